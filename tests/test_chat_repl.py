"""The chat prompt without a terminal: command table and aliases, /set and /k, multi-line blocks, piped,
closed and invalid-UTF-8 stdin, the cut-off notice, Ctrl-C that keeps the conversation, and --version.

The terminal reader's keys (paste, Esc-Enter, Ctrl-C, Ctrl-D, history) are driven through a prompt_toolkit
pipe; Ctrl-C during a real answer in a real terminal was checked by hand in tmux.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from topk_decode import __version__
from topk_decode.cli import chat_commands, chat_repl
from topk_decode.cli.app import app
from topk_decode.cli.chat_commands import COMMANDS, SETTINGS, ChatState, find_command, help_text, run_command
from topk_decode.cli.chat_repl import PlainReader, StopRequest, read_turn
from topk_decode.errors import TopkError

REPO = Path(__file__).resolve().parents[1]


def topk(*args: object, input: str | bytes | None = None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert "Traceback" not in result.output, result.output
    return result


def fake_state(k: int = 256) -> ChatState:
    """A ChatState over stand-ins: enough for the commands that only read or set values."""
    config = SimpleNamespace(k=k, k_per_layer=None)

    def set_k(value: int) -> None:
        config.k = value

    session = SimpleNamespace(resets=0, stats={})
    session.reset = lambda: setattr(session, "resets", session.resets + 1)
    return ChatState(SimpleNamespace(config=config, set_k=set_k), session, max_tokens=256)


def reader_of(lines: list[str]):
    """read(prompt) over a list of lines, recording the prompts it was asked with."""
    it, prompts = iter(lines), []

    def read(prompt: str):
        prompts.append(prompt)
        return next(it, None)

    read.prompts = prompts
    return read


# ---- the command table ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alias, name", [("/clear", "/reset"), ("/bye", "/quit"), ("/exit", "/quit"), ("/q", "/quit"), ("/?", "/help")]
)
def test_aliases_find_their_command(alias, name):
    assert find_command(alias) is find_command(name)


def test_quit_and_bye_end_the_chat_and_other_commands_do_not(capsys):
    state = fake_state()
    assert run_command("/bye", state) is False and run_command("/quit", state) is False
    assert run_command("/k", state) is True


def test_clear_resets_the_conversation_and_the_answer_counters(capsys):
    state = fake_state()
    state.record_answer(10, 2.0, 0.5)
    assert run_command("/clear", state)
    assert state.session.resets == 1 and state.answers == 0 and state.last_answer is None
    assert "(new conversation)" in capsys.readouterr().out


def test_k_alone_shows_k_and_with_a_number_sets_it(capsys):
    state = fake_state(k=256)
    run_command("/k", state)
    assert "(k = 256)" in capsys.readouterr().out
    run_command("/k 64", state)
    assert state.store.config.k == 64 and "(k = 64)" in capsys.readouterr().out


def test_set_changes_k_and_max_tokens_and_lists_what_is_settable(capsys):
    state = fake_state()
    run_command("/set k 128", state)
    run_command("/set max_tokens 512", state)
    run_command("/set max_new_tokens 300", state)  # the alias
    assert state.store.config.k == 128 and state.max_tokens == 300
    run_command("/set", state)
    out = capsys.readouterr().out
    assert all(s.name in out for s in SETTINGS) and "300" in out and "128" in out


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("/set k 0", "positive integer"),
        ("/set k abc", "positive integer"),
        ("/set max_tokens 1.5", "positive integer"),
        ("/set nope 3", "unknown setting"),
        ("/set k", "needs a value"),
        ("/nope", "unknown command"),
        ("/k -3", "positive integer"),
    ],
)
def test_bad_commands_raise_one_clear_error_and_change_nothing(line, fragment):
    state = fake_state(k=256)
    with pytest.raises(TopkError, match=fragment):
        run_command(line, state)
    assert state.store.config.k == 256 and state.max_tokens == 256


def test_help_lists_every_command_alias_and_setting():
    text = help_text()
    for c in COMMANDS:
        assert c.name in text and all(a in text for a in c.aliases)
    for s in SETTINGS:
        assert s.name in text and all(a in text for a in s.aliases)
    assert '"""' in text and "Esc-Enter" in text and "Ctrl-C" in text


