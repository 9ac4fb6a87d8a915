"""flat's numba backend, the Python side: a layer's tensors in, one exact top-k per query out, through the
compiled (head, block of keys) scan of topk_decode/kernels/flat_scan.py (how it works: that module's docstring).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from topk_decode.index.base import bf16_bits
from topk_decode.kernels import dots, flat_scan, jit
from topk_decode.kernels.flat_sample import head_cuts
from topk_decode.kernels.flat_scan import AHEAD, Candidates, Cuts, Tasks

# Tasks per pool worker when the block size is left to `search`: few, long tasks keep each running
# threshold close to the final k-th score (fewer insertions and compactions, fewer candidates to
# merge); two rather than one so that a worker delayed by other work does not hold up the whole layer.
TASKS_PER_WORKER = 2
MIN_BLOCK = 1 << 12  # keys per task at least (1 MiB at D=128): smaller tasks only add setup and merging


def warm_up(head_dim: int = 2, dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile the kernels now (seconds on a first run without numba's disk cache), not inside a step:
    the fp32 path for keys of `dtype`, and for bf16 keys the bf16 one where it is available for rows of `head_dim`.
    2,048 rows and k = 256: the smallest search that samples its cut (`flat_sample.sample_plan`)."""
    search(torch.zeros((1, 2048, 2), dtype=dtype), torch.zeros((1, 1, 2)), 256, 0, 2048, 1, dot="fp32")
    # the fp32 path's types do not depend on D; the bf16 one needs D % 32 == 0
    if dtype == torch.bfloat16 and dots.bf16_available(head_dim):
        keys = torch.zeros((1, 2048, head_dim), dtype=torch.bfloat16)
        search(keys, torch.zeros((1, 1, head_dim)), 256, 0, 2048, 1, dot="bf16")


def bf16_dot_applies(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `search` scores these (Hkv, N, D) keys and (Hkv, Q, D) float32 queries with the hardware bf16
    dot product: it is available here, the key rows are contiguous and every query is bf16-exact (the
    decoder's are)."""
    return (
        keys.dtype == torch.bfloat16
        and dots.bf16_available(q.shape[-1])
        and keys.stride(-1) == 1
        and torch.equal(q.to(torch.bfloat16).float(), q)
    )


def task_block(m: int, hkv: int, workers: int) -> int:
    """Keys per task so that each worker gets about TASKS_PER_WORKER tasks of equal size.

    Args:
        m: searchable keys per head; hkv: KV heads; workers: threads.
    """
    chunks = max(1, -(-workers * TASKS_PER_WORKER // hkv))  # tasks per head
    return max(MIN_BLOCK, -(-m // chunks))


def search(
    keys: torch.Tensor,
    q: torch.Tensor,
    k: int,
    lo: int,
    hi: int,
    threads: int = 1,
    block: int | None = None,
    ahead: int = AHEAD,
    dot: str = "auto",
    parts: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of every query over keys[:, lo:hi], (head, block) tasks in parallel on numba's threads.

    Args:
        keys: (Hkv, N, D) bf16 or int8 keys (strategy.py's `NUMBA_KEY_DTYPES`), e.g. a memory map; q: (Hkv, Q, D) float32 queries (for
            int8 keys scaled by their key scales: `ContextKV.search_queries`).
        k: results per query; lo, hi: the searchable rows [lo, hi).
        threads: numba threads to use; block: keys per task (None: `task_block`).
        ahead: rows prefetched ahead of the dot products (a tuning knob: docs/BENCHMARKS.md "flat's numba scan against the DRAM floor").
        dot: "bf16" scores with the hardware bf16 dot product (kernels/dots.py; the queries are rounded to bf16),
            "fp32" widens the keys and runs FMAs; "auto": bf16 where `bf16_dot_applies` (the same scores as
            fp32 up to summation order), else fp32.
        parts: if given, seconds spent in each pass are added to it ("cuts", "scan", "rescan", "merge",
            "total").
    Returns:
        ids (Hkv, Q, k) int64 positions in [lo, hi) (−1 in empty slots: only where k > hi − lo), scores
        (Hkv, Q, k) float32 exact q·k (0 in empty slots); in no particular order within a query.
    """
    t0 = time.perf_counter()
    hkv, n, _ = keys.shape
    Q = q.shape[1]
    lo, hi = max(0, lo), min(n, hi)
    ids = torch.full((hkv, Q, k), -1, dtype=torch.int64)
    scores = torch.zeros((hkv, Q, k), dtype=torch.float32)
    if hi <= lo or k <= 0:
        return ids, scores
    threads = max(1, threads)
    block = block or task_block(hi - lo, hkv, threads)
    starts = np.arange(lo, hi, block, dtype=np.int64)
    nb = len(starts)
    kb = min(k, block, hi - lo)
    task_h = np.repeat(np.arange(hkv, dtype=np.int64), nb)  # (T,) head-major: a head's blocks in order
    task_s = np.tile(starts, hkv)
    task_e = np.minimum(task_s + block, hi)
    if dot == "auto":
        dot = "bf16" if bf16_dot_applies(keys, q) else "fp32"
    q_np = bf16_bits(q.to(torch.bfloat16).contiguous()) if dot == "bf16" else q.contiguous().numpy()
    kbits = bf16_bits(keys) if keys.dtype == torch.bfloat16 else keys.numpy()
    workers = min(threads, len(task_h))
    jit.set_threads(workers)
    t1 = time.perf_counter()
    spec = head_cuts(kbits, q_np, lo, hi, k, workers)  # (Hkv, Q) sampled cuts, −inf: none
    t2 = time.perf_counter()
    bar = np.full((hkv, Q), -np.inf, dtype=np.float32)  # (Hkv, Q) shared cuts
    cand_i = np.empty((hkv * nb, Q, kb), dtype=np.int64)  # (T, Q, kb)
    cand_s = np.empty((hkv * nb, Q, kb), dtype=np.float32)
    task_o = np.arange(len(task_h), dtype=np.int64)
    cands, cuts = Candidates(cand_i, cand_s), Cuts(bar, spec)
    flat_scan.scan_par(kbits, q_np, Tasks(task_h, task_s, task_e, task_o), workers, k, cuts, cands, ahead)
    t3 = time.perf_counter()
    short = flat_scan.short_heads(cand_i.reshape(hkv, nb, Q, kb), spec, min(k, hi - lo))
    if short.any():  # a guess let too few rows through (rare on real keys): those heads again, without one
        spec[short] = -np.inf
        again = np.flatnonzero(np.repeat(short, nb))
        jit.set_threads(min(threads, len(again)))
        flat_scan.scan_par(
            kbits,
            q_np,
            Tasks(task_h[again], task_s[again], task_e[again], again),
            min(threads, len(again)),
            k,
            cuts,
            cands,
            ahead,
        )
        jit.set_threads(workers)
    t4 = time.perf_counter()
    flat_scan.merge_par(
        Candidates(cand_i.reshape(hkv, nb, Q, kb), cand_s.reshape(hkv, nb, Q, kb)),
        bar,
        k,
        Candidates(ids.numpy(), scores.numpy()),
    )
    if parts is not None:
        t5 = time.perf_counter()
        for name, dt in (
            ("cuts", t2 - t1),
            ("scan", t3 - t2),
            ("rescan", t4 - t3),
            ("merge", t5 - t4),
            ("total", t5 - t0),
        ):
            parts[name] = parts.get(name, 0.0) + dt
    return ids, scores
