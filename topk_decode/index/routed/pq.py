"""Residual codes for routed's per-key ranking (`rank=keys`): each key's offset from its cluster's centroid,
product-quantized to 4 bits per sub-vector (IVF-PQ, as RetroInfer and PQCache estimate scores).

Why: the exact top-k keys of a KV head's G query heads are scattered over a quarter of the clusters, so no
ranking of whole clusters reaches them within a 4 % read; scoring every key by centroid + residual code does
(docs/history/eval-2026-11.md "Why routed loses what exact top-k keeps"). One key's approximate score is

    q·k ≈ q·μ_c + Σ_j LUT_j[code_j],   LUT_j[b] = q_j·B_j[b]

with μ_c its cluster's centroid, q_j the j-th of m sub-vectors of q and B_j the j-th codebook (16 entries of
D/m dimensions). The codebooks are faiss' `ProductQuantizer`'s (a hard dependency already), one per (layer, KV
head), its sub-vectors trained in parallel; the codes are faiss' too (at one dimension per sub-vector computed by
kernels/pq_codes.py), kept as faiss packs them, two sub-vectors per byte (64 bytes per key at m = 128), in
the layout's row order, and unpacked a block of rows at a time where decoded. The same codes of
each value's residual to its cluster's mean value (`pq_values`) give the per-key estimate every unread key's own
approximate value v̄_c + r̂v (index/routed/estimate.py `keyed_rest_part`).

The torch path (index/routed/torch_path.py) scores with the decoded keys μ_c + r̂ (`approximate_scores`, decoded
block by block: no fp32 copy of the keys is kept), which gives the same scores as the table lookups; the fast form
(32 bytes per key at the default m scanned by lookups inside the captured step on the GPU) is index/routed/device_codes.py.

    >>> import torch
    >>> keys = torch.randn(1, 512, 8)
    >>> cent = keys.mean(1, keepdim=True)  # one cluster
    >>> codes = train_codes(keys, cent, torch.zeros(1, 512, dtype=torch.long), m=4)
    >>> codes.codes.shape, codes.unpacked().shape, codes.codebooks.shape
    (torch.Size([1, 512, 2]), torch.Size([1, 512, 4]), torch.Size([1, 4, 16, 2]))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NBITS = 4  # bits per sub-vector code: 16 codewords, one LUT of 16 entries per sub-vector
# sub-vectors per key by default: one dimension each up to 128 (64 bytes of codes at D = 128), which kept dense's
# answer more often than two or four dimensions each on the suite (docs/history/eval-2026-11.md "pq_m=64 on the GPU",
# "Key codes on a d = 128 model at 16K and 32K")
MAX_M = 128
TRAIN_ROWS = 65_536  # residuals per (layer, KV head) the codebooks are trained on (all when fewer)
SCORE_ROWS = 16_384  # rows decoded at a time by `approximate_scores` (Hkv × 8 MiB of fp32 keys at D = 128)


@dataclass
class ResidualCodes:
    """One layer's residual codes, all KV heads.

    codes: (Hkv, N, ⌈m/2⌉) uint8 the code (0..15) of every layout row's residual k − μ_c per sub-vector, two per
        byte: sub-vector 2j in the low nibble of byte j, 2j + 1 in the high one (faiss' packing; an odd m leaves the
        last high nibble 0).
    codebooks: (Hkv, m, 16, D/m) float32 codewords per sub-vector.
    """

    codes: torch.Tensor
    codebooks: torch.Tensor

    @property
    def m(self) -> int:
        """Sub-vectors per key."""
        return self.codebooks.shape[1]

    def unpacked(self) -> torch.Tensor:
        """(Hkv, N, m) uint8 one code per sub-vector."""
        p = self.codes
        return torch.stack([p & 0x0F, p >> 4], -1).view(*p.shape[:-1], 2 * p.shape[-1])[..., : self.m]

    @classmethod
    def packing(cls, codes: torch.Tensor, codebooks: torch.Tensor) -> ResidualCodes:
        """Codes given one per sub-vector, (Hkv, N, m) uint8, packed two per byte."""
        if codes.shape[-1] % 2:
            codes = torch.cat([codes, torch.zeros(*codes.shape[:-1], 1, dtype=torch.uint8)], -1)
        return cls(codes[..., 0::2] | (codes[..., 1::2] << 4), codebooks)


def packed_bytes(m: int) -> int:
    """Bytes of one key's codes at m sub-vectors (two 4-bit codes per byte)."""
    return (m * NBITS + 7) // 8


