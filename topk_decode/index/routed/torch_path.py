"""routed's torch path: routing, the scan and the estimate as tensor ops (`kernel=torch`, or where numba is missing).

`TorchPath` holds the methods; `RoutedStrategy` (index/routed/strategy.py) mixes it in and sets what they read in its
`prepare`: the layouts, the routing bias and spread, the clusters' sizes and first rows, the padding rows and
`_outside`, `_stats` (their fp32 copies through `fp32_centroids`, `fp32_value_means`), and for `rank=keys` (`_select_keys`, where the
device does not rank: a question's tokens, a CPU decode device) each row's cluster `_labels` and approximate
scores (`approx_scores`, decoded from the codes block by block). The compiled path
(kernels/routed_scan.py) gives the same selection and estimate as the cluster ranking here
(tests/test_routed_kernel.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from topk_decode.index.base import RestPart, Selection
from topk_decode.index.routed.estimate import combine, error_shift, keyed_rest_part, read_rest_part, unread_part
from topk_decode.index.routed.pq import top_rows


class Route(NamedTuple):
    """What routing chose for one layer and step (`RoutedStrategy.route`).

    rows: (Hkv, Mmax) int64 rows of the layout's flat (Hkv·N, D) keys to read, padded to the longest head.
    valid: (Hkv, Mmax) bool, False on padding; None when every padding row is a sink/tail row (masked with them).
    base: (Hkv, Q, C) float32 s·q·μ_c of every cluster (μ_c over its searchable keys).
    clusters: (Hkv, W) int64 the clusters considered, by priority; taken: (Hkv, W) bool, those read.
    run: (Hkv, Mmax) int64 the index into `clusters` of every row read.
    """

    rows: torch.Tensor
    valid: torch.Tensor | None
    base: torch.Tensor
    clusters: torch.Tensor
    taken: torch.Tensor
    run: torch.Tensor


class TorchPath:
    """The torch path's methods of `RoutedStrategy` (see the module docstring for the state they read)."""

    def route(self, layer: int, q: torch.Tensor, budget: int) -> Route:
        """Rows of the layout's flat (Hkv·N, D) keys to read, per head, padded to the longest head's list.

        Args:
            layer: layer index; q: (Hkv, Q, D) float32 queries; budget: keys to read per head (at least).
        Returns:
            the rows, their padding mask and which clusters they belong to (`Route`).
        """
        sizes_all = self._sizes[layer]
        hkv, C = sizes_all.shape
        base = torch.bmm(q, self.fp32_centroids(layer)).mul_(self.scale)  # (Hkv, Q, C) s·q·μ_c
        logit = base + self._bias[layer]
        if self.use_spread:
            logit.addcmul_(q.square().sum(-1, keepdim=True), self._spread[layer])
        share = (logit - torch.logsumexp(logit, dim=-1, keepdim=True)).amax(1)  # (Hkv, C) union over queries
        # Only the first clusters by share are needed: a top-k of twice the expected count, and the
        # full sort only when some head's largest clusters did not reach the budget (rare).
        guess = min(C, 2 * -(-budget * C // self.ckv.n_tokens) + 16)
        order = share.topk(guess, dim=-1, sorted=True).indices  # (Hkv, guess) by share
        sizes = sizes_all.gather(1, order)
        cums = sizes.cumsum(1)
        if guess < C and bool((cums[:, -1] < budget).any()):
            order = share.argsort(dim=-1, descending=True)  # (Hkv, C)
            sizes = sizes_all.gather(1, order)
            cums = sizes.cumsum(1)
        n_take = (cums < budget).sum(1, keepdim=True)  # (Hkv, 1) clusters per head − 1
        width = min(int(n_take.max()) + 1, order.shape[1])
        lens = sizes[:, :width].masked_fill(torch.arange(width) > n_take, 0)  # (Hkv, W) 0 past the budget
        starts = self._starts[layer].gather(1, order[:, :width])  # (Hkv, W) flat rows
        per_head = lens.sum(1)  # (Hkv,)
        m_max = int(per_head.max())
        # Row r of head h's padded list: run i where cum[i-1] ≤ r < cum[i], row starts[i] + r − cum[i-1].
        # Padding (r ≥ per_head[h]) reads a sink/tail row of head h (masked with them), else its first row.
        cum = lens.cumsum(1)  # (Hkv, W)
        r = torch.arange(m_max).repeat(hkv, 1)  # (Hkv, Mmax), contiguous for searchsorted
        run = torch.searchsorted(cum, r, right=True).clamp_(max=width - 1)  # (Hkv, Mmax)
        run_start = (cum - lens).gather(1, run)
        rows = starts.gather(1, run) + (r - run_start)
        valid = r < per_head[:, None]
        pad = self._pad_rows[layer]
        rows = torch.where(valid, rows, self._row_base if pad is None else pad)
        total = int(per_head.sum())
        self.stats.extra["keys_read"] += total
        self.stats.extra["keys_searchable"] += hkv * self.n_searchable
        return Route(rows, valid if pad is None else None, base, order[:, :width], lens > 0, run)

    def _select_torch(self, layer: int, q: torch.Tensor, k: int, budget: int) -> Selection:
        """The torch path's selection: `route`, a gather of the rows read, one exact fp32 bmm, a top-k, and the
        estimate of what it leaves out (`_rest`)."""
        lay = self.layouts[layer]
        hkv, Q, D = q.shape
        route = self.route(layer, q, budget)
        rows, valid = route.rows, route.valid  # (Hkv, Mmax)
        m_max = rows.shape[1]
        stored, at = self.key_rows(layer, rows.view(-1))
        k_low, k32, scores = self._buffers(hkv * m_max, Q, D, stored.dtype)
        torch.index_select(stored, 0, at, out=k_low)  # (Hkv·Mmax, D) contiguous runs
        pos = lay.pos.reshape(-1).index_select(0, rows.view(-1)).view(hkv, m_max)
        bad = self._outside[layer].index_select(0, rows.view(-1)).view(hkv, m_max)  # sinks, tail (and padding)
        if valid is not None:
            bad |= ~valid
        if k32 is not k_low:
            k32.copy_(k_low)  # exact upcast, into a reused buffer
        torch.bmm(q, k32.view(hkv, m_max, D).transpose(1, 2), out=scores)  # (Hkv, Q, Mmax) exact fp32
        if bool(bad.any()):
            scores.masked_fill_(bad[:, None, :], float("-inf"))
        top = scores.topk(min(k, m_max), dim=-1, sorted=False)
        scores_read = scores
        ids = pos[:, None, :].expand(hkv, Q, m_max).gather(-1, top.indices)  # (Hkv, Q, K) original positions
        scores, empty = top.values, torch.isinf(top.values)
        no_empty_slots = not bool(empty.any())
        rest = self._rest(layer, q, route, scores_read, top.indices) if self.estimate or self.estimate_read else None
        if not no_empty_slots:  # fewer than k valid keys were read for some query: empty slots
            ids, scores = ids.masked_fill(empty, -1), scores.masked_fill(empty, 0.0)
        return Selection(ids=ids, scores=scores, no_empty_slots=no_empty_slots, rest=rest)

    def _select_keys(self, layer: int, q: torch.Tensor, k: int, budget: int) -> Selection:
        """`rank=keys`: every searchable key scored by centroid + residual code (index/routed/pq.py), the `budget`
        best by the union over the head's queries read exactly, each query's exact top-k among them; the
        estimate weighs every unread key by its approximate score, with its cluster's mean value."""
        lay = self.layouts[layer]
        hkv, Q, D = q.shape
        n = lay.pos.shape[1]
        labels = self._labels[layer]  # (Hkv, N)
        approx = self.approx_scores(layer, q)  # (Hkv, Q, N) s·q·k̂
        outside = self._outside[layer].view(hkv, n)
        approx.masked_fill_(outside[:, None, :], float("-inf"))
        share = (approx - torch.logsumexp(approx, -1, keepdim=True)).amax(1)  # (Hkv, N) union over queries
        pad = self._pad_rows[layer] - self._row_base if self.key_block > 1 else None
        local = top_rows(share, budget, self.key_block, pad)  # (Hkv, B) rows of each head read
        width = local.shape[1]
        rows = (local + self._row_base).view(-1)
        stored, at = self.key_rows(layer, rows)
        keys = stored.index_select(0, at).float().view(hkv, width, D)
        scores = torch.bmm(q, keys.transpose(1, 2))  # (Hkv, Q, B) exact
        if self.key_block > 1:  # a block holds sinks or tail rows too (and the padding): never selected
            scores.masked_fill_(outside.gather(1, local)[:, None, :], float("-inf"))
        top = scores.topk(min(k, width), dim=-1, sorted=False)
        pos = lay.pos.gather(1, local)  # (Hkv, B)
        ids = pos[:, None, :].expand(hkv, Q, width).gather(-1, top.indices)
        self.stats.extra["keys_read"] += hkv * width
        self.stats.extra["keys_searchable"] += hkv * self.n_searchable
        rest = None
        if self.estimate or self.estimate_read:
            # unread keys: their approximate weights (estimate); read keys outside the top-k: exact (estimate_read)
            logit = approx if self.estimate else torch.full_like(approx, float("-inf"))
            if self.estimate and self.options.code_error:  # what the codes' error leaves out of every unread key
                logit.add_(error_shift(self.code_error(layer), q, self.scale)[:, :, None])
            read = scores.mul(self.scale) if self.estimate_read else torch.full_like(scores, float("-inf"))
            read.scatter_(-1, top.indices, float("-inf"))  # the top-k is accounted exactly
            logit.scatter_(-1, local[:, None, :].expand(hkv, Q, width), read)
            rest = keyed_rest_part(logit, labels, *self.rest_values(layer))
        return Selection(ids=ids, scores=top.values, no_empty_slots=True, rest=rest)

    def _rest(
        self, layer: int, q: torch.Tensor, route: Route, scores_read: torch.Tensor, top: torch.Tensor
    ) -> RestPart:
        """The estimate of what the selection leaves out (index/routed/estimate.py): unread clusters and/or read
        keys outside the top-k, as one part for the context part's merge.

        Args:
            layer: the layer; q: (Hkv, Q, D) its queries; route: this step's routing; scores_read: (Hkv, Q, Mmax)
            exact q·k of the rows
            read (−inf outside the range); top: (Hkv, Q, K) the columns each query kept.
        """
        st = self._stats[layer]
        parts = []
        if self.estimate and self.estimate_keys:
            parts.append(self._unread_keys_part(layer, q, route))
        elif self.estimate:
            read = torch.zeros(route.base.shape[0], route.base.shape[2], dtype=torch.bool)
            read.scatter_(1, route.clusters, route.taken)  # (Hkv, C) clusters read
            parts.append(unread_part(route.base + st.log_n, read, self.fp32_value_means(layer)))
        if self.estimate_read:
            parts.append(
                read_rest_part(scores_read * self.scale, top, route.run, route.clusters, self.fp32_value_means(layer))
            )
        return parts[0] if len(parts) == 1 else combine(parts[0], parts[1])

    def _unread_keys_part(self, layer: int, q: torch.Tensor, route: Route) -> RestPart:
        """`estimate_by=keys` after cluster routing: every searchable key of the clusters not read, weighed by its
        approximate score, with its cluster's mean value."""
        hkv = q.shape[0]
        n = self.layouts[layer].pos.shape[1]
        logit = self.approx_scores(layer, q)  # (Hkv, Q, N)
        if self.options.code_error:
            logit.add_(error_shift(self.code_error(layer), q, self.scale)[:, :, None])
        left_out = ~self._outside[layer].view(hkv, n)
        rows = route.rows - self._row_base  # (Hkv, Mmax) rows of each head read (padding: an outside or a read row)
        valid = torch.ones_like(rows) if route.valid is None else route.valid.long()
        read = torch.zeros(hkv, n, dtype=torch.long).scatter_add_(1, rows, valid) > 0
        logit.masked_fill_(~(left_out & ~read)[:, None, :], float("-inf"))
        return keyed_rest_part(logit, self._labels[layer], *self.rest_values(layer))

    def _buffers(self, rows: int, Q: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Gather, fp32 and score buffers reused across layers and steps (fresh 10-50 MiB tensors per layer
        would be page-faulted in every time); grown when a step reads more rows than any before."""
        cap = getattr(self, "_cap", None)
        if cap is None or cap[0] < rows or cap[1] != (Q, D, dtype):
            n = int(rows * 1.25)
            low = torch.empty((n, D), dtype=dtype)
            self._buf = (low, low if dtype == torch.float32 else torch.empty((n, D)), torch.empty(n * Q))
            self._cap = (n, (Q, D, dtype))
        low, k32, sc = self._buf
        return low[:rows], k32[:rows], sc[: rows * Q].view(self.ckv.n_kv_heads, Q, rows // self.ckv.n_kv_heads)
