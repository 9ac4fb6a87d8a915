#!/usr/bin/env python3
"""Train the demo model shipped in ``topk_decode/demo_model/`` from scratch.

A small Llama-architecture causal LM (GQA, RoPE) trained on synthetic long-context retrieval
data that this project generates itself (``topk_decode/eval/tasks.py``): filler text in a made-up
language with RULER-style facts at random depths. Nothing is downloaded.

Subcommands (see docs/TRAINING.md for the exact commands that produced the shipped model):

    python tools/train_demo_model.py tokenizer --out topk_decode/demo_model
    python tools/train_demo_model.py train --tok topk_decode/demo_model --ckpt-out .ckpt/run1 \\
        --time-budget 500
    python tools/train_demo_model.py train ... --ckpt-in .ckpt/run1     # resume
    python tools/train_demo_model.py export --ckpt .ckpt/run2 --tok topk_decode/demo_model \\
        --out topk_decode/demo_model
    python tools/train_demo_model.py eval --model topk_decode/demo_model --lengths 4096 16384

Recipe (docs/DESIGN.md, "The demo model's training trap"; docs/TRAINING.md): small models
trained only on "answer the question at the end" plateau at "answer with any number in the
context" (accuracy about 1/number-of-facts). What gets past it here: dense supervision on every place where a value is
predictable — key→value facts that recur through the sequence (loss on the value at every
recurrence), several questions per sequence, and plain copy segments (loss on the repeat) that
grow induction heads early — plus a length curriculum driven by measured accuracy: the maximum
context length doubles only once the model answers >= 90% at the current one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from topk_decode.eval import tasks as T  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_model_data import _init_worker, _make_batch, build_tokenizer, load_fast_tokenizer, make_config  # noqa: E402
from demo_model_io import CHANCE, build_eval_set, demo, eval_tf, evaluate, export, load_ckpt, save_ckpt  # noqa: E402

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def train(a: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    t_start = time.time()
    torch.manual_seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tok_dir = Path(a.tok)
    tok = load_fast_tokenizer(tok_dir)
    cfg = make_config(tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD), a)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    meta = {"step": 0, "stage": 0, "history": [], "evals": [], "elapsed": 0.0, "runs": []}
    if a.ckpt_in:
        meta = load_ckpt(model, opt, Path(a.ckpt_in))
        print(f"resumed from {a.ckpt_in}: step {meta['step']} stage {meta['stage']}")
    if a.force_stage is not None:
        meta["stage"] = a.force_stage
    stages = [int(x) for x in a.stages.split(",")]
    print(
        f"device {device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}; "
        f"params {n_params / 1e6:.2f}M; vocab {cfg.vocab_size}; stages {stages}",
        flush=True,
    )
    meta["runs"].append(
        {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "args": vars(a),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "start_step": meta["step"],
        }
    )

    # ---------------- eval sets ----------------
    eval_cache: dict[tuple[str, int], list] = {}

    def eval_at(task: str, L: int, n: int) -> float:
        key = (task, L)
        if key not in eval_cache:
            eval_cache[key] = build_eval_set(tok, task, L, n, seed0=900_000 + 1000 * L)
        bs = max(1, a.eval_tokens // (L + 64))
        return eval_tf(model, eval_cache[key], device, bs)

    # ---------------- workers ----------------
    ctx = mp.get_context("spawn")  # workers never touch CUDA
    pool = ctx.Pool(a.workers, initializer=_init_worker, initargs=(str(tok_dir), a.seed + meta["step"]))
    req_seed = [a.seed * 10_000_000 + meta["step"] * 64]

    def choose_len() -> int:
        st = meta["stage"]
        Lmax = stages[min(st, len(stages) - 1)]
        u = random.random()
        if u < a.short_frac or st == 0:
            return stages[0] if st == 0 or random.random() < 0.5 else stages[min(1, st)]
        if u < a.short_frac + a.mid_frac and st >= 2:
            return stages[random.randint(1, st - 1)]
        return Lmax

    queue: deque = deque()

    def submit() -> None:
        L = choose_len()
        B = max(1, a.tokens_per_step // L)
        req_seed[0] += 1
        dense_frac = a.dense_frac if meta["stage"] == 0 else a.dense_frac_later
        queue.append((L, pool.apply_async(_make_batch, ((L, B, req_seed[0], dense_frac),))))

    for _ in range(a.prefetch):
        submit()

    train_budget = a.time_budget
    last_save = time.time()
    last_eval_step = meta["step"]
    t_loop = time.time()
    print(f"setup {t_loop - t_start:.1f}s", flush=True)
    tok_count = 0
    log_acc: dict[str, list] = {"loss": [], "ans_acc": [], "rec_acc": []}
    stage_steps = 0
    run_step0 = meta["step"]
    while True:
        elapsed = time.time() - t_start
        if elapsed > train_budget:
            break
        L, res = queue.popleft()
        ids_np, w_np = res.get()
        submit()
        ids = torch.from_numpy(ids_np).long().to(device, non_blocking=True)
        w = torch.from_numpy(w_np).to(device, non_blocking=True)
        # lr: warmup, then constant; optional linear decay over the last part of this run
        step = meta["step"]
        lr = a.lr * min(1.0, (step + 1) / a.warmup)
        if a.decay_frac > 0:
            frac = elapsed / train_budget
            start = 1 - a.decay_frac
            if frac > start:
                lr *= max(0.1, 1 - (frac - start) / a.decay_frac * 0.9)
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            h = model.model(input_ids=ids).last_hidden_state
        wt = w[:, 1:]
        sel = wt > 0
        hs = h[:, :-1][sel]
        tgt = ids[:, 1:][sel]
        ww = wt[sel]
        logits = model.lm_head(hs.float())  # fp32 logits, only where there is a loss
        ce = F.cross_entropy(logits, tgt, reduction="none")
        loss = (ce * ww).sum() / ww.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        meta["step"] += 1
        stage_steps += 1
        tok_count += ids.numel()
        with torch.no_grad():
            correct = logits.argmax(-1) == tgt
            ans = ww == 1.0
            cp = ww == 0.5
            log_acc["loss"].append(loss.item())
            log_acc["ans_acc"].append(correct[ans].float().mean().item() if ans.any() else float("nan"))
            log_acc["rec_acc"].append(correct[cp].float().mean().item() if cp.any() else float("nan"))
        if meta["step"] % a.log_every == 0:
            dt = time.time() - t_loop
            rec = {
                "step": meta["step"],
                "t": round(meta["elapsed"] + time.time() - t_start, 1),
                "L": L,
                "B": ids.shape[0],
                "stage": meta["stage"],
                "Lmax": stages[min(meta["stage"], len(stages) - 1)],
                "loss": round(float(np.mean(log_acc["loss"])), 4),
                "val_acc": round(float(np.nanmean(log_acc["ans_acc"])), 4),
                "copy_acc": round(float(np.nanmean(log_acc["rec_acc"])), 4),
                "lr": lr,
                "gn": round(float(gn), 3),
                "tok_s": int(tok_count / dt),
                "mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else 0,
            }
            meta["history"].append(rec)
            print(json.dumps(rec), flush=True)
            log_acc = {"loss": [], "ans_acc": [], "rec_acc": []}
        # curriculum eval
        if meta["step"] - last_eval_step >= a.eval_every:
            last_eval_step = meta["step"]
            st = meta["stage"]
            Lmax = stages[min(st, len(stages) - 1)]
            te = time.time()
            acc_s = eval_at("single_needle", Lmax, a.eval_n)
            acc_m = eval_at("multi_key", Lmax, a.eval_n)
            ev = {
                "step": meta["step"],
                "L": Lmax,
                "single_needle": acc_s,
                "multi_key": acc_m,
                "chance_multi_key_copy_any": 1 / T.MULTI_KEY_FACTS,
                "chance_uniform": 1 / 900,
                "eval_s": round(time.time() - te, 1),
            }
            meta["evals"].append(ev)
            print("EVAL " + json.dumps(ev), flush=True)
            if min(acc_s, acc_m) >= a.advance_at and stage_steps >= a.min_stage_steps and st < len(stages) - 1:
                meta["stage"] = st + 1
                stage_steps = 0
                print(f"==> stage {meta['stage']}: Lmax {stages[meta['stage']]}", flush=True)
                # drop prefetched batches of the old stage mix
                while len(queue) > 2:
                    queue.pop()
                while len(queue) < a.prefetch:
                    submit()
        if time.time() - last_save > a.save_every and a.ckpt_out:
            meta_s = dict(meta)
            meta_s["elapsed"] = meta["elapsed"] + time.time() - t_start
            save_ckpt(model, opt, meta_s, Path(a.ckpt_out))
            last_save = time.time()
    pool.terminate()
    meta["elapsed"] = meta["elapsed"] + time.time() - t_start
    meta["runs"][-1]["steps"] = meta["step"] - run_step0
    if a.ckpt_out:
        save_ckpt(model, opt, meta, Path(a.ckpt_out))
        print(f"saved {a.ckpt_out} at step {meta['step']}", flush=True)
    # final evals
    finals = {}
    for L in [int(x) for x in a.final_lengths.split(",") if x]:
        for task in T.TASKS:
            te = time.time()
            fails: list = []
            key = (task, L)
            if key not in eval_cache:
                eval_cache[key] = build_eval_set(tok, task, L, a.final_n, seed0=900_000 + 1000 * L)
            finals[f"{task}@{L}"] = eval_tf(model, eval_cache[key], device, max(1, a.eval_tokens // (L + 64)), fails)
            for pred, want in fails[:3]:
                print(f"   miss: want {tok.decode(want)!r} got {tok.decode(pred)!r}")
            print(
                f"FINAL {task}@{L}: {finals[f'{task}@{L}']:.3f} (chance {CHANCE[task]}) [{time.time() - te:.1f}s]",
                flush=True,
            )
    meta["final_tf"] = finals
    if a.ckpt_out:
        (Path(a.ckpt_out) / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"total {time.time() - t_start:.1f}s", flush=True)


# =============================================================================================
# Export and evaluation with plain HF generate
# =============================================================================================


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def model_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--hidden", type=int, default=256)
        q.add_argument("--ffn", type=int, default=768)
        q.add_argument("--layers", type=int, default=4)
        q.add_argument("--heads", type=int, default=8)
        q.add_argument("--kv-heads", dest="kv_heads", type=int, default=2)
        q.add_argument("--rope-theta", dest="rope_theta", type=float, default=1_000_000.0)

    q = sub.add_parser("tokenizer", help="build the byte-level BPE tokenizer")
    q.add_argument("--out", default=str(ROOT / "topk_decode" / "demo_model"))
    q.add_argument("--bpe-vocab", type=int, default=2000)

    q = sub.add_parser("train", help="train (or resume) on synthetic data")
    model_args(q)
    q.add_argument("--tok", default=str(ROOT / "topk_decode" / "demo_model"))
    q.add_argument("--ckpt-in", dest="ckpt_in", default=None)
    q.add_argument("--ckpt-out", dest="ckpt_out", default=None)
    q.add_argument(
        "--time-budget",
        dest="time_budget",
        type=float,
        default=500.0,
        help="seconds of training from process start (evals/saves included)",
    )
    q.add_argument("--stages", default="512,1024,2048,4096,8192,16384")
    q.add_argument("--force-stage", dest="force_stage", type=int, default=None)
    q.add_argument("--tokens-per-step", dest="tokens_per_step", type=int, default=131072)
    q.add_argument("--lr", type=float, default=2e-3)
    q.add_argument("--wd", type=float, default=0.01)
    q.add_argument("--warmup", type=int, default=200)
    q.add_argument("--decay-frac", dest="decay_frac", type=float, default=0.0)
    q.add_argument("--short-frac", dest="short_frac", type=float, default=0.25)
    q.add_argument("--mid-frac", dest="mid_frac", type=float, default=0.25)
    q.add_argument(
        "--dense-frac",
        dest="dense_frac",
        type=float,
        default=0.7,
        help="fraction of dense (mostly-facts) sequences in stage 0",
    )
    q.add_argument("--dense-frac-later", dest="dense_frac_later", type=float, default=0.25)
    q.add_argument("--advance-at", dest="advance_at", type=float, default=0.9)
    q.add_argument("--min-stage-steps", dest="min_stage_steps", type=int, default=50)
    q.add_argument("--eval-every", dest="eval_every", type=int, default=100)
    q.add_argument("--eval-n", dest="eval_n", type=int, default=32)
    q.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=262144)
    q.add_argument("--final-lengths", dest="final_lengths", default="")
    q.add_argument("--final-n", dest="final_n", type=int, default=64)
    q.add_argument("--save-every", dest="save_every", type=float, default=120.0)
    q.add_argument("--log-every", dest="log_every", type=int, default=25)
    q.add_argument("--workers", type=int, default=12)
    q.add_argument("--prefetch", type=int, default=24)
    q.add_argument("--seed", type=int, default=1234)
    q.add_argument("--cpu", action="store_true")

    q = sub.add_parser("export", help="write the HF model directory from a checkpoint")
    model_args(q)
    q.add_argument("--ckpt", required=True)
    q.add_argument("--tok", default=str(ROOT / "topk_decode" / "demo_model"))
    q.add_argument("--out", default=str(ROOT / "topk_decode" / "demo_model"))

    q = sub.add_parser("eval", help="accuracy with plain HF generate (dense attention)")
    q.add_argument("--model", default=str(ROOT / "topk_decode" / "demo_model"))
    q.add_argument("--tasks", nargs="+", default=list(T.TASKS))
    q.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    q.add_argument("--n", type=int, default=50)
    q.add_argument("--seed", type=int, default=5_000_000)
    q.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=24)
    q.add_argument(
        "--format",
        choices=["task", "chat"],
        default="task",
        help="task: the TaskInstance question; chat: '\\nQuestion: ...\\nAnswer:' as topk chat asks",
    )
    q.add_argument(
        "--max-seconds",
        dest="max_seconds",
        type=float,
        default=0.0,
        help="per (task, length): stop early after this many seconds (0: never)",
    )
    q.add_argument("--bf16", action="store_true")
    q.add_argument("--cpu", action="store_true")
    q.add_argument("--verbose", action="store_true")
    q.add_argument("--json-out", dest="json_out", default=None)

    q = sub.add_parser("demo", help="ask the example questions over examples/docs (HF generate)")
    q.add_argument("--model", default=str(ROOT / "topk_decode" / "demo_model"))
    q.add_argument("--docs", default=str(ROOT / "examples" / "docs"))
    q.add_argument(
        "--questions",
        nargs="+",
        default=[
            "What is the special magic number for amber-fox?",
            "482",
            "What is the special magic number for silver-owl?",
            "731",
            "What is the special magic number for quiet-lynx?",
            "219",
            "Which number does variable brave-otter equal?",
            "calm-heron, which equals 365",
        ],
    )
    q.add_argument("--cpu", action="store_true")

    a = p.parse_args()
    if a.cmd == "tokenizer":
        build_tokenizer(Path(a.out), a.bpe_vocab)
    elif a.cmd == "train":
        train(a)
    elif a.cmd == "export":
        export(a)
    elif a.cmd == "eval":
        evaluate(a)
    elif a.cmd == "demo":
        demo(a)


if __name__ == "__main__":
    main()
