"""routed's keyed estimate on the decode device: per cluster, the log-sum-exp of its keys' residual-code scores.

The default estimate weighs an unread cluster c as n_c·exp(s·q·μ_c), the Jensen lower bound of Σ_k exp(s·q·k); on
real models that bound lost most of routed's answers (docs/history/eval-2026-11.md, the ablation). `estimate_by=keys`
weighs every unread key by its approximate score s·q·(μ_c + r̂_k) instead (index/routed/pq.py). After cluster
routing the unread keys are whole clusters, so per cluster the estimate needs only

    L_c(q) = log Σ_{k ∈ c, searchable} exp(s·q·r̂_k)        and then   logit_c = s·q·μ_c + L_c

in place of s·q·μ_c + log n_c (index/routed/device.py `estimate_part`). L_c does not depend on which clusters were
read, so it runs beside routing inside the captured step. `cluster_lse` computes it from the 4-bit codes packed two
per byte (16 bytes per key at m = 32) in two passes: `row_scores` (every row's approximate score, the 16-entry tables
looked up per sub-vector) and `segment_lse` (per cluster). `rank=keys` ranks every key by the same `row_scores` and
sums the unread ones with `segment_lse`. On CUDA each pass is a Triton kernel (one program per cluster and KV head),
elsewhere torch ops (the tests' reference and the CPU device).

With `pq_values` the estimate gives every unread key its own value, its cluster's mean plus the 4-bit code of its
residual: `residual_sum` adds Σ_i w_i·r̂_i as a weighted histogram of the codes per sub-vector (torch ops on every
device: scatter-adds over blocks of rows, then one small product with the codebooks).

A cluster holding sinks or tail rows (the window attends to them exactly) is routed by the mean of its searchable keys
only, while its codes are residuals to the mean of all its keys: `fix_delta` carries the difference for those few
clusters, so logit_c is the log of Σ exp(s·q·(μ_c + r̂_k)) over its searchable keys, as the torch path's
`_unread_keys_part` computes it.

    >>> import torch
    >>> from topk_decode.index.routed.pq import ResidualCodes
    >>> codes = ResidualCodes(torch.zeros(1, 4, 1, dtype=torch.uint8), torch.zeros(1, 2, 16, 2))
    >>> dc = device_codes(codes, torch.tensor([[0, 3, 4]]), torch.zeros(4, dtype=torch.bool), torch.zeros(1, 2, 4),
    ...                   torch.zeros(1, 2, 4))
    >>> cluster_lse(dc, torch.ones(1, 1, 4), scale=0.5)  # log 3 and log 1: every residual scores 0
    tensor([[[1.0986, 0.0000]]])
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from typing import Self

import numpy as np
import torch

from topk_decode.index.routed.cluster import row_labels
from topk_decode.index.routed.pq import NBITS, ResidualCodes

log = logging.getLogger(__name__)
_WORDS = 1 << NBITS  # entries per sub-vector table
RESIDUAL_ROWS = 4096  # rows per scatter-add of `residual_sum` (Hkv·G·m·4096 floats at once)


class Tensors:
    """A dataclass of tensors only: moved and measured field by field."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor held, in field order."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def to(self, device: torch.device) -> Self:
        """The same tensors on `device`."""
        return type(self)(*(t.to(device) for t in self.tensors()))

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class DeviceCodes(Tensors):
    """One layer's residual codes as the device reads them (all KV heads).

    packed: (Hkv, m/2, N) uint8 two sub-vectors' codes per byte (the even one in the low nibble), sub-vector-major so
        a block of rows loads contiguously; m is even (an odd m gets a zero sub-vector).
    books: (Hkv, m, 16, D/m) float32 codewords (zero for the padding sub-vector).
    offsets: (Hkv, C+1) int32 first layout row of every cluster.
    searchable: (Hkv, ⌈N/8⌉) uint8 bits, row r searchable iff bit r % 8 of byte r // 8 is set.
    fix_ids: (Hkv, A) int64 clusters with sinks or tail rows; fix_delta: (Hkv, A, D) float32 the mean of all their
        keys minus the mean of their searchable keys (0 on padding entries).
    """

    packed: torch.Tensor
    books: torch.Tensor
    offsets: torch.Tensor
    searchable: torch.Tensor
    fix_ids: torch.Tensor
    fix_delta: torch.Tensor


