"""Top-k decoding: the model's blocks on the decode device, the context KV on the CPU.

Per step and layer (batch 1):
    q, k, v = block projections at the true positions             (decode device)
    k, v → the exact window; window part of attention + its lse    (decode device)
    q → CPU; the strategy picks context ids + exact scores per KV head
    context part: softmax-weighted sum of values[ids] + its lse    (CPU, context.py)
    o (H, D), m and z (H, 2) → device; attention = one softmax over retrieved ∪ window, by lse merge (merge.py)

`forward_batch` runs several conversations' one-token steps as one (1, B, C) pass of the model, each row
at its own position over its own window and cache (docs/SERVE.md "Batched decoding").
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from topk_decode.config import DecodeConfig
from topk_decode.decode import embedding
from topk_decode.decode.context import ContextAttention
from topk_decode.decode.graphs import StepSegments
from topk_decode.decode.layer import finish_layer
from topk_decode.decode.merge import chunk_window_attention
from topk_decode.decode.sampling import Sampling
from topk_decode.decode.window import Window
from topk_decode.errors import NonFiniteLogits, StepCancelled, TopkError, TopkWarning
from topk_decode.index import DeviceStaged, FusedAttention, Selection, auto, get_strategy
from topk_decode.index.threads import default_threads, omp_threads
from topk_decode.model.blocks import ModelShape, attention_inputs, final_logits, rope
from topk_decode.store.cache_dir import ContextKV


@dataclass
class StepStats:
    """Accumulated wall-clock seconds per part of the decode step, and counts.

    search: the strategy's select (CPU wall; with a fused strategy, `select_and_attend`, the context part
    too); context: the context part of attention on the CPU
    (softmax of the k exact scores and the weighted sum of the selected value rows, context.py);
    d2h / h2d: the query's and the context part's transfers where they are separate calls (the
    multi-token path; wall time, so including the wait for the GPU work queued before them). In the
    one-token path both transfers (16 and 8 KiB) are inside the CUDA graphs.

    `summary()["gpu_ms"]` is the rest of the step: total minus search, context, d2h and h2d. It holds
    GPU compute, the launches (CUDA graphs or eager kernels), the waits for the GPU and the step's
    Python; the per-layer query sync makes them serial, so they are reported together. `launch_ms`
    (CPU time of the segment launches, one-token path) and `wait_ms` (blocked on the GPU until the
    layer's query is on the host) are parts of `gpu_ms`, not additions to it.

    recomputed: one-token steps whose logits were not finite and were computed again on the exact
    multi-token path (`TopKDecoder._recompute`; a bug to report, never expected).
    """

    steps: int = 0
    tokens: int = 0
    total_s: float = 0.0
    search_s: float = 0.0
    context_s: float = 0.0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    launch_s: float = 0.0
    wait_s: float = 0.0
    retrieved: int = 0
    recomputed: int = 0

    @property
    def transfer_s(self) -> float:
        """Both directions of PCIe traffic."""
        return self.d2h_s + self.h2d_s

    def summary(self) -> dict[str, float]:
        """Per-step means in milliseconds."""
        n = max(self.steps, 1)
        rest = self.total_s - self.search_s - self.context_s - self.transfer_s
        return {
            "steps": self.steps,
            "ms_per_step": 1e3 * self.total_s / n,
            "search_ms": 1e3 * self.search_s / n,
            "context_ms": 1e3 * self.context_s / n,
            "d2h_ms": 1e3 * self.d2h_s / n,
            "h2d_ms": 1e3 * self.h2d_s / n,
            "transfer_ms": 1e3 * self.transfer_s / n,
            "gpu_ms": 1e3 * rest / n,  # the rest of the step (see the class docstring)
            "launch_ms": 1e3 * self.launch_s / n,
            "wait_ms": 1e3 * self.wait_s / n,
            "retrieved_per_step": self.retrieved / n,
            "recomputed": self.recomputed,
        }


@dataclass
class Conversation:
    """One conversation's private state over the shared store: its window and strategy state."""

    window: Window
    strategy_state: Any
    pending: list[int] = field(default_factory=list)  # generated but not yet fed back (the last token)
    stats: StepStats = field(default_factory=StepStats)
    # Called as observer(layer, q, selection, conversation) after every search: q is (Hkv, G·T, D)
    # fp32 CPU, the window already holds this step's tokens. Used by the evaluation harness.
    observer: Callable[[int, torch.Tensor, Selection, Conversation], None] | None = None
    # Polled before every layer of a multi-token step and before a one-token graph step; True raises StepCancelled
    # (the server's cancel flag: a long prompt of a client that left stops within a layer).
    should_stop: Callable[[], bool] | None = None


class TopKDecoder:
    """Decoding (greedy, or sampled: sampling.py) of a model over a prefilled context with top-k retrieval attention.

    Args:
        model: the HF causal LM, already on `device`.
        ckv: the opened cache.
        config: k, strategy, sinks and tail.
        last_logits: (V,) logits after the last context token (used when the prompt is empty).
        progress: optional callback(done, total) while the strategy builds its indices.
        graphs: run one-token steps through fixed-buffer segments replayed as CUDA graphs (see
            graphs.py); None = on CUDA only. True on the CPU runs the same segments eagerly.
        lock: the step lock, shared by decoders of other caches over the same `model` (one model, one
            step at a time); None: a lock of its own.

    Threads: one decoder serves many conversations, and every step (`forward`) holds `self.lock`
    (shared by the decoders of other caches over the same model). Without a `batcher` the model runs
    at batch 1; with one (decode/batch.py), concurrent one-token steps run as one batched step
    (`forward_batch`). The lock covers every piece of shared scratch state at once: the context part's buffers, the strategies' search buffers
    and counters, the step segments. A conversation's own state (window, strategy state, pending
    token) is touched only by its own steps, so conversations in different threads interleave step by
    step and each gets exactly its serial answer. One conversation must not be stepped by two threads
    at once.
    """

    def __init__(
        self,
        model,
        ckv: ContextKV,
        config: DecodeConfig,
        last_logits: torch.Tensor | None = None,
        progress: Callable[[int, int], None] | None = None,
        graphs: bool | None = None,
        lock: threading.RLock | None = None,
    ) -> None:
        self.model = model
        self.ckv = ckv
        self.shape = ModelShape.from_config(model.config)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config.validate(self.shape.n_layers)
        self.config = config
        n = ckv.n_tokens
        self.n_sink = min(config.n_sink, n)
        self.n_tail = min(config.n_tail, n - self.n_sink)
        choice = auto.resolve(config.strategy, n, gpu=self.device.type == "cuda")
        config.strategy = choice.strategy
        config.strategy_options = {**choice.options, **config.strategy_options}  # the user's options win
        self.strategy_reason = choice.reason  # why this strategy runs (`topk info`, /show)
        self.strategy = get_strategy(config.strategy)(ckv, self.n_sink, n - self.n_tail, config.strategy_options)
        self.strategy.prepare(progress)
        self.last_logits = last_logits
        self.scale = self.shape.head_dim**-0.5
        self._warned_positions = False
        self._warned_nonfinite = False
        self._cuda = self.device.type == "cuda"
        self.context = ContextAttention(ckv.values, self.scale, ckv.value_scales)
        self._use_segments = self._cuda if graphs is None else graphs
        self._segments: StepSegments | None = None
        self._segments_k: list[int] | None = None  # the k per layer the segments were built for
        # Serialises steps over the shared scratch state (see the class docstring); re-entrant so an
        # observer or a progress callback may call back into the decoder.
        self.lock = lock if lock is not None else threading.RLock()
        # when set (decode/batch.py), concurrent one-token steps of this model are decoded together
        self.batcher = None
        self.closed = False
        # torch's CPU ops in a step run on at most this many OpenMP threads (TOPK_THREADS, else the CPUs this
        # process may use): torch's own default ignores a cgroup CPU quota. Set on the stepping thread only.
        self.cpu_threads = default_threads()
        if self.shape.sliding_window and n > self.shape.sliding_window:
            warnings.warn(
                f"the model's sliding window ({self.shape.sliding_window}) is shorter than the context "
                f"({n} tokens); top-k decoding attends over the whole context",
                TopkWarning,
                stacklevel=2,
            )
        # last: nothing after it may fail and leave the model changed
        want = config.host_embedding if config.host_embedding is not None else self._cuda and not embedding.tied(model)
        self.host_embedding = embedding.move_embedding_to_host(model, self.device) if want else None

    def new_conversation(self) -> Conversation:
        """A fresh conversation: the window starts with the context's sinks and tail."""
        n = self.ckv.n_tokens
        keep = list(range(self.n_sink)) + list(range(n - self.n_tail, n))
        idx = torch.tensor(keep, dtype=torch.int64)
        rows = [self.ckv.kv_rows(layer, idx) for layer in range(self.ckv.n_layers)]
        init_k = [k.to(self.device, self.dtype) for k, _ in rows]
        init_v = [v.to(self.device, self.dtype) for _, v in rows]
        return Conversation(Window(init_k, init_v, n), self.strategy.new_state())

    def _context_part(
        self, layer: int, q_host: torch.Tensor, conv: Conversation, o: torch.Tensor, mz: torch.Tensor, route=None
    ) -> None:
        """Search and the context part of one layer's attention, on the CPU.

        Args:
            layer: the layer.
            q_host: (Hkv, G·T, D) float32 queries on the host (already copied).
            conv: the conversation (strategy state, stats, observer).
            o, mz: (H·T, D) and (H·T, 2) host tensors that receive the part (see ContextAttention.attend).
            route: the device's ranking of this layer's clusters (`StepSegments.routes`), or None.
        """
        st = conv.stats
        if self.strategy.n_searchable == 0:
            self.context.write_empty(o, mz)
            return
        # strategies may keep the query (selection caches), and so may observers: hand them their own copy
        q_cpu = q_host.clone() if self.strategy.keeps_query or conv.observer is not None else q_host
        q_cpu = self.ckv.search_queries(layer, q_cpu)  # an int8 cache's key scales folded in (store/quant.py)
        k = self.config.k_for_layer(layer)
        t1 = time.perf_counter()
        # a strategy that computes the context part inside its search (routed's compiled path): one pass
        fused = isinstance(self.strategy, FusedAttention) and self.strategy.attends(
            layer, k, o, routed=route is not None
        )
        if fused:
            sel = self.strategy.select_and_attend(layer, q_cpu, k, conv.strategy_state, o, mz, route=route)
        elif route is not None:  # the device already merged its estimate: no second one
            raise TopkError(f"internal: strategy {self.strategy.name} routed on the device but did not attend")
        else:
            sel = self.strategy.select(layer, q_cpu, k, conv.strategy_state)
        t2 = time.perf_counter()
        if conv.observer is not None:
            conv.observer(layer, q_cpu, sel, conv)
        t2b = time.perf_counter()
        if not fused:
            st.retrieved += self.context.attend(layer, sel, o, mz)
        else:  # counted by the strategy where it can: a torch op here (32K slots at k = 1024) runs on
            # torch's OpenMP threads, whose spinning then slows the next layer's compiled search
            st.retrieved += sel.filled if sel.filled is not None else int((sel.ids >= 0).sum())
        t3 = time.perf_counter()
        st.search_s += t2 - t1
        st.context_s += t3 - t2b

    def _context_parts(
        self,
        layer: int,
        q_all: torch.Tensor,
        idx: list[int],
        convs: list[Conversation],
        o_all: torch.Tensor,
        mz_all: torch.Tensor,
    ) -> None:
        """The context part of several conversations' one-token steps over this decoder's cache (forward_batch).

        Where the strategy's rows are independent (flat) and the conversations hold no strategy state, one
        `select` searches every conversation's queries in one pass over the keys and one `attend` sums
        their values; otherwise each conversation gets its own `_context_part`.

        Args:
            layer: the layer.
            q_all: (Hkv, G, B, D) float32 host queries of the whole batch.
            idx: the batch positions of this decoder's conversations; convs: those conversations.
            o_all, mz_all: (Hkv, G, B, D) and (Hkv, G, B, 2) host tensors receiving the parts at `idx`.
        """
        hkv, G, _, D = q_all.shape
        n = len(idx)
        if not (
            n > 1
            and self.strategy.n_searchable > 0
            and self.strategy.rows_independent
            and all(c.strategy_state is None for c in convs)
        ):
            o = torch.empty((hkv * G, D), dtype=self.context.dtype)
            mz = torch.empty((hkv * G, 2), dtype=torch.float32)
            for b, conv in zip(idx, convs):
                self._context_part(layer, q_all[:, :, b].contiguous(), conv, o, mz)
                o_all[:, :, b] = o.view(hkv, G, D)
                mz_all[:, :, b] = mz.view(hkv, G, 2)
            return
        # rows conversation-major, (Hkv, n·G, D): conversation j's queries are rows [j·G, (j+1)·G)
        q = self.ckv.search_queries(layer, q_all[:, :, idx].transpose(1, 2).reshape(hkv, n * G, D))
        k = self.config.k_for_layer(layer)
        t1 = time.perf_counter()
        sel = self.strategy.select(layer, q, k, None)
        t2 = time.perf_counter()
        K = sel.ids.shape[-1]
        for j, conv in enumerate(convs):
            if conv.observer is not None:  # its own queries and selection, as alone
                rows = slice(j * G, (j + 1) * G)
                conv.observer(
                    layer,
                    q[:, rows].clone(),
                    Selection(ids=sel.ids[:, rows].contiguous(), scores=sel.scores[:, rows].contiguous()),
                    conv,
                )
        t3 = time.perf_counter()
        o = torch.empty((hkv * n * G, D), dtype=self.context.dtype)
        mz = torch.empty((hkv * n * G, 2), dtype=torch.float32)
        self.context.attend(layer, sel, o, mz)
        o_all[:, :, idx] = o.view(hkv, n, G, D).transpose(1, 2)
        mz_all[:, :, idx] = mz.view(hkv, n, G, 2).transpose(1, 2)
        filled = (
            [hkv * G * K] * n if sel.no_empty_slots else sel.ids.view(hkv, n, G, K).ge(0).sum(dim=(0, 2, 3)).tolist()
        )
        t4 = time.perf_counter()
        for conv, count in zip(convs, filled):  # one search and one sum for all: each conversation its share
            conv.stats.retrieved += count
            conv.stats.search_s += (t2 - t1) / n
            conv.stats.context_s += (t4 - t3) / n

    def forward(self, ids: list[int], conv: Conversation) -> torch.Tensor:
        """Feed new tokens (after any pending ones) through the model; return the last token's logits (V,).

        Thread-safe: the step holds the decoder's lock (see the class docstring). With a `batcher`, a
        one-token step waits to be decoded together with the other threads' (decode/batch.py).

        Args:
            ids: the new tokens.
            conv: the conversation they continue.
        """
        if self.batcher is not None and len(conv.pending) + len(ids) == 1:
            return self.batcher.step(self, conv, list(ids))
        return self.forward_alone(ids, conv)

    def forward_alone(self, ids: list[int], conv: Conversation) -> torch.Tensor:
        """`forward` without a batcher: this conversation's step only, under the decoder's lock."""
        with self.lock:
            if self.closed:
                raise TopkError("the store is closed")
            with omp_threads(self.cpu_threads):
                return self._forward_locked(ids, conv)

    def prompt_chunk_tokens(self) -> int:
        """Tokens per prompt chunk: `prompt_chunk`, or fewer where one score per (query head, chunk token,
        searchable context token) in fp32 would pass `prompt_scratch_mib` (at least 1)."""
        per_token = 4 * self.shape.n_heads * max(self.strategy.n_searchable, 1)
        fit = (self.config.prompt_scratch_mib << 20) // per_token
        return max(1, min(self.config.prompt_chunk, fit))

    @property
    def segments(self) -> StepSegments | None:
        """The one-token step's fixed-buffer segments (graphs.py): None until the first one-token step
        on the segment path, and after `reset_segments`. Read-only: for inspection (`.graphs`,
        `.compiled`, `.capacity`) and profiling."""
        return self._segments

    def reset_segments(self, compile: bool | None = None) -> None:
        """Drop the step's segments; the next one-token step builds (captures, compiles) new ones.

        Args:
            compile: when given, set `config.compile` first, so the new segments are compiled or not.
        """
        with self.lock:  # between steps, never inside one
            if compile is not None:
                self.config.compile = compile
            self._segments = None

    def close(self) -> None:
        """Stop the strategy's worker threads and give the model back its input embedding (`host_embedding`);
        later steps raise TopkError. Idempotent."""
        with self.lock:  # after any step in flight
            self.closed = True
            self.strategy.close()
            if self.host_embedding is not None:
                if self._segments is not None:  # the step's buffers and tables first: room for the table
                    self._segments.park()  # (a conversation's window resident there keeps them alive)
                self._segments = None
                if self._cuda:
                    gc.collect()  # captured graphs hold their pool until collected
                    torch.cuda.empty_cache()
                if not embedding.restore(self.model, self.host_embedding):
                    warnings.warn(
                        "the input embedding stays in CPU RAM: no room for it on the device", TopkWarning, stacklevel=2
                    )
                self.host_embedding = None

    @torch.inference_mode()
    def _forward_locked(self, ids: list[int], conv: Conversation) -> torch.Tensor:
        win = conv.window
        pending = conv.pending
        ids = pending + list(ids)
        if not ids:
            if win.n_new == 0 and self.last_logits is not None:
                return self.last_logits
            raise TopkError("nothing to decode: empty prompt")
        T = len(ids)
        self._check_room(win, T)
        t_start = time.perf_counter()
        pos0 = win.next_position
        conv.pending = []
        length0 = win.length
        try:
            if T == 1 and self._use_segments:
                check_stop(conv)
                logits = self._forward_one(ids[0], pos0, conv)
                if not finite(logits):  # (on CUDA this waits for the step: the sync below would anyway)
                    logits = self._recompute(ids[0], pos0, length0, conv, "one-token")
            else:
                # Chunks (prompt_chunk_tokens): each one appends to the window and attends to everything
                # before it, so the result is the one-step result and memory stays bounded.
                step = self.prompt_chunk_tokens()
                for s in range(0, T, step):
                    logits = self._forward_eager(ids[s : s + step], pos0 + s, conv)
                if not finite(logits):  # the exact path itself: nothing to recompute on
                    win.rewind(length0)
                    raise self._nonfinite_error()
        except BaseException:
            # A failed or interrupted step leaves the conversation as it was before it.
            win.length, conv.pending = length0, pending
            raise
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the caller reads the logits next anyway
        conv.stats.steps += 1
        conv.stats.tokens += T
        conv.stats.total_s += time.perf_counter() - t_start
        return logits

    @torch.inference_mode()
    def _recompute(self, token: int, pos0: int, length0: int, conv: Conversation, path: str) -> torch.Tensor:
        """A one-token step whose logits were not finite, undone and computed again on the exact multi-token path
        (`_forward_eager`: the modules launched one by one, the search on the host): (V,) logits.

        The step is undone first: the window's length goes back to `length0` and the slot it wrote is zeroed
        (`Window.rewind`; a window resident in the step's buffers stays there, `_forward_eager`'s `reserve`
        keeps it), and the strategy's per-conversation state (a selection cache the step may have filled)
        starts afresh. Counted in `stats.recomputed`, with a warning the first time per decoder.
        NonFiniteLogits (a TopkError) when the exact path's logits are not finite either.

        Args:
            token, pos0: the step's token and position; length0: the window's length before the step.
            conv: the conversation; path: which step gave them ("one-token", "batched"), for the warning.
        """
        conv.window.rewind(length0)
        if conv.strategy_state is not None:
            conv.strategy_state = self.strategy.new_state()
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"the {path} decode step's logits were not finite; the step was recomputed on the exact host "
                f"path. This is a bug: please report it with the strategy ({self.config.strategy}) and its "
                f"options ({self.config.strategy_options})",
                TopkWarning,
                stacklevel=2,
            )
        logits = self._forward_eager([token], pos0, conv)
        if not finite(logits):
            conv.window.rewind(length0)
            raise self._nonfinite_error(recomputed=True)
        conv.stats.recomputed += 1
        return logits

    def _nonfinite_error(self, recomputed: bool = False) -> NonFiniteLogits:
        """The error for logits that are not finite on the exact path."""
        where = "even on the exact path" if recomputed else "on the exact path"
        return NonFiniteLogits(
            f"the decode step's logits are not finite (strategy {self.config.strategy}, options "
            f"{self.config.strategy_options}), {where}: the cache or the model is broken"
        )

    def _check_room(self, win: Window, T: int) -> None:
        """TopkError when T more tokens pass max_window_tokens; a warning (once) past the model's positions."""
        limit = self.config.max_window_tokens
        if win.n_new + T > limit:
            held = f", with the {win.n_new} this conversation holds," if win.n_new else ""
            raise TopkError(
                f"the prompt is too long: {T} tokens{held} pass the limit of {limit} tokens after the "
                f"context (max_window_tokens); shorten it or start a new conversation"
            )
        end = win.next_position + T
        if end > self.shape.max_positions and not self._warned_positions:
            warnings.warn(
                f"position {end} is past the model's maximum positions "
                f"({self.shape.max_positions}); answers may degrade",
                TopkWarning,
                stacklevel=4,
            )
            self._warned_positions = True

    def _forward_one(self, token: int, position: int, conv: Conversation) -> torch.Tensor:
        """One token through fixed-buffer segments (CUDA graphs on CUDA): (V,) logits."""
        ks = [self.config.k_for_layer(layer) for layer in range(self.shape.n_layers)]
        if self._segments is not None and self._segments_k != ks:
            self._segments = None  # the device's routing budgets are fixed in the step: new segments
        if self._segments is None:
            staged = isinstance(self.strategy, DeviceStaged)
            routes = self.strategy.device_routes(self.device, ks, self.shape.group_size) if staged else None
            self._segments = StepSegments(
                self.model,
                self.shape,
                self.device,
                capture=self._cuda,
                scale=self.scale,
                compile=self.config.compile,
                context_dtype=self.context.dtype,
                routes=routes,
            )
            self._segments_k = ks
        seg, win = self._segments, conv.window
        routes = seg.routes
        seg.activate(win)
        seg.start(token, position, win)
        st, clock = conv.stats, time.perf_counter
        t0 = clock()
        seg.run(0)
        for layer_idx in range(self.shape.n_layers):
            t1 = clock()
            if routes is not None and routes.attends(layer_idx):  # the device computed the context part too
                st.retrieved += routes.attended(layer_idx)
                t2 = t3 = clock()
            else:
                seg.wait_query(layer_idx)  # the GPU goes on with the window part meanwhile
                t2 = clock()
                route = routes.host_route(layer_idx) if routes is not None and routes.handles(layer_idx) else None
                self._context_part(
                    layer_idx, seg.q_host[layer_idx], conv, seg.part_o[layer_idx], seg.part_mz[layer_idx], route
                )
                t3 = clock()
            seg.run(layer_idx + 1)
            st.launch_s += t1 - t0
            st.wait_s += t2 - t1
            t0 = t3
        st.launch_s += clock() - t0
        win.advance(1)
        return seg.logits[0].clone()  # the segment's buffer is overwritten next step

    def _forward_eager(self, ids: list[int], pos0: int, conv: Conversation) -> torch.Tensor:
        """Any number of tokens through the model's modules, launched one by one: (V,) logits."""
        win, st = conv.window, conv.stats
        T = len(ids)
        H, hkv, G, D = self.shape.n_heads, self.shape.n_kv_heads, self.shape.group_size, self.shape.head_dim
        positions = torch.arange(pos0, pos0 + T, device=self.device)
        x = self.model.model.embed_tokens(torch.tensor([ids], device=self.device))  # (1, T, C)
        cos, sin = rope(self.model, x, positions)
        W0 = win.length
        win.reserve(W0 + T)  # (a window resident in the step's buffers moves out if they are too small)
        part_o = torch.empty((H * T, D), dtype=self.context.dtype)
        part_mz = torch.empty((H * T, 2), dtype=torch.float32)
        for layer_idx, layer in enumerate(self.model.model.layers):
            check_stop(conv)
            q, k, v = attention_inputs(layer, x, cos, sin, self.shape)  # (1,H,T,D), (1,Hkv,T,D)
            wk, wv = win.update(layer_idx, W0, k[0], v[0])  # (Hkv, W0+T, D)
            out_w, lse_w = chunk_window_attention(q[0], wk, wv, self.scale)  # (H, T, D), (H, T)
            t0 = time.perf_counter()
            q_host = q[0].float().reshape(hkv, G * T, D).cpu()  # (Hkv, G·T, D)
            t1 = time.perf_counter()
            self._context_part(layer_idx, q_host, conv, part_o, part_mz)
            t2 = time.perf_counter()
            o_dev, mz_dev = part_o.to(self.device).view(H, T, D), part_mz.to(self.device).view(H, T, 2)
            st.d2h_s += t1 - t0
            st.h2d_s += time.perf_counter() - t2
            x = finish_layer(layer, x, out_w, lse_w, o_dev, mz_dev, self.shape)
        win.advance(T)
        return final_logits(self.model, x[:, -1:])[0]

    def stream(
        self,
        conv: Conversation,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_ids: set[int] | None = None,
        sampling: Sampling | None = None,
    ) -> Iterator[int]:
        """Continuation token by token (greedy unless `sampling` says otherwise); the last token stays
        pending so a next turn continues exactly.

        Args:
            conv: the conversation (window + strategy state).
            prompt_ids: tokens appended after whatever the conversation holds.
            max_new_tokens: at most this many generated tokens.
            eos_ids: stop after generating one of these (it is yielded, as HF includes it).
            sampling: temperature / top-p / seed (None: greedy).
        """
        eos_ids = eos_ids or set()
        if max_new_tokens <= 0:
            return
        try:
            logits = self.forward(prompt_ids, conv)
            for i in range(max_new_tokens):
                tok = sampling.pick(logits) if sampling is not None else int(torch.argmax(logits))
                if tok in eos_ids or i == max_new_tokens - 1:
                    conv.pending = [tok]
                    yield tok
                    return
                yield tok
                logits = self.forward([tok], conv)
        finally:
            if self.batcher is not None:  # no more steps of this answer: the next batch need not wait for it
                self.batcher.leave(conv)

    def generate(
        self,
        conv: Conversation,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_ids: set[int] | None = None,
        sampling: Sampling | None = None,
    ) -> list[int]:
        """All of `stream` as a list."""
        return list(self.stream(conv, prompt_ids, max_new_tokens, eos_ids, sampling))


