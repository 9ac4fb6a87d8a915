"""The context part of attention, computed on the CPU where the context KV lives.

For every query head, the strategy's selection gives the retrieved context tokens' ids and their exact
raw scores a_i = q·k_i. This module turns them into the part's normalised output and log-sum-exp

    lse_c = log Σ_i exp(s·a_i),      out_c = Σ_i exp(s·a_i − lse_c) · v_i

so that only (H, D+1) floats per layer cross to the GPU, where `merge.lse_merge` combines them with
the window part exactly (one softmax over the union, merge.py). The weighted sum reads each selected
value row once (`F.embedding_bag`, a fused gather + weighted sum, parallel over query heads) instead of
gathering the rows into a staging buffer and sending k·D values per head over PCIe.

Precision: the sum runs in the values' dtype with fp32 accumulation. For fp32 caches that is exact
fp32; for bf16/fp16 caches the weights are rounded to that dtype, as a GPU flash kernel rounds P
before P·V, and the part's output is rounded once to that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from topk_decode.index import Selection


class ContextAttention:
    """Per-layer CPU attention over the selected context tokens.

    Args:
        values: per layer (Hkv, N, D) CPU value tensors (memory-mapped or in RAM).
        scale: softmax scale (1/sqrt(D)).
    """

    # The softmax ops before the weighted sum touch 32K floats each: on a many-core host the fork/join
    # of a parallel region costs more than the work, so they run on this many threads (None: all).
    small_op_threads: int | None = 1

    def __init__(self, values: list[torch.Tensor], scale: float) -> None:
        hkv, n, d = values[0].shape
        self.hkv, self.n, self.d = hkv, n, d
        self.scale = scale
        self.dtype = values[0].dtype
        # (Hkv·N, D) views: one flat row space per layer, row = kv_head·N + position
        self.values_flat = [v.reshape(hkv * n, d) for v in values]
        self._row_base = (torch.arange(hkv, dtype=torch.int64) * n).view(hkv, 1, 1)
        self._offsets: dict[tuple[int, int], torch.Tensor] = {}
        self._weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _bag_offsets(self, bags: int, K: int) -> torch.Tensor:
        key = (bags, K)
        off = self._offsets.get(key)
        if off is None:
            off = self._offsets[key] = torch.arange(0, bags * K, K, dtype=torch.int64)
        return off

    @staticmethod
    def write_empty(out: torch.Tensor) -> None:
        """The context part of queries that retrieved nothing: output 0, lse −inf (the window alone)."""
        out[:, :-1].zero_()
        out[:, -1].fill_(float("-inf"))

    def attend(self, layer: int, sel: Selection, out: torch.Tensor) -> int:
        """Write the context part of one layer's attention into `out`.

        Args:
            layer: the layer.
            sel: the strategy's selection, ids and scores (Hkv, Q, K) with Q = G·T head-major.
            out: (Hkv·Q, D+1) float32: columns :D get the part's normalised output, column D its
                log-sum-exp of the scaled scores (−inf, with output 0, for a query that retrieved nothing).
        Returns:
            the number of context tokens attended (empty slots not counted).
        """
        hkv, Q, K = sel.ids.shape
        if K == 0:
            self.write_empty(out)
            return 0
        # ~10 ops on 32K-element tensors per layer: each costs tens of µs on a many-core host, so
        # they are few, in place, and into reused buffers (the empty-slot handling only when needed)
        R = hkv * Q
        w, w_low, rows = self._buffers(R, K)                 # (R, K) fp32, values' dtype, (R·K,) int64
        threads = torch.get_num_threads()
        if self.small_op_threads:
            torch.set_num_threads(min(threads, self.small_op_threads))
        try:
            torch.mul(sel.scores.view(R, K), self.scale, out=w)                      # scaled logits
            ids = sel.ids.view(R, K)
            empty = not sel.full and bool(ids.min() < 0)
            if empty:
                w.masked_fill_(ids < 0, float("-inf"))
                ids = ids.clamp(min=0)
            m = w.amax(dim=-1, keepdim=True)                                         # (R, 1)
            if empty:   # a query with no valid slot: m = −inf; subtract 0 so its weights are exp(−inf) = 0
                m.masked_fill_(torch.isinf(m), 0.0)
            w.sub_(m).exp_()                                                         # unnormalised weights ≤ 1
            z = w.sum(dim=-1, keepdim=True)                                          # (R, 1)
            w_low.copy_(w)
            torch.add(ids.view(hkv, Q, K), self._row_base, out=rows.view(hkv, Q, K))   # rows of values_flat
        finally:
            torch.set_num_threads(threads)
        o = F.embedding_bag(rows, self.values_flat[layer], self._bag_offsets(R, K), mode="sum",
                            per_sample_weights=w_low.view(-1))                   # (R, D)
        torch.div(o, z.clamp(min=torch.finfo(torch.float32).tiny), out=out[:, :self.d])
        torch.log(z, out=out[:, self.d:]).add_(m)                                # lse (−inf where z = 0)
        return int((sel.ids >= 0).sum()) if empty else ids.numel()

    def _buffers(self, R: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R, K) weight buffers, fp32 and in the values' dtype (the same one for fp32), and (R·K,) row ids;
        reused across steps (fresh 128-256 KiB tensors per layer would be mapped and unmapped each time)."""
        bufs = self._weights.get((R, K))
        if bufs is None:
            if len(self._weights) >= 8:      # prompt lengths vary: keep the pool bounded
                self._weights.clear()
            w = torch.empty((R, K), dtype=torch.float32)
            w_low = w if self.dtype == torch.float32 else torch.empty_like(w, dtype=self.dtype)
            bufs = self._weights[(R, K)] = (w, w_low, torch.empty((R * K,), dtype=torch.int64))
        return bufs
