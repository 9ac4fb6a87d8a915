"""Measure every strategy's fidelity on a real model over real text: one model, several lengths, strategies, ks.

Runs `topk eval`'s real-text tasks (`topk_decode/eval/realtext.py`: needles, multi-key, multi-value,
variable tracking, QA over Python's documentation) with one prefill per length, dense beside every
strategy × k, and writes per length `real_<model>_<length>.json` plus one markdown table
`real_<model>.md` (accuracy vs the truth and vs dense, attention-mass / id recall, KL, agreement).

    python benchmarks/bench_fidelity.py --model /path/to/hf_dir_or.gguf --lengths 4096,16384,32768 \
        --strategies flat,ivf,hnsw,quest,duo,tokenselect,routed --k 0.5%,1%,2%,5% --out-dir real_results

- A `.gguf` model is converted to an HF checkpoint first (the package's `topk_decode.model.gguf`
  when present, else a small inline conversion needing the `gguf` and `accelerate` packages).
- Strategies not registered in this checkout (e.g. `routed` before it is merged) are skipped
  with a message; `duo` needs a pattern: `--duo-pattern PATH`, else it is calibrated on the model
  first (`--duo-steps`, 0 = skip duo).
- `--budget-minutes`: lengths run shortest first; a length whose estimated time (the previous
  length's, scaled by the length ratio) exceeds what is left is skipped with a message.
- `--suite`: the fidelity suite's settings (docs/history/eval-2026-11.md, "The fidelity suite"): every real task,
  6 questions per task in each of 4 contexts per length (120 paired questions), k = 1 %, 2 % and 4 %
  (4 % is the keys routed reads to select 1 %: every strategy at the same read), the seed strategies.
  Explicit options still override it. Besides the per-length JSON it writes `real_<model>_paired.md`:
  the paired comparison with dense (`topk_decode.eval.paired`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def convert_gguf(path: Path, out_root: Path) -> Path:
    """An HF checkpoint directory for a GGUF file (converted once, reused).

    Args:
        path: the .gguf file.
        out_root: where converted checkpoints go (one folder per file name and size).
    """
    try:
        from topk_decode.model.gguf import converted_dir  # the package's converter, when this checkout has it
    except ImportError:
        converted_dir = None
    if converted_dir is not None:
        return converted_dir(path)
    out = out_root / f"{path.stem}-{path.stat().st_size}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {path} to {out} (bf16) ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
    # a GGUF-loaded model refuses save_pretrained: rebuild it from its config and load the weights
    fresh = AutoModelForCausalLM.from_config(loaded.config).to(torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".partial")
    fresh.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def check_faiss() -> None:
    """topk_decode.index imports faiss at module level: without it no strategy (nor dense eval) can run."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        sys.exit(
            "error: faiss is not installed; topk_decode's strategies import it (every one, flat included). "
            "Carry a faiss-cpu wheel for this Python, e.g. `pip download faiss-cpu --only-binary=:all: "
            "--no-deps --python-version 3.12 -d wheels/`, and pip install it."
        )


def usable_strategies(names: list[str]) -> list[str]:
    """The requested strategies (or variants, "routed:rank=keys") registered in this checkout (others are reported
    and skipped)."""
    from topk_decode.eval.runs import split_variant
    from topk_decode.index import STRATEGIES

    out = []
    for n in names:
        if split_variant(n)[0] in STRATEGIES or n == "auto":
            out.append(n)
        else:
            print(
                f"note: strategy {n!r} is not registered in this checkout (have: {', '.join(sorted(STRATEGIES))}); "
                "skipped",
                file=sys.stderr,
            )
    return out


def duo_pattern(args, model_dir: Path, out_dir: Path) -> str | None:
    """The duo pattern: given, or calibrated now on the model (time-boxed by --duo-steps)."""
    if args.duo_pattern:
        return args.duo_pattern
    if args.duo_steps <= 0:
        return None
    from topk_decode.calibrate.duo import DuoCalibrationConfig, calibrate_duo_to_file

    out = out_dir / f"duo_{model_dir.name}.tsv"
    t0 = time.perf_counter()
    cfg = DuoCalibrationConfig(steps=args.duo_steps, length=args.duo_length, sink=args.n_sink, recent=args.n_tail)
    calibrate_duo_to_file(model_dir, out, cfg, device=args.device)
    print(
        f"duo: calibrated {args.duo_steps} steps at {args.duo_length} tokens in {time.perf_counter() - t0:.0f} s "
        f"→ {out}",
        file=sys.stderr,
    )
    return str(out)


