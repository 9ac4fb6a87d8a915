"""flat's exact scan as compiled functions (numba): `flat --opt backend=numba`.

The torch backend scores all keys in bf16 with one batched matmul, then selects candidates and
rescores them in fp32 (flat.py `_half_scan`): several passes over (Hkv, Q, N) score buffers, and a
matmul whose CPU kernel reads the keys well below the DRAM bandwidth when Q is 4-7 rows. Here each
task (one KV head × one contiguous block of keys) reads its block once: each bf16 row is dotted with
all of the head's queries, four at a time, with fp32 sums (`_dot4`: AVX512-BF16 dot products for
bf16-exact queries where the CPU has them, else the row widened exactly to fp32; dots.py), and
kept only when it reaches the query's cut, so almost every key costs one
compare after its dot products. The cut is the highest of three: the task's own k-th best so far; a
cut that another block of the same head has published (`bar`), both lower bounds of the final k-th
score; and a guess from a strided sample of the block (`_sample_cut`), which is checked afterwards:
a query whose guess let fewer than k rows through is scanned again without it. Rows are prefetched
ahead of the dot products, so that reading the next rows overlaps the arithmetic. A second pass
merges each (head, query)'s block candidates into the exact top-k. Both passes run as one numba
parallel call each (`prange` over the workers, then over the heads): a Python thread pool's start
alone cost ~2 ms per layer on the 16-core host (docs/BENCHMARKS.md run 18).

Result: the top k by (exact fp32 score descending, position ascending): ties at the k-th score go to
the lower positions, independent of thread timing. The k ids are returned in no particular order.
Scores are exact fp32 dot products of the fp32 query with the key (bf16 widens exactly); only the
summation order differs from torch's matmul (~1e-6 relative).
"""

from __future__ import annotations

import numpy as np
import torch

from topk_decode.index import compiled, dots
from topk_decode.index.compiled import bits, jit, pjit, prange, prefetch_row
from topk_decode.index.dots import GROUP as _QGROUP, dot4 as _dot4

# Tasks per pool worker when the block size is left to `search`: few, long tasks keep each running
# threshold close to the final k-th score (fewer insertions and compactions, fewer candidates to
# merge); two rather than one so that a worker delayed by other work does not hold up the whole layer.
TASKS_PER_WORKER = 2
MIN_BLOCK = 1 << 12   # keys per task at least (1 MiB at D=128): smaller tasks only add setup and merging
_CHUNK = 64    # rows scored before their scores are compared (a (Qp, 64) fp32 buffer: L1); and between two
               # reads of the other blocks' published cuts
# Rows prefetched ahead of the dot products: the hardware prefetcher alone left a task's reads and its
# arithmetic one after the other (docs/BENCHMARKS.md run 18).
AHEAD = 16
# The sample's cut is its _SAMPLE_RANK-th largest score, with the stride that aims it at _SURVIVORS_PER_K·kb
# rows of the block. Two, not one: a guess that lets fewer than kb rows through costs a second pass (a
# 4-sigma miss at rank 64 on a random order). No sample where it would be over 1/_MIN_STRIDE of the rows.
_SAMPLE_RANK = 64
_SURVIVORS_PER_K = 2
_MIN_STRIDE = 8
_SAMPLE_AHEAD = 8   # sample rows prefetched ahead


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
def _sample_cut(keys, qp, Q, s, e, kb, spec):
    """spec[:Q] = a cut that about _SURVIVORS_PER_K·kb of rows [s, e) reach: the _SAMPLE_RANK-th largest score
    of an evenly strided sample of the rows.

    A guess, not a bound: `_block_topk` rescans a query whose guess let fewer than kb rows through. −inf
    where the sample would be too large a share of the block to pay (small blocks, small k: few insertions
    there anyway).
    """
    spec[:] = -np.inf
    rank = min(_SAMPLE_RANK, kb)
    stride = _SURVIVORS_PER_K * kb // rank
    ns = (e - s) // stride
    if stride < _MIN_STRIDE or ns < 4 * rank:
        return
    sc = np.empty((qp.shape[0], ns), dtype=np.float32)   # (Qp, ns) the sample's scores
    for r in range(ns):
        if r + _SAMPLE_AHEAD < ns:                    # rows far apart: no hardware prefetcher follows them
            prefetch_row(keys, s + (r + _SAMPLE_AHEAD) * stride)
        for i in range(0, qp.shape[0], _QGROUP):
            sc[i, r], sc[i + 1, r], sc[i + 2, r], sc[i + 3, r] = _dot4(keys, s + r * stride, qp, i)
    for i in range(Q):
        spec[i] = np.partition(sc[i], ns - rank)[ns - rank]   # the rank-th largest of the sample


