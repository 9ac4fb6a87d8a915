"""`topk serve CACHE [CACHE ...]`: the caches behind an OpenAI-compatible HTTP API (topk_decode/serve/),
each a model id; caches made with one model share it (loaded once)."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from topk_decode.cli.common import (
    KOption,
    KScheduleOption,
    PromptChunkTokensOption,
    StrategyOption,
    StrategyOptOption,
    ThreadsOption,
    check_device,
    check_positive,
    console,
    parse_options,
    say_note,
    use_threads,
)
from topk_decode.config import DecodeConfig
from topk_decode.errors import TopkError
from topk_decode.serve.schemas import MAX_BODY_MB
from topk_decode.serve.turns import PROMPT_CHUNK_TOKENS
from topk_decode.serve.worker import MAX_BATCH

API_KEY_ENV = "TOPK_API_KEY"


def serve_command(
    cache: Annotated[
        list[Path],
        typer.Argument(
            help="Cache directories written by `topk prefill`: each is a model "
            "id (its folder name), picked by a request's `model`. A cache grown by `topk prefill --append` "
            "meanwhile is served to new requests within seconds, without a restart."
        ),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free port, printed at start).")] = 8000,
    k: KOption = DecodeConfig.k,
    strategy: StrategyOption = DecodeConfig.strategy,
    k_schedule: KScheduleOption = DecodeConfig.k_schedule,
    opt: StrategyOptOption = None,
    model_name: Annotated[
        list[str] | None,
        typer.Option(help="The model id clients pass, once per cache in order (default: each cache's folder name)."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Answer length when a request sets no max_tokens.")] = 256,
    max_tokens_limit: Annotated[int, typer.Option(help="The largest max_tokens a request may ask for.")] = 4096,
    max_queue: Annotated[int, typer.Option(help="Requests waiting or running beyond which new ones get a 429.")] = 64,
    max_batch: Annotated[
        int,
        typer.Option(
            help="Requests decoded at once, their one-token steps in one batched model step (1: one request at a time)."
        ),
    ] = MAX_BATCH,
    prompt_chunk_tokens: PromptChunkTokensOption = PROMPT_CHUNK_TOKENS,
    max_body_mb: Annotated[float, typer.Option(help="Request bodies past this many MB get a 413.")] = MAX_BODY_MB,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir (default: the one the cache records).")] = None,
    device: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda when available).")] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU).")] = None,
    n_sink: Annotated[
        int, typer.Option(help="First context tokens kept in the exact GPU window.")
    ] = DecodeConfig.n_sink,
    n_tail: Annotated[
        int, typer.Option(help="Last context tokens kept in the exact GPU window.")
    ] = DecodeConfig.n_tail,
    compile: Annotated[
        bool, typer.Option("--compile/--no-compile", help="On CUDA, compile the one-token step.")
    ] = DecodeConfig.compile,
    threads: ThreadsOption = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_default=False,
            help="Requests must send Authorization: Bearer KEY (all but /health get a 401 without it).",
        ),
    ] = None,
    allow_no_key: Annotated[
        bool,
        typer.Option(
            "--allow-no-key",
            help="Listen beyond loopback without --api-key: anyone who can reach the address can use the server.",
        ),
    ] = False,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option(help="A browser origin allowed to call the API, e.g. https://app.example.com, or * (repeatable)."),
    ] = None,
    webui: Annotated[
        bool,
        typer.Option(
            "--webui/--no-webui",
            help="Serve the chat page at / (answers with their sources; the API key asked in the page). "
            "--no-webui: / is a 404; the API is the same either way.",
        ),
    ] = True,
) -> None:
    """Serve caches over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models; /health, /metrics) and a
    chat page at /."""
    check_positive("k", k)
    check_positive("--max-batch", max_batch)
    check_positive("--prompt-chunk-tokens", prompt_chunk_tokens)
    check_positive("--max-tokens", max_tokens)
    check_positive("--max-tokens-limit", max_tokens_limit)
    check_positive("--max-queue", max_queue)
    if not 0 < max_body_mb < float("inf"):
        raise TopkError(f"--max-body-mb must be a positive number, got {max_body_mb}")
    check_device(device)
    use_threads(threads)
    if not 0 <= port <= 65535:
        raise TopkError(f"--port must be in 0..65535, got {port}")
    if n_sink < 0 or n_tail < 0:
        raise TopkError("--n-sink and --n-tail must be ≥ 0")
    options = parse_options(opt)
    check_access(host, api_key, allow_no_key)
    origins = check_origins(cors_origin or [])

    from topk_decode.index import check_requested_strategy
    from topk_decode.store.cache_dir import check_cache

    check_requested_strategy(strategy)  # an unknown name fails before the model loads
    # so does a missing or truncated cache; neither check imports torch
    fingerprints = [check_cache(c)[0]["model"]["fingerprint"] for c in cache]
    names = model_ids(cache, model_name or [])
    import uvicorn

    from topk_decode.serve.app import Server, batching, create_app

    # bind first: a taken port is one error line before minutes of loading, not a log line after
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TopkError(f"cannot listen on {host}:{port}: {e.strerror}") from None

    from topk_decode.api import KVStore

    stores: dict[str, KVStore] = {}
    loaded: dict[str, KVStore] = {}  # model fingerprint → the first store that loaded it
    asked = dict(
        k=k,
        k_schedule=k_schedule,
        strategy=strategy,
        model=model,
        device=device,
        dtype=dtype,
        n_sink=n_sink,
        n_tail=n_tail,
        strategy_options=options,
        compile=compile,
    )
    for name, path, fp in zip(names, cache, fingerprints):
        stores[name] = KVStore.open(path, **asked, share_model=loaded.get(fp))
        loaded.setdefault(fp, stores[name])
    server = Server(
        stores,
        max_tokens_limit=max_tokens_limit,
        default_max_tokens=max_tokens,
        max_queue=max_queue,
        max_body_mb=max_body_mb,
        api_key=api_key,
        cors_origins=origins,
        max_batch=max_batch,
        prompt_chunk_tokens=prompt_chunk_tokens,
        webui=webui,
    )
    server.worker.warm_up()
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    served = ", ".join(
        f"{path} as model '{name}' ({stores[name].ckv.n_tokens:,} tokens, strategy {stores[name].config.strategy})"
        for name, path in zip(names, cache)
    )
    shared = (
        f"; {len(cache)} caches over {len(loaded)} loaded model{'s' if len(loaded) > 1 else ''}"
        if len(cache) > 1
        else ""
    )
    console().print(
        f"serving {served} on http://{shown}:{bound}/v1 (k={k}{shared}; {batching(max_batch)}; prompts "
        f"{prompt_chunk_tokens} tokens at a time between steps). Ctrl-C stops.",
        markup=False,
        soft_wrap=True,
    )
    if webui:
        console().print(f"chat page: http://{shown}:{bound}/", markup=False, soft_wrap=True)
    if api_key is None and not loopback(host):
        say_note("the server has no API key (--allow-no-key): anyone who can reach this address can use it")
    log_requests()

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # end the answers in progress first, or the graceful shutdown waits for them to finish
            server.worker.close()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(server), log_level="warning", timeout_graceful_shutdown=5)
    _Uvicorn(config).run(sockets=[sock])


def model_ids(caches: list[Path], names: list[str]) -> list[str]:
    """Each cache's model id: `names` (one per cache) if given, else its folder name, with as many parent
    folders as needed to tell apart caches whose folders share a name (TopkError for a cache given twice)."""
    if names:
        if len(names) != len(caches):
            raise TopkError(
                f"--model-name is given {len(names)} times for {len(caches)} caches: give it once per "
                f"cache, in order, or not at all"
            )
        if len(set(names)) != len(names) or not all(n.strip() for n in names):
            raise TopkError("--model-name values must be distinct and not empty")
        return list(names)
    paths = [Path(c).resolve() for c in caches]
    if len(set(paths)) != len(paths):
        twice = next(str(p) for p in paths if paths.count(p) > 1)
        raise TopkError(f"the cache {twice} is given twice")
    depth = [1] * len(paths)
    while True:
        ids = ["/".join(p.parts[-d:]) for p, d in zip(paths, depth)]
        clash = [i for i, name in enumerate(ids) if ids.count(name) > 1]
        if not clash:
            return ids
        for i in clash:
            depth[i] += 1


def loopback(host: str) -> bool:
    """Whether `host` is this machine only (localhost or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_access(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """A usable API key, and none needed only on loopback unless --allow-no-key says so (else TopkError)."""
    if api_key is not None and not (api_key and api_key.isascii() and api_key.isprintable() and " " not in api_key):
        raise TopkError(f"--api-key (or {API_KEY_ENV}) must be printable ASCII without spaces, not empty")
    if api_key is None and not allow_no_key and not loopback(host):
        raise TopkError(
            f"--host {host} reaches beyond this machine: pass --api-key KEY (or set {API_KEY_ENV}), "
            f"or --allow-no-key to serve without one"
        )


def check_origins(origins: list[str]) -> tuple[str, ...]:
    """The --cors-origin values, each `*` or scheme://host[:port] (a browser's Origin never has a path)."""
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise TopkError(
                f"--cors-origin must be * or an origin like https://app.example.com (no path, no "
                f"trailing slash), got {o!r}"
            )
    return tuple(origins)


def log_requests() -> None:
    """The one line per request (serve/metrics.py's logger) to stderr, with the time."""
    from topk_decode.serve.metrics import LOG

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
