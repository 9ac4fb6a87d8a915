"""routed's device-routed layer with the heads' work cut into equal pieces for the whole thread team.

`scan_layer_par` gives each KV head one task: Llama-3-8B's 8 heads use 8 of a 16-core host's threads
(Qwen2.5-7B's 4 heads use 4), and the layer waits for its slowest head. Here one call runs the layer in
rounds over the whole team (docs/BENCHMARKS.md "prefetching, and the heads' work split over the whole team"):

    rows:    per head, the layout rows of its chosen clusters, in routing order (counted, then listed, over
             ranges of its clusters);
    scan:    all heads' rows, cut into `pieces` equal ranges, scored against their head's queries;
    top-k:   per (head, query), the k-th largest score, the slots, and the slots' softmax weights;
    values:  the same ranges again: each piece sums weight × value over its rows that some query of the
             head selected, into a partial output per (piece, head); then each head adds its partials.

Same ids and scores as `scan_head`, and the same context part up to fp32 summation order
(tests/test_routed_split.py). The buffers are the caller's (`SplitScratch`): fresh MB-sized ones in
every layer would be page-faulted in, and unmapped again with a TLB shootdown on every core of the team.
The weights are stored query-major, (Hkv, Q, rows): the G top-k tasks of a head write their own rows
rather than interleaved floats of shared cache lines.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from topk_decode.kernels.dots import pad_queries
from topk_decode.kernels.jit import cycles, jit, pjit, prange
from topk_decode.kernels.routed_scan import (
    cluster_rows_into,
    count_rows,
    hit_rows,
    round_bf16,
    scan_range,
    slot_weights,
    sum_values,
)
from topk_decode.kernels.topk import top_k_one


class SplitScratch(NamedTuple):
    """The split call's buffers for `cap` rows per head (`new_scratch`)."""

    rows: np.ndarray  # (Hkv, cap) int64 layout rows of the chosen clusters
    rpos: np.ndarray  # (Hkv, cap) int64 their positions
    scores: np.ndarray  # (Hkv, Q, cap) float32 exact scores
    w: np.ndarray  # (Hkv, Q, cap) float32 softmax weights of the selected rows (0 elsewhere)
    part: np.ndarray  # (pieces, Hkv, Q, D) float32 partial outputs


def new_scratch(hkv: int, Q: int, d: int, cap: int, pieces: int) -> SplitScratch:
    """Buffers for a split call of `pieces` pieces over Hkv heads of Q queries, up to `cap` rows per head."""
    return SplitScratch(
        np.empty((hkv, cap), np.int64),
        np.empty((hkv, cap), np.int64),
        np.empty((hkv, Q, cap), np.float32),
        np.empty((hkv, Q, cap), np.float32),
        np.empty((pieces, hkv, Q, d), np.float32),
    )


@jit
def _pieces(counts, pieces):
    """Each piece's rows in each head, (pieces, Hkv, 2) int64 [r0, r1) (r0 = r1: none): the heads' rows
    (counts (Hkv,)) laid end to end and cut into `pieces` equal ranges."""
    hkv = counts.shape[0]
    starts = np.zeros(hkv + 1, dtype=np.int64)
    for h in range(hkv):
        starts[h + 1] = starts[h] + counts[h]
    seg = np.zeros((pieces, hkv, 2), dtype=np.int64)
    for p in range(pieces):
        a0, a1 = starts[hkv] * p // pieces, starts[hkv] * (p + 1) // pieces
        for h in range(hkv):
            r0, r1 = max(a0, starts[h]) - starts[h], min(a1, starts[h + 1]) - starts[h]
            if r1 > r0:
                seg[p, h, 0], seg[p, h, 1] = r0, r1
    return seg


@jit
def _pad_heads(q, qf, qb, use_b):
    """`dots.pad_queries` of every head (serial: see split_layer_par): use_b[h] = whether qb[h] holds head h's
    queries exactly."""
    for h in range(q.shape[0]):
        use_b[h] = pad_queries(q[h], qf[h], qb[h])


