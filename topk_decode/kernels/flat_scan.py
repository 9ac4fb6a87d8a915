"""flat's exact scan as compiled functions (numba): `flat --opt backend=numba`, and `auto`'s choice for long
bf16 contexts (index/flat/strategy.py; the Python side: index/flat/compiled.py).

The torch backend scores all keys in bf16 with one batched matmul, then selects candidates and
rescores them in fp32 (index/flat/strategy.py `half_scan`): several passes over (Hkv, Q, N) score buffers, and a
matmul whose CPU kernel reads the keys well below the DRAM bandwidth when Q is 4-7 rows. Here each
task (one KV head × one contiguous block of keys) reads its block once: each bf16 row is dotted with
all of the head's queries, four at a time, with fp32 sums (`dot4`: AVX512-BF16 dot products for
bf16-exact queries where the CPU has them, else the row widened exactly to fp32; kernels/dots.py), and its
scores are compared with the queries' cuts at once (`_score_hits`): almost every key costs its dot
products, four compares and a branch that is rarely taken.

The cuts. Before the scan, a strided sample of each head's whole range guesses the score that about 2·k
of the head's rows reach (kernels/flat_sample.py, one per query); a block keeps only rows at or above it, about
2·k/B of its rows for B blocks, instead of the kb·(1 + ln(m/kb)) that a running cut lets in from −inf.
A guess is not a bound: `search` checks that at least k of the head's rows got through and scans that
head again without it where not (exact either way). Each task also keeps its own k-th best so far and
reads a cut that the head's other blocks publish (`bar`), both lower bounds of the final k-th score.
Rows are prefetched ahead of the dot products, so that reading the next rows overlaps the arithmetic. A
last pass merges each (head, query)'s block candidates into the exact top-k. Each pass is one numba
parallel call (`prange`): a Python thread pool's start alone cost ~2 ms per layer on the 16-core host
(docs/BENCHMARKS.md "flat's numba scan against the DRAM floor"); this layout is that section's.

Result: the top k by (exact fp32 score descending, position ascending): ties at the k-th score go to
the lower positions, independent of thread timing. The k ids are returned in no particular order.
Scores are exact fp32 dot products of the fp32 query with the key (bf16 widens exactly); only the
summation order differs from torch's matmul (~1e-6 relative).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from topk_decode.kernels.dots import GROUP, dot4, score_rows4
from topk_decode.kernels.flat_sample import SURVIVORS_PER_K
from topk_decode.kernels.jit import jit, pjit, prange, prefetch_row


class Tasks(NamedTuple):
    """(T,) int64 each: a task's KV head, its rows [start, end) and the candidate slot it writes."""

    head: np.ndarray
    start: np.ndarray
    end: np.ndarray
    slot: np.ndarray


class Cuts(NamedTuple):
    """(Hkv, Q) float32 each: the cuts the blocks publish (`bar`) and the sampled ones (`spec`, −inf: none)."""

    bar: np.ndarray
    spec: np.ndarray


class Candidates(NamedTuple):
    """ids int64 and scores float32 of the same shape: per task slot (slots, Q, kb), or the result (Hkv, Q, k)."""

    ids: np.ndarray
    scores: np.ndarray


_CHUNK = 64  # rows scored between two refreshes of the cuts (the other blocks' published ones)
# Rows prefetched ahead of the dot products: the hardware prefetcher alone left a task's reads and its
# arithmetic one after the other (docs/BENCHMARKS.md "flat's numba scan against the DRAM floor").
AHEAD = 16


@jit
def _keep_top(cs, cr, n, kb):
    """Compact the first n candidates to their top kb by (score desc, insertion order); returns the cut.

    Args:
        cs: (cap,) float32 scores; cr: (cap,) int64 positions, in insertion (= position) order.
        n: candidates held (> kb); kb: how many to keep.
    """
    cut = np.partition(cs[:n], n - kb)[n - kb]  # the kb-th largest score
    above = 0
    for x in range(n):
        if cs[x] > cut:
            above += 1
    ties = kb - above  # candidates equal to the cut that stay: the earliest
    o = 0
    for x in range(n):  # in place: o ≤ x, so nothing unread is overwritten
        v = cs[x]
        if v > cut or (v == cut and ties > 0):
            if v == cut:
                ties -= 1
            cs[o] = v
            cr[o] = cr[x]
            o += 1
    return cut