def finite(logits: torch.Tensor) -> bool:
    """Whether every logit is finite (a NaN or an infinity would be sampled as some token, silently)."""
    return bool(torch.isfinite(logits).all())


def check_stop(conv: Conversation) -> None:
    """Raise StepCancelled when the conversation's `should_stop` says so."""
    if conv.should_stop is not None and conv.should_stop():
        raise StepCancelled("the step was cancelled")


@dataclass(eq=False)
class StepRequest:
    """One conversation's one-token step, to be decoded with others (`forward_batch`, decode/batch.py).

    ids: the new token (or none, when the conversation's pending token is the step's); `logits` (V,) or
    `error` is set by `forward_batch`.
    """

    decoder: TopKDecoder
    conv: Conversation
    ids: list[int]
    logits: torch.Tensor | None = None
    error: BaseException | None = None


def forward_batch(reqs: list[StepRequest]) -> None:
    """One model step for several conversations' one-token steps; sets each request's logits or error.

    The decoders must share one model and step lock (`TopKDecoder(lock=...)`); their caches may differ.
    A request whose conversation is cancelled (`should_stop`), full or closed gets its error alone; a
    failing step fails every request in it and leaves each conversation as it was. A row whose logits are not
    finite is undone and computed again alone on the exact path (`TopKDecoder._recompute`). One request left:
    the ordinary one-token step (CUDA graphs where they run).
    """
    lead = reqs[0].decoder
    with lead.lock:
        live = []
        for r in reqs:
            try:
                if r.decoder.closed:
                    raise TopkError("the store is closed")
                check_stop(r.conv)
                r.decoder._check_room(r.conv.window, 1)
                live.append(r)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                r.error = e
        if len(live) == 1:
            r = live[0]
            try:
                r.logits = r.decoder.forward_alone(r.ids, r.conv)
            except BaseException as e:  # noqa: BLE001 - handed to the request's own thread
                r.error = e
            return
        if not live:
            return
        saved = [(r.conv.window.length, r.conv.pending) for r in live]
        t0 = time.perf_counter()
        try:
            with omp_threads(lead.cpu_threads):
                logits = _forward_batch_locked(live)
            if lead._cuda:
                torch.cuda.current_stream(lead.device).synchronize()
        except BaseException as e:  # noqa: BLE001 - handed to every request's thread
            for r, (length, pending) in zip(live, saved):
                r.conv.window.length, r.conv.pending = length, pending
                r.error = e
            return
        dt = time.perf_counter() - t0
        ok = torch.isfinite(logits).all(dim=-1).tolist()
        for b, (r, (length, pending)) in enumerate(zip(live, saved)):
            st = r.conv.stats
            t1 = time.perf_counter()
            if ok[b]:
                r.logits = logits[b]
            else:  # this row alone, again on the exact path (the others' rows are theirs and finite)
                win = r.conv.window
                win.rewind(length)
                try:
                    with omp_threads(r.decoder.cpu_threads):
                        r.logits = r.decoder._recompute(
                            (pending + r.ids)[0], win.next_position, length, r.conv, "batched"
                        )
                except BaseException as e:  # noqa: BLE001 - handed to the request's own thread
                    win.length, r.conv.pending = length, pending
                    r.error = e
                    continue
            st.steps += 1
            st.tokens += 1
            st.total_s += dt + time.perf_counter() - t1


