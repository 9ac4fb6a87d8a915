"""routed's keyed estimate on the decode device: per cluster, the log-sum-exp of its keys' residual-code scores.

The default estimate weighs an unread cluster c as n_c·exp(s·q·μ_c), the Jensen lower bound of Σ_k exp(s·q·k); on
real models that bound lost most of routed's answers (docs/EVAL.md, the ablation). `estimate_by=keys` weighs every
unread key by its approximate score s·q·(μ_c + r̂_k) instead (index/routed/pq.py). After cluster routing the unread
keys are whole clusters, so per cluster the estimate needs only

    L_c(q) = log Σ_{k ∈ c, searchable} exp(s·q·r̂_k)        and then   logit_c = s·q·μ_c + L_c

in place of s·q·μ_c + log n_c (index/routed/device.py `estimate_part`). L_c does not depend on which clusters were
read, so it runs beside routing inside the captured step. `cluster_lse` computes it from the 4-bit codes packed two
per byte (16 bytes per key at m = 32): on CUDA a Triton kernel (one program per cluster and KV head, the 16-entry
tables looked up per sub-vector), elsewhere torch ops (the tests' reference and the CPU device).

A cluster holding sinks or tail rows (the window attends to them exactly) is routed by the mean of its searchable keys
only, while its codes are residuals to the mean of all its keys: `fix_delta` carries the difference for those few
clusters, so logit_c is the log of Σ exp(s·q·(μ_c + r̂_k)) over its searchable keys, as the torch path's
`_unread_keys_part` computes it.

    >>> import torch
    >>> from topk_decode.index.routed.pq import ResidualCodes
    >>> codes = ResidualCodes(torch.zeros(1, 4, 2, dtype=torch.uint8), torch.zeros(1, 2, 16, 2))
    >>> dc = device_codes(codes, torch.tensor([[0, 3, 4]]), torch.zeros(4, dtype=torch.bool), torch.zeros(1, 2, 4),
    ...                   torch.zeros(1, 2, 4))
    >>> cluster_lse(dc, torch.ones(1, 1, 4), scale=0.5)  # log 3 and log 1: every residual scores 0
    tensor([[[1.0986, 0.0000]]])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from topk_decode.index.routed.pq import NBITS, ResidualCodes

log = logging.getLogger(__name__)
_WORDS = 1 << NBITS  # entries per sub-vector table


@dataclass
class DeviceCodes:
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

    def to(self, device: torch.device) -> DeviceCodes:
        """The same codes on `device`."""
        return DeviceCodes(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor held, in field order."""
        return (self.packed, self.books, self.offsets, self.searchable, self.fix_ids, self.fix_delta)

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


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
    c8 = codes.codes  # (Hkv, N, m)
    hkv, n, m = c8.shape
    books = codes.codebooks
    if m % 2:  # a zero sub-vector makes whole bytes
        c8 = torch.cat([c8, torch.zeros(hkv, n, 1, dtype=torch.uint8)], 2)
        books = torch.cat([books, torch.zeros(hkv, 1, *books.shape[2:])], 1)
    packed = (c8[..., 0::2] | (c8[..., 1::2] << 4)).transpose(1, 2).contiguous()  # (Hkv, m/2, N)
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
    return DeviceCodes(packed, books.float().contiguous(), offsets.to(torch.int32), bits, fix_ids, fix_delta)


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
    lut = code_tables(codes, q32, scale)
    lse = _lse_triton(codes, lut) if q32.is_cuda else _lse_torch(codes, lut)
    hkv, g, _ = q32.shape
    a = codes.fix_ids.shape[1]
    shift = torch.bmm(q32, codes.fix_delta.transpose(1, 2)).mul_(scale)  # (Hkv, G, A)
    return lse.scatter_add_(-1, codes.fix_ids[:, None, :].expand(hkv, g, a), shift)


