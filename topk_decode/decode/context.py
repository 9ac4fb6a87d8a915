"""The context part of attention, computed on the CPU where the context KV lives.

For every query head, the strategy's selection gives the retrieved context tokens' ids and their exact
raw scores a_i = q·k_i. This module turns them into the part's sums, with m = max_i s·a_i,

    o = Σ_i exp(s·a_i − m) · v_i,     z = Σ_i exp(s·a_i − m)

so that only o (H, D) in the values' dtype and (m, z) (H, 2) in fp32 cross to the GPU per layer.
There `merge.context_part` finishes the part (out_c = o / z, lse_c = m + log z) inside the fused
merge with the window part (one softmax over the union, merge.py): right after a search every CPU op
runs cold, several times its warm cost (docs/BENCHMARKS.md, "Where the context part's time goes"), so
the CPU does only the ops that need the whole selection. The weighted sum reads each selected value row
once (`F.embedding_bag`, a fused gather + weighted sum, parallel over query heads) instead of gathering
the rows into a staging buffer and sending k·D values per head over PCIe.

Precision: the sum runs in the values' dtype with fp32 accumulation. For fp32 caches that is exact
fp32; for bf16/fp16 caches the weights are rounded to that dtype, as a GPU flash kernel rounds P
before P·V, and the part's output is rounded once to that dtype.
"""

from __future__ import annotations

import torch

from topk_decode.index import Selection
from topk_decode.index.base import RestPart
from topk_decode.index.threads import omp_threads