@jit
def _score_hits(keys, qp, t0, t1, ahead, e, cutv, sc, rows):
    """The rows of [t0, t1) that reach some query's cut: their positions into rows[:nh] and their scores
    into sc[j·Qp : (j + 1)·Qp] for the j-th of them; returns nh. Row t + ahead (if below e) is prefetched
    while row t is scored.

    Each row's scores are compared with cutv (Qp,) as soon as they exist: almost every row costs its dot
    products, the compares and one well-predicted branch. Scores are written to the next free slot whether
    or not the row is kept (cheaper than a branch around the stores). One group of queries (G ≤ 4, e.g.
    Llama-3-8B) has its own loop (`dots.score_rows4`: for bf16 queries written in IR, the queries held in
    registers for all rows): the general one's index arithmetic and loop over groups cost about half as
    much as the dot products on the dev box (docs/BENCHMARKS.md "flat's numba scan at 61–74 % of the DRAM floor").
    """
    qn = qp.shape[0]
    nh = 0
    if qn == GROUP:
        return score_rows4(keys, qp, t0, t1, ahead, e, cutv, sc, rows)
    for t in range(t0, t1):
        if t + ahead < e:
            prefetch_row(keys, t + ahead)
        hit = False
        o = nh * qn
        for i in range(0, qn, GROUP):
            a0, a1, a2, a3 = dot4(keys, t, qp, i)
            sc[o + i] = a0
            sc[o + i + 1] = a1
            sc[o + i + 2] = a2
            sc[o + i + 3] = a3
            hit |= (a0 >= cutv[i]) | (a1 >= cutv[i + 1]) | (a2 >= cutv[i + 2]) | (a3 >= cutv[i + 3])
        if hit:
            rows[nh] = t
            nh += 1
    return nh


@jit
def _block_pass(keys, qp, Q, s, e, kb, publish, bar, spec, cs, cr, cnt, thr, ahead):
    """Rows [s, e) into each query's candidates: a row joins query i's list when its score beats i's own
    cut (thr), reaches the head's published cut (bar) and the sample's guess (spec). Lists compact to their
    top kb when full.

    Chunks of _CHUNK rows: `_score_hits` scores every row and keeps the few that reach some query's combined
    cut; only those are looked at per query. The combined cuts are refreshed once a chunk (the other blocks'
    published cuts); within a chunk they only rise, which the per-query test below applies exactly.
    """
    qn = qp.shape[0]
    cap = cs.shape[1] - 1  # the last column: where a row not kept is written
    sc = np.empty(_CHUNK * qn, dtype=np.float32)  # (CHUNK·Qp,) the kept rows' scores, row-major
    rows = np.empty(_CHUNK, dtype=np.int64)
    cutv = np.full(qn, np.inf, dtype=np.float32)  # (Qp,) combined cuts; +inf for the padding queries
    for t0 in range(s, e, _CHUNK):
        t1 = min(t0 + _CHUNK, e)
        for u in range(Q):
            cutv[u] = max(thr[u], bar[u], spec[u])
        nh = _score_hits(keys, qp, t0, t1, ahead, e, cutv, sc, rows)
        for j in range(nh):
            r = rows[j]
            for u in range(Q):
                # > own: ties at the own cut lose to the earlier rows kept; ≥ the shared and sampled cuts
                # (in cutv): a tie with another block's cut may still be needed (keeps the result
                # independent of thread timing). Written unconditionally, counted only when kept: a
                # branch here would be mispredicted on most of these rows.
                v = sc[j * qn + u]
                n = cnt[u]
                cs[u, n] = v
                cr[u, n] = r
                n += (v >= cutv[u]) & (v > thr[u])
                cnt[u] = n
                if n == cap:
                    own = _keep_top(cs[u], cr[u], n, kb)
                    thr[u] = own
                    cnt[u] = kb
                    cutv[u] = max(cutv[u], own)
                    if publish and own > bar[u]:  # racy max: any published cut is a valid bound
                        bar[u] = own


@jit
def _padded_copy(q):
    """(Qp, D) a copy of the (Q, D) queries, zero rows padding the last group of GROUP, 64-byte aligned.

    Aligned: a 512-bit load that straddles two cache lines costs two (16 of them per key). The task's own
    copy: one padded array shared by all tasks scanned slower (docs/BENCHMARKS.md "flat's numba scan with bf16 dot products")."""
    Q, d = q.shape
    qn = (Q + GROUP - 1) // GROUP * GROUP
    pad = 64 // q.itemsize
    buf = np.zeros(qn * d + pad, dtype=q.dtype)
    off = ((64 - buf.ctypes.data % 64) % 64) // q.itemsize
    qp = buf[off : off + qn * d].reshape((qn, d))
    for i in range(Q):
        for j in range(d):
            qp[i, j] = q[i, j]
    return qp


