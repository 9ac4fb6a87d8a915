"""`auto`, the default strategy: exact `flat` on short contexts, routed with `rank=keys` and value codes beyond on
a GPU.

The choice depends on the cache's length and on whether decoding runs on a GPU: `rank=keys` ranks every key
by its residual code inside the captured one-token step on the device; on a CPU its torch path does flat's work
and more, so a CPU decodes with the exact scan at every length. `topk prefill` builds what the GPU's choice needs
(the decode machine is not known then), so the first question does not wait for a build. The threshold and the
fidelity behind it are in docs/STRATEGIES.md, "auto: which strategy runs".

    >>> choose(3_475).strategy, choose(200_000).strategy, choose(200_000).options, choose(200_000, gpu=False).strategy
    ('flat', 'routed', {'rank': 'keys', 'pq_values': 32}, 'flat')
"""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO = "auto"
EXACT_MAX_TOKENS = 8_192  # at most this many context tokens: flat (exact top-k); more, on a GPU: routed rank=keys
FAST = "routed"
# per-key ranking by 4-bit key codes of one dimension per sub-vector (rank=keys' default pq_m, 32 bytes per key at
# D ≥ 64), and each unread key's value as its cluster's mean + a 4-bit code of its residual (16 bytes per key; at most
# D/2 sub-vectors): together, the setting that kept dense's answer most often on the suite
# (docs/history/eval-2026-11.md)
FAST_OPTIONS = {"rank": "keys", "pq_values": 32}
EXACT = "flat"


@dataclass(frozen=True)
class AutoChoice:
    """The strategy `auto` runs for a cache, its options, and why (shown by `topk info` and `/show`)."""

    strategy: str
    reason: str
    options: dict = field(default_factory=dict)


def choose(n_tokens: int, gpu: bool = True) -> AutoChoice:
    """The strategy `auto` picks for a context of `n_tokens` tokens decoded on a GPU (`gpu`) or a CPU. The same for
    an int8 cache: flat and routed read it as stored, and routed on int8 gave dense's answer as often as on the float
    KV (docs/history/eval-2026-11.md "routed on int8")."""
    if n_tokens <= EXACT_MAX_TOKENS:
        return AutoChoice(EXACT, f"auto: {n_tokens:,} context tokens ≤ {EXACT_MAX_TOKENS:,}, the exact scan is cheap")
    if not gpu:
        return AutoChoice(
            EXACT,
            f"auto: {n_tokens:,} context tokens, decoded on a CPU: the exact scan (routed rank=keys ranks every key on "
            "a GPU; --strategy routed is faster here and gives dense's answer less often)",
        )
    return AutoChoice(
        FAST,
        f"auto: {n_tokens:,} context tokens > {EXACT_MAX_TOKENS:,}, routed rank=keys with value codes reads ~4 % of "
        "the keys per step (at most max_read_per_k·k per head where it ranks keys) and gives dense's answer more often "
        "than exact top-k at the same k (docs/history/eval-2026-11.md)",
        dict(FAST_OPTIONS),
    )


def resolve(name: str, n_tokens: int, gpu: bool = True) -> AutoChoice:
    """A requested strategy name as it will run: `auto` resolved for this context and device, any other as is."""
    if name == AUTO:
        return choose(n_tokens, gpu)
    return AutoChoice(name, "chosen by the user")
