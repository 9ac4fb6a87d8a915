"""The fidelity suite on the product's path: caches prefilled, stores opened as users open them, answers from `ask()`.

Every figure of this module comes from what a user runs: `KVStore.build` (the prefill), `KVStore.open(cache, ...)`
with its defaults (compile, CUDA graphs, the device placement) and one fresh `ask()`-conversation per question
(`store.session().ask`, which `ask()` is). Dense is the same path with `flat` at k = every context token (exact
attention over the whole context). Each setting is compared with dense question by question: the same text, the same
final answer (eval/paired.py `final_answer`), and whether the answer is right. A step whose logits were not finite
is counted (`recomputed`: the decoder recomputes it on the host path, decode/engine.py).

    python -m topk_decode.eval.product --model Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --lengths 16384 \\
        --seeds 0-3 --settings dense,auto,flat --out results/product
    python -m topk_decode.eval.product --merge a/product.json b/product.json --out results/all
    python -m topk_decode.eval.product ... --settings dense,quest,flat --dense-from results/dense/product.json

`--dense-from` takes dense's answers from earlier runs of the same suite (model, length, seed, context, questions, KV
dtype and RoPE scaling all equal) instead of asking dense again: settings run apart share one dense run.

`--as-budget llama-3-8b@128K:16GiB` adds the setting `auto@budget`: `auto` with the device's key codes and value
codes placed as that model's 16 GiB placement places them (`BUDGET_PLACEMENTS`), applied to this model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from topk_decode.eval.paired import final_answer, wilson
from topk_decode.eval.realtext import REAL_TASKS, make_suite
from topk_decode.index.auto import FAST, FAST_OPTIONS

# What the device placement holds for a larger model under a GPU budget, as measured by `topk bench` on the GPU host
# (docs/BENCHMARKS.md; the warning `routed: the key codes are coarsened ...`): key codes' sub-vectors and the share of
# layers with value codes. `--as-budget` applies them to the model under test.
BUDGET_PLACEMENTS = {
    "llama-3-8b@128K:16GiB": {"code_m": 16, "value_share": 1 / 32},
}
DENSE = "dense"


@dataclass
class Answer:
    """One question's answer under one setting."""

    task: str
    question: str
    truth: str
    text: str
    correct: bool
    recomputed: int = 0
    steps: int = 0


@dataclass
class Setting:
    """A named way to open the store: KVStore.open's strategy, k (None: the default; dense: every token) and options."""

    name: str
    strategy: str = "auto"
    k: int | None = None
    options: dict = field(default_factory=dict)


def parse_settings(names: list[str], k: int | None, as_budget: str | None, n_layers: int) -> list[Setting]:
    """The settings asked for by name: dense, auto, any registered strategy (at k; `name:key=value[:...]` with options
    of its own, `k=` its own k), auto@BUDGET."""
    from topk_decode.errors import TopkError
    from topk_decode.eval.runs import split_variant
    from topk_decode.index import check_requested_strategy

    out = []
    for name in names:
        if name == DENSE:
            out.append(Setting(DENSE, "flat"))
        elif name.startswith("auto@"):
            out.append(budget_setting(as_budget or name[5:], k, n_layers))
        else:  # a strategy, with options of its own where written name:key=value[:key=value] (k= its own k)
            try:
                strategy, own = split_variant(name)
                own_k = own.pop("k", None)
                out.append(Setting(name, check_requested_strategy(strategy), int(own_k) if own_k else k, own))
            except (TopkError, ValueError) as e:
                raise SystemExit(f"error: setting {name!r}: {e} (or dense, auto@BUDGET)") from None
    return out