# What a split call reports, one record: keys read (all heads, the most in one head), slots filled, the pieces'
# work (sum, most, span) in `cycles`, then the `cycles` at the call's start and at the end of each round.
TALLY = np.dtype(
    [
        ("read", np.int64),
        ("most_read", np.int64),
        ("filled", np.int64),
        ("work", np.int64),
        ("slowest", np.int64),
        ("span", np.int64),
        ("start", np.int64),
        ("rows", np.int64),
        ("scan", np.int64),
        ("top_k", np.int64),
        ("values", np.int64),
        ("sums", np.int64),
    ]
)
ROUNDS = ("rows", "scan", "top_k", "values", "sums")  # TALLY's round stamps, in order


def new_tally() -> np.ndarray:
    """A (1,) TALLY record array for `split_layer_par` to fill."""
    return np.zeros(1, TALLY)


@jit
def _tally_reads(starts, read, tally):
    """From each head's row counts per cluster range (starts[h, j + 1], j < J): starts[h, j] = the first row of
    range j, read[h] = the head's rows; tally's read and most_read (serial: see split_layer_par)."""
    total, most = 0, 0
    for h in range(starts.shape[0]):
        starts[h, 0] = 0
        for j in range(1, starts.shape[1]):
            starts[h, j] += starts[h, j - 1]
        read[h] = starts[h, starts.shape[1] - 1]
        total += read[h]
        most = max(most, read[h])
    tally[0].read = total
    tally[0].most_read = most


@jit
def _tally_work(filled, clock, tally):
    """tally's filled (slots), work and slowest (the pieces' `cycles` summed and at most) and span."""
    n = 0
    for h in range(filled.shape[0]):
        for i in range(filled.shape[1]):
            n += filled[h, i]
    first, last = clock[0, 0], clock[0, 1]
    work, slowest = 0, 0
    for p in range(clock.shape[0]):
        work += clock[p, 1] - clock[p, 0]
        slowest = max(slowest, clock[p, 1] - clock[p, 0])
        first, last = min(first, clock[p, 0]), max(last, clock[p, 1])
    tally[0].filled = n
    tally[0].work = work
    tally[0].slowest = slowest
    tally[0].span = last - first


