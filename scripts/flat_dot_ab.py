"""flat's numba scan with its two ways of scoring, alternately in one process: the keys widened to fp32
with FMAs (`dot="fp32"`) against the hardware bf16 dot product (`dot="bf16"`, index/dots.py), ms per
layer of `flat_kernel.search` over cold layers (synthetic keys, Llama-3-8B shape by default). Figures:
docs/BENCHMARKS.md run 19.

Usage: python scripts/flat_dot_ab.py [--threads 2] [--layers 8] [--n 131072] [--kv-heads 8] [--group 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's package, not an installed one
from topk_decode.bench.synthetic import synthetic_kv  # noqa: E402
from topk_decode.index import dots, flat_kernel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    D = 128
    if not dots.bf16_available(D):
        sys.exit("no AVX512-BF16 here (or numba targets another CPU): nothing to compare")
    ckv = synthetic_kv(a.layers, a.kv_heads, D, a.n, torch.bfloat16, 0)
    gen = torch.Generator().manual_seed(1)
    qs = [torch.randn(a.kv_heads, a.group, D, generator=gen).bfloat16().float() for _ in range(a.layers)]
    flat_kernel.warm_up(D)
    lo, hi = 4, a.n - 64
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(a.reps):
        for dot, ts in times.items():
            t = time.perf_counter()
            for layer in range(a.layers):
                flat_kernel.search(ckv.keys[layer], qs[layer], a.k, lo, hi, a.threads, dot=dot)
            ts.append((time.perf_counter() - t) / a.layers * 1e3)
    ids = {dot: flat_kernel.search(ckv.keys[0], qs[0], a.k, lo, hi, a.threads, dot=dot)[0].sort(-1).values
           for dot in times}
    key_bytes = a.kv_heads * a.n * D * 2
    for dot, ts in times.items():
        ms = statistics.median(ts[1:])
        print(json.dumps({"dot": dot, "threads": a.threads, "n": a.n, "layers": a.layers, "ms_per_layer": round(ms, 2),
                          "key_gb_s": round(key_bytes / ms / 1e6, 1), "all_ms": [round(x, 2) for x in ts],
                          "same_ids": bool(torch.equal(ids["fp32"], ids["bf16"]))}), flush=True)


if __name__ == "__main__":
    main()
