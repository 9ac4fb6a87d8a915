"""The compiled paths' exact top-k of one row of fp32 scores: a radix select on order-preserving keys.

A float32's bits map to a uint32 key whose unsigned order is the floats' order (`_order_key`). The k-th
largest score is found digit by digit: a histogram of the keys' top 11 bits finds the bucket holding it,
then three more digits (8, 8 and 5 bits) of that bucket's keys alone, so the full row is read twice (the
histogram, then one pass that lists the columns at or above the bucket) and only a few hundred keys more
than that. np.partition (a branchy quickselect) over the row, or over the bucket, cost more
(docs/BENCHMARKS.md runs 14 and 17). Scores are never NaN; −inf marks rows that must never be returned.
"""

from __future__ import annotations

import numpy as np

from topk_decode.kernels.jit import jit

# the histogram's bucket of −inf: no finite float maps to it (the most negative finite floats map to 4–7)
_NEG_INF_BUCKET = 3


@jit
def _order_key(b):
    """A float32's bits (uint32) → a uint32 whose unsigned order is the floats' order (−0 just below +0)."""
    return b ^ np.uint32(0xFFFFFFFF) if b >> np.uint32(31) else b | np.uint32(0x80000000)


@jit
def _key_float(key):
    """The float32 whose `_order_key` is key."""
    out = np.empty(1, dtype=np.uint32)
    out[0] = key & np.uint32(0x7FFFFFFF) if key >> np.uint32(31) else key ^ np.uint32(0xFFFFFFFF)
    return out.view(np.float32)[0]


@jit
def _histogram(bits, hist):
    """hist (2048,) = counts of the top 11 bits of the order keys of bits (float32 bits, uint32)."""
    hist[:] = 0
    for r in range(bits.shape[0]):
        hist[_order_key(bits[r]) >> np.uint32(21)] += 1


@jit
def _bucket(hist, kk):
    """(bucket, above): the histogram bucket holding the kk-th largest key, and the keys in higher buckets."""
    above, b = 0, hist.shape[0] - 1
    while above + hist[b] < kk:
        above += hist[b]
        b -= 1
    return b, above


@jit
def _kth_key(keys, n, need):
    """The need-th largest of keys[:n] (uint32, sharing their top 11 bits; 1 ≤ need ≤ n), by three more
    digits from the top. keys is reordered."""
    counts = np.empty(256, dtype=np.int64)
    for level in range(3):
        shift = np.uint32(13 - 8 * level) if level < 2 else np.uint32(0)
        mask = np.uint32(255) if level < 2 else np.uint32(31)
        counts[:] = 0
        for x in range(n):
            counts[(keys[x] >> shift) & mask] += 1
        d, above = _bucket(counts[: int(mask) + 1], need)
        kept = 0
        for x in range(n):  # keep the keys with digit d, in place (no branch)
            kx = keys[x]
            keys[kept] = kx
            kept += ((kx >> shift) & mask) == d
        n, need = kept, need - above
    return keys[0]  # all 32 bits fixed: the keys left are equal


@jit
def _cut(bits, kk, hist, cols, keys):
    """After `_histogram(bits, hist)`: (the kk-th largest float, n), with cols[:n] the columns at or above its
    histogram bucket, in row order. One pass over the row, writing without branches (a score above or below the
    cut is a coin flip for the branch predictor); then the bucket's keys alone (`_kth_key`).
    cols (m,) int64 and keys (m,) uint32: scratch."""
    b, above = _bucket(hist, kk)
    nb = np.uint32(b)
    n, n_b = 0, 0
    for r in range(bits.shape[0]):
        key = _order_key(bits[r])
        top = key >> np.uint32(21)
        cols[n] = r
        n += top >= nb
        keys[n_b] = key
        n_b += top == nb
    return _key_float(_kth_key(keys, n_b, kk - above)), n


@jit
def kth_largest(s, kk, hist):
    """The kk-th largest of s (float32, 1 ≤ kk ≤ len(s), no NaN), exactly. hist: (2048,) int64 scratch."""
    bits = s.view(np.uint32)
    _histogram(bits, hist)
    m = s.shape[0]
    return _cut(bits, kk, hist, np.empty(m, dtype=np.int64), np.empty(m, dtype=np.uint32))[0]


@jit
def top_k_one(s, rpos, ids_out, sc_out, cols_out, hist):
    """One query's top-k: every score above the k-th largest, then ties at it in row order.

    s: (m,) scores (−inf: never returned); rpos: (m,) positions. Writes ids (positions), scores and the scan
    columns they came from into the (K,) outputs, in row order; −1 / 0 / −1 in unfilled slots. hist: (2048,)
    int64 scratch. Returns the slots filled.
    """
    m, K = s.shape[0], ids_out.shape[0]
    bits = s.view(np.uint32)
    _histogram(bits, hist)
    kk = min(K, m - hist[_NEG_INF_BUCKET])
    o = 0
    if kk > 0:
        cols = np.empty(m, dtype=np.int64)
        cut, n = _cut(bits, kk, hist, cols, np.empty(m, dtype=np.uint32))
        for x in range(n):
            r = cols[x]
            if s[r] > cut:
                ids_out[o], sc_out[o], cols_out[o] = rpos[r], s[r], r
                o += 1
        for x in range(n):
            if o >= kk:
                break
            r = cols[x]
            if s[r] == cut:
                ids_out[o], sc_out[o], cols_out[o] = rpos[r], s[r], r
                o += 1
    while o < K:
        ids_out[o], sc_out[o], cols_out[o] = -1, 0.0, -1
        o += 1
    return kk


@jit
def top_k_rows(scores, rpos, ids_out, sc_out, cols_out):
    """Each query's `top_k_one` of scores (Q, m); rpos: (m,) each scan column's original position."""
    hist = np.empty(2048, dtype=np.int64)
    for i in range(scores.shape[0]):
        top_k_one(scores[i], rpos, ids_out[i], sc_out[i], cols_out[i], hist)
