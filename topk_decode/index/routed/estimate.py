"""RetroInfer-style estimate of the attention a routed selection leaves out (routed's `estimate` options).

routed reads a few clusters and keeps each query's exact top-k among them. The searchable tokens it
leaves out still hold attention mass; their part of the softmax is estimated from per-cluster statistics
(docs/STRATEGIES.md "routed: the estimate of the rest"):

- an **unread** cluster c (n_c searchable keys, mean key μ_c, mean value v̄_c) contributes
  Σ_j exp(s·q·k_j) ≈ n_c·exp(s·q·μ_c) and Σ_j exp(s·q·k_j)·v_j ≈ n_c·exp(s·q·μ_c)·v̄_c
  (exact when its keys are equal; below the truth by Jensen otherwise);
- a **read** key outside the top-k has an exact score (it was scanned) but its value is not read:
  it contributes exp(s·q·k_j)·v̄_c with its cluster's mean value.

Both form one `RestPart` (index/base.py), merged into the context part by log-sum-exp (decode/context.py).
The statistics are over the *searchable* keys only: sinks and the context tail sit in clusters too, but
the exact window attends to them, and counting them twice would break the merge's disjointness.

With residual codes (`rank=keys`, `estimate_by=keys`) an unread key weighs exp(s·q·k̂), k̂ = μ_c + r̂ its approximate
key. k-means codes leave the error e = k − k̂ uncorrelated with k̂ (each codeword is the mean of its residuals), so
Σ exp(s·q·k) ≈ Σ exp(s·q·k̂)·E[exp(s·q·e)]: without the factor the estimate weighs the unread keys too little, the
more the coarser the codes. `error_shift` is its log for e Gaussian per KV head (`CodeError`, measured on a sample
of rows by `code_error`), one number per query added to every unread key's logit: routed's `code_error` option, off
by default (it centres the unread mass but kept no more of dense's answers: docs/history/eval-2026-11.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topk_decode.index.base import RestPart
from topk_decode.index.routed.cluster import LayerLayout
from topk_decode.index.routed.device_codes import Tensors
from topk_decode.index.routed.pq import ResidualCodes, code_blocks, decode


@dataclass
class SearchableStats:
    """One layer's per-cluster statistics over the searchable keys [lo, hi) only.

    centroids: (Hkv, C, D) float32 mean searchable key per cluster (0 where none); routed keeps them
        in bf16 for bf16 caches (`stored_as`).
    value_means: (Hkv, C, D) float32 mean searchable value per cluster (0 where none), or None when the
        layout has no value means; in bf16 as the centroids.
    log_n: (Hkv, 1, C) float32 log of the searchable keys per cluster (−inf where none).
    """

    centroids: torch.Tensor
    value_means: torch.Tensor | None
    log_n: torch.Tensor

    def stored_as(self, dtype: torch.dtype) -> SearchableStats:
        """The same statistics with the centroids and mean values stored in `dtype` (log_n stays fp32)."""
        return SearchableStats(
            centroids=self.centroids.to(dtype),
            value_means=None if self.value_means is None else self.value_means.to(dtype),
            log_n=self.log_n,
        )


ERROR_ROWS = 4096  # rows per KV head whose code error `code_error` measures (strided over its searchable rows)


@dataclass
class CodeError(Tensors):
    """One layer's residual-code error e = k − k̂ as a Gaussian per KV head: mean (Hkv, D) and cov (Hkv, D, D)
    float32 (`code_error`)."""

    mean: torch.Tensor
    cov: torch.Tensor


def error_rows(searchable: torch.Tensor) -> torch.Tensor:
    """(Hkv, S) int64 the layout rows `code_error` measures per KV head: at most `ERROR_ROWS` of its searchable rows
    (searchable: (Hkv, N) bool), strided over them. Sinks and tail rows are left out: the estimate never weighs
    them, and a model's first tokens have keys far from the rest (layer 0's error would be theirs)."""
    count = int(searchable.sum(1).min())
    step = max(1, count // ERROR_ROWS)
    take = min(ERROR_ROWS, -(-count // step))
    return torch.stack([row.nonzero().squeeze(1)[::step][:take] for row in searchable])


def code_error(true: torch.Tensor, approx: torch.Tensor) -> CodeError:
    """The error's mean and covariance per KV head from the true and the coded keys (or residuals) of a sample of
    rows, both (Hkv, S, D) float32."""
    e = true - approx
    mean = e.mean(1)
    c = e - mean[:, None, :]
    return CodeError(mean, torch.bmm(c.transpose(1, 2), c).div_(max(1, e.shape[1])))


def error_shift(err: CodeError, q: torch.Tensor, scale: float) -> torch.Tensor:
    """(Hkv, Q) float32 log E[exp(s·q·e)] = s·q·μ_e + s²·qᵀΣ_e·q/2: what every unread key's approximate logit lacks
    (the module docstring), for q (Hkv, Q, D) float32 in the codes' space.

    >>> import torch
    >>> err = CodeError(torch.zeros(1, 2), torch.eye(2)[None] * 0.5)
    >>> error_shift(err, torch.tensor([[[2.0, 0.0]]]), 1.0)  # s²·qᵀΣq/2 = 4·0.5/2
    tensor([[1.]])
    """
    half = torch.bmm(q, err.cov.to(q.dtype)).mul_(0.5 * scale)  # (Hkv, Q, D) s·Σq/2
    return (q * half.add_(err.mean.to(q.dtype)[:, None, :])).sum(-1).mul_(scale)


def searchable_stats(
    lay: LayerLayout,
    outside: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    value_scales: torch.Tensor | None = None,
) -> SearchableStats:
    """Remove the sink and tail keys from a layer's cluster means (they are few: one gather per head).

    Args:
        lay: the layer's layout (without `value_means`, the stats have none either).
        outside: (Hkv·N,) bool, per layout row whether its position is outside [lo, hi).
        keys, values: (Hkv, N, D) the layer's keys and values in original order (the cache's memory maps); the keys
            are read where the layout holds none (`store_keys=false`).
        value_scales: an int8 cache's (Hkv, N) value scales (store/quant.py), or None. (Its keys' means are in the
            int8 keys' space, as the layout's centroids are: index/routed/layout.py.)
    """
    hkv, C, d = lay.centroids.shape
    n = lay.pos.shape[1]
    sizes = lay.sizes.float()  # (Hkv, C)
    key_sums = lay.centroids * sizes[..., None]  # (Hkv, C, D)
    value_sums = lay.value_means * sizes[..., None] if lay.value_means is not None else None
    out = outside.view(hkv, n)
    for h in range(hkv):
        rows = out[h].nonzero().squeeze(1)  # (r,) layout rows of head h
        if rows.numel() == 0:
            continue
        cluster = torch.searchsorted(lay.offsets[h], rows, right=True) - 1  # (r,)
        p = lay.pos[h, rows]
        k = lay.keys[h].index_select(0, rows) if lay.keys is not None else keys[h].index_select(0, p)
        key_sums[h].index_add_(0, cluster, k.float(), alpha=-1)
        if value_sums is not None:
            v = values[h].index_select(0, p).float()
            if value_scales is not None:
                v.mul_(value_scales[h].index_select(0, p)[:, None])
            value_sums[h].index_add_(0, cluster, v, alpha=-1)
        sizes[h].index_add_(0, cluster, torch.ones(rows.numel()), alpha=-1)
    denom = sizes.clamp(min=1)[..., None]
    return SearchableStats(
        centroids=key_sums / denom,
        value_means=None if value_sums is None else value_sums / denom,
        log_n=sizes.log().unsqueeze(1),
    )


def unread_part(logit: torch.Tensor, read: torch.Tensor, value_means: torch.Tensor, bmm=torch.bmm) -> RestPart:
    """The estimate over the clusters not read: lse = logsumexp_c(log n_c + s·q·μ_c), out = Σ_c p_c·v̄_c.

    Args:
        logit: (Hkv, Q, C) float32 log n_c + s·q·μ_c per query (−inf for clusters without searchable keys).
        read: (Hkv, C) bool, the clusters the head read (their keys are accounted exactly).
        value_means: (Hkv, C, D) float32 v̄_c.
        bmm: the batched product p·v̄ (index/routed/device.py passes one that reads stored low-precision means).
    """
    p, lse = softmax_weights(logit.masked_fill(read[:, None, :], float("-inf")))  # (Hkv, Q, C), (Hkv, Q)
    return RestPart(out=bmm(p, value_means), lse=lse)


def softmax_weights(logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(logit − lse) and lse = logsumexp(logit) over the last axis: weights 0 where logit is −inf, lse −inf (and
    every weight 0) where all of a query's are."""
    lse = torch.logsumexp(logit, dim=-1)
    return (logit - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]).exp_(), lse


