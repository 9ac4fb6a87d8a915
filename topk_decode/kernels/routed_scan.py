"""routed's compiled path: one KV head's layer as numba functions (the Python side: index/routed/compiled.py).

The torch path (index/routed/torch_path.py `route` + `select`, then decode/context.py) is ~40 small tensor ops per
layer; on a many-core host each is a parallel region of its own, and together they cost several times what
the few MB they read take (docs/BENCHMARKS.md, "Where routed's step goes"). Here a KV head's layer runs as
compiled functions that release the GIL, on numba's threads: routing against the centroids and the
estimate of the unread clusters (kernels/routed_route.py, or on the decode device: index/routed/device.py), then
what this module holds — the exact fp32 scan of the chosen clusters' keys, the top-k (kernels/topk.py) and
(in the decoder) the context part itself (`scan_head`; kernels/routed_split.py cuts the same work into pieces for
the whole team). With the context part inside, a decode step runs no parallel torch op on the CPU, so
torch's OpenMP workers (which spin after each parallel region) no longer compete with the search for the
cores (docs/BENCHMARKS.md "the decode buffer-ownership refactor").

Same rules as the torch path: a cluster's priority is the largest share of attention mass any of the
head's queries gives it (softmax over s·q·μ_c + bias_c), clusters are read in that order until `budget`
keys are read, sinks/tail rows are never returned; the estimate is index/routed/estimate.py's `unread_part`, the
context part decode/context.py's, merged with the estimate as `merge_rest` does. Scores are exact fp32 dot
products (bf16 keys widen exactly; only the summation order differs from torch's matmul). The context
part weighs the values with fp32 weights (the torch path rounds them to the values' dtype first, as a
flash kernel does): within bf16 rounding of each other (tests/test_routed_kernel.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from topk_decode.kernels.dots import GROUP, dot4, pad_queries
from topk_decode.kernels.jit import cycles, jit, pjit, prange, prefetch_row, stored_float
from topk_decode.kernels.topk import top_k_rows


class LayerArrays(NamedTuple):
    """One layer's arrays as the per-layer calls read them (numpy views of the strategy's tensors, no copies).

    keys: (Hkv, N, D) uint16 bf16 bits, cluster-contiguous; pos: (Hkv, N) int32 positions, −1 outside the searchable
    range; offsets: (Hkv, C + 1) int64; cent: (Hkv, C, D) uint16 (bf16) centroids; bias, size_factor: (Hkv, C)
    float32 (`finish_head`); vmeans: (Hkv, C, D) uint16 (bf16) mean values, or (Hkv, 1, D) zeros; vals: (Hkv, N, D)
    uint16 values, by layout row when values_by_row, else by position; or, in an int8 cache (`--kv-dtype int8`,
    store/quant.py), int8 keys (their scales folded into the queries: q ⊙ s_k, the centroids in the same space) and
    int8 values with vscale (Hkv, N) float32 their per-row scales in the values' order; (Hkv, 0) for float values.
    keys_by_row: keys are the layout's (N rows, cluster-contiguous); False: the cache's own keys by position (routed's
    `store_keys=false`: one copy of the KV), each layout row read at its position.
    """

    keys: np.ndarray
    pos: np.ndarray
    offsets: np.ndarray
    cent: np.ndarray
    bias: np.ndarray
    size_factor: np.ndarray
    vmeans: np.ndarray
    vals: np.ndarray
    values_by_row: bool
    vscale: np.ndarray
    keys_by_row: bool


class HeadArrays(NamedTuple):
    """One KV head's slice of `LayerArrays` as a head's scan reads it (made inside the parallel loops; read only:
    outputs stay separate arguments, kernels/routed_scan.py `scan_layer_par` says why)."""

    keys: np.ndarray
    keys_by_row: bool
    pos: np.ndarray
    offsets: np.ndarray
    vals: np.ndarray
    vscale: np.ndarray
    values_by_row: bool


@jit
def head_arrays(a, h):
    """`HeadArrays` of head h of a `LayerArrays`."""
    return HeadArrays(a.keys[h], a.keys_by_row, a.pos[h], a.offsets[h], a.vals[h], a.vscale[h], a.values_by_row)


class LayerOut(NamedTuple):
    """What a per-layer call writes: ids (Hkv, Q, K) int64 (−1 in empty slots), scores (Hkv, Q, K) float32, the
    context part's o (Hkv, Q, D) float32 and mz (Hkv, Q, 2) float32 (m, z)."""

    ids: np.ndarray
    scores: np.ndarray
    o: np.ndarray
    mz: np.ndarray


