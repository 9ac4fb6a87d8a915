"""Probe: how fast can the GPU itself gather scattered KV rows that stay in the host's RAM?

The decode step today searches and attends the CPU store on the CPU, layer by layer, between the GPU's parts
(docs/BENCHMARKS.md: at 128K on 8 cores the CPU's search is ~56 of ~74 ms a token). If the GPU can read the rows it
needs straight from pinned host memory (unified addressing: a pinned page's device address is its host address), the
CPU leaves the critical path. This times, per "layer" of Llama-3-8B at 128K (8 KV heads × 4 % of 131,072 rows = 41,943
rows of 128 bytes: one int8 key or value row each):

- gpu_gather: torch.index_select on a CUDA view of pinned host memory (the rows cross PCIe as the kernel reads them);
- cpu_gather_copy: the CPU gathers the rows into a pinned buffer (torch, every thread), then one copy to the GPU;
- copy_contiguous: one contiguous copy of the same bytes (PCIe's own rate for them);
for rows drawn one by one at random and in runs of 16 and 64 (routed's clusters), with the rows checked equal.

    python scripts/probe_host_gather.py [--gib 4] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from topk_decode.bench.measure import cuda_median_ms


def cuda_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the pinned host tensor's memory (cupy's UnownedMemory, then DLPack)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(host.data_ptr(), host.numel() * host.element_size(), host, 0)
    arr = cupy.ndarray(tuple(host.shape), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    return torch.from_dlpack(arr)


def rows_drawn(n_rows: int, count: int, run: int, gen: torch.Generator) -> torch.Tensor:
    """count row indices in runs of `run` consecutive rows starting at random places."""
    starts = torch.randint(0, n_rows - run, (-(-count // run),), generator=gen)
    return (starts[:, None] + torch.arange(run)).flatten()[:count]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0, help="pinned host memory to draw the rows from")
    p.add_argument("--rows", type=int, default=8 * 131072 * 4 // 100, help="rows per gather (a layer's read)")
    p.add_argument("--row-bytes", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    n_rows = int(a.gib * 2**30) // a.row_bytes
    t = time.perf_counter()
    host = torch.empty((n_rows, a.row_bytes), dtype=torch.uint8, pin_memory=True)
    host.view(torch.int32).random_()
    alloc_s = time.perf_counter() - t
    try:
        dev_view = cuda_view(host)
    except Exception as e:  # no cupy, or no unified addressing: the CPU's gather alone is timed
        dev_view, report_error = None, f"{type(e).__name__}: {e}"
    else:
        report_error = None
    gen = torch.Generator().manual_seed(0)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host_gib": a.gib,
        "rows": a.rows,
        "row_bytes": a.row_bytes,
        "pin_and_fill_s": round(alloc_s, 2),
        "cases": [],
        "gpu_view_error": report_error,
    }
    staging = torch.empty((a.rows, a.row_bytes), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty((a.rows, a.row_bytes), dtype=torch.uint8, device="cuda")
    for run in (1, 16, 64):
        idx = rows_drawn(n_rows, a.rows, run, gen)
        idx_dev = idx.cuda()
        same = dev_view is not None and bool(torch.equal(dev_view.index_select(0, idx_dev).cpu(), host[idx]))

        def cpu_gather_copy():
            torch.index_select(host, 0, idx, out=staging)
            dst.copy_(staging, non_blocking=True)

        mb = a.rows * a.row_bytes / 1e6
        case = {
            "run": run,
            "equal": same,
            "gpu_gather_ms": round(cuda_median_ms(lambda i: dev_view.index_select(0, idx_dev), a.reps), 4)
            if same
            else None,
            "cpu_gather_copy_ms": round(cuda_median_ms(lambda i: cpu_gather_copy(), a.reps), 4),
            "copy_contiguous_ms": round(cuda_median_ms(lambda i: dst.copy_(staging, non_blocking=True), a.reps), 4),
        }
        for k in ("gpu_gather", "cpu_gather_copy", "copy_contiguous"):
            case[k + "_gb_s"] = round(mb / case[k + "_ms"], 2) if case[k + "_ms"] else None
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
