"""Layer-wise, chunked prefill: all N tokens through layer ℓ, then layer ℓ+1.

Only one chunk's activations and at most two layers' keys/values (Hkv, N, D) live on the device at
a time — the layer computing and the previous one, which drains to `on_layer` in the background (see
drain.py) — so peak device memory grows linearly with N (never N²): each chunk attends to every
earlier key of its layer through a flash kernel with a bottom-right-aligned causal mask. The residual
stream of all N tokens stays on the device when it fits comfortably, else in pinned CPU memory.

With `offload_weights`, the model stays on the CPU (pinned) and one decoder layer at a time is
copied to the device, the next one on a side stream while this one computes: peak device memory is
then a few layers' weights (up to three: the host may queue one layer ahead of the GPU) plus two
layers' KV and a chunk's activations, so an 8B model prefills within a 16 GiB budget even though its
bf16 weights alone are 15 GiB.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from topk_decode.model.blocks import ModelShape, attention_inputs, final_logits, finish_block, rope
from topk_decode.prefill.drain import KVDrain

# Tokens per prefill chunk unless asked otherwise (bounds the chunk's activations on the device).
CHUNK_SIZE = 4096

try:  # optional: flash-attn handles GQA and bottom-right causal masks natively
    from flash_attn import flash_attn_func  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_func = None


@dataclass
class PrefillStats:
    """What a prefill measured."""

    n_tokens: int
    seconds: float
    peak_device_bytes: int | None  # None on CPU
    resumed_at_layer: int = 0  # > 0: the time covers only the layers from this one on (`--resume`)
    ranks: int = 1  # processes that computed it (`--gpus N`, prefill/distributed.py)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / max(self.seconds, 1e-9)


# How a CUDA chunk attends (decided once per geometry by a numerical self-check, see _pick_mode):
# "gqa": two flash calls on the unexpanded KV heads; "expand": the same with K/V repeated per query
# head; "sdpa": torch's lower-right CausalBias path (3x slower than HF's prefill at 128K, measured:
# it leaves the flash kernel for a non-square causal chunk with GQA).
_MODES: dict[tuple, str] = {}
# Which attention paths prefills of this process took (reported by `topk bench`).
ATTENTION_PATHS: set[str] = set()


def _flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention with its log-sum-exp: (1, H, T, D) output and (1, H, T) fp32 lse."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    return res[0], res[1]


def _split_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: bool) -> torch.Tensor:
    """Chunk attention as (full attention to the earlier keys) ⊕ (causal attention within the chunk).

    The chunk's own block is square, where top-left and bottom-right causal masks coincide, so both
    parts run on the flash kernel; the two partial results are merged exactly by their log-sum-exps.
    """
    T, S = q.shape[2], k.shape[2]
    if expand and k.shape[1] != q.shape[1]:
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    out_d, lse_d = _flash_lse(q, k[:, :, S - T :], v[:, :, S - T :], True)
    if S == T:
        return out_d
    out_p, lse_p = _flash_lse(q, k[:, :, : S - T], v[:, :, : S - T], False)
    lse = torch.logaddexp(lse_p, lse_d)
    out = out_p.float() * torch.exp(lse_p - lse)[..., None] + out_d.float() * torch.exp(lse_d - lse)[..., None]
    return out.to(q.dtype)


def _sdpa_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    T, S = q.shape[2], k.shape[2]
    mask = causal_lower_right(T, S) if T > 1 else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _pick_mode(q: torch.Tensor, k: torch.Tensor) -> str:
    """Try the flash modes on a small problem of this geometry against an explicit-mask reference."""
    key = (q.shape[1], k.shape[1], q.shape[3], q.dtype, q.device)
    if key in _MODES:
        return _MODES[key]
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[3]
    g = torch.Generator(device=q.device).manual_seed(0)
    tq, tk, tv = (
        torch.randn((1, h, n, D), generator=g, device=q.device, dtype=q.dtype)
        for h, n in ((H, 128), (Hkv, 384), (Hkv, 384))
    )
    visible = torch.ones(128, 384, dtype=torch.bool, device=q.device).tril(384 - 128)  # lower-right
    G = H // Hkv
    ref = F.scaled_dot_product_attention(
        tq.float(), tk.float().repeat_interleave(G, 1), tv.float().repeat_interleave(G, 1), attn_mask=visible
    )
    mode = "sdpa"
    for candidate, expand in (("gqa", False), ("expand", True)):
        try:
            out = _split_flash(tq, tk, tv, expand)
            if torch.allclose(out.float(), ref, atol=3e-2, rtol=0):
                mode = candidate
                break
        except Exception:  # noqa: BLE001 - an unsupported variant just is not chosen
            continue
    _MODES[key] = mode
    return mode


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk's queries over all keys so far (chunk = the last T keys).

    Args:
        q: (1, H, T, D); k, v: (1, Hkv, S, D) with S ≥ T, the chunk's own keys last.
    Returns:
        (1, H, T, D).
    """
    T = q.shape[2]
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        ATTENTION_PATHS.add("chunked flash-attn")
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and T > 1:
        mode = _pick_mode(q, k)
        if mode != "sdpa":
            ATTENTION_PATHS.add(f"chunked split-flash ({mode})")
            return _split_flash(q, k, v, expand=mode == "expand")
    ATTENTION_PATHS.add("chunked sdpa lower-right")
    return _sdpa_lower_right(q, k, v)


