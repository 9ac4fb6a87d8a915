"""The CPU side of a decode step, per layer: a strategy's search plus the context part, as the decoder runs them.

For each configuration, one JSON line: ms per step over every layer (each layer's data cold, as in
decoding) and per layer. A configuration is a strategy and its options; routed's compiled path runs
`select_and_attend` (search and context part in one pass), every other one `select` then
decode/context.py's `ContextAttention.attend`, exactly the decoder's `_context_part`.

Usage (Llama-3-8B shape at 128K, 32 layers; synthetic random bf16 KV, so routed's recall here says
nothing: docs/BENCHMARKS.md):
  python benchmarks/bench_step_cpu.py --n 131072 --layers 32 --configs flat routed:kernel=torch routed:kernel=numba
With routed:device_route=true the clusters (with rank=keys: the keys) are ranked on the GPU (the CPU where there is none), untimed,
and the CPU side is what is left of a device-routed step (index/routed/device.py).
Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one
from topk_decode.bench.measure import anon_huge_pages
from topk_decode.bench.synthetic import synthetic_kv
from topk_decode.decode.context import ContextAttention
from topk_decode.index import FusedAttention, get_strategy
from topk_decode.index.routed.compiled import SPLIT_ROUNDS


def parse_config(text: str) -> tuple[str, dict]:
    """'routed:kernel=numba,cluster_size=16' → ('routed', {'kernel': 'numba', 'cluster_size': '16'})."""
    name, _, opts = text.partition(":")
    return name, dict(kv.split("=", 1) for kv in opts.split(",") if kv)


def step_ms(
    strat, context: ContextAttention, qs: list[torch.Tensor], k: int, layers: int, reps: int, routes=None
) -> float:
    """Median ms of one step's CPU side over `layers` layers (search + context part per layer).

    With `routes` (routed's DeviceRoutes) each layer is ranked on its device first, untimed: the CPU side is
    then the scan of the ranked clusters, the top-k and the context part, as in a device-routed step."""
    hkv, Q, d = qs[0].shape
    o = torch.empty(hkv * Q, d, dtype=torch.bfloat16)
    mz = torch.empty(hkv * Q, 2)

    def one_layer(layer: int, q: torch.Tensor) -> float:
        route = None
        if routes is not None:
            routes.route(layer, q.to(routes.device))
            if routes.device.type == "cuda":
                torch.cuda.synchronize(routes.device)
            route = routes.host_route(layer)
        t = time.perf_counter()
        if isinstance(strat, FusedAttention) and strat.attends(layer, k, o, routed=route is not None):
            strat.select_and_attend(layer, q, k, None, o, mz, route=route)
        else:
            context.attend(layer, strat.select(layer, q, k), o, mz)
        return time.perf_counter() - t

    def one_step(step: int) -> float:
        return sum(one_layer(layer, qs[(step + layer) % len(qs)]) for layer in range(layers))

    one_step(0)
    times = sorted(1e3 * one_step(r + 1) for r in range(reps))
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072, help="context tokens (keys per KV head)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=["flat", "routed:kernel=torch", "routed:kernel=numba"])
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[None],
        help="routed's compiled path: numba threads, one row per count (default: one per core)",
    )
    ap.add_argument("--out", default=None, help="append the JSON lines here too")
    a = ap.parse_args()
    ckv = synthetic_kv(a.layers, a.kv_heads, a.head_dim, a.n, torch.bfloat16, 0)
    gen = torch.Generator().manual_seed(1)
    qs = [torch.randn((a.kv_heads, a.group, a.head_dim), generator=gen).bfloat16().float() for _ in range(7)]
    context = ContextAttention(ckv.values, 1.0 / math.sqrt(a.head_dim))
    lo, hi = 4, a.n - 64
    for text in a.configs:
        name, opts = parse_config(text)
        t = time.perf_counter()
        strat = get_strategy(name)(ckv, lo, hi, opts)
        strat.prepare()
        open_s = time.perf_counter() - t
        routes = None
        if name == "routed" and opts.get("device_route") == "true":
            routes = strat.device_routes(torch.device("cuda" if torch.cuda.is_available() else "cpu"), [a.k] * a.layers)
        for threads in a.threads:
            if threads is not None:
                strat.threads = threads
            timed = ("kernel_s", "span_s", "head_max_s", "head_mean_s", *(r + "_s" for r in SPLIT_ROUNDS))
            before = {name: strat.stats.extra.get(name, 0.0) for name in timed}
            calls = strat.stats.searches
            ms = step_ms(strat, context, qs, a.k, a.layers, a.reps, routes)
            row = {
                "what": "step_cpu",
                "config": text,
                "n": a.n,
                "layers": a.layers,
                "kv_heads": a.kv_heads,
                "head_dim": a.head_dim,
                "group": a.group,
                "k": a.k,
                "threads": getattr(strat, "threads", torch.get_num_threads()),
                "open_s": round(open_s, 1),
                "ms_per_step": round(ms, 2),
                "ms_per_layer": round(ms / a.layers, 3),
            }
            if hasattr(strat, "keys_read_fraction") and strat.keys_read_fraction() is not None:
                row["keys_read_pct"] = round(100 * strat.keys_read_fraction(), 2)
            calls = strat.stats.searches - calls
            for tname, v0 in before.items():  # per layer, inside the compiled call (routed_compiled.HeadTimes)
                if tname in strat.stats.extra and calls:
                    row[tname[:-2] + "_ms_per_layer"] = round(1e3 * (strat.stats.extra[tname] - v0) / calls, 3)
            if name == "routed" and getattr(strat, "kernel", False):
                import numba

                row["numba_threading_layer"] = numba.threading_layer()
                row["hugepages"] = strat.huge_bytes > 0  # routed's option `hugepages` (compare its two values)
                row["anon_huge_pages_gib"] = round(anon_huge_pages() / 2**30, 2)
            line = json.dumps(row)
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")
        strat.close()


if __name__ == "__main__":
    main()
