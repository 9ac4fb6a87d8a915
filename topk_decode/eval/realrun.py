"""Running a real-text suite (`topk_decode/eval/realtext.py`): one prefill, many questions.

Per suite:
  1. the context is written to one document and prefilled once with `build_cache` (the product
     path, chat template included: questions go through the cache's prompt format, as `store.ask`);
  2. dense reference per question: the HF model with full attention over the *stored* context KV
     (a fresh `DynamicCache` per question holding the cache's keys and values, then the prompt and
     greedy decoding), so the context is never prefilled twice; tests/test_realtext.py checks it
     against the HF model run over context + prompt from scratch;
  3. per strategy (its indices built once for all questions) × schedule × k: every question on a
     fresh conversation, teacher-forced for fidelity and free-running for the answer, through the
     harness's `run_one` (same metrics and observer as the demo tasks). A variant with `kv=int8`
     ("routed:rank=keys:kv=int8", `kv_variant`) decodes the same prefill stored as `topk prefill --kv-dtype int8`
     stores it (an in-RAM copy), against the same full-precision dense answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from topk_decode.api import KVStore
from topk_decode.config import DecodeConfig
from topk_decode.errors import TopkError
from topk_decode.eval.realtext import RealSuite
from topk_decode.eval.runs import (
    InstanceResult,
    LoadedModel,
    method_name,
    run_budgets,
    run_one,
    split_variant,
    strategy_options,
    variant_label,
)
from topk_decode.prefill.build import build_cache
from topk_decode.prefill.documents import PromptFormat
from topk_decode.store.cache_dir import ContextKV, open_cache
from topk_decode.store.format import QUANTIZED


class DenseContext:
    """Dense attention over a stored context: HF greedy decoding on a cache that holds the context KV.

    Args:
        model: the HF causal LM.
        ckv: the opened cache (its keys/values are copied to the model's device and dtype once).
    """

    def __init__(self, model, ckv: ContextKV) -> None:
        p = next(model.parameters())
        self.model = model
        # (1, Hkv, N, D) per layer, as the HF cache holds them
        self.kv = [
            (ckv.keys[i][None].to(p.device, p.dtype), ckv.values[i][None].to(p.device, p.dtype))
            for i in range(ckv.n_layers)
        ]

    def _cache(self):
        from transformers import DynamicCache

        try:
            c = DynamicCache(config=self.model.config)
        except TypeError:  # transformers versions whose DynamicCache takes no config
            c = DynamicCache()
        for i, (k, v) in enumerate(self.kv):
            c.update(k, v, i)  # the first update keeps the tensors; later steps concatenate copies
        return c

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], n_steps: int, eos_ids: set[int]) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding after context + prompt, as `metrics.dense_reference` but on the stored context.

        Args:
            prompt_ids: tokens after the context.
            n_steps: at most this many generated tokens (stops after an eos, which is kept).
            eos_ids: token ids that end generation.
        Returns:
            the generated tokens and the (steps, V) fp32 CPU logits each was chosen from.
        """
        dev = self.kv[0][0].device
        cache = self._cache()
        out = self.model(
            input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        tokens: list[int] = []
        logits: list[torch.Tensor] = []
        for _ in range(n_steps):
            step = out.logits[0, -1].float().cpu()  # (V,)
            tok = int(torch.argmax(step))
            tokens.append(tok)
            logits.append(step)
            if tok in eos_ids or len(tokens) == n_steps:
                break
            out = self.model(
                input_ids=torch.tensor([[tok]], device=dev), past_key_values=out.past_key_values, use_cache=True
            )
        return tokens, torch.stack(logits)


_DENSE_FILE = "dense_refs.pt"


def kv_variant(spec: str) -> tuple[str, str | None]:
    """A strategy variant without its `kv=` key, and that KV format (None: the cache as prefilled):
    "routed:rank=keys:kv=int8" → ("routed:rank=keys", "int8")."""
    name, own = split_variant(spec)
    kv = own.pop("kv", None)
    if kv not in (None, QUANTIZED):
        raise TopkError(f"strategy variant {spec!r}: kv must be {QUANTIZED}")
    return ":".join([name, *(f"{k}={v}" for k, v in own.items())]), kv


def int8_copy(ckv: ContextKV) -> ContextKV:
    """An in-RAM copy of a context's KV as `topk prefill --kv-dtype int8` stores it (the cache itself untouched)."""
    from topk_decode.store.quant import quantize_context

    return quantize_context(
        dataclasses.replace(ckv, path=Path("<memory>"), keys=list(ckv.keys), values=list(ckv.values))
    )


@contextlib.contextmanager
def _suite_dir(suite: RealSuite, m: LoadedModel, cfg) -> Iterator[tuple[str, bool]]:
    """Where a suite's cache lives: a temporary directory, or with `cfg.keep_dir` a kept one that later
    runs on the same (model, context, dtype) reuse, prefill and dense answers included.

    Yields:
        the directory and whether it is kept.
    """
    if not cfg.keep_dir:
        with tempfile.TemporaryDirectory(prefix="topk-eval-", dir=cfg.work_dir) as tmp:
            yield tmp, False
        return
    d = (
        Path(cfg.keep_dir)
        / f"{Path(m.model_dir).name}_{suite.length}_{suite.seed}_{suite.sha}_{cfg.device}_{cfg.dtype}"
    )
    d.mkdir(parents=True, exist_ok=True)
    yield str(d), True


def _load_dense(d: Path) -> dict:
    """Dense references kept by an earlier run in `d`: (task, question, steps) → (tokens, logits)."""
    f = d / _DENSE_FILE
    return torch.load(f) if f.is_file() else {}


def _means(runs: list) -> str:
    """A progress summary of one (strategy, k) over the questions (the JSON has every value)."""

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    return (
        f"mass recall {mean([r.mass_recall for r in runs]):.4f}, id recall {mean([r.id_recall for r in runs]):.4f}, "
        f"KL {mean([r.kl_mean for r in runs]):.2e} (max {max(r.kl_max for r in runs):.2e}), "
        f"agreement {mean([r.agreement for r in runs]):.3f}, {sum(r.seconds for r in runs):.0f} s"
    )


def eval_suite(
    suite: RealSuite,
    m: LoadedModel,
    cfg,
    log: Callable[[str], None],
    checkpoint: Callable[[list[InstanceResult], dict], None] | None = None,
) -> tuple[list[InstanceResult], dict]:
    """Prefill one suite, answer every question densely, then with every strategy × schedule × k.

    Args:
        suite: the context and its questions.
        m: the loaded model and tokenizer.
        cfg: the EvalConfig (strategies, ks, schedules, device, window, options).
        log: progress lines.
        checkpoint: called with the results so far and the context's info after each strategy (a long
            run keeps what it measured if it is stopped).
    Returns:
        one InstanceResult per question, and a dict describing the context (tokens, timings, hash).
    """
    tok = m.tokenizer
    with _suite_dir(suite, m, cfg) as (tmp, kept):
        doc = Path(tmp) / "document.txt"
        t0 = time.perf_counter()
        if kept and (Path(tmp) / "cache" / "manifest.json").is_file():
            cache = Path(tmp) / "cache"
            log(f"real suite len={suite.length} seed={suite.seed}: reusing the kept prefill {cache}")
        else:
            doc.write_text(suite.context, encoding="utf-8")
            # allow_long_context: dense and top-k run over the same positions, so fidelity stays like for
            # like past the model's maximum (build_cache still warns); the user picked the lengths
            cache, _ = build_cache(
                doc,
                Path(tmp) / "cache",
                m.model_dir,
                chunk_size=cfg.chunk_size,
                device=cfg.device,
                dtype=cfg.dtype,
                allow_long_context=True,
            )
        prefill_s = time.perf_counter() - t0
        ckv = open_cache(cache, verify=False)
        n_ctx = ckv.n_tokens
        fmt = PromptFormat(**ckv.manifest.get("prompt", {"kind": "raw"}))
        log(
            f"real suite len={suite.length} seed={suite.seed}: {n_ctx} context tokens ({fmt.kind} layout), "
            f"prefill {prefill_s:.1f} s, {len(suite.questions)} questions"
        )
        dense = None
        kept_refs = _load_dense(Path(tmp)) if kept else {}
        results: list[InstanceResult] = []
        refs = []
        for q in suite.questions:
            prompt_ids = tok(fmt.question_text(q.question, first_turn=True), add_special_tokens=False).input_ids
            t1 = time.perf_counter()
            key = (q.task, q.question, max(q.max_new_tokens, 1))
            if key not in kept_refs:
                dense = dense or DenseContext(m.model, ckv)
                kept_refs[key] = dense.generate(prompt_ids, max(q.max_new_tokens, 1), m.eos)
                if kept:
                    torch.save(kept_refs, Path(tmp) / _DENSE_FILE)
            d_tokens, d_logits = kept_refs[key]
            d_text = tok.decode(d_tokens, skip_special_tokens=True)
            ir = InstanceResult(
                task=q.task,
                length=suite.length,
                depth=q.depth,
                seed=suite.seed,
                answer=q.answer,
                layout=fmt.kind,
                n_context_tokens=n_ctx,
                n_prompt_tokens=len(prompt_ids),
                dense_generated=d_text,
                dense_correct=q.check(d_text),
                prefill_seconds=prefill_s,
                dense_seconds=time.perf_counter() - t1,
                question=q.question,
            )
            log(
                f"  {q.task} depth={q.depth:.2f}: dense {d_text.strip()!r} "
                f"{'correct' if ir.dense_correct else 'wrong'} (expected {q.answer!r})"
            )
            results.append(ir)
            refs.append((q, prompt_ids, d_tokens, d_logits))
        del dense
        info = {
            "length": suite.length,
            "seed": suite.seed,
            "n_context_tokens": n_ctx,
            "layout": fmt.kind,
            "prefill_seconds": prefill_s,
            "python": suite.python,
            "context_sha": suite.sha,
            "qa_topics": suite.qa_topics,
            "questions": len(suite.questions),
        }
        int8 = None
        for spec in cfg.strategies:
            strategy, kv = kv_variant(spec)
            if kv is not None:
                int8 = int8 or int8_copy(ckv)
            ks = run_budgets(strategy, cfg.ks, n_ctx)  # a variant's own budget ("flat:k=100%") or the run's
            shown = variant_label(spec)  # its name in tables: "flat@100%", not "flat:k=100%@100%"
            t1 = time.perf_counter()
            dc = DecodeConfig(
                k=max(k for k, _ in ks),
                strategy=split_variant(strategy)[0],
                strategy_options=strategy_options(cfg.strategy_options, strategy),
                n_sink=cfg.n_sink,
                n_tail=cfg.n_tail,
                compile=False,
            )
            store = KVStore(ckv if kv is None else int8, m.model, tok, dc)
            log(f"  {spec}: opened in {time.perf_counter() - t1:.1f} s")
            for schedule in cfg.k_schedules:
                store.decoder.config.k_schedule = schedule
                for k, label in ks:
                    right = same = 0
                    runs = []
                    read_counter = getattr(store.decoder.strategy, "keys_read_fraction", None)
                    if read_counter is not None:  # count this (schedule, k) alone
                        store.decoder.strategy.stats.extra.update(keys_read=0, keys_searchable=0)
                    for (q, prompt_ids, d_tokens, d_logits), ir in zip(refs, results):
                        run = run_one(
                            store,
                            shown,
                            schedule,
                            k,
                            prompt_ids,
                            d_tokens,
                            d_logits,
                            q.answer,
                            q.max_new_tokens,
                            cfg.fidelity_steps > 0,
                            check=q.check,
                            k_label=label,
                            observe_steps=cfg.fidelity_steps,
                        )
                        ir.runs.append(run)
                        runs.append(run)
                        right += bool(run.correct)
                        same += bool(run.same_as_dense)
                    read = read_counter() if read_counter is not None else None
                    seg = store.decoder.segments
                    routes = seg.routes if seg is not None else None  # which path the one-token steps took
                    on_device = (None, None) if routes is None else (routes.layers_on_device(), routes.keyed_layers())
                    for run in runs:
                        run.keys_read = read
                        run.device_layers, run.keyed_layers = on_device
                    log(
                        f"    {method_name(shown, schedule, label or k)} (k={k}): {right}/{len(refs)} correct, "
                        f"{same}/{len(refs)} same as dense, {_means(runs)}"
                        + ("" if read is None else f", keys read {100 * read:.2f} %")
                        + (
                            ""
                            if routes is None
                            else f", device routing on {on_device[0]} layers, per-key on {on_device[1]}"
                        )
                    )
            store.close()  # its search threads
            del store
            if checkpoint is not None:
                checkpoint(results, info)
        return results, info