class LayerStreamer:
    """Moves one decoder layer's weights to the device at a time; the CPU copies stay pinned.

    Args:
        model: the HF causal LM with its weights on the CPU.
        device: the compute device.
    """

    def __init__(self, model, device: torch.device) -> None:
        self.layers = list(model.model.layers)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.host: list[dict[str, torch.Tensor]] = []
        for layer in self.layers:
            tensors = dict(layer.named_parameters())
            tensors.update(layer.named_buffers())
            if self.stream is not None:
                for t in tensors.values():
                    if not t.is_pinned():
                        t.data = t.data.pin_memory()  # once: pinned copies are async and ~4x faster
            self.host.append({name: t.data for name, t in tensors.items()})
        self.ready: dict[int, torch.cuda.Event | None] = {}

    def prefetch(self, i: int) -> None:
        """Start copying layer i's weights to the device (on the side stream when on CUDA)."""
        if i >= len(self.layers) or i in self.ready:
            return
        tensors = dict(self.layers[i].named_parameters())
        tensors.update(self.layers[i].named_buffers())
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:
            for name, t in tensors.items():
                t.data = self.host[i][name].to(self.device, non_blocking=True)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        self.ready[i] = event

    def acquire(self, i: int) -> None:
        """Make layer i's weights usable on the compute stream."""
        self.prefetch(i)
        event = self.ready[i]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, i: int) -> None:
        """Point layer i back at its pinned CPU weights (the device copies are freed)."""
        tensors = dict(self.layers[i].named_parameters())
        tensors.update(self.layers[i].named_buffers())
        for name, t in tensors.items():
            if self.stream is not None:
                # allocated on the side stream, used on the compute stream: keep the memory until that work is done
                t.data.record_stream(torch.cuda.current_stream(self.device))
            t.data = self.host[i][name]
        self.ready.pop(i, None)


def device_room(device: torch.device) -> int:
    """Bytes this process can still allocate on a CUDA device: free memory, capped by a per-process
    memory fraction if one is set, plus what the caching allocator holds unused."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    return max(0, min(free, int(fraction * total) - reserved)) + reserved - torch.cuda.memory_allocated(device)


def _residual_stream(n: int, shape: ModelShape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (N, C) residual stream: on the device when it fits comfortably, else in (pinned) CPU memory.

    On the device, each chunk's host↔device copies (2 × 32 MiB per 4096-token chunk of an 8B model)
    disappear. "Comfortably": at most a quarter of what is left once the two layers' KV that can be
    live at once (one computing, one draining) are set aside — the rest is for the weights in
    flight, a chunk's activations and fragmentation (1 GiB at 128K for Llama-3-8B passes under a
    16 GiB budget; 8 GiB at 1M tokens stays on the host).
    """
    if device.type == "cuda":
        kv_bytes = 2 * shape.n_kv_heads * n * shape.head_dim * dtype.itemsize
        if n * shape.hidden_size * dtype.itemsize <= (device_room(device) - 2 * kv_bytes) // 4:
            return torch.empty((n, shape.hidden_size), dtype=dtype, device=device)
    return torch.empty((n, shape.hidden_size), dtype=dtype, pin_memory=device.type == "cuda")