def _lse_torch(codes: DeviceCodes, lut: torch.Tensor) -> torch.Tensor:
    """`cluster_lse`'s per-cluster log-sum-exp in torch ops (the reference; memory Hkv·G·N·m floats)."""
    hkv, g, m, _ = lut.shape
    n = codes.packed.shape[2]
    c = codes.offsets.shape[1] - 1
    p = codes.packed.transpose(1, 2).long()  # (Hkv, N, m/2)
    idx = torch.stack([p & 0xF, p >> 4], -1).view(hkv, 1, n * m) + _WORDS * torch.arange(m).repeat(n)  # flat lut index
    score = lut.reshape(hkv, g, m * _WORDS).gather(-1, idx.expand(hkv, g, n * m)).view(hkv, g, n, m).sum(-1)
    bits = torch.from_numpy(np.unpackbits(codes.searchable.cpu().numpy(), axis=1, bitorder="little")[:, :n])
    score.masked_fill_(~bits.to(score.device, torch.bool)[:, None, :], float("-inf"))
    sizes = codes.offsets.diff(dim=1).long()  # (Hkv, C)
    labels = torch.stack([torch.repeat_interleave(torch.arange(c, device=lut.device), s) for s in sizes])
    labels = labels[:, None, :].expand(hkv, g, n)
    mx = torch.full((hkv, g, c), float("-inf"), device=lut.device).scatter_reduce_(-1, labels, score, "amax")
    safe = torch.where(torch.isfinite(mx), mx, 0.0)
    total = torch.zeros_like(mx).scatter_add_(-1, labels, (score - safe.gather(-1, labels)).exp())
    return torch.where(total > 0, safe + total.log(), float("-inf"))


_KERNEL = None


def _lse_triton(codes: DeviceCodes, lut: torch.Tensor) -> torch.Tensor:
    """`cluster_lse`'s per-cluster log-sum-exp by the Triton kernel (one program per cluster and KV head)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _compile_kernel()
    hkv, g, m, _ = lut.shape
    gp = 1 << max(0, (g - 1).bit_length())  # the kernel's query axis is a power of two
    if gp != g:
        lut = torch.cat([lut, lut.new_zeros(hkv, gp - g, m, _WORDS)], 1)
    n = codes.packed.shape[2]
    c = codes.offsets.shape[1] - 1
    out = torch.empty((hkv, gp, c), dtype=torch.float32, device=lut.device)
    _KERNEL[(c, hkv)](
        codes.packed,
        lut.contiguous(),
        codes.offsets,
        codes.searchable,
        out,
        n,
        c,
        codes.searchable.shape[1],
        M2=m // 2,
        GP=gp,
        BLOCK=32,
    )
    return out[:, :g]


def _compile_kernel():
    """The Triton kernel (imported here: Triton ships with CUDA builds of torch only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def lse_kernel(packed, lut, offsets, bits, out, N, C, NB, M2: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(offsets + h * (C + 1) + c)
        end = tl.load(offsets + h * (C + 1) + c + 1)
        g = tl.arange(0, GP)
        g_base = (h * GP + g) * (2 * M2 * 16)  # (GP,) each query's tables
        run_max = tl.full([GP], float("-inf"), tl.float32)
        run_sum = tl.zeros([GP], tl.float32)
        for r0 in range(start, end, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            ok = rows < end
            byte = tl.load(bits + h * NB + rows // 8, mask=ok, other=0).to(tl.int32)
            ok = ok & (((byte >> (rows % 8)) & 1) != 0)
            acc = tl.zeros([BLOCK, GP], tl.float32)
            for j in tl.static_range(M2):
                b = tl.load(packed + (h * M2 + j) * N + rows, mask=ok, other=0).to(tl.int32)
                acc += tl.load(lut + g_base[None, :] + (2 * j * 16) + (b & 15)[:, None])
                acc += tl.load(lut + g_base[None, :] + ((2 * j + 1) * 16) + (b >> 4)[:, None])
            acc = tl.where(ok[:, None], acc, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(acc, 0))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(acc - safe[None, :]), 0)
            run_max = new_max
        res = tl.where(run_sum > 0, run_max + tl.log(run_sum), float("-inf"))
        tl.store(out + (h * GP + g) * C + c, res)

    log.info("routed: the keyed estimate's cluster scores run as a Triton kernel")
    return lse_kernel
