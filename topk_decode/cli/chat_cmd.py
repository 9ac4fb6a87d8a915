"""`topk chat CACHE`: multi-turn chat over a prefilled cache, answers streamed as they are generated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from topk_decode.cli.common import check_device, check_positive, console, parse_options, say_error
from topk_decode.errors import TopkError

HELP = """commands:
  /reset    start a new conversation (the documents stay cached)
  /k N      change the retrieval budget k (context tokens per query head and layer)
  /stats    per-step statistics of this conversation
  /help     this help
  /quit     leave (Ctrl-D works too)"""


def chat_command(
    cache: Annotated[Path, typer.Argument(help="The cache directory written by `topk prefill`.")],
    k: Annotated[int, typer.Option("--k", "-k", help="Context tokens retrieved per query head and layer.")] = 256,
    strategy: Annotated[str, typer.Option(help="Selection strategy (flat = exact top-k).")] = "flat",
    k_schedule: Annotated[str, typer.Option(help="uniform, or linear: k growing over layers at the same total.")] = "uniform",
    opt: Annotated[Optional[list[str]], typer.Option(help="Strategy option key=value, e.g. nprobe=32 (repeatable).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Answer length limit in tokens.")] = 256,
    model: Annotated[Optional[Path], typer.Option(help="Checkpoint dir or GGUF file (default: the one the cache records).")] = None,
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when available).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU).")] = None,
    n_sink: Annotated[int, typer.Option(help="First context tokens kept in the exact GPU window.")] = 4,
    n_tail: Annotated[int, typer.Option(help="Last context tokens kept in the exact GPU window.")] = 64,
    prompt: Annotated[Optional[str], typer.Option(help="Answer this one question, print it and exit.")] = None,
    compile: Annotated[bool, typer.Option("--compile/--no-compile",
                                          help="On CUDA, compile the one-token step (the first token waits for it).")] = True,
) -> None:
    """Chat with your documents (or answer one --prompt and exit)."""
    check_positive("k", k)
    check_positive("--max-new-tokens", max_new_tokens)
    check_device(device)
    if n_sink < 0 or n_tail < 0:
        raise TopkError("--n-sink and --n-tail must be ≥ 0")
    options = parse_options(opt)
    if prompt is not None and not prompt.strip():
        raise TopkError("--prompt is empty")

    from topk_decode.index import get_strategy

    get_strategy(strategy)  # an unknown name fails before the model loads
    store = _open_store(cache, k=k, k_schedule=k_schedule, strategy=strategy, model=model, device=device, dtype=dtype,
                        n_sink=n_sink, n_tail=n_tail, strategy_options=options, compile=compile)
    session = store.session()
    if prompt is not None:
        _answer(session, prompt, max_new_tokens)
        return
    _interactive(store, session, max_new_tokens)


def _open_store(cache: Path, **kwargs):
    """KVStore.open with a transient progress bar while the strategy builds its indices."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from topk_decode.api import KVStore

    err = console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
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


def _stats_table(store, session):
    """The `/stats` table: per-step means of this conversation and the strategy's counters."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="decode stats: per-step means", caption=f"strategy {store.config.strategy}, k={store.config.k}")
    table.add_column("stat")
    table.add_column("value", justify="right")
    for name, value in session.stats.items():
        if isinstance(value, float):
            text = f"{value:,.2f}"
        elif isinstance(value, int) and not isinstance(value, bool):
            text = f"{value:,}"
        else:
            text = str(value)  # strategies may report extra counters of any kind
        table.add_row(escape(str(name)), escape(text))
    return table


def _command(line: str, store, session) -> bool:
    """Run one in-chat `/command`. Returns False when the chat should end."""
    cmd, _, arg = line.partition(" ")
    out = console()
    if cmd in ("/quit", "/exit", "/q"):
        return False
    if cmd == "/reset":
        session.reset()
        out.print("(new conversation)")
    elif cmd == "/k":
        try:
            store.set_k(int(arg))
        except ValueError:
            raise TopkError(f"/k expects a positive integer, got {arg.strip()!r}") from None
        out.print(f"(k = {store.config.k})")
    elif cmd == "/stats":
        out.print(_stats_table(store, session))
    elif cmd == "/help":
        out.print(HELP, markup=False)
    else:
        raise TopkError(f"unknown command {cmd} (type /help)")
    return True


def _read_line() -> str | None:
    """One line from the user, or None at end of input (Ctrl-D / closed stdin)."""
    try:
        return input("you> ")
    except EOFError:
        typer.echo()
        return None


def _interactive(store, session, max_new_tokens: int) -> None:
    """The read–answer loop. Ctrl-C during an answer stops it and resets the conversation."""
    n_docs = len(store.documents)
    console().print(f"{store.ckv.n_tokens:,} tokens in {n_docs} document{'s' * (n_docs != 1)} · "
                    f"strategy {store.config.strategy} · k={store.config.k}. Type /help for commands.",
                    markup=False)
    while (line := _read_line()) is not None:
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not _command(line, store, session):
                    break
                continue
            typer.echo("topk> ", nl=False)
            _answer(session, line, max_new_tokens)
        except TopkError as e:
            say_error(e)  # a bad in-chat command must not end the chat
        except KeyboardInterrupt:
            # The interrupted step may have reached only some layers: the window is no longer consistent.
            session.reset()
            typer.echo("\n(answer interrupted; conversation reset)")