def whole_layer_attention_fits(n: int, shape: ModelShape, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether one layer's queries and attention output for all N tokens (2 × N·H·D) fit comfortably.

    Then the layer's attention is one causal SDPA call over the whole sequence (the call HF's own
    prefill makes; on an H100 torch dispatches it to cuDNN's kernel, 1.4× faster at 128K than the
    chunked flash path, measured): 2 GiB at 128K for Llama-3-8B, which passes under a 16 GiB budget
    with streamed weights; at 1M (16 GiB) the chunked path runs. Same "comfortably" rule as
    `_residual_stream`.
    """
    if device.type != "cuda":
        return False
    need = 2 * n * shape.n_heads * shape.head_dim * dtype.itemsize
    kv_bytes = 2 * shape.n_kv_heads * n * shape.head_dim * dtype.itemsize
    return need <= (device_room(device) - 2 * kv_bytes) // 4


def _run_layer(
    model,
    layer_idx: int,
    layer,
    hidden: torch.Tensor,
    shape: ModelShape,
    device: torch.device,
    chunk_size: int,
    drain: KVDrain,
    progress: Callable[[int], None] | None,
    whole: bool | None = None,
    past: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One decoder layer over all N tokens, chunk by chunk; `hidden` (N, C) is updated in place.

    The layer's keys/values (Hkv, N, D) live on the device while it runs, then go to `drain`, which
    copies them out while the next layer computes. With `whole` (default: when it fits, see
    `whole_layer_attention_fits`) the chunks' queries are kept and the attention runs once for the
    whole layer between a projection pass and an output pass; otherwise each chunk attends on its own.
    With `past` (this layer's (Hkv, P, D) keys and values of the P positions before `hidden`'s first
    token, from a cache: `topk prefill --append`), `hidden` holds positions P.. only, its chunks attend
    to the past keys too, and the layer's KV handed to `drain` covers all P + N positions.
    """
    P = 0 if past is None else past[0].shape[1]
    N = P + hidden.shape[0]
    if whole is None:
        whole = P == 0 and whole_layer_attention_fits(N, shape, hidden.dtype, device)
    keys = torch.empty((1, shape.n_kv_heads, N, shape.head_dim), dtype=hidden.dtype, device=device)
    values = torch.empty_like(keys)
    if P:
        keys[0, :, :P].copy_(past[0])
        values[0, :, :P].copy_(past[1])
    queries = torch.empty((1, shape.n_heads, N, shape.head_dim), dtype=hidden.dtype, device=device) if whole else None
    for s in range(P, N, chunk_size):
        e = min(s + chunk_size, N)
        x = hidden[s - P : e - P].to(device, non_blocking=True)[None]  # (1, T, C); a view if on device
        cos, sin = rope(model, x, torch.arange(s, e, device=device))
        q, k, v = attention_inputs(layer, x, cos, sin, shape)  # (1, H|Hkv, T, D)
        keys[:, :, s:e], values[:, :, s:e] = k, v
        if whole:
            queries[:, :, s:e] = q
            continue
        out = chunk_attention(q, keys[:, :, :e], values[:, :, :e])  # (1, H, T, D)
        # pinned host: an async device→pinned copy; stream order keeps the next layer's read of it correct
        hidden[s - P : e - P].copy_(finish_block(layer, x, out)[0], non_blocking=True)
        if progress is not None:
            progress(e - s)
    if whole:
        ATTENTION_PATHS.add("whole-layer sdpa")
        attn = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, enable_gqa=shape.n_heads != shape.n_kv_heads
        )  # (1, H, N, D)
        del queries
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            x = hidden[s:e].to(device, non_blocking=True)[None]
            hidden[s:e].copy_(finish_block(layer, x, attn[:, :, s:e])[0], non_blocking=True)
            if progress is not None:
                progress(e - s)
    drain.submit(layer_idx, keys[0], values[0])  # returns at once on CUDA: no sync, the GPU goes on