@jit
def _block_topk(keys, q, s, e, k, bar, spec, ids_out, sc_out, ahead):
    """One task: the top-kb of rows [s, e) of one head's keys for each of its queries, among the rows that
    reach the head's sampled cut.

    The cut (kernels/flat_sample.py, over the whole head, in `search`) lets about 2·k of the head's rows through,
    about 2·k/B of each of its B blocks, instead of the kb·(1 + ln(m/kb)) that a running cut lets in from
    −inf; `search` checks afterwards that at least k of the head's rows got through, and rescans the head
    without the guess where not (exact either way).

    Args:
        keys: (N, D) the head's bf16 keys as their uint16 bits.
        q: (Q, D) float32 queries (or their bf16 bits); s, e: the block's rows; k: results per query in the end.
        bar: (Q,) float32 cuts published by this head's blocks (−inf: none yet); shared between threads.
        spec: (Q,) float32 the head's sampled cuts (−inf: none).
        ids_out: (Q, kb) int64 positions out, kb = min(k, block size); sc_out: (Q, kb) float32 scores out.
            Unfilled slots get −1 / −inf.
        ahead: rows prefetched ahead of the one being scored.
    """
    Q = q.shape[0]
    kb = ids_out.shape[1]
    publish = kb >= k  # a cut of k candidates bounds the final k-th score
    qp = _padded_copy(q)
    cap = (SURVIVORS_PER_K + 1) * kb + 64  # room to insert before a compaction
    cs = np.empty((Q, cap + 1), dtype=np.float32)  # (Q, cap + 1) candidate scores, one spare slot
    cr = np.empty((Q, cap + 1), dtype=np.int64)  # (Q, cap + 1) candidate positions
    cnt = np.zeros(Q, dtype=np.int64)
    thr = np.full(Q, -np.inf, dtype=np.float32)  # each query's own cut: keep only scores above it
    _block_pass(keys, qp, Q, s, e, kb, publish, bar, spec, cs, cr, cnt, thr, ahead)
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


@pjit
def scan_par(keys, q, tasks, workers, k, cuts, out, ahead):
    """Every task, split over `workers` numba threads: worker w takes tasks w, w + workers, ...

    Args:
        keys: (Hkv, N, D) uint16 bits; q: (Hkv, Q, D) float32 (or bf16 bits).
        tasks: `Tasks`; workers: threads; k: results per query; cuts: `Cuts`; out: `Candidates` (one slot per
            task); ahead: rows prefetched ahead.
    """
    # unpacked outside the parallel loop: numba 0.68 drops writes made through a tuple's array field inside a
    # prange body (tests/test_flat_kernel.py checks the results)
    task_h, task_s, task_e, task_o = tasks
    bar, spec = cuts
    ids_out, sc_out = out
    for w in prange(workers):
        for t in range(w, task_h.shape[0], workers):
            h, o = task_h[t], task_o[t]
            _block_topk(keys[h], q[h], task_s[t], task_e[t], k, bar[h], spec[h], ids_out[o], sc_out[o], ahead)


@jit
def short_heads(ids, spec, need):
    """Which heads' sampled cuts let fewer than `need` rows through for some query: (Hkv,) bool.

    Args:
        ids: (Hkv, B, Q, kb) the blocks' candidates (−1: empty); spec: (Hkv, Q) the cuts (−inf: none).
    """
    hkv, nb, Q, kb = ids.shape
    short = np.zeros(hkv, dtype=np.bool_)
    for h in range(hkv):
        for i in range(Q):
            if spec[h, i] == -np.inf:
                continue
            n = 0
            for b in range(nb):
                for o in range(kb):
                    n += ids[h, b, i, o] >= 0
            if n < need:
                short[h] = True
    return short


@jit
def _merge_query(ids_in, sc_in, i, low, k, ids_out, sc_out):
    """One (head, query)'s exact top-k over its blocks' candidates, ties to the lower positions.

    Args:
        ids_in, sc_in: (B, Q, kb) the head's blocks' candidates, blocks in position order (−1 / −inf: empty).
        i: the query; low: its published cut (candidates below it cannot be in the top k).
        k: results per query; ids_out, sc_out: (k,) out (−1 / 0 in unfilled slots).
    """
    nb, _, kb = ids_in.shape
    cs = np.empty(nb * kb, dtype=np.float32)  # (B·kb,) the candidates, position order
    cr = np.empty(nb * kb, dtype=np.int64)
    n = 0
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
        ids_out[o] = cr[o]
        sc_out[o] = cs[o]
    for o in range(n, k):
        ids_out[o] = -1
        sc_out[o] = 0.0


@pjit
def merge_par(cands, bar, k, out):
    """`_merge_query` of every (head, query) in parallel, on the scan's threads (a pass per head would leave
    half of them idle at 8 KV heads): cands `Candidates` (Hkv, B, Q, kb); bar (Hkv, Q); out `Candidates`
    (Hkv, Q, k)."""
    ids_in, sc_in = cands
    ids_out, sc_out = out
    Q = bar.shape[1]
    for w in prange(bar.shape[0] * Q):
        h, i = w // Q, w % Q
        _merge_query(ids_in[h], sc_in[h], i, bar[h, i], k, ids_out[h, i], sc_out[h, i])
