"""Evaluation sets, teacher-forced accuracy, checkpoints, and the export / eval / demo subcommands
of train_demo_model.py."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from topk_decode.eval import tasks as T  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_model_data import load_fast_tokenizer, make_config  # noqa: E402

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


# =============================================================================================
# Evaluation (teacher-forced greedy check; equals greedy generation of the answer tokens)
# =============================================================================================

CHANCE = {
    "single_needle": "uniform 1/900; copy-any-number-in-context 1/1",
    "multi_key": f"uniform 1/900; copy-any-number-in-context 1/{T.MULTI_KEY_FACTS}",
    "multi_value": f"uniform (1/900)^{T.MULTI_VALUE_COUNT}; right numbers, random order "
    f"1/{math.factorial(T.MULTI_VALUE_COUNT)}",
    "variable_tracking": "uniform 1/900 per hop; right chain vs distractor chain 1/2",
}


def build_eval_set(tok, task: str, length: int, n: int, seed0: int):
    """Token ids (prompt, answer) of n instances at evenly spread depths."""
    bos = tok.token_to_id(BOS)
    out = []
    for i in range(n):
        depth = (i + 0.5) / n
        inst = T.make_instance(task, length, round(depth, 4), seed0 + i, tok)
        c = tok.encode(inst.context, add_special_tokens=False).ids
        q = tok.encode(inst.question, add_special_tokens=False).ids
        a = tok.encode(" " + inst.answer, add_special_tokens=False).ids
        out.append(([bos] + c + q, a))
    return out


def eval_tf(model, items, device, bs: int, fails: list | None = None) -> float:
    """Fraction of items whose answer tokens are all the argmax (teacher forcing)."""
    import torch

    correct = 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(items), bs):
            chunk = items[i : i + bs]
            seqs = [p + a for p, a in chunk]
            Lm = max(len(s) for s in seqs)
            x = torch.zeros(len(seqs), Lm, dtype=torch.long)
            for j, s in enumerate(seqs):
                x[j, : len(s)] = torch.tensor(s)
            x = x.to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                h = model.model(input_ids=x).last_hidden_state
            for j, (p, a) in enumerate(chunk):
                pos = torch.arange(len(p) - 1, len(p) - 1 + len(a), device=device)
                logits = model.lm_head(h[j, pos].float())
                pred = logits.argmax(-1).tolist()
                correct += int(pred == a)
                if fails is not None and pred != a:
                    fails.append((pred, a))
    model.train()
    return correct / max(1, len(items))


# =============================================================================================
# Training loop
# =============================================================================================


def save_ckpt(model, opt, meta: dict, out: Path) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    # shards of <= ~6 MB: files coming back from the GPU machine are size-limited
    shards: list[dict] = [{}]
    size = 0
    for k, v in sd.items():
        nb = v.numel() * 4
        if size + nb > 6_000_000 and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nb
    for old in out.glob("model_*.pt"):
        old.unlink()
    for i, sh in enumerate(shards):
        torch.save(sh, out / f"model_{i}.pt.tmp")
        os.replace(out / f"model_{i}.pt.tmp", out / f"model_{i}.pt")
    st = opt.state_dict()
    m = {k: v["exp_avg"].to(torch.bfloat16).cpu() for k, v in st["state"].items()}
    s = {k: v["exp_avg_sq"].to(torch.bfloat16).cpu() for k, v in st["state"].items()}
    steps = {k: float(v["step"]) for k, v in st["state"].items()}
    torch.save({"m": m, "steps": steps}, out / "opt_m.pt.tmp")
    os.replace(out / "opt_m.pt.tmp", out / "opt_m.pt")
    torch.save({"s": s}, out / "opt_v.pt.tmp")
    os.replace(out / "opt_v.pt.tmp", out / "opt_v.pt")
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def load_weights(inp: Path) -> dict:
    """The fp32 state dict of a checkpoint directory (model_*.pt shards)."""
    import torch

    sd: dict = {}
    for f in sorted(inp.glob("model_*.pt")):
        sd.update(torch.load(f, map_location="cpu"))
    if not sd:
        raise FileNotFoundError(f"no model_*.pt in {inp}")
    return sd


def load_ckpt(model, opt, inp: Path) -> dict:
    import torch

    model.load_state_dict(load_weights(inp))
    meta = json.loads((inp / "meta.json").read_text())
    if (inp / "opt_m.pt").exists() and (inp / "opt_v.pt").exists():
        m = torch.load(inp / "opt_m.pt", map_location="cpu")
        s = torch.load(inp / "opt_v.pt", map_location="cpu")
        st = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        for k in m["m"]:
            k_i = int(k)
            p = params[k_i]
            st["state"][k_i] = {
                "step": torch.tensor(m["steps"][k]),
                "exp_avg": m["m"][k].float().to(p.device),
                "exp_avg_sq": s["s"][k].float().to(p.device),
            }
        opt.load_state_dict(st)
    return meta


def export(a: argparse.Namespace) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    ckpt = Path(a.ckpt)
    tok = load_fast_tokenizer(Path(a.tok))
    cfg = make_config(tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD), a)
    model = LlamaForCausalLM(cfg)
    sd = load_weights(ckpt)
    model.load_state_dict(sd)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    if Path(a.tok).resolve() != out.resolve():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(a.tok).save_pretrained(str(out))
    print(f"exported {ckpt} -> {out}")


def evaluate(a: argparse.Namespace) -> None:
    """Accuracy with plain HF ``generate`` (dense attention), greedy, fp32 unless --bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    tk = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    model = (
        AutoModelForCausalLM.from_pretrained(
            a.model, local_files_only=True, dtype=torch.bfloat16 if a.bf16 else torch.float32
        )
        .to(device)
        .eval()
    )
    results = {}
    for L in a.lengths:
        for task in a.tasks:
            ok = 0
            t0 = time.time()
            n_done = 0
            for i in range(a.n):
                if a.max_seconds and time.time() - t0 > a.max_seconds:
                    break
                n_done += 1
                depth = round((i + 0.5) / a.n, 4)
                inst = T.make_instance(task, L, depth, a.seed + i, tk)
                question, want = inst.question, inst.answer
                if a.format == "chat":  # as `topk chat` asks: "\nQuestion: ...\nAnswer:"
                    key = (
                        question.split("variable ", 1)[1].split(" equal?", 1)[0]
                        if task == "variable_tracking"
                        else question.split(" for ", 1)[1].split("?", 1)[0]
                    )
                    q, prefix = T.chat_query(task, key)
                    question = f"\nQuestion: {q}\nAnswer:"
                    want = f"{prefix} {inst.answer}"
                ids = (
                    [tk.bos_token_id]
                    + tk(inst.context, add_special_tokens=False).input_ids
                    + tk(question, add_special_tokens=False).input_ids
                )
                x = torch.tensor([ids], device=device)
                with torch.no_grad():
                    y = model.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        do_sample=False,
                        max_new_tokens=a.max_new_tokens,
                        pad_token_id=tk.pad_token_id,
                    )
                text = tk.decode(y[0, len(ids) :], skip_special_tokens=True).strip()
                good = text.startswith(want)
                ok += good
                if a.verbose and not good:
                    print(f"  miss {task}@{L} seed {a.seed + i} depth {depth}: want {want!r} got {text!r}")
            acc = ok / max(1, n_done)
            results[f"{task}@{L}"] = acc
            print(
                f"{task:18s} L={L:6d} acc={acc:.3f} ({ok}/{n_done})  chance: {CHANCE[task]}  [{time.time() - t0:.1f}s]",
                flush=True,
            )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))


