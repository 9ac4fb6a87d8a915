"""flat: exact maximum-inner-product search, one Faiss index per (layer, KV head).

The keys are added in the precision they were stored in (fp32 → IndexFlatIP; fp16 / bf16 →
IndexScalarQuantizer QT_fp16 / QT_bf16, which decodes them exactly), so the returned scores are the
exact fp32 inner products of the stored keys: recall 1.0 by construction. The `torch` backend scans
the memory-mapped keys with a blocked matmul instead (no second copy of the keys in RAM).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import faiss
import numpy as np
import torch

from topk_decode.index.base import Selection, SelectionStrategy

_SQ_TYPES = {torch.float16: "QT_fp16", torch.bfloat16: "QT_bf16"}
_TORCH_BLOCK = 1 << 16  # keys per matmul block: bounds the fp32 temporary to ~32 MiB per head at D=128


def default_threads() -> int:
    """Threads for per-head searches: one per core, Faiss itself single-threaded inside each."""
    return max(1, os.cpu_count() or 1)


def new_flat_index(d: int, dtype: torch.dtype) -> faiss.Index:
    """An exact inner-product index that stores vectors in `dtype`'s precision."""
    if dtype in _SQ_TYPES:
        qtype = getattr(faiss.ScalarQuantizer, _SQ_TYPES[dtype])
        return faiss.IndexScalarQuantizer(d, qtype, faiss.METRIC_INNER_PRODUCT)
    return faiss.IndexFlatIP(d)


def add_in_blocks(index: faiss.Index, keys: torch.Tensor, block: int = 1 << 18) -> None:
    """Add (M, D) keys to a Faiss index as fp32 blocks (bounded temporary memory)."""
    for s in range(0, keys.shape[0], block):
        index.add(np.ascontiguousarray(keys[s:s + block].float().numpy()))


class FlatStrategy(SelectionStrategy):
    """Exact top-k per query head.

    Options:
        backend: "faiss" (default) or "torch".
        threads: parallel head searches (default: CPU cores).
    """

    name = "flat"

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        self.backend = self.options.get("backend", "faiss")
        if self.backend not in ("faiss", "torch"):
            from topk_decode.errors import TopkError

            raise TopkError(f"unknown flat backend {self.backend!r} (use faiss or torch)")
        self.threads = int(self.options.get("threads") or default_threads())
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        if self.threads > 1:
            # Faiss parallelises one search over its queries only; with G·T queries per head we
            # parallelise over heads ourselves, so each search must stay on one thread.
            faiss.omp_set_num_threads(1)
        self.indices: list[list[faiss.Index]] = []
        if self.backend != "faiss" or self.n_searchable == 0:
            return
        L, H = self.ckv.n_layers, self.ckv.n_kv_heads
        for layer in range(L):
            row = []
            for h in range(H):
                index = new_flat_index(self.ckv.head_dim, self.ckv.dtype)
                add_in_blocks(index, self.ckv.keys[layer][h, self.lo:self.hi])
                row.append(index)
                if progress:
                    progress(layer * H + h + 1, L * H)
            self.indices.append(row)

    def _map(self, fn, items):
        return list(self.pool.map(fn, items)) if self.pool else [fn(i) for i in items]

    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        if k >= self.n_searchable:
            return self.all_tokens(q, layer)
        self.stats.searches += 1
        if self.backend == "torch":
            parts = self._map(lambda h: self._torch_topk(layer, h, q[h], k), range(q.shape[0]))
        else:
            qn = q.numpy()
            parts = self._map(lambda h: self.indices[layer][h].search(qn[h], k), range(q.shape[0]))
        scores = torch.from_numpy(np.stack([p[0] for p in parts]))   # (Hkv, Q, k)
        ids = torch.from_numpy(np.stack([p[1] for p in parts]))      # (Hkv, Q, k)
        ids = torch.where(ids >= 0, ids + self.lo, ids)
        return Selection(ids=ids, scores=scores)

    def _torch_topk(self, layer: int, h: int, q: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Blocked exact scan of one head's keys: (Q, k) scores and searchable-range offsets."""
        keys = self.ckv.keys[layer][h]
        best_s = torch.full((q.shape[0], 0), float("-inf"))
        best_i = torch.zeros((q.shape[0], 0), dtype=torch.int64)
        for s in range(self.lo, self.hi, _TORCH_BLOCK):
            e = min(s + _TORCH_BLOCK, self.hi)
            sc = q @ keys[s:e].float().T                                   # (Q, block)
            cand_s = torch.cat([best_s, sc], dim=1)
            cand_i = torch.cat([best_i, torch.arange(s - self.lo, e - self.lo).expand(q.shape[0], -1)], dim=1)
            top = cand_s.topk(min(k, cand_s.shape[1]), dim=1)
            best_s, best_i = top.values, cand_i.gather(1, top.indices)
        return best_s.numpy(), best_i.numpy()
