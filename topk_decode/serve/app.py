"""The ASGI app: OpenAI's /v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}, plus /health,
/metrics, /v1/passage (the text around an answer's source) and the chat page at / (`webui/`, unless turned off).

Every served cache is a model id; a request's `model` picks its cache. Each request is a fresh
conversation over that cache's documents (the client sends the whole history, as with OpenAI); see
decode/messages.py for how it is laid out after them. `DecodeWorker` decodes up to `max_batch`
requests at once, their one-token steps together; the event loop only reads (up to the body limit),
parses, queues and streams. `Access` (outside the routes) checks the API key, counts each answer by status
and logs one line per request; CORS, when enabled, sits outside it (a preflight carries no key). A client
that leaves while sending its body is answered 499 (nobody reads it) and logged as such, not as a server error.
The chat page's own files are served without the key (they hold nothing from the documents: the page asks for
the key and sends it with its API calls), with a Content-Security-Policy that lets the page reach this server only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from topk_decode.serve.metrics import CONTENT_TYPE, LOG, Metrics
from topk_decode.serve.passages import AROUND_TOKENS, MAX_AROUND, passage
from topk_decode.serve.schemas import (
    MAX_BODY_MB,
    APIError,
    GenerationRequest,
    model_not_found,
    parse_json,
    parse_request,
    served_model,
    too_large,
)
from topk_decode.serve.turns import PROMPT_CHUNK_TOKENS
from topk_decode.serve.worker import MAX_BATCH, WATCH_S, DecodeWorker, Job

OPEN_PATHS = ("/health",)  # answered without the API key: liveness probes carry no credentials
QUIET_PATHS = ("/health", "/metrics")  # polled every few seconds: logged only when they fail
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/passage")
WEBUI_DIR = Path(__file__).parent / "webui"  # the chat page's files (package data)
# the page's files: path → (file, media type); served without the key when the web UI is on
WEBUI_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
# the page may load its own files and call this server, nothing else (no other host, no inline script, no frames)
WEBUI_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
PASSAGE_PARAMS = ("model", "document", "start", "end", "around")
MODEL_ROUTE = "/v1/models/{model}"  # GET /v1/models/ID: counted under this route, whatever the id
CLIENT_CLOSED = 499  # nginx's "client closed request": the status of a request whose client left before its answer
SENDING_GONE = "client disconnected while sending its request"


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


def batching(max_batch: int) -> str:
    """The batching policy in words (/health, the start-up line)."""
    if max_batch == 1:
        return "serial queue, batch 1"
    return f"up to {max_batch} answers at once, their one-token steps decoded together"


class Server:
    """The app's state: the stores behind a worker, the served model ids and limits.

    Args:
        stores: model id → opened KVStore, in the order GET /v1/models lists them (the id is what clients
            pass as `model`).
        max_tokens_limit: the largest max_tokens a request may ask for.
        default_max_tokens: max_tokens when a request gives none.
        max_queue: requests waiting or running beyond which new ones get a 429.
        max_body_mb: request bodies past this many MB get a 413, before they are read in full.
        api_key: requests must carry `Authorization: Bearer API_KEY` (all but /health and the chat page's files);
            None: no key.
        cors_origins: browser origins allowed to call the API (CORS); empty: none.
        max_batch: requests decoded at once, their one-token steps batched (1: one at a time).
        watch_s: how often each cache's path is checked for a version grown by `topk prefill --append`
            (`DecodeWorker`); `stores` then follows the versions served.
        prompt_chunk_tokens: most prompt tokens run between two steps of the running answers (serve/turns.py).
        webui: serve the chat page at / (False: / is a 404, as any unknown path; the API is the same).
    """

    def __init__(
        self,
        stores: dict,
        max_tokens_limit: int = 4096,
        default_max_tokens: int = 256,
        max_queue: int = 64,
        max_body_mb: float = MAX_BODY_MB,
        api_key: str | None = None,
        cors_origins: tuple[str, ...] = (),
        max_batch: int = MAX_BATCH,
        watch_s: float | None = WATCH_S,
        prompt_chunk_tokens: int = PROMPT_CHUNK_TOKENS,
        webui: bool = True,
    ) -> None:
        if not stores:
            raise ValueError("a server needs at least one store")
        self.stores = dict(stores)
        self.model_ids = list(self.stores)
        self.max_body_bytes = int(max_body_mb * 2**20)
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = min(default_max_tokens, max_tokens_limit)
        self.api_key = api_key
        self.cors_origins = tuple(cors_origins)
        self.webui = webui
        self.open_paths = OPEN_PATHS + (tuple(WEBUI_FILES) if webui else ())
        self._passage_tokenizers: dict = {}  # model id → a tokenizer copy of its own, for /v1/passage
        self.metrics = Metrics()
        self.worker = DecodeWorker(
            self.stores,
            max_queue=max_queue,
            metrics=self.metrics,
            max_batch=max_batch,
            watch_s=watch_s,
            prompt_chunk_tokens=prompt_chunk_tokens,
        )
        self.stores = self.worker.stores  # the versions served: the worker swaps in a cache grown by --append
        self.metrics.watch(self.worker)
        self.created = int(time.time())

    # ---- plain endpoints --------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        """GET /health: liveness, the batching policy, the queue and the served models."""
        w = self.worker
        body = {
            "status": "ok",
            "batching": batching(w.max_batch),
            "prompt_chunk_tokens": w.prompt_chunk_tokens,
            "queue": w.waiting,
            "running": w.running,
            "served": w.served,
            "cancelled": w.cancelled,
            "batched_steps": sum(b.batches for b in w.batchers),
            "batched_requests": sum(b.stepped for b in w.batchers),
            "models": [
                {"id": name, "context_tokens": s.ckv.n_tokens, "documents": len(s.documents)}
                for name, s in self.stores.items()
            ],
        }
        if len(self.stores) == 1:  # one cache: its facts at the top level too (as before several were served)
            body.update(
                model=self.model_ids[0],
                context_tokens=body["models"][0]["context_tokens"],
                documents=body["models"][0]["documents"],
            )
        return JSONResponse(body)

    async def prometheus(self, request: Request) -> Response:
        """GET /metrics: the Prometheus text format (metrics.py)."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(self, name: str) -> dict:
        """A served cache as an OpenAI model object, with its document count, tokens and strategy (fields
        OpenAI's lacks)."""
        s = self.stores[name]
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "topk-decode",
            "documents": len(s.documents),
            "context_tokens": s.ckv.n_tokens,
            "strategy": s.config.strategy,
        }

    async def models(self, request: Request) -> JSONResponse:
        """GET /v1/models: every served cache."""
        return JSONResponse({"object": "list", "data": [self.model_card(name) for name in self.model_ids]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id} (the openai client's `models.retrieve`): the cache as /v1/models lists it, or the
        404 `model_not_found` a generation request naming an unknown model gets."""
        name = request.path_params["model"]
        if name not in self.stores:
            return _error(model_not_found(name, self.model_ids))
        request.state.model = name  # the metrics' model label (only for a served id: the label set stays bounded)
        return JSONResponse(self.model_card(name))

    async def passage(self, request: Request) -> Response:
        """GET /v1/passage?model=ID&document=NAME&start=T&end=T&around=N: the text of a cache's document around
        context tokens [start, end) (a source's `span`), bounded (serve/passages.py); 4xx JSON on bad input."""
        query = request.query_params
        try:
            unknown = sorted(set(query) - set(PASSAGE_PARAMS))
            if unknown:
                raise APIError(
                    400,
                    f"unknown parameter {unknown[0]!r}; GET /v1/passage takes {', '.join(PASSAGE_PARAMS)}",
                    param=unknown[0],
                    code="unknown_parameter",
                )
            name = served_model(query.get("model"), self.model_ids)
            request.state.model = name
            document = query.get("document")
            if not document:
                raise APIError(
                    400,
                    "document is required: a name from the answer's sources",
                    param="document",
                    code="missing_required_parameter",
                )
            start, end = _int_param(query, "start"), _int_param(query, "end")
            around = _int_param(query, "around")
            around = AROUND_TOKENS if around is None else around
            if around > MAX_AROUND:
                raise APIError(400, f"around must be in 0..{MAX_AROUND}, got {around}", param="around")
            store = self.stores[name]
            if name not in self._passage_tokenizers:  # the decoding threads use the store's own
                self._passage_tokenizers[name] = copy.deepcopy(store.tokenizer)
            body = passage(store, self._passage_tokenizers[name], document, start, end, around)
        except APIError as e:
            return _error(e)
        return JSONResponse({**body, "model": name})

    async def page(self, request: Request) -> Response:
        """GET / and the page's files (webui/): the chat page."""
        name, media_type = WEBUI_FILES[request.url.path]
        return Response((WEBUI_DIR / name).read_bytes(), media_type=media_type, headers=WEBUI_HEADERS)

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
        except ClientDisconnect:  # nobody to answer: Access logs it (one line) and counts it as a 499
            request.state.gone = SENDING_GONE
            return Response(status_code=CLIENT_CLOSED)
        except APIError as e:
            return _error(e)
        try:
            req = parse_request(parse_json(raw), kind, self.model_ids, self.max_tokens_limit, self.default_max_tokens)
            job = Job(
                req,
                asyncio.get_running_loop(),
                id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            )
            request.state.job = job  # for the log line (Access)
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
        if kind_ == "done":  # cancelled before it started: the client is gone, nobody reads this
            return JSONResponse({}, status_code=CLIENT_CLOSED)
        if req.stream:
            return _Stream(self._events(job, req, job.id), job)
        return await self._collect(request, job, req, job.id)

    async def _collect(self, request: Request, job: Job, req: GenerationRequest, ident: str) -> JSONResponse:
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        parts, entries = [], []
        try:
            while True:
                kind_, value = await job.queue.get()
                if kind_ == "text":
                    parts.append(value[0])
                    entries += value[1]
                elif kind_ == "error":
                    return _error(value)
                else:
                    break
        finally:
            watcher.cancel()
        text, info = "".join(parts), value
        logprobs = _logprobs(req, entries, 0)
        if req.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": info["finish_reason"],
                "logprobs": logprobs,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": info["finish_reason"], "logprobs": logprobs}
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion" if req.kind == "chat" else "text_completion",
                "created": int(time.time()),
                "model": req.model,
                "choices": [choice],
                "usage": _usage(info),
                "sources": info["sources"],
            }
        )

    async def _events(self, job: Job, req: GenerationRequest, ident: str):
        """OpenAI's chunk stream: role, content deltas, a last chunk with finish_reason (and our sources)."""
        chat = req.kind == "chat"
        base = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
        }

        def chunk(delta: dict | str, finish: str | None = None, logprobs: dict | None = None, **extra) -> str:
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": delta}
            choice.update(finish_reason=finish, logprobs=logprobs)
            return _sse({**base, "choices": [choice], **extra})

        if chat:
            yield chunk({"role": "assistant", "content": ""})
        offset = 0  # characters of the completion so far: completions' text_offset
        while True:
            kind_, value = await job.queue.get()
            if kind_ == "text":
                text, entries = value
                yield chunk({"content": text} if chat else text, logprobs=_logprobs(req, entries, offset))
                offset += sum(len(e["token"]) for e in entries)
            elif kind_ == "error":  # the answer has started: report in-band, as OpenAI does
                yield f"data: {value.json()}\n\n"
                break
            else:
                yield chunk({} if chat else "", value["finish_reason"], sources=value["sources"])
                if req.include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(value)})
                break
        yield "data: [DONE]\n\n"


