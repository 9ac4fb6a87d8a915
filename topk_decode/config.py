"""Decode-time configuration: one dataclass, passed explicitly (no globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from topk_decode.errors import TopkError


@dataclass
class DecodeConfig:
    """How a store is decoded.

    Args:
        k: context tokens retrieved per query head and layer (on top of sinks and tail).
        k_per_layer: per-layer budgets; overrides `k` when given (length = number of layers).
        k_schedule: "uniform" (k at every layer) or "linear" (increasing with depth, same total k·L).
        strategy: selection strategy name (see `topk_decode.index.STRATEGIES`), or "auto" (the default:
            exact `flat` on short contexts, `routed` on long ones; index/auto.py). The decoder replaces
            "auto" by the name it resolved to.
        strategy_options: options of that strategy (e.g. {"backend": "torch"} for flat).
        n_sink: first context tokens kept on the GPU with exact attention (attention sinks).
        n_tail: last context tokens kept on the GPU with exact attention (e.g. the chat-template
            prefix of the question and the end of the last document).
        compile: on CUDA, fuse the small ops of each layer's one-token step (norms, RoPE, merge,
            residuals) with torch.compile; the first step pays the compilation (decode/graphs.py).
        prompt_chunk: a longer prompt goes through the model in chunks of this many tokens, each
            attending exactly to everything before it: the step's working memory is bounded by the
            chunk (its window part runs on fused attention kernels, linear in the window) instead of
            growing with the prompt's length squared.
        prompt_scratch_mib: bound on a prompt chunk's search scratch, whose largest part is one score
            per (query head, chunk token, context token), 4 bytes each: over a long context the chunk
            shrinks below prompt_chunk to stay within it (e.g. 1M tokens, 32 query heads: 8 tokens).
        max_window_tokens: most tokens a conversation may add after the context (prompts and
            answers); the window's memory grows linearly with it. A prompt that would pass it is
            refused with a TopkError, and the conversation is left as it was.
        host_embedding: keep the input embedding table in CPU RAM (decode/embedding.py) and free its
            GPU memory for the strategy (routed's routing tables); None (default): on a CUDA decode device
            when the embedding is not tied to the LM head. The model gets its table back at `close`.
        n_layers: the model's number of layers; leave it None: `validate(n_layers)` sets it (the
            decoder calls it with the model's depth), and `k_for_layer` reads it for the schedule.
    """

    k: int = 256
    k_per_layer: list[int] | None = None
    k_schedule: str = "uniform"
    strategy: str = "auto"
    strategy_options: dict = field(default_factory=dict)
    n_sink: int = 4
    n_tail: int = 64
    compile: bool = True
    prompt_chunk: int = 512
    prompt_scratch_mib: int = 1024
    max_window_tokens: int = 65536
    host_embedding: bool | None = None
    n_layers: int | None = None

    def validate(self, n_layers: int) -> None:
        """Raise TopkError for budgets that make no sense; on success set `self.n_layers = n_layers`."""
        if self.k_per_layer is not None:
            if len(self.k_per_layer) != n_layers:
                raise TopkError(f"k_per_layer has {len(self.k_per_layer)} entries, the model has {n_layers} layers")
            if any(k <= 0 for k in self.k_per_layer):
                raise TopkError("every per-layer k must be a positive integer")
        elif self.k <= 0:
            raise TopkError(f"k must be a positive integer, got {self.k}")
        from topk_decode.index.schedule import SCHEDULES

        if self.k_schedule not in SCHEDULES:
            raise TopkError(f"unknown k schedule {self.k_schedule!r} (use {' or '.join(SCHEDULES)})")
        if self.n_sink < 0 or self.n_tail < 0:
            raise TopkError("n_sink and n_tail must be ≥ 0")
        for name in ("prompt_chunk", "prompt_scratch_mib", "max_window_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TopkError(f"{name} must be a positive integer, got {value!r}")
        self.n_layers = n_layers  # the schedule needs the depth; k itself may change later (set_k)

    def k_for_layer(self, layer: int) -> int:
        """The retrieval budget of one layer."""
        if self.k_per_layer is not None:
            return self.k_per_layer[layer]
        if self.k_schedule != "uniform":
            from topk_decode.index.schedule import k_schedule

            return k_schedule(self.k_schedule, self.k, self.n_layers)[layer]
        return self.k
