"""The ASGI app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus /health.

Each request is a fresh conversation over the cached documents (the client sends the whole
history, as with OpenAI); see decode/messages.py for how it is laid out after them. Requests are
decoded one at a time by `DecodeWorker`; the event loop only reads (up to the body limit), parses,
queues and streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from topk_decode.serve.schemas import MAX_BODY_MB, APIError, GenerationRequest, parse_json, parse_request, too_large
from topk_decode.serve.worker import DecodeWorker, Job

BATCHING = "serial queue, batch 1"


def _error(e: APIError) -> Response:
    return Response(e.json(), status_code=e.status, media_type="application/json")


class _Stream(StreamingResponse):
    """A StreamingResponse that cancels its job however the response ends (done, client gone, error)."""

    def __init__(self, content, job: Job) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Server:
    """The app's state: the store behind a worker, the served model id and limits.

    Args:
        store: the opened KVStore.
        model_id: the name clients pass as `model` (GET /v1/models lists it).
        max_tokens_limit: the largest max_tokens a request may ask for.
        default_max_tokens: max_tokens when a request gives none.
        max_queue: requests waiting or running beyond which new ones get a 429.
        max_body_mb: request bodies past this many MB get a 413, before they are read in full.
    """

    def __init__(self, store, model_id: str, max_tokens_limit: int = 4096, default_max_tokens: int = 256,
                 max_queue: int = 64, max_body_mb: float = MAX_BODY_MB) -> None:
        self.store = store
        self.model_id = model_id
        self.max_body_bytes = int(max_body_mb * 2 ** 20)
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = min(default_max_tokens, max_tokens_limit)
        self.worker = DecodeWorker(store, max_queue=max_queue)
        self.created = int(time.time())

    # ---- plain endpoints --------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        """GET /health: liveness, the batching policy and the queue."""
        w = self.worker
        return JSONResponse({"status": "ok", "model": self.model_id, "batching": BATCHING,
                             "queue": w.waiting, "running": w.running, "served": w.served, "cancelled": w.cancelled,
                             "context_tokens": self.store.ckv.n_tokens, "documents": len(self.store.documents)})

    async def models(self, request: Request) -> JSONResponse:
        """GET /v1/models: the one model this server serves."""
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "topk-decode"}]})

    # ---- generation ---------------------------------------------------------------------------------
    async def chat(self, request: Request):
        """POST /v1/chat/completions."""
        return await self._generate(request, "chat")

    async def completions(self, request: Request):
        """POST /v1/completions."""
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, kind: str):
        try:
            raw = await read_body(request, self.max_body_bytes)
            req = parse_request(parse_json(raw), kind, self.model_id, self.max_tokens_limit, self.default_max_tokens)
            job = Job(req, asyncio.get_running_loop())
            self.worker.submit(job)
        except APIError as e:
            return _error(e)
        # until the answer starts, watch for the client leaving (the response's own watch starts later)
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        try:
            kind_, value = await job.queue.get()
        finally:
            watcher.cancel()
        if kind_ == "error":
            return _error(value)
        if kind_ == "done":     # cancelled before it started: the client is gone, nobody reads this
            return JSONResponse({}, status_code=499)
        ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return _Stream(self._events(job, req, ident), job)
        return await self._collect(request, job, req, ident)

    async def _collect(self, request: Request, job: Job, req: GenerationRequest, ident: str) -> JSONResponse:
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        parts = []
        try:
            while True:
                kind_, value = await job.queue.get()
                if kind_ == "text":
                    parts.append(value)
                elif kind_ == "error":
                    return _error(value)
                else:
                    break
        finally:
            watcher.cancel()
        text, info = "".join(parts), value
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": info["finish_reason"], "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": info["finish_reason"], "logprobs": None}
        return JSONResponse({"id": ident, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                             "created": int(time.time()), "model": self.model_id, "choices": [choice],
                             "usage": _usage(info), "sources": info["sources"]})

    async def _events(self, job: Job, req: GenerationRequest, ident: str):
        """OpenAI's chunk stream: role, content deltas, a last chunk with finish_reason (and our sources)."""
        chat = req.kind == "chat"
        base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id}

        def chunk(delta: dict | str, finish: str | None = None, **extra) -> str:
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": delta}
            choice.update(finish_reason=finish, logprobs=None)
            return _sse({**base, "choices": [choice], **extra})

        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            kind_, value = await job.queue.get()
            if kind_ == "text":
                yield chunk({"content": value} if chat else value)
            elif kind_ == "error":      # the answer has started: report in-band, as OpenAI does
                yield f"data: {value.json()}\n\n"
                break
            else:
                yield chunk({} if chat else "", value["finish_reason"], sources=value["sources"])
                if req.include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(value)})
                break
        yield "data: [DONE]\n\n"


def _usage(info: dict) -> dict:
    return {"prompt_tokens": info["prompt_tokens"], "completion_tokens": info["completion_tokens"],
            "total_tokens": info["prompt_tokens"] + info["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": info["cached_tokens"]}}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to pass `limit` bytes (declared or received)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large(limit)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (the body has been read: only a disconnect can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def create_app(server: Server) -> Starlette:
    """The Starlette app over a `Server`.

    Args:
        server: the state (store, worker, model id, limits).
    """
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.worker.close()

    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error},
                     lifespan=lifespan)
