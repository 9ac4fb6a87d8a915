"""flat's exact scan as compiled functions (numba): `flat --opt backend=numba`, and `auto`'s choice for long
bf16 contexts (flat.py).

The torch backend scores all keys in bf16 with one batched matmul, then selects candidates and
rescores them in fp32 (flat.py `_half_scan`): several passes over (Hkv, Q, N) score buffers, and a
matmul whose CPU kernel reads the keys well below the DRAM bandwidth when Q is 4-7 rows. Here each
task (one KV head × one contiguous block of keys) reads its block once: each bf16 row is dotted with
all of the head's queries, four at a time, with fp32 sums (`_dot4`: AVX512-BF16 dot products for
bf16-exact queries where the CPU has them, else the row widened exactly to fp32; dots.py), and its
scores are compared with the queries' cuts at once (`_score_hits`): almost every key costs its dot
products, four compares and a branch that is rarely taken.

The cuts. Before the scan, a strided sample of each head's whole range guesses the score that about 2·k
of the head's rows reach (flat_sample.py, one per query); a block keeps only rows at or above it, about
2·k/B of its rows for B blocks, instead of the kb·(1 + ln(m/kb)) that a running cut lets in from −inf.
A guess is not a bound: `search` checks that at least k of the head's rows got through and scans that
head again without it where not (exact either way). Each task also keeps its own k-th best so far and
reads a cut that the head's other blocks publish (`bar`), both lower bounds of the final k-th score.
Rows are prefetched ahead of the dot products, so that reading the next rows overlaps the arithmetic. A
last pass merges each (head, query)'s block candidates into the exact top-k. Each pass is one numba
parallel call (`prange`): a Python thread pool's start alone cost ~2 ms per layer on the 16-core host
(docs/BENCHMARKS.md run 18); this layout is run 20's.

Result: the top k by (exact fp32 score descending, position ascending): ties at the k-th score go to
the lower positions, independent of thread timing. The k ids are returned in no particular order.
Scores are exact fp32 dot products of the fp32 query with the key (bf16 widens exactly); only the
summation order differs from torch's matmul (~1e-6 relative).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from topk_decode.index import compiled, dots
from topk_decode.index.compiled import bits, jit, pjit, prange, prefetch_row
from topk_decode.index.dots import GROUP as _QGROUP, dot4 as _dot4, score_rows4
from topk_decode.index.flat_sample import SURVIVORS_PER_K, head_cuts

# Tasks per pool worker when the block size is left to `search`: few, long tasks keep each running
# threshold close to the final k-th score (fewer insertions and compactions, fewer candidates to
# merge); two rather than one so that a worker delayed by other work does not hold up the whole layer.
TASKS_PER_WORKER = 2
MIN_BLOCK = 1 << 12   # keys per task at least (1 MiB at D=128): smaller tasks only add setup and merging
_CHUNK = 64    # rows scored between two refreshes of the cuts (the other blocks' published ones)
# Rows prefetched ahead of the dot products: the hardware prefetcher alone left a task's reads and its
# arithmetic one after the other (docs/BENCHMARKS.md run 18).
AHEAD = 16


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
def _score_hits(keys, qp, t0, t1, ahead, e, cutv, sc, rows):
    """The rows of [t0, t1) that reach some query's cut: their positions into rows[:nh] and their scores
    into sc[j·Qp : (j + 1)·Qp] for the j-th of them; returns nh. Row t + ahead (if below e) is prefetched
    while row t is scored.

    Each row's scores are compared with cutv (Qp,) as soon as they exist: almost every row costs its dot
    products, the compares and one well-predicted branch. Scores are written to the next free slot whether
    or not the row is kept (cheaper than a branch around the stores). One group of queries (G ≤ 4, e.g.
    Llama-3-8B) has its own loop (`dots.score_rows4`: for bf16 queries written in IR, the queries held in
    registers for all rows): the general one's index arithmetic and loop over groups cost about half as
    much as the dot products on the dev box (docs/BENCHMARKS.md run 20).
    """
    qn = qp.shape[0]
    nh = 0
    if qn == _QGROUP:
        return score_rows4(keys, qp, t0, t1, ahead, e, cutv, sc, rows)
    for t in range(t0, t1):
        if t + ahead < e:
            prefetch_row(keys, t + ahead)
        hit = False
        o = nh * qn
        for i in range(0, qn, _QGROUP):
            a0, a1, a2, a3 = _dot4(keys, t, qp, i)
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
    cap = cs.shape[1] - 1                           # the last column: where a row not kept is written
    sc = np.empty(_CHUNK * qn, dtype=np.float32)    # (CHUNK·Qp,) the kept rows' scores, row-major
    rows = np.empty(_CHUNK, dtype=np.int64)
    cutv = np.full(qn, np.inf, dtype=np.float32)   # (Qp,) combined cuts; +inf for the padding queries
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
                    if publish and own > bar[u]:   # racy max: any published cut is a valid bound
                        bar[u] = own


@jit
def _padded_copy(q):
    """(Qp, D) a copy of the (Q, D) queries, zero rows padding the last group of _QGROUP, 64-byte aligned.

    Aligned: a 512-bit load that straddles two cache lines costs two (16 of them per key). The task's own
    copy: one padded array shared by all tasks scanned slower (docs/BENCHMARKS.md run 19)."""
    Q, d = q.shape
    qn = (Q + _QGROUP - 1) // _QGROUP * _QGROUP
    pad = 64 // q.itemsize
    buf = np.zeros(qn * d + pad, dtype=q.dtype)
    off = ((64 - buf.ctypes.data % 64) % 64) // q.itemsize
    qp = buf[off:off + qn * d].reshape((qn, d))
    for i in range(Q):
        for j in range(d):
            qp[i, j] = q[i, j]
    return qp


@jit
def _block_topk(keys, q, s, e, k, bar, spec, ids_out, sc_out, ahead):
    """One task: the top-kb of rows [s, e) of one head's keys for each of its queries, among the rows that
    reach the head's sampled cut.

    The cut (flat_sample.py, over the whole head, in `search`) lets about 2·k of the head's rows through,
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
    publish = kb >= k                       # a cut of k candidates bounds the final k-th score
    qp = _padded_copy(q)
    cap = (SURVIVORS_PER_K + 1) * kb + 64            # room to insert before a compaction
    cs = np.empty((Q, cap + 1), dtype=np.float32)     # (Q, cap + 1) candidate scores, one spare slot
    cr = np.empty((Q, cap + 1), dtype=np.int64)       # (Q, cap + 1) candidate positions
    cnt = np.zeros(Q, dtype=np.int64)
    thr = np.full(Q, -np.inf, dtype=np.float32)       # each query's own cut: keep only scores above it
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
def _scan_par(keys, q, task_h, task_s, task_e, task_o, workers, k, bar, spec, ids_out, sc_out, ahead):
    """Every task, split over `workers` numba threads: worker w takes tasks w, w + workers, ...

    Args:
        keys: (Hkv, N, D) uint16 bits; q: (Hkv, Q, D) float32 (or bf16 bits).
        task_h, task_s, task_e, task_o: (T,) int64 head, rows [s, e) and output slot of each task.
        workers: threads; k: results per query; bar: (Hkv, Q) float32 shared cuts; spec: (Hkv, Q) sampled
        cuts; ids_out, sc_out: (slots, Q, kb) per-task candidates; ahead: rows prefetched ahead.
    """
    for w in prange(workers):
        for t in range(w, task_h.shape[0], workers):
            h, o = task_h[t], task_o[t]
            _block_topk(keys[h], q[h], task_s[t], task_e[t], k, bar[h], spec[h], ids_out[o], sc_out[o], ahead)