@jit
def _score_rows(keys, qp, t0, t1, ahead, e, sc):
    """sc[:, r] = exact fp32 scores of row t0 + r against every (padded) query, rows [t0, t1); row t + ahead
    (if below e) is prefetched while row t is scored."""
    for t in range(t0, t1):
        if t + ahead < e:
            prefetch_row(keys, t + ahead)
        r = t - t0
        for i in range(0, qp.shape[0], _QGROUP):
            sc[i, r], sc[i + 1, r], sc[i + 2, r], sc[i + 3, r] = _dot4(keys, t, qp, i)


@jit
def _block_pass(keys, qp, Q, s, e, kb, publish, bar, spec, cs, cr, cnt, thr, ahead):
    """Rows [s, e) into each query's candidates: a row joins query i's list when its score beats i's own
    cut (thr), reaches the head's published cut (bar) and the sample's guess (spec). Lists compact to their
    top kb when full.

    Chunks of _CHUNK rows: first every score of the chunk (a tight loop of dot products, `_score_rows`),
    then one compare per score against the query's combined cut; the rare score that reaches it is looked at
    again. Kept apart, both loops compile tight (one loop doing both ran ~1.5× the dot products alone).
    """
    sc = np.empty((qp.shape[0], _CHUNK), dtype=np.float32)   # (Qp, CHUNK) one chunk's scores
    for t0 in range(s, e, _CHUNK):
        t1 = min(t0 + _CHUNK, e)
        _score_rows(keys, qp, t0, t1, ahead, e, sc)
        for u in range(Q):
            cut = max(thr[u], bar[u], spec[u])        # the other blocks' published cuts, once a chunk
            for r in range(t1 - t0):
                v = sc[u, r]
                # > own: ties at the own cut lose to the earlier rows kept; ≥ shared: a tie with another
                # block's cut may still be needed (keeps the result independent of thread timing)
                if v >= cut and v > thr[u] and v >= bar[u] and v >= spec[u]:
                    n = cnt[u]
                    cs[u, n] = v
                    cr[u, n] = t0 + r
                    cnt[u] = n + 1
                    if n + 1 == cs.shape[1]:
                        own = _keep_top(cs[u], cr[u], n + 1, kb)
                        thr[u] = own
                        cnt[u] = kb
                        cut = max(cut, own)
                        if publish and own > bar[u]:   # racy max: any published cut is a valid bound
                            bar[u] = own


@jit
def _block_topk(keys, q, s, e, k, bar, ids_out, sc_out, ahead):
    """One task: the exact top-kb of rows [s, e) of one head's keys for each of its queries.

    A strided sample first guesses each query's final cut (`_sample_cut`), so that about 2·kb rows are ever
    inserted instead of the kb·(1 + ln(m/kb)) a running cut lets in from −inf; a query whose guess
    let fewer than kb rows through is rescanned without it (exact either way).

    Args:
        keys: (N, D) the head's bf16 keys as their uint16 bits.
        q: (Q, D) float32 queries; s, e: the block's rows; k: results wanted per query in the end.
        bar: (Q,) float32 cuts published by this head's blocks (−inf: none yet); shared between threads.
        ids_out: (Q, kb) int64 positions out, kb = min(k, block size); sc_out: (Q, kb) float32 scores out.
            Unfilled slots get −1 / −inf.
        ahead: rows prefetched ahead of the one being scored.
    """
    d = keys.shape[1]
    Q = q.shape[0]
    kb = ids_out.shape[1]
    publish = kb >= k                       # a cut of k candidates bounds the final k-th score
    qp_n = (Q + _QGROUP - 1) // _QGROUP * _QGROUP
    # (Qp, D) the task's own copy, zero rows padding the last group (float32 or bf16 bits): a padded array
    # shared by all tasks, made once in `search`, scanned slower (docs/BENCHMARKS.md run 19)
    qp = np.zeros((qp_n, d), dtype=q.dtype)
    for i in range(Q):
        for j in range(d):
            qp[i, j] = q[i, j]
    spec = np.empty(Q, dtype=np.float32)
    _sample_cut(keys, qp, Q, s, e, kb, spec)
    cap = (_SURVIVORS_PER_K + 1) * kb + 64            # room to insert before a compaction
    cs = np.empty((Q, cap), dtype=np.float32)         # (Q, cap) candidate scores
    cr = np.empty((Q, cap), dtype=np.int64)           # (Q, cap) candidate positions
    cnt = np.zeros(Q, dtype=np.int64)
    thr = np.full(Q, -np.inf, dtype=np.float32)       # each query's own cut: keep only scores above it
    _block_pass(keys, qp, Q, s, e, kb, publish, bar, spec, cs, cr, cnt, thr, ahead)
    again = False
    for i in range(Q):
        if cnt[i] < kb and spec[i] > -np.inf:          # the guess was too high: rows below it may count
            again = True
            spec[i] = -np.inf
            cnt[i] = 0
            thr[i] = -np.inf
        else:
            spec[i] = np.inf                          # settled: take nothing more
    if again:
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
def _scan_par(keys, q, task_h, task_s, task_e, workers, k, bar, ids_out, sc_out, ahead):
    """Every task, split over `workers` numba threads: worker w takes tasks w, w + workers, ...

    Args:
        keys: (Hkv, N, D) uint16 bits; q: (Hkv, Q, D) float32.
        task_h, task_s, task_e: (T,) int64 head and rows [s, e) of each task, head-major.
        workers: threads; k: results per query; bar: (Hkv, Q) float32 shared cuts;
        ids_out, sc_out: (T, Q, kb) per-task candidates; ahead: rows prefetched ahead.
    """
    for w in prange(workers):
        for t in range(w, task_h.shape[0], workers):
            h = task_h[t]
            _block_topk(keys[h], q[h], task_s[t], task_e[t], k, bar[h], ids_out[t], sc_out[t], ahead)


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


