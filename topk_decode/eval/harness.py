"""`run_eval`: task accuracy and fidelity of top-k decoding against dense attention, same instances.

Per seeded task instance (task × length × depth × seed):
  1. prefill the context once into a cache directory (`build_cache` on a one-file document, whose
     layout is exactly `[bos] + tokenize(context)`: checked, not assumed);
  2. dense reference: the HF model over context + question with its own full KV cache, greedy;
  3. per strategy (one opened store) and per k: teacher-forced top-k decoding on the dense tokens,
     with the decoder's observer measuring attention fidelity at every layer and step, and the
     logits compared with dense (KL, greedy agreement); the answer is checked on the free-running
     generation (identical to dense when every teacher-forced argmax agreed, else decoded anew).
"""

from __future__ import annotations

import datetime
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from topk_decode.api import KVStore
from topk_decode.config import DecodeConfig
from topk_decode.errors import TopkError
from topk_decode.eval.metrics import dense_reference, is_correct
from topk_decode.eval.runs import (  # noqa: F401 - re-exported
    InstanceResult,
    LoadedModel,
    RunResult,
    method_name,
    resolve_k,
    run_budgets,
    run_one,
    split_variant,
    strategy_options,
    variant_label,
)
from topk_decode.index import check_requested_strategy, split_options
from topk_decode.index.auto import AUTO
from topk_decode.model.loading import eos_token_ids, load_model, load_tokenizer, model_fingerprint
from topk_decode.prefill.build import build_cache, parse_dtype, pick_device
from topk_decode.store.cache_dir import open_cache


@dataclass
class EvalConfig:
    """What to evaluate.

    Args:
        model: checkpoint directory (default: the shipped demo model).
        tasks: task names of `topk_decode.eval.tasks.TASKS` (demo filler, one prefill per instance) or
            `topk_decode.eval.realtext.REAL_TASKS` (Python's documentation, one prefill per length and
            seed serving every real task's questions).
        lengths: context lengths in tokens.
        depths: depths of the asked fact, in [0, 1].
        seeds: instances per (task, length, depth), seeded first_seed, first_seed+1, ...; for the real
            tasks, contexts per length.
        first_seed: the first instance seed.
        strategies: selection strategies to compare with dense.
        ks: retrieval budgets per query head and layer: ints, or "x%" strings for a share of the
            context's tokens (resolved per context, `resolve_k`).
        k_schedules: per-layer budget schedules to compare ("uniform", "linear": same total k·L).
        fidelity_steps: teacher-forced decode steps measured per run (at least the answer's length
            is always decoded); 0 turns the per-layer attention metrics off (KL/agreement stay).
            Real tasks decode every question's full answer budget (KL and agreement on every step)
            and measure the attention metrics on the first `fidelity_steps` steps (prompt step included).
        device, dtype: compute device / dtype for prefill, dense and top-k (default: CUDA+bf16 if
            available, else CPU+fp32).
        n_sink, n_tail: exact window of the top-k decoder (as `KVStore.open`).
        strategy_options: options passed to every strategy; a key "name.option" goes to strategy
            `name` only (e.g. "duo.pattern").
        questions: questions per real task in each context.
        chunk_size: prefill chunk length.
        work_dir: where the temporary caches go (default: the system temp dir).
        keep_dir: real tasks only: keep each context's cache (and the dense answers) in a folder under
            this directory and reuse it in later runs with the same model, context, device and dtype
            (default: None, a temporary cache per run).
        docs: a documents folder or file: fidelity only, on these documents and `question` (laid out
            as `topk prefill` and `topk chat` do) instead of the tasks.
        question: the question asked about `docs`.
    """

    model: str | None = None
    tasks: list[str] = field(default_factory=lambda: ["single_needle"])
    lengths: list[int] = field(default_factory=lambda: [4096])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    seeds: int = 1
    first_seed: int = 0
    strategies: list[str] = field(default_factory=lambda: [AUTO])
    ks: list[int | str] = field(default_factory=lambda: [1, 4, 16, 64, 256, 1024])
    k_schedules: list[str] = field(default_factory=lambda: ["uniform"])
    fidelity_steps: int = 8
    device: str | None = None
    dtype: str | None = None
    n_sink: int = DecodeConfig.n_sink
    n_tail: int = DecodeConfig.n_tail
    strategy_options: dict = field(default_factory=dict)
    chunk_size: int = 4096
    work_dir: str | None = None
    keep_dir: str | None = None
    docs: str | None = None
    question: str = "What are these documents about?"
    questions: int = 2

    def validate(self) -> None:
        """Raise TopkError for settings that make no sense."""
        from topk_decode.eval.realtext import REAL_TASKS
        from topk_decode.eval.tasks import TASKS

        for t in self.tasks:
            if t not in TASKS and t not in REAL_TASKS:
                raise TopkError(f"unknown task {t!r} (available: {', '.join(TASKS + REAL_TASKS)})")
        for s in self.strategies:
            check_requested_strategy(split_variant(s)[0])
        check_plain_options(self)  # unknown options fail early
        if self.docs is not None and not self.question.strip():
            raise TopkError("--question must not be empty")
        if not self.tasks or not self.lengths or not self.depths or not self.strategies or not self.ks:
            raise TopkError("tasks, lengths, depths, strategies and k each need at least one value")
        if any(n <= 0 for n in self.lengths):
            raise TopkError(f"lengths must be positive, got {self.lengths}")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise TopkError(f"depths must be in [0, 1], got {self.depths}")
        from topk_decode.index.schedule import SCHEDULES

        for sch in self.k_schedules:
            if sch not in SCHEDULES:
                raise TopkError(f"unknown k schedule {sch!r} (available: {', '.join(SCHEDULES)})")
        for k in self.ks:
            resolve_k(k, 1)  # raises on a bad value
        if self.questions < 1:
            raise TopkError(f"--questions must be at least 1, got {self.questions}")
        if self.seeds < 1:
            raise TopkError(f"--seeds must be at least 1, got {self.seeds}")
        if self.fidelity_steps < 0:
            raise TopkError(f"--fidelity-steps must be ≥ 0, got {self.fidelity_steps}")


