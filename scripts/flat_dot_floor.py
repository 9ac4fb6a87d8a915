"""The floor under flat's numba scan on this host: its dot products alone (flat_kernel._dot4), no top-k.

Times, in ns per key and thread: one thread over a warm 4,096-row block; every thread over its own warm
block at once; every thread over its share of cold layers (Llama-3-8B shape: 8 KV heads x N keys x 128),
with 0, 16 and 48 rows prefetched ahead. What a scan that scores every key exactly in fp32 cannot beat
here. Figures: docs/BENCHMARKS.md run 18.

Both ways of scoring (`--dot`): the keys widened to fp32 with FMAs, and the hardware bf16 dot product
(index/dots.py) where the CPU has it.

Usage: python scripts/flat_dot_floor.py [--threads 16] [--layers 8] [--n 131072] [--dot fp32 bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's package, not an installed one
import numba  # noqa: E402
from topk_decode.index import dots, flat_kernel  # noqa: E402
from topk_decode.index.compiled import bits, jit, pjit, prange, prefetch_row  # noqa: E402


@jit
def _dot_rows(keys, q, s, e, out, ahead):
    """out[0] = the largest score of rows [s, e) against q's first four queries (row t + ahead prefetched)."""
    best = np.float32(-np.inf)
    for t in range(s, e):
        if ahead > 0 and t + ahead < e:
            prefetch_row(keys, t + ahead)
        a0, a1, a2, a3 = flat_kernel._dot4(keys, t, q, 0)
        best = max(best, max(max(a0, a1), max(a2, a3)))
    out[0] = best


@pjit
def _dot_par(keys, q, rows, reps, out, ahead, warm):
    """Every thread w scores `rows` rows `reps` times: its own rows of head 0 (warm) or its share of the layer."""
    for w in prange(out.shape[0]):
        for _ in range(reps):
            if warm:
                _dot_rows(keys[0], q, w * rows, (w + 1) * rows, out[w], ahead)
            else:
                h, part = w % keys.shape[0], w // keys.shape[0]
                _dot_rows(keys[h], q, part * rows, (part + 1) * rows, out[w], ahead)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8, help="cold layers cycled through")
    ap.add_argument("--n", type=int, default=131072, help="keys per head")
    ap.add_argument("--dot", nargs="+", default=["fp32", "bf16"],
                    help="fp32: keys widened, FMAs; bf16: the hardware bf16 dot product (where available)")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    for dot in a.dot:
        if dot == "bf16" and not dots.bf16_available(128):
            print(json.dumps({"dot": dot, "skipped": "no AVX512-BF16 here"}))
            continue
        _floor(a, dot)


def _floor(a: argparse.Namespace, dot: str) -> None:
    """The floor's rows for one way of scoring."""
    q = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    if dot == "bf16":
        q = bits(torch.from_numpy(q).bfloat16())
    gen = torch.Generator().manual_seed(0)
    layers = [bits(torch.randn((8, a.n, 128), generator=gen).bfloat16()) for _ in range(a.layers)]
    out, one = np.zeros((a.threads, 1), np.float32), np.zeros(1, np.float32)
    _dot_rows(layers[0][0], q, 0, 4096, one, 0)
    t = time.perf_counter()
    for _ in range(50):
        _dot_rows(layers[0][0], q, 0, 4096, one, 0)
    print(json.dumps({"dot": dot, "what": "1 thread warm", "ns_per_key": round((time.perf_counter() - t) / (50 * 4096) * 1e9, 1)}))
    rows = 8 * a.n // a.threads
    for ahead in (0, 16, 48):
        _dot_par(layers[0], q, 4096, 1, out, ahead, True)
        t = time.perf_counter()
        _dot_par(layers[0], q, 4096, 50, out, ahead, True)
        warm = (time.perf_counter() - t) / (50 * 4096) * 1e9
        ts = []
        for keys in layers:
            t = time.perf_counter()
            _dot_par(keys, q, rows, 1, out, ahead, False)
            ts.append(time.perf_counter() - t)
        dt = float(np.median(ts))
        print(json.dumps({"dot": dot, "what": f"{a.threads} threads", "ahead": ahead, "warm_ns_per_key": round(warm, 1),
                          "cold_ns_per_key": round(dt / rows * 1e9, 1), "cold_ms_per_layer": round(dt * 1e3, 2),
                          "cold_gb_s": round(8 * a.n * 256 / dt / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
