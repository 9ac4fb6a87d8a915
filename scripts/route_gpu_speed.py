"""What routed's device-side routing costs per layer inside a captured graph (index/routed/device.py).

    python scripts/route_gpu_speed.py --n 131072 --kv-heads 8 --group 4      # Llama-3-8B shape at 128K
    python scripts/route_gpu_speed.py --n 1048576 --kv-heads 4 --group 7 --probe-fraction 0.02 --segment 65536

Synthetic tables (random bf16 centroids and mean values, clusters of `--cluster-size`) in a real
`DeviceRoutes`; each measured piece is captured once as a CUDA graph and replayed back to back (µs per
replay, graph launch included): `route` (rank the clusters, copy the ranking to the host), `route` +
`estimate_part`, and the ranking's parts alone (the centroid product, the sorted top-W, a full sort).
One JSON line. Needs a CUDA GPU. Figures: docs/BENCHMARKS.md run 17.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one
from topk_decode.index.routed.device import DeviceRoutes


def graph_us(fn, reps: int) -> float:
    """µs per replay of fn captured as a CUDA graph (after a warm-up run outside the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072, help="context tokens")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cluster-size", type=int, default=16)
    ap.add_argument("--probe-fraction", type=float, default=0.04)
    ap.add_argument("--values", default="auto", help="DeviceRoutes tables: auto, keys, fp8-values, fp8")
    ap.add_argument("--reps", type=int, default=500)
    a = ap.parse_args()
    dev = torch.device("cuda")
    hkv, G, D = a.kv_heads, a.group, a.head_dim
    C = math.ceil(a.n / a.cluster_size)
    gen = torch.Generator().manual_seed(0)
    stats = SimpleNamespace(
        centroids=torch.randn(hkv, C, D, generator=gen).bfloat16(),
        value_means=torch.randn(hkv, C, D, generator=gen).bfloat16(),
        log_n=torch.full((hkv, 1, C), math.log(a.cluster_size)),
    )
    sizes = torch.full((hkv, C), a.cluster_size, dtype=torch.int64)
    bias = torch.zeros(hkv, 1, C)
    budget = math.ceil(a.probe_fraction * a.n)
    routes = DeviceRoutes([stats], [sizes], [bias], [budget], a.n, 1 / math.sqrt(D), True, dev, values=a.values)
    t = routes.tables[0]
    q32 = torch.randn(hkv, G, D, device=dev)
    share = torch.randn(hkv, C, device=dev)
    row = {
        "what": "route_gpu",
        "n": a.n,
        "kv_heads": hkv,
        "group": G,
        "clusters": C,
        "width": t.width,
        "tables": routes.values_kind,
        "route_us": graph_us(lambda: routes.route(0, q32), a.reps),
        "route_estimate_us": graph_us(lambda: (routes.route(0, q32), routes.estimate_part(0)), a.reps),
        "centroid_product_us": graph_us(lambda: routes.bmm(q32, t.cent.transpose(1, 2)), a.reps),
        "top_w_sorted_us": graph_us(lambda: share.topk(t.width, dim=-1, sorted=True), a.reps),
        "full_sort_us": graph_us(lambda: share.sort(dim=-1, descending=True), a.reps),
    }
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