def default_m(head_dim: int) -> int:
    """Sub-vectors per key when `pq_m` is not given: one per dimension, at most `MAX_M`."""
    return min(MAX_M, max(1, head_dim))


def train_codes(
    keys: torch.Tensor, centroids: torch.Tensor, labels: torch.Tensor, m: int, threads: int | None = None
) -> ResidualCodes:
    """Train and encode the residuals of every KV head of one layer: the sub-vectors of every head trained in
    parallel (the codebooks `ProductQuantizer.train` gives, one `Clustering` each), then the rows encoded over every
    thread (a layer has fewer KV heads than a host has cores: 2 of 8 on Qwen2.5-Coder-1.5B): by faiss'
    `compute_codes` in chunks, or at one dimension per sub-vector by kernels/pq_codes.py (the same codes).

    Args:
        keys: (Hkv, N, D) the layer's keys in layout row order.
        centroids: (Hkv, C, D) float32 each cluster's centroid.
        labels: (Hkv, N) int64 the cluster of every row.
        m: sub-vectors per key (D must be a multiple of m).
        threads: parallel workers (default: `index/threads.py` `default_threads`), each on one OpenMP thread of the
            project's `HeadPool` (faiss runs without the GIL).
    """
    import faiss

    from topk_decode.index.threads import HeadPool, default_threads

    hkv, n, d = keys.shape
    codes = torch.empty((hkv, n, packed_bytes(m)), dtype=torch.uint8)
    books = torch.empty((hkv, m, 1 << NBITS, d // m), dtype=torch.float32)
    rng = np.random.default_rng(0)  # every head's sample drawn in head order: the codes do not depend on `threads`
    samples = [None if n <= TRAIN_ROWS else rng.choice(n, TRAIN_ROWS, replace=False) for _ in range(hkv)]
    residuals = keys.float() - row_centroids(centroids, labels)  # (Hkv, N, D)
    workers = threads or default_threads()

    dsub = d // m
    train_rows = [residuals[h].numpy() if samples[h] is None else residuals[h].numpy()[samples[h]] for h in range(hkv)]
    reference = faiss.ProductQuantizer(d, m, NBITS)  # held: its `cp` is a view into it, not a copy
    params = reference.cp  # faiss' own: `ProductQuantizer.train` clusters with these

    def train(task: tuple[int, int, int]) -> None:
        h, j0, j1 = task  # sub-vectors j0..j1 of one head, each as `ProductQuantizer.train` does them
        for j in range(j0, j1):
            clus = faiss.Clustering(dsub, 1 << NBITS, params)
            clus.train(np.ascontiguousarray(train_rows[h][:, j * dsub : (j + 1) * dsub]), faiss.IndexFlatL2(dsub))
            books[h, j] = torch.from_numpy(faiss.vector_to_array(clus.centroids).reshape(1 << NBITS, dsub))

    def quantizer(h: int):
        pq = faiss.ProductQuantizer(d, m, NBITS)
        faiss.copy_array_to_vector(books[h].numpy().ravel(), pq.centroids)
        return pq

    chunk = max(4096, -(-hkv * n // (4 * workers)))  # rows per encoding task: ~4 tasks per worker

    def encode(task: tuple[int, int]) -> None:
        h, a = task
        b = min(n, a + chunk)  # packed as `ResidualCodes` keeps them
        codes[h, a:b] = torch.from_numpy(quantizers[h].compute_codes(np.ascontiguousarray(residuals[h, a:b].numpy())))

    pool = HeadPool(workers)
    try:
        per = -(-m // -(-workers // hkv))  # sub-vectors per training task: every worker busy, no more tasks
        pool.map(train, [(h, j, min(m, j + per)) for h in range(hkv) for j in range(0, m, per)])
        if dsub == 1:  # faiss' own nearest codewords, in one compiled loop (kernels/pq_codes.py says why)
            from topk_decode.kernels.jit import set_threads
            from topk_decode.kernels.pq_codes import nearest_codes_1d

            set_threads(workers)
            for h in range(hkv):
                nearest_codes_1d(residuals[h].numpy(), books[h, :, :, 0].contiguous().numpy(), codes[h].numpy())
        else:
            quantizers = [quantizer(h) for h in range(hkv)]
            pool.map(encode, [(h, a) for h in range(hkv) for a in range(0, n, chunk)])
    finally:
        pool.close()
    return ResidualCodes(codes, books)


def row_centroids(centroids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(Hkv, N, D) the centroid of every row's cluster: centroids (Hkv, C, D), labels (Hkv, N)."""
    return centroids.gather(1, labels[..., None].expand(-1, -1, centroids.shape[2]))


def approximate_keys(centroids: torch.Tensor, labels: torch.Tensor, codes: ResidualCodes) -> torch.Tensor:
    """(Hkv, N, D) float32 μ_c + r̂ per row: each key as its cluster's centroid and its residual code say."""
    return row_centroids(centroids, labels) + decode(codes)


def approximate_scores(
    q: torch.Tensor, centroids: torch.Tensor, labels: torch.Tensor, codes: ResidualCodes, block: int = SCORE_ROWS
) -> torch.Tensor:
    """(Hkv, Q, N) float32 q·(μ_c + r̂) for every row, the approximate keys decoded `block` rows at a time.

    Args:
        q: (Hkv, Q, D) float32 queries; centroids: (Hkv, C, D) float32; labels: (Hkv, N) int64 the cluster of
        every row; codes: the layer's residual codes.
    """
    hkv, n = labels.shape
    out = torch.empty((hkv, q.shape[1], n))
    for a, b, part in code_blocks(codes, block):
        out[:, :, a:b] = torch.bmm(q, approximate_keys(centroids, labels[:, a:b], part).transpose(1, 2))
    return out


def code_blocks(codes: ResidualCodes, block: int = SCORE_ROWS):
    """Yield (a, b, the codes of rows a:b) over every row, `block` rows at a time (what is decoded at once)."""
    n = codes.codes.shape[1]
    for a in range(0, n, block):
        b = min(n, a + block)
        yield a, b, ResidualCodes(codes.codes[:, a:b], codes.codebooks)


def top_rows(
    share: torch.Tensor, width: int, block: int = 1, pad: torch.Tensor | None = None, ordered: bool = True
) -> torch.Tensor:
    """(Hkv, W) int64 the layout rows rank=keys reads: the `width` best rows by `share`, in row order; with
    `block` > 1 the best width // block blocks of `block` consecutive rows, each block scored by its best row (the
    host then reads runs, not single rows), W = width // block · block.

    Args:
        share: (Hkv, N) float32 each row's score (−inf for rows never to read); pad: (Hkv, 1) int64 a row outside
            the searchable range per head, read in place of the rows past the end of the last block.
        ordered: return the rows in row order (the host reads them so); False leaves single rows in topk's order
            (the same set, without the sort: docs/BENCHMARKS.md "Every layer on the device" times it).
    """
    if block == 1:
        rows = share.topk(width, dim=-1, sorted=False).indices
        return rows.int().sort(dim=-1).values.long() if ordered else rows
    hkv, n = share.shape
    nb = -(-n // block)
    padded = torch.nn.functional.pad(share, (0, nb * block - n), value=float("-inf"))
    best = padded.view(hkv, nb, block).amax(-1)  # (Hkv, nb)
    blocks = best.topk(width // block, dim=-1, sorted=False).indices.sort(dim=-1).values
    rows = (blocks[..., None] * block + torch.arange(block, device=share.device)).view(hkv, -1)
    return torch.where(rows < n, rows, pad)


def decode(codes: ResidualCodes) -> torch.Tensor:
    """(Hkv, N, D) float32 decoded residuals r̂ (q·r̂ = Σ_j LUT_j[code_j])."""
    idx = codes.unpacked().long()  # (Hkv, N, m)
    hkv, n, m = idx.shape
    books = codes.codebooks  # (Hkv, m, 16, d)
    parts = books[torch.arange(hkv)[:, None, None], torch.arange(m)[None, None, :], idx]  # (Hkv, N, m, d)
    return parts.reshape(hkv, n, -1)
