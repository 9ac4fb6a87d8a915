"""routed's compiled path with routing on the CPU (no device tables, or `device_route=false`): per layer, one
call (`search_layer_par`) routes each KV head's query against its centroids over ranges of clusters in
parallel (`route_chunk`), then runs the rest of each head (`finish_head`): cluster choice, the estimate of
the unread clusters (`_unread`), and kernels/routed_scan.py's scan, top-k and context part. The Python side is
index/routed/compiled.py `search_layer`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from topk_decode.kernels.jit import cycles, jit, pjit, prange
from topk_decode.kernels.routed_scan import dot_queries, exp_into, head_arrays, read_clusters, widen


@jit
def route_chunk(qh, cent, bias, scale, logit, e, mx, z):
    """One (KV head, range of clusters) task: routing logits and their exponentials.

    Writes logit (Cj, Q) = s·q·μ_c + bias_c, mx (Q,) the range's max logit per query, e (Cj, Q) =
    exp(logit − mx) and z (Q,) = Σ e (the head combines the ranges, `finish_head`).
    """
    Cj, Q = logit.shape
    d = qh.shape[1]
    widened = np.empty(d, dtype=np.uint32)
    wf = widened.view(np.float32)
    dots = np.empty(Q, dtype=np.float32)
    for c in range(Cj):
        widen(cent[c], widened)
        dot_queries(qh, wf, dots)
        for i in range(Q):
            logit[c, i] = dots[i] * scale + bias[c]
    shifted = np.empty(Cj, dtype=np.float32)
    ex = np.empty(Cj, dtype=np.float32)
    bits = np.empty(Cj, dtype=np.int32)
    for i in range(Q):
        m = np.float32(-np.inf)
        for c in range(Cj):
            m = max(m, logit[c, i])
        mx[i] = m
        if m == -np.inf:
            e[:, i] = 0.0
            z[i] = 0.0
            continue
        for c in range(Cj):
            shifted[c] = logit[c, i] - m
        exp_into(shifted, ex, bits)
        total = np.float32(0.0)
        for c in range(Cj):
            e[c, i] = ex[c]
            total += ex[c]
        z[i] = total


@jit
def _cluster_order(logit, lz, offsets, budget, n):
    """Clusters by priority (max over queries of the log share logit − lz; logit is (C, Q)) and how many
    to read.

    Returns (order, taken, m): the first `taken` clusters of `order` hold m ≥ budget keys (or all of them).
    """
    C, Q = logit.shape
    neg = np.full(C, np.inf, dtype=np.float32)  # −share, ascending = by priority
    for c in range(C):
        for i in range(Q):
            if lz[i] > -np.inf:
                neg[c] = min(neg[c], lz[i] - logit[c, i])
    # sort only the first clusters: a partition of twice the expected count, doubled while the clusters
    # it holds do not reach the budget (the top clusters are often small ones)
    guess = min(C, 2 * ((budget * C + n - 1) // n) + 16)
    order = np.empty(0, dtype=np.int64)
    while True:
        if guess >= C:
            order = np.argsort(neg)
            break
        cut = np.partition(neg, guess)[guess]
        cand = np.nonzero(neg <= cut)[0]
        order = cand[np.argsort(neg[cand])]
        reach = 0
        for c in order:
            reach += offsets[c + 1] - offsets[c]
        if reach >= budget:
            break
        guess *= 2
    m = 0
    taken = 0
    while taken < order.shape[0] and m < budget:
        c = order[taken]
        m += offsets[c + 1] - offsets[c]
        taken += 1
    return order, taken, m


@jit
def _unread(e, size_factor, vmeans, order, taken, bounds, factor, mxs, rest_o, rest_lse):
    """The unread clusters' estimate (index/routed/estimate.py `unread_part`): lse = logsumexp_c(s·q·μ_c + log n_c),
    out = Σ_c p_c·v̄_c over the clusters not read.

    Reuses routing's exponentials: exp(s·q·μ_c + log n_c − mxs) = e[c, i]·size_factor[c]·factor[p, i]
    with size_factor = n_c·exp(−bias_c) (0 for a cluster without searchable keys) and factor the rescale
    of range p's exponentials to the head's max, so no exp is taken here.
    """
    C, Q = e.shape
    d = vmeans.shape[1]
    read = np.zeros(C, dtype=np.bool_)
    for t in range(taken):
        read[order[t]] = True
    z = np.zeros(Q, dtype=np.float32)
    w = np.empty(Q, dtype=np.float32)
    widened = np.empty(d, dtype=np.uint32)
    vf = widened.view(np.float32)
    rest_o[:, :] = 0.0
    for p in range(bounds.shape[0] - 1):
        for c in range(bounds[p], bounds[p + 1]):  # clusters outer: each mean value is read once for all queries
            if read[c] or size_factor[c] == 0.0:
                continue
            for i in range(Q):
                w[i] = e[c, i] * size_factor[c] * factor[p, i]
                z[i] += w[i]
            widen(vmeans[c], widened)
            for i in range(Q):
                for j in range(d):
                    rest_o[i, j] += w[i] * vf[j]
    for i in range(Q):
        if z[i] > 0.0 and mxs[i] > -np.inf:
            rest_lse[i] = mxs[i] + math.log(z[i])
            for j in range(d):
                rest_o[i, j] /= z[i]
        else:
            rest_lse[i] = -np.inf
            rest_o[i, :] = 0.0


@jit
def finish_head(
    head,
    size_factor,
    vmeans,
    qh,
    budget,
    k,
    scale,
    estimate,
    attend,
    logit,
    e,
    bounds,
    mx_parts,
    z_parts,
    ids_out,
    sc_out,
    rest_o,
    rest_lse,
    o_out,
    mz_out,
):
    """One KV head after its routing tasks: cluster choice, scan up to `budget` keys, top-k, [estimate],
    [context part]. Returns the keys read.

    Args:
        head: the head's `HeadArrays` (kernels/routed_scan.py): its keys (N, D) cluster-contiguous bf16 bits or int8,
            or with keys_by_row False the cache's keys by position; pos (N,) int32 original positions, −1 for rows
            never returned (sinks, tail): one array read per row, not positions and flags (docs/BENCHMARKS.md
            "segmented k-means, Qwen2.5-7B at 1M, one position array, huge pages"); offsets (C + 1,) int64, cluster
            c = rows [offsets[c], offsets[c+1]); vals (N or positions, D) bf16 bits, by layout row when
            values_by_row, else by position (attend only), or int8 with vscale their float32 scales (else (0,)).
        size_factor: (C,) float32 n_c·exp(−bias_c), 0 without searchable keys; vmeans: (C, D) bf16 mean
            values as uint16 (both for the estimate only).
        qh: (Q, D) float32 queries; budget: keys to read (at least); k: results per query; scale: s.
        estimate: fill rest_o/rest_lse with the unread clusters' estimate.
        attend: also write the context part into o_out (Q, D) float32 and mz_out (Q, 2).
        logit, e: (C, Q) routing's logits and exponentials; bounds: (J + 1,) the routing tasks' cluster
            ranges; mx_parts, z_parts: (J, Q) their maxima and sums (`route_chunk`).
        ids_out, sc_out: (Q, K) outputs (−1 / 0 in unfilled slots).
    """
    J, Q = mx_parts.shape
    mxs = np.full(Q, -np.inf, dtype=np.float32)
    for p in range(J):
        for i in range(Q):
            mxs[i] = max(mxs[i], mx_parts[p, i])
    factor = np.zeros((J, Q), dtype=np.float32)  # each range's exponentials → the head's max
    lz = np.full(Q, -np.inf, dtype=np.float32)
    for i in range(Q):
        if mxs[i] == -np.inf:
            continue
        total = 0.0
        for p in range(J):
            if mx_parts[p, i] > -np.inf:
                factor[p, i] = math.exp(mx_parts[p, i] - mxs[i])
                total += z_parts[p, i] * factor[p, i]
        lz[i] = mxs[i] + math.log(total)
    order, taken, m = _cluster_order(logit, lz, head.offsets, budget, head.pos.shape[0])
    if estimate:
        _unread(e, size_factor, vmeans, order, taken, bounds, factor, mxs, rest_o, rest_lse)
    read_clusters(head, order, taken, m, qh, scale, rest_o, rest_lse, estimate, attend, ids_out, sc_out, o_out, mz_out)
    return m


class RouteBuffers(NamedTuple):
    """Routing's buffers for one layer: logit, e (Hkv, C, Q) float32 the logits and their exponentials; bounds
    (J + 1,) int64 the routing tasks' cluster ranges; mx, z (Hkv, J, Q) float32 each range's maxima and sums."""

    logit: np.ndarray
    e: np.ndarray
    bounds: np.ndarray
    mx: np.ndarray
    z: np.ndarray


class RestOut(NamedTuple):
    """The unread clusters' estimate: out (Hkv, Q, D) float32, lse (Hkv, Q) float32 (−inf: nothing left out)."""

    out: np.ndarray
    lse: np.ndarray