def _sync_host(hidden: torch.Tensor, device: torch.device) -> None:
    """Before the CPU reads a pinned `hidden`: the async copies into it must have landed."""
    if device.type == "cuda" and not hidden.is_cuda:
        torch.cuda.synchronize(device)


class _Resume:
    """Where a prefill starts (layer 0 from the embeddings, or a checkpoint) and when it checkpoints."""

    def __init__(
        self, start: int, hidden: torch.Tensor | None, fn: Callable[[int, torch.Tensor], None] | None, every: float
    ) -> None:
        self.start, self.hidden, self.fn, self.every = start, hidden, fn, every
        self.last = time.monotonic()

    def residual(
        self,
        model,
        ids: list[int],
        shape: ModelShape,
        dtype: torch.dtype,
        device: torch.device,
        embed_device: torch.device,
        chunk_size: int,
    ) -> torch.Tensor:
        """The (N, C) residual stream entering layer `start`: the embeddings, or the checkpoint's copy."""
        N = len(ids)
        hidden = _residual_stream(N, shape, dtype, device)
        if self.start:
            hidden.copy_(self.hidden.to(dtype))
            self.hidden = None
            return hidden
        tokens = torch.tensor(ids, dtype=torch.int64)
        for s in range(0, N, chunk_size):
            hidden[s : s + chunk_size].copy_(model.model.embed_tokens(tokens[s : s + chunk_size].to(embed_device)))
        return hidden

    def after_layer(
        self, next_layer: int, n_layers: int, hidden: torch.Tensor, drain: KVDrain, device: torch.device
    ) -> None:
        """Checkpoint when one is due: the layers below `next_layer` are on disk first (drain.wait)."""
        if self.fn is None or next_layer >= n_layers or time.monotonic() - self.last < self.every:
            return
        drain.wait()
        _sync_host(hidden, device)
        self.fn(next_layer, hidden.cpu() if hidden.is_cuda else hidden)
        self.last = time.monotonic()


