"""`topk prefill DOCS --out CACHE`: documents → a complete cache directory, with a progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from topk_decode.cli.common import (
    check_device,
    check_positive,
    console,
    dir_size,
    human_bytes,
    parse_options,
    parse_strategy_names,
    say_note,
    say_warning,
)
from topk_decode.errors import TopkError


def _tokens_per_s_column():
    """A rich progress column showing whole-model tokens/s (work units are token-layers)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class TokensPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            if "layers" not in task.fields:
                return Text("")
            if not speed:
                return Text("— tok/s")
            return Text(f"{speed / task.fields['layers']:,.0f} tok/s")

    return TokensPerSecond()


def _progress():
    """The progress bar used for the prefill and for strategy artifacts (on stderr, transient)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    err = console(stderr=True)
    # Outside a terminal (scripts, CI logs) a live bar is only noise: the summary line says it all.
    return Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), _tokens_per_s_column(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True,
                    disable=not err.is_terminal)


def prefill_command(
    docs: Annotated[Path, typer.Argument(help="A documents directory (.txt/.md, recursive) or one text file.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The cache directory to create.")],
    model: Annotated[Optional[Path], typer.Option(help="Local HF checkpoint dir (default: the embedded demo model).")] = None,
    chunk_size: Annotated[int, typer.Option(help="Tokens per prefill chunk (bounds peak GPU memory).")] = 4096,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing cache at --out.")] = False,
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when available).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU).")] = None,
    strategy: Annotated[Optional[str], typer.Option(help="Also build these strategies' artifacts: NAME[,NAME...].")] = None,
    opt: Annotated[Optional[list[str]], typer.Option(help="Strategy build option key=value (repeatable).")] = None,
) -> None:
    """Prefill documents once and write each layer's keys/values to a cache directory."""
    # Everything cheap is checked before the model loads: a typo must not cost a prefill.
    check_positive("--chunk-size", chunk_size)
    check_device(device)
    names = parse_strategy_names(strategy)
    options = parse_options(opt)
    if options and not names:
        raise TopkError("--opt sets strategy build options: name the strategies with --strategy NAME[,NAME...]")
    from topk_decode.index import split_options

    per_strategy = split_options(names, options)   # unknown or mistyped options fail before the prefill

    from topk_decode.prefill.build import build_cache, parse_dtype

    parse_dtype(dtype)
    if model is None:
        from topk_decode.demo import default_model_dir

        model, trained = default_model_dir()
        if not trained:
            say_note(f"no trained demo model is installed: using a random-weight stand-in ({model}) that "
                     "produces noise; pass --model DIR for real answers")

    out_console = console()
    with _progress() as bar:
        state: dict = {}

        def on_start(n_tokens: int, n_layers: int, skipped: list[str]) -> None:
            for s in skipped:
                say_warning(f"skipped {s}")
            state["task"] = bar.add_task(f"prefill {n_tokens:,} tokens × {n_layers} layers",
                                         total=n_tokens * n_layers, layers=n_layers)

        def progress(tokens: int) -> None:
            bar.advance(state["task"], tokens)

        path, stats = build_cache(docs, out, model, chunk_size=chunk_size, overwrite=overwrite, device=device,
                                  dtype=dtype, on_start=on_start, progress=progress)
        if names:
            _build_strategies(bar, path, names, per_strategy)

    peak = "n/a on CPU" if stats.peak_device_bytes is None else human_bytes(stats.peak_device_bytes)
    out_console.print(f"wrote {path}", markup=False, soft_wrap=True)
    out_console.print(f"tokens: {stats.n_tokens:,}   time: {stats.seconds:.2f} s   "
                      f"throughput: {stats.tokens_per_s:,.0f} tok/s   peak GPU memory: {peak}   "
                      f"size on disk: {human_bytes(dir_size(path))}", markup=False)


def _build_strategies(bar, path: Path, names: list[str], options: dict[str, dict]) -> None:
    """Build each named strategy's artifacts inside the finished cache, one progress task each."""
    from topk_decode.index import prepare_artifacts
    from topk_decode.store import open_cache

    ckv = open_cache(path, verify=False)  # just written and checksummed by us
    for name in names:
        task = bar.add_task(f"strategy {name}", total=None)

        def progress(done: int, total: int, task=task) -> None:
            bar.update(task, completed=done, total=total)

        try:
            prepare_artifacts(ckv, [name], options[name], progress)
        except BaseException:
            # The prefill itself is complete and valid: say so, so nobody re-runs hours of prefill.
            say_note(f"the cache {path} is complete; only the {name} artifacts were not built")
            raise
        bar.remove_task(task)