class HeadClock(NamedTuple):
    """Per KV head: read (Hkv,) int64 keys read, clock (Hkv, 2) int64 the `cycles` at its work's start and end."""

    read: np.ndarray
    clock: np.ndarray


@jit
def exp_into(x, out, bits):
    """out = exp(x) elementwise (float32), as a loop the compiler vectorizes (math.exp stays scalar).

    Cephes' expf: 2^k · p(r) with r = x − k·ln 2, |r| ≤ ln 2 / 2, degree-5 polynomial; relative error
    ~1e-7 (fp32 rounding). x is clamped to [−87, 88]: −inf gives ~1.6e-38, not 0 (callers that need an
    exact 0 there multiply by a zero factor)."""
    for j in range(x.shape[0]):
        v = min(max(x[j], np.float32(-87.0)), np.float32(88.0))
        k = math.floor(v * np.float32(1.44269504) + np.float32(0.5))
        r = v - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        out[j] = p * r * r + r + np.float32(1.0)
        bits[j] = (np.int32(k) + np.int32(127)) << 23  # 2^k as float32 bits
    scale = bits.view(np.float32)
    for j in range(x.shape[0]):
        out[j] *= scale[j]


@jit
def widen(row, widened):
    """widened (D,) uint32 = a bf16 row's bits shifted into fp32 position: viewed as float32 it is the row,
    exactly (the callers make the float32 view once, outside their loops)."""
    for j in range(row.shape[0]):
        widened[j] = np.uint32(row[j]) << 16


@jit
def round_bf16(x, out):
    """out (D,) uint16 = x (D,) float32 rounded to bf16 bits, to nearest even as torch rounds (NaN → 0x7FC0)."""
    bits = x.view(np.uint32)
    for j in range(x.shape[0]):
        b = bits[j]
        if b & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
            out[j] = np.uint16(0x7FC0)
        else:
            out[j] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@jit
def dot_queries(qh, x, out):
    """out[i] = q_i·x for every query (Q, D) against one fp32 row x (D,)."""
    for i in range(qh.shape[0]):
        acc = np.float32(0.0)
        for j in range(qh.shape[1]):
            acc += qh[i, j] * x[j]
        out[i] = acc


# Rows ahead of the scan whose cache lines are requested: the clusters read are small and scattered, so
# without it each row is a serial DRAM miss; 16 rows keep ~70 lines in flight (docs/BENCHMARKS.md "prefetching, and the heads' work split over the whole team").
_AHEAD = 16


@jit
def _cluster_rows(offsets, order, taken, m):
    """The layout rows of the first `taken` clusters of `order`, in that order: (m,) int64."""
    rows = np.empty(m, dtype=np.int64)
    cluster_rows_into(offsets, order, taken, rows)
    return rows


@jit
def count_rows(offsets, order, taken, t0=0):
    """Rows in clusters order[t0:taken] (by default the first `taken`)."""
    m = 0
    for t in range(t0, taken):
        m += offsets[order[t] + 1] - offsets[order[t]]
    return m


@jit
def cluster_rows_into(offsets, order, taken, rows, t0=0, r=0):
    """Write the layout rows of clusters order[t0:taken] (by default the first `taken`) into rows from index r on,
    in that order."""
    for t in range(t0, taken):
        if t + _AHEAD < taken:
            prefetch_row(offsets, order[t + _AHEAD])
        c = order[t]
        for row in range(offsets[c], offsets[c + 1]):
            rows[r] = row
            r += 1


