"""`topk prefill DOCS --out CACHE`: documents → a complete cache directory, with a progress bar."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated

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
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    err = console(stderr=True)
    # Outside a terminal (scripts, nohup, CI logs) a live bar is only noise: _LogLines prints plain lines instead.
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        _tokens_per_s_column(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM (a pre-empted machine, `kill`, a job scheduler): unwinds like Ctrl-C does."""


@contextmanager
def _sigterm_unwinds():
    """Turn SIGTERM into `Terminated` while the prefill runs, so it cleans up (or keeps a resumable
    partial directory) exactly as Ctrl-C does, instead of dying with its partial directory half-written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _LogLines:
    """Plain progress lines on stderr every `every` seconds, for output that is not a terminal (logs, nohup)."""

    def __init__(self, every: float) -> None:
        self.every, self.done, self.total, self.layers = every, 0, 0, 1
        self.t0 = self.last = time.monotonic()

    def start(self, n_tokens: int, n_layers: int) -> None:
        self.n, self.total, self.layers = n_tokens, n_tokens * n_layers, n_layers
        self.t0 = self.last = time.monotonic()

    def advance(self, tokens: int) -> None:
        self.done += tokens
        now = time.monotonic()
        if now - self.last < self.every or not self.total:
            return
        self.last = now
        layer = min(self.done // max(self.n, 1), self.layers)
        elapsed = now - self.t0
        typer.echo(
            f"prefill: {100 * self.done / self.total:.0f}% ({layer}/{self.layers} layers done, "
            f"{elapsed:.0f} s elapsed)",
            err=True,
        )


def prefill_command(
    docs: Annotated[
        Path,
        typer.Argument(
            help="A documents directory (every UTF-8 text file in it, recursively: "
            "code, config, CSV, Markdown, HTML, EPUB, notebooks ...; PDF, DOCX, PPTX "
            "and XLSX with the docs extra; "
            "binary files, VCS folders, virtual "
            "environments, node_modules, __pycache__, hidden (.name) and .gitignore'd paths are "
            "skipped) or one text file."
        ),
    ],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="The cache directory to create.")] = None,
    append: Annotated[
        Path | None,
        typer.Option(
            "--append",
            metavar="CACHE",
            help="Add the documents to this "
            "existing cache instead: the model runs over the new documents only, and the cache becomes "
            "what a prefill of its documents followed by these would write (swapped in atomically).",
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            help="Local HF checkpoint dir or GGUF file (default: the embedded "
            "demo model; with --append, the cache's own)."
        ),
    ] = None,
    chunk_size: Annotated[
        int | None,
        typer.Option(
            help="Tokens per prefill chunk (bounds peak GPU memory; default 4096, with --append the cache's own)."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an existing cache at --out (only a topk cache: any other directory is refused).",
        ),
    ] = False,
    device: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda when available).")] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU; with --append, the cache's own)."),
    ] = None,
    kv_dtype: Annotated[
        str | None,
        typer.Option(
            "--kv-dtype",
            help="int8: store keys and values in 8 bits (keys scaled per channel, values per token; half of bf16's "
            "disk and RAM; decoded by flat and routed); default: the model's dtype.",
        ),
    ] = None,
    strategy: Annotated[
        str | None, typer.Option(help="Also build these strategies' artifacts: NAME[,NAME...].")
    ] = None,
    opt: Annotated[list[str] | None, typer.Option(help="Strategy build option key=value (repeatable).")] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue an interrupted prefill of --out from its last "
            "checkpointed layer (checked against recorded checksums).",
        ),
    ] = False,
    checkpoint_every: Annotated[float, typer.Option(help="Seconds between resume checkpoints.", min=0)] = 300.0,
    log_every: Annotated[
        float, typer.Option(help="Seconds between plain progress lines when stderr is not a terminal.", min=0)
    ] = 30.0,
    allow_long_context: Annotated[
        bool,
        typer.Option(
            "--allow-long-context",
            help="Prefill a context longer than the model's positions (refused otherwise; answers degrade past them).",
        ),
    ] = False,
    follow_symlinks: Annotated[
        bool,
        typer.Option(
            "--follow-symlinks",
            help="Also read symbolic links that leave the documents folder (skipped and reported otherwise).",
        ),
    ] = False,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            metavar="GLOB",
            help="Read paths matching "
            "this gitignore-style pattern even where skipped by default or by a .gitignore (repeatable).",
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude",
            metavar="GLOB",
            help="Never read paths matching this gitignore-style pattern; wins over --include (repeatable).",
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            help="Prefill on N GPUs, one process each (sequence-"
            "parallel; with --device cpu: N CPU processes). Under torchrun: its processes.",
        ),
    ] = None,
) -> None:
    """Prefill documents once and write each layer's keys/values to a cache directory (or add them to one)."""
    # Everything cheap is checked before the model loads: a typo must not cost a prefill.
    if (out is None) == (append is None):
        raise TopkError("name the cache: --out CACHE to create one, or --append CACHE to add the documents to one")
    why_not = "an interrupted append leaves the cache as it was: run it again"
    for flag, given, why in (
        ("--overwrite", overwrite, why_not),
        ("--resume", resume, why_not),
        ("--gpus", gpus is not None, "an append runs in one process"),
        ("--kv-dtype", kv_dtype is not None, "the cache keeps the dtype it was prefilled with"),
    ):
        if append is not None and given:
            raise TopkError(f"{flag} does not apply to --append ({why})")
    check_positive("--chunk-size", chunk_size)
    check_device(device)
    names = parse_strategy_names(strategy)
    options = parse_options(opt)
    if options and not names:
        raise TopkError("--opt sets strategy build options: name the strategies with --strategy NAME[,NAME...]")
    # Paths and names are checked without torch (a typo answers in a second, not after seconds of imports).
    from topk_decode.model.loading import check_model_path, parse_dtype
    from topk_decode.prefill.documents import check_documents_path, compile_globs
    from topk_decode.store.cache_dir import check_output

    parse_dtype(dtype)
    if kv_dtype is not None:  # before anything loads: the value, and whether the named strategies read it
        from topk_decode.index import get_strategy
        from topk_decode.store.format import check_kv_dtype

        check_kv_dtype(kv_dtype)

        for name in names:
            get_strategy(name).check_kv_dtype(kv_dtype)
    check_documents_path(docs)
    compile_globs(include or [], "--include")
    compile_globs(exclude or [], "--exclude")
    if append is None:
        check_output(out, overwrite)
    if model is not None:
        check_model_path(model)
    from topk_decode.index import split_options

    per_strategy = split_options(names, options)  # unknown or mistyped options fail before the prefill
    from topk_decode.prefill.distributed_launch import RankSpec, leader, plan_group, run_torchrun_rank
    from topk_decode.prefill.layerwise import CHUNK_SIZE

    group = plan_group(gpus, device)  # None: this process alone; bad --gpus fails here

    if append is not None:
        _append_command(
            docs,
            append,
            model,
            chunk_size,
            device,
            dtype,
            per_strategy,
            log_every,
            allow_long_context,
            follow_symlinks,
            include or [],
            exclude or [],
        )
        return
    from topk_decode.prefill.build import build_cache

    if model is None:
        from topk_decode.demo import default_model_dir

        model, trained = default_model_dir()
        if not trained and (group is None or group.rank == 0):
            say_note(
                f"no trained demo model is installed: using a random-weight stand-in ({model}) that "
                "produces noise; pass --model DIR for real answers"
            )

    spec = RankSpec(str(model), dtype, CHUNK_SIZE if chunk_size is None else chunk_size)
    if group is not None and group.rank != 0:  # a torchrun rank other than 0: computes its share, writes nothing
        run_torchrun_rank(group, spec)
        return
    out_console = console()
    with _progress() as bar, _sigterm_unwinds():
        state: dict = {}
        lines = _LogLines(log_every) if bar.disable else None

        def on_start(n_tokens: int, n_layers: int, skipped: list[str]) -> None:
            from topk_decode.prefill.documents import summarize_skipped

            for line in summarize_skipped(skipped):  # one line per reason, not one per file
                say_warning(f"skipped {line}")
            state["task"] = bar.add_task(
                f"prefill {n_tokens:,} tokens × {n_layers} layers", total=n_tokens * n_layers, layers=n_layers
            )
            if lines is not None:
                lines.start(n_tokens, n_layers)

        def progress(tokens: int) -> None:
            bar.advance(state["task"], tokens)
            if lines is not None:
                lines.advance(tokens)

        try:
            sized = {} if chunk_size is None else {"chunk_size": chunk_size}
            with leader(group, spec) if group is not None else nullcontext() as prefill_fn:
                path, stats = build_cache(
                    docs,
                    out,
                    model,
                    **sized,
                    overwrite=overwrite,
                    device=group.device_name if group else device,
                    dtype=dtype,
                    on_start=on_start,
                    progress=progress,
                    resume=resume,
                    checkpoint_every=checkpoint_every,
                    on_note=say_note,
                    allow_long_context=allow_long_context,
                    follow_symlinks=follow_symlinks,
                    include=include or [],
                    exclude=exclude or [],
                    prefill_fn=prefill_fn,
                    kv_dtype=kv_dtype,
                )
        except Terminated:
            typer.echo("terminated", err=True)
            raise typer.Exit(143) from None
        from topk_decode.index import keeps_artifacts
        from topk_decode.index.auto import choose

        if not names:  # what `auto` will run on a GPU, so the first question does not wait for a build
            choice = choose(stats.n_tokens)
            names = [choice.strategy] if keeps_artifacts(choice.strategy) else []
            per_strategy = {n: dict(choice.options) for n in names}
        if names:
            _build_strategies(bar, path, names, per_strategy)

    peak = "n/a on CPU" if stats.peak_device_bytes is None else human_bytes(stats.peak_device_bytes)
    out_console.print(f"wrote {path}", markup=False, soft_wrap=True)
    if stats.resumed_at_layer:
        out_console.print(
            f"resumed at layer {stats.resumed_at_layer}: the figures below cover the layers computed by this run",
            markup=False,
        )
    out_console.print(
        f"tokens: {stats.n_tokens:,}   time: {stats.seconds:.2f} s   "
        f"throughput: {stats.tokens_per_s:,.0f} tok/s   peak GPU memory: {peak}"
        f"{f' (rank 0 of {stats.ranks})' if stats.ranks > 1 and stats.peak_device_bytes else ''}   "
        f"size on disk: {human_bytes(dir_size(path))}",
        markup=False,
    )


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