@pjit
def _merge_par(ids_in, sc_in, bar, k, ids_out, sc_out):
    """`_merge_head` of every head in parallel: ids_in, sc_in (Hkv, B, Q, kb); bar (Hkv, Q); outs (Hkv, Q, k)."""
    for h in prange(ids_in.shape[0]):
        _merge_head(ids_in[h], sc_in[h], bar[h], k, ids_out[h], sc_out[h])


def warm_up(head_dim: int = 2) -> None:
    """Compile the kernels now (seconds on a first run without numba's disk cache), not inside a step:
    the fp32 path, and the bf16 one where it is available for rows of `head_dim`."""
    search(torch.zeros((1, 4, 2), dtype=torch.bfloat16), torch.zeros((1, 1, 2)), 1, 0, 4, 1, block=2, dot="fp32")
    if dots.bf16_available(head_dim):   # the fp32 path's types do not depend on D; the bf16 one needs D % 32 == 0
        keys = torch.zeros((1, 4, head_dim), dtype=torch.bfloat16)
        search(keys, torch.zeros((1, 1, head_dim)), 1, 0, 4, 1, block=2, dot="bf16")


def bf16_dot_applies(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `search` scores these (Hkv, N, D) keys and (Hkv, Q, D) float32 queries with the hardware bf16
    dot product: it is available here, the key rows are contiguous and every query is bf16-exact (the
    decoder's are)."""
    return (dots.bf16_available(q.shape[-1]) and keys.stride(-1) == 1
            and torch.equal(q.to(torch.bfloat16).float(), q))


def task_block(m: int, hkv: int, workers: int) -> int:
    """Keys per task so that each worker gets about TASKS_PER_WORKER tasks of equal size.

    Args:
        m: searchable keys per head; hkv: KV heads; workers: threads.
    """
    chunks = max(1, -(-workers * TASKS_PER_WORKER // hkv))          # tasks per head
    return max(MIN_BLOCK, -(-m // chunks))


def search(keys: torch.Tensor, q: torch.Tensor, k: int, lo: int, hi: int, threads: int = 1,
           block: int | None = None, ahead: int = AHEAD, dot: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of every query over keys[:, lo:hi], (head, block) tasks in parallel on numba's threads.

    Args:
        keys: (Hkv, N, D) bf16 keys (KEY_DTYPES), e.g. a memory map; q: (Hkv, Q, D) float32 queries.
        k: results per query; lo, hi: the searchable rows [lo, hi).
        threads: numba threads to use; block: keys per task (None: `task_block`).
        ahead: rows prefetched ahead of the dot products (a tuning knob: docs/BENCHMARKS.md run 18).
        dot: "bf16" scores with the hardware bf16 dot product (dots.py; the queries are rounded to bf16),
            "fp32" widens the keys and runs FMAs; "auto": bf16 where `bf16_dot_applies` (the same scores as
            fp32 up to summation order), else fp32.
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
    threads = max(1, threads)
    block = block or task_block(hi - lo, hkv, threads)
    starts = np.arange(lo, hi, block, dtype=np.int64)
    nb = len(starts)
    kb = min(k, block, hi - lo)
    task_h = np.repeat(np.arange(hkv, dtype=np.int64), nb)          # (T,) head-major: a head's blocks in order
    task_s = np.tile(starts, hkv)
    task_e = np.minimum(task_s + block, hi)
    if dot == "auto":
        dot = "bf16" if bf16_dot_applies(keys, q) else "fp32"
    q_np = bits(q.to(torch.bfloat16).contiguous()) if dot == "bf16" else q.contiguous().numpy()
    bar = np.full((hkv, Q), -np.inf, dtype=np.float32)               # (Hkv, Q) shared cuts
    cand_i = np.empty((hkv * nb, Q, kb), dtype=np.int64)             # (T, Q, kb)
    cand_s = np.empty((hkv * nb, Q, kb), dtype=np.float32)
    workers = min(threads, len(task_h))
    compiled.set_threads(workers)
    _scan_par(bits(keys), q_np, task_h, task_s, task_e, workers, k, bar, cand_i, cand_s, ahead)
    compiled.set_threads(min(threads, hkv))
    _merge_par(cand_i.reshape(hkv, nb, Q, kb), cand_s.reshape(hkv, nb, Q, kb), bar, k, ids.numpy(),
               scores.numpy())
    return ids, scores
