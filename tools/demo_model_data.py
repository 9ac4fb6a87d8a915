"""Tokenizer, model config and synthetic training sequences of the demo model (see train_demo_model.py)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
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
        chunk = keys[i : i + 4]
        texts.append("".join(T.magic_fact(k, "") + T.magic_question(k) for k in chunk))
        texts.append("".join(T.multi_value_fact(k, "") + T.multi_value_question(k) for k in chunk))
        texts.append("".join(T.vt_fact(k, "") + T.vt_question(k) + ", which equals" for k in chunk))
    # No digits in the BPE training text: number tokens are added below, one per value.
    assert not any(c.isdigit() for t in texts for c in t)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
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
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=65536
    )
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
        vocab_size=vocab_size,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": float(a.rope_theta)},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_dropout=0.0,
        initializer_range=0.02,
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
      occurrence after the first (the recurring facts of docs/DESIGN.md, "The demo model's
      training trap");
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
        return [np.asarray(e.ids, dtype=np.int32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def filler(self, n: int) -> np.ndarray:
        s = self.rng.randrange(0, len(self.stream) - n - 1)
        return self.stream[s : s + n]

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
                items.append(dict(group=gid, text=T.magic_fact(k, v), kind="magic", protected=(i in asked and j == 0)))
            gid += 1
            if i in asked:
                qa.append(("single_needle", k, str(v)))
        if L >= 1024 and r.random() < 0.5:  # multi-value group (asked)
            mk = rest[0]
            mvals = values[n_magic : n_magic + r.randint(2, T.MULTI_VALUE_COUNT)]
            for v in mvals:
                items.append(dict(group=-1, text=T.multi_value_fact(mk, v), kind="mv", protected=True, value=str(v)))
            qa.append(("multi_value", mk, "MV"))
        if L >= 1024 and r.random() < 0.3:  # two variable-tracking chains, first one asked
            n = r.randint(2, T.VT_CHAIN)
            c1, c2 = rest[1 : 1 + n], rest[1 + T.VT_CHAIN : 1 + T.VT_CHAIN + n]
            for ci, (chain, val) in enumerate(((c1, values[-1]), (c2, values[-2]))):
                for i, var in enumerate(chain):
                    reps = 1 + (r.random() < 0.3)
                    for j in range(reps):
                        items.append(
                            dict(
                                group=gid,
                                text=T.vt_fact(var, val if i == 0 else chain[i - 1]),
                                kind="vt",
                                protected=(ci == 0 and j == 0),
                            )
                        )
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
                sup[k + 1 : -1] = 1.0
            it["sup"] = sup
        # document separators as `topk prefill` writes them (no loss)
        if r.random() < 0.3:
            g = T.grammar()
            for _ in range(r.randint(1, 4)):
                name = f"{r.choice(g.nouns)}_{r.randint(1, 99)}.{r.choice(('txt', 'md'))}"
                items.append(
                    dict(
                        group=-4,
                        ids=self.enc([f"\n\n### Document: {name}\n\n"])[0],
                        kind="header",
                        protected=False,
                        sup=None,
                    )
                )
        # copy segments (loss on the repeat)
        if r.random() < 0.8:
            for _ in range(r.randint(1, 3 if L <= 2048 else 6)):
                n = r.randint(8, 48)
                seg = self.filler(n) if r.random() < 0.5 else self.nrng.integers(3, self.vocab, size=n, dtype=np.int32)
                sup = np.full(n, 0.5, dtype=np.float32)
                sup[0] = 0.0
                if r.random() < 0.5:  # immediate repeat: one item, weights fixed
                    items.append(
                        dict(
                            group=-3,
                            ids=np.concatenate([seg, seg]),
                            kind="copy",
                            protected=False,
                            sup=np.concatenate([np.zeros(n, np.float32), sup]),
                        )
                    )
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
                qs.append(
                    {
                        "single_needle": T.magic_question,
                        "multi_value": T.multi_value_question,
                        "variable_tracking": T.vt_question,
                    }[task](key)
                )
                pre.append("")
            else:
                question, prefix = T.chat_query(task, key)
                qs.append(f"\nQuestion: {question}\nAnswer:")
                pre.append(" " + prefix)
            ans.append(" " + a_ + ".")
        e = self.enc(qs + pre + ans)
        n_ = len(qs)
        q_ids, p_ids, a_ids = e[:n_], e[n_ : 2 * n_], e[2 * n_ :]
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
