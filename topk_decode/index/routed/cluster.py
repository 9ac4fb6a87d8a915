"""Clustered key layout for the `routed` strategy: k-means per (layer, KV head), keys stored cluster-contiguous.

Per (layer, KV head) the N context keys are clustered into C = ⌈N / S⌉ clusters of ~S tokens by a few
Lloyd iterations of Euclidean k-means on the *centred* keys (each head's mean key subtracted: real keys
share a large common component that queries do not, docs/STRATEGIES.md "centring"). Euclidean rather
than spherical or inner-product k-means because routing scores a cluster by q·c with c the *mean* of its
raw keys: q·c is then exactly the mean score of the cluster's keys, and the spread (mean squared
distance to c, stored too) completes a second-order estimate of the cluster's attention mass
(index/routed/strategy.py). Inner-product k-means would let centroids grow without bound; spherical k-means ignores the
key norms that the scores depend on.

The layout of one layer: keys (and optionally values) permuted so that each cluster's rows are one
contiguous run, the original position of every row, per-cluster offsets, centroids and spreads.
Long contexts are clustered in segments of `segment` consecutive tokens, each into its own ⌈n/S⌉
clusters (RetroInfer's segmented clustering): one assignment then costs N·(segment/S) distances instead of
N·N/S, which at 1M tokens is 16× less and what lets the layout be built at all (docs/STRATEGIES.md
"segments"). Contexts up to one segment are clustered whole.
K-means runs on the GPU when one is available (bf16/fp32 matmuls, all points); on a CPU it trains on a
subsample and stops early when its time budget is spent — the final assignment of all N keys always runs.
Assignments only decide which keys are read together: scores are always recomputed exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from topk_decode.index.routed.pq import ResidualCodes

# Scores per distance block: bounds the (block, C) temporaries to ~200 MiB (k-means runs inside the
# decoder's GPU budget, next to the weights).
_BLOCK_ELEMS = 1 << 25


@dataclass
class KMeansConfig:
    """How the clusters are trained.

    Args:
        cluster_size: target tokens per cluster S (C = ⌈N / S⌉).
        iters: Lloyd iterations.
        cpu_sample: on a CPU, train on at most this many points per cluster (all N are assigned at the end).
        cpu_seconds: on a CPU, stop iterating a head after this many seconds (at least one iteration runs).
        seed: initialisation seed.
        segment: tokens per independently clustered segment (rounded up to a multiple of cluster_size;
            0: the whole context at once).
    """

    cluster_size: int = 16
    iters: int = 6
    cpu_sample: int = 16
    cpu_seconds: float = 2.0
    seed: int = 0
    segment: int = 65536


@dataclass
class LayerLayout:
    """One layer's cluster-contiguous layout, all KV heads.

    keys: (Hkv, N, D) keys permuted cluster by cluster, in the cache's dtype; None where not stored (routed's
        `store_keys=false`: the cache's own keys are read at `pos`).
    values: (Hkv, N, D) values in the same order, or None when not stored.
    pos: (Hkv, N) int64 original position of every permuted row.
    offsets: (Hkv, C + 1) int64; cluster c of head h is rows offsets[h, c]:offsets[h, c + 1].
    centroids: (Hkv, C, D) float32 mean of each cluster's raw keys (0 for an empty cluster); None once routed has
        taken its searchable statistics where nothing else reads them (ranking clusters without codes: strategy.py).
    spread: (Hkv, C) float32 mean squared distance of a cluster's keys to its centroid, per dimension.
    value_means: (Hkv, C, D) float32 mean of each cluster's values (0 for an empty cluster), or None
        (layouts built before it existed, or dropped as the centroids are): what routed's estimate of the unread
        clusters attends to.
    codes: the rows' residual codes (index/routed/pq.py), or None (built with `pq_m=0`).
    value_codes: the rows' value residuals to value_means, coded the same way, or None (built with `pq_values=0`).
    value_scales: (Hkv, N) float32 the stored values' scales in row order (an int8 cache with values stored), or None.

    In an int8 cache (index/routed/layout.py `in_key_space`) keys and values are its int8 rows, and the centroids
    and key codes are in the int8 keys' space (divided by the key scales): queries scaled by them score both.
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None
    pos: torch.Tensor
    offsets: torch.Tensor
    centroids: torch.Tensor | None
    spread: torch.Tensor
    value_means: torch.Tensor | None = None
    codes: ResidualCodes | None = None
    value_codes: ResidualCodes | None = None
    value_scales: torch.Tensor | None = None

    @property
    def sizes(self) -> torch.Tensor:
        """(Hkv, C) int64 tokens per cluster."""
        return self.offsets[:, 1:] - self.offsets[:, :-1]

    def labels(self) -> torch.Tensor:
        """(Hkv, N) int64 the cluster of every row."""
        return row_labels(self.offsets)


