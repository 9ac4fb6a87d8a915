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
        raise TopkError(f"unknown strategy {name!r} (available: auto, {', '.join(sorted(STRATEGIES))})") from None


def keeps_artifacts(name: str) -> bool:
    """True when a strategy keeps files in the cache (its class overrides `build_artifacts`)."""
    cls = get_strategy(name)
    return getattr(cls.build_artifacts, "__func__", None) is not SelectionStrategy.build_artifacts.__func__


def split_options(names: list[str], options: dict | None) -> dict[str, dict]:
    """Options given once for several strategies (`--strategy ivf,hnsw --opt nlist=64`), split per strategy.

    Every option must belong to at least one of the strategies (else TopkError with the valid names);
    each strategy gets only its own, validated and converted (`SelectionStrategy.checked_options`).

    Args:
        names: strategy names.
        options: the options as given.
    """
    options = dict(options or {})
    classes = [get_strategy(n) for n in names]
    if len(classes) == 1:
        return {names[0]: classes[0].checked_options(options)}
    known = set().union(*[set(c.OPTIONS or options) for c in classes])
    unknown = sorted(set(options) - known)
    if unknown:
        raise TopkError(f"unknown option {unknown[0]!r} for strategies {', '.join(names)} "
                        f"(valid options: {', '.join(sorted(known)) or 'none'})")
    return {n: c.checked_options({k: v for k, v in options.items() if c.OPTIONS is None or k in c.OPTIONS})
            for n, c in zip(names, classes)}


def prepare_artifacts(ckv, names: list[str], options: dict | None = None, progress=None) -> None:
    """Build and save in the cache directory what the named strategies need (`topk prefill --strategy`).

    Args:
        ckv: the opened cache (`topk_decode.store.open_cache`).
        names: strategy names.
        options: strategy options (e.g. {"nlist": 1024}), split between the strategies (`split_options`).
        progress: callback(done, total).
    """
    for name, opts in split_options(names, options).items():
        get_strategy(name).build_artifacts(ckv, opts, progress)


__all__ = ["keeps_artifacts", "prepare_artifacts", "split_options", "artifact_dir", "artifacts_complete", "Selection", "SelectionStrategy", "STRATEGIES", "get_strategy", "exact_scores", "FlatStrategy"]