@jit
def _short_heads(ids, spec, need):
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
    cs = np.empty(nb * kb, dtype=np.float32)   # (B·kb,) the candidates, position order
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
def _merge_par(ids_in, sc_in, bar, k, ids_out, sc_out):
    """`_merge_query` of every (head, query) in parallel, on the scan's threads (a pass per head would leave
    half of them idle at 8 KV heads): ids_in, sc_in (Hkv, B, Q, kb); bar (Hkv, Q); outs (Hkv, Q, k)."""
    Q = bar.shape[1]
    for w in prange(bar.shape[0] * Q):
        h, i = w // Q, w % Q
        _merge_query(ids_in[h], sc_in[h], i, bar[h, i], k, ids_out[h, i], sc_out[h, i])


def warm_up(head_dim: int = 2) -> None:
    """Compile the kernels now (seconds on a first run without numba's disk cache), not inside a step:
    the fp32 path, and the bf16 one where it is available for rows of `head_dim`. 2,048 rows and k = 256:
    the smallest search that samples its cut (`flat_sample.sample_plan`)."""
    search(torch.zeros((1, 2048, 2), dtype=torch.bfloat16), torch.zeros((1, 1, 2)), 256, 0, 2048, 1, dot="fp32")
    if dots.bf16_available(head_dim):   # the fp32 path's types do not depend on D; the bf16 one needs D % 32 == 0
        keys = torch.zeros((1, 2048, head_dim), dtype=torch.bfloat16)
        search(keys, torch.zeros((1, 1, head_dim)), 256, 0, 2048, 1, dot="bf16")


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
           block: int | None = None, ahead: int = AHEAD, dot: str = "auto",
           parts: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of every query over keys[:, lo:hi], (head, block) tasks in parallel on numba's threads.

    Args:
        keys: (Hkv, N, D) bf16 keys (KEY_DTYPES), e.g. a memory map; q: (Hkv, Q, D) float32 queries.
        k: results per query; lo, hi: the searchable rows [lo, hi).
        threads: numba threads to use; block: keys per task (None: `task_block`).
        ahead: rows prefetched ahead of the dot products (a tuning knob: docs/BENCHMARKS.md run 18).
        dot: "bf16" scores with the hardware bf16 dot product (dots.py; the queries are rounded to bf16),
            "fp32" widens the keys and runs FMAs; "auto": bf16 where `bf16_dot_applies` (the same scores as
            fp32 up to summation order), else fp32.
        parts: if given, seconds spent in each pass are added to it ("cuts", "scan", "rescan", "merge",
            "total"; scripts/flat_search_parts.py).
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
    task_h = np.repeat(np.arange(hkv, dtype=np.int64), nb)          # (T,) head-major: a head's blocks in order
    task_s = np.tile(starts, hkv)
    task_e = np.minimum(task_s + block, hi)
    if dot == "auto":
        dot = "bf16" if bf16_dot_applies(keys, q) else "fp32"
    q_np = bits(q.to(torch.bfloat16).contiguous()) if dot == "bf16" else q.contiguous().numpy()
    kbits = bits(keys)
    workers = min(threads, len(task_h))
    compiled.set_threads(workers)
    t1 = time.perf_counter()
    spec = head_cuts(kbits, q_np, lo, hi, k, workers)               # (Hkv, Q) sampled cuts, −inf: none
    t2 = time.perf_counter()
    bar = np.full((hkv, Q), -np.inf, dtype=np.float32)               # (Hkv, Q) shared cuts
    cand_i = np.empty((hkv * nb, Q, kb), dtype=np.int64)             # (T, Q, kb)
    cand_s = np.empty((hkv * nb, Q, kb), dtype=np.float32)
    task_o = np.arange(len(task_h), dtype=np.int64)
    _scan_par(kbits, q_np, task_h, task_s, task_e, task_o, workers, k, bar, spec, cand_i, cand_s, ahead)
    t3 = time.perf_counter()
    short = _short_heads(cand_i.reshape(hkv, nb, Q, kb), spec, min(k, hi - lo))
    if short.any():   # a guess let too few rows through (rare on real keys): those heads again, without one
        spec[short] = -np.inf
        again = np.flatnonzero(np.repeat(short, nb))
        compiled.set_threads(min(threads, len(again)))
        _scan_par(kbits, q_np, task_h[again], task_s[again], task_e[again], again, min(threads, len(again)), k,
                  bar, spec, cand_i, cand_s, ahead)
        compiled.set_threads(workers)
    t4 = time.perf_counter()
    _merge_par(cand_i.reshape(hkv, nb, Q, kb), cand_s.reshape(hkv, nb, Q, kb), bar, k, ids.numpy(),
               scores.numpy())
    if parts is not None:
        t5 = time.perf_counter()
        for name, dt in (("cuts", t2 - t1), ("scan", t3 - t2), ("rescan", t4 - t3), ("merge", t5 - t4),
                         ("total", t5 - t0)):
            parts[name] = parts.get(name, 0.0) + dt
    return ids, scores
