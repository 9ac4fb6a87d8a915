"""tokenselect: one token set per layer, chosen by a soft vote of all its query heads (Wu et al. 2024).

Each query head's attention distribution over the searchable tokens (softmax of its scaled q·k)
votes for tokens; the votes are summed over every query head of the layer and the top-k of the sum
is shared by all heads (each head still gets its own exact scores). The Selection Cache skips the
search while consecutive queries are alike: per conversation and layer we keep the last searched
query and its selection, and reuse that selection while the cosine similarity of the new query to
it stays above `threshold` — only the exact scores of the reused ids are recomputed (K·D per head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from topk_decode.index.base import Selection, SelectionStrategy, exact_scores
from topk_decode.index.options import StrategyOptions, option


def soft_vote(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Sum over query heads of each head's softmax over tokens.

    Args:
        scores: (Hkv, Q, M) unscaled q·k of every query head and searchable token.
        scale: softmax temperature, 1/√D for attention.
    Returns:
        (M,) the votes; they sum to Hkv·Q.
    """
    return torch.softmax(scores * scale, dim=-1).sum(dim=(0, 1))


def scan_scores(q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int, block: int = 2048) -> torch.Tensor:
    """Exact q·k of every key in [lo, hi), scanning the keys in blocks.

    Converting 16-bit keys to fp32 block by block keeps the converted block in cache, which is
    faster than converting the whole range at once (docs/STRATEGIES.md, "tokenselect").

    Args:
        q: (Hkv, Q, D) float32 queries.
        keys: (Hkv, N, D) one layer's keys, any float dtype.
        lo, hi: the key range.
        block: keys per block.
    Returns:
        (Hkv, Q, hi - lo) float32.
    """
    out = torch.empty(q.shape[0], q.shape[1], hi - lo)
    for s in range(lo, hi, block):
        e = min(s + block, hi)
        torch.bmm(q, keys[:, s:e].float().transpose(1, 2), out=out[:, :, s - lo : e - lo])
    return out


@dataclass
class SelectionCache:
    """Per-conversation state: per layer, the last searched query (flattened) and its token ids."""

    last_q: dict[int, torch.Tensor] = field(default_factory=dict)
    last_ids: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenSelectOptions(StrategyOptions):
    """tokenselect's options."""

    threshold: float = option(
        0.9, "Cosine similarity above which the last selection is reused (a value above 1 disables the cache)."
    )


class TokenSelectStrategy(SelectionStrategy):
    """Layer-shared top-k by soft vote, with a similarity-gated selection cache (options: `TokenSelectOptions`)."""

    name = "tokenselect"
    Options = TokenSelectOptions

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None:
        self.threshold = self.options.threshold
        self.scale = self.ckv.head_dim**-0.5

    def new_state(self) -> SelectionCache:
        return SelectionCache()

    def select(self, layer: int, q: torch.Tensor, k: int, state: Any = None) -> Selection:
        if k >= self.n_searchable:
            return self.all_tokens(q, layer)
        keys = self.ckv.keys[layer]
        flat_q = q.reshape(-1)
        if state is not None and layer in state.last_q:
            prev, ids = state.last_q[layer], state.last_ids[layer]
            # Reuse only for the same query layout and budget (a multi-token prompt vs a single token).
            if prev.shape == flat_q.shape and ids.shape[0] == k:
                cos = torch.nn.functional.cosine_similarity(flat_q, prev, dim=0)
                if float(cos) >= self.threshold:
                    self.stats.reused += 1
                    self.stats.extra["hit_rate"] = self.hit_rate()
                    full = ids.expand(q.shape[0], q.shape[1], k)  # (Hkv, Q, k)
                    return Selection(ids=full, scores=exact_scores(keys, q, full), searched=False)
        self.stats.searches += 1
        self.stats.extra["hit_rate"] = self.hit_rate()
        scores = scan_scores(q, keys, self.lo, self.hi)  # (Hkv, Q, M)
        ids = soft_vote(scores, self.scale).topk(k).indices  # (k,) offsets in [lo, hi)
        full = ids.expand(q.shape[0], q.shape[1], k)
        sel = Selection(ids=full + self.lo, scores=scores.gather(2, full))
        if state is not None:
            state.last_q[layer] = flat_q.clone()
            state.last_ids[layer] = ids + self.lo
        return sel

    def hit_rate(self) -> float:
        """Fraction of selections served from the cache."""
        total = self.stats.searches + self.stats.reused
        return self.stats.reused / total if total else 0.0
