"""One evaluated run and what it reports, shared by the demo-task harness (harness.py) and the real-text suites
(realrun.py): budgets, per-strategy options, `run_one` (teacher-forced fidelity and free-running correctness of
one (strategy, k)) and its result records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from topk_decode.api import KVStore
from topk_decode.errors import TopkError
from topk_decode.eval.metrics import FidelityObserver, is_correct, teacher_forced
from topk_decode.index import get_strategy
from topk_decode.index.auto import AUTO


def resolve_k(k: int | str, n_context: int) -> int:
    """A budget for a context of n_context tokens: an int as is, "x%" as max(1, round(x/100 · n_context)).

    Args:
        k: a positive int, or a string "x%" with 0 < x ≤ 100.
        n_context: the context's token count.
    """
    if isinstance(k, str) and k.strip().endswith("%"):
        try:
            frac = float(k.strip()[:-1]) / 100.0
        except ValueError:
            raise TopkError(f"k {k!r} is not a number or a percentage") from None
        if not 0.0 < frac <= 1.0:
            raise TopkError(f"k {k!r} must be a percentage in (0, 100]")
        return max(1, round(frac * n_context))
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise TopkError(f"k must be positive integers or percentages, got {k!r}")
    return k


def parse_budget(text: str) -> int | str:
    """One budget as written: "256" → 256, "1%" → "1%" (a percentage of each context); TopkError for anything else."""
    t = text.strip()
    try:
        k = t if t.endswith("%") else int(t)
    except ValueError:
        raise TopkError(f"k {t!r} is not an integer or a percentage such as 1%") from None
    resolve_k(k, 1)
    return k


def split_variant(spec: str) -> tuple[str, dict]:
    """A strategy with options of its own, to compare variants in one run: "routed:rank=keys:probe_fraction=0.05"
    → ("routed", {"rank": "keys", "probe_fraction": "0.05"}); a plain name → (name, {}). The key `k` is the
    variant's own budget ("flat:k=100%", the noise floor: `run_budgets`), not a strategy option."""
    name, *pairs = spec.split(":")
    own = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise TopkError(f"strategy variant {spec!r}: expected name:key=value[:key=value...]")
        own[key.strip()] = value.strip()
    return name.strip(), own


def run_budgets(spec: str, ks: list, n_context: int) -> list[tuple[int, str | None]]:
    """(k, label) for every budget a strategy or variant runs at, smallest first: the variant's own `k=` where it
    has one, else the run's `ks`; label is the budget as requested ("1%") or None for an integer."""
    own = split_variant(spec)[1].get("k")
    return sorted(
        {
            (resolve_k(k, n_context), None if isinstance(k, int) else str(k))
            for k in ([parse_budget(own)] if own else ks)
        },
        key=lambda kl: (kl[0], kl[1] or ""),
    )


def variant_label(spec: str) -> str:
    """A variant's name in tables, without its own budget: "routed:rank=keys:k=2%" → "routed:rank=keys"."""
    return ":".join(part for part in spec.split(":") if not part.strip().startswith("k="))


def strategy_options(options: dict, strategy: str) -> dict:
    """The options one strategy gets: plain keys, "strategy.key" keys addressed to it (prefix dropped), and a
    variant's own options ("routed:rank=keys", `split_variant`) last.

    Args:
        options: all strategy options of the run.
        strategy: the strategy's name or variant.
    """
    strategy, own = split_variant(strategy)
    if strategy == AUTO:  # the decoder resolves it per context; its options go to what it resolves to
        return {k.split(".", 1)[1]: v for k, v in options.items() if k.startswith(AUTO + ".")}
    cls = get_strategy(strategy)
    # plain keys go to the strategies that declare them (index.split_options checks that each belongs to one)
    out = {k: v for k, v in options.items() if "." not in k and (cls.OPTIONS is None or k in cls.OPTIONS)}
    out.update({k.split(".", 1)[1]: v for k, v in options.items() if k.startswith(strategy + ".")})
    own.pop("k", None)  # the variant's budget (split_variant)
    return cls.checked_options({**out, **own})


