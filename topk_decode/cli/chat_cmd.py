"""`topk chat CACHE`: multi-turn chat over a prefilled cache, answers streamed as they are generated."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from topk_decode.cli.chat_commands import ChatState, run_command, say
from topk_decode.cli.chat_repl import (
    PlainReader,
    StopRequest,
    make_reader,
    read_turn,
    stderr_apart,
    stdin_closed,
    write_prompt,
)
from topk_decode.cli.common import (
    KOption,
    KScheduleOption,
    StrategyOption,
    StrategyOptOption,
    ThreadsOption,
    check_device,
    check_positive,
    console,
    parse_options,
    say_error,
    say_note,
    use_threads,
)
from topk_decode.config import DecodeConfig
from topk_decode.errors import TopkError


def chat_command(
    cache: Annotated[Path, typer.Argument(help="The cache directory written by `topk prefill`.")],
    k: KOption = DecodeConfig.k,
    strategy: StrategyOption = DecodeConfig.strategy,
    k_schedule: KScheduleOption = DecodeConfig.k_schedule,
    opt: StrategyOptOption = None,
    max_new_tokens: Annotated[int, typer.Option(help="Answer length limit in tokens.")] = 256,
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint dir or GGUF file (default: the one the cache records).")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda when available).")] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU).")] = None,
    n_sink: Annotated[
        int, typer.Option(help="First context tokens kept in the exact GPU window.")
    ] = DecodeConfig.n_sink,
    n_tail: Annotated[
        int, typer.Option(help="Last context tokens kept in the exact GPU window.")
    ] = DecodeConfig.n_tail,
    prompt: Annotated[str | None, typer.Option(help="Answer this one question, print it and exit.")] = None,
    compile: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile", help="On CUDA, compile the one-token step (the first token waits for it)."
        ),
    ] = DecodeConfig.compile,
    system: Annotated[str | None, typer.Option(help="System prompt (a system turn right after the documents).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy (exact); > 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling: keep the tokens covering this probability.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed of the sampler (reproducible sampled answers).")] = None,
    threads: ThreadsOption = None,
) -> None:
    """Chat with your documents (or answer one --prompt and exit)."""
    check_positive("k", k)
    check_positive("--max-new-tokens", max_new_tokens)
    check_device(device)
    use_threads(threads)
    if n_sink < 0 or n_tail < 0:
        raise TopkError("--n-sink and --n-tail must be ≥ 0")
    options = parse_options(opt)
    if prompt is not None and not prompt.strip():
        raise TopkError("--prompt is empty")

    from topk_decode.index import check_requested_strategy
    from topk_decode.store.cache_dir import check_cache

    check_requested_strategy(strategy)  # an unknown name fails before the model loads
    check_cache(cache)  # so does a missing or truncated cache; neither check imports torch
    from topk_decode.decode.sampling import Sampling

    Sampling(temperature, top_p, seed)  # bad sampling options fail before the model loads too
    store = _open_store(
        cache,
        k=k,
        k_schedule=k_schedule,
        strategy=strategy,
        model=model,
        device=device,
        dtype=dtype,
        n_sink=n_sink,
        n_tail=n_tail,
        strategy_options=options,
        compile=compile,
    )
    session = store.session(system, temperature=temperature, top_p=top_p, seed=seed, sources=True)
    if prompt is not None:
        _answer(session, prompt, max_new_tokens)
        return
    _interactive(ChatState(store, session, max_new_tokens))


def _open_store(cache: Path, **kwargs):
    """KVStore.open with a transient progress bar while the strategy builds its indices."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from topk_decode.api import KVStore

    err = console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("loading model and cache", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, description=f"building {kwargs['strategy']} index", completed=done, total=total)

        return KVStore.open(cache, progress=progress, **kwargs)


def _answer(session, question: str, max_new_tokens: int) -> None:
    """Stream one answer to stdout, piece by piece (leading whitespace of the answer dropped)."""
    started = False
    for piece in session.ask(question, max_new_tokens=max_new_tokens, stream=True):
        if not started:
            piece = piece.lstrip()
            started = bool(piece)
        if piece:
            typer.echo(piece, nl=False)
    typer.echo()


