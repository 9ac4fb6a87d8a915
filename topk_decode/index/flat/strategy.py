"""flat: exact maximum-inner-product search over the whole searchable range: recall 1.0 by construction.

Two backends scan the memory-mapped keys directly (no second copy of the keys in RAM, nothing built at open). `torch` scores
all KV heads in one batched matmul, in the keys' own half precision, then rescores the candidates
exactly in fp32 with a certificate that the result is the exact top-k (see `half_scan`). `numba` (bf16
keys) runs compiled (head, block of keys) tasks that score every key exactly once and keep it only if it
reaches its query's cut (topk_decode/kernels/flat_scan.py): about twice torch's speed on the GPU host. The default, `auto`,
takes numba for long bf16 contexts, torch otherwise (docs/STRATEGIES.md "flat's
default backend"). `backend=faiss` stays available: one Faiss index per (layer, KV head), the keys added in
the precision they were stored in (fp32 → IndexFlatIP; fp16 / bf16 → IndexScalarQuantizer QT_fp16 / QT_bf16,
which decodes them exactly); Faiss is imported only when it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from topk_decode.errors import TopkError
from topk_decode.index.base import Selection, SelectionStrategy
from topk_decode.index.flat.select_topk import topk_by_threshold
from topk_decode.index.options import StrategyOptions, option
from topk_decode.index.threads import HeadPool, default_threads
from topk_decode.store.format import KV_DTYPES, dtype_name

if TYPE_CHECKING:
    import faiss

# auto takes numba where the context is long enough to repay its first-run compile (~30 s on 2 cores, cached on
# disk after), torch otherwise (docs/STRATEGIES.md "flat's default backend")
NUMBA_MIN_KEYS = 1 << 15
NUMBA_KEY_DTYPES = (torch.bfloat16, torch.int8)  # the keys index/flat/compiled.py reads
_SQ_TYPES = {torch.float16: "QT_fp16", torch.bfloat16: "QT_bf16"}
_TORCH_BLOCK = 1 << 16  # keys per matmul block: bounds the fp32 temporary to ~32 MiB per head at D=128


def new_flat_index(d: int, dtype: torch.dtype) -> faiss.Index:
    """An exact inner-product index that stores vectors in `dtype`'s precision."""
    import faiss

    if dtype in _SQ_TYPES:
        qtype = getattr(faiss.ScalarQuantizer, _SQ_TYPES[dtype])
        return faiss.IndexScalarQuantizer(d, qtype, faiss.METRIC_INNER_PRODUCT)
    return faiss.IndexFlatIP(d)


def add_in_blocks(index: faiss.Index, keys: torch.Tensor, block: int = 1 << 18) -> None:
    """Add (M, D) keys to a Faiss index as fp32 blocks (bounded temporary memory)."""
    for s in range(0, keys.shape[0], block):
        index.add(np.ascontiguousarray(keys[s : s + block].float().numpy()))


@dataclass(frozen=True)
class FlatOptions(StrategyOptions):
    """flat's options (all search options: flat builds nothing)."""

    backend: str = option(
        "auto",
        "auto (numba for bf16 or int8 keys when at least NUMBA_MIN_KEYS keys are searchable, else "
        "torch), torch (a batched half-precision matmul of the memory map and an exact rescoring), "
        "numba (compiled exact scan in (head, block of keys) tasks, index/flat/compiled.py; bf16 or int8 keys "
        "only) or faiss (indices copied into RAM at open). All are exact.",
        check=("auto", "torch", "numba", "faiss"),
    )
    threads: int | None = option(None, "Parallel head searches, or the numba backend's threads (default: CPU cores).")


