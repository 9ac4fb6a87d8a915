"""Time the compiled top-k of one row of scores (index/kernel_topk.py `top_k_one`), one thread.

    python scripts/topk_row_speed.py                       # rows of 2,000 / 5,248 / 16,700 scores, k = 1024
    python scripts/topk_row_speed.py --rows 5248 --k 1024 --reps 50

One JSON line per row length: µs per row, over 64 rows of N(0, 3²) scores with every 50th −inf (rows outside
the searchable range), in a compiled loop (no Python per row). Before 2f500ca the function lived in
routed_kernel.py as `_top_k_one`; the script times that one where kernel_topk.py is missing, so a checkout
of an older commit gives the "before" figure. Figures: docs/BENCHMARKS.md run 17.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's package, not an installed one
from topk_decode.index.compiled import jit

try:
    from topk_decode.index.kernel_topk import top_k_one
except ImportError:   # before 2f500ca
    from topk_decode.index.routed_kernel import _top_k_one as top_k_one


@jit
def _rows(S, rpos, ids, sc, cols, hist, reps):
    """reps × the top-k of every row of S."""
    for _ in range(reps):
        for i in range(S.shape[0]):
            top_k_one(S[i], rpos, ids, sc, cols, hist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2000, 5248, 16700], help="scores per row")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for m in a.rows:
        S = (rng.standard_normal((64, m)) * 3).astype(np.float32)
        S[:, ::50] = -np.inf
        rpos = np.arange(m, dtype=np.int64)
        ids, sc, cols = np.empty(a.k, np.int64), np.empty(a.k, np.float32), np.empty(a.k, np.int64)
        hist = np.empty(2048, np.int64)
        _rows(S, rpos, ids, sc, cols, hist, 1)                       # compile and warm
        t = time.perf_counter()
        _rows(S, rpos, ids, sc, cols, hist, a.reps)
        us = (time.perf_counter() - t) / a.reps / S.shape[0] * 1e6
        print(json.dumps({"what": "top_k_row", "scores": m, "k": a.k, "us_per_row": round(us, 1)}), flush=True)


if __name__ == "__main__":
    main()
