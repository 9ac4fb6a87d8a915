"""routed's exact part on the decode device: the GPU reads the rows it ranked straight from the host's RAM.

The device already ranks every key (`rank=keys`) or every cluster and knows the rows to read (index/routed/device.py
`route`).
Until now it sent them to the CPU, which scanned them exactly, took each query's top-k and summed their values: the
step's critical path, and slower on fewer cores. A pinned host page is addressable from the GPU (unified addressing),
and the GPU reads those rows faster than the CPU searches them (docs/BENCHMARKS.md "The GPU reading the host's rows",
"The device reads the rows itself"). So with `device_read` the device does it all inside the captured step, per layer:

1. the rows' cache positions, gathered from a device table per layer (−1 for rows outside the searchable range;
   index/routed/device.py `attend`); where clusters are ranked, the ranked clusters' rows, their positions looked up
   in the host's table by step 2's kernel itself (`read_rows`: 4 bytes beside each 128-byte key, and no device table
   of N positions per layer, which at 1M tokens would not fit beside a 7B model under 16 GiB);
2. `read_scores`: their keys read from the host's RAM and scored exactly against the queries (scaled as the host's);
3. the exact top-k of each query among them (torch.topk), their softmax weights;
4. `weighted_values`: the values of each query's top-k read from the host's RAM, summed with those weights.

The result is the context part the CPU wrote before (o, (m, z)), the same arithmetic in float32; the CPU is left
holding the memory. The host tensors must stay registered with CUDA (`HostKV`) while the step can run.

On CUDA steps 2 and 4 are Triton kernels that read the host's rows themselves (one program per block of rows and KV
head; one per query and slice of its top-k); elsewhere torch ops do the same (the CPU "device" of the tests).

    >>> import torch
    >>> keys = torch.eye(4).view(1, 4, 4)  # one KV head, four keys
    >>> read_scores(keys, torch.tensor([[2, -1, 0]], dtype=torch.int32), torch.ones(1, 1, 4))
    tensor([[[1., -inf, 1.]]])
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

log = logging.getLogger(__name__)
SCORE_BLOCK = 64  # rows per program of `read_scores`
VALUE_SLICES = 8  # programs per query of `weighted_values`


class HostKV:
    """One layer-list of host tensors the device reads: keys and values (Hkv, N, D) in position order, an int8 cache's
    value scales (Hkv, N) float32 or None, and the layout's positions (Hkv, N) int32 (each layout row's cache position,
    −1 outside the searchable range; `read_rows`) or None. On CUDA each is registered with the driver (page-locked and
    mapped) until `close`; they must be contiguous CPU tensors in RAM (not memory-mapped files).
    """

    def __init__(self, keys, values, value_scales, device: torch.device, positions=None) -> None:
        self.keys, self.values = list(keys), list(values)
        self.value_scales = list(value_scales) if value_scales is not None else [None] * len(self.keys)
        self.positions = list(positions) if positions is not None else [None] * len(self.keys)
        self._registered: list[int] = []
        # unregistered when this object goes, before the tensors it holds can be freed: a mapping freed while still
        # registered would make the next registration of that address range fail (or map stale pages)
        self._finalizer = weakref.finalize(self, _unregister, self._registered)
        if device.type == "cuda":
            cudart = torch.cuda.cudart()
            for t in self._held():
                if not t.is_contiguous():
                    raise ValueError("device_read needs contiguous host tensors")
                err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                if int(err) != 0:
                    self.close()
                    raise RuntimeError(f"cudaHostRegister failed ({int(err)})")
                self._registered.append(t.data_ptr())

    def _held(self) -> list[torch.Tensor]:
        """Every host tensor held."""
        return [t for t in (*self.keys, *self.values, *self.value_scales, *self.positions) if t is not None]

    def nbytes(self) -> int:
        """Host bytes the device reads from."""
        return sum(t.numel() * t.element_size() for t in self._held())

    def close(self) -> None:
        """Unregister the host tensors (idempotent; also done when the object is collected)."""
        _unregister(self._registered)


def _unregister(ptrs: list[int]) -> None:
    """cudaHostUnregister each pointer in `ptrs`, emptying the list."""
    if ptrs:
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)
        ptrs.clear()


def read_scores(keys: torch.Tensor, pos: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(Hkv, G, W) float32 q·k of the keys at positions `pos`, −inf where pos < 0.

    Args:
        keys: (Hkv, N, D) host keys (bf16, float32 or int8); pos: (Hkv, W) int32 positions on the device;
        q: (Hkv, G, D) float32 on the device, already scaled (softmax scale, an int8 cache's key scales).
    """
    if q.is_cuda:
        return _scores_triton(keys, pos, q)
    k = keys.gather(1, pos.clamp(min=0).long()[..., None].expand(-1, -1, keys.shape[2])).float()  # (Hkv, W, D)
    s = torch.bmm(q, k.transpose(1, 2))
    return s.masked_fill_((pos < 0)[:, None, :], float("-inf"))