class FlatStrategy(SelectionStrategy):
    """Exact top-k per query head (options: `FlatOptions`)."""

    name = "flat"
    Options = FlatOptions
    keeps_query = False
    rows_independent = True  # exact top-k per query row: one scan serves several conversations' rows
    kv_dtypes = KV_DTYPES  # int8 keys: the torch backend's fp32 scan widens them block by block

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        self.backend = self.options.backend
        if self.backend == "auto":
            self.backend = auto_backend(self.ckv.dtype, self.n_searchable)
        if self.backend == "numba":
            _check_numba(self.ckv.dtype)
        self.threads = self.options.threads or default_threads()
        self._buffers: dict = {}
        # Per-head searches in parallel, each single-threaded on the pool's own workers (threads.py);
        # the torch backend's batched scan runs on the caller's thread with all its threads.
        self.pool = HeadPool(self.threads)
        self.indices: list = []
        if self.backend == "numba":
            from topk_decode.index.flat import compiled  # numba: imported where the backend runs

            # compile (or load numba's disk cache) at open, not inside the first step
            compiled.warm_up(self.ckv.head_dim, self.ckv.dtype)
        if self.backend != "faiss" or self.n_searchable == 0:
            return
        L, H = self.ckv.n_layers, self.ckv.n_kv_heads
        for layer in range(L):
            row = []
            for h in range(H):
                index = new_flat_index(self.ckv.head_dim, self.ckv.dtype)
                add_in_blocks(index, self.ckv.keys[layer][h, self.lo : self.hi])
                row.append(index)
                if progress:
                    progress(layer * H + h + 1, L * H)
            self.indices.append(row)

    def _map(self, fn, items):
        return self.pool.map(fn, items)

    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        if k >= self.n_searchable:
            return self.all_tokens(q, layer)
        self.stats.searches += 1
        if self.backend == "torch":
            return self._torch_select(layer, q, k)
        if self.backend == "numba":
            from topk_decode.index.flat import compiled

            ids, scores = compiled.search(self.ckv.keys[layer], q, k, self.lo, self.hi, self.threads)
            # k < hi − lo here: a slot stays empty only if fewer than k keys score above −inf (inf/nan keys)
            return Selection(ids=ids, scores=scores, no_empty_slots=not bool((ids < 0).any()))
        qn = q.numpy()
        parts = self._map(lambda h: self.indices[layer][h].search(qn[h], k), range(q.shape[0]))
        scores = torch.from_numpy(np.stack([p[0] for p in parts]))  # (Hkv, Q, k)
        ids = torch.from_numpy(np.stack([p[1] for p in parts]))  # (Hkv, Q, k)
        ids = torch.where(ids >= 0, ids + self.lo, ids)
        return Selection(ids=ids, scores=scores)

    # ---- torch backend: one batched scan of all KV heads over the memory-mapped keys ----------
    def _torch_select(self, layer: int, q: torch.Tensor, k: int) -> Selection:
        """Exact top-k of every query head at once; the heads run in parallel inside the matmul."""
        keys = self.ckv.keys[layer]  # (Hkv, N, D) memmap
        half = keys.dtype in (torch.float16, torch.bfloat16)
        if half and torch.equal(q.to(keys.dtype).float(), q):
            # Reused buffers only for one-token steps (Q = G): prompt chunks vary in length, and a kept
            # (Hkv, Q, N) buffer per length would pile up.
            buffers = self._buffers if q.shape[1] <= 64 else None
            return half_scan(keys, q, k, self.lo, self.hi, self.stats, buffers)
        scores, ids = fp32_scan(keys, q, k, self.lo, self.hi)
        return Selection(ids=ids, scores=scores, no_empty_slots=True)

    def torch_search(self, layer: int, h: int, q: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One head's exact top-k (used by strategies that search a subset of heads, e.g. duo).

        Args:
            layer, h: layer and KV head; q: (Q, D) float32 queries; k: results per query.
        Returns:
            (Q, k) scores and (Q, k) offsets into the searchable range [lo, hi).
        """
        keys = self.ckv.keys[layer][h : h + 1]  # (1, N, D)
        q1 = q[None]  # (1, Q, D)
        if keys.dtype in (torch.float16, torch.bfloat16) and torch.equal(q1.to(keys.dtype).float(), q1):
            sel = half_scan(keys, q1, k, self.lo, self.hi, self.stats)
            scores, ids = sel.scores, sel.ids
        else:
            scores, ids = fp32_scan(keys, q1, k, self.lo, self.hi)
        return scores[0].numpy(), (ids[0] - self.lo).numpy()


def auto_backend(dtype: torch.dtype, n_searchable: int) -> str:
    """The backend `auto` stands for: numba for bf16 or int8 keys when at least NUMBA_MIN_KEYS keys are searchable,
    torch otherwise."""
    return "numba" if dtype in NUMBA_KEY_DTYPES and n_searchable >= NUMBA_MIN_KEYS else "torch"


def _check_numba(dtype: torch.dtype) -> None:
    """Refuse backend=numba, with a one-line TopkError, where it cannot run (keys neither bf16 nor int8)."""
    if dtype not in NUMBA_KEY_DTYPES:
        raise TopkError(
            f"flat: backend=numba reads bf16 or int8 keys, these are {dtype_name(dtype)} (use backend=torch)"
        )


def fp32_scan(keys: torch.Tensor, q: torch.Tensor, k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked exact fp32 scan of keys[:, lo:hi] for all heads: (Hkv, Q, k) scores and absolute ids."""
    best_s = best_i = None
    for s in range(lo, hi, _TORCH_BLOCK):
        e = min(s + _TORCH_BLOCK, hi)
        sc = torch.bmm(q, keys[:, s:e].float().transpose(1, 2))  # (Hkv, Q, block)
        ids = torch.arange(s, e).expand_as(sc)
        if best_s is not None:
            sc, ids = torch.cat([best_s, sc], dim=-1), torch.cat([best_i, ids], dim=-1)
        top = sc.topk(min(k, sc.shape[-1]), dim=-1)
        best_s, best_i = top.values, ids.gather(-1, top.indices)
    return best_s, best_i


# The sampled-threshold top-k wins on few cores but its ~20 small serial ops lose to torch's
# row-parallel topk on many (docs/BENCHMARKS.md, "Search floor on the 16-core host").
THRESHOLD_MAX_THREADS = 4

# bf16 keeps 8 significant bits: a half-precision score is within 2^-8 relative of the fp32 one
# (fp32 accumulation, one rounding). 2^-7 also covers fp32 summation-order differences.
_HALF_REL_ERR = 2.0**-7


def half_scan(
    keys: torch.Tensor, q: torch.Tensor, k: int, lo: int, hi: int, stats, buffers: dict | None = None
) -> Selection:
    """Exact top-k through a half-precision scan: no fp32 copy of the keys is ever made.

    1. scores in the keys' dtype with one batched matmul over the memory map (fp32 accumulation);
    2. the top k + margin candidates by those scores are rescored exactly in fp32;
    3. certificate: every key left out scored ≤ c in half precision, so its exact score is ≤ c·(1 ± 2^-7);
       if the exact k-th score is above that bound the result is the exact top-k. Rows that fail it
       (rare: ties at the boundary) are rescanned in fp32.

    Args:
        keys: (Hkv, N, D) fp16/bf16 keys; q: (Hkv, Q, D) fp32 queries exactly representable in that dtype.
        k: results per query; lo, hi: the searchable range.
        stats: the strategy's StrategyStats (counts fp32 rescans).
        buffers: reusable score buffers keyed by shape (no 8-64 MiB allocation per layer and step).
    """
    hkv, n, d = keys.shape
    Q, M = q.shape[1], hi - lo
    kc = min(M, k + max(32, k // 4))
    # Scan all N keys and mask [0, lo) and [hi, N) afterwards: a sliced batch (row stride ≠ M·D)
    # drops torch's CPU bmm onto a slow generic path (docs/BENCHMARKS.md, "Search floor on the 16-core host").
    if buffers is not None:
        approx = buffers.get((hkv, Q, n, keys.dtype))
        if approx is None:
            approx = buffers[(hkv, Q, n, keys.dtype)] = torch.empty((hkv, Q, n), dtype=keys.dtype)
        # one batched matmul q·Kᵀ: on the 16-core host K·qᵀ and threaded blocks lost to it (docs/STRATEGIES.md
        # "flat's default backend")
        torch.bmm(q.to(keys.dtype), keys.transpose(1, 2), out=approx)  # (Hkv, Q, N) half
    else:
        approx = torch.bmm(q.to(keys.dtype), keys.transpose(1, 2))
    approx[..., :lo] = float("-inf")
    approx[..., hi:] = float("-inf")
    # Exact candidates without a full topk over N (cheaper on few cores: THRESHOLD_MAX_THREADS); unsorted:
    # only their minimum (the certificate's c) and the set matter.
    if torch.get_num_threads() <= THRESHOLD_MAX_THREADS:
        cand_s, cand_i = topk_by_threshold(approx, kc, sorted=False, counters=stats.extra, buffers=buffers)
    else:
        cand_s, cand_i = approx.topk(kc, dim=-1, sorted=False)
    rows = cand_i + (torch.arange(hkv) * n).view(hkv, 1, 1)  # (Hkv, Q, kc) rows of (Hkv·N, D)
    if buffers is not None:  # 10-20 MiB per layer and step: reuse instead of fresh (page-faulting) memory
        k_sel = buffers.get(("sel", hkv * Q * kc, d, keys.dtype))
        if k_sel is None:
            k_sel = buffers[("sel", hkv * Q * kc, d, keys.dtype)] = torch.empty((hkv * Q * kc, d), dtype=keys.dtype)
            buffers[("sel32", hkv * Q * kc, d)] = torch.empty((hkv * Q * kc, d), dtype=torch.float32)
        torch.index_select(keys.reshape(hkv * n, d), 0, rows.view(-1), out=k_sel)
        k32 = buffers[("sel32", hkv * Q * kc, d)]
        k32.copy_(k_sel)
    else:
        k32 = keys.reshape(hkv * n, d).index_select(0, rows.view(-1)).float()
    exact = torch.bmm(k32.view(hkv * Q, kc, d), q.reshape(hkv * Q, d, 1)).view(hkv, Q, kc)  # (Hkv, Q, kc) fp32
    top = exact.topk(k, dim=-1)
    scores, ids = top.values, cand_i.gather(-1, top.indices)
    if kc < M:
        c = cand_s.amin(-1).float()  # (Hkv, Q) ≥ every left-out key's
        bound = torch.where(c >= 0, c / (1 - _HALF_REL_ERR), c / (1 + _HALF_REL_ERR))
        bad = (scores[..., -1] < bound).nonzero().tolist()
        for h, i in bad:
            s, ix = fp32_scan(keys[h : h + 1], q[h : h + 1, i : i + 1], k, lo, hi)
            scores[h, i], ids[h, i] = s[0, 0], ix[0, 0]
        stats.extra["fp32_rescans"] = stats.extra.get("fp32_rescans", 0) + len(bad)
    return Selection(ids=ids, scores=scores, no_empty_slots=True)  # k < M here: every slot holds a token