def row_labels(offsets: torch.Tensor) -> torch.Tensor:
    """(Hkv, N) int64 the cluster of every layout row, from the (Hkv, C + 1) cluster offsets (on their device)."""
    sizes = offsets.diff(dim=1).long()
    c = sizes.shape[1]
    return torch.stack([torch.repeat_interleave(torch.arange(c, device=offsets.device), n) for n in sizes])


def _assign(x: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """Nearest centroid of every row: argmax_c x·c − |c|²/2, in blocks. x (n, D), cent (C, D) → (n,) int64."""
    half_norm = 0.5 * (cent.float() ** 2).sum(-1)  # (C,)
    c_t = cent.to(x.dtype).t().contiguous()  # (D, C)
    block = max(1, _BLOCK_ELEMS // max(1, cent.shape[0]))
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for s in range(0, x.shape[0], block):
        sc = (x[s : s + block] @ c_t).float()  # (b, C)
        sc -= half_norm
        out[s : s + block] = sc.argmax(-1)
    return out


def _update(x: torch.Tensor, labels: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """New centroids = mean of their points; an empty cluster keeps its old centroid."""
    C, d = cent.shape
    sums = torch.zeros((C, d), dtype=torch.float32, device=x.device).index_add_(0, labels, x.float())
    counts = torch.bincount(labels, minlength=C).to(torch.float32)
    fresh = sums / counts.clamp(min=1)[:, None]
    return torch.where(counts[:, None] > 0, fresh, cent)


def kmeans(
    keys: torch.Tensor, n_clusters: int, cfg: KMeansConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cluster one head's keys (centred); return every key's cluster and each cluster's statistics.

    Args:
        keys: (N, D) keys of one (layer, KV head), any float dtype, on the CPU.
        n_clusters: C.
        cfg: iterations, CPU sample and time budget, seed.
        device: where to compute (cuda: all points every iteration; cpu: subsampled and time-bounded).
    Returns:
        labels (N,) int64 cluster of every key, centroids (C, D) float32 mean of each cluster's raw keys
        (0 when empty), spread (C,) float32 mean squared distance of its keys to it per dimension; on the CPU.
    """
    n, d = keys.shape
    gen = torch.Generator().manual_seed(cfg.seed)
    on_gpu = device.type == "cuda"
    # bf16 keys are matmul'd in bf16 on the GPU (assignments only group keys; exact scores come later)
    work_dtype = keys.dtype if on_gpu and keys.dtype in (torch.bfloat16, torch.float16) else torch.float32
    x = keys.to(device=device, dtype=work_dtype, copy=True)  # never the (read-only) map itself
    mean = x.mean(0, dtype=torch.float32)  # (D,)
    x -= mean.to(work_dtype)  # (N, D) centred, in place
    init = torch.randperm(n, generator=gen)[:n_clusters].to(device)
    cent = x.index_select(0, init).float()  # (C, D)
    if on_gpu:
        train = x
    else:
        m = min(n, cfg.cpu_sample * n_clusters)
        train = x if m == n else x.index_select(0, torch.randperm(n, generator=gen)[:m].to(device))
    t0 = time.perf_counter()
    for _ in range(cfg.iters):
        cent = _update(train, _assign(train, cent), cent)
        if not on_gpu and time.perf_counter() - t0 > cfg.cpu_seconds:
            break
    labels = _assign(x, cent)
    del x, train
    # statistics of the final clusters from the exact keys (not the centred working copy), in blocks
    C = n_clusters
    counts = torch.bincount(labels, minlength=C).clamp(min=1).float()  # (C,)
    cents = torch.zeros((C, d), device=device)
    spread = torch.zeros(C, device=device)
    step = 1 << 17
    for s in range(0, n, step):
        cents.index_add_(0, labels[s : s + step], keys[s : s + step].to(device).float())
    cents /= counts[:, None]
    for s in range(0, n, step):
        lab = labels[s : s + step]
        sq = ((keys[s : s + step].to(device).float() - cents.index_select(0, lab)) ** 2).sum(-1)  # (b,)
        spread.index_add_(0, lab, sq)
    spread /= counts * d
    return labels.cpu(), cents.cpu(), spread.cpu()


def kmeans_segmented(
    keys: torch.Tensor, cfg: KMeansConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kmeans` of one head's keys, segment by segment; labels numbered across segments, ⌈N / S⌉ clusters in all.

    Args:
        keys: (N, D) keys of one (layer, KV head), on the CPU.
        cfg: k-means configuration (cluster_size S and segment).
        device: where to compute.
    Returns:
        labels (N,) int64, centroids (C, D) float32, spread (C,) float32, as `kmeans`.
    """
    n, S = keys.shape[0], cfg.cluster_size
    seg = -(-cfg.segment // S) * S if cfg.segment > 0 else n  # whole clusters per segment: C = ⌈N / S⌉
    if n <= seg:
        return kmeans(keys, max(1, -(-n // S)), cfg, device)
    labels, cents, spread = [], [], []
    base = 0
    for s in range(0, n, seg):
        c = -(-min(seg, n - s) // S)
        lab, cen, spr = kmeans(keys[s : s + seg], c, cfg, device)
        labels.append(lab + base)
        cents.append(cen)
        spread.append(spr)
        base += c
    return torch.cat(labels), torch.cat(cents), torch.cat(spread)


def build_layer(
    keys: torch.Tensor, values: torch.Tensor | None, cfg: KMeansConfig, device: torch.device, store_values: bool = True
) -> LayerLayout:
    """Cluster every KV head of one layer and permute its keys (and values) cluster-contiguously.

    Args:
        keys: (Hkv, N, D) the layer's keys (memory-mapped or in RAM).
        values: (Hkv, N, D) the layer's values (their per-cluster means are always kept), or None.
        cfg: k-means configuration.
        device: where k-means runs.
        store_values: also keep the values permuted cluster-contiguously (when `values` is given).
    """
    hkv, n, d = keys.shape
    C = max(1, -(-n // cfg.cluster_size))
    out_k = torch.empty((hkv, n, d), dtype=keys.dtype)
    out_v = torch.empty((hkv, n, d), dtype=values.dtype) if values is not None and store_values else None
    v_means = torch.zeros((hkv, C, d), dtype=torch.float32) if values is not None else None
    pos = torch.empty((hkv, n), dtype=torch.int64)
    offsets = torch.zeros((hkv, C + 1), dtype=torch.int64)
    cents = torch.zeros((hkv, C, d), dtype=torch.float32)
    spread = torch.zeros((hkv, C), dtype=torch.float32)
    for h in range(hkv):
        kh = keys[h]
        try:
            labels, cents[h], spread[h] = kmeans_segmented(kh, cfg, device)
        except torch.OutOfMemoryError:  # the GPU budget is taken (e.g. by the weights): the CPU path
            torch.cuda.empty_cache()
            labels, cents[h], spread[h] = kmeans_segmented(kh, cfg, torch.device("cpu"))
        perm = torch.sort(labels, stable=True).indices  # (N,) rows grouped by cluster
        offsets[h, 1:] = torch.cumsum(torch.bincount(labels, minlength=C), 0)
        pos[h] = perm
        torch.index_select(kh, 0, perm, out=out_k[h])
        if out_v is not None:
            torch.index_select(values[h], 0, perm, out=out_v[h])
        if v_means is not None:
            v_means[h] = _cluster_means(values[h], labels, C)
    return LayerLayout(out_k, out_v, pos, offsets, cents, spread, v_means)


def _cluster_means(x: torch.Tensor, labels: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """(C, D) float32 mean of the rows of x (N, D) per label (0 for an empty cluster), in blocks."""
    sums = torch.zeros((n_clusters, x.shape[1]), dtype=torch.float32)
    step = 1 << 17
    for s in range(0, x.shape[0], step):
        sums.index_add_(0, labels[s : s + step], x[s : s + step].float())
    return sums / torch.bincount(labels, minlength=n_clusters).clamp(min=1).float()[:, None]


def kmeans_device() -> torch.device:
    """cuda when available (k-means over all points), else cpu (subsampled, time-bounded)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