def budget_setting(budget: str, k: int | None, n_layers: int) -> Setting:
    """`auto` placed as under `budget` (a key of BUDGET_PLACEMENTS)."""
    if budget not in BUDGET_PLACEMENTS:
        raise SystemExit(f"error: unknown budget {budget!r}; known: {', '.join(BUDGET_PLACEMENTS)}")
    p = BUDGET_PLACEMENTS[budget]
    layers = max(1, round(p["value_share"] * n_layers))
    opts = {**FAST_OPTIONS, "device_code_m": p["code_m"], "device_value_layers": layers}
    return Setting(f"auto@{budget}", FAST, k, opts)  # auto's strategy beyond its threshold, named


def ask_all(store, questions) -> list[Answer]:
    """Every question on a fresh conversation of `store`, as `store.ask` asks it."""
    out = []
    for q in questions:
        chat = store.session()
        text = chat.ask(q.question, max_new_tokens=q.max_new_tokens)
        st = chat.conv.stats
        out.append(Answer(q.task, q.question, q.answer, text, q.check(text), st.recomputed, st.steps))
    return out


def open_store(cache: Path, setting: Setting, n_tokens: int, device: str | None):
    """`KVStore.open` as the setting says (dense: flat over every context token)."""
    from topk_decode import KVStore

    k = n_tokens if setting.name == DENSE else setting.k
    kwargs = {} if k is None else {"k": k}  # None: KVStore.open's default k
    return KVStore.open(cache, strategy=setting.strategy, strategy_options=setting.options, device=device, **kwargs)


def compare(dense: list[Answer], other: list[Answer]) -> dict:
    """Paired figures of `other` against `dense`, question by question."""
    n = len(dense)
    same_text = sum(a.text == b.text for a, b in zip(dense, other))
    same_final = sum(final_answer(a.task, a.text) == final_answer(b.task, b.text) for a, b in zip(dense, other))
    lo, hi = wilson(same_final, n)
    return {
        "n": n,
        "same_text": same_text,
        "same_final": same_final,
        "same_final_pct": 100 * same_final / max(n, 1),
        "same_final_ci95": [100 * lo, 100 * hi],
        "correct": sum(b.correct for b in other),
        "dense_correct": sum(a.correct for a in dense),
        "recomputed_steps": sum(b.recomputed for b in other),
    }


def run_key(model: str, length: int, seed: int, sha: str, kv_dtype: str | None, rope_scaling: str | None) -> tuple:
    """What must be equal for two runs' dense answers to be the same run's (the checkpoint by `model_fingerprint`; their
    questions are compared too)."""
    return (model, length, seed, sha, kv_dtype, rope_scaling)


def dense_runs(paths: list[Path]) -> dict[tuple, tuple[list[dict], str]]:
    """Dense's answers in earlier product.json files by `run_key`, each with the file it came from."""
    found = {}
    for path in paths:
        results = json.loads(Path(path).read_text())
        for r in results["runs"]:
            if DENSE in r["answers"] and "model_fingerprint" in r:
                fp = r["model_fingerprint"]
                key = run_key(fp, r["length"], r["seed"], r["sha"], r.get("kv_dtype"), r.get("rope_scaling"))
                found[key] = (r["answers"][DENSE], str(path))
    return found


