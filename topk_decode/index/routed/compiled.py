"""routed's compiled path, the Python side: one layer's arrays in, one compiled call per layer out.

The compiled functions are in kernels/routed_route.py, kernels/routed_scan.py and kernels/routed_split.py. With routing on
the CPU, one call per layer (`search_layer_par`) runs two parallel rounds on numba's threads:
- routing, over (KV head, range of clusters): logits and their exponentials (`route_chunk`);
- the rest of each head (`finish_head`): cluster choice, scan, top-k, the estimate, the context part.
Splitting routing over ranges gives every thread work when the KV heads are fewer than the cores. When
the decode device routes (index/routed/device.py), `split_layer_par` cuts the scan, top-k and context part into
pieces for the whole team (`split_layer`). `scan_layer` (one task per KV head, `scan_head`) is the split's
reference in the tests: in decoding it lost to the split (docs/BENCHMARKS.md "prefetching, and the heads' work split over the whole team").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from topk_decode.kernels import jit
from topk_decode.kernels.dots import GROUP, bf16_available
from topk_decode.kernels.routed_route import RestOut, RouteBuffers, search_layer_par
from topk_decode.kernels.routed_scan import HeadClock, LayerArrays, LayerOut, scan_layer_par
from topk_decode.kernels.routed_split import ROUNDS, SplitScratch, new_scratch, new_tally, split_layer_par

# The smallest cluster range of one routing task: below it a task's fixed cost rivals its work.
_MIN_CLUSTERS_PER_TASK = 1024


def warm_up(arrays: LayerArrays) -> None:
    """Compile the per-layer calls for these arrays' types now (seconds on a first run without numba's disk
    cache), not inside a decode step: a search of one query with k = 1, then a split scan of one cluster."""
    hkv, d = arrays.keys.shape[0], arrays.keys.shape[2]
    q = torch.zeros(hkv, 1, d)
    o, mz = np.empty((hkv, 1, d), np.float32), np.empty((hkv, 1, 2), np.float32)
    search_layer(arrays, q, 1, 1, 1.0, True, 1, o, mz)
    order, take = torch.zeros(hkv, 1, dtype=torch.int32), torch.ones(hkv, dtype=torch.int32)
    split_layer(arrays, q, order, take, 1, 1.0, 2, o, mz, {})
    split_layer(arrays, q, order, take, 1, 1.0, 2, o, mz, {}, rows_given=True)


def kernel_positions(pos: torch.Tensor, outside: torch.Tensor) -> np.ndarray:
    """The kernels' positions: (Hkv, N) int32, −1 where a row is outside the searchable range (sinks, tail).

    One 4-byte read per scanned row instead of an 8-byte position and a flag from two more places in memory:
    the rows routing picks are scattered, so each array read costs a cache miss of its own."""
    return torch.where(outside.view(pos.shape), -1, pos).to(torch.int32).numpy()


class LayerResult(NamedTuple):
    """ids (Hkv, Q, K) int64 (−1 in empty slots), scores (Hkv, Q, K) float32, the estimate's out
    (Hkv, Q, D) and lse (Hkv, Q) float32 (meaningful with estimate), the keys read in all heads, the
    slots filled (counted by numpy: a torch op would wake torch's OpenMP threads, engine.py) and the
    heads' timing (`HeadTimes`)."""

    ids: torch.Tensor
    scores: torch.Tensor
    rest_out: torch.Tensor
    rest_lse: torch.Tensor
    read: int
    filled: int
    times: HeadTimes


# the parts of a split call (kernels/routed_split.py), as HeadTimes.rounds times them: from the Python side's call to the
# compiled function's start, its rounds, and from their end back to the Python side
SPLIT_ROUNDS = ("enter", *ROUNDS, "exit")


class HeadTimes(NamedTuple):
    """Seconds inside one compiled call: the mean and the slowest head's own work, and the span from the
    first head's start to the last one's end (the call's time beyond the span is starting and joining
    the threads; beyond the slowest head, heads that started late). A split call (kernels/routed_split.py) times
    its pieces instead of heads, and its parts (`SPLIT_ROUNDS`: entry, the rounds, exit) as `rounds`."""

    mean: float
    slowest: float
    span: float
    rounds: tuple = ()


def head_times(clock: np.ndarray) -> HeadTimes:
    """HeadTimes of a call's clock (Hkv, 2) `cycles` (start, end) per head."""
    rate = jit.cycles_per_second()
    work = clock[:, 1] - clock[:, 0]
    return HeadTimes(
        float(work.mean()) / rate, float(work.max()) / rate, float(clock[:, 1].max() - clock[:, 0].min()) / rate
    )


def team_size(cores: int) -> int:
    """Threads of the per-layer call on a host with `cores` cores: one fewer than the cores, and (at the
    call) no more than its tasks. Every team member waits at the region's end, so one descheduled member
    stalls the layer for an OS time slice; a team of every core did, while the GPU ran the step
    (docs/BENCHMARKS.md "routing on the device")."""
    return max(1, cores - 1)


def reused_buffer(scratch: dict | None, name: str, shape: tuple, dtype: type) -> np.ndarray:
    """scratch[name] when it has this shape, else a new buffer kept there (None: always a new one)."""
    buf = None if scratch is None else scratch.get(name)
    if buf is None or buf.shape != shape:
        buf = np.empty(shape, dtype)
        if scratch is not None:
            scratch[name] = buf
    return buf


def search_layer(
    arrays: LayerArrays,
    q: torch.Tensor,
    budget: int,
    k: int,
    scale: float,
    estimate: bool,
    threads: int,
    o: np.ndarray | None = None,
    mz: np.ndarray | None = None,
    scratch: dict | None = None,
) -> LayerResult:
    """routed's search of one layer (and, given o and mz, its context part), every KV head in parallel.

    Args:
        arrays: the layer's arrays (`LayerArrays`).
        q: (Hkv, Q, D) float32 queries; budget: keys to read per head (at least); k: results per query.
        scale: softmax scale; estimate: compute the unread clusters' estimate; threads: numba threads to use.
        o: (Hkv, Q, D) float32 receives the context part's unnormalised output (merged with the estimate);
        mz: (Hkv, Q, 2) float32 receives its m and z. Both None: search only.
        scratch: the caller's dict of routing buffers, reused across layers and steps (the logits are
            MBs at 1M tokens: fresh ones would be page-faulted in every layer); None: fresh buffers.
    """
    hkv, Q, d = q.shape
    a, s = arrays, np.float32(scale)
    C = a.cent.shape[1]
    qn = q.contiguous().numpy()
    ids = np.empty((hkv, Q, k), dtype=np.int64)
    scores = np.empty((hkv, Q, k), dtype=np.float32)
    rest_o = np.zeros((hkv, Q, d), dtype=np.float32)
    rest_lse = np.full((hkv, Q), -np.inf, dtype=np.float32)
    attend = o is not None
    if not attend:
        o, mz = np.empty((hkv, Q, d), np.float32), np.empty((hkv, Q, 2), np.float32)
    # Routing tasks per head: enough for every thread (Qwen2.5-7B has 4 KV heads for 16 cores), each over
    # at least _MIN_CLUSTERS_PER_TASK clusters.
    J = max(1, min(-(-threads // hkv), C // _MIN_CLUSTERS_PER_TASK))
    bounds = np.array([C * p // J for p in range(J + 1)], dtype=np.int64)
    logit, e = (reused_buffer(scratch, name, (hkv, C, Q), np.float32) for name in ("logit", "e"))
    mx_p, z_p = (reused_buffer(scratch, name, (hkv, J, Q), np.float32) for name in ("mx", "z"))
    read, clock = np.zeros(hkv, dtype=np.int64), np.zeros((hkv, 2), dtype=np.int64)
    jit.set_threads(min(threads, hkv * J))  # no idle team members (see `team_size`)
    search_layer_par(
        a,
        qn,
        budget,
        k,
        s,
        estimate,
        attend,
        RouteBuffers(logit, e, bounds, mx_p, z_p),
        LayerOut(ids, scores, o, mz),
        RestOut(rest_o, rest_lse),
        HeadClock(read, clock),
    )
    return LayerResult(
        torch.from_numpy(ids),
        torch.from_numpy(scores),
        torch.from_numpy(rest_o),
        torch.from_numpy(rest_lse),
        int(read.sum()),
        int(np.count_nonzero(ids >= 0)),
        head_times(clock),
    )


def scan_layer(
    arrays: LayerArrays,
    q: torch.Tensor,
    order: torch.Tensor,
    take: torch.Tensor,
    k: int,
    scale: float,
    threads: int,
    o: np.ndarray,
    mz: np.ndarray,
) -> LayerResult:
    """One layer routed on the device (index/routed/device.py), one task per KV head (the split's reference in the
    tests; `split_layer` decodes): every KV head scans its chosen clusters,
    takes the top-k and writes the context part, in parallel. No estimate here (the device
    merges its own), so the result's rest is empty.

    Args:
        arrays: the layer's arrays; q: (Hkv, Q, D) float32 queries.
        order: (Hkv, W) int32 clusters by priority; take: (Hkv,) int32 how many of them to read.
        k: results per query; scale: softmax scale; threads: numba threads to use.
        o: (Hkv, Q, D) float32 and mz: (Hkv, Q, 2) float32 receive the context part.
    """
    hkv, Q, d = q.shape
    a, s = arrays, np.float32(scale)
    qn = q.contiguous().numpy()
    order_n, take_n = order.numpy(), take.numpy()
    ids = np.empty((hkv, Q, k), dtype=np.int64)
    scores = np.empty((hkv, Q, k), dtype=np.float32)
    read, clock = np.zeros(hkv, dtype=np.int64), np.zeros((hkv, 2), dtype=np.int64)
    jit.set_threads(min(threads, hkv))
    scan_layer_par(a, order_n, take_n, qn, k, s, LayerOut(ids, scores, o, mz), HeadClock(read, clock))
    return LayerResult(
        torch.from_numpy(ids),
        torch.from_numpy(scores),
        torch.zeros(hkv, Q, d),
        torch.full((hkv, Q), -float("inf")),
        int(read.sum()),
        int(np.count_nonzero(ids >= 0)),
        head_times(clock),
    )


def split_layer(
    arrays: LayerArrays,
    q: torch.Tensor,
    order: torch.Tensor,
    take: torch.Tensor,
    k: int,
    scale: float,
    threads: int,
    o: np.ndarray,
    mz: np.ndarray,
    scratch: dict,
    o_bf16: np.ndarray | None = None,
    rows_given: bool = False,
    read_scores: np.ndarray | None = None,
) -> LayerResult:
    """`scan_layer` with the heads' work cut into `threads` equal pieces per round (kernels/routed_split.py), so every
    thread of the team has work however few the KV heads are.

    Args: as `scan_layer`; scratch: the caller's dict, which keeps the buffers (grown when a layer needs more
        rows than they hold) across layers and steps; o_bf16: (Hkv, Q, D) uint16 that receives o rounded to
        bf16 too (the decoder's part buffer), or None; rows_given: `order` holds (Hkv, B) layout rows, `take[h]`
        of them read for head h (rank=keys: the device ranked every key), not clusters; read_scores: (Hkv, Q, W)
        float32 that receives the scaled exact scores of the rows read outside each query's top-k (−inf elsewhere;
        `split_layer_par`'s read_sc), or None.
    """
    # Called once per layer and step: its Python side is on the critical path (docs/BENCHMARKS.md "huge pages over a whole step, a faster top-k, less Python per layer")
    hkv, Q, d = q.shape
    qn = q.numpy() if q.is_contiguous() else q.contiguous().numpy()
    ids = np.empty((hkv, Q, k), dtype=np.int64)
    scores = np.empty((hkv, Q, k), dtype=np.float32)
    tally = scratch.get("tally")
    if tally is None:
        tally = scratch["tally"] = new_tally()
    if o_bf16 is None:
        o_bf16 = reused_buffer(scratch, "no_bf16", (0, Q, d), np.uint16)
    if read_scores is None:
        read_scores = reused_buffer(scratch, "no_read", (0, Q, 0), np.float32)
    qp = (Q + GROUP - 1) // GROUP * GROUP
    qf = reused_buffer(scratch, "qf", (hkv, qp, d), np.float32)
    # bf16 bits where the CPU scores with bf16 dot products (kernels/dots.py); a float32 buffer tells the kernel it cannot
    bf16 = bf16_available(d) and arrays.keys.strides[2] == 2
    qb = reused_buffer(scratch, "qb" if bf16 else "qf_b", (hkv, qp, d), np.uint16 if bf16 else np.float32)
    jit.set_threads(threads)
    for _ in range(2):
        c_in = jit.now()
        buf: SplitScratch | None = scratch.get("split")
        if buf is None or buf.part.shape[:2] != (threads, hkv) or buf.scores.shape[1] != Q:
            buf = scratch["split"] = new_scratch(hkv, Q, d, 0, threads)
        split_layer_par(
            arrays,
            order.numpy(),
            take.numpy(),
            rows_given,
            qn,
            qf,
            qb,
            k,
            np.float32(scale),
            threads,
            buf,
            LayerOut(ids, scores, o, mz),
            o_bf16,
            read_scores,
            tally,
        )
        c_out = jit.now()
        need = int(tally[0]["most_read"])
        if need <= buf.rows.shape[1]:
            break
        # too few rows for this layer (the first call, or a layer reading more): grow with a margin, again
        scratch["split"] = new_scratch(hkv, Q, d, need + need // 4 + 64, threads)
    no_rest = scratch.get("no_rest")
    if no_rest is None or no_rest[0].shape != (hkv, Q, d):
        no_rest = scratch["no_rest"] = (torch.zeros(hkv, Q, d), torch.full((hkv, Q), -float("inf")))
    t, rate = tally[0], jit.cycles_per_second()
    marks = (c_in, int(t["start"]), *(int(t[name]) for name in ROUNDS), c_out)
    times = HeadTimes(
        int(t["work"]) / threads / rate,
        int(t["slowest"]) / rate,
        int(t["span"]) / rate,
        tuple([(b - a) / rate for a, b in zip(marks, marks[1:])]),
    )
    return LayerResult(
        torch.from_numpy(ids), torch.from_numpy(scores), *no_rest, int(t["read"]), int(t["filled"]), times
    )
