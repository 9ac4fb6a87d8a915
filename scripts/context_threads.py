"""How the context part's small ops are kept on one thread: per-thread OpenMP vs torch.set_num_threads vs not at all.

    python scripts/context_threads.py --context 131072 --layers 4 --reps 20
    python scripts/context_threads.py --ops-only     # only the small ops, no search or embedding_bag

Synthetic Llama-3-8B-shaped KV (8 KV heads, D = 128, bf16) and the flat strategy's torch backend at
k = 1024; every layer runs its search, then `ContextAttention.attend`, timed alone, in three variants
taking turns: "per_thread" (the shipped `index.threads.omp_threads`, this thread only), "set_num_threads"
(the former process-wide toggle, restored after each call) and "all_threads" (no limit). CPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import topk_decode.decode.context as context_mod
from topk_decode.bench.synthetic import synthetic_kv
from topk_decode.decode.context import ContextAttention
from topk_decode.index import get_strategy
from topk_decode.index.threads import omp_threads


@contextlib.contextmanager
def process_wide(n: int | None):
    """The former way: torch.set_num_threads around the ops (process-wide, not thread-safe)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(min(n, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ops_only() -> None:
    """Median µs of 8 small ops under each variant (three interleaved rounds)."""
    x, y = torch.randn(32, 1024), torch.empty(32, 1024)
    variants = {"per_thread": omp_threads, "set_num_threads": process_wide,
                "all_threads": lambda n: contextlib.nullcontext()}
    res: dict[str, list[float]] = {}
    for _ in range(3):
        for name, manager in variants.items():
            ts = []
            for _ in range(300):
                t = time.perf_counter()
                with manager(1):
                    for _ in range(8):
                        torch.mul(x, 0.1, out=y)
                        y.sub_(1).exp_()
                        y.sum(-1)
                ts.append(1e6 * (time.perf_counter() - t))
            res.setdefault(name, []).append(round(statistics.median(ts), 1))
    print(json.dumps({"threads": torch.get_num_threads(), "median_us_per_round": res}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ops-only", action="store_true", help="time 8 elementwise ops on (32, 1024) fp32, 300 times, "
                    "per variant, three rounds (no memory traffic: the thread setting's own cost)")
    a = ap.parse_args()
    if a.ops_only:
        ops_only()
        return
    hkv, G, D = 8, 4, 128
    ckv = synthetic_kv(a.layers, hkv, D, a.context, torch.bfloat16)
    strat = get_strategy("flat")(ckv, 0, a.context, {"backend": "torch"})
    strat.prepare()
    ctx = ContextAttention(ckv.values, D ** -0.5)
    o, mz = torch.empty((hkv * G, D), dtype=torch.bfloat16), torch.empty((hkv * G, 2))
    variants = {"per_thread": (omp_threads, 1), "set_num_threads": (process_wide, 1), "all_threads": (omp_threads, None)}
    times: dict[str, list[float]] = {v: [] for v in variants}
    gen = torch.Generator().manual_seed(0)
    for _ in range(a.reps):
        for name, (manager, n) in variants.items():
            context_mod.omp_threads, ctx.small_op_threads = manager, n
            for layer in range(a.layers):
                q = torch.randn((hkv, G, D), generator=gen).to(torch.bfloat16).float()
                sel = strat.select(layer, q, a.k)
                t = time.perf_counter()
                ctx.attend(layer, sel, o, mz)
                times[name].append(1e6 * (time.perf_counter() - t))
    print(json.dumps({"context": a.context, "k": a.k, "threads": torch.get_num_threads(),
                      "median_us_per_layer": {n: round(statistics.median(v), 1) for n, v in times.items()}}, indent=1))


if __name__ == "__main__":
    main()
