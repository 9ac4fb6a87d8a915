"""flat's exact scan as compiled functions (numba): `flat --opt backend=numba`.

The torch backend scores all keys in bf16 with one batched matmul, then selects candidates and
rescores them in fp32 (flat.py `_half_scan`): several passes over (Hkv, Q, N) score buffers, and a
matmul whose CPU kernel reads the keys well below the DRAM bandwidth when Q is 4-7 rows. Here each
task (one KV head × one contiguous block of keys) reads its block once: the bf16 rows are widened
exactly to fp32 a small tile at a time, dotted against all of the head's queries (exact fp32 scores),
and kept only when they beat the query's running threshold, so almost every key costs one compare
after its dot products. The threshold is the task's own k-th best so far, raised further by a cut
that another block of the same head has published (`bar`): both are lower bounds of the final k-th
score, so nothing rejected could have been returned. A second pass merges each (head, query)'s
block candidates into the exact top-k. Tasks run on the strategy's thread pool; the compiled
functions release the GIL.

Result: the top k by (exact fp32 score descending, position ascending): ties at the k-th score go to
the lower positions, independent of thread timing. The k ids are returned in no particular order.
Scores are exact fp32 dot products of the fp32 query with the key (bf16 widens exactly); only the
summation order differs from torch's matmul (~1e-6 relative).
"""

from __future__ import annotations

import numpy as np
import torch

from topk_decode.index.compiled import bits, jit

# Tasks per pool worker when the block size is left to `search`: few, long tasks keep each running
# threshold close to the final k-th score (fewer insertions and compactions, fewer candidates to
# merge); two rather than one so that a worker delayed by other work does not hold up the whole layer.
TASKS_PER_WORKER = 2
MIN_BLOCK = 1 << 12   # keys per task at least (1 MiB at D=128): smaller tasks only add setup and merging
_TILE = 16     # rows widened at once: a (16, D) fp32 tile stays in L1 while every query reads it
_QGROUP = 4    # queries dotted together: each widened element is loaded once for four FMAs


@jit
def _keep_top(cs, cr, n, kb):
    """Compact the first n candidates to their top kb by (score desc, insertion order); returns the cut.

    Args:
        cs: (cap,) float32 scores; cr: (cap,) int64 positions, in insertion (= position) order.
        n: candidates held (> kb); kb: how many to keep.
    """
    cut = np.partition(cs[:n], n - kb)[n - kb]   # the kb-th largest score
    above = 0
    for x in range(n):
        if cs[x] > cut:
            above += 1
    ties = kb - above                             # candidates equal to the cut that stay: the earliest
    o = 0
    for x in range(n):                            # in place: o ≤ x, so nothing unread is overwritten
        v = cs[x]
        if v > cut or (v == cut and ties > 0):
            if v == cut:
                ties -= 1
            cs[o] = v
            cr[o] = cr[x]
            o += 1
    return cut


