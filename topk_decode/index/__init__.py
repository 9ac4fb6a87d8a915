"""Selection strategies: one module per strategy behind the `SelectionStrategy` interface.

The registry names each strategy's module and class; a class (and with it torch, faiss, numba) is
imported on first use, so `topk --help`, `topk info` and error messages start without them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from topk_decode.errors import TopkError
from topk_decode.index.artifacts import artifact_dir, artifacts_complete

# name → (module, class, keeps files in the cache: overrides `build_artifacts`, reads int8 caches: "int8" in its
# `kv_dtypes`); a test checks both flags against the class, so `topk info` can tell ready strategies without
# importing them
_REGISTRY = {
    "flat": ("topk_decode.index.flat.strategy", "FlatStrategy", False, True),
    "ivf": ("topk_decode.index.ann", "IvfStrategy", True, False),
    "hnsw": ("topk_decode.index.ann", "HnswStrategy", True, False),
    "quest": ("topk_decode.index.quest", "QuestStrategy", True, False),
    "tokenselect": ("topk_decode.index.tokenselect", "TokenSelectStrategy", False, False),
    "duo": ("topk_decode.index.duo", "DuoStrategy", True, False),
    "routed": ("topk_decode.index.routed.strategy", "RoutedStrategy", True, True),
}


class StrategyRegistry(Mapping):
    """Strategy name → class, importing a class's module only when the class is looked up."""

    def __getitem__(self, name: str):
        module, cls = _REGISTRY[name][:2]
        return getattr(importlib.import_module(module), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(_REGISTRY)

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY


STRATEGIES = StrategyRegistry()


def check_strategy_name(name: str) -> str:
    """`name` when a strategy is registered under it, else TopkError naming the available ones (no import)."""
    if name not in _REGISTRY:
        raise TopkError(f"unknown strategy {name!r} (available: auto, {', '.join(sorted(_REGISTRY))})")
    return name


def check_requested_strategy(name: str) -> str:
    """`name` when a user may ask for it: "auto" (resolved per cache by the decoder) or a registered
    strategy, else TopkError naming the choices (no import)."""
    from topk_decode.index.auto import AUTO

    return name if name == AUTO else check_strategy_name(name)


def keeps_artifacts(name: str) -> bool:
    """True when strategy `name` keeps files in the cache (`index/NAME/`), without importing it."""
    return _REGISTRY[check_strategy_name(name)][2]


def reads_int8(name: str) -> bool:
    """True when strategy `name` decodes caches of `--kv-dtype int8`, without importing it."""
    return _REGISTRY[check_strategy_name(name)][3]


def get_strategy(name: str):
    """The strategy class registered under `name`."""
    return STRATEGIES[check_strategy_name(name)]


def __getattr__(name: str):
    # The interface and flat's class, imported on first use like the strategies (they need torch).
    if name in (
        "Selection",
        "SelectionStrategy",
        "FusedAttention",
        "DeviceStage",
        "DeviceStaged",
        "FusedAttention",
        "DeviceStage",
        "DeviceStaged",
        "exact_scores",
    ):
        from topk_decode.index import base

        return getattr(base, name)
    if name == "FlatStrategy":
        return get_strategy("flat")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def split_options(names: list[str], options: dict | None) -> dict:
    """Options given once for several strategies (`--strategy ivf,hnsw --opt nlist=64`), split per strategy.

    Every option must belong to at least one of the strategies (else TopkError with the valid names);
    each strategy gets only its own, parsed into its options dataclass (index/options.py).

    Args:
        names: strategy names.
        options: the options as given.
    Returns:
        strategy name → its parsed options (`SelectionStrategy.Options`).
    """
    options = dict(options or {})
    classes = [get_strategy(n) for n in names]
    if len(classes) == 1:
        return {names[0]: classes[0].parse_options(options)}
    known = set().union(*[set(c.OPTIONS) for c in classes])
    unknown = sorted(set(options) - known)
    if unknown:
        raise TopkError(
            f"unknown option {unknown[0]!r} for strategies {', '.join(names)} "
            f"(valid options: {', '.join(sorted(known)) or 'none'})"
        )
    return {n: c.parse_options({k: v for k, v in options.items() if k in c.OPTIONS}) for n, c in zip(names, classes)}


def prepare_artifacts(ckv, names: list[str], options=None, progress=None) -> None:
    """Build and save in the cache directory what the named strategies need (`topk prefill --strategy`).

    Args:
        ckv: the opened cache (`topk_decode.store.open_cache`).
        names: strategy names.
        options: strategy options (e.g. {"nlist": 1024}), split between the strategies (`split_options`), or
            one strategy's parsed options.
        progress: callback(done, total).
    """
    from topk_decode.index.options import StrategyOptions

    # one strategy's options already parsed (`split_options`' values) go to it as they are
    parsed = {names[0]: options} if isinstance(options, StrategyOptions) and len(names) == 1 else None
    for name, opts in (parsed or split_options(names, options)).items():
        cls = get_strategy(name)
        cls.check_kv_dtype(ckv.manifest["kv_dtype"])
        cls.build_artifacts(ckv, opts, progress)


__all__ = [
    "prepare_artifacts",
    "split_options",
    "artifact_dir",
    "artifacts_complete",
    "Selection",
    "SelectionStrategy",
    "FusedAttention",
    "DeviceStage",
    "DeviceStaged",
    "STRATEGIES",
    "StrategyRegistry",
    "check_requested_strategy",
    "check_strategy_name",
    "keeps_artifacts",
    "get_strategy",
    "exact_scores",
    "FlatStrategy",
]
