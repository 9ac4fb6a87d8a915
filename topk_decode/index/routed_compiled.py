"""routed's compiled path, the Python side: one layer's arrays in, the heads' tasks on the strategy's pool.

The compiled functions are in routed_kernel.py. Per layer, two rounds of tasks:
- routing, over (KV head, range of clusters): logits and their exponentials (`route_chunk`);
- the rest of each head (`finish_head`): cluster choice, scan, top-k, the estimate, the context part.

Splitting routing over ranges gives every pool thread work when the KV heads are fewer than the cores.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from topk_decode.index.routed_kernel import finish_head, route_chunk, scan_head

# The smallest cluster range of one routing task: below it a task's fixed cost rivals its work.
_MIN_CLUSTERS_PER_TASK = 1024


def warm_up() -> None:
    """Compile the kernels now (seconds on a first run without numba's disk cache), not inside a decode step."""
    f32, u16 = np.float32, np.uint16
    Q, d, C = 1, 2, 2
    logit, e = np.zeros((C, Q), f32), np.zeros((C, Q), f32)
    mx, z = np.zeros((1, Q), f32), np.zeros((1, Q), f32)
    qh, cent, sf = np.zeros((Q, d), f32), np.zeros((C, d), u16), np.ones(C, f32)
    route_chunk(qh, cent, np.zeros(C, f32), f32(1.0), logit, e, mx[0], z[0])
    ids, sc = np.empty((Q, 1), np.int64), np.empty((Q, 1), f32)
    finish_head(np.zeros((4, d), u16), np.arange(4), np.zeros(4, np.bool_), np.array([0, 2, 4]), sf, cent, qh,
                 2, 1, f32(1.0), True, np.zeros((4, d), u16), True, True, logit, e, np.array([0, C]), mx, z,
                 ids, sc, np.empty((Q, d), f32), np.empty(Q, f32), np.empty((Q, d), f32), np.empty((Q, 2), f32))
    scan_head(np.zeros((4, d), u16), np.arange(4), np.zeros(4, np.bool_), np.array([0, 2, 4]),
              np.array([0, 1], np.int32), 1, qh, 1, f32(1.0), np.zeros((4, d), u16), True, ids, sc,
              np.empty((Q, d), f32), np.empty((Q, 2), f32))


class LayerArrays(NamedTuple):
    """One layer's arrays as the kernel reads them (numpy views of the strategy's tensors, no copies).

    keys: (Hkv, N, D) uint16; pos: (Hkv, N) int64; outside: (Hkv, N) bool; offsets: (Hkv, C + 1) int64;
    cent: (Hkv, C, D) uint16 (bf16); bias, size_factor: (Hkv, C) float32 (`finish_head`); vmeans: (Hkv, C, D)
    uint16 (bf16) or (Hkv, 1, D) zeros;
    vals: (Hkv, N, D) uint16 values (by layout row when values_by_row, else by position) or None.
    """

    keys: np.ndarray
    pos: np.ndarray
    outside: np.ndarray
    offsets: np.ndarray
    cent: np.ndarray
    bias: np.ndarray
    size_factor: np.ndarray
    vmeans: np.ndarray
    vals: np.ndarray | None
    values_by_row: bool


class LayerResult(NamedTuple):
    """ids (Hkv, Q, K) int64 (−1 in empty slots), scores (Hkv, Q, K) float32, the estimate's out
    (Hkv, Q, D) and lse (Hkv, Q) float32 (meaningful with estimate), and the keys read in all heads."""

    ids: torch.Tensor
    scores: torch.Tensor
    rest_out: torch.Tensor
    rest_lse: torch.Tensor
    read: int


def _reused(scratch: dict | None, name: str, shape: tuple, dtype: type) -> np.ndarray:
    """scratch[name] when it has this shape, else a new buffer kept there (None: always a new one)."""
    buf = None if scratch is None else scratch.get(name)
    if buf is None or buf.shape != shape:
        buf = np.empty(shape, dtype)
        if scratch is not None:
            scratch[name] = buf
    return buf


def search_layer(arrays: LayerArrays, q: torch.Tensor, budget: int, k: int, scale: float, estimate: bool,
                 pool, o: np.ndarray | None = None, mz: np.ndarray | None = None,
                 scratch: dict | None = None) -> LayerResult:
    """routed's search of one layer (and, given o and mz, its context part), every KV head in parallel on `pool`.

    Args:
        arrays: the layer's arrays (`LayerArrays`).
        q: (Hkv, Q, D) float32 queries; budget: keys to read per head (at least); k: results per query.
        scale: softmax scale; estimate: compute the unread clusters' estimate; pool: a `threads.HeadPool`.
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
    vals = a.vals if a.vals is not None else a.keys          # unread unless attend
    # Routing tasks per head: enough for every pool thread (Qwen2.5-7B has 4 KV heads for 16 cores),
    # each over at least _MIN_CLUSTERS_PER_TASK clusters.
    J = max(1, min(-(-pool.threads // hkv), C // _MIN_CLUSTERS_PER_TASK))
    bounds = np.array([C * p // J for p in range(J + 1)], dtype=np.int64)
    logit, e = (_reused(scratch, name, (hkv, C, Q), np.float32) for name in ("logit", "e"))
    mx_p, z_p = (_reused(scratch, name, (hkv, J, Q), np.float32) for name in ("mx", "z"))

    def route(task: tuple[int, int]) -> None:
        h, p = task
        c0, c1 = bounds[p], bounds[p + 1]
        route_chunk(qn[h], a.cent[h][c0:c1], a.bias[h][c0:c1], s, logit[h][c0:c1], e[h][c0:c1], mx_p[h, p], z_p[h, p])

    def finish(h: int) -> int:
        return finish_head(a.keys[h], a.pos[h], a.outside[h], a.offsets[h], a.size_factor[h], a.vmeans[h], qn[h],
                            budget, k, s, estimate, vals[h], a.values_by_row, attend, logit[h], e[h], bounds,
                            mx_p[h], z_p[h], ids[h], scores[h], rest_o[h], rest_lse[h], o[h], mz[h])

    pool.map(route, [(h, p) for h in range(hkv) for p in range(J)])
    read = pool.map(finish, range(hkv))
    return LayerResult(torch.from_numpy(ids), torch.from_numpy(scores), torch.from_numpy(rest_o),
                       torch.from_numpy(rest_lse), int(sum(read)))


def scan_layer(arrays: LayerArrays, q: torch.Tensor, order: torch.Tensor, take: torch.Tensor, k: int,
               scale: float, pool, o: np.ndarray, mz: np.ndarray) -> LayerResult:
    """One layer routed on the device (index/routed_device.py): every KV head scans its chosen clusters,
    takes the top-k and writes the context part, in parallel on `pool`. No estimate here (the device
    merges its own), so the result's rest is empty.

    Args:
        arrays: the layer's arrays; q: (Hkv, Q, D) float32 queries.
        order: (Hkv, W) int32 clusters by priority; take: (Hkv,) int32 how many of them to read.
        k: results per query; scale: softmax scale; pool: a `threads.HeadPool`.
        o: (Hkv, Q, D) float32 and mz: (Hkv, Q, 2) float32 receive the context part.
    """
    hkv, Q, d = q.shape
    a, s = arrays, np.float32(scale)
    qn = q.contiguous().numpy()
    order_n, take_n = order.numpy(), take.numpy()
    ids = np.empty((hkv, Q, k), dtype=np.int64)
    scores = np.empty((hkv, Q, k), dtype=np.float32)
    vals = a.vals if a.vals is not None else a.keys

    def head(h: int) -> int:
        return scan_head(a.keys[h], a.pos[h], a.outside[h], a.offsets[h], order_n[h], int(take_n[h]), qn[h], k, s,
                         vals[h], a.values_by_row, ids[h], scores[h], o[h], mz[h])

    read = pool.map(head, range(hkv))
    return LayerResult(torch.from_numpy(ids), torch.from_numpy(scores), torch.zeros(hkv, Q, d),
                       torch.full((hkv, Q), -float("inf")), int(sum(read)))