def read_rest_part(
    scaled: torch.Tensor, top: torch.Tensor, run: torch.Tensor, run_clusters: torch.Tensor, value_means: torch.Tensor
) -> RestPart:
    """The read keys outside each query's top-k: exact weights, their cluster's mean value.

    Args:
        scaled: (Hkv, Q, M) float32 s·q·k of the rows read (−inf for sinks, tail and padding).
        top: (Hkv, Q, K) int64 the columns of `scaled` each query kept (accounted exactly).
        run: (Hkv, M) int64 the run (cluster read) of every row, an index into `run_clusters`.
        run_clusters: (Hkv, W) int64 the cluster of every run.
        value_means: (Hkv, C, D) float32 v̄_c.
    """
    hkv, Q, M = scaled.shape
    rest = scaled.scatter(-1, top, float("-inf"))  # (Hkv, Q, M)
    mx = rest.amax(-1, keepdim=True)  # (Hkv, Q, 1)
    finite = torch.isfinite(mx)
    w = (rest - torch.where(finite, mx, 0.0)).exp_()  # (Hkv, Q, M)
    W = run_clusters.shape[1]
    per_run = torch.zeros((hkv, Q, W)).scatter_add_(-1, run[:, None, :].expand(hkv, Q, M), w)  # (Hkv, Q, W)
    v_runs = value_means.gather(1, run_clusters[..., None].expand(hkv, W, value_means.shape[2]))  # (Hkv, W, D)
    total = per_run.sum(-1)  # (Hkv, Q)
    out = torch.bmm(per_run, v_runs) / total.clamp(min=1e-30)[..., None]
    lse = torch.where(finite.squeeze(-1) & (total > 0), mx.squeeze(-1) + total.log(), float("-inf"))
    return RestPart(out=out, lse=lse)


