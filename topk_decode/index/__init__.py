"""Selection strategies: one module per strategy behind the `SelectionStrategy` interface."""

from __future__ import annotations

from topk_decode.errors import TopkError
from topk_decode.index.base import Selection, SelectionStrategy, artifact_dir, artifacts_complete, exact_scores
from topk_decode.index.flat import FlatStrategy
from topk_decode.index.ann import HnswStrategy, IvfStrategy
from topk_decode.index.quest import QuestStrategy
from topk_decode.index.tokenselect import TokenSelectStrategy
from topk_decode.index.duo import DuoStrategy
from topk_decode.index.routed import RoutedStrategy

STRATEGIES: dict[str, type[SelectionStrategy]] = {
    FlatStrategy.name: FlatStrategy,
    IvfStrategy.name: IvfStrategy,
    HnswStrategy.name: HnswStrategy,
    QuestStrategy.name: QuestStrategy,
    TokenSelectStrategy.name: TokenSelectStrategy,
    DuoStrategy.name: DuoStrategy,
    RoutedStrategy.name: RoutedStrategy,
}


def get_strategy(name: str) -> type[SelectionStrategy]:
    """The strategy class registered under `name`."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise TopkError(f"unknown strategy {name!r} (available: {', '.join(sorted(STRATEGIES))})") from None


def prepare_artifacts(ckv, names: list[str], options: dict | None = None, progress=None) -> None:
    """Build and save in the cache directory what the named strategies need (`topk prefill --strategy`).

    Args:
        ckv: the opened cache (`topk_decode.store.open_cache`).
        names: strategy names.
        options: strategy options (e.g. {"nlist": 1024}).
        progress: callback(done, total).
    """
    for name in names:
        get_strategy(name).build_artifacts(ckv, options, progress)


__all__ = ["prepare_artifacts", "artifact_dir", "artifacts_complete", "Selection", "SelectionStrategy", "STRATEGIES", "get_strategy", "exact_scores", "FlatStrategy"]
