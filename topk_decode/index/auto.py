"""`auto`, the default strategy: exact `flat` where the exact scan is cheap, `routed` beyond.

The choice depends on the cache alone (its searchable tokens), so `topk prefill` can build what the
choice needs and the first question does not wait for a build. The threshold and the fidelity behind it
are in docs/STRATEGIES.md, "auto: which strategy runs".

    >>> choose(3_475).strategy, choose(200_000).strategy
    ('flat', 'routed')
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
EXACT_MAX_TOKENS = 32_768  # at most this many context tokens: flat (exact); more: routed
FAST = "routed"
EXACT = "flat"


@dataclass(frozen=True)
class AutoChoice:
    """The strategy `auto` runs for a cache, and why (shown by `topk info` and `/show`)."""

    strategy: str
    reason: str


def choose(n_tokens: int) -> AutoChoice:
    """The strategy `auto` picks for a context of `n_tokens` tokens."""
    if n_tokens <= EXACT_MAX_TOKENS:
        return AutoChoice(EXACT, f"auto: {n_tokens:,} context tokens ≤ {EXACT_MAX_TOKENS:,}, the exact scan is cheap")
    return AutoChoice(
        FAST, f"auto: {n_tokens:,} context tokens > {EXACT_MAX_TOKENS:,}, routed reads ~4 % of the keys per step"
    )


def resolve(name: str, n_tokens: int) -> AutoChoice:
    """A requested strategy name as it will run: `auto` resolved for this context, any other as is."""
    if name == AUTO:
        return choose(n_tokens)
    return AutoChoice(name, "chosen by the user")
