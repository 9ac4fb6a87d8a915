"""The `topk` command line: command registration and the one place where errors become exit codes.

Exit codes: 0 success; 1 internal error (a bug: one line, traceback only with TOPK_DEBUG=1);
2 bad input or environment (`TopkError`, usage errors); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import errno
import io
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

from topk_decode.cli import bench_cmd, chat_cmd, duo_cmd, eval_cmd, info_cmd, prefill_cmd, serve_cmd
from topk_decode.cli.common import TopkCommand, one_line, plain_flags, say_error, say_warning
from topk_decode.errors import TopkError, TopkWarning

EXIT_INTERNAL, EXIT_USER, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 130, 141


class OutputError(OSError):
    """Writing to stdout failed (closed, a full disk): the output is lost, so the command must not exit 0."""


class CheckedStdout(io.TextIOWrapper):
    """sys.stdout whose failed writes and flushes raise OutputError (a BrokenPipeError stays one)."""

    def write(self, s: str) -> int:
        try:
            return super().write(s)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(e.errno, e.strerror) from None

    def flush(self) -> None:
        try:
            super().flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(e.errno, e.strerror) from None


class ClosedStdout(io.TextIOBase):
    """sys.stdout when file descriptor 1 is closed (`topk ... >&-`): Python sets it to None and every
    print is then dropped in silence; here the first write fails instead."""

    encoding = "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        raise OutputError(errno.EBADF, "stdout is closed")


def checked_stdout():
    """A sys.stdout whose failures are OutputError, for `main()` to install."""
    out = sys.stdout
    if out is None:
        return ClosedStdout()
    if type(out) is not io.TextIOWrapper:
        return out  # already replaced (a test runner's capture): leave it alone
    return CheckedStdout(
        out.buffer,
        encoding=out.encoding,
        errors=out.errors,
        line_buffering=out.line_buffering,
        write_through=out.write_through,
    )


def quiet_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's final flush of what is still buffered cannot fail
    again (a second message after ours, or a traceback)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


def output_lost(e: OSError) -> None:
    """One line for a stdout that cannot be written."""
    say_error(f"cannot write the output to stdout ({e.strerror or e}); nothing more is printed")
    quiet_stdout()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning replacement: `warning: <message>` on one line, no source location."""
    say_warning(message)


class TopkGroup(TyperGroup):
    """The root command: runs the chosen subcommand and turns every failure into one line + exit code.

    Living in the click group (not only in `main()`) means typer's CliRunner sees exactly what a
    user sees.
    """

    def get_params(self, ctx: typer.Context) -> list:
        return plain_flags(super().get_params(ctx))  # `--version`, `--help`: flags, no `<bool>` (common.py)

    def invoke(self, ctx: typer.Context) -> Any:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            warnings.simplefilter("always", TopkWarning)
            try:
                return super().invoke(ctx)
            except (typer.TyperException, typer.Exit, typer.Abort):
                raise  # usage errors, --help, explicit exits: handled in main()
            except TopkError as e:
                say_error(e)
                raise typer.Exit(EXIT_USER) from None
            except ModuleNotFoundError as e:
                # An environment problem, not a bug: name the package instead of an internal error.
                say_error(
                    f"the Python package {e.name!r} is not installed (pip install topk-decode installs "
                    f"every dependency; see pyproject.toml)"
                )
                raise typer.Exit(EXIT_USER) from None
            except KeyboardInterrupt:
                typer.echo("interrupted", err=True)
                raise typer.Exit(EXIT_INTERRUPTED) from None
            except BrokenPipeError:
                # The reader went away (`topk ... | head`): stop quietly, as Unix tools do on SIGPIPE.
                quiet_stdout()
                raise typer.Exit(EXIT_BROKEN_PIPE) from None
            except OutputError as e:
                output_lost(e)
                raise typer.Exit(EXIT_USER) from None
            except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
                if os.environ.get("TOPK_DEBUG") == "1":
                    raise
                say_error(f"internal error: {type(e).__name__}: {one_line(e)} (set TOPK_DEBUG=1 for the traceback)")
                raise typer.Exit(EXIT_INTERNAL) from None

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            code = super().main(
                args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra
            )
        except typer.TyperException as e:
            # Usage errors (bad option value, missing argument) on one line, like every other error.
            hint = f" (see '{e.ctx.command_path} --help')" if getattr(e, "ctx", None) is not None else ""
            say_error(f"{e.format_message()}{hint}")
            code = getattr(e, "exit_code", EXIT_USER)
        except typer.Abort:
            typer.echo("interrupted", err=True)
            code = EXIT_INTERRUPTED
        code = code if isinstance(code, int) else 0
        try:
            if sys.stdout is not None:
                sys.stdout.flush()  # output still buffered must reach its reader before we say 0
        except BrokenPipeError:
            quiet_stdout()
            code = code or EXIT_BROKEN_PIPE
        except OutputError as e:
            output_lost(e)
            code = code or EXIT_USER
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=TopkGroup,
    name="topk",
    help="Question answering over a million tokens on one GPU: prefill documents once, then chat with top-k decoding.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from topk_decode import __version__

        typer.echo(f"topk-decode {__version__}")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    # Plain `topk` prints the help (typer's no_args_is_help would surface as a usage *error*).
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


# ---- command registration: one line per command (other modules add theirs here), each a TopkCommand --
app.command("prefill", cls=TopkCommand)(prefill_cmd.prefill_command)
app.command("chat", cls=TopkCommand)(chat_cmd.chat_command)
app.command("info", cls=TopkCommand)(info_cmd.info_command)
app.command("eval", cls=TopkCommand)(eval_cmd.eval_command)
app.command("calibrate-duo", cls=TopkCommand)(duo_cmd.calibrate_duo_command)
app.command("bench", cls=TopkCommand)(bench_cmd.bench_command)
app.command("serve", cls=TopkCommand)(serve_cmd.serve_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `topk` console script and `python -m topk_decode`.

    Args:
        argv: arguments (default: sys.argv[1:]).
    """
    sys.stdout = checked_stdout()  # a closed or failing stdout is an error, not an answer lost in silence
    typer.main.get_command(app).main(args=argv, prog_name="topk")


if __name__ == "__main__":
    main()