class ContextAttention:
    """Per-layer CPU attention over the selected context tokens.

    Args:
        values: per layer (Hkv, N, D) CPU value tensors (memory-mapped or in RAM).
        scale: softmax scale (1/sqrt(D)).
        value_scales: an int8 cache's per layer (Hkv, N) float32 value scales (store/quant.py), folded into the
            weights; the part's output is then float32. None for float caches.
    """

    # The softmax ops before the weighted sum touch 32K floats each: on a many-core host the fork/join
    # of a parallel region costs more than the work, so they run on this many threads (None: all).
    # Set per call on the calling thread only (index/threads.py), never process-wide.
    small_op_threads: int | None = 1

    def __init__(
        self, values: list[torch.Tensor], scale: float, value_scales: list[torch.Tensor] | None = None
    ) -> None:
        hkv, n, d = values[0].shape
        self.hkv, self.n, self.d = hkv, n, d
        self.scale = scale
        self.dtype = values[0].dtype if value_scales is None else torch.float32
        # (Hkv·N, D) views: one flat row space per layer, row = kv_head·N + position
        self.values_flat = [v.reshape(hkv * n, d) for v in values]
        self.scales_flat = None if value_scales is None else [s.reshape(hkv * n) for s in value_scales]
        self._row_base = (torch.arange(hkv, dtype=torch.int64) * n).view(hkv, 1, 1)
        self._offsets: dict[tuple[int, int], torch.Tensor] = {}
        self._weights: dict[tuple[int, int], tuple] = {}

    def _bag_offsets(self, bags: int, K: int) -> torch.Tensor:
        key = (bags, K)
        off = self._offsets.get(key)
        if off is None:
            off = self._offsets[key] = torch.arange(0, bags * K, K, dtype=torch.int64)
        return off

    @staticmethod
    def write_empty(o: torch.Tensor, mz: torch.Tensor) -> None:
        """The context part of queries that retrieved nothing: o = 0, m = 0, z = 0 (lse −inf: the window alone)."""
        o.zero_()
        mz.zero_()

    def attend(self, layer: int, sel: Selection, o: torch.Tensor, mz: torch.Tensor) -> int:
        """Write the context part of one layer's attention into `o` and `mz`.

        Args:
            layer: the layer.
            sel: the strategy's selection, ids and scores (Hkv, Q, K) with Q = G·T head-major.
            o: (Hkv·Q, D) contiguous, in the values' dtype: receives o (the module's docstring).
            mz: (Hkv·Q, 2) float32: receives m and z (all three 0 for a query that retrieved nothing).
        Returns:
            the number of context tokens attended (empty slots not counted).
        """
        hkv, Q, K = sel.ids.shape
        if K == 0:
            self.write_empty(o, mz)
            if sel.rest is not None:
                merge_rest(o, mz, sel.rest)
            return 0
        # ~8 ops on 32K-element tensors per layer, right after the search, each with the caches cold
        # (docs/BENCHMARKS.md, "Where the context part's time goes"): so they are few, in place, into
        # reused buffers, and the empty-slot handling only when needed. (numpy's ufuncs on the same
        # memory measured slower, docs/BENCHMARKS.md.)
        R = hkv * Q
        w, w_low, rows, aux = self._buffers(R, K)  # (R, K) fp32, values' dtype, (R·K,) int64
        with omp_threads(self.small_op_threads):
            torch.mul(sel.scores.view(R, K), self.scale, out=w)  # scaled logits
            ids = sel.ids.view(R, K)
            empty = not sel.no_empty_slots and bool(ids.min() < 0)
            if empty:
                w.masked_fill_(ids < 0, float("-inf"))
                ids = ids.clamp(min=0)
            m = torch.amax(w, dim=-1, keepdim=True, out=mz[:, :1])  # (R, 1)
            if empty:  # a query with no valid slot: m = −inf; subtract 0 so its weights are exp(−inf) = 0
                m.masked_fill_(torch.isinf(m), 0.0)
            w.sub_(m).exp_()  # unnormalised weights ≤ 1
            torch.sum(w, dim=-1, keepdim=True, out=mz[:, 1:])  # z, (R, 1)
            if w_low is not w:
                w_low.copy_(w)
            torch.add(ids.view(hkv, Q, K), self._row_base, out=rows.view(hkv, Q, K))  # rows of values_flat
        if self.scales_flat is not None:  # int8 values: each weight times its row's scale, the rows widened
            sw = w.view(-1) * self.scales_flat[layer].index_select(0, rows)
            v = self.values_flat[layer].index_select(0, rows).view(R, K, self.d).float()
            torch.bmm(sw.view(R, 1, K), v, out=o.view(R, 1, self.d))
        else:  # F.embedding_bag straight into `o` (mode 0 = sum; its .out form saves a copy)
            torch.ops.aten._embedding_bag_forward_only.out(
                self.values_flat[layer],
                rows,
                self._bag_offsets(R, K),
                False,
                0,
                False,
                w_low.view(-1),
                False,
                -1,
                out0=o,
                out1=aux[0],
                out2=aux[1],
                out3=aux[2],
            )
        if sel.rest is not None:
            merge_rest(o, mz, sel.rest)
        return int((sel.ids >= 0).sum()) if empty else ids.numel()

    def _buffers(self, R: int, K: int) -> tuple:
        """Buffers reused across steps for R bags of K rows (fresh 128-256 KiB tensors per layer would be
        mapped and unmapped each time): (R, K) weights in fp32 and in the values' dtype (the same tensor
        for fp32), (R·K,) row ids, and embedding_bag's other outputs (bag bookkeeping we do not use)."""
        bufs = self._weights.get((R, K))
        if bufs is None:
            if len(self._weights) >= 8:  # prompt lengths vary: keep the pool bounded
                self._weights.clear()
            w = torch.empty((R, K), dtype=torch.float32)
            w_low = w if self.dtype == torch.float32 else torch.empty_like(w, dtype=self.dtype)
            aux = [torch.empty((0,), dtype=torch.int64) for _ in range(3)]
            bufs = self._weights[(R, K)] = (w, w_low, torch.empty((R * K,), dtype=torch.int64), aux)
        return bufs


def merge_rest(o: torch.Tensor, mz: torch.Tensor, rest: RestPart) -> None:
    """Add an estimated rest part (index/base.py `RestPart`) to a written context part, in place.

    The rest is a third disjoint part of the same softmax, so it joins by log-sum-exp exactly as the
    window does on the GPU (docs/DESIGN.md "The merge"): with m' = max(m, lse_r),
    o ← o·e^(m−m') + out_r·e^(lse_r−m'), z ← z·e^(m−m') + e^(lse_r−m'), m ← m'. Nothing on the GPU changes.

    Args:
        o: (R, D) the part's unnormalised output, values' dtype (R = Hkv·Q, head-major).
        mz: (R, 2) float32 m and z (m = 0, z = 0 for a query that retrieved nothing).
        rest: out (Hkv, Q, D) and lse (Hkv, Q), float32.
    """
    R, D = o.shape
    lse = rest.lse.reshape(R, 1)  # (R, 1)
    m, z = mz[:, :1], mz[:, 1:]
    m_new = torch.maximum(m, lse)  # lse −inf: m stays
    a = (m - m_new).exp_()  # (R, 1) rescales the selected part
    b = (lse - m_new).exp_()  # (R, 1) 0 where nothing is left out
    merged = o.float().mul_(a).add_(rest.out.reshape(R, D) * b)  # (R, D) fp32
    o.copy_(merged)
    z.mul_(a).add_(b)
    m.copy_(m_new)