def _append_command(
    docs: Path,
    cache: Path,
    model: Path | None,
    chunk_size: int | None,
    device: str | None,
    dtype: str | None,
    per_strategy: dict[str, dict],
    log_every: float,
    allow_long_context: bool,
    follow_symlinks: bool,
    include: list[str],
    exclude: list[str],
) -> None:
    """`topk prefill NEW_DOCS --append CACHE`, with the same progress bar and summary as a prefill."""
    from topk_decode.prefill.append import append_cache

    with _progress() as bar, _sigterm_unwinds():
        state: dict = {}
        lines = _LogLines(log_every) if bar.disable else None

        def on_start(n_tokens: int, n_layers: int, skipped: list[str]) -> None:
            from topk_decode.prefill.documents import summarize_skipped

            for line in summarize_skipped(skipped):
                say_warning(f"skipped {line}")
            state["task"] = bar.add_task(
                f"append {n_tokens:,} tokens × {n_layers} layers", total=n_tokens * n_layers, layers=n_layers
            )
            if lines is not None:
                lines.start(n_tokens, n_layers)

        def progress(tokens: int) -> None:
            bar.advance(state["task"], tokens)
            if lines is not None:
                lines.advance(tokens)

        def on_strategy(name: str):
            task = bar.add_task(f"strategy {name}", total=None)
            return lambda done, total: bar.update(task, completed=done, total=total)

        try:
            path, stats, _ = append_cache(
                docs,
                cache,
                model,
                chunk_size=chunk_size,
                device=device,
                dtype=dtype,
                on_start=on_start,
                progress=progress,
                allow_long_context=allow_long_context,
                follow_symlinks=follow_symlinks,
                include=include,
                exclude=exclude,
                strategies=per_strategy,
                on_strategy=on_strategy,
            )
        except Terminated:
            typer.echo("terminated; the cache is unchanged", err=True)
            raise typer.Exit(143) from None
    from topk_decode.store.cache_dir import read_manifest

    manifest = read_manifest(path)
    added = manifest["prefill"]["appended"][-1]
    out_console = console()
    out_console.print(
        f"appended {added['documents']} document{'s' * (added['documents'] != 1)} "
        f"({added['n_tokens']:,} tokens) to {path}",
        markup=False,
        soft_wrap=True,
    )
    out_console.print(
        f"tokens: {manifest['n_tokens']:,} in all, {stats.n_tokens:,} computed   time: {stats.seconds:.2f} s   "
        f"throughput: {stats.tokens_per_s:,.0f} tok/s   size on disk: {human_bytes(dir_size(path))}",
        markup=False,
    )
