"""routed's search for one layer as one compiled function per KV head (numba): `routed --opt kernel=numba`.

The torch path (routed.py `route` + `select`) is ~30 small tensor ops per layer; on a many-core host
each is a parallel region of its own, and together they cost several times what the few MB they read
take (docs/BENCHMARKS.md, "Where routed's step goes"). Here one KV head's whole search — routing
against the centroids, the walk over clusters up to the budget, the exact fp32 scan of their keys and
the top-k — is one compiled function that releases the GIL, and the heads run in parallel on the
strategy's thread pool. Same rules as the torch path: a cluster's priority is the largest share of
attention mass any of the head's queries gives it (softmax over s·q·μ_c + bias_c), clusters are read
in that order until `budget` keys are read, sinks/tail rows are never returned.

Scores are exact fp32 dot products of the fp32 query with the key (bf16 keys widen exactly); only the
summation order differs from torch's matmul (agreement to ~1e-6 relative, tests/test_routed_kernel.py).
Opt-in, not the default: its threads share the cores with torch's OpenMP workers, which spin after
every parallel torch op; in the decoder that starves them unless OMP_WAIT_POLICY=PASSIVE is set before
the process starts (docs/BENCHMARKS.md, run 12).
"""

from __future__ import annotations

import math

import numpy as np
import torch

try:  # optional: without numba, routed runs its torch path
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None

# Reassociation lets the dot products use SIMD lanes; no "ninf"/"nnan": −inf marks rows and clusters.
_FASTMATH = {"reassoc", "contract"}
# Keys it reads: bf16 (what GPU prefills write). fp32/fp16 caches take the torch path.
KEY_DTYPES = (torch.bfloat16,)


def available() -> bool:
    """Whether the compiled search can run (numba is importable)."""
    return numba is not None