@dataclass
class DeviceValueCodes(Tensors):
    """One layer's value residual codes as the device reads them (`pq_values`, all KV heads).

    packed: (Hkv, m/2, N) uint8 as `DeviceCodes.packed`; books: (Hkv, m, 16, D/m) float32 codewords (zero for the
    padding sub-vector); means: (Hkv, C, D) the layout's mean value per cluster (over all its keys: the residuals'
    reference), in the cache's dtype.
    """

    packed: torch.Tensor
    books: torch.Tensor
    means: torch.Tensor


def pack_codes(codes: ResidualCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed (Hkv, m/2, N) uint8, books (Hkv, m, 16, D/m) float32): two sub-vectors' codes per byte, the even one in
    the low nibble, sub-vector-major; an odd m gets a zero sub-vector."""
    books = codes.codebooks
    if codes.m % 2:  # the last byte's high nibble (0) codes a zero sub-vector
        books = torch.cat([books, torch.zeros(books.shape[0], 1, *books.shape[2:])], 1)
    return codes.codes.transpose(1, 2).contiguous(), books.float().contiguous()  # (Hkv, m/2, N): packed as stored


def device_value_codes(codes: ResidualCodes, means: torch.Tensor, dtype: torch.dtype) -> DeviceValueCodes:
    """A layer's value residual codes in the device's form (on the CPU): codes of v − v̄_c, means (Hkv, C, D) v̄_c."""
    packed, books = pack_codes(codes)
    return DeviceValueCodes(packed, books, means.to(dtype).contiguous())


def residual_sum(
    vc: DeviceValueCodes, w: torch.Tensor, block: int = RESIDUAL_ROWS, triton: bool | None = None
) -> torch.Tensor:
    """(Hkv, G, D) float32 Σ_i w_i·r̂_i over every layout row i: the weighted sum of the rows' decoded value residuals.

    As a weighted histogram of the codes per sub-vector, H_j[b] = Σ_{i: code_j(i) = b} w_i, then
    Σ_i w_i·r̂_i = Σ_j Σ_b H_j[b]·B_j[b] (the j-th D/m dimensions): the codes are read once (16 bytes per key at
    m = 32) and nothing is decoded per row. On CUDA a Triton kernel (one program per chunk of rows and KV head, its
    histograms added atomically once per sub-vector), elsewhere torch ops (scatter-add), `block` rows at a time.

    Args:
        vc: the layer's `DeviceValueCodes` on w's device; w: (Hkv, G, N) float32 each row's weight (0 where none).
        triton: the Triton kernel or torch's ops (default: Triton on CUDA).
    """
    hkv, g, n = w.shape
    m = 2 * vc.packed.shape[1]
    if w.is_cuda if triton is None else triton:
        hist = _residual_hist_triton(vc.packed, w)
    else:
        hist = _residual_hist_torch(vc.packed, w, block)
    out = torch.einsum("hgjb,hjbd->hgjd", hist.view(hkv, g, m, _WORDS), vc.books)  # (Hkv, G, m, D/m)
    return out.reshape(hkv, g, -1)[:, :, : vc.means.shape[2]]  # the padding sub-vector's dimensions dropped


def _residual_hist_torch(packed: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """(Hkv, G, m·16) float32 each sub-vector's weighted histogram of the codes, by scatter-adds of `block` rows."""
    hkv, g, n = w.shape
    m = 2 * packed.shape[1]
    hist = w.new_zeros(hkv, g, m * _WORDS)
    first = (torch.arange(m, device=w.device) * _WORDS).view(1, m, 1)  # each sub-vector's first bin
    for a in range(0, n, block):
        b = min(n, a + block)
        p = packed[:, :, a:b].long()  # (Hkv, m/2, B)
        bins = torch.stack([p & 0xF, p >> 4], 2).view(hkv, m, b - a) + first  # sub-vector 2j: low nibble of byte j
        src = w[:, :, None, a:b].expand(hkv, g, m, b - a).reshape(hkv, g, m * (b - a))
        hist.scatter_add_(-1, bins.view(hkv, 1, m * (b - a)).expand(hkv, g, m * (b - a)), src)
    return hist


RESIDUAL_CHUNK = 2048  # rows per program of the Triton histogram
ROWS_BLOCK = 128  # rows per program of the Triton row scores