def run(args) -> dict:
    """Prefill one cache per (length, seed), open every setting on it, ask every question; write JSON + markdown."""
    from topk_decode.model.loading import load_tokenizer, model_fingerprint, resolve_model_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="topk-product-"))
    model_dir = resolve_model_path(args.model)
    tok = load_tokenizer(model_dir)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    settings = parse_settings(args.settings.split(","), args.k, args.as_budget, cfg.num_hidden_layers)
    if settings[0].name != DENSE:
        raise SystemExit("error: the first setting must be dense (every other one is compared with it)")
    from topk_decode.errors import TopkError

    fingerprint = model_fingerprint(model_dir)  # (a GGUF's converted directory: the GGUF's own)
    results: dict = {"model": str(args.model), "runs": []}
    reusable = dense_runs(args.dense_from or [])
    for length in [int(x) for x in args.lengths.split(",")]:
        for seed in seeds_of(args.seeds):
            suite = make_suite(args.tasks.split(","), length, seed, tok, per_task=args.per_task)
            docs, cache = work / "docs" / f"{length}_{seed}", work / "caches" / f"{length}_{seed}"
            docs.mkdir(parents=True, exist_ok=True)
            (docs / "context.txt").write_text(suite.context)
            t0 = time.perf_counter()
            _prefill(docs, cache, model_dir, args)
            prefill_s = time.perf_counter() - t0
            done = {"length": length, "seed": seed, "sha": suite.sha, "prefill_s": prefill_s, "placements": {}}
            # (no RoPE scaling is declared on this path)
            done.update(model_fingerprint=fingerprint, kv_dtype=args.kv_dtype, rope_scaling=None, answers={})
            results["runs"].append(done)
            key = run_key(fingerprint, length, seed, suite.sha, args.kv_dtype, done["rope_scaling"])
            earlier, source = reusable.get(key, (None, None))
            if earlier is not None and [a["question"] for a in earlier] == [q.question for q in suite.questions]:
                done["answers"][DENSE] = earlier  # dense asked in an earlier run of this very suite: not again
                done["placements"][DENSE] = {"reused_from": source}
                print(f"[{length} seed {seed}] dense: reused from {source}", flush=True)
            for s in settings:  # saved after every setting: a run cut short keeps what it asked
                if s.name in done["answers"]:
                    continue
                try:
                    store = open_store(cache, s, _n_tokens(cache), args.device)
                except TopkError as e:  # this setting cannot run here (a missing option, an int8 cache ...)
                    done["placements"][s.name] = {"error": str(e)}
                    print(f"[{length} seed {seed}] {s.name}: error: {e}", flush=True)
                    continue
                try:
                    t1 = time.perf_counter()
                    done["answers"][s.name] = [asdict(a) for a in ask_all(store, suite.questions)]
                    done["placements"][s.name] = {"reason": store.strategy_reason, **_placement(store)}
                    took = time.perf_counter() - t1
                    print(f"[{length} seed {seed}] {s.name}: {took:.1f} s; {done['placements'][s.name]}", flush=True)
                finally:
                    store.close()
                (out / "product.json").write_text(json.dumps(results, indent=1))
            if not args.keep_caches:
                _remove(cache)
    results["table"] = table(results, [s.name for s in settings])
    (out / "product.json").write_text(json.dumps(results, indent=1))
    text = markdown(results["table"]) + not_run(results)
    (out / "product.md").write_text(text)
    print(text)
    return results


def not_run(results: dict) -> str:
    """A line per setting that could not be opened, with why (markdown)."""
    errors = {n: p["error"] for r in results["runs"] for n, p in r.get("placements", {}).items() if "error" in p}
    return "".join(f"\nnot run: {name}: {why}\n" for name, why in errors.items())


def _prefill(docs: Path, cache: Path, model_dir: Path, args) -> None:
    from topk_decode.prefill.build import build_cache

    build_cache(docs, cache, model_dir, overwrite=True, device=args.device, kv_dtype=args.kv_dtype)


def _n_tokens(cache: Path) -> int:
    from topk_decode.store.cache_dir import open_cache

    return open_cache(cache, verify=False).n_tokens


def _placement(store) -> dict:
    """What the device placement held (layers keyed, value-coded, the key codes' halvings), where it placed any."""
    strat = store.decoder.strategy
    routes = getattr(strat, "routes", None)
    if routes is None:
        return {}
    return {
        "layers_on_device": routes.layers_on_device(),
        "keyed_layers": routes.keyed_layers(),
        "value_coded_layers": routes.value_coded_layers(),
        "code_halvings": routes.code_halvings,
        "tables": routes.values_kind,
    }


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def seeds_of(spec: str) -> list[int]:
    """ "0-3" → [0, 1, 2, 3]; "1,5" → [1, 5]."""
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def table(results: dict, names: list[str]) -> list[dict]:
    """One row per (length, setting) against dense, every seed pooled where both were asked (a run cut short has
    some settings only)."""
    rows = []
    for length in sorted({r["length"] for r in results["runs"]}):
        runs = [r for r in results["runs"] if r["length"] == length]
        for name in names[1:]:
            both = [r for r in runs if DENSE in r["answers"] and name in r["answers"]]
            if both:
                dense = [Answer(**a) for r in both for a in r["answers"][DENSE]]
                other = [Answer(**a) for r in both for a in r["answers"][name]]
                rows.append({"length": length, "setting": name, **compare(dense, other)})
    return rows