def check_plain_options(cfg: EvalConfig) -> None:
    """Raise TopkError for a plain option (no "strategy." prefix) that none of the named strategies has;
    `auto` resolves per context, so it takes only "auto."-prefixed options."""
    named = [name for name in (split_variant(s)[0] for s in cfg.strategies) if name != AUTO]
    if named:
        split_options(named, {k: v for k, v in cfg.strategy_options.items() if "." not in k})


@dataclass
class EvalResult:
    """Everything `run_eval` measured, JSON-ready through `to_dict`."""

    config: dict
    environment: dict
    instances: list[InstanceResult] = field(default_factory=list)
    contexts: list[dict] = field(default_factory=list)  # real tasks: one entry per prefilled context

    def to_dict(self) -> dict:
        """Plain dict: config, environment, per-instance results and the aggregated summary."""
        from topk_decode.eval.report import summarize

        out = {
            "config": self.config,
            "environment": self.environment,
            "summary": summarize(self),
            "instances": [asdict(i) for i in self.instances],
        }
        if self.contexts:
            out["contexts"] = self.contexts
        return out


def environment(model_dir: Path, trained: bool | None, device: torch.device) -> dict:
    """Facts needed to reproduce or compare a run: machine, versions, model, date."""
    import transformers

    try:
        import faiss

        faiss_version = faiss.__version__
    except ImportError:
        faiss_version = None

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}, "
        f"{torch.get_num_threads()} torch threads",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "faiss": faiss_version,
        "model": str(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "trained_demo_model": trained,
    }


def _answer_steps(tokenizer, answer: str) -> int:
    """Decode steps enough to produce the answer (its tokens after a space) plus one."""
    return len(tokenizer(" " + answer, add_special_tokens=False).input_ids) + 1