@pjit
def search_layer_par(a, q, budget, k, scale, estimate, attend, route, out, rest, heads):
    """One layer, every KV head: routing over (head, cluster range) tasks, then `finish_head` per head, each
    round on numba's threads.

    Args: a: `LayerArrays`; q (Hkv, Q, D) float32; budget, k, scale, estimate: as `finish_head`; attend: also
        write the context part into out.o / out.mz; route: `RouteBuffers`; out: `LayerOut`; rest: `RestOut`;
        heads: `HeadClock` (read and the `cycles` at which each head's `finish_head` started and ended).
    """
    # unpacked outside the parallel loops (kernels/routed_scan.py `scan_layer_par` says why)
    cent, bias, size_factor, vmeans = a.cent, a.bias, a.size_factor, a.vmeans
    logit, e, bounds, mx_p, z_p = route
    ids, scores, o, mz = out
    rest_o, rest_lse = rest
    read, clock = heads
    hkv = a.keys.shape[0]
    J = bounds.shape[0] - 1
    for t in prange(hkv * J):
        h, p = t // J, t % J
        c0, c1 = bounds[p], bounds[p + 1]
        route_chunk(q[h], cent[h, c0:c1], bias[h, c0:c1], scale, logit[h, c0:c1], e[h, c0:c1], mx_p[h, p], z_p[h, p])
    for h in prange(hkv):
        clock[h, 0] = cycles()
        read[h] = finish_head(
            head_arrays(a, h),
            size_factor[h],
            vmeans[h],
            q[h],
            budget,
            k,
            scale,
            estimate,
            attend,
            logit[h],
            e[h],
            bounds,
            mx_p[h],
            z_p[h],
            ids[h],
            scores[h],
            rest_o[h],
            rest_lse[h],
            o[h],
            mz[h],
        )
        clock[h, 1] = cycles()