@jit
def _block_topk(keys, q, s, e, k, bar, ids_out, sc_out):
    """One task: the exact top-kb of rows [s, e) of one head's keys for each of its queries.

    Args:
        keys: (N, D) the head's bf16 keys as their uint16 bits.
        q: (Q, D) float32 queries; s, e: the block's rows; k: results wanted per query in the end.
        bar: (Q,) float32 cuts published by this head's blocks (−inf: none yet); shared between threads.
        ids_out: (Q, kb) int64 positions out, kb = min(k, block size); sc_out: (Q, kb) float32 scores out.
            Unfilled slots get −1 / −inf.
    """
    d = keys.shape[1]
    Q = q.shape[0]
    kb = ids_out.shape[1]
    publish = kb >= k                       # a cut of k candidates bounds the final k-th score
    qp_n = (Q + _QGROUP - 1) // _QGROUP * _QGROUP
    qp = np.zeros((qp_n, d), dtype=np.float32)        # (Qp, D) zero rows pad the last group
    qp[:Q] = q
    wide = np.empty(_TILE * d, dtype=np.uint32)       # (TILE·D,) widened bits, viewed once as fp32
    kf = wide.view(np.float32)
    sc = np.empty((qp_n, _TILE), dtype=np.float32)    # (Qp, TILE) scores of the tile
    cap = 2 * kb + 64                                 # room to insert before a compaction
    cs = np.empty((Q, cap), dtype=np.float32)         # (Q, cap) candidate scores
    cr = np.empty((Q, cap), dtype=np.int64)           # (Q, cap) candidate positions
    cnt = np.zeros(Q, dtype=np.int64)
    thr = np.full(Q, -np.inf, dtype=np.float32)       # each query's own cut: keep only scores above it
    for t in range(s, e, _TILE):
        m = min(_TILE, e - t)
        for r in range(m):
            for j in range(d):
                wide[r * d + j] = np.uint32(keys[t + r, j]) << 16      # bf16 → fp32 is exact
        for i in range(0, qp_n, _QGROUP):
            q0, q1, q2, q3 = qp[i], qp[i + 1], qp[i + 2], qp[i + 3]
            for r in range(m):
                x = kf[r * d:(r + 1) * d]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for j in range(d):
                    a0 += q0[j] * x[j]
                    a1 += q1[j] * x[j]
                    a2 += q2[j] * x[j]
                    a3 += q3[j] * x[j]
                sc[i, r], sc[i + 1, r], sc[i + 2, r], sc[i + 3, r] = a0, a1, a2, a3
        for i in range(Q):
            own, shared = thr[i], bar[i]
            for r in range(m):
                v = sc[i, r]
                # > own: ties at the own cut lose to the earlier rows kept; ≥ shared: a tie with another
                # block's cut may still be needed (keeps the result independent of thread timing)
                if v > own and v >= shared:
                    c = cnt[i]
                    cs[i, c] = v
                    cr[i, c] = t + r
                    cnt[i] = c + 1
                    if c + 1 == cap:
                        own = _keep_top(cs[i], cr[i], cap, kb)
                        thr[i] = own
                        cnt[i] = kb
                        if publish and own > bar[i]:   # racy max: any published cut is a valid bound
                            bar[i] = own
    for i in range(Q):
        n = cnt[i]
        if n > kb:
            cut = _keep_top(cs[i], cr[i], n, kb)
            n = kb
            if publish and cut > bar[i]:
                bar[i] = cut
        for o in range(n):
            ids_out[i, o] = cr[i, o]
            sc_out[i, o] = cs[i, o]
        for o in range(n, kb):
            ids_out[i, o] = -1
            sc_out[i, o] = -np.inf


@jit
def _scan_share(keys, q, task_h, task_s, task_e, first, step, k, bar, ids_out, sc_out):
    """One worker's share of the tasks: tasks first, first + step, ... (one call per pool thread).

    Args:
        keys: (Hkv, N, D) uint16 bits; q: (Hkv, Q, D) float32.
        task_h, task_s, task_e: (T,) int64 head and rows [s, e) of each task.
        first, step: this worker's tasks; k: results per query.
        bar: (Hkv, Q) float32 shared cuts; ids_out, sc_out: (T, Q, kb) per-task candidates.
    """
    for t in range(first, task_h.shape[0], step):
        h = task_h[t]
        _block_topk(keys[h], q[h], task_s[t], task_e[t], k, bar[h], ids_out[t], sc_out[t])


@jit
def _merge_head(ids_in, sc_in, bar, k, ids_out, sc_out):
    """One head's exact top-k over its blocks' candidates, ties to the lower positions.

    Args:
        ids_in, sc_in: (B, Q, kb) the head's blocks' candidates, blocks in position order (−1 / −inf: empty).
        bar: (Q,) the head's published cuts (candidates below them cannot be in the top k).
        k: results per query; ids_out, sc_out: (Q, k) out (−1 / 0 in unfilled slots).
    """
    nb, Q, kb = ids_in.shape
    cs = np.empty(nb * kb, dtype=np.float32)   # (B·kb,) one query's candidates, position order
    cr = np.empty(nb * kb, dtype=np.int64)
    for i in range(Q):
        n = 0
        low = bar[i]
        for b in range(nb):
            for o in range(kb):
                if ids_in[b, i, o] >= 0 and sc_in[b, i, o] >= low:
                    cs[n] = sc_in[b, i, o]
                    cr[n] = ids_in[b, i, o]
                    n += 1
        if n > k:
            _keep_top(cs, cr, n, k)
            n = k
        for o in range(n):
            ids_out[i, o] = cr[o]
            sc_out[i, o] = cs[o]
        for o in range(n, k):
            ids_out[i, o] = -1
            sc_out[i, o] = 0.0