@pjit
def split_layer_par(a, order, take, given, q, qf, qb, k, scale, pieces, buf, out, o16, read_sc, tally):
    """One device-routed layer (as `scan_layer_par`) in `pieces` equal pieces per round.

    Args:
        a: `LayerArrays`; order, take, q, k, scale: as `scan_layer_par`.
        given: order holds layout rows themselves, take[h] of them for head h (routed's rank=keys: the device
            ranked every key), not clusters.
        qf, qb: (Hkv, Qp, D) buffers for the queries padded to groups of four, as float32 and as bf16 bits
            (uint16 where the CPU has the bf16 dot product, else float32 and unused; kernels/dots.py).
        buf: `SplitScratch`; it must hold every head's rows: when some head needs more (tally's most_read says
            how many), nothing else is written and the caller retries with a larger one.
        out: `LayerOut`; o16: (Hkv, Q, D) uint16 receives o rounded to bf16 as well (the decoder's part buffer:
            no conversion on the Python side), or (0, Q, D): o only.
        read_sc: (Hkv, Q, W) float32 receives s·q·k of every row read, −inf at each query's top-k and outside the
            searchable range and past the head's rows (routed's estimate_read on the device: the read rows outside
            the top-k join the estimate with their exact weights), or (0, Q, 0): nothing.
        tally: (1,) TALLY record array: the call's counts and times, reduced here so that the Python side does
            no array work.
    """
    # unpacked outside the parallel loops (kernels/routed_scan.py `scan_layer_par` says why)
    keys, pos, offsets, _, _, _, _, vals, values_by_row, vscale, keys_by_row = a
    rows, rpos, sc, w, part = buf
    ids, scores, o, mz = out
    hkv, Q, d = q.shape
    cap = rows.shape[1]
    # np.empty, not np.zeros, and the reductions in `_tally_reads` / `_tally_work`: in a parallel function
    # numba turns each array expression (a fill, a sum) into a parallel region of its own, a fork and join of
    # the team each (docs/BENCHMARKS.md "segmented k-means, Qwen2.5-7B at 1M, one position array, huge pages"). Every element of these is written by the rounds.
    read, filled, clock = np.empty(hkv, np.int64), np.empty((hkv, Q), np.int64), np.empty((pieces, 2), np.int64)
    tally[0].start = cycles()
    use_b = np.empty(hkv, np.bool_)
    _pad_heads(q, qf, qb, use_b)
    # the rows round: with fewer KV heads than threads (Qwen2.5-7B: 4 heads of ~10,000 chosen clusters at 1M),
    # each head's clusters in J ranges, counted, then listed once every range's first row is known (a second
    # parallel region); with one range per head it starts at row 0, so the counting task lists it too
    J = 1 if given else max(1, pieces // hkv)
    starts = np.empty((hkv, J + 1), np.int64)
    for t in prange(hkv * J):
        h, j = t // J, t % J
        if given:  # the rows themselves
            starts[h, 1] = take[h]
            if take[h] <= cap:
                rows[h, : take[h]] = order[h, : take[h]]
        else:
            t0, t1 = take[h] * j // J, take[h] * (j + 1) // J
            starts[h, j + 1] = count_rows(offsets[h], order[h], t1, t0)
            if J == 1 and starts[h, 1] <= cap:
                cluster_rows_into(offsets[h], order[h], t1, rows[h])
    _tally_reads(starts, read, tally)
    if tally[0].most_read > cap:
        return
    if J > 1:
        for t in prange(hkv * J):
            h, j = t // J, t % J
            cluster_rows_into(offsets[h], order[h], take[h] * (j + 1) // J, rows[h], take[h] * j // J, starts[h, j])
    tally[0].rows = cycles()
    seg = _pieces(read, pieces)
    for p in prange(pieces):
        clock[p, 0] = cycles()
        for h in range(hkv):
            r0, r1 = seg[p, h, 0], seg[p, h, 1]
            if r1 > r0:
                scan_range(keys[h], keys_by_row, pos[h], rows[h], r0, r1, qf[h], qb[h], use_b[h], rpos[h], sc[h])
    tally[0].scan = cycles()
    ms, zs = np.empty((hkv, Q), np.float32), np.empty((hkv, Q), np.float32)
    K = ids.shape[2]
    for t in prange(hkv * Q):
        h, i = t // Q, t % Q
        n = read[h]
        cols = np.empty(K, np.int64)
        filled[h, i] = top_k_one(sc[h, i, :n], rpos[h, :n], ids[h, i], scores[h, i], cols, np.empty(2048, np.int64))
        # zeroed by the task that scatters into it (its lines then sit in this core's cache, not in the scan
        # pieces' caches); no measurable change on the host either way (docs/BENCHMARKS.md "segmented k-means, Qwen2.5-7B at 1M, one position array, huge pages")
        w[h, i, :n] = 0.0
        ms[h, i], zs[h, i] = slot_weights(
            scores[h, i], cols, scale, w[h, i], np.empty(K, np.float32), np.empty(K, np.float32), np.empty(K, np.int32)
        )
        if read_sc.shape[0] > 0:
            for r in range(read_sc.shape[2]):
                read_sc[h, i, r] = sc[h, i, r] * scale if r < n else -np.inf
            for t2 in range(K):
                if cols[t2] >= 0:
                    read_sc[h, i, cols[t2]] = -np.inf
    tally[0].top_k = cycles()
    for p in prange(pieces):  # the same row ranges as the scan: each piece sums the rows it scanned that were chosen
        hits = np.empty(cap, np.int64)
        for h in range(hkv):
            r0, r1 = seg[p, h, 0], seg[p, h, 1]
            if r1 > r0:
                part[p, h] = 0.0
                n_hit = hit_rows(w[h].T, r0, r1, hits)
                sum_values(
                    vals[h], vscale[h], rows[h] if values_by_row else rpos[h], hits, 0, n_hit, w[h].T, part[p, h]
                )
        clock[p, 1] = cycles()
    tally[0].values = cycles()
    for h in prange(hkv):
        o[h] = 0.0
        for p in range(pieces):
            if seg[p, h, 1] > seg[p, h, 0]:  # pieces with rows of this head wrote a partial for it
                for i in range(Q):
                    for j in range(d):
                        o[h, i, j] += part[p, h, i, j]
        for i in range(Q):
            mz[h, i, 0] = ms[h, i]
            mz[h, i, 1] = zs[h, i]
            if o16.shape[0] > 0:
                round_bf16(o[h, i], o16[h, i])
    tally[0].sums = cycles()
    _tally_work(filled, clock, tally)