def markdown(per_length: list[dict], model: str) -> str:
    """One table: rows (length, method); accuracy per task vs the truth, answers equal to dense, fidelity."""
    from topk_decode.eval.realtext import REAL_TASKS

    lines = []
    for data in per_length:
        summ = data["summary"]
        tasks = [t for t in REAL_TASKS if any(r["task"] == t for r in summ["accuracy"])]
        n_ctx = data["contexts"][0]["n_context_tokens"] if data.get("contexts") else "?"
        length = data["config"]["lengths"][0]
        lines += [
            f"### {model}, {length} tokens ({n_ctx} in the cache)",
            "",
            "| method | k | "
            + " | ".join(t.removeprefix("real_") for t in tasks)
            + " | all | = dense | mass recall | worst layer | id recall | KL mean | KL max | agree |",
            "|" + "---|" * (len(tasks) + 10),
        ]
        acc: dict[str, dict[str, tuple[int, int, int]]] = {}
        for r in summ["accuracy"]:
            acc.setdefault(r["method"], {})[r["task"]] = (r["correct"], r["n"], r["same_as_dense"])
        fid = {r["method"]: r for r in summ["fidelity"]}
        for method, cells in acc.items():
            c = sum(x[0] for x in cells.values())
            n = sum(x[1] for x in cells.values())
            same = sum(x[2] for x in cells.values())
            f = fid.get(method)
            ks = "—" if f is None else ",".join(map(str, f["resolved_k"]))
            row = [method, ks] + [f"{cells[t][0]}/{cells[t][1]}" if t in cells else "" for t in tasks]
            row += [f"{c}/{n}", "—" if method == "dense" else f"{same}/{n}"]
            if f is None:
                row += ["—"] * 6
            else:
                fmt = lambda x, s: "—" if x is None else format(x, s)  # noqa: E731
                row += [
                    fmt(f["mass_recall"], ".3f"),
                    fmt(f["worst_layer_mass_recall"], ".3f"),
                    fmt(f["id_recall"], ".3f"),
                    fmt(f["kl_mean"], ".2e"),
                    fmt(f["kl_max"], ".2e"),
                    fmt(f["agreement"], ".3f"),
                ]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


