"""The chat prompt of `topk chat`: reading turns, and a graceful Ctrl-C during an answer.

Reading: in a terminal, prompt_toolkit gives line editing, a history kept across runs and multi-line
input (a paste stays one turn; Esc-Enter / Alt-Enter inserts a newline; Enter submits). Otherwise
(piped or redirected stdin or stdout) plain lines are read, so scripts keep working, and the prompts
go to stderr: stdout carries only the answers (and what /commands print). In both, a turn that starts
with `\"\"\"` goes on until a line that ends with `\"\"\"` (ollama's convention).

The in-chat commands live in chat_commands.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from topk_decode.errors import TopkError

PROMPT, CONTINUATION = "you> ", "...  "
FENCE = '"""'

# the input part of `/help` (chat_commands.help_text)
INPUT_HELP = f"""input:
  Enter submits; Esc-Enter (or Alt-Enter) starts a new line; a pasted text stays one question.
  {FENCE} starts a multi-line question that ends at a line ending with {FENCE} (also in piped input).
  Up/Down recall earlier questions (history kept across chats); Ctrl-R searches it.
  Ctrl-C while a question is read in abandons it (the conversation stays as before it); during
  the answer it stops the answer and keeps what was said (a second Ctrl-C abandons the step);
  at the prompt Ctrl-C clears the line. Ctrl-D on an empty line or /bye leaves."""


# ---- reading turns --------------------------------------------------------------------------------
def read_turn(read: Callable[[str], str | None]) -> str | None:
    """One user turn: a line, or a `\"\"\"` block of lines.

    Args:
        read: read(prompt) → the next line without its newline, or None at end of input.

    Returns the turn's text (a block without its fences, lines joined by newlines), or None at end
    of input before any text.
    """
    first = read(PROMPT)
    if first is None or not first.lstrip().startswith(FENCE):
        return first
    body = first.lstrip()[len(FENCE) :]
    if body.rstrip().endswith(FENCE):  # """one line"""
        return body.rstrip()[: -len(FENCE)]
    lines = [body] if body.strip() else []
    while (line := read(CONTINUATION)) is not None:
        if line.rstrip().endswith(FENCE):
            rest = line.rstrip()[: -len(FENCE)]
            if rest.strip():
                lines.append(rest)
            break
        lines.append(line)
    return "\n".join(lines)  # end of input inside a block submits what it holds


def write_prompt(text: str) -> None:
    """A prompt (`you> `, `topk> `) or chat status line outside a terminal: on stderr, so that stdout
    carries only the answers (`echo q | topk chat CACHE > answers.txt`), flushed at once."""
    err = sys.stderr
    if err is None:
        return
    err.write(text)
    err.flush()


def stderr_apart() -> bool:
    """Whether stderr goes elsewhere than stdout (not both the same terminal, pipe or file): then a
    `topk> ` written on stderr needs its own newline once the answer (on stdout) is done."""
    try:
        return not os.path.samestat(os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno()))
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return True


class PlainReader:
    """Lines from a non-terminal stdin, read as bytes so that an invalid UTF-8 line is one error, not the end.

    Args:
        stream: a binary stream (sys.stdin.buffer) or a text stream.
        echo_prompt: write the prompt to stderr (`write_prompt`: stdout carries only the answers).
    """

    def __init__(self, stream, echo_prompt: bool = True) -> None:
        self.stream = stream
        self.echo_prompt = echo_prompt
        self.line_no = 0
        try:
            self.tty = stream.isatty()  # a terminal echoes the line read, its newline included
        except (AttributeError, ValueError):
            self.tty = False

    def __call__(self, prompt: str) -> str | None:
        if self.echo_prompt:
            write_prompt(prompt)
        raw = self.stream.readline()
        if self.echo_prompt and (not raw or not self.tty):
            write_prompt("\n")  # what follows on stderr (an `error:` line) starts a line of its own
        if not raw:
            return None
        self.line_no += 1
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TopkError(
                    f"input line {self.line_no} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                    f"offset {e.start}); line skipped"
                ) from None
        return raw.rstrip("\r\n")


def history_path() -> Path | None:
    """Where the question history lives: $TOPK_CHAT_HISTORY ("" = keep none), else
    $XDG_CACHE_HOME/topk-decode/chat_history (~/.cache when unset)."""
    env = os.environ.get("TOPK_CHAT_HISTORY")
    if env is not None:
        return Path(env).expanduser() if env else None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "topk-decode" / "chat_history"


class TerminalReader:
    """Lines from a terminal through prompt_toolkit: editing, history, paste and Esc-Enter newlines.

    Ctrl-C clears the line and prompts again; Ctrl-D on an empty line ends the input (None).

    Args:
        input, output: prompt_toolkit Input / Output (default: the terminal; tests pass a pipe).
    """

    def __init__(self, input=None, output=None) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        keys = KeyBindings()

        @keys.add("escape", "enter")  # Alt-Enter sends the same sequence in most terminals
        def _newline(event) -> None:
            event.current_buffer.insert_text("\n")

        path, history = history_path(), InMemoryHistory()
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch(exist_ok=True)
                history = FileHistory(str(path))
            except OSError:
                pass  # a read-only home: history for this chat only
        self.session = PromptSession(
            history=history,
            key_bindings=keys,
            multiline=False,
            input=input,
            output=output,
            prompt_continuation=lambda width, line, soft: CONTINUATION,
        )

    def __call__(self, prompt: str) -> str | None:
        while True:
            try:
                return self.session.prompt(prompt)
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt: drop the line, ask again
            except EOFError:
                return None


def stdin_closed() -> bool:
    """True when there is no stdin to read (Python sets sys.stdin to None when started with `<&-`)."""
    return sys.stdin is None or getattr(sys.stdin, "closed", False)


def make_reader() -> Callable[[str], str | None]:
    """prompt_toolkit when stdin and stdout are a terminal, plain line reading otherwise."""
    try:
        tty = sys.stdin.isatty() and sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return TerminalReader()
    return PlainReader(getattr(sys.stdin, "buffer", sys.stdin))


# ---- Ctrl-C during an answer ----------------------------------------------------------------------
class StopRequest:
    """Ctrl-C while a question is answered. Until the first piece of the answer is shown (`answering`
    False: the question's tokens are still going through the model), the first Ctrl-C raises
    KeyboardInterrupt at once: the decoder leaves the window as it was before the interrupted step
    and the chat rewinds the question. Once the answer shows (`answering` True), the first Ctrl-C only
    asks it to stop at the next token, so the decoder never sees a half-done step; a second one raises
    KeyboardInterrupt as usual.

    Use as `with StopRequest() as stop: ... if stop.requested: break`. Outside the main thread
    (signals cannot be handled there) it does nothing and Ctrl-C behaves as usual.
    """

    def __init__(self) -> None:
        self.requested = False
        self.answering = False
        self.raised = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.raised:
            return  # already unwinding: one more press must not interrupt the rewind
        if self.requested or not self.answering:
            self.requested = self.raised = True
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