def _int_param(query, name: str) -> int | None:
    """A query parameter that must be a non-negative integer (None when absent; APIError otherwise)."""
    value = query.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        raise APIError(400, f"{name} must be a non-negative integer, got {value[:40]!r}", param=name)
    return int(value)


def _logprobs(req: GenerationRequest, entries: list[dict], offset: int) -> dict | None:
    """A choice's logprobs in the request's shape: chat's {"content": [...]}, or completions' parallel lists
    (tokens, token_logprobs, top_logprobs, text_offset from `offset`); None when not asked for."""
    if req.logprobs is None:
        return None
    if req.kind == "chat":
        return {"content": entries, "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _usage(info: dict) -> dict:
    """OpenAI's usage: prompt_tokens are the cached documents' tokens plus the request's own (its messages after
    the chat template, or its prompt), cached_tokens the documents' (as OpenAI reports a prompt cache hit)."""
    return {
        "prompt_tokens": info["prompt_tokens"],
        "completion_tokens": info["completion_tokens"],
        "total_tokens": info["prompt_tokens"] + info["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": info["cached_tokens"]},
    }


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to pass `limit` bytes (declared or received);
    ClientDisconnect if the client leaves before it has sent it all."""
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


class Access:
    """ASGI middleware: the API key check (401 in OpenAI's shape), the request counter by status, and one
    log line per request (id, method, path, status, model, prompt, cached and completion tokens, finish, seconds;
    or why the client left).

    Args:
        app: the app inside.
        server: the Server (its api_key and metrics).
    """

    def __init__(self, app, server: Server) -> None:
        self.app, self.server = app, server
        self.key = server.api_key.encode() if server.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, path, status = time.perf_counter(), scope["path"], 500
        state = scope.setdefault("state", {})

        async def send_(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.key is not None and path not in self.server.open_paths and not self.authorized(scope):
                denied = _error(unauthorized(scope))
                denied.headers["WWW-Authenticate"] = "Bearer"
                await denied(scope, receive, send_)
            else:
                await self.app(scope, receive, send_)
        finally:
            job: Job | None = state.get("job")
            model = job.request.model if job is not None else state.get("model", "")
            self.server.metrics.requests.labels(_route(path), str(status), model).inc()
            if not ((path in QUIET_PATHS or path in self.server.open_paths) and status < 400):
                line = f"{job.id if job is not None else '-'} {scope['method']} {path} {status}"
                if job is not None:
                    line += (
                        f" model={model} prompt_tokens={job.prompt_tokens} cached_tokens={job.cached_tokens} "
                        f"completion_tokens={job.completion_tokens} finish={job.finish or '-'}"
                    )
                if "gone" in state:
                    line += f" {state['gone']}"
                LOG.info("%s seconds=%.3f", line, time.perf_counter() - t0)

    def authorized(self, scope) -> bool:
        """Whether the request carries `Authorization: Bearer <the key>` (compared in constant time)."""
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def _route(path: str) -> str:
    """The metrics' route label of a path: a route's own path, MODEL_ROUTE for /v1/models/ID, /ui/ for the chat page's
    files, else "other"."""
    if path in ROUTES:
        return path
    if path.startswith("/ui/") and path in WEBUI_FILES:
        return "/ui/"
    return MODEL_ROUTE if path.startswith("/v1/models/") else "other"


def unauthorized(scope) -> APIError:
    """The 401 OpenAI answers a missing or wrong key with."""
    given = b"authorization" in dict(scope["headers"])
    message = (
        "Incorrect API key provided"
        if given
        else "You didn't provide an API key; send it as the header Authorization: Bearer KEY"
    )
    return APIError(401, message, code="invalid_api_key")


def create_app(server: Server) -> Starlette:
    """The Starlette app over a `Server`.

    Args:
        server: the state (store, worker, model id, limits, key, CORS origins).
    """
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),  # an id may hold a slash (org/name)
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/passage", server.passage, methods=["GET"]),
    ]
    if server.webui:
        routes += [Route(path, server.page, methods=["GET"]) for path in WEBUI_FILES]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.worker.close()

    middleware = [Middleware(Access, server=server)]
    if server.cors_origins:  # outermost: a browser's preflight (OPTIONS, no key) is answered here
        middleware.insert(
            0,
            Middleware(
                CORSMiddleware,
                allow_origins=list(server.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
            ),
        )
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
