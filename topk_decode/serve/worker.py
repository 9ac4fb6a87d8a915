"""One decoding thread that serves requests one at a time (batch 1), off the event loop.

Each request becomes a `Job`: the worker thread renders and tokenizes its prompt, decodes, and
hands events to the request's asyncio queue (`start`, then `text` pieces, then `done`, or one
`error`). Tokenizers and the store are only ever touched by this thread, and under the store lock,
so concurrent clients can never mix their conversations. A job whose client went away is
cancelled: it is skipped if still queued and stops at its next token if running.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from topk_decode.errors import TopkError
from topk_decode.serve.schemas import APIError, GenerationRequest


class StopText:
    """Cuts the streamed text at the first stop sequence, holding back what could be the start of one.

    Args:
        stops: the stop sequences (may be empty).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop sequence was reached).

        Args:
            piece: the next piece of decoded text.
        """
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        cut = len(self.buf) - self.hold
        out, self.buf = (self.buf[:cut], self.buf[cut:]) if cut > 0 else ("", self.buf)
        return out, False

    def flush(self) -> str:
        """What was held back, at the end of the answer (no stop sequence came)."""
        out, self.buf = self.buf, ""
        return out


@dataclass(eq=False)   # compared and hashed by identity (kept in a set)
class Job:
    """One request's generation: its events go to `queue` on the event loop."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value) -> None:
        """Hand an event to the request's coroutine (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:   # the event loop is closed (server gone): nobody is waiting for this
            pass

    def cancel(self) -> None:
        """The client is gone: skip the job if queued, stop it at its next token if running."""
        self.cancelled.set()


class DecodeWorker:
    """The serial queue in front of the store.

    Args:
        store: the opened KVStore.
        max_queue: jobs waiting or running beyond which new requests get a 429.
    """

    def __init__(self, store, max_queue: int = 64) -> None:
        self.store = store
        self.max_queue = max_queue
        self.lock = threading.Lock()          # the store and its tokenizer: one request at a time
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="topk-decode")
        self._count = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.served = 0
        self.cancelled = 0   # jobs stopped early because their client went away
        self.current: Job | None = None
        self.pending: set[Job] = set()
        self.closing = False

    def submit(self, job: Job) -> None:
        """Queue a job (429 when the queue is full, 503 once shutting down).

        Args:
            job: the request's job.
        """
        with self._count:
            if self.waiting + self.running >= self.max_queue:
                raise APIError(429, f"the queue is full ({self.max_queue} requests); retry later",
                               code="queue_full", type="rate_limit_error")
            if self.closing:
                raise _shutting_down()
            self.waiting += 1
            self.pending.add(job)
        self._pool.submit(self._run, job)

    def warm_up(self) -> None:
        """Decode two tokens on the decoding thread, so that the one-time work of the first step
        (torch.compile, CUDA graph capture) happens before the first request, on the thread that will
        replay it."""
        def run() -> None:
            with self.lock:
                ids = self.store.tokenizer("Hello", add_special_tokens=False).input_ids
                self.store.generate_ids(ids, max_new_tokens=2)

        self._pool.submit(run).result()

    def close(self) -> None:
        """Server shutdown: queued jobs get a 503, the running one stops at its next token."""
        with self._count:
            self.closing = True
            pending, self.pending = list(self.pending), set()
        for job in pending:
            job.cancel()
            job.emit("error", _shutting_down())
        self._pool.shutdown(wait=False, cancel_futures=True)
        if (job := self.current) is not None:
            job.cancel()

    def _run(self, job: Job) -> None:
        with self._count:
            if job not in self.pending:   # close() has answered it already
                return
            self.pending.discard(job)
            self.waiting -= 1
            self.running += 1
        try:
            if job.cancelled.is_set():
                with self._count:
                    self.cancelled += 1
                job.emit("done", None)
                return
            with self.lock:
                self.current = job
                self._generate(job)
        except APIError as e:
            job.emit("error", e)
        except TopkError as e:
            job.emit("error", APIError(400, str(e), code="invalid_value"))
        except Exception as e:  # noqa: BLE001 - a failing request must not take the worker down
            job.emit("error", APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        finally:
            self.current = None
            with self._count:
                self.running -= 1
                self.served += 1

    def _generate(self, job: Job) -> None:
        req, store = job.request, self.store
        session = store.session(temperature=req.temperature, top_p=req.top_p, seed=req.seed, sources=True)
        if req.kind == "chat":
            from topk_decode.decode.messages import conversation_text

            text = conversation_text(req.messages, store.prompt_format, store.tokenizer)
        else:
            text = req.prompt
        n_prompt = session.count_tokens(text)
        n_context = store.ckv.n_tokens
        limit = store.decoder.shape.max_positions
        if n_context + n_prompt + req.max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the cached documents "
                                f"({n_context}) + the prompt ({n_prompt}) + max_tokens ({req.max_tokens}) exceed it",
                           param="max_tokens" if n_context + n_prompt < limit else "messages",
                           code="context_length_exceeded")
        pieces = session.complete(text, req.max_tokens)
        job.emit("start", None)
        stopper, finish = StopText(req.stop), None
        started = req.kind != "chat"   # a chat answer starts at its first non-space character
        try:
            for piece in pieces:
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if not started:
                    piece = piece.lstrip()
                    started = bool(piece)
                out, hit = stopper.feed(piece)
                if out:
                    job.emit("text", out)
                if hit:
                    finish = "stop"
                    break
            else:
                if tail := stopper.flush():
                    job.emit("text", tail)
        finally:
            pieces.close()   # stops decoding: the conversation is thrown away with the session
        if finish == "cancelled":
            with self._count:
                self.cancelled += 1
            if self.closing:      # the client is still there: tell it why the answer ends here
                job.emit("error", _shutting_down())
                return
        job.emit("done", {"finish_reason": finish or session.finish_reason or "length",
                          "prompt_tokens": n_context + n_prompt, "cached_tokens": n_context,
                          "completion_tokens": session.n_generated, "sources": session.sources})


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutdown", type="server_error")