def warm_up() -> None:
    """Compile the kernels now (seconds on a first run without numba's disk cache), not inside a step."""
    keys = torch.zeros((1, 4, 2), dtype=torch.bfloat16)
    search(keys, torch.zeros((1, 1, 2)), 1, 0, 4, None, block=2)


def task_block(m: int, hkv: int, workers: int) -> int:
    """Keys per task so that each worker gets about TASKS_PER_WORKER tasks of equal size.

    Args:
        m: searchable keys per head; hkv: KV heads; workers: pool threads.
    """
    chunks = max(1, -(-workers * TASKS_PER_WORKER // hkv))          # tasks per head
    return max(MIN_BLOCK, -(-m // chunks))


def search(keys: torch.Tensor, q: torch.Tensor, k: int, lo: int, hi: int, pool, block: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of every query over keys[:, lo:hi], (head, block) tasks in parallel on `pool`.

    Args:
        keys: (Hkv, N, D) bf16 keys (KEY_DTYPES), e.g. a memory map; q: (Hkv, Q, D) float32 queries.
        k: results per query; lo, hi: the searchable rows [lo, hi).
        pool: a `threads.HeadPool` (None: run on this thread); block: keys per task (None: `task_block`).
    Returns:
        ids (Hkv, Q, k) int64 positions in [lo, hi) (−1 in empty slots: only where k > hi − lo), scores
        (Hkv, Q, k) float32 exact q·k (0 in empty slots); in no particular order within a query.
    """
    hkv, n, _ = keys.shape
    Q = q.shape[1]
    lo, hi = max(0, lo), min(n, hi)
    ids = torch.full((hkv, Q, k), -1, dtype=torch.int64)
    scores = torch.zeros((hkv, Q, k), dtype=torch.float32)
    if hi <= lo or k <= 0:
        return ids, scores
    workers = pool.threads if pool is not None else 1
    block = block or task_block(hi - lo, hkv, workers)
    starts = np.arange(lo, hi, block, dtype=np.int64)
    nb = len(starts)
    kb = min(k, block, hi - lo)
    task_h = np.repeat(np.arange(hkv, dtype=np.int64), nb)          # (T,) head-major: a head's blocks in order
    task_s = np.tile(starts, hkv)
    task_e = np.minimum(task_s + block, hi)
    keys_np = bits(keys)                                             # (Hkv, N, D) bits, no copy
    q_np = q.contiguous().numpy()
    bar = np.full((hkv, Q), -np.inf, dtype=np.float32)               # (Hkv, Q) shared cuts
    cand_i = np.empty((hkv * nb, Q, kb), dtype=np.int64)             # (T, Q, kb)
    cand_s = np.empty((hkv * nb, Q, kb), dtype=np.float32)
    workers = min(workers, len(task_h))
    args = (keys_np, q_np, task_h, task_s, task_e)
    if workers > 1:
        pool.map(lambda w: _scan_share(*args, w, workers, k, bar, cand_i, cand_s), range(workers))
    else:
        _scan_share(*args, 0, 1, k, bar, cand_i, cand_s)
    ids_np, sc_np = ids.numpy(), scores.numpy()
    cand_i, cand_s = cand_i.reshape(hkv, nb, Q, kb), cand_s.reshape(hkv, nb, Q, kb)
    merge = (lambda h: _merge_head(cand_i[h], cand_s[h], bar[h], k, ids_np[h], sc_np[h]))
    if pool is not None and pool.threads > 1 and hkv > 1:
        pool.map(merge, range(hkv))
    else:
        for h in range(hkv):
            merge(h)
    return ids, scores
