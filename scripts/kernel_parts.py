"""Where one KV head's device-routed layer goes on this CPU: routed_kernel.py's scan, top-k and context
part timed apart, on cold data (each head's keys and values are touched once per round, as in decoding).

Usage: python scripts/kernel_parts.py --n 131072 --rows 5248   (Llama-3-8B head at 128K, 4 % read)
       python scripts/kernel_parts.py --n 131072 --layout routed   (routed's layout and routing of synthetic KV)
Synthetic random bf16 keys and values; with the uniform layout the clusters read are a random choice.
Figures: docs/BENCHMARKS.md.
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
from topk_decode.index.kernel_topk import top_k_rows
from topk_decode.index.routed_kernel import _attend, _cluster_rows, _count_rows, _scan, scan_head


def bf16_bits(shape: tuple, gen: torch.Generator) -> np.ndarray:
    """Random bf16 values as their uint16 bits."""
    return torch.randn(shape, generator=gen).bfloat16().view(torch.int16).numpy().view(np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072, help="keys per head")
    ap.add_argument("--rows", type=int, default=2624, help="keys read per head (whole clusters)")
    ap.add_argument("--cluster-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8, help="distinct heads cycled through (keeps data cold)")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warm", action="store_true",
                    help="read the same clusters every round (they stay in the last-level cache)")
    ap.add_argument("--layout", choices=["uniform", "routed"], default="uniform",
                    help="uniform: random clusters of --cluster-size; routed: routed's own layout of synthetic KV "
                         "(--layers layers, k-means as at open) and the clusters its routing picks for random queries")
    ap.add_argument("--layers", type=int, default=2, help="--layout routed: layers built (cycled through)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    Q, d = a.group, a.head_dim
    rounds = uniform_rounds(a, rng) if a.layout == "uniform" else routed_rounds(a, rng)
    ids, sc = np.empty((Q, a.k), np.int64), np.empty((Q, a.k), np.float32)
    cols, o, mz = np.empty((Q, a.k), np.int64), np.empty((Q, d), np.float32), np.empty((Q, 2), np.float32)
    no_o, no_lse, s = np.zeros((1, d), np.float32), np.zeros(1, np.float32), np.float32(d ** -0.5)
    times = {"scan": [], "top_k": [], "attend": [], "scan_head": []}
    read, clusters = [], []
    for r in range(a.rounds + 1):
        heads = next(rounds)
        for keys, vals, pos, offsets, order, taken, qh in heads:
            m = int(_count_rows(offsets, order, taken))
            t0 = time.perf_counter()
            rows = _cluster_rows(offsets, order, taken, m)
            rpos, scores = _scan(keys, pos, rows, qh)
            t1 = time.perf_counter()
            top_k_rows(scores, rpos, ids, sc, cols)
            t2 = time.perf_counter()
            _attend(vals, rows, cols, sc, s, no_o, no_lse, False, o, mz)
            t3 = time.perf_counter()
            if r:   # round 0 compiles
                times["scan"].append(t1 - t0), times["top_k"].append(t2 - t1), times["attend"].append(t3 - t2)
                read.append(m), clusters.append(taken)
        for keys, vals, pos, offsets, order, taken, qh in next(rounds):   # other clusters: cold again
            t0 = time.perf_counter()
            scan_head(keys, pos, offsets, order, taken, qh, a.k, s, vals, True, ids, sc, o, mz)
            if r:
                times["scan_head"].append(time.perf_counter() - t0)
    row = {"what": "kernel_parts", "layout": a.layout, "n": a.n, "rows": int(np.median(read)),
           "rows_per_cluster": round(float(np.sum(read) / np.sum(clusters)), 2), "group": Q, "k": a.k,
           **{f"{name}_us": round(1e6 * float(np.median(v)), 1) for name, v in times.items()}}
    print(json.dumps(row), flush=True)


def uniform_rounds(a, rng):
    """Per round, each head's scan inputs: random bf16 KV, clusters of --cluster-size, a random choice of them."""
    gen = torch.Generator().manual_seed(0)
    N, S, d = a.n, a.cluster_size, a.head_dim
    keys = [bf16_bits((N, d), gen) for _ in range(a.heads)]
    vals = [bf16_bits((N, d), gen) for _ in range(a.heads)]
    pos = np.arange(N, dtype=np.int32)
    offsets = np.arange(0, N + 1, S, dtype=np.int64)
    taken = -(-a.rows // S)
    orders = [rng.permutation(N // S).astype(np.int32) for _ in range(a.heads)]
    qh = rng.standard_normal((a.group, d)).astype(np.float32)
    while True:
        if not a.warm:   # fresh clusters every round: read from DRAM, as a decode step does
            orders = [rng.permutation(N // S).astype(np.int32) for _ in range(a.heads)]
        yield [(keys[h], vals[h], pos, offsets, orders[h], taken, qh) for h in range(a.heads)]


def routed_rounds(a, rng):
    """Per round, each KV head of one layer of routed's layout (cycling through the layers) with the clusters its
    device routing (routed_device.py; the CPU without CUDA) ranks for fresh random queries, k = --k."""
    from topk_decode.bench.synthetic import synthetic_kv
    from topk_decode.index import get_strategy

    ckv = synthetic_kv(a.layers, a.heads, a.head_dim, a.n, torch.bfloat16, 0)
    strat = get_strategy("routed")(ckv, 4, a.n - 64, {"kernel": "numba", "device_route": "true"})
    strat.prepare()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    routes = strat.device_routes(device, [a.k] * a.layers)
    layer = 0
    while True:
        q = torch.from_numpy(rng.standard_normal((a.heads, a.group, a.head_dim)).astype(np.float32))
        routes.route(layer, q.to(device))
        order, take = (t.numpy() for t in routes.host_route(layer))
        arr = strat._kernel_in[layer]
        qn = q.numpy()
        yield [(arr.keys[h], arr.vals[h], arr.pos[h], arr.offsets[h], order[h], int(take[h]), qn[h])
               for h in range(a.heads)]
        layer = (layer + 1) % a.layers


if __name__ == "__main__":
    main()
