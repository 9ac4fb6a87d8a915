#!/usr/bin/env python3
"""Train the demo model shipped in ``topk_decode/demo_model/`` from scratch.

A small Llama-architecture causal LM (GQA, RoPE) trained on synthetic long-context retrieval
data that this project generates itself (``topk_decode/eval/tasks.py``): filler text in a made-up
language with RULER-style facts at random depths. Nothing is downloaded.

Subcommands (see docs/TRAINING.md for the exact commands that produced the shipped model):

    python scripts/train_demo_model.py tokenizer --out topk_decode/demo_model
    python scripts/train_demo_model.py train --tok topk_decode/demo_model --ckpt-out .ckpt/run1 \\
        --time-budget 500
    python scripts/train_demo_model.py train ... --ckpt-in .ckpt/run1     # resume
    python scripts/train_demo_model.py export --ckpt .ckpt/run2 --tok topk_decode/demo_model \\
        --out topk_decode/demo_model
    python scripts/train_demo_model.py eval --model topk_decode/demo_model --lengths 4096 16384

Recipe (DESIGN.md, "Training the demo model"): small models trained only on "answer the
question at the end" plateau at "answer with any number in the context" (accuracy about
1/number-of-facts). What gets past it here: dense supervision on every place where a value is
predictable — key→value facts that recur through the sequence (loss on the value at every
recurrence), several questions per sequence, and plain copy segments (loss on the repeat) that
grow induction heads early — plus a length curriculum driven by measured accuracy: the maximum
context length doubles only once the model answers >= 90% at the current one.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
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

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


# =============================================================================================
# Tokenizer
# =============================================================================================

def build_tokenizer(out: Path, bpe_vocab: int = 2000, seed: int = 0) -> None:
    """Byte-level BPE trained on generated text, plus one token per three-digit value.

    Args:
        out: directory to write tokenizer.json / tokenizer_config.json / special_tokens_map.json.
        bpe_vocab: size of the trained part of the vocabulary (specials and bytes included).
        seed: seed of the training text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    g = T.grammar()
    texts: list[str] = []
    for _ in range(4000):
        texts.append("".join(g.sentence(rng) for _ in range(20)))
    keys = [f"{a}-{b}" for a in T.ADJECTIVES for b in T.ANIMALS]
    for i in range(0, len(keys), 4):
        chunk = keys[i:i + 4]
        texts.append("".join(T.magic_fact(k, "") + T.magic_question(k) for k in chunk))
        texts.append("".join(T.multi_value_fact(k, "") + T.multi_value_question(k) for k in chunk))
        texts.append("".join(T.vt_fact(k, "") + T.vt_question(k) + ", which equals" for k in chunk))
    # No digits in the BPE training text: number tokens are added below, one per value.
    assert not any(c.isdigit() for t in texts for c in t)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)

    d = json.loads(tok.to_str())
    vocab: dict[str, int] = d["model"]["vocab"]
    merges = d["model"]["merges"]
    as_pairs = bool(merges) and isinstance(merges[0], list)

    def add_merge(a: str, b: str) -> None:
        if a + b in vocab:
            return
        vocab[a + b] = len(vocab)
        merges.append([a, b] if as_pairs else f"{a} {b}")

    sp = "\u0120"  # byte-level BPE's visible space
    lo, hi = T.VALUE_RANGE
    for v in range(lo, hi + 1):
        s = str(v)
        add_merge(sp, s[0])
        for i in range(1, len(s)):
            add_merge(sp + s[:i], s[i])
    d["model"]["vocab"] = vocab
    d["model"]["merges"] = merges
    tok = Tokenizer.from_str(json.dumps(d))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=65536)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # Sanity: values are single tokens and decode back.
    for v in (lo, 482, hi):
        ids = tok.encode(f" {v}", add_special_tokens=False).ids
        assert len(ids) == 1 and tok.decode(ids).strip() == str(v), (v, ids)
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {out}")


