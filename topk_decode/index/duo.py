"""duo: DuoAttention's head split — retrieval heads search the whole context, streaming heads none.

Each (layer, KV head) has a gate in [0, 1] (DuoAttention's `full_attention_heads.tsv`, or our own
`topk calibrate-duo`). Heads whose gate is at or above the `sparsity` quantile of all gates are
retrieval heads: exact top-k over the context, delegated to the flat strategy's search (the same
Faiss index types / torch scan, built for these heads only). The others are streaming heads: they
attend only to the decoder's GPU window — the context's first `n_sink` and last `n_tail` tokens
plus everything generated since — which is exactly DuoAttention's sinks + recent set. A streaming
head has no index, no search and no CPU→GPU traffic: its slots come back as -1 (empty).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from topk_decode.errors import TopkError
from topk_decode.index.artifacts import artifact_dir, read_done, start_artifacts, verify_done, write_done, writing
from topk_decode.index.base import FLOAT_KV_DTYPES, Selection
from topk_decode.index.flat import FlatStrategy, add_in_blocks, new_flat_index
from topk_decode.index.options import StrategyOptions, option
from topk_decode.index.threads import HeadPool, default_threads

PATTERN_FILE = "full_attention_heads.tsv"


def parse_pattern(path: str | Path, n_layers: int, n_kv_heads: int) -> torch.Tensor:
    """Read a DuoAttention gate table: one row per layer, one tab-separated column per KV head.

    Args:
        path: the TSV file.
        n_layers: the model's number of layers (rows expected).
        n_kv_heads: the model's number of KV heads (columns expected).
    Returns:
        (n_layers, n_kv_heads) float32 gates in [0, 1].
    """
    path = Path(path)
    if not path.is_file():
        raise TopkError(f"duo pattern file not found: {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TopkError(f"unreadable duo pattern file {path}: {e}") from None
    rows = [line for line in text.splitlines() if line.strip()]
    if len(rows) != n_layers:
        raise TopkError(
            f"duo pattern {path} has {len(rows)} rows, the model has {n_layers} layers (one row per layer expected)"
        )
    gates = []
    for i, line in enumerate(rows):
        cells = line.strip().split("\t")
        if len(cells) != n_kv_heads:
            raise TopkError(
                f"duo pattern {path} row {i + 1} has {len(cells)} columns, the model has "
                f"{n_kv_heads} KV heads (tab-separated, one column per KV head expected)"
            )
        try:
            vals = [float(c) for c in cells]
        except ValueError:
            raise TopkError(f"duo pattern {path} row {i + 1} has a non-numeric value: {line.strip()!r}") from None
        bad = [v for v in vals if not (0.0 <= v <= 1.0)]  # also rejects nan
        if bad:
            raise TopkError(f"duo pattern {path} row {i + 1} has value {bad[0]} outside [0, 1]")
        gates.append(vals)
    return torch.tensor(gates, dtype=torch.float32)


def write_pattern(path: str | Path, gates: torch.Tensor) -> Path:
    """Write gates in DuoAttention's TSV format (one row per layer, tab-separated KV heads).

    Args:
        path: the output file (parent directories are created).
        gates: (n_layers, n_kv_heads) values in [0, 1].
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["\t".join(f"{float(g):.6f}" for g in row) for row in gates.detach().cpu()]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def retrieval_mask(gates: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Which heads are retrieval heads: gate ≥ the `sparsity` quantile of all gates (DuoAttention's rule).

    Args:
        gates: (n_layers, n_kv_heads) gates.
        sparsity: fraction of heads to make streaming, in [0, 1]; 0 = all retrieval, 1 = all streaming.
    Returns:
        (n_layers, n_kv_heads) bool, True = retrieval head.
    """
    if not 0.0 <= sparsity <= 1.0:
        raise TopkError(f"duo sparsity must be in [0, 1], got {sparsity}")
    if sparsity <= 0.0:
        return torch.ones_like(gates, dtype=torch.bool)
    if sparsity >= 1.0:
        return torch.zeros_like(gates, dtype=torch.bool)
    # Linear interpolation between order statistics, as numpy.quantile (DuoAttention's code) does.
    threshold = torch.quantile(gates.double().flatten(), sparsity)
    return gates.double() >= threshold


@dataclass(frozen=True)
class DuoOptions(StrategyOptions):
    """duo's options."""

    pattern: str | None = option(
        None,
        "Path of a `full_attention_heads.tsv` (DuoAttention's file or `topk "
        "calibrate-duo` output); default: the one stored in the cache's duo artifacts.",
        build=True,
    )
    sparsity: float = option(0.5, "Fraction of KV heads that become streaming heads.")
    backend: str = option(
        "faiss", "The retrieval heads' exact search: faiss or torch (as flat's).", check=("faiss", "torch")
    )
    threads: int | None = option(None, "Parallel head searches (default: CPU cores).")


class DuoStrategy(FlatStrategy):
    """Exact top-k for retrieval heads, nothing for streaming heads (options: `DuoOptions`)."""

    name = "duo"
    Options = DuoOptions
    kv_dtypes = FLOAT_KV_DTYPES  # not flat's int8: its indices are built from float keys

    @classmethod
    def build_artifacts(
        cls, ckv, options: dict | None = None, progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Validate the `pattern` option against the cache's model and store it in the cache.

        Args:
            ckv: the opened cache.
            options: must hold `pattern=PATH` (DuoAttention's file or `topk calibrate-duo` output).
            progress: unused (copying a small file).
        """
        src = cls.parse_options(options).pattern
        if not src:
            raise TopkError(
                "duo needs a head pattern: pass pattern=PATH (DuoAttention's full_attention_heads.tsv "
                "or the output of `topk calibrate-duo`)"
            )
        parse_pattern(src, ckv.n_layers, ckv.n_kv_heads)
        out = start_artifacts(ckv.path, cls.name)
        with writing(out, cls.name):
            shutil.copyfile(src, out / PATTERN_FILE)
            write_done(out, [out / PATTERN_FILE], {"pattern": str(src)}, ckv.cache_id)

    def _pattern_path(self) -> Path:
        given = self.options.pattern
        if given:
            return Path(given)
        d = artifact_dir(self.ckv.path, self.name)
        if read_done(d) is not None:
            verify_done(d)  # the stored pattern is the one that was validated at build
            return d / PATTERN_FILE
        raise TopkError(
            "duo needs a head pattern: pass strategy option pattern=PATH (DuoAttention's "
            "full_attention_heads.tsv or `topk calibrate-duo` output)"
        )

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        sparsity = self.options.sparsity
        self.gates = parse_pattern(self._pattern_path(), self.ckv.n_layers, self.ckv.n_kv_heads)
        self.retrieval = retrieval_mask(self.gates, sparsity)  # (L, Hkv) bool
        self.retrieval_heads = [torch.nonzero(r).flatten().tolist() for r in self.retrieval]
        n_stream = int((~self.retrieval).sum())
        self.stats.extra.update(
            streaming_heads=0, pattern_streaming=n_stream, pattern_retrieval=int(self.retrieval.sum())
        )
        # Flat's search machinery (backend, per-head thread pool) without its all-heads index build.
        self.backend = self.options.backend
        self.threads = self.options.threads or default_threads()
        self.pool = HeadPool(self.threads)  # parallel heads, each search single-threaded (threads.py)
        # Indices only for retrieval heads: a streaming head's memory-mapped keys are never read.
        self.head_index: dict[tuple[int, int], faiss.Index] = {}
        if self.backend != "faiss" or self.n_searchable == 0:
            return
        todo = [(layer, h) for layer, hs in enumerate(self.retrieval_heads) for h in hs]
        for i, (layer, h) in enumerate(todo):
            index = new_flat_index(self.ckv.head_dim, self.ckv.dtype)
            add_in_blocks(index, self.ckv.keys[layer][h, self.lo : self.hi])
            self.head_index[(layer, h)] = index
            if progress:
                progress(i + 1, len(todo))

    def search_head(self, layer: int, h: int, q: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k of one retrieval head (flat's search): (Q, k) scores and searchable-range offsets.

        Args:
            layer: layer index.
            h: KV head index (must be a retrieval head).
            q: (Q, D) float32 queries of the head's group.
            k: results per query.
        """
        if self.backend == "torch":
            return self.torch_search(layer, h, q, k)
        return self.head_index[(layer, h)].search(q.numpy(), k)

    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        hkv, Q, _ = q.shape
        heads = self.retrieval_heads[layer]
        self.stats.extra["streaming_heads"] += hkv - len(heads)
        if not heads:
            # K = 0: the decoder gathers and transfers nothing for this layer.
            empty = torch.empty((hkv, Q, 0))
            return Selection(ids=empty.long(), scores=empty, searched=False)
        if k >= self.n_searchable:
            return self.all_tokens(q, layer, heads)  # retrieval heads only, exact
        ids = torch.full((hkv, Q, k), -1, dtype=torch.int64)
        scores = torch.zeros((hkv, Q, k), dtype=torch.float32)
        self.stats.searches += 1
        parts = self._map(lambda h: self.search_head(layer, h, q[h], k), heads)
        for h, (s, i) in zip(heads, parts):
            i = torch.from_numpy(np.asarray(i))
            scores[h] = torch.from_numpy(np.asarray(s))
            ids[h] = torch.where(i >= 0, i + self.lo, i)
        return Selection(ids=ids, scores=scores)