@dataclass
class RunResult:
    """One strategy at one k on one instance. Fidelity means are over decode steps (None if unmeasured)."""

    strategy: str
    k: int
    schedule: str
    generated: str | None  # None in documents mode (fidelity only)
    correct: bool | None
    steps: int
    agreement: float  # teacher-forced steps whose argmax equals the dense token / steps
    kl_mean: float  # nats, mean over steps of KL(dense ‖ top-k) next-token distributions
    kl_max: float
    mass_recall: float | None
    id_recall: float | None
    output_rel_error: float | None
    score_error: float | None  # max |strategy's score − exact q·k| over selected ids (should be ~0)
    layer_mass_recall: list[float] | None = None
    head_mass_recall: list[list[float]] | None = None  # (layers, query heads)
    seconds: float = 0.0
    k_label: str | None = None  # the budget as requested ("1%"), when it differs from k
    same_as_dense: bool | None = None  # the generated tokens equal dense's, token for token
    keys_read: float | None = None  # share of the searchable keys the strategy's searches read (routed)
    device_layers: int | None = None  # layers whose one-token steps ranked on the decode device (routed); None: none
    keyed_layers: int | None = None  # of those, layers scoring keys by residual codes (rank=keys, estimate_by=keys)


def method_name(strategy: str, schedule: str, k: int | str) -> str:
    """How a run is labelled in tables: "flat@16", or "flat/linear@16" for a non-uniform schedule."""
    return f"{strategy}@{k}" if schedule == "uniform" else f"{strategy}/{schedule}@{k}"


@dataclass
class InstanceResult:
    """One seeded task instance: its dense reference and every (strategy, k) run."""

    task: str  # a task name, or "documents" (fidelity on the user's documents)
    length: int
    depth: float | None
    seed: int | None
    answer: str | None
    layout: str  # "raw": [bos] + tokenize(context), as the tasks define; "template": chat prefix
    n_context_tokens: int
    n_prompt_tokens: int
    dense_generated: str
    dense_correct: bool | None
    prefill_seconds: float
    dense_seconds: float
    runs: list[RunResult] = field(default_factory=list)
    question: str | None = None  # real tasks: the question asked (several share one context)


def run_one(
    store: KVStore,
    strategy: str,
    schedule: str,
    k: int,
    prompt_ids: list[int],
    dense_tokens: list[int],
    dense_logits: torch.Tensor,
    answer: str | None,
    answer_steps: int,
    observe: bool,
    check: Callable[[str], bool] | None = None,
    k_label: str | None = None,
    observe_steps: int | None = None,
) -> RunResult:
    """Teacher-forced fidelity + free-running correctness of one (strategy, k).

    `check` judges the decoded generation (default: `is_correct` against `answer`); `k_label` is
    the budget as requested, e.g. "1%"; `observe_steps` limits the attention metrics to the first steps.
    """
    t0 = time.perf_counter()
    store.set_k(k)
    obs = FidelityObserver(store.decoder) if observe else None
    tf = teacher_forced(store.decoder, prompt_ids, dense_tokens, dense_logits, obs, observe_steps)
    n_ans = min(answer_steps, len(dense_tokens))
    if answer is None:
        gen = None  # fidelity only: no answer to check
    elif all(tf.matches[:n_ans]):
        # every step the answer needs chose the dense token from the same inputs: the free-running
        # generation is the dense one, token for token
        gen = dense_tokens[:answer_steps]
    else:
        gen = store.generate_ids(prompt_ids, answer_steps)
    text = store.tokenizer.decode(gen, skip_special_tokens=True) if gen is not None else None
    fid = obs.result() if obs is not None else None
    correct = None if answer is None or text is None else (check(text) if check else is_correct(text, answer))
    return RunResult(
        strategy=strategy,
        k=k,
        schedule=schedule,
        generated=text,
        correct=correct,
        steps=len(tf.matches),
        k_label=k_label,
        same_as_dense=None if gen is None else list(gen) == list(dense_tokens[:answer_steps]),
        agreement=sum(tf.matches) / max(len(tf.matches), 1),
        kl_mean=tf.kl_mean,
        kl_max=tf.kl_max,
        mass_recall=fid.mass_recall if fid else None,
        id_recall=fid.id_recall if fid else None,
        output_rel_error=fid.output_rel_error if fid else None,
        score_error=fid.score_error if fid else None,
        layer_mass_recall=fid.layer_mass_recall if fid else None,
        head_mass_recall=fid.head_mass_recall if fid else None,
        seconds=time.perf_counter() - t0,
    )


@dataclass
class LoadedModel:
    """The model, tokenizer and eos ids every instance shares (loaded once)."""

    model_dir: Path
    model: object
    tokenizer: object
    eos: set[int]
