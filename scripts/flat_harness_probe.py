"""Why flat's numba scan ranked differently in two harnesses on the GPU host (docs/STRATEGIES.md
"flat's default backend"): FlatStrategy.select over 32 layers, ms per layer, for keys drawn with
`torch.randn` (as scripts/flat_ab.py does) and for synthetic keys (as scripts/scan_bandwidth.py does),
numba against torch, in one process. Run it again under other settings to separate the causes, e.g.
`NUMBA_THREADING_LAYER=workqueue` or `OMP_WAIT_POLICY=PASSIVE` (torch's OpenMP threads not spinning).

Usage: python scripts/flat_harness_probe.py [--n 131072] [--layers 32] [--kv-heads 8] [--group 4] [--k 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's package, not an installed one
import numba  # noqa: E402
from topk_decode.bench.synthetic import kv_in_memory, synthetic_kv  # noqa: E402
from topk_decode.index.flat import FlatStrategy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    L, H, D, N = a.layers, a.kv_heads, 128, a.n
    gen = torch.Generator().manual_seed(0)
    randn = [torch.randn(H, N, D, generator=gen).to(torch.bfloat16) for _ in range(L)]
    caches = {"randn": kv_in_memory(randn, randn, list(range(N)), "llama"),
              "synthetic": synthetic_kv(L, H, D, N, torch.bfloat16, 0)}
    qs = [torch.randn(H, a.group, D, generator=gen).bfloat16().float() for _ in range(L)]
    for rnd in range(2):
        for keys, ckv in caches.items():
            for backend in ("numba", "torch"):
                strat = FlatStrategy(ckv, 4, N - 64, {"backend": backend})
                strat.prepare()
                times = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    for layer in range(L):
                        strat.select(layer, qs[layer], a.k)
                    times.append((time.perf_counter() - t) / L * 1e3)
                print(json.dumps({"round": rnd, "keys": keys, "backend": backend, "n": N, "layers": L,
                                  "numba_layer": numba.threading_layer() if backend == "numba" else None,
                                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                                  "ms_per_layer": round(statistics.median(times[1:]), 2),
                                  "all_ms": [round(x, 2) for x in times]}), flush=True)


if __name__ == "__main__":
    main()
