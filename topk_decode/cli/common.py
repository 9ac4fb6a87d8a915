"""Helpers shared by the `topk` commands: one-line messages, consoles, option parsing, sizes.

Nothing here imports torch: `topk --help` must stay fast, so every command imports the heavy
modules inside its function body.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand

from topk_decode.errors import TopkError

# The decode options `topk chat` and `topk serve` share, declared once (defaults: DecodeConfig's fields).
KOption = Annotated[int, typer.Option("--k", "-k", help="Context tokens retrieved per query head and layer.")]
StrategyOption = Annotated[
    str,
    typer.Option(
        help="Selection strategy: auto (exact flat on short contexts, routed on long ones), flat (exact top-k), routed, ..."
    ),
]
KScheduleOption = Annotated[str, typer.Option(help="uniform, or linear: k growing over layers at the same total.")]
StrategyOptOption = Annotated[
    list[str] | None, typer.Option(help="Strategy option key=value, e.g. nprobe=32 (repeatable).")
]


def plain_flags(params: list) -> list:
    """Boolean flags shown in `--help` as flags: typer prints a type column (`<bool>`) for every option,
    flags included, as if `--overwrite true` were the way to set one (it is an error). An empty metavar
    leaves that column blank; parsing is unchanged. Returns `params`."""
    for p in params:
        # duck-typed: typer ≥ 0.29 vendors click, so its options are no `click.Option`
        if getattr(p, "param_type_name", None) == "option" and getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class TopkCommand(TyperCommand):
    """Every `topk` subcommand (app.py registers them with it): its help shows flags as flags."""

    def get_params(self, ctx: typer.Context) -> list:
        return plain_flags(super().get_params(ctx))


def one_line(text: object) -> str:
    """A message flattened to one line (tracebacks and multi-line library errors never reach users)."""
    return " ".join(str(text).split())


def say_error(message: object) -> None:
    """Print `error: <message>` on one line on stderr."""
    typer.echo(f"error: {one_line(message)}", err=True)


def say_warning(message: object) -> None:
    """Print `warning: <message>` on one line on stderr."""
    typer.echo(f"warning: {one_line(message)}", err=True)


def say_note(message: object) -> None:
    """Print `note: <message>` on one line on stderr (facts the user should see, not problems)."""
    typer.echo(f"note: {one_line(message)}", err=True)


def console(stderr: bool = False):
    """A rich console bound to the current stdout/stderr (so test runners that swap them see output).

    Args:
        stderr: write to stderr (progress bars, status) instead of stdout.
    """
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Outside a terminal rich would wrap at 80 columns and split paths over lines; use a wide page.
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, highlight=False)


def parse_value(text: str) -> int | float | bool | str:
    """'32' → 32, '0.5' → 0.5, 'true'/'false' → bool, anything else stays a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str] | None) -> dict:
    """Parse repeated `--opt key=value` into a dict (numbers become int/float).

    Args:
        pairs: the raw `key=value` strings.
    """
    out: dict = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise TopkError(f"--opt expects key=value, got {pair!r}")
        out[key.strip()] = parse_value(value)
    return out


def parse_strategy_names(text: str | None) -> list[str]:
    """'flat,ivf' → ['flat', 'ivf'], each checked against the registry (before any expensive work).

    Args:
        text: comma-separated strategy names, or None.
    """
    if not text:
        return []
    from topk_decode.index import check_strategy_name

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise TopkError(f"--strategy expects NAME[,NAME...], got {text!r}")
    for n in names:
        check_strategy_name(n)  # raises TopkError naming the available strategies (imports none of them)
    return names


def check_device(device: str | None) -> None:
    """Reject device names torch would only fail on later with a cryptic message."""
    if device is None:
        return
    if device != "cpu" and device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise TopkError(f"unknown device {device!r} (use cuda, cuda:N or cpu)")


def check_positive(name: str, value: int | None) -> None:
    """Raise TopkError unless `value` is a positive integer (None = not given)."""
    if value is not None and value <= 0:
        raise TopkError(f"{name} must be a positive integer, got {value}")


# `--prompt-chunk-tokens`, declared once for `topk serve` and `topk bench --streams` (serve/turns.py).
PromptChunkTokensOption = Annotated[
    int,
    typer.Option(
        "--prompt-chunk-tokens",
        help="Most prompt tokens run between two decode steps of the answers in progress: a long prompt goes "
        "through the model in pieces of this many tokens, taking turns with them, so it holds up other requests "
        "one piece at a time (smaller: shorter waits for the others, a slower long prompt).",
    ),
]

# `--threads`, declared once for every command that decodes (chat, serve, bench, eval): see `use_threads`.
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="CPU threads for searches and torch's CPU ops (default: TOPK_THREADS, else the CPUs this "
        "process may use: its affinity mask, capped by a cgroup CPU quota).",
    ),
]


def use_threads(threads: int | None) -> int:
    """Apply `--threads` to this process (as TOPK_THREADS, which every pool reads); returns the count in force.

    A bad `--threads` or TOPK_THREADS fails here, before anything loads.
    """
    from topk_decode.cpus import THREADS_ENV, usable_cpus

    if threads is not None:
        check_positive("--threads", threads)
        os.environ[THREADS_ENV] = str(threads)
    n = usable_cpus()
    # numba sizes its thread pool once, at import, and torch's OpenMP runtime its default when it loads: both
    # count the affinity mask, neither a cgroup quota or the knob. The CLI owns its process, so it starts them
    # at n; only before they load, and a NUMBA_NUM_THREADS or OMP_NUM_THREADS the user set is kept.
    for module, var in (("numba", "NUMBA_NUM_THREADS"), ("torch", "OMP_NUM_THREADS")):
        if module not in sys.modules:
            os.environ.setdefault(var, str(n))
    return n


def gpu_present() -> bool:
    """Whether decoding here would run on a CUDA GPU (`pick_device`'s default), without importing torch
    when nothing has yet (`topk info` stays under a second): then an NVIDIA (or ROCm) GPU the driver
    lists and CUDA_VISIBLE_DEVICES does not hide stands in for torch.cuda.is_available()."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (nvidia.is_dir() and any(nvidia.iterdir())) or Path("/dev/kfd").exists()


def human_bytes(n: float | None) -> str:
    """1536 → '1.5 KiB'."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def dir_size(path: str | os.PathLike) -> int:
    """Total bytes of the regular files under a directory."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
