"""Search time per decode step of every strategy on the GPU host's CPU, at 128K and 1M tokens.

One synthetic layer of the Llama-3-8B shape (8 KV heads × 4 query heads each, head_dim 128, bf16
keys; search speed depends on the shapes, not on the model — recall is measured on model keys in
docs/STRATEGIES.md). Prints one JSON line per measurement and appends it to --out as it goes, so a
run cut short by its time limit still leaves every finished row.

    python scripts/device_strategy_speed.py --sizes 131072 1048576 --out speed.jsonl --deadline 480
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_strategies import artifact_bytes, open_strategy, synthetic_cache  # noqa: E402

from topk_decode.store import open_cache  # noqa: E402


def configs(n: int, skip_hnsw: bool = False) -> list[tuple[str, str, dict]]:
    """What to time at context length n (HNSW builds take minutes per head at 1M: 128K only)."""
    rows = [
        ("flat torch", "flat", {"backend": "torch"}),
        ("flat faiss SQbf16", "flat", {}),
        ("quest page=16", "quest", {"dense_layers": 0}),
        ("tokenselect no reuse", "tokenselect", {"threshold": 2.0}),
        ("ivf nlist=1024 nprobe=32", "ivf", {"nlist": 1024, "nprobe": 32}),
        ("ivf nlist=1024 nprobe=128", "ivf", {"nlist": 1024, "nprobe": 128}),
    ]
    if n <= 262144 and not skip_hnsw:
        rows.append(("hnsw M=32 ef=64", "hnsw", {"efSearch": 64}))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--deadline", type=float, default=480.0, help="seconds; later configs are skipped")
    p.add_argument("--out", default="speed.jsonl")
    p.add_argument("--skip-hnsw", action="store_true", help="HNSW's search does not depend on the query dtype")
    args = p.parse_args()
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="speed-"))
    out = open(args.out, "a")
    print(
        json.dumps({"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()}), file=out
    )
    for n in args.sizes:
        t = time.perf_counter()
        cache = synthetic_cache(work / f"c{n}", n, 1, args.kv_heads, args.head_dim)
        ckv = open_cache(cache, verify=False)
        print(f"# synthetic cache n={n} in {time.perf_counter() - t:.1f}s", flush=True)
        gen = torch.Generator().manual_seed(1)
        # bf16-valued queries, as a bf16 model produces them: flat's half-precision scan requires it
        # (fp32 queries fall back to a blocked fp32 scan, 8-30x slower: measured in the first run)
        qs = [
            torch.randn(args.kv_heads, args.group, args.head_dim, generator=gen).bfloat16().float()
            for _ in range(args.repeat + 1)
        ]
        for label, name, options in configs(n, args.skip_hnsw):
            if time.perf_counter() - t_start > args.deadline:
                row = {"n": n, "config": label, "skipped": "deadline"}
            else:
                strat, build_s = open_strategy(ckv, name, options, 4, n - 64)
                strat.select(0, qs[0], args.k, strat.new_state())  # warm-up: pages in the map
                t0 = time.perf_counter()
                for q in qs[1:]:
                    strat.select(0, q, args.k, strat.new_state())
                ms = 1e3 * (time.perf_counter() - t0) / args.repeat
                row = {
                    "n": n,
                    "config": label,
                    "k": args.k,
                    "ms_per_layer": round(ms, 2),
                    "ms_per_step_32_layers": round(32 * ms, 1),
                    "build_s_per_layer": round(build_s, 1),
                    "artifact_bytes_per_layer": artifact_bytes(cache, name),
                }
            print(json.dumps(row), flush=True)
            print(json.dumps(row), file=out, flush=True)


if __name__ == "__main__":
    main()