def _status(state: ChatState, text: str) -> None:
    """One status line of the chat (the greeting, "(answer cut off ...)"): on stdout in a terminal, on
    stderr when piped (stdout carries only the answers there)."""
    if state.piped:
        write_prompt(text + "\n")
    else:
        say(text)


def _stream_answer(state: ChatState, question: str) -> None:
    """Stream one answer in the chat. Ctrl-C before the answer shows abandons the question at once and
    rewinds the conversation to before it; during the answer the first Ctrl-C stops it and keeps what was said.

    The answer stops at a token boundary (StopRequest), so the decoder never sees a half-done step:
    every token shown so far is in the conversation's window, and the token generated when the stop
    came is shown only if the decoder kept it as the pending token of the next turn. An interrupted
    step (the question's, or a second Ctrl-C's) leaves the window as it was before that step (engine.py).
    """
    session, clock = state.session, time.perf_counter
    conv = session.conv
    steps0, t0, first = conv.stats.steps, clock(), None
    started = stopped = interrupted = False
    with StopRequest() as stop:
        mark = session.mark()
        try:
            pieces = session.ask(question, max_new_tokens=state.max_tokens, stream=True)
            if state.piped:
                write_prompt("topk> ")  # stdout: the answer only
            else:
                typer.echo("topk> ", nl=False)
            try:
                for piece in pieces:
                    stop.answering = True  # from here the first Ctrl-C stops at a token boundary
                    first = clock() if first is None else first
                    if stop.requested:
                        stopped = True
                        if not conv.pending:
                            break  # generated but never fed back: not part of the conversation
                    if not started:
                        piece = piece.lstrip()
                        started = bool(piece)
                    if piece:
                        typer.echo(piece, nl=False)
                    if stopped:
                        break
            finally:
                pieces.close()
        except KeyboardInterrupt:
            typer.echo()
            if state.piped and stderr_apart():
                write_prompt("\n")  # ends the `topk> ` line there
            if not stop.answering:
                session.rewind(mark)
                _status(state, "(question abandoned; the conversation is as it was before it)")
                return
            interrupted = True
    now = clock()
    state.record_answer(conv.stats.steps - steps0, now - t0, (first or now) - t0)
    if interrupted:
        _status(state, "(answer interrupted; the conversation keeps it up to the last token fed back)")
        return
    typer.echo()
    if state.piped and stderr_apart():
        write_prompt("\n")  # ends the `topk> ` line there (stdout's newline ends it where both are one)
    if stopped:
        _status(state, "(answer stopped; the conversation keeps it)")
    elif conv.pending and conv.pending[0] not in state.store.eos_ids:
        _status(state, f"(answer cut off at max_tokens = {state.max_tokens}; /set max_tokens N allows longer answers)")


def _interactive(state: ChatState) -> None:
    """The read–answer loop (chat_repl.py reads the turns and runs the /commands)."""
    store = state.store
    if stdin_closed():
        say_note("stdin is closed: no questions to read (use --prompt QUESTION, or run in a terminal)")
        return
    read = make_reader()
    state.piped = isinstance(read, PlainReader)  # prompts and status lines on stderr (chat_repl.write_prompt)
    n_docs = len(store.documents)
    _status(
        state,
        f"{store.ckv.n_tokens:,} tokens in {n_docs} document{'s' * (n_docs != 1)} · "
        f"strategy {store.config.strategy} · k={store.config.k}. Type /help for commands.",
    )
    while True:
        try:
            try:
                line = read_turn(read)
            except KeyboardInterrupt:  # Ctrl-C at a plain (non-prompt_toolkit) prompt: drop the line
                write_prompt("\n")  # where that prompt was written
                continue
            if line is None:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/") and "\n" not in line:
                if not run_command(line, state):
                    break
                continue
            _stream_answer(state, line)
        except TopkError as e:
            say_error(e)  # a bad in-chat command or input line must not end the chat
        except KeyboardInterrupt:
            # Ctrl-C during a /command (answers handle their own): start over rather than guess its state.
            state.reset()
            typer.echo("\n(interrupted; conversation reset)")
