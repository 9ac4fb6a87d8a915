"""Per-layer retrieval budgets: uniform, or the seed paper's linearly increasing ("adaptive") schedule.

Both schedules spend the same total budget Σ_l k_l = k·L, so they compare at equal cost.
"""

from __future__ import annotations

from functools import lru_cache

from topk_decode.errors import TopkError

SCHEDULES = ("uniform", "linear")


@lru_cache(maxsize=64)
def _linear(k: int, n_layers: int) -> tuple[int, ...]:
    # Weights l+1 (layer 0 gets the least, the last layer the most), scaled to total k·L and rounded
    # by largest remainder so the integer budgets sum exactly to k·L.
    total = k * n_layers
    weights = [l + 1 for l in range(n_layers)]
    ideal = [total * w / sum(weights) for w in weights]
    out = [int(x) for x in ideal]
    by_remainder = sorted(range(n_layers), key=lambda l: ideal[l] - out[l], reverse=True)
    for l in by_remainder[: total - sum(out)]:
        out[l] += 1
    # Every layer retrieves at least one token: take it from the largest budgets.
    for l in range(n_layers):
        while out[l] < 1:
            out[max(range(n_layers), key=lambda j: out[j])] -= 1
            out[l] += 1
    return tuple(out)


def k_schedule(kind: str, k: int, n_layers: int) -> list[int]:
    """Per-layer budgets of a schedule.

    Args:
        kind: "uniform" (k everywhere) or "linear" (increasing with depth, k_l ∝ l+1).
        k: the mean budget per layer.
        n_layers: number of layers.
    Returns:
        n_layers positive integers summing to k·n_layers.
    """
    if kind not in SCHEDULES:
        raise TopkError(f"unknown k schedule {kind!r} (use {' or '.join(SCHEDULES)})")
    if k <= 0 or n_layers <= 0:
        raise TopkError(f"k and the number of layers must be positive, got k={k}, layers={n_layers}")
    if kind == "uniform":
        return [k] * n_layers
    return list(_linear(k, n_layers))