def test_adding_a_command_is_one_table_entry(monkeypatch, capsys):
    monkeypatch.setattr(
        chat_commands,
        "COMMANDS",
        COMMANDS + [chat_commands.Command("/ping", "answer pong", lambda s, a: print("pong", a))],
    )
    assert run_command("/ping  x ", fake_state())
    assert capsys.readouterr().out == "pong x\n" and "/ping" in help_text()


# ---- turns: lines and multi-line blocks -----------------------------------------------------------
def test_a_plain_line_is_one_turn():
    assert read_turn(reader_of(["What is prefill?", "next"])) == "What is prefill?"


def test_a_fenced_block_is_one_turn_with_its_newlines():
    read = reader_of(['"""First line', "second line", 'third"""', "after"])
    assert read_turn(read) == "First line\nsecond line\nthird"
    assert read.prompts == [chat_repl.PROMPT, chat_repl.CONTINUATION, chat_repl.CONTINUATION]
    assert read_turn(read) == "after"


def test_fences_on_their_own_lines_and_a_one_line_block():
    assert read_turn(reader_of(['"""', "a", "b", '"""'])) == "a\nb"
    assert read_turn(reader_of(['"""just this"""'])) == "just this"


def test_end_of_input_inside_a_block_submits_what_it_holds_and_end_of_input_is_none():
    assert read_turn(reader_of(['"""a', "b"])) == "a\nb"
    assert read_turn(reader_of([])) is None


def test_plain_reader_skips_an_invalid_utf8_line_with_one_error_and_goes_on(capsys):
    read = PlainReader(io.BytesIO("héllo\n".encode() + b"\xff\xfebad\n" + b"last\r\n"), echo_prompt=False)
    assert read("> ") == "héllo"
    with pytest.raises(TopkError, match="line 2 is not valid UTF-8"):
        read("> ")
    assert read("> ") == "last"
    assert read("> ") is None


def test_stop_request_turns_the_first_ctrl_c_into_a_flag_and_the_second_into_keyboardinterrupt():
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        stop.answering = True
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_stop_request_before_the_answer_raises_at_the_first_ctrl_c_and_then_ignores_more():
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the question is still going through the model
        assert stop.requested and stop.raised
        os.kill(os.getpid(), signal.SIGINT)  # pressed again while unwinding: no second interrupt
    assert signal.getsignal(signal.SIGINT) is before


# ---- the chat end to end on a tiny model ----------------------------------------------------------
@pytest.fixture(scope="module")
def cache(built_cache) -> Path:
    return built_cache[0]