def keyed_rest_part(
    logit: torch.Tensor, labels: torch.Tensor, value_means: torch.Tensor, value_codes: ResidualCodes | None = None
) -> RestPart:
    """The estimate from per-key weights (routed's `rank=keys`): each key left out weighs exp(logit), with its
    cluster's mean value, plus its own coded value residual where `value_codes` are given (`pq_values`).

    Args:
        logit: (Hkv, Q, N) float32 s·q·k per layout row (approximate for unread keys, exact for read ones;
            −inf for the keys accounted exactly and outside the searchable range).
        labels: (Hkv, N) int64 the cluster of every row.
        value_means: (Hkv, C, D) float32 v̄_c (with value_codes: the means their residuals are to).
        value_codes: (Hkv, N, m) codes of every row's v − v̄_c (index/routed/pq.py), or None.
    """
    hkv, Q, n = logit.shape
    w, lse = softmax_weights(logit)  # (Hkv, Q, N), (Hkv, Q)
    per_cluster = torch.zeros((hkv, Q, value_means.shape[1])).scatter_add_(-1, labels[:, None, :].expand(hkv, Q, n), w)
    out = torch.bmm(per_cluster, value_means.float())
    if value_codes is not None:  # Σ_i w_i·r̂_i, the residuals decoded a block of rows at a time
        for a, b, part in code_blocks(value_codes):
            out.baddbmm_(w[:, :, a:b], decode(part))
    return RestPart(out=out, lse=lse)


def combine(a: RestPart, b: RestPart) -> RestPart:
    """Two disjoint rest parts as one (log-sum-exp merge, as docs/DESIGN.md "The merge")."""
    lse = torch.logaddexp(a.lse, b.lse)  # (Hkv, Q)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    wa = (a.lse - safe).exp()[..., None]  # 0 where a is empty
    wb = (b.lse - safe).exp()[..., None]
    return RestPart(out=a.out * wa + b.out * wb, lse=lse)
