"""Selection strategies: one module per strategy behind the `SelectionStrategy` interface."""

from __future__ import annotations

from topk_decode.errors import TopkError
from topk_decode.index.base import Selection, SelectionStrategy, exact_scores
from topk_decode.index.flat import FlatStrategy

STRATEGIES: dict[str, type[SelectionStrategy]] = {
    FlatStrategy.name: FlatStrategy,
}


def get_strategy(name: str) -> type[SelectionStrategy]:
    """The strategy class registered under `name`."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise TopkError(f"unknown strategy {name!r} (available: {', '.join(sorted(STRATEGIES))})") from None


__all__ = ["Selection", "SelectionStrategy", "STRATEGIES", "get_strategy", "exact_scores", "FlatStrategy"]