def load_fast_tokenizer(tok_dir: Path):
    """The raw ``tokenizers.Tokenizer`` of a saved tokenizer directory."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


# =============================================================================================
# Model
# =============================================================================================

def make_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int, a: argparse.Namespace):
    """The LlamaConfig of the demo model."""
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": float(a.rope_theta)},
        rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        attention_dropout=0.0, initializer_range=0.02,
    )


# =============================================================================================
# Training data (runs in worker processes)
# =============================================================================================

class SequenceBuilder:
    """Builds training sequences of an exact token length with per-token loss weights.

    A sequence is ``[bos] + context + QA*``: the context is filler (slices of a pre-tokenized
    stream) with items inserted at random offsets; the QA part is one or more questions, each
    followed by its answer, the last one by EOS. Items are

    * key→number facts (``magic_fact``), each appearing 1–3 times: loss on the number at every
      occurrence after the first (the recurring pairs of DESIGN.md);
    * sometimes a multi-value group and two variable-tracking chains (loss on their recurring
      VT facts too);
    * copy segments: a filler slice or random tokens, repeated right after or later in the
      sequence (loss on the repeat);

    and the answers get the loss (weight 1). ``weights[t] > 0`` means token ``ids[t]`` is
    predicted (from position ``t-1``) with that weight.
    """

    def __init__(self, tok_dir: str, seed: int, stream_tokens: int = 1_500_000) -> None:
        self.tok = load_fast_tokenizer(Path(tok_dir))
        self.bos = self.tok.token_to_id(BOS)
        self.eos = self.tok.token_to_id(EOS)
        self.vocab = self.tok.get_vocab_size()
        self.equals_id = self.tok.encode(" equals", add_special_tokens=False).ids[0]
        assert len(self.tok.encode(" equals", add_special_tokens=False).ids) == 1
        self.rng = random.Random(seed)
        self.nrng = np.random.default_rng(seed)
        g = T.grammar()
        ids: list[int] = []
        while len(ids) < stream_tokens:
            batch = ["".join(g.sentence(self.rng) for _ in range(16)) for _ in range(256)]
            for e in self.tok.encode_batch(batch, add_special_tokens=False):
                ids.extend(e.ids)
        self.stream = np.asarray(ids, dtype=np.int32)

    def enc(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32)
                for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def filler(self, n: int) -> np.ndarray:
        s = self.rng.randrange(0, len(self.stream) - n - 1)
        return self.stream[s:s + n]

    def build(self, L: int, dense: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One sequence of exactly ``L`` tokens: (ids, loss weights).

        ``dense`` (the first curriculum stage): mostly facts, little filler, more recurrences.
        """
        r = self.rng
        # ---------------- facts -------------------------------------------------------------
        if dense:
            n_magic = r.randint(4, max(5, min(160, L // 24)))
        else:
            n_magic = r.randint(2, max(3, min(64, L // 64)))
        keys = T.random_keys(r, n_magic + 2 * T.VT_CHAIN + 1, hard=r.random() < 0.6)
        r.shuffle(keys)
        magic_keys, rest = keys[:n_magic], keys[n_magic:]
        values = T.random_values(r, n_magic + T.MULTI_VALUE_COUNT + 2)
        # item: dict(group, text|ids, kind, protected); group >= 0 -> recurring group
        items: list[dict] = []
        gid = 0
        n_q = r.randint(1, 3) if L <= 1024 else r.randint(2, 4 if L <= 4096 else 8)
        asked = set(range(min(n_q, n_magic)))
        qa: list[tuple[str, object]] = []  # (question, answer or "MV")
        for i, (k, v) in enumerate(zip(magic_keys, values)):
            reps = 1 + (r.random() < 0.5) + (r.random() < 0.25) + (dense and r.random() < 0.5)
            for j in range(reps):
                items.append(dict(group=gid, text=T.magic_fact(k, v), kind="magic",
                                  protected=(i in asked and j == 0)))
            gid += 1
            if i in asked:
                qa.append(("single_needle", k, str(v)))
        if L >= 1024 and r.random() < 0.5:  # multi-value group (asked)
            mk = rest[0]
            mvals = values[n_magic:n_magic + r.randint(2, T.MULTI_VALUE_COUNT)]
            for v in mvals:
                items.append(dict(group=-1, text=T.multi_value_fact(mk, v), kind="mv",
                                  protected=True, value=str(v)))
            qa.append(("multi_value", mk, "MV"))
        if L >= 1024 and r.random() < 0.3:  # two variable-tracking chains, first one asked
            n = r.randint(2, T.VT_CHAIN)
            c1, c2 = rest[1:1 + n], rest[1 + T.VT_CHAIN:1 + T.VT_CHAIN + n]
            for ci, (chain, val) in enumerate(((c1, values[-1]), (c2, values[-2]))):
                for i, var in enumerate(chain):
                    reps = 1 + (r.random() < 0.3)
                    for j in range(reps):
                        items.append(dict(group=gid, text=T.vt_fact(var, val if i == 0 else chain[i - 1]),
                                          kind="vt", protected=(ci == 0 and j == 0)))
                    gid += 1
            qa.append(("variable_tracking", c1[-1], T.vt_answer(c1, values[-1])))
        r.shuffle(qa)
        # encode fact texts
        encs = self.enc([it["text"] for it in items])
        for it, e in zip(items, encs):
            it["ids"] = e
            sup = np.zeros(len(e), dtype=np.float32)
            if it["kind"] == "magic":
                sup[-2] = 1.0  # the number (before ".")
            elif it["kind"] == "vt":
                # everything after "equals" (a number or a variable name), not the final "."
                k = int(np.nonzero(e == self.equals_id)[0][0])
                sup[k + 1:-1] = 1.0
            it["sup"] = sup
        # document separators as `topk prefill` writes them (no loss)
        if r.random() < 0.3:
            g = T.grammar()
            for _ in range(r.randint(1, 4)):
                name = f"{r.choice(g.nouns)}_{r.randint(1, 99)}.{r.choice(('txt', 'md'))}"
                items.append(dict(group=-4, ids=self.enc([f"\n\n### Document: {name}\n\n"])[0],
                                  kind="header", protected=False, sup=None))
        # copy segments (loss on the repeat)
        if r.random() < 0.8:
            for _ in range(r.randint(1, 3 if L <= 2048 else 6)):
                n = r.randint(8, 48)
                seg = (self.filler(n) if r.random() < 0.5
                       else self.nrng.integers(3, self.vocab, size=n, dtype=np.int32))
                sup = np.full(n, 0.5, dtype=np.float32)
                sup[0] = 0.0
                if r.random() < 0.5:  # immediate repeat: one item, weights fixed
                    items.append(dict(group=-3, ids=np.concatenate([seg, seg]), kind="copy",
                                      protected=False,
                                      sup=np.concatenate([np.zeros(n, np.float32), sup])))
                else:  # repeat later: a recurring group of two
                    for _j in range(2):
                        items.append(dict(group=gid, ids=seg, kind="copy", protected=False, sup=sup))
                    gid += 1
        r.shuffle(items)  # context order
        # ---------------- QA tokens (multi-value answer = values in context order) ----------
        # Two question formats: the eval format of tasks.py (question ends with the answer's
        # fixed start, loss on the answer) and the `topk chat` format ("...\nAnswer:", loss on
        # the whole answer sentence; the copied fixed start gets weight 0.9).
        mv_order = [it["value"] for it in items if it["kind"] == "mv"]
        qs, ans, pre = [], [], []
        for task, key, a_ in qa:
            a_ = ", ".join(mv_order) if a_ == "MV" else str(a_)
            if r.random() < 0.5:
                qs.append({"single_needle": T.magic_question, "multi_value": T.multi_value_question,
                           "variable_tracking": T.vt_question}[task](key))
                pre.append("")
            else:
                question, prefix = T.chat_query(task, key)
                qs.append(f"\nQuestion: {question}\nAnswer:")
                pre.append(" " + prefix)
            ans.append(" " + a_ + ".")
        e = self.enc(qs + pre + ans)
        n_ = len(qs)
        q_ids, p_ids, a_ids = e[:n_], e[n_:2 * n_], e[2 * n_:]
        qa_len = sum(len(x) for x in e) + 1
        ctx_len = L - 1 - qa_len
        # drop unprotected items until items take at most 60% (dense: 85%) of the context
        cap = 0.85 if dense else 0.6
        while sum(len(it["ids"]) for it in items) > cap * ctx_len:
            cand = [i for i, it in enumerate(items) if not it["protected"]]
            if not cand:
                break
            items.pop(r.choice(cand))
        item_len = sum(len(it["ids"]) for it in items)
        assert item_len <= ctx_len, (L, item_len, ctx_len)
        free = ctx_len - item_len
        cuts = sorted(r.randint(0, free) for _ in range(len(items)))
        gaps = [b - a_ for a_, b in zip([0] + cuts, cuts + [free])]
        ids = [np.asarray([self.bos], np.int32)]
        wts = [np.zeros(1, np.float32)]
        seen: set[int] = set()
        for gap, it in zip(gaps, items):
            if gap:
                ids.append(self.filler(gap))
                wts.append(np.zeros(gap, np.float32))
            ids.append(it["ids"])
            g = it["group"]
            if g == -4:
                wts.append(np.zeros(len(it["ids"]), np.float32))
            elif g == -3 or (g >= 0 and g in seen):
                wts.append(it["sup"])
            else:
                wts.append(np.zeros(len(it["ids"]), np.float32))
            if g >= 0:
                seen.add(g)
        if gaps[-1]:
            ids.append(self.filler(gaps[-1]))
            wts.append(np.zeros(gaps[-1], np.float32))
        for q, p_, a_ in zip(q_ids, p_ids, a_ids):
            ids.append(q)
            wts.append(np.zeros(len(q), np.float32))
            if len(p_):
                ids.append(p_)
                wts.append(np.full(len(p_), 0.9, np.float32))
            ids.append(a_)
            wa = np.ones(len(a_), np.float32)
            if len(a_) == 2:
                wa[-1] = 0.3  # "." after a single value (weight 1.0 marks retrieval, for logging)
            wts.append(wa)
        ids.append(np.asarray([self.eos], np.int32))
        wts.append(np.full(1, 0.3, np.float32))
        ids_a = np.concatenate(ids)
        w_a = np.concatenate(wts)
        assert len(ids_a) == L, (len(ids_a), L)
        return ids_a, w_a

    def batch(self, L: int, B: int, dense_frac: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        out = [self.build(L, dense=self.rng.random() < dense_frac) for _ in range(B)]
        return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


_WORKER: SequenceBuilder | None = None


def _init_worker(tok_dir: str, base_seed: int) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER = SequenceBuilder(tok_dir, base_seed)  # same filler stream in every worker


def _make_batch(args: tuple[int, int, int, float]) -> tuple[np.ndarray, np.ndarray]:
    L, B, s, dense_frac = args
    assert _WORKER is not None
    _WORKER.rng.seed(s)
    _WORKER.nrng = np.random.default_rng(s)
    return _WORKER.batch(L, B, dense_frac)


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
            chunk = items[i:i + bs]
            seqs = [p + a for p, a in chunk]
            Lm = max(len(s) for s in seqs)
            x = torch.zeros(len(seqs), Lm, dtype=torch.long)
            for j, s in enumerate(seqs):
                x[j, :len(s)] = torch.tensor(s)
            x = x.to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                                enabled=device.type == "cuda"):
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
    cfg = make_config(tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS),
                      tok.token_to_id(PAD), a)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    meta = {"step": 0, "stage": 0, "history": [], "evals": [], "elapsed": 0.0, "runs": []}
    if a.ckpt_in:
        meta = load_ckpt(model, opt, Path(a.ckpt_in))
        print(f"resumed from {a.ckpt_in}: step {meta['step']} stage {meta['stage']}")
    if a.force_stage is not None:
        meta["stage"] = a.force_stage
    stages = [int(x) for x in a.stages.split(",")]
    print(f"device {device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}; "
          f"params {n_params/1e6:.2f}M; vocab {cfg.vocab_size}; stages {stages}", flush=True)
    meta["runs"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a),
                         "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                         "start_step": meta["step"]})

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
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                            enabled=device.type == "cuda"):
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
            correct = (logits.argmax(-1) == tgt)
            ans = ww == 1.0
            cp = ww == 0.5
            log_acc["loss"].append(loss.item())
            log_acc["ans_acc"].append(correct[ans].float().mean().item() if ans.any() else float("nan"))
            log_acc["rec_acc"].append(correct[cp].float().mean().item() if cp.any() else float("nan"))
        if meta["step"] % a.log_every == 0:
            dt = time.time() - t_loop
            rec = {"step": meta["step"], "t": round(meta["elapsed"] + time.time() - t_start, 1),
                   "L": L, "B": ids.shape[0], "stage": meta["stage"],
                   "Lmax": stages[min(meta['stage'], len(stages) - 1)],
                   "loss": round(float(np.mean(log_acc["loss"])), 4),
                   "val_acc": round(float(np.nanmean(log_acc["ans_acc"])), 4),
                   "copy_acc": round(float(np.nanmean(log_acc["rec_acc"])), 4),
                   "lr": lr, "gn": round(float(gn), 3), "tok_s": int(tok_count / dt),
                   "mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1)
                   if device.type == "cuda" else 0}
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
            ev = {"step": meta["step"], "L": Lmax, "single_needle": acc_s, "multi_key": acc_m,
                  "chance_multi_key_copy_any": 1 / T.MULTI_KEY_FACTS, "chance_uniform": 1 / 900,
                  "eval_s": round(time.time() - te, 1)}
            meta["evals"].append(ev)
            print("EVAL " + json.dumps(ev), flush=True)
            if (min(acc_s, acc_m) >= a.advance_at and stage_steps >= a.min_stage_steps
                    and st < len(stages) - 1):
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
            finals[f"{task}@{L}"] = eval_tf(model, eval_cache[key], device,
                                            max(1, a.eval_tokens // (L + 64)), fails)
            for pred, want in fails[:3]:
                print(f"   miss: want {tok.decode(want)!r} got {tok.decode(pred)!r}")
            print(f"FINAL {task}@{L}: {finals[f'{task}@{L}']:.3f} (chance {CHANCE[task]}) "
                  f"[{time.time() - te:.1f}s]", flush=True)
    meta["final_tf"] = finals
    if a.ckpt_out:
        (Path(a.ckpt_out) / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"total {time.time() - t_start:.1f}s", flush=True)


# =============================================================================================
# Export and evaluation with plain HF generate
# =============================================================================================

def export(a: argparse.Namespace) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM
    ckpt = Path(a.ckpt)
    tok = load_fast_tokenizer(Path(a.tok))
    cfg = make_config(tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS),
                      tok.token_to_id(PAD), a)
    model = LlamaForCausalLM(cfg)
    sd = load_weights(ckpt)
    model.load_state_dict(sd)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id, do_sample=False, max_new_tokens=32)
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
    model = AutoModelForCausalLM.from_pretrained(
        a.model, local_files_only=True,
        dtype=torch.bfloat16 if a.bf16 else torch.float32).to(device).eval()
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
                    key = (question.split("variable ", 1)[1].split(" equal?", 1)[0]
                           if task == "variable_tracking"
                           else question.split(" for ", 1)[1].split("?", 1)[0])
                    q, prefix = T.chat_query(task, key)
                    question = f"\nQuestion: {q}\nAnswer:"
                    want = f"{prefix} {inst.answer}"
                ids = ([tk.bos_token_id] + tk(inst.context, add_special_tokens=False).input_ids
                       + tk(question, add_special_tokens=False).input_ids)
                x = torch.tensor([ids], device=device)
                with torch.no_grad():
                    y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=a.max_new_tokens,
                                       pad_token_id=tk.pad_token_id)
                text = tk.decode(y[0, len(ids):], skip_special_tokens=True).strip()
                good = text.startswith(want)
                ok += good
                if a.verbose and not good:
                    print(f"  miss {task}@{L} seed {a.seed + i} depth {depth}: "
                          f"want {want!r} got {text!r}")
            acc = ok / max(1, n_done)
            results[f"{task}@{L}"] = acc
            print(f"{task:18s} L={L:6d} acc={acc:.3f} ({ok}/{n_done})  chance: {CHANCE[task]}  "
                  f"[{time.time() - t0:.1f}s]", flush=True)
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
    model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True,
                                                 dtype=torch.float32).to(device).eval()
    files = sorted(p for p in Path(a.docs).rglob("*") if p.suffix in (".txt", ".md"))
    ids = [tk.bos_token_id]
    for f in files:
        head = f"\n\n### Document: {f.relative_to(a.docs)}\n\n" if len(files) > 1 else ""
        ids += tk(head + f.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    print(f"context: {len(ids)} tokens from {len(files)} documents")
    ok = 0
    for q, want in zip(a.questions[0::2], a.questions[1::2]):
        x = torch.tensor([ids + tk(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False).input_ids],
                         device=device)
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=32, pad_token_id=tk.pad_token_id)
        text = tk.decode(y[0, x.shape[1]:], skip_special_tokens=True).strip()
        good = want in text
        ok += good
        print(f"{'OK ' if good else 'BAD'} Q: {q!r} -> {text!r} (expected {want!r})")
    print(f"{ok}/{len(a.questions) // 2} demo questions answered")


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
    q.add_argument("--time-budget", dest="time_budget", type=float, default=500.0,
                   help="seconds of training from process start (evals/saves included)")
    q.add_argument("--stages", default="512,1024,2048,4096,8192,16384")
    q.add_argument("--force-stage", dest="force_stage", type=int, default=None)
    q.add_argument("--tokens-per-step", dest="tokens_per_step", type=int, default=131072)
    q.add_argument("--lr", type=float, default=2e-3)
    q.add_argument("--wd", type=float, default=0.01)
    q.add_argument("--warmup", type=int, default=200)
    q.add_argument("--decay-frac", dest="decay_frac", type=float, default=0.0)
    q.add_argument("--short-frac", dest="short_frac", type=float, default=0.25)
    q.add_argument("--mid-frac", dest="mid_frac", type=float, default=0.25)
    q.add_argument("--dense-frac", dest="dense_frac", type=float, default=0.7,
                   help="fraction of dense (mostly-facts) sequences in stage 0")
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
    q.add_argument("--format", choices=["task", "chat"], default="task",
                   help="task: the TaskInstance question; chat: '\\nQuestion: ...\\nAnswer:' as topk chat asks")
    q.add_argument("--max-seconds", dest="max_seconds", type=float, default=0.0,
                   help="per (task, length): stop early after this many seconds (0: never)")
    q.add_argument("--bf16", action="store_true")
    q.add_argument("--cpu", action="store_true")
    q.add_argument("--verbose", action="store_true")
    q.add_argument("--json-out", dest="json_out", default=None)

    q = sub.add_parser("demo", help="ask the example questions over examples/docs (HF generate)")
    q.add_argument("--model", default=str(ROOT / "topk_decode" / "demo_model"))
    q.add_argument("--docs", default=str(ROOT / "examples" / "docs"))
    q.add_argument("--questions", nargs="+", default=[
        "What is the special magic number for amber-fox?", "482",
        "What is the special magic number for silver-owl?", "731",
        "What is the special magic number for quiet-lynx?", "219",
        "Which number does variable brave-otter equal?", "calm-heron, which equals 365"])
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
