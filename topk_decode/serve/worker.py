"""The decoding threads behind the server, off the event loop: up to `max_batch` answers at a time, their
one-token steps decoded together (decode/batch.py).

Each request becomes a `Job` for one of the served caches (`request.model`). A preparing thread
renders and tokenizes its prompt and checks it against that cache's limits, so an oversized request
is refused without ever reaching the decoder; then a decoding thread decodes it and hands events to
the request's asyncio queue (`start`, then `text` pieces, then `done`, or one `error`). Each job has
its own conversation, so concurrent clients never mix theirs; every step holds the model's step lock
and the one-token steps of the running jobs over one model (whatever their cache) run as one batched
step. A prompt goes through the model in pieces of at most `prompt_chunk_tokens` tokens that take turns with the
running answers' steps (serve/turns.py), so a long prompt delays the others by one piece at a time, not by its
whole prefill. The preparing thread has its own copy of each tokenizer. A job whose client went away is
cancelled: it is skipped if still queued, and if running it stops within a layer of its prompt or at
its next token (the decoder polls `Job.cancelled` through the conversation's `should_stop`). Each
`text` event carries the text and, when the request asked for logprobs, its tokens' OpenAI logprob entries.

A cache grown by `topk prefill --append` (a new version swapped in at its path) is picked up without a restart:
a watching thread looks at each served path every `watch_s` seconds (one stat; the manifest only when the
directory changed), opens a new version with the options the cache was served with, sharing the loaded model,
and swaps it in for requests prepared from then on. A job is bound to the store it was prepared on, so
answers in flight finish on the version they started on; an old version is closed once no job uses it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from topk_decode.errors import NonFiniteLogits, StepCancelled, TopkError
from topk_decode.serve.metrics import LOG
from topk_decode.serve.schemas import APIError, GenerationRequest
from topk_decode.serve.turns import PROMPT_CHUNK_TOKENS, PromptTurns, check_chunk_tokens

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the model gives (almost) no chance; JSON has no -inf
SLICE_CHARS = 1 << 16  # a long prompt is first counted slice by slice, so a huge one is refused early
MAX_BATCH = 8  # answers decoded at once by default (`topk serve --max-batch`)
WATCH_S = 1.0  # how often each served cache's path is checked for a new version (`topk prefill --append`)
RETRY_S = 60.0  # a version that failed to open is tried again after this long, or as soon as the path changes


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
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        cut = len(self.buf) - self.hold
        out, self.buf = (self.buf[:cut], self.buf[cut:]) if cut > 0 else ("", self.buf)
        return out, False

    def flush(self) -> str:
        """What was held back, at the end of the answer (no stop sequence came)."""
        out, self.buf = self.buf, ""
        return out


@dataclass(eq=False)  # compared and hashed by identity (kept in a set)
class Job:
    """One request's generation: its events go to `queue` on the event loop."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ids: list[int] = field(default_factory=list)  # the prompt's tokens, set by the preparing thread
    cached_tokens: int = 0  # the cache's document tokens, set with `ids`
    id: str = "-"  # the response id, for the log line
    t0: float = field(default_factory=time.perf_counter)  # arrival, for the time to first token
    completion_tokens: int = 0  # generated so far (the log line of a request cut short)
    finish: str | None = None  # the finish reason once decoded
    # the KVStore it is answered from, bound when prepared (a version swapped in later does not change it); None
    # before and once the job is over
    store: object = None

    @property
    def prompt_tokens(self) -> int:
        """usage.prompt_tokens, the log's and the metrics': the cached documents' tokens and the request's own
        (its messages after the chat template, or its prompt); 0 before it is prepared."""
        return self.cached_tokens + len(self.ids) if self.ids else 0

    def emit(self, kind: str, value) -> None:
        """Hand an event to the request's coroutine (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed (server gone): nobody is waiting for this
            pass

    def cancel(self) -> None:
        """The client is gone: skip the job if queued, stop it within a layer if running."""
        self.cancelled.set()


def room_of(store) -> int:
    """Tokens a prompt and its answer may take after the store's documents: the window's limit, the model's
    positions."""
    decoder = store.decoder
    return min(decoder.config.max_window_tokens, decoder.shape.max_positions - store.ckv.n_tokens)


def reopen_options(store) -> dict:
    """The `KVStore.open` keywords that open a new version of the store's cache as the store was opened: the
    strategy and options asked for (auto may resolve differently at another length), not the ones resolved."""
    c = store.config
    return dict(
        k=c.k,
        k_per_layer=list(c.k_per_layer) if c.k_per_layer is not None else None,
        k_schedule=c.k_schedule,
        strategy=store.requested_strategy,
        strategy_options=dict(store.requested_options),
        n_sink=c.n_sink,
        n_tail=c.n_tail,
        compile=c.compile,
        prompt_chunk=c.prompt_chunk,
        prompt_scratch_mib=c.prompt_scratch_mib,
        max_window_tokens=c.max_window_tokens,
    )


def _warm(store) -> None:
    """Decode two tokens over the store (the first step's one-time work: torch.compile, CUDA graph capture)."""
    ids = store.tokenizer("Hello", add_special_tokens=False).input_ids
    store.generate_ids(ids, max_new_tokens=2)


def tokenize_within(tokenizer, text: str, limit: int) -> list[int] | None:
    """The token ids of `text`, or None once slices of it clearly hold more than `limit` tokens."""
    if len(text) > SLICE_CHARS:
        # Slices end at a space or newline, where most tokenizers split anyway: their counts add up to
        # the whole text's count give or take a token per cut (the margin), without tokenizing past the limit.
        n, start, cuts = 0, 0, 0
        while start < len(text):
            end = start + SLICE_CHARS
            if end < len(text):
                space = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
                end = space if space > start else end
            n += len(tokenizer(text[start:end], add_special_tokens=False).input_ids)
            cuts += 1
            if n > limit + 2 * cuts:
                return None
            start = end
    return tokenizer(text, add_special_tokens=False).input_ids


class DecodeWorker:
    """The queue in front of the stores, behind a preparing thread.

    Args:
        stores: model id → opened KVStore; stores of one model share it (`KVStore.open(share_model=...)`).
        max_queue: jobs preparing, waiting or running beyond which new requests get a 429.
        metrics: the server's Metrics, told about each decoded request (None: nobody counts).
        max_batch: answers decoded at once, their one-token steps batched (1: one at a time, serially).
        watch_s: seconds between checks of the served paths for a new version of a cache (None: never).
        prompt_chunk_tokens: most prompt tokens that run between two steps of the running answers (serve/turns.py).
    """

    def __init__(
        self,
        stores: dict,
        max_queue: int = 64,
        metrics=None,
        max_batch: int = MAX_BATCH,
        watch_s: float | None = WATCH_S,
        prompt_chunk_tokens: int = PROMPT_CHUNK_TOKENS,
    ) -> None:
        self.prompt_chunk_tokens = check_chunk_tokens(prompt_chunk_tokens)
        self.stores = dict(stores)
        self.max_queue = max_queue
        self.metrics = metrics
        self.max_batch = max_batch
        self.tokenizers: dict[str, object] = {}  # the preparing thread's own copies (decoding threads use the stores')
        self.rooms: dict[str, int] = {}
        copies: dict[int, object] = {}
        for name, store in self.stores.items():
            self.tokenizers[name] = copies.setdefault(id(store.tokenizer), copy.deepcopy(store.tokenizer))
            self.rooms[name] = room_of(store)
        self.batchers = []
        self._batcher_of: dict[int, tuple] = {}  # id of a loaded model → (its caches' batcher, their step lock)
        self._turns_of: dict[int, tuple] = {}  # id of a step lock → (its prompt turns, the lock)
        for store in self.stores.values():
            self._batch(store)
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="topk-prepare")
        self._pool = ThreadPoolExecutor(max_workers=max_batch, thread_name_prefix="topk-decode")
        self._count = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.served = 0
        self.cancelled = 0  # jobs stopped early because their client went away
        self.current: set[Job] = set()
        self.pending: set[Job] = set()
        self.closing = False
        # new versions of the caches (`refresh`): jobs bound to each store, and the stores swapped out but in use
        self._users: dict[object, int] = {}
        self._retired: set = set()
        self._refreshing = threading.Lock()
        self._seen: dict[str, tuple] = {}  # model id → the served path's (device, inode, ctime) last found served
        self._failed: dict[str, tuple] = {}  # model id → (path's key, time, message) of the last version that failed
        self._stop = threading.Event()
        self.watch_s = watch_s
        if watch_s:
            threading.Thread(target=self._watch, name="topk-cache-watch", daemon=True).start()

    def _batch(self, store) -> None:
        """Put the store's one-token steps through its model's batcher (made on first use), when batching pays."""
        # Only a strategy whose rows are independent (flat: one scan serves every conversation) gains from a
        # batched step; routed's, eager and searching per conversation, lost to its serial graph-replayed steps
        # on the GPU host (docs/SERVE.md "Batched decoding").
        if self.max_batch <= 1 or not store.decoder.strategy.rows_independent:
            return
        from topk_decode.decode.batch import StepBatcher

        batcher, lock = self._batcher_of.get(id(store.model), (None, store.decoder.lock))
        if lock is not store.decoder.lock:
            raise ValueError("batched decoders must share one model and one step lock")
        if batcher is None:  # one batcher per loaded model: its caches' steps go through it together
            batcher = StepBatcher(self.max_batch)
            self._batcher_of[id(store.model)] = batcher, lock
            self.batchers.append(batcher)
        batcher.attach([store.decoder])

    def turns(self, store) -> PromptTurns:
        """The prompt turns of the store's model (made on first use; shared by the caches over that model)."""
        lock = store.decoder.lock
        with self._count:
            turns, _ = self._turns_of.setdefault(id(lock), (PromptTurns(self.prompt_chunk_tokens), lock))
        return turns

    def submit(self, job: Job) -> None:
        """Queue a job (429 when the queue is full, 503 once shutting down).

        Args:
            job: the request's job.
        """
        with self._count:
            if self.waiting + self.running >= self.max_queue:
                raise APIError(
                    429,
                    f"the queue is full ({self.max_queue} requests); retry later",
                    code="queue_full",
                    type="rate_limit_error",
                )
            if self.closing:
                raise _shutting_down()
            self.waiting += 1
            self.pending.add(job)
        self._prep.submit(self._prepare, job)

    def warm_up(self) -> None:
        """Decode two tokens over each store on a decoding thread, so that the one-time work of the first
        step (torch.compile, CUDA graph capture) happens before the first request."""

        for store in self.stores.values():
            self._pool.submit(_warm, store).result()

    def close(self) -> None:
        """Server shutdown: queued jobs get a 503, the running one stops within a layer."""
        self._stop.set()
        with self._count:
            self.closing = True
            pending, self.pending = list(self.pending), set()
        for job in pending:
            job.cancel()
            job.emit("error", _shutting_down())
        self._prep.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._count:
            running = list(self.current)
        for job in running:
            job.cancel()

    # ---- a cache grown by `topk prefill --append` --------------------------------------------------------
    def refresh(self, name: str) -> bool:
        """Serve the version now at the cache's path to requests prepared from now on, if it is a new one: open it
        with the cache's options and its store's model (`share_model`), warm it up, swap it in. True if swapped in.

        Cheap when nothing changed (one stat). A version that does not open (not a cache, another model...) leaves
        the one served in place, with one log line; it is tried again once the path changes, or after RETRY_S.

        Args:
            name: the model id.
        """
        with self._refreshing:  # one check at a time: the watcher's, or a caller's
            store, key = self.stores[name], None
            path = store.ckv.path
            if self.closing:
                return False
            try:
                st = os.stat(path)
                key = (st.st_dev, st.st_ino, st.st_ctime_ns)  # a new version is a new directory (CacheWriter.swap)
                if key == self._seen.get(name):
                    return False
                failed = self._failed.get(name)
                if failed is not None and failed[0] == key and time.monotonic() - failed[1] < RETRY_S:
                    return False
                from topk_decode.store.cache_dir import check_cache

                if check_cache(path)[1] == store.ckv.cache_id:  # the same manifest: the version served
                    self._seen[name] = key
                    self._failed.pop(name, None)
                    return False
                new = self._open_version(store)
            except Exception as e:  # noqa: BLE001 - any failure keeps the served version
                self._fail(name, key, e)
                return False
            if not self._swap(name, store, new):
                return False
            self._seen[name] = key  # (a newer version may have come meanwhile: the next check compares manifests)
            self._failed.pop(name, None)
        old_docs = [d["name"] for d in store.documents]
        how = "appended" if [d["name"] for d in new.documents][: len(old_docs)] == old_docs else "replaced"
        LOG.info(
            "cache %s: now %s tokens, %d documents (%s; strategy %s); new requests use it",
            name,
            f"{new.ckv.n_tokens:,}",
            len(new.documents),
            how,
            new.config.strategy,
        )
        return True

    def _open_version(self, store):
        """The cache at the store's path opened as the store was, over its model, and warmed up (here, not on a
        decoding thread: those may all be busy, and the step's one-time work is not tied to a thread)."""
        from topk_decode.api import KVStore

        new = KVStore.open(store.ckv.path, **reopen_options(store), share_model=store)
        try:
            _warm(new)
            self._batch(new)
        except BaseException:
            new.close()
            raise
        return new

    def _swap(self, name: str, old, new) -> bool:
        """Serve `new` for `name`; `old` is closed now if no job uses it, else by the last one's `_release`."""
        with self._count:
            served = not self.closing
            if served:
                self.stores[name], self.rooms[name] = new, room_of(new)
                in_use = bool(self._users.get(old))
                if in_use:
                    self._retired.add(old)
        if not served:
            new.close()
        elif not in_use:
            self._close_store(old)
        return served

    def _release(self, job: Job) -> None:
        """The job is over: its store loses a user, and is closed if it was the last one of a swapped-out store."""
        with self._count:
            store, job.store = job.store, None
            if store is None:
                return
            self._users[store] -= 1
            if self._users[store]:
                return
            del self._users[store]
            if store not in self._retired:
                return
            self._retired.discard(store)
        self._close_store(store)

    def _close_store(self, store) -> None:
        """Close a store no longer served (its search threads stop; its maps go with the last reference)."""
        if any(s is store for s in self.stores.values()):  # also served under another id
            return
        if any(s.model is store.model for s in self.stores.values()):
            # the served stores decode with its model: leave its input embedding where it is (engine.py `close`)
            store.decoder.host_embedding = None
        store.close()

    def _fail(self, name: str, key: tuple | None, e: Exception) -> None:
        """Record a version that failed to open; one log line, unless it is the failure logged last."""
        if isinstance(e, OSError) and e.strerror:
            message = f"cannot read {e.filename or self.stores[name].ckv.path}: {e.strerror}"
        else:
            message = " ".join(str(e).split())  # one line
            message = message if isinstance(e, TopkError) else f"{type(e).__name__}: {message}"
        last = self._failed.get(name)
        self._failed[name] = key, time.monotonic(), message
        if (last is None or last[2] != message) and not self.closing:
            n = self.stores[name].ckv.n_tokens
            LOG.warning(
                "cache %s: a new version cannot be served (%s); still serving the one of %s tokens",
                name,
                message,
                f"{n:,}",
            )

    def _watch(self) -> None:
        """The watching thread: every `watch_s` seconds, each cache's path checked for a new version."""
        while not self._stop.wait(self.watch_s):
            for name in list(self.stores):
                if self._stop.is_set():
                    return
                try:
                    self.refresh(name)
                except Exception as e:  # noqa: BLE001 - the watcher must go on (refresh logs its own failures)
                    self._fail(name, None, e)

    def prompt_ids(self, req: GenerationRequest, store=None, room: int | None = None) -> list[int]:
        """The request's prompt tokens, checked against the room after the documents (else a 400); an unset
        max_tokens is cut to the room left. Runs on the preparing thread (its own tokenizer).

        Args:
            req: the validated request (its max_tokens may be lowered).
            store, room: the store the request is answered from and its room (default: the one served now).
        """
        if store is None:
            store, room = self.stores[req.model], self.rooms[req.model]
        vocab = store.decoder.shape.vocab_size
        if req.logit_bias and max(req.logit_bias) >= vocab:
            raise APIError(
                400,
                f"logit_bias names token {max(req.logit_bias)}; this model's vocabulary has {vocab} tokens",
                param="logit_bias",
                code="invalid_value",
            )
        if req.kind == "chat":
            from topk_decode.decode.messages import conversation_text

            text = conversation_text(req.messages, store.prompt_format, self.tokenizers[req.model])
        else:
            text = req.prompt
        ids = tokenize_within(self.tokenizers[req.model], text, room - 1)
        n_prompt = len(ids) if ids is not None else None
        if ids is not None and not ids:
            raise APIError(400, "the prompt is empty once tokenized", param="prompt", code="invalid_value")
        if ids is not None and not req.max_tokens_given:
            req.max_tokens = max(1, min(req.max_tokens, room - n_prompt))
        if ids is None or n_prompt + req.max_tokens > room:
            n_context, window = store.ckv.n_tokens, store.decoder.config.max_window_tokens
            prompt = f"{n_prompt}" if ids is not None else f"more than {room}"
            if room == window:
                limit = (
                    f"this server takes at most {window} tokens of prompt and answer after the cached "
                    f"documents (max_window_tokens)"
                )
            else:
                limit = (
                    f"this model's maximum context length is {store.decoder.shape.max_positions} tokens, "
                    f"{n_context} of them the cached documents"
                )
            raise APIError(
                400,
                f"{limit}; the prompt ({prompt}) + max_tokens ({req.max_tokens}) exceed it",
                param="max_tokens"
                if ids is not None and n_prompt < room
                else ("messages" if req.kind == "chat" else "prompt"),
                code="context_length_exceeded",
            )
        return ids

    def _leave_queue(self, job: Job) -> bool:
        """Take a job out of the waiting ones; False if close() has answered it already."""
        with self._count:
            if job not in self.pending:
                return False
            self.pending.discard(job)
            self.waiting -= 1
            return True

    def _prepare(self, job: Job) -> None:
        if job.cancelled.is_set():
            if self._leave_queue(job):
                with self._count:
                    self.cancelled += 1
                job.emit("done", None)
            return
        with self._count:  # the version of the cache served now answers the job, whatever is swapped in later
            job.store, room = self.stores[job.request.model], self.rooms[job.request.model]
            self._users[job.store] = self._users.get(job.store, 0) + 1
        try:
            job.ids = self.prompt_ids(job.request, job.store, room)
            job.cached_tokens = job.store.ckv.n_tokens
        except Exception as e:  # noqa: BLE001 - a failing request must not take the thread down
            self._release(job)
            if self._leave_queue(job):
                job.emit("error", _api_error(e))
            return
        try:
            self._pool.submit(self._run, job)
        except RuntimeError:  # shut down meanwhile: close() has answered the job
            self._release(job)

    def _run(self, job: Job) -> None:
        try:
            if not self._leave_queue(job):  # close() has answered it
                return
            with self._count:
                self.running += 1
                self.current.add(job)
            try:
                if job.cancelled.is_set():
                    with self._count:
                        self.cancelled += 1
                    job.emit("done", None)
                    return
                self._generate(job)
            except Exception as e:  # noqa: BLE001 - a failing request must not take the worker down
                job.emit("error", _api_error(e))
            finally:
                with self._count:
                    self.current.discard(job)
                    self.running -= 1
                    self.served += 1
        finally:
            self._release(job)

    def _generate(self, job: Job) -> None:
        req, store = job.request, job.store
        session = store.session(
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=req.logit_bias or None,
            logprobs=req.logprobs,
        )
        from topk_decode.serve.passages import PassageTracker  # torch: `topk serve`'s checks run before it loads

        # the documents it drew on, each with the passage that drew the most (serve/passages.py)
        shape = store.decoder.shape
        session.tracker = PassageTracker(
            store.documents, store.decoder.scale, shape.group_size, shape.n_layers, store.ckv.n_tokens
        )
        session.conv.observer = session.tracker
        session.conv.should_stop = job.cancelled.is_set  # a client that leaves stops the prompt within a layer
        turns = self.turns(store)
        job.emit("start", None)
        stopper, finish = StopText(req.stop), None
        started = req.kind != "chat"  # a chat answer starts at its first non-space character
        first_at, logged = None, 0
        pieces = None
        try:
            # the prompt piece by piece, in turns with the running answers' steps (serve/turns.py); its last piece
            # and the first token in one turn
            last = turns.feed(store.decoder, session.conv, job.ids, job.cancelled.is_set)
            pieces = session.complete(last, req.max_tokens)
            with turns.turn(job.cancelled.is_set):
                first = next(pieces, None)
            with turns.running(session.conv):
                for piece in itertools.chain([] if first is None else [first], pieces):
                    first_at = first_at or time.perf_counter()
                    job.completion_tokens = session.n_generated
                    if job.cancelled.is_set():
                        finish = "cancelled"
                        break
                    if not started:
                        piece = piece.lstrip()
                        started = bool(piece)
                    out, hit = stopper.feed(piece)
                    entries, logged = self._logprobs(store, session, logged)
                    if out or entries:
                        job.emit("text", (out, entries))
                    if hit:
                        finish = "stop"
                        break
                    turns.between_steps(job.cancelled.is_set)  # a prompt piece in progress goes first
                else:
                    tail = stopper.flush()
                    entries, logged = self._logprobs(store, session, logged)
                    if tail or entries:
                        job.emit("text", (tail, entries))
        except StepCancelled:
            finish = "cancelled"
        finally:
            if pieces is not None:
                pieces.close()  # stops decoding: the conversation is thrown away with the session
            end = time.perf_counter()
            job.completion_tokens = session.n_generated
            if self.metrics is not None:
                self.metrics.decoded(
                    req.model,
                    job.prompt_tokens,
                    session.n_generated,
                    first_at and first_at - job.t0,
                    end - first_at if first_at else 0.0,
                    session.conv.stats,
                    cached_tokens=job.cached_tokens,
                )
        job.finish = finish or session.finish_reason or "length"
        if finish == "cancelled":
            with self._count:
                self.cancelled += 1
            if self.closing:  # the client is still there: tell it why the answer ends here
                job.emit("error", _shutting_down())
                return
        job.emit(
            "done",
            {
                "finish_reason": job.finish,
                "prompt_tokens": job.prompt_tokens,
                "cached_tokens": job.cached_tokens,
                "completion_tokens": session.n_generated,
                "sources": session.sources,
            },
        )

    def _logprobs(self, store, session, done: int) -> tuple[list[dict], int]:
        """OpenAI's logprob entries of the tokens picked since the first `done` (none unless asked; the end of
        turn token left out, as its text is), and how many are done now."""
        sampling = session.sampling
        if sampling is None or sampling.logprobs is None:
            return [], done
        tok, eos = store.tokenizer, store.eos_ids
        entries = [
            token_logprob(tok, t, lp, alternatives) for t, lp, alternatives in sampling.picked[done:] if t not in eos
        ]
        return entries, len(sampling.picked)


def token_logprob(tokenizer, token: int, logprob: float, alternatives: list[tuple[int, float]]) -> dict:
    """One token's entry in OpenAI's chat logprobs: token text, logprob, UTF-8 bytes, top_logprobs."""

    def entry(t: int, lp: float) -> dict:
        text = tokenizer.decode([t])  # a token holding part of a character decodes to U+FFFD
        return {"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": list(text.encode("utf-8"))}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in alternatives]}


def _api_error(e: Exception) -> APIError:
    """What a request's failure is answered with: TopkError is the client's (400), anything else (non-finite
    logits included: a broken cache or model) a 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, NonFiniteLogits):
        return APIError(500, str(e), type="server_error")
    if isinstance(e, TopkError):
        return APIError(400, str(e), code="invalid_value")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutdown", type="server_error")