# The fidelity suite (docs/history/eval-2026-11.md): 12 contexts × 3 tasks × 3 questions = 108 paired questions per
# length, 9 facts per context (30 left the 0.5B model answering 26 % densely), first on held-out seeds; flat at
# k = 100 % is the measurement's noise floor; 4 % is what routed reads to select 1 % (the others at the same read).
SUITE = {
    "strategies": "flat,flat:k=100%,routed,routed:rank=keys,routed:rank=keys:pq_values=32,quest,ivf,hnsw,tokenselect,duo",
    "k": "1%,2%,4%",
    "tasks": "real_needle,real_multi_key,real_qa",
    "questions": 3,
    "seeds": 12,
    "first_seed": 10,
}
DEFAULTS = {
    "strategies": "flat,ivf,hnsw,quest,duo,tokenselect,routed",
    "k": "0.5%,1%,2%,5%",
    "tasks": "real_needle,real_multi_key,real_multi_value,real_vt,real_qa",
    "questions": 1,
    "seeds": 1,
    "first_seed": 0,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory or .gguf file")
    p.add_argument(
        "--suite",
        action="store_true",
        help=f"the fidelity suite's settings ({', '.join(f'{k}={v}' for k, v in SUITE.items())})".replace("%", "%%"),
    )
    p.add_argument("--lengths", default="4096", help="comma-separated context lengths (tokens)")
    p.add_argument("--strategies", default=None, help=f"default: {DEFAULTS['strategies']}")
    p.add_argument(
        "--k",
        default=None,
        help=f"budgets: ints or percentages of the context (default: {DEFAULTS['k']})".replace("%", "%%"),
    )
    p.add_argument("--tasks", default=None, help=f"default: {DEFAULTS['tasks']}")
    p.add_argument("--questions", type=int, default=None, help="questions per task per context (default: 1)")
    p.add_argument("--seeds", type=int, default=None, help="contexts per length (default: 1)")
    p.add_argument(
        "--first-seed",
        type=int,
        default=None,
        help="seed of the first context (tune on some seeds, report on others; default 0, --suite 10)",
    )
    p.add_argument("--fidelity-steps", type=int, default=4, help="steps with attention metrics per question")
    p.add_argument("--duo-pattern", help="duo head pattern (TSV); default: calibrate on the model")
    p.add_argument("--duo-steps", type=int, default=60, help="calibration steps when no pattern (0: skip duo)")
    p.add_argument("--duo-length", type=int, default=2048, help="calibration context length")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--n-tail", type=int, default=64)
    p.add_argument("--opt", action="append", default=[], help="strategy option key=value or strategy.key=value")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bf16/fp16/fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--budget-minutes", type=float, default=None, help="skip lengths that would not fit")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out-dir", default="real_results")
    p.add_argument(
        "--keep-dir",
        default=None,
        help="keep each context's prefill and dense answers here and reuse them in later runs",
    )
    p.add_argument("--convert-dir", default=None, help="where a .gguf is converted (default: OUT_DIR/converted)")
    args = p.parse_args(argv)
    for key, value in (SUITE if args.suite else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    check_faiss()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from topk_decode.cli.common import parse_options
    from topk_decode.cli.eval_cmd import parse_k_list
    from topk_decode.errors import TopkError
    from topk_decode.eval import paired
    from topk_decode.eval.harness import EvalConfig, run_eval
    from topk_decode.eval.report import save_json

    t_start = time.perf_counter()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    if model.suffix == ".gguf":
        model = convert_gguf(model, Path(args.convert_dir) if args.convert_dir else out_dir / "converted")
    name = model.name
    try:
        strategies = usable_strategies([s.strip() for s in args.strategies.split(",") if s.strip()])
        options = parse_options(args.opt)
        ks = parse_k_list(args.k)
        if "duo" in strategies and "duo.pattern" not in options:
            pattern = duo_pattern(args, model, out_dir)
            if pattern is None:
                print("note: duo skipped (no --duo-pattern and --duo-steps 0)", file=sys.stderr)
                strategies.remove("duo")
            else:
                options["duo.pattern"] = pattern
        lengths = sorted(int(x) for x in args.lengths.split(","))
        per_length: list[dict] = []
        last: tuple[int, float] | None = None
        for length in lengths:
            if args.budget_minutes is not None and last is not None:
                left = args.budget_minutes * 60 - (time.perf_counter() - t_start)
                # attention and search grow with the context; the step overhead does not: scale linearly
                est = last[1] * length / last[0]
                if est > left:
                    print(
                        f"note: {length} tokens skipped: estimated {est:.0f} s, {left:.0f} s left of the budget",
                        file=sys.stderr,
                    )
                    continue
            cfg = EvalConfig(
                model=str(model),
                tasks=args.tasks.split(","),
                lengths=[length],
                seeds=args.seeds,
                questions=args.questions,
                first_seed=args.first_seed,
                strategies=strategies,
                ks=ks,
                fidelity_steps=args.fidelity_steps,
                device=args.device,
                dtype=args.dtype,
                n_sink=args.n_sink,
                n_tail=args.n_tail,
                strategy_options=options,
                keep_dir=args.keep_dir,
            )
            t0 = time.perf_counter()
            path = out_dir / f"real_{name}_{length}.json"

            def write(result, done: bool) -> dict:
                # written after every strategy, so a run stopped early keeps what it measured
                save_json(result, path)
                data = json.loads(path.read_text())
                data["seconds"] = time.perf_counter() - t0
                data["complete"] = done
                path.write_text(json.dumps(data, indent=1))
                (out_dir / f"real_{name}.md").write_text(markdown(per_length + [data], name))
                (out_dir / f"real_{name}_paired.md").write_text(
                    paired.markdown([i for d in per_length + [data] for i in d["instances"]])
                )
                return data

            result = run_eval(
                cfg, log=lambda m: print(m, file=sys.stderr, flush=True), checkpoint=lambda r: write(r, False)
            )
            per_length.append(write(result, True))
            last = (length, per_length[-1]["seconds"])
            print(f"{length} tokens: {last[1]:.0f} s → {path}", file=sys.stderr)
    except TopkError as e:
        sys.exit(f"error: {e}")
    print(markdown(per_length, name))
    print(paired.markdown([i for d in per_length for i in d["instances"]]))
    print(f"total {time.perf_counter() - t_start:.0f} s; tables in {out_dir / f'real_{name}.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