def _context_cache(inst, tokenizer, model_dir: Path, cfg: EvalConfig, tmp: Path) -> tuple[Path, list[int], str, float]:
    """Prefill the instance's context into tmp/cache.

    Returns the cache, its context ids, the layout and the prefill seconds. The layout is "raw" when
    the ids are exactly `[bos] + tokenize(context)` (the tasks' layout, checked here, not assumed);
    a tokenizer with a chat template makes `build_cache` open a user turn first ("template"): dense
    and top-k then both run over those same ids, so fidelity is still like for like.
    """
    doc = tmp / "context.txt"
    doc.write_text(inst.context, encoding="utf-8")
    t0 = time.perf_counter()
    # allow_long_context: dense and top-k run over the same positions, so fidelity stays like for like
    # past the model's maximum (build_cache still warns); the user picked the lengths
    cache, _ = build_cache(
        doc,
        tmp / "cache",
        model_dir,
        chunk_size=cfg.chunk_size,
        device=cfg.device,
        dtype=cfg.dtype,
        allow_long_context=True,
    )
    seconds = time.perf_counter() - t0
    ids = tokenizer(inst.context, add_special_tokens=False).input_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    expected = ([bos] if bos is not None else []) + list(ids)
    tokens = open_cache(cache, verify=False).tokens
    return cache, tokens, "raw" if tokens == expected else "template", seconds


def _eval_instance(inst, seed: int, m: LoadedModel, cfg: EvalConfig, log: Callable[[str], None]) -> InstanceResult:
    """Prefill one task instance, run dense, then every strategy and k on it; the cache is deleted after."""
    with tempfile.TemporaryDirectory(prefix="topk-eval-", dir=cfg.work_dir) as tmp:
        cache, ctx_ids, layout, prefill_s = _context_cache(inst, m.tokenizer, m.model_dir, cfg, Path(tmp))
        if layout != "raw":
            log(
                "note: the tokenizer's chat template puts the context in a user turn; dense and top-k share that layout"
            )
        prompt_ids = m.tokenizer(inst.question, add_special_tokens=False).input_ids
        head = dict(
            task=inst.task, length=inst.length, depth=inst.depth, seed=seed, layout=layout, prefill_seconds=prefill_s
        )
        return _measure(cache, ctx_ids, prompt_ids, inst.answer, head, m, cfg, log)


def _eval_documents(m: LoadedModel, cfg: EvalConfig, log: Callable[[str], None]) -> InstanceResult:
    """Fidelity only, on the user's documents and question, laid out as `topk prefill` / `topk chat` do."""
    from topk_decode.prefill.documents import PromptFormat

    with tempfile.TemporaryDirectory(prefix="topk-eval-", dir=cfg.work_dir) as tmp:
        t0 = time.perf_counter()
        cache, _ = build_cache(
            cfg.docs, Path(tmp) / "cache", m.model_dir, chunk_size=cfg.chunk_size, device=cfg.device, dtype=cfg.dtype
        )
        prefill_s = time.perf_counter() - t0
        ckv = open_cache(cache, verify=False)
        fmt = PromptFormat(**ckv.manifest.get("prompt", {"kind": "raw"}))
        prompt_ids = m.tokenizer(fmt.question_text(cfg.question, first_turn=True), add_special_tokens=False).input_ids
        head = dict(
            task="documents", length=ckv.n_tokens, depth=None, seed=None, layout=fmt.kind, prefill_seconds=prefill_s
        )
        return _measure(cache, ckv.tokens, prompt_ids, None, head, m, cfg, log)