def read_rows(
    keys: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`read_scores` of the keys at layout rows `rows`, each row's cache position looked up in the host's `table`:
    (Hkv, G, W) float32 scores (−inf where rows < 0 or the table holds −1) and (Hkv, W) int32 the positions read.

    Args:
        keys: (Hkv, N, D) host keys; table: (Hkv, N) int32 host positions of the layout's rows (`HostKV.positions`);
        rows: (Hkv, W) int32 layout rows on the device (−1: none); q: as `read_scores`.
    """
    if q.is_cuda:
        return _scores_triton(keys, rows, q, table)
    pos = torch.where(rows >= 0, table.gather(1, rows.clamp(min=0).long()), -1).to(torch.int32)
    return read_scores(keys, pos, q), pos


def weighted_values(
    values: torch.Tensor, scales: torch.Tensor | None, pos: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """(Hkv, G, D) float32 Σ_i w_i·v_i over each query's rows: the values at positions `pos` (rows with pos < 0 skipped),
    dequantised by an int8 cache's per-token scales.

    Args:
        values: (Hkv, N, D) host values; scales: (Hkv, N) float32 host value scales or None;
        pos: (Hkv, G, K) int32 positions on the device; w: (Hkv, G, K) float32 weights on the device.
    """
    if w.is_cuda:
        return _values_triton(values, scales, pos, w)
    hkv, g, k = pos.shape
    flat = pos.clamp(min=0).long().view(hkv, g * k)
    v = values.gather(1, flat[..., None].expand(-1, -1, values.shape[2])).float().view(hkv, g, k, -1)
    w = torch.where(pos >= 0, w, 0.0)
    if scales is not None:
        w = w * scales.gather(1, flat).view(hkv, g, k)
    return (w[..., None] * v).sum(2)


class _Pointer:
    """A host tensor's address as Triton takes a pointer argument (`data_ptr`, `dtype`): registered host memory is
    device-addressable at the address the driver maps it to (Triton's launcher asks the driver)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype, self._ptr = t.dtype, t.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr


def _pointer(t: torch.Tensor):
    return t if t.is_cuda else _Pointer(t)


def _scores_triton(keys: torch.Tensor, pos: torch.Tensor, q: torch.Tensor, table: torch.Tensor | None = None):
    """The scores (and, given the host's position `table`, `pos` being layout rows, the positions read)."""
    hkv, n, d = keys.shape
    g, w = q.shape[1], pos.shape[1]
    q, pos = q.contiguous(), pos.contiguous()  # the kernel indexes both as dense (no-ops where they are)
    out = torch.empty((hkv, g, w), dtype=torch.float32, device=q.device)
    read = pos if table is None else torch.empty_like(pos)  # (any pointer when there is no table: not written)
    grid = (-(-w // SCORE_BLOCK), hkv)
    _kernels()["scores"][grid](
        _pointer(keys),
        pos,
        q,
        out,
        n,
        w,
        read if table is None else _pointer(table),
        read,
        G=g,
        D=d,
        BLOCK=SCORE_BLOCK,
        LOOKUP=table is not None,
    )
    return out if table is None else (out, read)


def _values_triton(
    values: torch.Tensor, scales: torch.Tensor | None, pos: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    hkv, n, d = values.shape
    _, g, k = pos.shape
    pos, w = pos.contiguous(), w.contiguous()  # the kernel indexes both as dense (no-ops where they are)
    part = torch.empty((hkv * g, VALUE_SLICES, d), dtype=torch.float32, device=w.device)
    chunk = -(-k // VALUE_SLICES)
    sc = _pointer(scales) if scales is not None else w  # (any pointer when there are no scales: not read)
    _kernels()["values"][(hkv * g, VALUE_SLICES)](
        _pointer(values), sc, pos, w, part, n, k, chunk, G=g, D=d, SCALED=scales is not None, BLOCK=32
    )
    return part.sum(1).view(hkv, g, d)


@functools.cache
def _kernels() -> dict:
    """The Triton kernels, compiled at first use (Triton is imported here: it ships with CUDA builds of torch only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def scores_kernel(
        keys,
        pos,
        q,
        out,
        N,
        W,
        table,
        read,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        LOOKUP: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        i = b * BLOCK + tl.arange(0, BLOCK)
        inside = i < W
        p = tl.load(pos + h * W + i, mask=inside, other=-1)
        if LOOKUP:  # p is a layout row: its cache position from the host's table (−1 outside the searchable range)
            p = tl.load(table + h * N + tl.where(p >= 0, p, 0).to(tl.int64), mask=inside & (p >= 0), other=-1)
            tl.store(read + h * W + i, p, mask=inside)
        ok = p >= 0
        d = tl.arange(0, D)
        row = (h * N + tl.where(ok, p, 0)).to(tl.int64)
        k = tl.load(keys + row[:, None] * D + d[None, :], mask=ok[:, None], other=0).to(tl.float32)  # (BLOCK, D)
        for g in tl.static_range(G):
            qg = tl.load(q + (h * G + g) * D + d)
            s = tl.sum(k * qg[None, :], 1)
            tl.store(out + (h * G + g) * W + i, tl.where(ok, s, float("-inf")), mask=inside)

    @triton.jit
    def values_kernel(
        values,
        scales,
        pos,
        w,
        part,
        N,
        K,
        CHUNK,
        G: tl.constexpr,
        D: tl.constexpr,
        SCALED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        hg = tl.program_id(0)
        s = tl.program_id(1)
        h = hg // G
        d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        start = s * CHUNK
        for j0 in range(start, start + CHUNK, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            inside = (j < K) & (j < start + CHUNK)
            p = tl.load(pos + hg * K + j, mask=inside, other=-1)
            ok = p >= 0
            row = (h * N + tl.where(ok, p, 0)).to(tl.int64)
            wt = tl.load(w + hg * K + j, mask=ok, other=0.0)
            if SCALED:
                wt = wt * tl.load(scales + row, mask=ok, other=0.0)
            v = tl.load(values + row[:, None] * D + d[None, :], mask=ok[:, None], other=0).to(tl.float32)
            acc += tl.sum(v * wt[:, None], 0)
        tl.store(part + (hg * tl.num_programs(1) + s) * D + d, acc)

    log.info("routed: the device reads the host's rows itself (device_read): Triton kernels")
    return {"scores": scores_kernel, "values": values_kernel}
