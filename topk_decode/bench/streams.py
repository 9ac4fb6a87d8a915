"""`topk bench --streams`: S concurrent answers over one cache, run as `topk serve` runs requests.

Each stream is a conversation on its own thread. Its prompt goes through the model in turns with the running
answers' steps (serve/turns.py: pieces of at most `prompt_chunk_tokens` tokens), then it takes `steps` greedy
one-token steps, batched with the other streams' where the server batches them (a StepBatcher, decode/batch.py, over
a strategy whose rows are independent: flat). No end of turn stops a stream: each generates exactly `steps` tokens.

Per row (a stream count S), measured from the moment the streams start:
- `tokens_per_s`: the streams' generated tokens over the row's wall time (their start to the last token, prompts
  included);
- each stream's time to first token (TTFT: its prompt, and its wait for a turn) and inter-token latency (ITL: the
  gaps between its tokens), as p50/p99 over the row (`ttft_ms_*`, `itl_ms_*`) and per stream (`per_stream`).

With `long_prompt` = T, each stream count gets a second row in which one more stream sends a T-token prompt first;
the S short streams start as its first piece begins (a whole piece ahead of them: the worst time to arrive), so their
TTFT and ITL are those of requests arriving during a long prompt. `prompt_chunk_tokens` ≥ T is the server as it was
before pieces (issue 53): the long prompt in one step, the short streams waiting for all of it. That row adds the long prompt's prefill time (`long_prefill_s`, to its first token), the short
streams' ITL over the gaps that ended before it (`itl_during_long_ms_*`), and `short_first_tokens_before_long`:
whether every short stream had its first token before the long prompt had its own.

Over a cache (`--cache`: its model and real weights) the tokens are the tokenizer's; over a named shape the weights and
the context KV are random and the rows are timing only (`timing_only`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from topk_decode.errors import TopkError
from topk_decode.serve.turns import PROMPT_CHUNK_TOKENS, PromptTurns
from topk_decode.store.format import check_kv_dtype

SHORT_PROMPT = 24  # tokens of each short stream's prompt (a short question)
FILLER = " the harbour and the ledger"  # the long prompt's text over a cache, repeated to T tokens


@dataclass
class StreamsConfig:
    """What one `topk bench --streams` run measures.

    Args:
        streams: the stream counts S, one row each (two with `long_prompt`).
        steps: tokens each stream generates (greedy, no end-of-turn stop).
        long_prompt: T > 0: each stream count also runs with one more stream sending a T-token prompt; 0: not.
        prompt_chunk_tokens: most prompt tokens run between two steps of the running answers (serve/turns.py).
        cache: a cache directory, decoded with its own model and weights; None: `model` and `context`.
        model: a named shape (random weights) or a checkpoint, over `context` tokens of random KV (no `cache`).
        context: the random KV's length.
        kv_dtype: "int8": the named shape's random KV stored in 8 bits, as `topk prefill --kv-dtype int8` stores a
            cache's; None: the model's dtype (a cache keeps its own).
        k, strategy, strategy_options: the decoding's.
        device, dtype: None: the cache's defaults (CUDA when available; bf16 there, fp32 on the CPU).
        gpu_memory: a GPU budget in bytes for the named shape (None: whole GPU).
        out: directory for bench_streams_<name>.json.
    """

    streams: list[int]
    steps: int = 16
    long_prompt: int = 0
    prompt_chunk_tokens: int = PROMPT_CHUNK_TOKENS
    cache: str | None = None
    model: str = "llama-3-8b"
    context: int = 32768
    kv_dtype: str | None = None
    k: int = 1024
    strategy: str = "flat"
    strategy_options: dict = field(default_factory=dict)
    device: str | None = None
    dtype: str | None = None
    gpu_memory: int | None = None
    out: str = "bench-results"

    def validate(self) -> None:
        """Raise TopkError on options that cannot work."""
        if not self.streams or min(self.streams) < 1:
            raise TopkError("--streams must list stream counts of at least 1, e.g. 1,2,4,8")
        if self.steps < 1 or self.k < 1 or self.prompt_chunk_tokens < 1:
            raise TopkError("--steps, --k and --prompt-chunk-tokens must be positive")
        if self.long_prompt < 0:
            raise TopkError(f"--long-prompt must be a token count ≥ 0, got {self.long_prompt}")
        if self.cache is not None and not Path(self.cache).is_dir():
            raise TopkError(f"--cache {self.cache}: no such cache directory")
        if self.cache is None and self.context < 128:
            raise TopkError("the context must be at least 128 tokens")
        check_kv_dtype(self.kv_dtype)
        if self.cache is not None and self.kv_dtype is not None:
            raise TopkError(
                "--kv-dtype applies to a named shape's random KV; a cache keeps the KV dtype it was made with"
            )
        from topk_decode.index import check_requested_strategy

        check_requested_strategy(self.strategy)


@dataclass
class Target:
    """What the streams decode over: the decoder, token ids to prompt with, and what it is."""

    decoder: object
    prompt: Callable[[int, int], list[int]]  # (stream number, tokens) → that stream's prompt
    name: str
    what: str
    timing_only: bool
    close: Callable[[], None]


def open_target(cfg: StreamsConfig) -> Target:
    """The decoder of a cache (its model, real weights) or of a named shape (random weights, random KV)."""
    if cfg.cache is not None:
        from topk_decode.api import KVStore

        store = KVStore.open(
            cfg.cache,
            k=cfg.k,
            strategy=cfg.strategy,
            strategy_options=cfg.strategy_options,
            device=cfg.device,
            dtype=cfg.dtype,
        )
        tok = store.tokenizer
        filler = tok(FILLER, add_special_tokens=False).input_ids

        def prompt(i: int, n: int) -> list[int]:
            ids = tok(f"Question {i}: what do the documents say about item {i}?", add_special_tokens=False).input_ids
            ids = ids if n > len(ids) else []
            return (ids + filler * (1 + n // len(filler)))[:n]

        name = Path(cfg.cache).resolve().name
        what = f"cache {cfg.cache} ({store.ckv.n_tokens:,} tokens, model {store.ckv.manifest['model']['path']})"
        return Target(store.decoder, prompt, name, what, False, store.close)
    from topk_decode.bench.measure import set_gpu_budget
    from topk_decode.bench.shapes import build_model, has_real_weights
    from topk_decode.bench.synthetic import synthetic_kv
    from topk_decode.config import DecodeConfig
    from topk_decode.decode.engine import TopKDecoder
    from topk_decode.model.blocks import ModelShape
    from topk_decode.prefill.build import parse_dtype, pick_device

    device = pick_device(cfg.device)
    dtype = parse_dtype(cfg.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(cfg.model, device, dtype)
    shape = ModelShape.from_config(model.config)
    ckv = synthetic_kv(shape.n_layers, shape.n_kv_heads, shape.head_dim, cfg.context, dtype, kv_dtype=cfg.kv_dtype)
    if cfg.gpu_memory and device.type == "cuda":
        set_gpu_budget(device, cfg.gpu_memory)
    config = DecodeConfig(k=cfg.k, strategy=cfg.strategy, strategy_options=dict(cfg.strategy_options))
    decoder = TopKDecoder(model, ckv, config)
    vocab = shape.vocab_size

    def prompt(i: int, n: int) -> list[int]:
        return [(7 + 13 * i + j) % vocab for j in range(n)]

    weights = "real weights" if has_real_weights(cfg.model) else "random weights"
    kv = f" stored in {cfg.kv_dtype}" if cfg.kv_dtype else ""
    what = f"{cfg.model} ({weights}), random KV of {cfg.context:,} tokens{kv}: timing only"
    return Target(decoder, prompt, Path(cfg.model).name, what, True, decoder.close)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, linearly interpolated between ranks; None when empty."""
    return float(np.percentile(values, q)) if values else None