def _measure(
    cache: Path,
    ctx_ids: list[int],
    prompt_ids: list[int],
    answer: str | None,
    head: dict,
    m: LoadedModel,
    cfg: EvalConfig,
    log: Callable[[str], None],
) -> InstanceResult:
    """Dense reference, then every strategy × schedule × k on one prefilled context."""
    tok = m.tokenizer
    answer_steps = _answer_steps(tok, answer) if answer is not None else 0
    t0 = time.perf_counter()
    dense_tokens, dense_logits = dense_reference(
        m.model, ctx_ids + prompt_ids, max(answer_steps, cfg.fidelity_steps, 1), m.eos
    )
    dense_s = time.perf_counter() - t0
    dense_text = tok.decode(dense_tokens[: answer_steps or len(dense_tokens)], skip_special_tokens=True)
    ir = InstanceResult(
        **head,
        answer=answer,
        n_context_tokens=len(ctx_ids),
        n_prompt_tokens=len(prompt_ids),
        dense_generated=dense_text,
        dense_seconds=dense_s,
        dense_correct=is_correct(dense_text, answer) if answer is not None else None,
    )
    verdict = "" if answer is None else ("correct " if ir.dense_correct else "wrong ") + f"(expected {answer!r})"
    log(
        f"{head['task']} len={head['length']} depth={head['depth']} seed={head['seed']}: {len(ctx_ids)} tokens, "
        f"dense {dense_text.strip()!r} {verdict}"
    )
    check_plain_options(cfg)
    for strategy in cfg.strategies:
        ks = run_budgets(strategy, cfg.ks, len(ctx_ids))
        shown = variant_label(strategy)
        # one store per strategy (its indices are built once); k only changes what a search returns
        dc = DecodeConfig(
            k=ks[-1][0],
            strategy=split_variant(strategy)[0],
            strategy_options=strategy_options(cfg.strategy_options, strategy),
            n_sink=cfg.n_sink,
            n_tail=cfg.n_tail,
        )
        store = KVStore(open_cache(cache, verify=False), m.model, tok, dc)
        for schedule in cfg.k_schedules:
            store.decoder.config.k_schedule = schedule
            for k, label in ks:
                run = run_one(
                    store,
                    shown,
                    schedule,
                    k,
                    prompt_ids,
                    dense_tokens,
                    dense_logits,
                    answer,
                    answer_steps,
                    cfg.fidelity_steps > 0,
                    k_label=label,
                )
                ir.runs.append(run)
                mr = "-" if run.mass_recall is None else f"{run.mass_recall:.4f}"
                verdict = "" if run.correct is None else ("correct, " if run.correct else "wrong, ")
                log(
                    f"  {method_name(shown, schedule, label or k)}: {verdict}mass recall {mr}, "
                    f"KL {run.kl_mean:.2e}, agreement {run.agreement:.2f}"
                )
        store.close()  # its search threads
        del store  # release the strategy's indices before the cache directory goes
    return ir


def run_eval(
    cfg: EvalConfig, log: Callable[[str], None] | None = None, checkpoint: Callable[[EvalResult], None] | None = None
) -> EvalResult:
    """Run dense and every (strategy, k) on the same seeded instances (or on `cfg.docs`, fidelity only).

    Args:
        cfg: what to evaluate.
        log: called with one progress line per instance and run.
        checkpoint: real tasks: called with the partial result after each strategy of each context.
    Returns:
        the EvalResult (see `EvalResult.to_dict` for the JSON layout).
    """
    from topk_decode.eval.tasks import make_instance

    cfg.validate()
    log = log or (lambda _msg: None)
    trained: bool | None = None
    if cfg.model is None:
        from topk_decode.demo import default_model_dir

        model_dir, trained = default_model_dir()
        if not trained:
            log(f"no trained demo model shipped: using random weights at {model_dir} (answers are noise)")
    else:
        model_dir = Path(cfg.model)
    device = pick_device(cfg.device)
    model = load_model(model_dir, device, parse_dtype(cfg.dtype))
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model, tokenizer)
    loaded = LoadedModel(model_dir, model, tokenizer, eos)
    result = EvalResult(config=asdict(cfg), environment=environment(model_dir, trained, device))
    if cfg.docs is not None:
        result.instances.append(_eval_documents(loaded, cfg, log))
        return result
    from topk_decode.eval.realrun import eval_suite
    from topk_decode.eval.realtext import REAL_TASKS, make_suite

    real = [t for t in cfg.tasks if t in REAL_TASKS]
    for length in cfg.lengths if real else []:
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
            try:
                suite = make_suite(real, length, seed, tokenizer, per_task=cfg.questions)
            except ValueError as e:
                raise TopkError(str(e)) from None

            def partial(done: list[InstanceResult], info: dict) -> None:
                checkpoint(
                    EvalResult(result.config, result.environment, result.instances + done, result.contexts + [info])
                )

            instances, info = eval_suite(suite, loaded, cfg, log, partial if checkpoint else None)
            result.instances += instances
            result.contexts.append(info)
    for task in [t for t in cfg.tasks if t not in REAL_TASKS]:
        for length in cfg.lengths:
            for depth in cfg.depths:
                for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
                    inst = make_instance(task, length, depth, seed, tokenizer)
                    result.instances.append(_eval_instance(inst, seed, loaded, cfg, log))
    return result
