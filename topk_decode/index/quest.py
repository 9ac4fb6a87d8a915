"""quest: query-aware page selection (Tang et al. 2024, "Quest").

The context is cut into pages of `page_size` consecutive tokens (page p = positions
[p·S, (p+1)·S)). Per page and KV head we keep the elementwise min and max of its keys. For a query
q the page score Σ_d max(q_d·min_d, q_d·max_d) bounds q·k from above for every key k of the page
(each term bounds q_d·k_d because k_d lies in [min_d, max_d]). Each query head attends to every
token of its top-scoring pages within its budget; the last searchable page is always attended
(Quest's "current page"). The first `dense_layers` layers attend to everything, as in Quest.
Scores of the chosen tokens are exact q·k; tokens of a chosen page outside [lo, hi) are marked -1 so
the retrieved set never overlaps the decoder's window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from topk_decode.index.artifacts import (
    artifact_dir,
    ensure_artifacts,
    start_artifacts,
    write_done,
    write_file,
    writing,
)
from topk_decode.index.base import Selection, SelectionStrategy, exact_scores
from topk_decode.index.options import NON_NEGATIVE, POSITIVE, StrategyOptions, option
from topk_decode.store.cache_dir import ContextKV
from topk_decode.store.format import as_torch, dtype_name, numpy_storage


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of the keys of every page (the last page may be partial).

    Args:
        keys: (Hkv, N, D) one layer's keys.
        page_size: tokens per page.
    Returns:
        mins, maxs: (Hkv, P, D) in the keys' dtype, P = ceil(N / page_size).
    """
    hkv, n, d = keys.shape
    full = n // page_size
    mins, maxs = [], []
    if full:
        pages = keys[:, : full * page_size].reshape(hkv, full, page_size, d)  # (Hkv, P_full, S, D)
        mins.append(pages.amin(dim=2))
        maxs.append(pages.amax(dim=2))
    if n % page_size:
        rest = keys[:, full * page_size :]  # (Hkv, r, D)
        mins.append(rest.amin(dim=1, keepdim=True))
        maxs.append(rest.amax(dim=1, keepdim=True))
    return torch.cat(mins, dim=1), torch.cat(maxs, dim=1)


def page_scores(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound Σ_d max(q_d·min_d, q_d·max_d) for every query and page.

    Args:
        q: (Hkv, Q, D) float32 queries.
        mins, maxs: (Hkv, P, D) page bounds.
    Returns:
        (Hkv, Q, P) float32.
    """
    # max(q_d·min_d, q_d·max_d) = q_d⁺·max_d + q_d⁻·min_d (q⁺ = max(q, 0), q⁻ = min(q, 0)): two matmuls.
    return torch.bmm(q.clamp(min=0), maxs.float().transpose(1, 2)) + torch.bmm(
        q.clamp(max=0), mins.float().transpose(1, 2)
    )


@dataclass(frozen=True)
class QuestOptions(StrategyOptions):
    """quest's options."""

    page_size: int = option(16, "Tokens per page.", build=True, check=POSITIVE)
    dense_layers: int = option(2, "The first layers attend to every token.", check=NON_NEGATIVE)


class QuestStrategy(SelectionStrategy):
    """Top pages by their key-bound score; every token of a chosen page is attended (options: `QuestOptions`)."""

    name = "quest"
    Options = QuestOptions

    @classmethod
    def build_artifacts(
        cls, ckv: ContextKV, options: dict | None = None, progress: Callable[[int, int], None] | None = None
    ) -> None:
        opts = cls.parse_options(options).build_values()
        d = start_artifacts(ckv.path, cls.name)
        files = []
        with writing(d, cls.name):
            for layer in range(ckv.n_layers):
                mins, maxs = page_bounds(ckv.keys[layer], opts["page_size"])
                for tag, t in (("min", mins), ("max", maxs)):
                    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # bf16 has no numpy dtype
                    files.append(d / f"{tag}.{layer:03d}.bin")
                    write_file(files[-1], raw.contiguous().numpy().reshape(-1).view(np.uint8).data)
                if progress:
                    progress(layer + 1, ckv.n_layers)
            write_done(d, files, {"options": dict(opts, dtype=dtype_name(ckv.dtype))}, ckv.cache_id)

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        built = ensure_artifacts(
            self.ckv,
            self.name,
            self.options.given_build_values(),
            lambda: self.build_artifacts(self.ckv, self.options, progress),
        )
        self.page_size = int(built["page_size"])
        self.dense_layers = self.options.dense_layers
        d = artifact_dir(self.ckv.path, self.name)
        n_pages = -(-self.ckv.n_tokens // self.page_size)
        shape = (self.ckv.n_kv_heads, n_pages, self.ckv.head_dim)

        def load(rel: Path) -> torch.Tensor:
            arr = np.memmap(rel, dtype=numpy_storage(built["dtype"]), mode="r", shape=shape)
            return as_torch(arr, built["dtype"])

        self.mins = [load(d / f"min.{layer:03d}.bin") for layer in range(self.ckv.n_layers)]
        self.maxs = [load(d / f"max.{layer:03d}.bin") for layer in range(self.ckv.n_layers)]
        # Pages overlapping the searchable range [lo, hi); the last of them is always attended.
        self.p_lo, self.p_hi = self.lo // self.page_size, -(-self.hi // self.page_size)

    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        S = self.page_size
        n_pages = max(1, k // S)
        if layer < self.dense_layers or k >= self.n_searchable or n_pages >= self.p_hi - self.p_lo:
            return self.all_tokens(q, layer)
        self.stats.searches += 1
        mins = self.mins[layer][:, self.p_lo : self.p_hi - 1]  # (Hkv, P', D), last page apart
        maxs = self.maxs[layer][:, self.p_lo : self.p_hi - 1]
        top = page_scores(q, mins, maxs).topk(n_pages - 1, dim=-1).indices + self.p_lo  # (Hkv, Q, n-1)
        last = torch.full((*top.shape[:2], 1), self.p_hi - 1, dtype=torch.int64)
        pages = torch.cat([top, last], dim=-1)  # (Hkv, Q, n_pages)
        ids = (pages.unsqueeze(-1) * S + torch.arange(S)).flatten(2)  # (Hkv, Q, n_pages·S)
        ids = torch.where((ids >= self.lo) & (ids < self.hi), ids, -1)
        scores = exact_scores(self.ckv.keys[layer], q, ids)  # (Hkv, Q, K)
        return Selection(ids=ids, scores=scores)