def _head_search(keys, pos, outside, offsets, cent, bias, qh, budget, k, scale, ids_out, sc_out):
    """One KV head: route, read clusters up to `budget` keys, exact scores, top-k. Returns keys read.

    Args:
        keys: (N, D) the head's cluster-contiguous bf16 keys as their uint16 bits.
        pos: (N,) int64 original positions; outside: (N,) bool rows never returned (sinks, tail).
        offsets: (C + 1,) int64 cluster c = rows [offsets[c], offsets[c+1]).
        cent: (C, D) float32 centroids; bias: (C,) float32 added to s·q·μ_c (−inf: never routed).
        qh: (Q, D) float32 queries; budget: keys to read (at least); k: results per query.
        scale: softmax scale s; ids_out, sc_out: (Q, K) outputs (−1 / 0 in unfilled slots).
    """
    n, d = keys.shape
    C = cent.shape[0]
    Q = qh.shape[0]
    # routing: one pass over the centroids for all queries, then each query's log-softmax
    lg = np.empty((Q, C), dtype=np.float32)
    for c in range(C):
        for i in range(Q):
            acc = np.float32(0.0)
            for j in range(d):
                acc += qh[i, j] * cent[c, j]
            lg[i, c] = acc * scale + bias[c]
    share = np.full(C, -np.inf, dtype=np.float32)
    for i in range(Q):
        mx = -np.inf
        for c in range(C):
            mx = max(mx, lg[i, c])
        z = 0.0
        for c in range(C):
            z += math.exp(lg[i, c] - mx)
        lz = mx + math.log(z)
        for c in range(C):
            share[c] = max(share[c], lg[i, c] - lz)
    # clusters by share: sort only a partition of twice the expected count (all of them if that is short)
    neg = -share
    guess = min(C, 2 * ((budget * C + n - 1) // n) + 16)
    if guess < C:
        cut = np.partition(neg, guess)[guess]
        cand = np.nonzero(neg <= cut)[0]
        order = cand[np.argsort(neg[cand])]
        reach = 0
        for c in order:
            reach += offsets[c + 1] - offsets[c]
        if reach < budget:
            order = np.argsort(neg)
    else:
        order = np.argsort(neg)
    m = 0
    taken = 0
    while taken < order.shape[0] and m < budget:
        c = order[taken]
        m += offsets[c + 1] - offsets[c]
        taken += 1
    # exact fp32 scores of every row read
    scores = np.empty((Q, m), dtype=np.float32)
    rows = np.empty(m, dtype=np.int64)
    widened = np.empty(d, dtype=np.uint32)
    r = 0
    for t in range(taken):
        c = order[t]
        for row in range(offsets[c], offsets[c + 1]):
            rows[r] = row
            if outside[row]:
                for i in range(Q):
                    scores[i, r] = -np.inf
            else:
                for j in range(d):
                    widened[j] = np.uint32(keys[row, j]) << 16          # bf16 → fp32 is exact
                kf = widened.view(np.float32)
                for i in range(Q):
                    acc = np.float32(0.0)
                    for j in range(d):
                        acc += qh[i, j] * kf[j]
                    scores[i, r] = acc
            r += 1
    # top-k by the k-th largest score (a partition), ties at it filled in row order
    K = ids_out.shape[1]
    for i in range(Q):
        s = scores[i]
        n_valid = 0
        for r in range(m):
            if s[r] > -np.inf:
                n_valid += 1
        kk = min(K, n_valid)
        o = 0
        if kk > 0:
            cut = np.partition(s, m - kk)[m - kk]
            for r in range(m):
                if s[r] > cut:
                    ids_out[i, o] = pos[rows[r]]
                    sc_out[i, o] = s[r]
                    o += 1
            for r in range(m):
                if o >= kk:
                    break
                if s[r] == cut:
                    ids_out[i, o] = pos[rows[r]]
                    sc_out[i, o] = s[r]
                    o += 1
        while o < K:
            ids_out[i, o] = -1
            sc_out[i, o] = 0.0
            o += 1
    return m


_compiled = None


def _kernel():
    """The compiled `_head_search` (compiled on first use; cached on disk by numba where it can write)."""
    global _compiled
    if _compiled is None:
        _compiled = numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)(_head_search)
    return _compiled


def warm_up() -> None:
    """Compile the kernel now (seconds on a first run without numba's disk cache), not inside a decode step."""
    ids, sc = np.empty((1, 1), np.int64), np.empty((1, 1), np.float32)
    _kernel()(np.zeros((4, 2), np.uint16), np.arange(4), np.zeros(4, np.bool_), np.array([0, 2, 4]),
                  np.zeros((2, 2), np.float32), np.zeros(2, np.float32), np.zeros((1, 2), np.float32),
                  2, 1, np.float32(1.0), ids, sc)


def search_layer(keys: torch.Tensor, pos: torch.Tensor, outside: torch.Tensor, offsets: torch.Tensor,
                 cent: torch.Tensor, bias: torch.Tensor, q: torch.Tensor, budget: int, k: int, scale: float,
                 pool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """routed's search of one layer, every KV head in parallel on `pool`.

    Args:
        keys: (Hkv, N, D) cluster-contiguous bf16 keys (KEY_DTYPES).
        pos: (Hkv, N) int64 original positions; outside: (Hkv, N) bool rows never returned.
        offsets: (Hkv, C + 1) int64; cent: (Hkv, C, D) float32; bias: (Hkv, C) float32.
        q: (Hkv, Q, D) float32 queries; budget: keys to read per head (at least); k: results per query.
        scale: softmax scale; pool: a `threads.HeadPool`.
    Returns:
        ids (Hkv, Q, k) int64 (−1 in empty slots), scores (Hkv, Q, k) float32, keys read in all heads.
    """
    hkv, Q, _ = q.shape
    keys_np = keys.view(torch.int16).numpy().view(np.uint16)
    arrays = [t.numpy() for t in (pos, outside, offsets, cent, bias, q.contiguous())]
    ids = np.empty((hkv, Q, k), dtype=np.int64)
    scores = np.empty((hkv, Q, k), dtype=np.float32)
    fn, s = _kernel(), np.float32(scale)
    read = pool.map(lambda h: fn(keys_np[h], *(a[h] for a in arrays), budget, k, s, ids[h], scores[h]),
                    range(hkv))
    return torch.from_numpy(ids), torch.from_numpy(scores), int(sum(read))
