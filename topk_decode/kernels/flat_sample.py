"""The cut that flat's numba scan starts from (kernels/flat_scan.py): per KV head and query, a guess of the score
that about SURVIVORS_PER_K·k of the head's rows reach, from an evenly strided sample of its rows.

A guess, not a bound: flat_kernel.search checks that at least k rows got through and scans a head again
without it where not. Sampling the whole head rather than each block lets each of B blocks keep about
2·k/B rows instead of 2·k (docs/BENCHMARKS.md "flat's numba scan at 61–74 % of the DRAM floor").
"""

from __future__ import annotations

import numpy as np

from topk_decode.kernels.dots import GROUP, dot4
from topk_decode.kernels.jit import jit, pjit, prange, prefetch_row

# The sample's cut is its _SAMPLE_RANK-th largest score, with the stride that aims it at SURVIVORS_PER_K·k
# rows of the head. Two, not one: a guess that lets fewer than k rows through costs the head a second pass
# (a 4-sigma miss at rank 64 on a random order). No sample where it would be over 1/_MIN_STRIDE of the rows.
_SAMPLE_RANK = 64
SURVIVORS_PER_K = 2
_MIN_STRIDE = 8
_SAMPLE_AHEAD = 8  # sample rows prefetched ahead


def sample_plan(m: int, k: int) -> tuple[int, int, int]:
    """(stride, rows, rank) of the cut's sample for a top-k of m rows: the rank-th largest score of every
    stride-th row; rows = 0 where no sample pays (it would be over 1/_MIN_STRIDE of the rows, or too few)."""
    rank = min(_SAMPLE_RANK, k)
    stride = SURVIVORS_PER_K * k // rank
    ns = m // stride if stride >= _MIN_STRIDE else 0
    return stride, (ns if ns >= 4 * rank else 0), rank


@jit
def _sample_rows(keys, qp, s, stride, r0, r1, sc):
    """sc[:, r] = the scores of sample row r (key row s + r·stride) against every padded query, r in [r0, r1)."""
    for r in range(r0, r1):
        if r + _SAMPLE_AHEAD < r1:  # rows far apart: no hardware prefetcher follows them
            prefetch_row(keys, s + (r + _SAMPLE_AHEAD) * stride)
        for i in range(0, qp.shape[0], GROUP):
            sc[i, r], sc[i + 1, r], sc[i + 2, r], sc[i + 3, r] = dot4(keys, s + r * stride, qp, i)


@pjit
def _sample_par(keys, qp, s, stride, rank, parts, Q, sc, spec):
    """Every head's sample cut (the rank-th largest score of its sample), each head's sample split into
    `parts` tasks.

    Args:
        keys: (Hkv, N, D) uint16 bits; qp: (Hkv, Qp, D) padded queries; s, stride: the sample's first row
        and step; rank: which largest score is the cut; parts: tasks per head; Q: real queries;
        sc: (Hkv, Qp, ns) float32 work space; spec: (Hkv, Q) float32 out.
    """
    hkv, ns = keys.shape[0], sc.shape[2]
    per = -(-ns // parts)
    for w in prange(hkv * parts):
        h, p = w // parts, w % parts
        _sample_rows(keys[h], qp[h], s, stride, p * per, min(ns, (p + 1) * per), sc[h])
    for w in prange(hkv * Q):
        h, i = w // Q, w % Q
        spec[h, i] = np.partition(sc[h, i], ns - rank)[ns - rank]


def head_cuts(keys: np.ndarray, q: np.ndarray, lo: int, hi: int, k: int, workers: int) -> np.ndarray:
    """(Hkv, Q) float32 each head's sampled cut over rows [lo, hi) (`sample_plan`), −inf where none pays.

    Args:
        keys: (Hkv, N, D) uint16 bits; q: (Hkv, Q, D) queries as `search` scans them; workers: threads.
    """
    hkv, Q = q.shape[0], q.shape[1]
    spec = np.full((hkv, Q), -np.inf, dtype=np.float32)
    stride, ns, rank = sample_plan(hi - lo, k)
    if ns == 0:
        return spec
    qn = -(-Q // GROUP) * GROUP
    qp = np.zeros((hkv, qn, q.shape[2]), dtype=q.dtype)  # (Hkv, Qp, D) padded
    qp[:, :Q] = q
    sc = np.empty((hkv, qn, ns), dtype=np.float32)  # (Hkv, Qp, ns) the samples' scores
    parts = max(1, min(workers // hkv, ns // (4 * rank)))
    _sample_par(keys, qp, lo, stride, rank, parts, Q, sc, spec)
    return spec
