"""routed's split scan (the device-routed layer, routed_split.py) with its two ways of scoring, alternately
in one process: the keys widened to fp32 (`TOPK_NO_BF16_DOT=1`) against the hardware bf16 dot product
(index/dots.py). ms per layer and per round (enter, rows, scan, top-k, values, sums, exit), routing on the
CPU device, synthetic keys. Figures: docs/BENCHMARKS.md run 19.

Usage: python scripts/routed_dot_ab.py [--threads 2] [--layers 2] [--n 131072] [--kv-heads 8] [--group 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's package, not an installed one
from topk_decode.bench.synthetic import synthetic_kv  # noqa: E402
from topk_decode.index import dots, routed_compiled  # noqa: E402
from topk_decode.index.routed import RoutedStrategy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    D, H, G, L = 128, a.kv_heads, a.group, a.layers
    if not dots.bf16_available(D):
        sys.exit("no AVX512-BF16 here (or numba targets another CPU): nothing to compare")
    ckv = synthetic_kv(L, H, D, a.n, torch.bfloat16, 0)
    strat = RoutedStrategy(ckv, 4, a.n - 64, {"kernel": "numba", "device_route": "true"})
    strat.prepare()
    routes = strat.device_routes(torch.device("cpu"), [a.k] * L)
    gen = torch.Generator().manual_seed(1)
    qs = [torch.randn(H, G, D, generator=gen).bfloat16().float() for _ in range(L)]
    picked = []
    for layer in range(L):
        routes.route(layer, qs[layer])
        picked.append(routes.host_route(layer))
    o, mz = np.empty((H, G, D), np.float32), np.empty((H, G, 2), np.float32)
    scratch: dict = {}
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    rounds: dict[str, list[tuple]] = {"fp32": [], "bf16": []}
    for _ in range(a.reps):
        for dot in times:
            if dot == "fp32":
                os.environ["TOPK_NO_BF16_DOT"] = "1"
            else:
                os.environ.pop("TOPK_NO_BF16_DOT", None)
            t = time.perf_counter()
            for layer in range(L):
                res = routed_compiled.split_layer(strat._kernel_in[layer], qs[layer], *picked[layer], a.k,
                                                  strat.scale, a.threads, o, mz, scratch)
            times[dot].append((time.perf_counter() - t) / L * 1e3)
            rounds[dot].append(res.times.rounds)
    strat.close()
    for dot, ts in times.items():
        per_round = [round(statistics.median(r[j] for r in rounds[dot][2:]) * 1e3, 3) for j in range(len(rounds[dot][0]))]
        print(json.dumps({"dot": dot, "threads": a.threads, "n": a.n, "group": G, "rows_read": res.read,
                          "ms_per_layer": round(statistics.median(ts[2:]), 3), "rounds_ms": per_round,
                          "all_ms": [round(x, 2) for x in ts]}), flush=True)


if __name__ == "__main__":
    main()