def demo(a: argparse.Namespace) -> None:
    """Ask the examples/QUESTIONS.md questions over examples/docs with plain HF generate.

    The context is laid out as ``topk prefill`` does it: ``[bos]`` then, per document (sorted by
    name), ``tokenize("\n\n### Document: NAME\n\n" + text)``; the question is appended as
    ``topk chat`` does: ``"\nQuestion: {question}\nAnswer:"``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    tk = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True, dtype=torch.float32).to(device).eval()
    files = sorted(p for p in Path(a.docs).rglob("*") if p.suffix in (".txt", ".md"))
    ids = [tk.bos_token_id]
    for f in files:
        head = f"\n\n### Document: {f.relative_to(a.docs)}\n\n" if len(files) > 1 else ""
        ids += tk(head + f.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    print(f"context: {len(ids)} tokens from {len(files)} documents")
    ok = 0
    for q, want in zip(a.questions[0::2], a.questions[1::2]):
        x = torch.tensor([ids + tk(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False).input_ids], device=device)
        with torch.no_grad():
            y = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32, pad_token_id=tk.pad_token_id
            )
        text = tk.decode(y[0, x.shape[1] :], skip_special_tokens=True).strip()
        good = want in text
        ok += good
        print(f"{'OK ' if good else 'BAD'} Q: {q!r} -> {text!r} (expected {want!r})")
    print(f"{ok}/{len(a.questions) // 2} demo questions answered")
