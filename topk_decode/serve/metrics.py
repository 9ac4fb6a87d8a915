"""What `topk serve` reports: Prometheus metrics (GET /metrics) and one log line per request.

The metrics live in the server's own registry (not prometheus_client's global one), so several
servers in one process (the tests) never share or clash. Counters end in `_total` on the wire.
"""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LOG = logging.getLogger("topk_decode.serve")
# seconds: from a few ms (short prompt on a GPU) to minutes (a long prompt on a CPU, or a long queue)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SEARCH_MS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)
TOKENS_PER_S_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's Prometheus metrics; `watch(worker)` adds the queue gauges. Requests carry the model id
    they named (empty for requests that named none, such as /health), and so does every decoding metric."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "topk_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status", "model"],
            registry=r,
        )
        self.queue = Gauge("topk_queue_depth", "Requests preparing or waiting for the decoder", registry=r)
        self.running = Gauge("topk_running", "Requests being decoded (at most --max-batch, together)", registry=r)
        self.ttft = Histogram(
            "topk_time_to_first_token_seconds",
            "From a generation request's arrival to its first generated text",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "topk_prompt_tokens",
            "Prompt tokens as usage.prompt_tokens counts them: the cached documents' and the request's own "
            "(its messages after the chat template, or its prompt)",
            ["model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "topk_cached_tokens",
            "Of topk_prompt_tokens, the cached documents' (usage.prompt_tokens_details.cached_tokens): "
            "the difference is what ran through the model",
            ["model"],
            registry=r,
        )
        self.completion_tokens = Counter("topk_completion_tokens", "Tokens generated", ["model"], registry=r)
        self.decode_seconds = Counter(
            "topk_decode_seconds",
            "Seconds from each answer's first generated text to its "
            "end (tokens after the first / this = decode tokens/s)",
            ["model"],
            registry=r,
        )
        self.tokens_per_second = Histogram(
            "topk_decode_tokens_per_second",
            "Each answer's decode speed after its first token",
            ["model"],
            buckets=TOKENS_PER_S_BUCKETS,
            registry=r,
        )
        self.steps = Counter(
            "topk_steps",
            "Decoder steps of each request (one generated token, or one piece of a prompt: --prompt-chunk-tokens); "
            "a batched step counts once for each request in it",
            ["model"],
            registry=r,
        )
        self.search_seconds = Counter(
            "topk_search_seconds",
            "Seconds of top-k search on the CPU, over all steps (a search shared by a batch: each request its share)",
            ["model"],
            registry=r,
        )
        self.search_ms = Histogram(
            "topk_search_ms_per_step",
            "Each request's mean top-k search time per decoder step, in ms",
            ["model"],
            buckets=SEARCH_MS_BUCKETS,
            registry=r,
        )
        self.keys_read = Counter(
            "topk_keys_read",
            "Context keys read from the CPU store (retrieved keys summed over steps, layers and heads)",
            ["model"],
            registry=r,
        )
        self.recomputed_steps = Counter(
            "topk_recomputed_steps",
            "One-token steps whose logits were not finite, computed again on the exact path (a bug to report)",
            ["model"],
            registry=r,
        )

    def watch(self, worker) -> None:
        """Read the queue gauges from `worker` at each scrape; every served model's series start at 0."""
        self.queue.set_function(lambda: worker.waiting)
        self.running.set_function(lambda: worker.running)
        for model in worker.stores:
            for metric in (
                self.ttft,
                self.prompt_tokens,
                self.cached_tokens,
                self.completion_tokens,
                self.decode_seconds,
                self.tokens_per_second,
                self.steps,
                self.search_seconds,
                self.search_ms,
                self.keys_read,
                self.recomputed_steps,
            ):
                metric.labels(model)

    def decoded(
        self,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        decode_s: float,
        stats,
        cached_tokens: int = 0,
    ) -> None:
        """Count one request's decoding.

        Args:
            model: the model id (cache) it asked.
            prompt_tokens: its usage.prompt_tokens: the cached documents' tokens and its own.
            completion_tokens: tokens it generated.
            ttft_s: seconds from its arrival to its first text (None: it produced none).
            decode_s: seconds from its first text to its end.
            stats: its conversation's StepStats (steps, search seconds, keys retrieved, steps recomputed).
            cached_tokens: of prompt_tokens, the cached documents' (its usage's cached_tokens).
        """
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.cached_tokens.labels(model).inc(cached_tokens)
        self.completion_tokens.labels(model).inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
        self.decode_seconds.labels(model).inc(decode_s)
        if completion_tokens > 1 and decode_s > 0:
            self.tokens_per_second.labels(model).observe((completion_tokens - 1) / decode_s)
        self.steps.labels(model).inc(stats.steps)
        self.search_seconds.labels(model).inc(stats.search_s)
        if stats.steps:
            self.search_ms.labels(model).observe(1e3 * stats.search_s / stats.steps)
        self.keys_read.labels(model).inc(stats.retrieved)
        self.recomputed_steps.labels(model).inc(stats.recomputed)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
