"""serve/turns.py: a long prompt goes through the model in pieces that take turns with the other prompts and with
the running answers' steps, so no request waits behind a whole long prompt (issue 53).

Every test here is about order (which piece or step runs before which), never about how long anything takes.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from topk_decode.errors import StepCancelled
from topk_decode.serve.turns import PromptTurns

WAIT = 30  # seconds any wait for another thread may take before the test fails (a loaded CI box)


class Conv:
    """A conversation as PromptTurns sees it: a name and a step count."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = SimpleNamespace(steps=0)


class Decoder:
    """A decoder that logs its steps, one at a time under a step lock as the real one; `gate` (if set) holds a
    conversation's first prompt piece until it is set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[str, int]] = []
        self.gates: dict[str, threading.Event] = {}
        self.inside: dict[str, threading.Event] = {}

    def forward(self, ids: list[int], conv: Conv) -> None:
        with self.lock:
            if conv.name in self.gates and conv.stats.steps == 0:
                self.inside.setdefault(conv.name, threading.Event()).set()
                assert self.gates[conv.name].wait(WAIT)
            self.log.append((conv.name, len(ids)))
            conv.stats.steps += 1


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.mark.parametrize(
    "n, fed, last",
    [(1, [], 1), (4, [], 4), (5, [4], 1), (9, [4, 4], 1), (12, [4, 4], 4), (13, [4, 4, 4], 1)],
)
def test_feed_runs_every_whole_piece_but_the_last_and_returns_the_last(n, fed, last):
    turns, d, conv = PromptTurns(4), Decoder(), Conv("a")
    ids = list(range(n))
    rest = turns.feed(d, conv, ids)
    assert [k for _, k in d.log] == fed and rest == ids[n - last :] and turns.turns == len(fed)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_chunk_that_is_not_a_positive_integer_is_refused(bad):
    with pytest.raises(ValueError, match="prompt_chunk_tokens must be a positive integer"):
        PromptTurns(bad)


def test_a_short_prompt_waits_for_one_piece_of_a_long_one_not_for_all_of_it():
    turns, d = PromptTurns(4), Decoder()
    long, short = Conv("long"), Conv("short")
    d.gates["long"] = threading.Event()
    feeder = threading.Thread(target=lambda: d.forward(turns.feed(d, long, list(range(40))), long))
    feeder.start()
    until(lambda: "long" in d.inside and d.inside["long"].is_set(), "the long prompt's first piece never started")

    def ask() -> None:
        with turns.turn():
            d.forward(list(range(3)), short)

    asker = threading.Thread(target=ask)
    asker.start()
    until(lambda: len(turns.line) == 1, "the short prompt never got in line")
    d.gates["long"].set()  # the long prompt's first piece ends; it gets back in line behind the short one
    feeder.join(WAIT)
    asker.join(WAIT)
    assert d.log[:3] == [("long", 4), ("short", 3), ("long", 4)]
    assert sum(k for name, k in d.log if name == "long") == 40


def test_two_long_prompts_take_turns_piece_by_piece():
    turns, d = PromptTurns(4), Decoder()
    a, b = Conv("a"), Conv("b")
    d.gates["a"] = threading.Event()
    ta = threading.Thread(target=lambda: turns.feed(d, a, list(range(13))))
    ta.start()
    until(lambda: "a" in d.inside, "a's first piece never started")
    tb = threading.Thread(target=lambda: turns.feed(d, b, list(range(13))))
    tb.start()
    until(lambda: len(turns.line) == 1, "b never got in line")
    d.gates["a"].set()
    ta.join(WAIT)
    tb.join(WAIT)
    assert [name for name, _ in d.log] == ["a", "b", "a", "b", "a", "b"]


def test_every_running_answer_steps_between_two_pieces():
    turns, d = PromptTurns(4), Decoder()
    answers = [Conv("x"), Conv("y")]
    stop = threading.Event()

    def answer(conv: Conv) -> None:
        with turns.running(conv):
            while not stop.is_set():
                turns.between_steps()
                d.forward([1], conv)

    threads = [threading.Thread(target=answer, args=(c,)) for c in answers]
    for t in threads:
        t.start()
    until(lambda: all(c.stats.steps > 0 for c in answers), "the answers never stepped")
    prompt = Conv("prompt")
    rest = turns.feed(d, prompt, list(range(4 * 6 + 1)))
    stop.set()
    for t in threads:
        t.join(WAIT)
    assert len(rest) == 1
    pieces = [i for i, (name, _) in enumerate(d.log) if name == "prompt"]
    assert len(pieces) == 6
    for i, j in zip(pieces, pieces[1:]):  # between two pieces, a step of each running answer
        assert {"x", "y"} <= {name for name, _ in d.log[i + 1 : j]}, d.log[i : j + 1]
    assert turns.waited_out == 0


def test_a_running_answer_waits_while_a_piece_holds_the_turn():
    turns = PromptTurns(4)
    taken, release, passed = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with turns.turn():
            taken.set()
            assert release.wait(WAIT)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(WAIT)
    stepper = threading.Thread(target=lambda: (turns.between_steps(), passed.set()))
    stepper.start()
    until(lambda: stepper.is_alive(), "the answer never started")
    assert not passed.is_set()  # (it may not have reached the wait yet; it must not have passed it)
    release.set()
    holder.join(WAIT)
    assert passed.wait(WAIT)
    turns.between_steps()  # no piece: at once


def test_a_piece_goes_anyway_when_a_running_answer_does_not_step():
    turns, d = PromptTurns(4, max_wait_s=0.05), Decoder()
    stalled = Conv("stalled")
    with turns.running(stalled):
        turns.feed(d, Conv("prompt"), list(range(13)))  # three pieces: the second and third wait out
    assert turns.turns == 3 and turns.waited_out == 2


def test_a_prompt_cancelled_while_in_line_gives_up_its_place():
    turns, d = PromptTurns(4), Decoder()
    cancel, out = threading.Event(), []

    def wait_in_line() -> None:
        try:
            turns.feed(d, Conv("late"), list(range(9)), should_stop=cancel.is_set)
        except StepCancelled as e:
            out.append(e)

    with turns.turn():
        t = threading.Thread(target=wait_in_line)
        t.start()
        until(lambda: len(turns.line) == 1, "the prompt never got in line")
        cancel.set()
        t.join(WAIT)
    assert out and not turns.line and not d.log and not turns.busy


def test_pieces_give_the_answer_of_one_step(built_cache):
    """Fed in pieces of 8 tokens (the decoder's own chunks are 512), a prompt gives the logits of one step within
    float rounding, and the same greedy tokens after it."""
    from topk_decode.api import KVStore

    with KVStore.open(built_cache[0], device="cpu") as store:
        d = store.decoder
        prompt = [(5 + 7 * j) % 200 + 3 for j in range(61)]

        def greedy(conv, logits, n=6) -> list[int]:
            out = [int(torch.argmax(logits))]
            for _ in range(n - 1):
                out.append(int(torch.argmax(d.forward([out[-1]], conv))))
            return out

        whole_conv = d.new_conversation()
        whole = d.forward(prompt, whole_conv)
        conv = d.new_conversation()
        turns = PromptTurns(8)
        rest = turns.feed(d, conv, prompt)
        with turns.turn():
            pieces = d.forward(rest, conv)
        assert len(rest) == 5 and turns.turns == 8 and conv.stats.steps == 8
        torch.testing.assert_close(pieces, whole, atol=1e-4, rtol=1e-4)
        assert greedy(conv, pieces) == greedy(whole_conv, whole)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_topk_serve_with_a_bad_prompt_chunk_is_one_error_line(tmp_path, value):
    from topk_decode.cli.app import app

    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--prompt-chunk-tokens", value, "--device", "cpu"])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --prompt-chunk-tokens must be a positive integer, got {value}"
