"""Does backing the context KV with transparent huge pages speed up the decode's random row reads?

    python scripts/hugepage_probe.py --gib 8 --out prof/

Allocates two copies of `--gib` GiB of bf16 rows (Hkv·N, D) laid out as L layers: one in ordinary
anonymous memory (4 KiB pages), one in an anonymous mapping advised MADV_HUGEPAGE before it is first
touched. Then times, rotating over the layers so that every call is cache-cold as in a decode step:
the context part's weighted sum (embedding_bag over 32 bags × 1024 random rows) and the search's
candidate gather (index_select of 40,960 random rows). Prints JSON with AnonHugePages before/after.
"""

from __future__ import annotations

import argparse
import json
import mmap
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def anon_huge(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous mapping advised for huge pages before first touch, as a uint8 tensor."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return buf, torch.frombuffer(buf, dtype=torch.uint8)


def meminfo(key: str) -> int:
    """A /proc/meminfo field in kB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def timed(fn, layers: int, reps: int) -> float:
    """Mean µs per call, rotating over the layers."""
    fn(0)
    t = time.perf_counter()
    for i in range(reps):
        fn(i % layers)
    return 1e6 * (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default="prof")
    a = ap.parse_args()
    D, hkv, bags, K, cand = 128, 8, 32, 1024, 40960
    rows_per_layer = int(a.gib * 2**30) // (2 * D) // a.layers
    n = rows_per_layer // hkv
    res: dict = {"gib": a.gib, "layers": a.layers, "tokens_per_layer": n, "threads": torch.get_num_threads(),
                 "thp_enabled": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()}
    before = meminfo("AnonHugePages")
    small = torch.empty((a.layers * rows_per_layer, D), dtype=torch.bfloat16)
    small.normal_()
    _keep, raw = anon_huge(a.layers * rows_per_layer * D * 2)
    huge = raw.view(torch.bfloat16).view(a.layers * rows_per_layer, D)
    huge.copy_(small)
    res["anon_huge_pages_kb"] = meminfo("AnonHugePages") - before
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, rows_per_layer, (bags * K,), generator=gen) + l * rows_per_layer for l in range(a.layers)]
    cands = [torch.randint(0, rows_per_layer, (cand,), generator=gen) + l * rows_per_layer for l in range(a.layers)]
    offsets = torch.arange(0, bags * K, K)
    w = torch.rand(bags * K).to(torch.bfloat16)
    out = torch.empty((cand, D), dtype=torch.bfloat16)
    for name, store in (("4k", small), ("huge", huge)):
        res[f"embedding_bag_us_{name}"] = timed(
            lambda l: F.embedding_bag(rows[l], store, offsets, mode="sum", per_sample_weights=w), a.layers, 64)
        res[f"index_select_us_{name}"] = timed(
            lambda l: torch.index_select(store, 0, cands[l], out=out), a.layers, 64)
    text = json.dumps(res, indent=1)
    print(text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "hugepage_probe.json").write_text(text)


if __name__ == "__main__":
    main()