@torch.inference_mode()
def _forward_batch_locked(reqs: list[StepRequest]) -> torch.Tensor:
    """The batched step: the B tokens go through the model's modules as one (1, B, C) sequence, each at its own
    position; each attends to its own window and its own cache. (B, V) logits."""
    lead = reqs[0].decoder
    model, shape, device = lead.model, lead.shape, lead.device
    H, hkv, G, D = shape.n_heads, shape.n_kv_heads, shape.group_size, shape.head_dim
    B = len(reqs)
    tokens = []
    for r in reqs:
        tokens.append((r.conv.pending + r.ids)[0])
        r.conv.pending = []
    wins = [r.conv.window for r in reqs]
    starts = [w.length for w in wins]
    positions = torch.tensor([w.next_position for w in wins], device=device)
    for w, s in zip(wins, starts):
        w.reserve(s + 1)
    groups: dict[int, tuple[TopKDecoder, list[int]]] = {}
    for b, r in enumerate(reqs):
        groups.setdefault(id(r.decoder), (r.decoder, []))[1].append(b)
    x = model.model.embed_tokens(torch.tensor([tokens], device=device))  # (1, B, C)
    cos, sin = rope(model, x, positions)  # (1, B, D): each token its position
    out_w = torch.empty((H, B, D), dtype=torch.float32, device=device)
    lse_w = torch.empty((H, B), dtype=torch.float32, device=device)
    o = torch.empty((hkv, G, B, D), dtype=lead.context.dtype)
    mz = torch.empty((hkv, G, B, 2), dtype=torch.float32)
    for layer_idx, layer in enumerate(model.model.layers):
        q, k, v = attention_inputs(layer, x, cos, sin, shape)  # (1, H, B, D), (1, Hkv, B, D)
        for b, (w, s) in enumerate(zip(wins, starts)):  # each token over its own window
            wk, wv = w.update(layer_idx, s, k[0, :, b : b + 1], v[0, :, b : b + 1])
            out_w[:, b : b + 1], lse_w[:, b : b + 1] = chunk_window_attention(q[0, :, b : b + 1], wk, wv, lead.scale)
        q_host = q[0].float().reshape(hkv, G, B, D).cpu()
        for decoder, idx in groups.values():  # each cache its own search
            decoder._context_parts(layer_idx, q_host, idx, [reqs[b].conv for b in idx], o, mz)
        x = finish_layer(layer, x, out_w, lse_w, o.view(H, B, D).to(device), mz.view(H, B, 2).to(device), shape)
    for w in wins:
        w.advance(1)
    return final_logits(model, x)