def markdown(rows: list[dict]) -> str:
    """The table as markdown."""
    head = "| length | setting | n | same final answer as dense (95 % CI) | same text | right (dense) | recomputed |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["same_final_ci95"]
        lines.append(
            f"| {r['length']:,} | {r['setting']} | {r['n']} | {r['same_final']}/{r['n']} = {r['same_final_pct']:.1f} % "
            f"({lo:.1f}–{hi:.1f}) | {r['same_text']} | {r['correct']} ({r['dense_correct']}) | "
            f"{r['recomputed_steps']} |"
        )
    return "\n".join(lines) + "\n"


def merged(paths: list[Path]) -> dict:
    """The runs of several product.json files (suites run apart: other lengths, seeds or hosts) as one result."""
    runs = [r for p in paths for r in json.loads(Path(p).read_text())["runs"]]
    names = list(dict.fromkeys(name for r in runs for name in r["answers"]))
    if DENSE not in names:
        raise SystemExit("error: no dense answers in these files: nothing to compare with")
    results = {"model": ", ".join(sorted({json.loads(Path(p).read_text())["model"] for p in paths})), "runs": runs}
    results["table"] = table(results, [DENSE] + [n for n in names if n != DENSE])
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--merge", nargs="+", default=None, metavar="JSON", help="table the runs of these product.json files"
    )
    p.add_argument("--model", help="HF checkpoint directory or GGUF file")
    p.add_argument("--lengths", default="16384", help="context lengths in tokens, comma-separated")
    p.add_argument("--seeds", default="0", help="suite seeds: 0-3 or 1,5")
    p.add_argument("--tasks", default=",".join(REAL_TASKS), help="real-text tasks (eval/realtext.py)")
    p.add_argument("--per-task", type=int, default=6, help="questions per task and context")
    p.add_argument(
        "--settings",
        default="dense,auto,flat",
        help="dense first, then auto, any strategy (flat, routed, quest, ...; name:key=value for its options), "
        "auto@BUDGET",
    )
    p.add_argument("--k", type=int, default=None, help="k of every setting but dense (default: KVStore.open's)")
    p.add_argument("--as-budget", default=None, help=f"add auto placed as under: {', '.join(BUDGET_PLACEMENTS)}")
    p.add_argument("--kv-dtype", default=None, help="int8: prefill the KV in 8 bits")
    p.add_argument("--device", default=None, help="cuda or cpu (default: CUDA when available)")
    p.add_argument("--work", default=None, help="where the documents and caches go (default: a temporary folder)")
    p.add_argument("--keep-caches", action="store_true", help="keep the prefilled caches under WORK/caches")
    p.add_argument(
        "--dense-from",
        nargs="+",
        default=None,
        metavar="JSON",
        help="dense's answers from these product.json files where they ran the same suite (model, length, seed, "
        "questions, KV dtype, RoPE scaling): dense is not asked again there",
    )
    p.add_argument("--out", required=True, help="results folder: product.json and product.md")
    args = p.parse_args(argv)
    if args.merge:
        results = merged([Path(x) for x in args.merge])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "product.json").write_text(json.dumps(results, indent=1))
        text = markdown(results["table"]) + not_run(results)
        (out / "product.md").write_text(text)
        print(text)
        return 0
    if not args.model:
        p.error("--model is required (or --merge)")
    if args.as_budget and not any(s.startswith("auto@") for s in args.settings.split(",")):
        args.settings += f",auto@{args.as_budget}"
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
