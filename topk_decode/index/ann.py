"""ivf and hnsw: approximate maximum-inner-product search with Faiss, one index per (layer, KV head).

Both index all N context keys (ids = context positions) with `METRIC_INNER_PRODUCT`, and restrict
each search to the searchable range with an `IDSelectorRange(lo, hi)`, so sinks and tail (which
live in the decoder's exact window) are never returned. Scores are always recomputed exactly from
the memory-mapped keys (`exact_scores`): the indices may store keys in 16 bits or centred.

Query-aware remedy (attention queries are out of distribution for the keys): with `center=True`
each head's mean key μ is subtracted before indexing. q·(k − μ) = q·k − q·μ ranks the keys of one
query exactly as q·k does, but the common component that dominates raw keys no longer drags every
key into the same few clusters/neighbourhoods. `spherical=True` trains IVF centroids with spherical
k-means, so probing by q·c ranks clusters by direction rather than by centroid norm.
Centring raised recall on the trained demo model's keys and on keys with a shared offset and was
neutral on random-model keys, so it is on by default; spherical k-means gave mixed results and is off
(figures: docs/STRATEGIES.md, "Query-aware remedy: centring the keys").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from topk_decode.errors import TopkError
from topk_decode.index.artifacts import (
    artifact_dir,
    ensure_artifacts,
    start_artifacts,
    write_done,
    write_file,
    writing,
)
from topk_decode.index.base import Selection, SelectionStrategy, exact_scores
from topk_decode.index.options import POSITIVE, StrategyOptions, option
from topk_decode.index.threads import HeadPool, default_threads
from topk_decode.store.cache_dir import ContextKV

_SQ_TYPES = {torch.float16: "QT_fp16", torch.bfloat16: "QT_bf16"}


# ---- the shared Faiss strategy ---------------------------------------------------------------------
@dataclass(frozen=True)
class AnnOptions(StrategyOptions):
    """The options ivf and hnsw share."""

    center: bool = option(True, "Subtract each head's mean key before indexing.", build=True)
    threads: int | None = option(None, "Parallel head searches (default: CPU cores).", check=POSITIVE)
    mmap: bool = option(True, "Map the index files instead of reading them into RAM.")


class FaissAnnStrategy(SelectionStrategy):
    """Common build/load/search of per-(layer, KV head) Faiss ANN indices (subclasses: ivf, hnsw)."""

    IO_FLAGS: int = 0
    Options = AnnOptions

    # ---- options ----
    @classmethod
    def build_options(cls, ckv: ContextKV, opts: AnnOptions) -> dict:
        """All build options, defaults filled in (recorded in done.json)."""
        return opts.build_values()

    @classmethod
    def new_index(cls, d: int, n: int, dtype: torch.dtype, opts: dict) -> faiss.Index:
        """An empty index for one head's n keys of dimension d."""
        raise NotImplementedError

    def search_params(self) -> faiss.SearchParameters:
        """Per-search parameters (nprobe / efSearch) with the [lo, hi) id selector."""
        raise NotImplementedError

    def params_for(self, k: int) -> faiss.SearchParameters:
        """The search parameters for a budget of k (HNSW widens its beam to k)."""
        return self.params

    # ---- build ----
    @classmethod
    def build_artifacts(
        cls, ckv: ContextKV, options: dict | None = None, progress: Callable[[int, int], None] | None = None
    ) -> None:
        opts = cls.build_options(ckv, cls.parse_options(options))
        d = start_artifacts(ckv.path, cls.name)
        # Building (k-means, graph insertion) is parallel inside Faiss: undo the single-thread setting
        # an opened strategy may have left for its per-head searches; one thread per usable CPU, no more.
        saved_threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(default_threads())
        try:
            with writing(d, cls.name):
                files = cls._build_heads(ckv, opts, d, progress)
                write_done(d, files, {"options": opts}, ckv.cache_id)
        finally:
            faiss.omp_set_num_threads(saved_threads)

    @classmethod
    def _build_heads(
        cls, ckv: ContextKV, opts: dict, d: Path, progress: Callable[[int, int], None] | None
    ) -> list[Path]:
        """Build and save one index per (layer, KV head); returns the files written."""
        L, H, D = ckv.n_layers, ckv.n_kv_heads, ckv.head_dim
        files = []
        for layer in range(L):
            for h in range(H):
                x = ckv.keys[layer][h].float().numpy()  # (N, D)
                if opts["center"]:
                    # Queries are not shifted: q·(k − μ) ranks one query's keys exactly as q·k, and
                    # scores are recomputed exactly after the search, so μ is not needed later.
                    x = x - x.mean(axis=0)
                x = np.ascontiguousarray(x, dtype=np.float32)
                index = cls.new_index(D, x.shape[0], ckv.dtype, opts)
                if not index.is_trained:
                    index.train(x)
                index.add(x)  # ids 0..N-1 = positions
                files.append(d / f"l{layer:03d}.h{h:02d}.faiss")
                write_file(files[-1], faiss.serialize_index(index))
                if progress:
                    progress(layer * H + h + 1, L * H)
        return files

    # ---- open ----
    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        wanted = {k: v for k, v in self.build_options(self.ckv, self.options).items() if k in self.options.given}
        d = artifact_dir(self.ckv.path, self.name)
        self.built = ensure_artifacts(
            self.ckv, self.name, wanted, lambda: self.build_artifacts(self.ckv, self.options, progress)
        )
        L, H = self.ckv.n_layers, self.ckv.n_kv_heads
        # mmap=False reads the indices into RAM (faster searches, RAM = artifact bytes).
        flags = self.IO_FLAGS if self.options.mmap else 0
        self.indices = [
            [faiss.read_index(str(d / f"l{layer:03d}.h{h:02d}.faiss"), flags) for h in range(H)] for layer in range(L)
        ]
        self.threads = self.options.threads or default_threads()
        self.pool = HeadPool(self.threads)  # parallel heads, each search single-threaded (threads.py)
        # The selector must outlive every search that uses it: keep it on the instance.
        self.selector = faiss.IDSelectorRange(self.lo, self.hi)
        self.params = self.search_params()

    # ---- search ----
    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        if k >= self.n_searchable:
            return self.all_tokens(q, layer)
        self.stats.searches += 1
        qn = np.ascontiguousarray(q.numpy(), dtype=np.float32)  # (Hkv, Q, D)
        row, params = self.indices[layer], self.params_for(k)

        def one(h: int) -> np.ndarray:
            return row[h].search(qn[h], k, params=params)[1]  # (Q, k) ids, -1 = none

        parts = self.pool.map(one, range(q.shape[0]))
        ids = torch.from_numpy(np.stack(parts))  # (Hkv, Q, k)
        scores = exact_scores(self.ckv.keys[layer], q, ids)  # (Hkv, Q, k) exact q·k
        return Selection(ids=ids, scores=scores)


