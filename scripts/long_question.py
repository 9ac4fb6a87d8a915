"""Seconds to feed one long question through `TopKDecoder.forward`, beside a plain prefill of the same tokens.

    python scripts/long_question.py --tokens 1024 2048 4096 8192 [--shape smollm2] [--context 4096]

Builds a random-weight model of a real model's shape (`--shape`: the demo model's, or SmolLM2-135M's
with `--layers` of its 30 layers; speed does not depend on the weights) over `--context` tokens of
random KV in RAM (bench/synthetic.py), then for each length T feeds T question tokens to a fresh
conversation and prints the wall seconds, where they went (the step's StepStats: search, context
part, transfers; `window` is the window part of attention, timed around `chunk_window_attention`), and the
model's own forward over the same T tokens (HF, SDPA: what a prefill of them costs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

import topk_decode.decode.engine as engine_mod  # noqa: E402
from topk_decode.bench.synthetic import synthetic_kv  # noqa: E402
from topk_decode.config import DecodeConfig  # noqa: E402
from topk_decode.decode.engine import TopKDecoder  # noqa: E402
from topk_decode.model.loading import load_model  # noqa: E402
from topk_decode.model.tiny import make_random_model  # noqa: E402

SHAPES = {  # config overrides of make_random_model (llama layout)
    "demo": dict(
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=4,
        vocab_size=2999,
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        num_hidden_layers=30,
        vocab_size=49152,
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--shape", choices=SHAPES, default="demo")
    ap.add_argument("--layers", type=int, default=None, help="layers of the shape to keep (default: all)")
    ap.add_argument("--context", type=int, default=4096, help="context tokens of random KV")
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--no-prefill", action="store_true", help="skip the plain forward over the same tokens")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bf16 model and KV there)")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = dict(SHAPES[a.shape], max_position_embeddings=1 << 17)
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    with tempfile.TemporaryDirectory() as d:
        make_random_model(d, "llama", **cfg)
        model = load_model(d, a.device)
    c = model.config
    cuda = model.device.type == "cuda"
    ckv = synthetic_kv(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, a.context, model.dtype)
    dec = TopKDecoder(model, ckv, DecodeConfig(k=a.k))
    window_s = [0.0]
    name = "chunk_window_attention" if hasattr(engine_mod, "chunk_window_attention") else "window_attention"
    inner = getattr(engine_mod, name)

    def timed(*args, **kw):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = inner(*args, **kw)
        if cuda:
            torch.cuda.synchronize()
        window_s[0] += time.perf_counter() - t
        return out

    setattr(engine_mod, name, timed)
    print(
        f"shape {a.shape} ({c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} heads, "
        f"D {c.head_dim})  context {a.context}  k {a.k}  chunk {dec.prompt_chunk_tokens()}  "
        f"threads {torch.get_num_threads()}  device {model.device} {model.dtype}"
    )
    dec.forward(list(range(10, 138)), dec.new_conversation())  # warm-up: first-call costs out of the figures
    for T in a.tokens:
        ids = [(7 * i) % (c.vocab_size - 20) + 10 for i in range(T)]
        conv = dec.new_conversation()
        window_s[0] = 0.0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        dec.forward(ids, conv)
        total = time.perf_counter() - t
        st = conv.stats
        peak = f"  peak GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else ""
        line = (
            f"T {T:6d}  forward {total:7.2f} s  window {window_s[0]:6.2f}  search {st.search_s:6.2f}  "
            f"context {st.context_s:6.2f}  d2h {st.d2h_s:5.2f}  h2d {st.h2d_s:5.2f}{peak}"
        )
        if not a.no_prefill:
            x = torch.tensor([ids], device=model.device)
            t = time.perf_counter()
            with torch.inference_mode():
                model.model(x)
            if cuda:
                torch.cuda.synchronize()
            line += f"  | model forward (prefill) {time.perf_counter() - t:6.2f} s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
