"""Where one layer's time goes in flat's numba search (flat_kernel.search): the sampled cuts, the scan,
the check and rescan, the merge, and the rest (Python, allocations), in ms per layer over cold layers of
synthetic keys (Llama-3-8B shape at 128K by default), beside the same process's DRAM floor.

Usage: python scripts/flat_search_parts.py [--threads 16] [--layers 16] [--n 131072] [--kv-heads 8] [--group 4]
Figures: docs/BENCHMARKS.md run 20.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's package, not an installed one
from topk_decode.bench.synthetic import synthetic_kv  # noqa: E402
from topk_decode.cpus import usable_cpus  # noqa: E402
from topk_decode.index import flat_kernel  # noqa: E402
from scan_bandwidth import dram_bandwidth  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=usable_cpus())
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    dram = dram_bandwidth()["gb_s"]
    ckv = synthetic_kv(a.layers, a.kv_heads, 128, a.n, torch.bfloat16, 0)
    gen = torch.Generator().manual_seed(1)
    qs = [torch.randn((a.kv_heads, a.group, 128), generator=gen).bfloat16().float() for _ in range(a.layers)]
    for layer in range(a.layers):   # compile, then one untimed round
        flat_kernel.search(ckv.keys[layer], qs[layer], a.k, 4, a.n - 64, a.threads)
    for rep in range(a.reps):
        parts: dict = {}
        for layer in range(a.layers):
            flat_kernel.search(ckv.keys[layer], qs[layer], a.k, 4, a.n - 64, a.threads, parts=parts)
        ms = {name: round(1e3 * t / a.layers, 3) for name, t in parts.items()}
        ms["rest"] = round(ms["total"] - sum(v for n, v in ms.items() if n != "total"), 3)
        key_gb_s = a.kv_heads * a.n * 128 * 2 / (ms["total"] / 1e3) / 1e9
        print(json.dumps({"rep": rep, "threads": a.threads, "n": a.n, "kv_heads": a.kv_heads, "group": a.group,
                          "k": a.k, "ms_per_layer": ms, "key_gb_s": round(key_gb_s, 1), "dram_gb_s": dram,
                          "pct_of_dram": round(100 * key_gb_s / dram, 1)}), flush=True)


if __name__ == "__main__":
    main()
