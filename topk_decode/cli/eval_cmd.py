"""`topk eval`: task accuracy and fidelity of top-k strategies against dense attention."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from topk_decode.cli.common import ThreadsOption, check_device, console, parse_options, say_note, use_threads
from topk_decode.config import DecodeConfig
from topk_decode.errors import TopkError


def parse_list(name: str, text: str, kind: Callable[[str], object]) -> list:
    """'4096,16384' → [4096, 16384]; a bad item raises TopkError naming the option.

    Args:
        name: the option name (for the message).
        text: comma-separated values.
        kind: int, float or str.
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise TopkError(f"{name} expects a comma-separated list, got {text!r}")
    out = []
    for t in items:
        try:
            out.append(kind(t))
        except ValueError:
            raise TopkError(f"{name}: {t!r} is not a valid {kind.__name__}") from None
    return out


def parse_k_list(text: str) -> list[int | str]:
    """'16,1%' → [16, '1%']: positive ints, or percentages of each context's tokens.

    Args:
        text: comma-separated budgets.
    """
    from topk_decode.eval.runs import parse_budget

    try:
        return [parse_budget(t) for t in parse_list("--k", text, str)]
    except TopkError as e:
        raise TopkError(f"--k: {e}") from None


def eval_command(
    model: Annotated[
        Path | None,
        typer.Option("--model", help="Checkpoint directory or GGUF file (default: the shipped demo model)."),
    ] = None,
    tasks: Annotated[
        str,
        typer.Option(
            "--tasks",
            help="Comma-separated tasks: single_needle, multi_key, multi_value, variable_tracking (demo filler); real_needle, real_multi_key, real_multi_value, real_vt, real_qa (Python's docs, one prefill per length and seed).",
        ),
    ] = "single_needle",
    lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated context lengths in tokens.")] = "4096",
    depths: Annotated[
        str, typer.Option("--depths", help="Comma-separated depths of the asked fact in [0, 1].")
    ] = "0.1,0.5,0.9",
    seeds: Annotated[
        int, typer.Option("--seeds", help="Instances per (task, length, depth); real tasks: contexts per length.")
    ] = 1,
    questions: Annotated[int, typer.Option("--questions", help="Real tasks: questions per task in each context.")] = 2,
    first_seed: Annotated[int, typer.Option("--first-seed", help="Seed of the first instance.")] = 0,
    strategies: Annotated[
        str,
        typer.Option(
            "--strategies", help="Comma-separated selection strategies (auto: the default's choice per context)."
        ),
    ] = "auto",
    k: Annotated[
        str,
        typer.Option(
            "--k",
            help="Comma-separated retrieval budgets per query head and layer; x% = share of the context's tokens.",
        ),
    ] = "1,4,16,64,256,1024",
    k_schedules: Annotated[
        str,
        typer.Option("--k-schedules", help="Comma-separated per-layer schedules: uniform, linear (same total budget)."),
    ] = "uniform",
    docs: Annotated[
        Path | None,
        typer.Option("--docs", help="Fidelity only, on these documents (folder or file) instead of the tasks."),
    ] = None,
    question: Annotated[
        str, typer.Option("--question", help="The question asked about --docs.")
    ] = "What are these documents about?",
    out: Annotated[Path | None, typer.Option("--out", help="Write the full results as JSON here.")] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write PNG plots into this directory (needs matplotlib).")
    ] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cuda, cuda:N or cpu (default: CUDA when available).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU).")
    ] = None,
    fidelity_steps: Annotated[
        int, typer.Option("--fidelity-steps", help="Teacher-forced steps measured per run (0: no attention metrics).")
    ] = 8,
    n_sink: Annotated[
        int, typer.Option("--n-sink", help="First context tokens kept in the exact window.")
    ] = DecodeConfig.n_sink,
    n_tail: Annotated[
        int, typer.Option("--n-tail", help="Last context tokens kept in the exact window.")
    ] = DecodeConfig.n_tail,
    opt: Annotated[
        list[str] | None,
        typer.Option(
            "--opt",
            help="Strategy option key=value (repeatable); strategy.key=value for one strategy only (duo.pattern=gates.tsv).",
        ),
    ] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Also print the tables as markdown.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-instance progress lines.")] = False,
    threads: ThreadsOption = None,
) -> None:
    """Run dense and each strategy × k on the same seeded task instances: accuracy and fidelity tables."""
    check_device(device)
    use_threads(threads)
    from topk_decode.eval.harness import EvalConfig, run_eval
    from topk_decode.eval.report import markdown_tables, print_tables, save_json, write_plots

    cfg = EvalConfig(
        model=str(model) if model is not None else None,
        tasks=parse_list("--tasks", tasks, str),
        lengths=parse_list("--lengths", lengths, int),
        depths=parse_list("--depths", depths, float),
        seeds=seeds,
        first_seed=first_seed,
        strategies=parse_list("--strategies", strategies, str),
        ks=parse_k_list(k),
        questions=questions,
        k_schedules=parse_list("--k-schedules", k_schedules, str),
        fidelity_steps=fidelity_steps,
        device=device,
        dtype=dtype,
        n_sink=n_sink,
        n_tail=n_tail,
        strategy_options=parse_options(opt),
        docs=str(docs) if docs is not None else None,
        question=question,
    )
    cfg.validate()  # before loading anything
    err = console(stderr=True)
    log = None if quiet else (lambda msg: err.print(msg, markup=False, highlight=False))
    result = run_eval(cfg, log=log)
    print_tables(result, console())
    if markdown:
        typer.echo(markdown_tables(result))
    if out is not None:
        say_note(f"results written to {save_json(result, out)}")
    if plot is not None:
        for p in write_plots(result, plot):
            say_note(f"plot written to {p}")
