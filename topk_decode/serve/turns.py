"""Turns on one model between prompts and running answers, so that no request waits behind a long prompt.

Every step holds the model's step lock (decode/engine.py). A prompt went through the model as one step, so a long
prompt held the lock for its whole prefill and every other request over that model waited behind it, a short
question's prompt and the running answers' next tokens alike (issue 53: a short question waited 52 s behind a
100,000-character one on a 2-core CPU). Releasing the lock between chunks is not enough by itself: Python's locks
are not fair, and a thread that releases one and takes it again at once usually gets it back before the threads
waiting for it wake up.

`PromptTurns` feeds a prompt in pieces of at most `chunk_tokens` tokens, each its own step, and gives the pieces
turns (docs/SERVE.md "Scheduling"):

- one prompt piece at a time; prompts waiting for a turn are served in order of arrival, and a prompt that has had
  a piece goes to the back of the line, so a short prompt waits for at most one piece of each prompt ahead of it;
- before a piece runs, every running answer (`running`: a conversation between its first token and its last) has
  taken one step since the last piece ended, batched together where the model has a batcher (decode/batch.py); a
  safety net, `max_wait_s`, lets the piece go anyway if one has not;
- while a piece runs, the running answers wait for it (`between_steps`), or their steps, taking the unfair lock again
  and again, would keep the piece out.

One iteration is one step of each running answer plus at most `chunk_tokens` tokens of one prompt. The last piece
of a prompt gives its answer's first token: the caller runs it inside `turn()`; `feed` runs the pieces before it.
Each piece attends exactly to everything before it, so the answer is the one a single step gives, up to float
rounding where pieces end inside one of the decoder's own prompt chunks (`prompt_chunk`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from topk_decode.errors import StepCancelled

PROMPT_CHUNK_TOKENS = 64  # prompt tokens per turn by default (`topk serve --prompt-chunk-tokens`)
MAX_WAIT_S = 5.0  # longest wait for the running answers' steps before a piece goes anyway (a safety net)
POLL_S = 0.002  # how often the next piece looks at the running answers' step counts
CANCEL_POLL_S = 0.1  # how often a request waiting for a turn (or for a piece to end) looks at its cancel flag


def check_chunk_tokens(value) -> int:
    """`value` if it is a positive integer, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"prompt_chunk_tokens must be a positive integer, got {value!r}")
    return value


class PromptTurns:
    """The turns of one model's prompt pieces (one per step lock: every cache over that model shares it).

    Args:
        chunk_tokens: most prompt tokens fed in one turn.
        max_wait_s: longest wait for the running answers' steps before a piece goes anyway.
    """

    def __init__(self, chunk_tokens: int = PROMPT_CHUNK_TOKENS, max_wait_s: float = MAX_WAIT_S) -> None:
        self.chunk_tokens = check_chunk_tokens(chunk_tokens)
        self.max_wait_s = max_wait_s
        self.cond = threading.Condition()
        self.line: deque[object] = deque()  # the prompts waiting for a turn, in order
        self.busy = False  # a turn is taken
        self.answers: dict[int, object] = {}  # id → the running answers' conversations
        self.marks: dict[int, int] = {}  # id of a running answer → its step count when the last turn ended
        self.turns = 0  # turns given (counts)
        self.waited_out = 0  # turns that went without every running answer's step (max_wait_s)

    def feed(self, decoder, conv, ids: list[int], should_stop: Callable[[], bool] | None = None) -> list[int]:
        """Run every piece of the prompt `ids` but its last through the decoder, one turn each; return the last
        piece (1 to `chunk_tokens` tokens), for the caller to run inside `turn()` with its first token.

        Args:
            decoder: the TopKDecoder; conv: the conversation the prompt continues.
            ids: the prompt's tokens.
            should_stop: polled while waiting for a turn (and by the decoder within a piece, through
                `conv.should_stop`): True raises StepCancelled.
        """
        n = self.chunk_tokens
        head = (len(ids) - 1) // n * n
        for start in range(0, head, n):
            with self.turn(should_stop):
                decoder.forward(ids[start : start + n], conv)
        return ids[head:]

    @contextmanager
    def turn(self, should_stop: Callable[[], bool] | None = None) -> Iterator[None]:
        """Hold the model's next prompt turn: wait for the prompts ahead and for the running answers' steps.

        Args:
            should_stop: polled while waiting: True raises StepCancelled (the place in line is given up).
        """
        self._take(should_stop)
        try:
            yield
        finally:
            self._give()

    @contextmanager
    def running(self, conv) -> Iterator[None]:
        """`conv` is answering (its first token is out): each turn waits for one step of it."""
        with self.cond:
            self.answers[id(conv)] = conv
        try:
            yield
        finally:
            with self.cond:
                self.answers.pop(id(conv), None)
                self.marks.pop(id(conv), None)
                self.cond.notify_all()

    def between_steps(self, should_stop: Callable[[], bool] | None = None) -> None:
        """A running answer calls this between two of its steps: it returns once no prompt piece holds the turn (at
        once if none does), or when `should_stop` says so (the next step then raises StepCancelled)."""
        with self.cond:
            while self.busy and not (should_stop is not None and should_stop()):
                self.cond.wait(CANCEL_POLL_S)

    def _stepped(self) -> bool:
        """Whether every running answer has stepped since the last turn ended."""
        return all(c.stats.steps > self.marks[i] for i, c in self.answers.items() if i in self.marks)

    def _take(self, should_stop: Callable[[], bool] | None) -> None:
        me = object()
        with self.cond:
            self.line.append(me)
            try:
                deadline = None
                while True:
                    if should_stop is not None and should_stop():
                        raise StepCancelled("the request was cancelled while waiting for its prompt's turn")
                    if self.line[0] is me and not self.busy:
                        if self._stepped():
                            break
                        now = time.monotonic()
                        deadline = deadline or now + self.max_wait_s
                        if now >= deadline:
                            self.waited_out += 1
                            break
                        self.cond.wait(POLL_S)
                    else:
                        self.cond.wait(CANCEL_POLL_S)
                self.busy = True
            finally:
                self.line.remove(me)
                self.cond.notify_all()

    def _give(self) -> None:
        with self.cond:
            self.busy = False
            self.turns += 1
            self.marks = {i: c.stats.steps for i, c in self.answers.items()}
            self.cond.notify_all()