def test_piped_chat_runs_a_block_and_commands_and_ends_at_end_of_input(cache):
    result = topk(
        "chat",
        cache,
        "--max-new-tokens",
        3,
        input='/set max_tokens 2\n"""What is\nprefill?"""\n/show\n/stats\n/k\n/clear\n',
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert result.stderr.count("topk> ") == 1  # the two-line block was one question (prompts: stderr)
    assert "(max_tokens = 2)" in out and "strategy   flat" in out and str(cache) in out
    assert "tokens_per_s" in out and "answer_tokens" in out and "(k = 256)" in out
    assert "(new conversation)" in out and "error" not in result.stderr


def test_an_answer_stopped_by_max_tokens_says_it_was_cut_off(cache):
    result = topk("chat", cache, "--max-new-tokens", 2, input="Why?\n/bye\n")
    assert result.exit_code == 0, result.output
    assert "(answer cut off at max_tokens = 2;" in result.stderr  # piped: a status line, on stderr


def test_invalid_utf8_on_stdin_is_one_error_and_the_chat_goes_on(cache):
    result = topk("chat", cache, "--max-new-tokens", 2, input=b"\xff\xfe?\n/k 8\n")
    assert result.exit_code == 0, result.output
    errors = [line for line in result.stderr.splitlines() if "error" in line]  # beside the prompts (stderr when piped)
    assert len(errors) == 1 and errors[0].startswith("error: input line 1 is not valid UTF-8"), result.stderr
    assert "(k = 8)" in result.stdout


def _python_m(*args: object, shell_suffix: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TOPK_DEBUG", None)
    cmd = " ".join([sys.executable, "-m", "topk_decode", *map(str, args)]) + shell_suffix
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=300)


def test_closed_stdin_exits_zero_with_one_line(cache):
    proc = _python_m("chat", cache, shell_suffix=" <&-")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: stdin is closed"), proc.stderr
    assert "internal error" not in proc.stderr


def test_version_prints_the_package_version():
    result = topk("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"topk-decode {__version__}"


def test_ctrl_c_during_an_answer_keeps_exactly_what_was_said(cache, capsys):
    """Stopped after 3 pieces, the conversation holds the question and the shown tokens: the next answer
    equals the one of a conversation fed those same tokens directly."""
    from topk_decode.api import KVStore
    from topk_decode.cli.chat_cmd import _stream_answer

    store = KVStore.open(cache, k=8, device="cpu")
    state = ChatState(store, store.session(), max_tokens=20)
    ask = state.session.ask

    def ask_then_ctrl_c(question, **kw):
        for i, piece in enumerate(ask(question, **kw)):
            if i == 3:
                os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C while this piece is shown
            yield piece

    state.session.ask = ask_then_ctrl_c
    _stream_answer(state, "What does the fox do?")
    assert "(answer stopped; the conversation keeps it)" in capsys.readouterr().out
    conv, n = state.session.conv, state.last_answer[0]
    assert conv.pending == [] and 4 <= n < 20  # stopped early; the last generated token never shown nor fed
    kept = conv.window.n_new
    state.session.ask = ask
    after = state.session.ask("And then?", max_new_tokens=6)

    ref = store.session()
    q1 = ref._question_ids("What does the fox do?")
    ref.turns = 1
    store.decoder.generate(ref.conv, q1, max_new_tokens=n)  # feeds q1 and the first n - 1 tokens
    ref.conv.pending = []  # the n-th was dropped, as above
    assert ref.conv.window.n_new == kept == len(q1) + n - 1
    assert ref.ask("And then?", max_new_tokens=6) == after


def test_ctrl_c_before_the_answer_shows_abandons_the_question_and_rewinds_the_conversation(cache, capsys, monkeypatch):
    """Ctrl-C while the question goes through the model (no piece shown yet): the first press raises at
    once, and the conversation is exactly as before the question (the next answer is a fresh one's)."""
    from topk_decode.api import KVStore
    from topk_decode.cli.chat_cmd import _stream_answer

    store = KVStore.open(cache, k=8, device="cpu", prompt_chunk=4)
    state = ChatState(store, store.session(), max_tokens=5)
    _stream_answer(state, "What does the fox do?")
    conv = state.session.conv
    before = (state.session.turns, list(conv.pending), conv.window.length)
    from topk_decode.decode import engine

    window_part, calls = engine.chunk_window_attention, []

    def window_part_then_ctrl_c(*args):
        calls.append(1)
        if len(calls) == 5:  # inside the question's third chunk
            os.kill(os.getpid(), signal.SIGINT)
        return window_part(*args)

    monkeypatch.setattr(engine, "chunk_window_attention", window_part_then_ctrl_c)
    _stream_answer(state, "the lazy dog " * 30)
    monkeypatch.undo()
    assert len(calls) == 5  # the question went no further
    assert "(question abandoned; the conversation is as it was before it)" in capsys.readouterr().out
    assert (state.session.turns, conv.pending, conv.window.length) == before
    after = state.session.ask("And then?", max_new_tokens=6)

    ref = store.session()
    ref.ask("What does the fox do?", max_new_tokens=5)
    assert ref.ask("And then?", max_new_tokens=6) == after


def test_rewind_drops_a_whole_turn_and_restores_the_sampler(cache):
    from topk_decode.api import KVStore

    store = KVStore.open(cache, k=8, device="cpu")
    chat = store.session(temperature=0.8, seed=3)
    chat.ask("What does the fox do?", max_new_tokens=4)
    mark = chat.mark()
    first = chat.ask("And then?", max_new_tokens=6)
    chat.rewind(mark)
    assert chat.ask("And then?", max_new_tokens=6) == first


# ---- the terminal reader, driven through a pipe instead of a tty ---------------------------------
@pytest.fixture
def terminal(tmp_path, monkeypatch):
    """terminal(keys) → the lines a TerminalReader returns for those keystrokes (None at Ctrl-D)."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    monkeypatch.setenv("TOPK_CHAT_HISTORY", str(tmp_path / "history"))

    def run(keys: str, n: int) -> list:
        with create_pipe_input() as pipe:
            read = chat_repl.TerminalReader(input=pipe, output=DummyOutput())
            pipe.send_text(keys)
            return [read(chat_repl.PROMPT) for _ in range(n)]

    return run


def test_terminal_paste_of_two_lines_is_one_turn_and_esc_enter_adds_a_line(terminal):
    assert terminal("\x1b[200~first line\nsecond line\x1b[201~\r", 1) == ["first line\nsecond line"]
    assert terminal("abc\x1b\rdef\r", 1) == ["abc\ndef"]


def test_terminal_ctrl_c_clears_the_line_and_ctrl_d_ends_the_input(terminal):
    assert terminal("half a question\x03real question\r\x04", 2) == ["real question", None]


def test_terminal_history_is_kept_in_a_file_across_chats(terminal, tmp_path):
    assert terminal("What is prefill?\r", 1) == ["What is prefill?"]
    assert "What is prefill?" in (tmp_path / "history").read_text()
    assert terminal("\x1b[A\r", 1) == ["What is prefill?"]  # arrow up in a new chat recalls it


class _Chat:
    """`topk chat` in a subprocess with piped stdin/stdout; its output (stderr, where the prompts go
    when piped, merged in) gathered by a reader thread."""

    def __init__(self, cache: Path) -> None:
        import threading

        env = dict(os.environ, PYTHONPATH=str(REPO), TOPK_CHAT_HISTORY="")
        env.pop("TOPK_DEBUG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "topk_decode", "chat", str(cache), "--device", "cpu", "--max-new-tokens", "6"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.out = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read1(4096):
            self.out += chunk

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def wait_for(self, text: str, count: int = 1, timeout: float = 300.0) -> float:
        """Seconds until `text` has appeared `count` times in the output (fails after `timeout`)."""
        import time

        t0 = time.monotonic()
        while self.out.decode(errors="replace").count(text) < count:
            assert self.proc.poll() is None or self.reader.is_alive(), self.text()
            assert time.monotonic() - t0 < timeout, f"no {text!r} after {timeout} s:\n{self.text()[-2000:]}"
            time.sleep(0.05)
        return time.monotonic() - t0

    def finish(self) -> str:
        self.proc.stdin.close()
        self.proc.wait(timeout=300)
        self.reader.join(timeout=10)
        return self.text()

    def text(self) -> str:
        return self.out.decode(errors="replace")


def _answers(transcript: str) -> list[str]:
    return [part.split("\n", 1)[0].strip() for part in transcript.split("topk> ")[1:]]


@pytest.mark.slow
def test_first_ctrl_c_during_a_long_question_abandons_it_at_once_and_keeps_the_conversation(cache):
    """A question of ~60K tokens takes far longer than the bound below; the first Ctrl-C ends it within
    seconds, and the next question is answered as in a fresh chat (the window is exactly as before)."""
    chat = _Chat(cache)
    chat.wait_for("Type /help")
    chat.send("What does the fox do?\n")  # one turn first: the abandoned question follows it
    chat.wait_for("topk> ")
    chat.wait_for("you> ", count=2)
    chat.send("the lazy dog " * 20000 + "\n")  # BPE of the tiny tokenizer: ~60K tokens
    chat.wait_for("topk> ", count=2)  # the question is going through the model
    import time

    time.sleep(1.0)
    chat.proc.send_signal(signal.SIGINT)
    assert chat.wait_for("(question abandoned; the conversation is as it was before it)", timeout=30) < 30
    chat.send("And then?\n/bye\n")
    out = chat.finish()
    assert chat.proc.returncode == 0, out
    assert "conversation reset" not in out

    ref = _Chat(cache)
    ref.send("What does the fox do?\nAnd then?\n/bye\n")
    ref_out = ref.finish()
    ours, theirs = _answers(out), _answers(ref_out)
    assert len(ours) == 3 and len(theirs) == 2, (out, ref_out)
    assert ours[0] == theirs[0] and ours[2] == theirs[1] and ours[2], (out, ref_out)