class _Stream:
    """One stream's thread: its prompt in turns, then `steps` greedy tokens; its token times."""

    def __init__(self, decoder, turns: PromptTurns, prompt: list[int], steps: int) -> None:
        self.decoder, self.turns, self.prompt, self.steps = decoder, turns, prompt, steps
        self.conv = decoder.new_conversation()
        self.t0: float | None = None
        self.times: list[float] = []
        self.error: BaseException | None = None
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        d, conv = self.decoder, self.conv
        try:
            self.go.wait()
            self.t0 = time.perf_counter()
            last = self.turns.feed(d, conv, self.prompt)
            with self.turns.turn():
                tok = int(torch.argmax(d.forward(last, conv)))
                self.times.append(time.perf_counter())
            with self.turns.running(conv):
                for _ in range(self.steps - 1):
                    self.turns.between_steps()
                    tok = int(torch.argmax(d.forward([tok], conv)))
                    self.times.append(time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - reported by the row
            self.error = e
        finally:
            if d.batcher is not None:
                d.batcher.leave(conv)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 2)


def run_row(decoder, prompt, streams: int, steps: int, long_prompt: int, chunk: int) -> dict:
    """Run S short streams (and a long prompt first, when `long_prompt` > 0) to their end; the row's figures."""
    from topk_decode.decode.batch import StepBatcher

    turns = PromptTurns(chunk)
    shorts = [_Stream(decoder, turns, prompt(i, SHORT_PROMPT), steps) for i in range(streams)]
    long = _Stream(decoder, turns, prompt(streams, long_prompt), 1) if long_prompt else None
    total = streams + (long is not None)
    batcher = StepBatcher(max_batch=total) if total > 1 and decoder.strategy.rows_independent else None
    if batcher is not None:
        batcher.attach([decoder])
    try:
        for s in shorts + ([long] if long else []):
            s.thread.start()
        if long is not None:  # the short streams arrive as the long prompt's first piece begins: a whole piece ahead
            long.go.set()
            while not turns.busy and long.thread.is_alive():
                time.sleep(0.001)
        for s in shorts:
            s.go.set()
        for s in shorts + ([long] if long else []):
            s.thread.join()
    finally:
        decoder.batcher = None
    for s in shorts + ([long] if long else []):
        if s.error is not None:
            raise s.error
    start = min(s.t0 for s in shorts)
    ttft = [s.times[0] - s.t0 for s in shorts]
    gaps = [g for s in shorts for g in s.gaps]
    wall = max(s.times[-1] for s in shorts) - start
    row = {
        "streams": streams,
        "long_prompt_tokens": long_prompt,
        "prompt_chunk_tokens": chunk,
        "steps": steps,
        "tokens_generated": sum(len(s.times) for s in shorts),
        "batching": batcher is not None,
        "mean_batch": round(batcher.stepped / batcher.batches, 2) if batcher is not None and batcher.batches else 1.0,
        "tokens_per_s": round(sum(len(s.times) for s in shorts) / wall, 2),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_max": _ms(max(ttft)),
        "itl_ms_p50": _ms(percentile(gaps, 50)),
        "itl_ms_p99": _ms(percentile(gaps, 99)),
        "wall_s": round(wall, 2),
        "per_stream": [
            {
                "tokens": len(s.times),
                "ttft_ms": _ms(s.times[0] - s.t0),
                "itl_ms_p50": _ms(percentile(s.gaps, 50)),
                "itl_ms_p99": _ms(percentile(s.gaps, 99)),
            }
            for s in shorts
        ],
    }
    if long is not None:
        long_first = long.times[0]
        during = [b - a for s in shorts for a, b in zip(s.times, s.times[1:]) if b < long_first]
        row.update(
            long_prefill_s=round(long_first - long.t0, 2),
            short_first_tokens_before_long=all(s.times[0] < long_first for s in shorts),
            itl_during_long_count=len(during),
            itl_during_long_ms_p50=_ms(percentile(during, 50)),
            itl_during_long_ms_p99=_ms(percentile(during, 99)),
            turns_waited_out=turns.waited_out,
        )
    return row