@jit
def _scan(head, rows, qh):
    """Exact fp32 q·k of every row in `rows`: (positions (m,), scores (Q, m), −inf for rows outside the
    searchable range, whose pos is −1)."""
    m = rows.shape[0]
    Q, d = qh.shape
    scores = np.empty((Q, m), dtype=np.float32)
    rpos = np.empty(m, dtype=np.int64)
    qf = np.empty(((Q + GROUP - 1) // GROUP * GROUP, d), dtype=np.float32)  # (Qp, D) padded queries
    pad_queries(qh, qf, qf)
    scan_range(head.keys, head.keys_by_row, head.pos, rows, 0, m, qf, qf, False, rpos, scores)
    return rpos, scores


@jit
def scan_range(keys, keys_by_row, pos, rows, r0, r1, qf, qb, use_b, rpos, scores):
    """`_scan` of rows[r0:r1] into rpos[r0:r1] and scores[:, r0:r1] (Q = scores.shape[0] queries).

    keys: the layout's rows (keys_by_row) or the cache's keys by position (each row read at pos[row]).
    qf: (Qp, D) float32 queries padded to groups of GROUP (`dots.pad_queries`); qb: the same as bf16 bits,
    used instead where `use_b` (the hardware bf16 dot product, kernels/dots.py; same scores up to summation order)."""
    Q = scores.shape[0]
    for r in range(r0, min(r0 + 2 * _AHEAD, r1)):
        prefetch_row(pos, rows[r])
    for r in range(r0, min(r0 + _AHEAD, r1)):
        prefetch_row(keys, rows[r] if keys_by_row else pos[rows[r]])
    for r in range(r0, r1):
        if r + 2 * _AHEAD < r1:  # positions further ahead: a key read by position waits on its position
            prefetch_row(pos, rows[r + 2 * _AHEAD])
        if r + _AHEAD < r1:
            ahead = rows[r + _AHEAD]
            prefetch_row(keys, ahead if keys_by_row else pos[ahead])  # (−1 outside: a hint never faults)
        row = rows[r]
        p = pos[row]
        rpos[r] = p
        if p < 0:
            for i in range(Q):
                scores[i, r] = -np.inf
            continue
        at = row if keys_by_row else p
        for i in range(0, Q, GROUP):
            if use_b:
                a0, a1, a2, a3 = dot4(keys, at, qb, i)
            else:
                a0, a1, a2, a3 = dot4(keys, at, qf, i)
            scores[i, r] = a0
            if i + 1 < Q:
                scores[i + 1, r] = a1
            if i + 2 < Q:
                scores[i + 2, r] = a2
            if i + 3 < Q:
                scores[i + 3, r] = a3


@jit
def slot_weights(sc, cols, scale, w, shifted, ex, bits):
    """One query's softmax weights exp(s·a − m) of its filled slots, written at their scan columns w[cols[t]].

    sc, cols: (K,) the slots' scores and scan columns (−1 empty); w: (m,) this query's column of the weights.
    Returns (m, z); (0, 0) for a query with no filled slot. shifted, ex, bits: (K,) scratch."""
    K = sc.shape[0]
    mx = -np.inf
    for t in range(K):
        if cols[t] >= 0:
            mx = max(mx, sc[t] * scale)
    if mx == -np.inf:
        return np.float32(0.0), np.float32(0.0)
    for t in range(K):
        shifted[t] = sc[t] * scale - mx
    exp_into(shifted, ex, bits)
    z = np.float32(0.0)
    for t in range(K):
        if cols[t] >= 0:
            w[cols[t]] = ex[t]
            z += ex[t]
    return np.float32(mx), z


@jit
def hit_rows(w, r0, r1, hits):
    """Write the scan columns r0 ≤ r < r1 some query weighs (w[r] ≠ 0, w: (≥ r1, Q)) into hits, in scan order;
    returns how many."""
    n_hit = 0
    for r in range(r0, r1):
        hit = False
        for i in range(w.shape[1]):
            hit = hit or w[r, i] != 0.0
        if hit:
            hits[n_hit] = r
            n_hit += 1
    return n_hit


@jit
def sum_values(vals, vscale, src, hits, x0, x1, w, out):
    """out (Q, D) += Σ_r w[r, i]·v_r over the scan columns r of hits[x0:x1] (value row src[r]): each value row is
    read once for all the queries that weigh it, in scan order (cluster runs), prefetched ahead. vals: bf16 bits,
    or int8 with vscale (rows,) float32 the rows' scales (each weight times its row's scale); vscale (0,): none."""
    Q, d = out.shape
    vf = np.empty(d, dtype=np.float32)
    scaled = vscale.shape[0] > 0
    for x in range(x0, min(x0 + _AHEAD, x1)):
        prefetch_row(vals, src[hits[x]])
    for x in range(x0, x1):
        if x + _AHEAD < x1:
            prefetch_row(vals, src[hits[x + _AHEAD]])
        r = hits[x]
        row = vals[src[r]]
        for j in range(d):
            vf[j] = stored_float(row[j])  # exact: bf16 bits or int8
        f = vscale[src[r]] if scaled else np.float32(1.0)
        for i in range(Q):
            wi = w[r, i]
            if wi != 0.0:
                wi = wi * f
                for j in range(d):
                    out[i, j] += wi * vf[j]


@jit
def _attend(vals, vscale, src, cols, sc, scale, rest_o, rest_lse, with_rest, o_out, mz_out):
    """The context part (decode/context.py) of each query's selected rows, merged with the estimate.

    Writes o = Σ exp(s·a − m)·v (fp32) and (m, z); a query with no selected row and no estimate gets
    o = 0, m = 0, z = 0. With the estimate (out_r, lse_r) joins by log-sum-exp as `merge_rest` does.
    The G queries of a head mostly select the same keys: each scan column's value row (src (m,), the
    values' row of every scan column) is read once for all of them, in scan order (cluster runs), rather
    than once per query and slot.

    Args: cols (Q, K) the scan column of each slot (−1 empty); sc (Q, K) its score.
    """
    Q, K = sc.shape
    m, d = src.shape[0], vals.shape[1]
    w = np.zeros((m, Q), dtype=np.float32)
    ms, zs = np.zeros(Q, np.float32), np.zeros(Q, np.float32)
    shifted, ex, bits = np.empty(K, np.float32), np.empty(K, np.float32), np.empty(K, np.int32)
    for i in range(Q):
        ms[i], zs[i] = slot_weights(sc[i], cols[i], scale, w[:, i], shifted, ex, bits)
    hits = np.empty(m, dtype=np.int64)
    n_hit = hit_rows(w, 0, m, hits)
    o_out[:, :] = 0.0
    sum_values(vals, vscale, src, hits, 0, n_hit, w, o_out)
    for i in range(Q):
        m_i, z = ms[i], zs[i]
        if with_rest and rest_lse[i] > -np.inf:
            m_new = max(m_i, rest_lse[i])
            a = np.float32(math.exp(m_i - m_new))
            b = np.float32(math.exp(rest_lse[i] - m_new))
            for j in range(d):
                o_out[i, j] = o_out[i, j] * a + rest_o[i, j] * b
            z = z * a + b
            m_i = m_new
        mz_out[i, 0] = m_i
        mz_out[i, 1] = z


@jit
def read_clusters(
    head, order, taken, m, qh, scale, rest_o, rest_lse, with_rest, attend, ids_out, sc_out, o_out, mz_out
):
    """What a head (`HeadArrays`) does once its clusters are chosen: the exact scan of the first `taken` of `order`
    (m rows), each query's top-k into ids_out / sc_out, and with `attend` the context part (merged with rest_o /
    rest_lse when `with_rest`) into o_out / mz_out."""
    rows = _cluster_rows(head.offsets, order, taken, m)
    rpos, scores = _scan(head, rows, qh)
    cols = np.empty(ids_out.shape, dtype=np.int64)
    top_k_rows(scores, rpos, ids_out, sc_out, cols)
    if attend:  # the values' row of each scan column: its layout row (values stored by row) or its position
        _attend(
            head.vals,
            head.vscale,
            rows if head.values_by_row else rpos,
            cols,
            sc_out,
            scale,
            rest_o,
            rest_lse,
            with_rest,
            o_out,
            mz_out,
        )


@jit
def scan_head(head, order, taken, qh, k, scale, ids_out, sc_out, o_out, mz_out):
    """One KV head (`HeadArrays`) whose clusters were chosen elsewhere (index/routed/device.py, on the decode device): scan the
    first `taken` clusters of `order`, top-k, context part (without an estimate: the device merges its
    own). Returns the keys read.

    Args: as `finish_head`; order: (W,) int32 clusters by priority; taken: how many of them to read.
    """
    m = count_rows(head.offsets, order, taken)
    no_rest_o, no_rest_lse = np.zeros((1, o_out.shape[1]), np.float32), np.zeros(1, np.float32)
    read_clusters(head, order, taken, m, qh, scale, no_rest_o, no_rest_lse, False, True, ids_out, sc_out, o_out, mz_out)
    return m


@pjit
def scan_layer_par(a, order, take, q, k, scale, out, heads):
    """One layer routed elsewhere, every KV head on numba's threads: `scan_head` per head.

    Args: a: `LayerArrays`; order (Hkv, W) int32 clusters by priority, take (Hkv,) int32 how many to read;
        q (Hkv, Q, D) float32; out: `LayerOut`; heads: `HeadClock`.
    """
    # the output tuples unpacked here, outside the parallel loops: numba 0.68 drops writes made through a
    # tuple's array field inside a prange body (tests/test_routed_kernel.py checks the results); the inputs are only
    # read, through each head's `HeadArrays`
    ids, scores, o, mz = out
    read, clock = heads
    for h in prange(a.keys.shape[0]):
        clock[h, 0] = cycles()
        read[h] = scan_head(head_arrays(a, h), order[h], take[h], q[h], k, scale, ids[h], scores[h], o[h], mz[h])
        clock[h, 1] = cycles()
