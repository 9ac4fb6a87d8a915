"""How close the CPU search gets to the host's memory bandwidth: DRAM read floor, flat scan, routed scan.

On one host, one JSON line per measurement:
  dram      — GB/s of summing a large fp32 tensor (all threads), the read floor;
  flat      — ms per layer of FlatStrategy.select (each backend of `--flat-backends`) over Hkv × N × D
              bf16 keys, the key bytes / time as GB/s and as % of the dram figure;
  routed    — ms per layer of RoutedStrategy.select, keys read %, GB/s of the keys it read, its
              routing stage alone, and id recall of flat's exact top-k (random keys cluster poorly:
              this recall is a floor, not the fidelity on a real model).

Usage (Llama-3-8B shape at 128K, one layer):
  python benchmarks/bench_scan.py --n 131072 --kv-heads 8 --group 4 --k 1024 --out scan.jsonl
flat's torch and numba backends only, one layer and then 32 layers (each layer's keys cold):
  python benchmarks/bench_scan.py --n 131072 --kv-heads 8 --group 4 --k 1024 --flat-backends torch numba \
      --skip routed routed_layers --layers 32 --out scan.jsonl
Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one
from topk_decode.bench.synthetic import synthetic_kv


def _timed(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps calls, after one warm-up."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t))
    return sorted(ts)[len(ts) // 2]


def dram_bandwidth(gib: float = 4.0, reps: int = 5) -> dict:
    """Read bandwidth of `x.sum()` over a gib-GiB fp32 tensor (already resident), all torch threads."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    ms = _timed(lambda: x.sum(), reps)
    # the same read split over threads by hand (one chunk each, no reduction tree)
    n_thr = torch.get_num_threads()
    chunks = x.chunk(n_thr)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    with ThreadPoolExecutor(n_thr) as pool:
        ms_thr = _timed(lambda: list(pool.map(lambda c: c.sum(), chunks)), reps)
    torch.set_num_threads(prev)
    best = min(ms, ms_thr)
    return {
        "what": "dram",
        "gib": gib,
        "threads": n_thr,
        "sum_ms": round(ms, 2),
        "threaded_sum_ms": round(ms_thr, 2),
        "gb_s": round(x.numel() * 4 / best / 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072, help="keys per head (context length)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--probe-fraction", type=float, nargs="+", default=[0.04], help="routed budgets to time")
    ap.add_argument("--cluster-size", type=int, default=64)
    ap.add_argument("--dram-gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="any of dram flat routed; with --layers > 1 also routed_layers, flat_layers",
    )
    ap.add_argument(
        "--flat-backends",
        nargs="+",
        default=["torch"],
        help="flat backends to time (its `backend` option: torch, numba, faiss)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="with > 1: also time routed and flat over every layer per "
        "step (each layer's data cold, as in decoding) on a synthetic cache of this many layers",
    )
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["torch", "numba"],
        help="routed's search paths to time (its `kernel` option; numba: bf16 keys)",
    )
    ap.add_argument(
        "--estimate",
        action="store_true",
        help="routed with its estimate of the rest (the strategy's default; both kernels implement it)",
    )
    ap.add_argument("--profile", action="store_true", help="print a torch profile of routed select (stderr)")
    ap.add_argument("--out", default=None, help="append the JSON lines here too")
    a = ap.parse_args()
    outf = open(a.out, "a") if a.out else None

    def emit(row: dict) -> None:
        row = {
            "n": a.n,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "group": a.group,
            "k": a.k,
            "threads": torch.get_num_threads(),
            **row,
        }
        line = json.dumps(row)
        print(line, flush=True)
        if outf:
            outf.write(line + "\n")
            outf.flush()

    dram = None
    if "dram" not in a.skip:
        r = dram_bandwidth(a.dram_gib)
        dram = r["gb_s"]
        emit(r)
    from topk_decode.index.flat import FlatStrategy
    from topk_decode.index.routed import RoutedStrategy

    ckv = synthetic_kv(1, a.kv_heads, a.head_dim, a.n, torch.bfloat16, 0)
    key_bytes = a.kv_heads * a.n * a.head_dim * 2
    gen = torch.Generator().manual_seed(1)
    qs = [torch.randn((a.kv_heads, a.group, a.head_dim), generator=gen).bfloat16().float() for _ in range(a.reps + 1)]
    lo, hi = 4, a.n - 64
    flat = FlatStrategy(ckv, lo, hi, {})
    flat.prepare()
    exact = [flat.select(0, q, a.k).ids for q in qs]

    def pct(gbs: float) -> float | None:
        return None if dram is None else round(100 * gbs / dram, 1)

    if "flat" not in a.skip:
        for backend in a.flat_backends:
            f = FlatStrategy(ckv, lo, hi, {"backend": backend})
            f.prepare()
            sels = []
            it = iter(qs * 2)
            ms = _timed(lambda: sels.append(f.select(0, next(it), a.k)), a.reps)
            f.close()
            gbs = key_bytes / ms / 1e6
            # the same top-k as the torch backend's (ties aside): share of equal id sets over heads × queries
            same = [torch.equal(sel.ids.sort(-1).values, ids.sort(-1).values) for sel, ids in zip(sels, exact)]
            emit(
                {
                    "what": "flat",
                    "backend": backend,
                    "dot": _numba_dot(backend, ckv, qs[0]),
                    "ms_per_layer": round(ms, 2),
                    "key_gb_s": round(gbs, 1),
                    "pct_of_dram": pct(gbs),
                    "dram_gb_s": dram,
                    "same_ids_as_torch": round(sum(same) / len(same), 3),
                }
            )
    if "routed" not in a.skip:
        for kernel in a.kernels:
            t = time.perf_counter()
            routed = RoutedStrategy(
                ckv, lo, hi, {"cluster_size": a.cluster_size, "kernel": kernel, "estimate": a.estimate}
            )
            routed.prepare()
            build_s = time.perf_counter() - t

            for pf in a.probe_fraction:
                routed.probe_fraction = pf
                routed.stats.extra.update(keys_read=0, keys_searchable=0)
                sels = []
                it = iter(qs * 2)
                ms = _timed(lambda: sels.append(routed.select(0, next(it), a.k)), a.reps)
                read = routed.keys_read_fraction()
                budget = max(int(pf * (hi - lo)), 2 * a.k)
                it = iter(qs * 2)
                route_ms = _timed(lambda: routed.route(0, next(it), budget), a.reps) if kernel == "torch" else None
                rec = []
                for sel, ids in zip(sels[: len(qs)], exact):
                    for h in range(a.kv_heads):
                        for i in range(a.group):
                            rec.append(len(set(sel.ids[h, i].tolist()) & set(ids[h, i].tolist())) / a.k)
                gbs = read * key_bytes / ms / 1e6
                emit(
                    {
                        "what": "routed",
                        "kernel": kernel,
                        "probe_fraction": pf,
                        "cluster_size": a.cluster_size,
                        "build_s": round(build_s, 1),
                        "ms_per_layer": round(ms, 3),
                        "route_ms": route_ms and round(route_ms, 3),
                        "keys_read_pct": round(100 * read, 2),
                        "read_gb_s": round(gbs, 1),
                        "pct_of_dram": pct(gbs),
                        "id_recall_random_keys": round(sum(rec) / len(rec), 3),
                    }
                )
                if a.profile and kernel == "torch":
                    from torch.profiler import profile

                    with profile() as prof:
                        for q in qs:
                            routed.select(0, q, a.k)
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), file=sys.stderr)
            routed.close()
    if a.layers > 1:
        del ckv, flat
        ckv = synthetic_kv(a.layers, a.kv_heads, a.head_dim, a.n, torch.bfloat16, 0)
        runs = (
            []
            if "routed_layers" in a.skip
            else [
                (
                    f"routed_{kernel}",
                    lambda kernel=kernel: RoutedStrategy(
                        ckv,
                        lo,
                        hi,
                        {
                            "cluster_size": a.cluster_size,
                            "kernel": kernel,
                            "probe_fraction": a.probe_fraction[0],
                            "estimate": a.estimate,
                        },
                    ),
                )
                for kernel in a.kernels
            ]
        )
        if "flat_layers" not in a.skip:  # "flat" is the torch backend (the name earlier runs recorded)
            runs += [
                ("flat" if b == "torch" else f"flat_{b}", lambda b=b: FlatStrategy(ckv, lo, hi, {"backend": b}))
                for b in a.flat_backends
            ]
        for name, make in runs:
            strat = make()
            strat.prepare()
            ms = _timed(
                lambda: [strat.select(layer, qs[layer % len(qs)], a.k) for layer in range(a.layers)],
                max(3, a.reps // 2),
            )
            strat.close()
            row = {
                "what": f"{name}_all_layers",
                "layers": a.layers,
                "ms_per_step": round(ms, 2),
                "ms_per_layer": round(ms / a.layers, 3),
            }
            if name.startswith("flat"):  # flat reads every key of every layer
                gbs = key_bytes * a.layers / ms / 1e6
                row.update(
                    key_gb_s=round(gbs, 1), pct_of_dram=pct(gbs), dot=_numba_dot(name.removeprefix("flat_"), ckv, qs[0])
                )
            emit(row)
            del strat


def _numba_dot(backend: str, ckv, q: torch.Tensor) -> str | None:
    """How flat's numba backend scores here ("bf16": hardware dot products, "fp32"), None for other backends."""
    if backend != "numba":
        return None
    from topk_decode.index.flat import compiled

    return "bf16" if compiled.bf16_dot_applies(ckv.keys[0], q) else "fp32"


if __name__ == "__main__":
    main()