@dataclass(frozen=True)
class IvfOptions(AnnOptions):
    """ivf's options."""

    nlist: int | None = option(
        None, "Number of clusters (default 4·√N, at most N/39 so k-means has data).", build=True, check=POSITIVE
    )
    nprobe: int | None = option(None, "Clusters scanned per query (default max(1, nlist/8)).", check=POSITIVE)
    spherical: bool = option(False, "Spherical k-means for the centroids (mixed results).", build=True)


class IvfStrategy(FaissAnnStrategy):
    """Inverted-file index: k-means coarse quantizer, scan the `nprobe` best lists (options: `IvfOptions`)."""

    name = "ivf"
    Options = IvfOptions
    # Zero-copy mapping of the lists: the old IO_FLAG_MMAP path was ~15× slower to search here.
    IO_FLAGS = faiss.IO_FLAG_MMAP_IFC

    @classmethod
    def build_options(cls, ckv: ContextKV, opts: IvfOptions) -> dict:
        n = ckv.n_tokens
        nlist = opts.nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
        if nlist > n:
            raise TopkError(f"nlist={nlist} is more than the {n} context tokens")
        return {**opts.build_values(), "nlist": nlist}

    @classmethod
    def new_index(cls, d: int, n: int, dtype: torch.dtype, opts: dict) -> faiss.Index:
        quantizer = faiss.IndexFlatIP(d)
        if dtype in _SQ_TYPES:
            qtype = getattr(faiss.ScalarQuantizer, _SQ_TYPES[dtype])
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, opts["nlist"], qtype, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexIVFFlat(quantizer, d, opts["nlist"], faiss.METRIC_INNER_PRODUCT)
        index.cp.spherical = opts["spherical"]
        index.cp.seed = 1234  # reproducible clusters (the Faiss wrapper keeps `quantizer` referenced)
        if faiss.get_num_gpus() > 0:
            # With faiss-gpu (the `gpu-index` extra) the k-means assignments run on the GPUs; the index
            # itself stays a CPU index. faiss-cpu reports 0 GPUs, so this is skipped there.
            index.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(d))
        return index

    def search_params(self) -> faiss.SearchParameters:
        nlist = self.built["nlist"]
        self.nprobe = min(self.options.nprobe or max(1, nlist // 8), nlist)
        return faiss.SearchParametersIVF(nprobe=self.nprobe, sel=self.selector)


@dataclass(frozen=True)
class HnswOptions(AnnOptions):
    """hnsw's options."""

    M: int = option(32, "Graph degree.", build=True, check=POSITIVE)
    efConstruction: int = option(80, "Build beam width.", build=True, check=POSITIVE)
    efSearch: int = option(64, "Search beam width (raised to k when smaller).", check=POSITIVE)


class HnswStrategy(FaissAnnStrategy):
    """Hierarchical navigable small-world graph over the keys, inner-product metric (options: `HnswOptions`)."""

    name = "hnsw"
    Options = HnswOptions
    IO_FLAGS = faiss.IO_FLAG_MMAP_IFC  # zero-copy mapping of the stored vectors and graph

    @classmethod
    def build_options(cls, ckv: ContextKV, opts: HnswOptions) -> dict:
        return opts.build_values()

    @classmethod
    def new_index(cls, d: int, n: int, dtype: torch.dtype, opts: dict) -> faiss.Index:
        if dtype in _SQ_TYPES:
            qtype = getattr(faiss.ScalarQuantizer, _SQ_TYPES[dtype])
            index = faiss.IndexHNSWSQ(d, qtype, opts["M"], faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexHNSWFlat(d, opts["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = opts["efConstruction"]
        return index

    def search_params(self) -> faiss.SearchParameters:
        self.ef_search = self.options.efSearch
        self._params_by_k: dict[int, faiss.SearchParameters] = {}
        return faiss.SearchParametersHNSW(efSearch=self.ef_search, sel=self.selector)

    def params_for(self, k: int) -> faiss.SearchParameters:
        if k <= self.ef_search:
            return self.params
        # The beam must be at least k wide to return k results; one parameter object per such k.
        if k not in self._params_by_k:
            self._params_by_k[k] = faiss.SearchParametersHNSW(efSearch=k, sel=self.selector)
        return self._params_by_k[k]