def _residual_hist_triton(packed: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`_residual_hist_torch` by a Triton kernel (one program per chunk of rows and KV head)."""
    hkv, g, n = w.shape
    m2 = packed.shape[1]
    gp = _pow2(g)
    hist = torch.zeros((hkv, gp, 2 * m2 * _WORDS), dtype=torch.float32, device=w.device)
    grid = (-(-n // RESIDUAL_CHUNK), hkv)
    # w is often a view of a (Hkv, GP, N) buffer (`row_scores` pads G to a power of two): its strides are passed,
    # never assumed (read as contiguous, a head's weights came from the padding query's raw scores: −inf, NaN)
    if w.stride(2) != 1:
        w = w.contiguous()
    _kernels()["hist"][grid](
        packed.contiguous(), w, hist, n, g, w.stride(0), w.stride(1), RESIDUAL_CHUNK, M2=m2, GP=gp, BLOCK=64
    )
    return hist[:, :g]


def row_residuals(codes: DeviceCodes | DeviceValueCodes, rows: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """(Hkv, W, dim) float32 the decoded residuals r̂ of the layout rows `rows` (Hkv, W) int64 of each head: value codes'
    (dim: their means' D when not given) or key codes' (`code_error` measures the device's own)."""
    hkv, w = rows.shape
    m2, dsub = codes.packed.shape[1], codes.books.shape[3]
    p = codes.packed.gather(2, rows[:, None, :].expand(hkv, m2, w)).long()  # (Hkv, m/2, W)
    idx = torch.stack([p & 0xF, p >> 4], 2).view(hkv, 2 * m2, w)  # sub-vector 2j: the low nibble of byte j
    r = codes.books.gather(2, idx[..., None].expand(hkv, 2 * m2, w, dsub))  # (Hkv, m, W, D/m)
    return r.permute(0, 2, 1, 3).reshape(hkv, w, 2 * m2 * dsub)[:, :, : dim or codes.means.shape[2]]


def device_codes(
    codes: ResidualCodes,
    offsets: torch.Tensor,
    outside: torch.Tensor,
    centroids: torch.Tensor,
    routed_centroids: torch.Tensor,
) -> DeviceCodes:
    """A layer's codes in the device's form (on the CPU; `DeviceCodes.to` moves them).

    Args:
        codes: the layout's residual codes (index/routed/pq.py); offsets: (Hkv, C+1) the layout's cluster offsets.
        outside: (Hkv·N,) bool, per layout row whether it is a sink or tail row (not searchable).
        centroids: (Hkv, C, D) the layout's centroids (the codes' reference); routed_centroids: (Hkv, C, D) the ones
            routing scores (over the searchable keys only).
    """
    hkv, n, _ = codes.codes.shape
    packed, books = pack_codes(codes)
    out = outside.view(hkv, n)
    bits = torch.from_numpy(np.packbits((~out).numpy(), axis=1, bitorder="little"))
    fixed = []
    for h in range(hkv):
        rows = out[h].nonzero().squeeze(1)
        fixed.append(torch.unique(torch.searchsorted(offsets[h], rows, right=True) - 1))
    a = max(1, max(len(f) for f in fixed))
    fix_ids = torch.zeros(hkv, a, dtype=torch.int64)
    fix_delta = torch.zeros(hkv, a, centroids.shape[2])
    for h, f in enumerate(fixed):
        fix_ids[h, : len(f)] = f
        fix_delta[h, : len(f)] = centroids[h, f].float() - routed_centroids[h, f].float()
    return DeviceCodes(packed, books, offsets.to(torch.int32), bits, fix_ids, fix_delta)


def coarsened(codes: DeviceCodes, iters: int = 20) -> DeviceCodes:
    """The same codes at half the sub-vectors (half the bytes per key), made from the codes alone.

    Each byte holds the codes (a, b) of sub-vectors 2j and 2j + 1: one of 256 combined codewords (B_2j[a], B_2j+1[b]).
    A k-means of those 256 points into 16, weighted by how many rows hold each byte, gives sub-vector j of the coarse
    codes: its codebook (the 16 means) and every row's code (the mean its byte's point joined). No key is read: a
    layer's codes are coarsened on the host when the fine ones do not fit the device (index/routed/device.py
    `_place_codes`). m must be a multiple of 4 (the coarse codes are two per byte too).
    """
    hkv, m2, n = codes.packed.shape
    _, m, _, dsub = codes.books.shape
    if m % 4:
        raise ValueError(f"{m} sub-vectors cannot be halved into whole bytes")
    b = torch.arange(256)
    lo, hi = codes.books[:, 0::2].index_select(2, b & 0xF), codes.books[:, 1::2].index_select(2, b >> 4)
    points = torch.cat([lo, hi], -1)  # (Hkv, m/2, 256, 2·dsub) the byte value v's point: (B_2j[v & 15], B_2j+1[v >> 4])
    packed = codes.packed.numpy()
    weight = torch.from_numpy(
        np.stack([np.bincount(packed[h, j], minlength=256) for h in range(hkv) for j in range(m2)]).astype(np.float32)
    )
    means, join = _weighted_kmeans(points.flatten(0, 1), weight, _WORDS, iters)
    join = join.view(hkv, m2, 256).to(torch.uint8).numpy()
    coarse = np.empty((hkv, m2 // 2, n), np.uint8)
    for h in range(hkv):
        for j in range(0, m2, 2):  # rows' coarse codes of sub-vectors j and j + 1, two per byte
            coarse[h, j // 2] = join[h, j][packed[h, j]] | (join[h, j + 1][packed[h, j + 1]] << 4)
    books = means.view(hkv, m2, _WORDS, 2 * dsub).contiguous()
    return DeviceCodes(torch.from_numpy(coarse), books, codes.offsets, codes.searchable, codes.fix_ids, codes.fix_delta)


def _weighted_kmeans(x: torch.Tensor, w: torch.Tensor, k: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched weighted k-means: x (P, S, d) points with weights w (P, S) → means (P, k, d), each point's mean (P, S).
    Seeded with each batch's k heaviest points; a mean that loses all its weight keeps its place."""
    means = x.gather(1, w.topk(k, dim=1).indices[:, :, None].expand(-1, -1, x.shape[2]))
    xw, x2 = x * w[:, :, None], x.square().sum(-1, keepdim=True)
    for step in range(iters + 1):
        d2 = x2 - 2 * torch.bmm(x, means.transpose(1, 2)) + means.square().sum(-1)[:, None, :]  # (P, S, k)
        join = d2.argmin(-1)
        if step == iters:
            return means, join
        total = torch.zeros(x.shape[0], k, 1).scatter_add_(1, join[:, :, None], w[:, :, None])  # (P, k, 1)
        sums = torch.zeros_like(means).scatter_add_(1, join[:, :, None].expand_as(xw), xw)
        means = torch.where(total > 0, sums / total.clamp(min=1e-30), means)
    return means, join


def code_tables(codes: DeviceCodes, q32: torch.Tensor, scale: float) -> torch.Tensor:
    """(Hkv, G, m, 16) float32 s·q_j·B_j[b]: each query's score of every codeword, per sub-vector.

    Args:
        q32: (Hkv, G, D) float32 queries.
    """
    hkv, g, d = q32.shape
    m, dsub = codes.books.shape[1], codes.books.shape[3]
    q = q32.view(hkv, g, d // dsub, dsub)
    if d // dsub < m:  # the padding sub-vector (no part of q): its table is 0
        q = torch.cat([q, q.new_zeros(hkv, g, m - d // dsub, dsub)], 2)
    return torch.einsum("hgjd,hjbd->hgjb", q, codes.books).mul_(scale)


def cluster_lse(codes: DeviceCodes, q32: torch.Tensor, scale: float) -> torch.Tensor:
    """(Hkv, G, C) float32 log Σ exp(s·q·(r̂_k + δ_c)) over each cluster's searchable keys (−inf where none).

    Args:
        codes: the layer's `DeviceCodes` on q32's device; q32: (Hkv, G, D) float32 queries; scale: the softmax scale s.
    """
    hkv, g, _ = q32.shape
    base = torch.zeros(hkv, g, codes.offsets.shape[1] - 1, device=q32.device)
    return segment_lse(row_scores(codes, q32, scale, base), codes.offsets)


def row_scores(codes: DeviceCodes, q32: torch.Tensor, scale: float, base: torch.Tensor) -> torch.Tensor:
    """(Hkv, G, N) float32 every layout row's approximate score base_c + s·q·(r̂_k + δ_c), −inf where not searchable.

    Args:
        codes: the layer's `DeviceCodes`; q32: (Hkv, G, D) float32 queries; scale: s;
        base: (Hkv, G, C) float32 each cluster's term (routing's s·q·μ_c; 0 for the residuals alone).
    """
    hkv, g, _ = q32.shape
    a = codes.fix_ids.shape[1]
    shift = torch.bmm(q32, codes.fix_delta.transpose(1, 2)).mul_(scale)  # (Hkv, G, A)
    base = base.scatter_add(-1, codes.fix_ids[:, None, :].expand(hkv, g, a), shift)
    lut = code_tables(codes, q32, scale)
    return _rows_triton(codes, lut, base) if q32.is_cuda else _rows_torch(codes, lut, base)


def segment_lse(scores: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(Hkv, G, C) float32 log-sum-exp of each cluster's rows of `scores` (Hkv, G, N) (−inf where all are −inf).

    Args:
        offsets: (Hkv, C+1) int32 the clusters' first rows.
    """
    return _lse_triton(scores, offsets) if scores.is_cuda else _lse_torch(scores, offsets)


def _rows_torch(codes: DeviceCodes, lut: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """`row_scores` in torch ops (the reference; memory Hkv·G·N·m floats)."""
    hkv, g, m, _ = lut.shape
    n = codes.packed.shape[2]
    p = codes.packed.transpose(1, 2).long()  # (Hkv, N, m/2)
    idx = torch.stack([p & 0xF, p >> 4], -1).view(hkv, 1, n * m) + _WORDS * torch.arange(m).repeat(n)  # flat lut index
    score = lut.reshape(hkv, g, m * _WORDS).gather(-1, idx.expand(hkv, g, n * m)).view(hkv, g, n, m).sum(-1)
    score += base.gather(-1, row_labels(codes.offsets)[:, None, :].expand(hkv, g, n))
    bits = torch.from_numpy(np.unpackbits(codes.searchable.cpu().numpy(), axis=1, bitorder="little")[:, :n])
    return score.masked_fill_(~bits.to(score.device, torch.bool)[:, None, :], float("-inf"))


def _lse_torch(scores: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`segment_lse` in torch ops (the reference)."""
    hkv, g, n = scores.shape
    c = offsets.shape[1] - 1
    labels = row_labels(offsets)[:, None, :].expand(hkv, g, n)
    mx = torch.full((hkv, g, c), float("-inf"), device=scores.device).scatter_reduce_(-1, labels, scores, "amax")
    safe = torch.where(torch.isfinite(mx), mx, 0.0)
    total = torch.zeros_like(mx).scatter_add_(-1, labels, (scores - safe.gather(-1, labels)).exp())
    return torch.where(total > 0, safe + total.log(), float("-inf"))


def _pow2(g: int) -> int:
    """The kernels' query axis: g rounded up to a power of two."""
    return 1 << max(0, (g - 1).bit_length())


def _rows_triton(codes: DeviceCodes, lut: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """`row_scores` by a Triton kernel (one program per `ROWS_BLOCK` rows and KV head; each row finds its cluster by a
    binary search of the offsets: a program per cluster ran ~16 rows on 32 lanes)."""
    kernels = _kernels()
    hkv, g, m, _ = lut.shape
    gp = _pow2(g)
    if gp != g:  # the padding queries' tables and base are 0; their rows are dropped below
        lut = torch.cat([lut, lut.new_zeros(hkv, gp - g, m, _WORDS)], 1)
        base = torch.cat([base, base.new_zeros(hkv, gp - g, base.shape[2])], 1)
    n = codes.packed.shape[2]
    c = codes.offsets.shape[1] - 1
    out = torch.empty((hkv, gp, n), dtype=torch.float32, device=lut.device)
    kernels["rows"][(-(-n // ROWS_BLOCK), hkv)](
        codes.packed,
        lut.contiguous(),
        base.contiguous(),
        codes.offsets,
        codes.searchable,
        out,
        n,
        c,
        codes.searchable.shape[1],
        STEPS=max(1, c.bit_length()),
        M2=m // 2,
        GP=gp,
        BLOCK=ROWS_BLOCK,
    )
    return out[:, :g]


def _lse_triton(scores: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`segment_lse` by a Triton kernel (one program per cluster and KV head)."""
    kernels = _kernels()
    hkv, g, n = scores.shape
    c = offsets.shape[1] - 1
    gp = _pow2(g)
    out = torch.empty((hkv, gp, c), dtype=torch.float32, device=scores.device)
    if scores.stride(2) != 1:  # the kernel takes the head and query strides, rows one apart
        scores = scores.contiguous()
    kernels["lse"][(c, hkv)](scores, scores.stride(0), scores.stride(1), offsets, out, g, n, c, GP=gp, BLOCK=32)
    return out[:, :g]


@functools.cache
def _kernels() -> dict:
    """The Triton kernels, compiled at first use (Triton is imported here: it ships with CUDA builds of torch only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rows_kernel(
        packed,
        lut,
        base,
        offsets,
        bits,
        out,
        N,
        C,
        NB,
        STEPS: tl.constexpr,
        M2: tl.constexpr,
        GP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        h = tl.program_id(1)
        inside = rows < N
        # each row's cluster: the last c with offsets[c] <= row (a binary search over the head's C + 1 offsets)
        lo = tl.zeros([BLOCK], tl.int32)
        hi = tl.zeros([BLOCK], tl.int32) + C
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            go = tl.load(offsets + h * (C + 1) + mid) <= rows
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        g = tl.arange(0, GP)
        g_lut = (h * GP + g) * (2 * M2 * 16)  # (GP,) each query's tables
        acc = tl.load(base + (h * GP + g[None, :]) * C + lo[:, None])  # (BLOCK, GP) each row's cluster term
        byte = tl.load(bits + h * NB + rows // 8, mask=inside, other=0).to(tl.int32)
        ok = inside & (((byte >> (rows % 8)) & 1) != 0)
        for j in tl.static_range(M2):
            b = tl.load(packed + (h * M2 + j) * N + rows, mask=inside, other=0).to(tl.int32)
            acc += tl.load(lut + g_lut[None, :] + (2 * j * 16) + (b & 15)[:, None])
            acc += tl.load(lut + g_lut[None, :] + ((2 * j + 1) * 16) + (b >> 4)[:, None])
        acc = tl.where(ok[:, None], acc, float("-inf"))
        tl.store(out + (h * GP + g[None, :]) * N + rows[:, None], acc, mask=inside[:, None])

    @triton.jit
    def lse_kernel(scores, s_h, s_g, offsets, out, G, N, C, GP: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(offsets + h * (C + 1) + c)
        end = tl.load(offsets + h * (C + 1) + c + 1)
        g = tl.arange(0, GP)
        run_max = tl.full([GP], float("-inf"), tl.float32)
        run_sum = tl.zeros([GP], tl.float32)
        for r0 in range(start, end, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            ok = (rows < end)[:, None] & (g < G)[None, :]
            x = tl.load(scores + h * s_h + g[None, :] * s_g + rows[:, None], mask=ok, other=float("-inf"))
            new_max = tl.maximum(run_max, tl.max(x, 0))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(x - safe[None, :]), 0)
            run_max = new_max
        res = tl.where(run_sum > 0, run_max + tl.log(run_sum), float("-inf"))
        tl.store(out + (h * GP + g) * C + c, res)

    @triton.jit
    def hist_kernel(packed, w, hist, N, G, w_h, w_g, CHUNK, M2: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        h = tl.program_id(1)
        start = c * CHUNK
        g = tl.arange(0, GP)
        bins = tl.arange(0, 16)
        for j in tl.static_range(M2):
            lo = tl.zeros([GP, 16], tl.float32)
            hi = tl.zeros([GP, 16], tl.float32)
            for r0 in range(start, start + CHUNK, BLOCK):
                rows = r0 + tl.arange(0, BLOCK)
                ok = rows < N
                b = tl.load(packed + (h * M2 + j) * N + rows, mask=ok, other=0).to(tl.int32)
                wt = tl.load(
                    w + h * w_h + g[:, None] * w_g + rows[None, :], mask=ok[None, :] & (g[:, None] < G), other=0.0
                )
                lo += tl.sum(wt[:, :, None] * ((b & 15)[:, None] == bins[None, :]).to(tl.float32)[None, :, :], 1)
                hi += tl.sum(wt[:, :, None] * ((b >> 4)[:, None] == bins[None, :]).to(tl.float32)[None, :, :], 1)
            at = hist + ((h * GP + g[:, None]) * (2 * M2) + 2 * j) * 16 + bins[None, :]
            tl.atomic_add(at, lo)
            tl.atomic_add(at + 16, hi)

    log.info("routed: the per-key scores of the device's estimate and ranking run as Triton kernels")
    return {"rows": rows_kernel, "lse": lse_kernel, "hist": hist_kernel}