def _warm(decoder, prompt, batched: bool) -> None:
    """Untimed: one stream's prompt and two tokens (and two streams' batched steps), the first steps' one-time costs
    (CUDA graphs, torch.compile, the search's first allocations)."""
    run_row(decoder, prompt, 1, 2, 0, PROMPT_CHUNK_TOKENS)
    if batched:
        run_row(decoder, prompt, 2, 2, 0, PROMPT_CHUNK_TOKENS)


def run_streams(cfg: StreamsConfig, log: Callable[[str], None] = print) -> dict:
    """Every row of the run, each logged as one JSON line and written to bench_streams_<name>.json."""
    cfg.validate()
    target = open_target(cfg)
    try:
        d = target.decoder
        limit = d.config.max_window_tokens
        if cfg.long_prompt + 1 > limit or SHORT_PROMPT + cfg.steps > limit:
            raise TopkError(
                f"--long-prompt {cfg.long_prompt} does not fit: a conversation may add at most {limit} tokens after "
                "the context (max_window_tokens)"
            )
        from topk_decode.bench.run import environment

        env = environment(d.device)
        data = {
            "config": asdict(cfg),
            "what": target.what,
            "timing_only": target.timing_only,
            "strategy": d.config.strategy,
            "device": str(d.device),
            "dtype": str(d.dtype).removeprefix("torch."),
            "environment": env,
            "rows": [],
        }
        log(f"{target.what}; strategy {d.config.strategy}, k={cfg.k}, {d.device}, {data['dtype']}")
        path = Path(cfg.out) / f"bench_streams_{target.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        _warm(d, target.prompt, max(cfg.streams) > 1 or cfg.long_prompt > 0)
        for n in cfg.streams:
            for long in [0, cfg.long_prompt] if cfg.long_prompt else [0]:
                row = run_row(d, target.prompt, n, cfg.steps, long, cfg.prompt_chunk_tokens)
                row["timing_only"] = target.timing_only
                data["rows"].append(row)
                path.write_text(json.dumps(data, indent=1))
                log(json.dumps({k: v for k, v in row.items() if k != "per_stream"}))
        data["path"] = str(path)
        return data
    finally:
        target.close()