@torch.inference_mode()
def prefill_layers(
    model,
    ids: list[int],
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None],
    chunk_size: int = CHUNK_SIZE,
    progress: Callable[[int], None] | None = None,
    offload_weights: bool = False,
    device: torch.device | str | None = None,
    start_layer: int = 0,
    hidden: torch.Tensor | None = None,
    checkpoint: Callable[[int, torch.Tensor], None] | None = None,
    checkpoint_every: float = 60.0,
    past: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, PrefillStats]:
    """Run the model over `ids` layer by layer, handing each layer's KV to `on_layer`.

    Args:
        model: HF causal LM (weights on the compute device, or on the CPU with `offload_weights`).
        ids: the N context token ids.
        on_layer: called as on_layer(layer, keys, values) with owned (Hkv, N, D) CPU tensors, post-RoPE
            keys, once per layer in layer order. On CUDA it runs in a background thread while the next
            layer computes (one call at a time); what it raises is re-raised here.
        chunk_size: tokens per chunk.
        progress: called with the number of tokens just processed (for a progress bar).
        offload_weights: keep the weights on the CPU and stream one decoder layer at a time to
            `device` (the embedding and LM head run where they are; only the last token's logits
            are computed).
        device: compute device with `offload_weights` (default: CUDA when available).
        start_layer: resume: compute layers start_layer.. only (`hidden` must then be given).
        hidden: (N, C) CPU residual stream entering `start_layer` (from a checkpoint).
        checkpoint: called as checkpoint(next_layer, hidden) with the (N, C) CPU residual stream
            entering `next_layer`, once every layer below it was handed to `on_layer` and returned;
            at most every `checkpoint_every` seconds (0: after every layer), never after the last layer.
        checkpoint_every: seconds between checkpoints.
        past: continue a context (`topk prefill --append`): past(layer) gives that layer's (Hkv, P, D)
            CPU keys and values of the P positions before `ids`, which then sit at positions P..; each
            chunk attends to them too, `on_layer` gets all P + N positions, and the chunks start at P
            (a multiple of `chunk_size` gives exactly the chunks a prefill of the whole context runs).
    Returns:
        the logits (V,) after the last token, and PrefillStats (n_tokens: the tokens computed).
    """
    if start_layer and hidden is None:
        raise ValueError("start_layer > 0 needs the residual stream entering it (hidden)")
    resume = _Resume(start_layer, hidden, checkpoint, checkpoint_every)
    shape = ModelShape.from_config(model.config)
    dtype = next(model.parameters()).dtype
    if offload_weights:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _prefill_offloaded(model, ids, on_layer, chunk_size, progress, shape, dtype, device, resume, past)
    device = next(model.parameters()).device
    N = len(ids)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    hidden = resume.residual(model, ids, shape, dtype, device, device, chunk_size)  # (N, C)
    with KVDrain(on_layer, device) as drain:  # leaving it waits for the last layer's on_layer
        for layer_idx, layer in enumerate(model.model.layers):
            if layer_idx < resume.start:
                continue
            _run_layer(
                model,
                layer_idx,
                layer,
                hidden,
                shape,
                device,
                chunk_size,
                drain,
                progress,
                past=None if past is None else past(layer_idx),
            )
            resume.after_layer(layer_idx + 1, shape.n_layers, hidden, drain, device)
        _sync_host(hidden, device)
        last = final_logits(model, hidden[N - 1 : N].to(device)[None])[0].cpu()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return last, PrefillStats(N, time.perf_counter() - t0, peak, resume.start)


def _prefill_offloaded(
    model,
    ids,
    on_layer,
    chunk_size,
    progress,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    resume: _Resume,
    past=None,
) -> tuple[torch.Tensor, PrefillStats]:
    """`prefill_layers` with the weights on the CPU: one decoder layer on the device at a time."""
    N = len(ids)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    embed_device = model.model.embed_tokens.weight.device  # the embedding lookup stays where it is
    hidden = resume.residual(model, ids, shape, dtype, device, embed_device, chunk_size)  # (N, C)
    rotary = model.model.rotary_emb
    rotary_host = {name: b.data for name, b in rotary.named_buffers()}
    for b in rotary.buffers():
        b.data = b.data.to(device)
    streamer = LayerStreamer(model, device)
    try:
        with KVDrain(on_layer, device) as drain:  # leaving it waits for the last layer's on_layer
            for layer_idx, layer in enumerate(model.model.layers):
                if layer_idx < resume.start:
                    continue
                streamer.acquire(layer_idx)
                streamer.prefetch(layer_idx + 1)  # overlaps with this layer's compute
                _run_layer(
                    model,
                    layer_idx,
                    layer,
                    hidden,
                    shape,
                    device,
                    chunk_size,
                    drain,
                    progress,
                    past=None if past is None else past(layer_idx),
                )
                streamer.release(layer_idx)
                resume.after_layer(layer_idx + 1, shape.n_layers, hidden, drain, device)
            _sync_host(hidden, device)
            head_device = model.lm_head.weight.device
            last = final_logits(model, hidden[N - 1 : N].to(head_device)[None])[0].cpu()
    finally:
        for name, b in rotary.named_buffers():
            b.data = rotary_host[name]
        for i in list(streamer.ready):
            streamer.release(i)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return last, PrefillStats(N, time.perf_counter() - t0, peak, resume.start)
