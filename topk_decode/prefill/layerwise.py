"""Layer-wise, chunked prefill: all N tokens through layer ℓ, then layer ℓ+1.

Only one layer's keys/values (Hkv, N, D) and one chunk's activations live on the device at a time,
so peak device memory grows linearly with N (never N²): each chunk attends to every earlier key of
its layer through a flash kernel with a bottom-right-aligned causal mask. The residual stream of all
N tokens is kept on the CPU between layers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from topk_decode.model.blocks import ModelShape, attention_inputs, final_logits, finish_block, rope

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

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / max(self.seconds, 1e-9)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk's queries over all keys so far (chunk = the last T keys).

    Args:
        q: (1, H, T, D); k, v: (1, Hkv, S, D) with S ≥ T, the chunk's own keys last.
    Returns:
        (1, H, T, D).
    """
    T, S = q.shape[2], k.shape[2]
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    mask = causal_lower_right(T, S) if T > 1 else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@torch.inference_mode()
def prefill_layers(
    model,
    ids: list[int],
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None],
    chunk_size: int = 4096,
    progress: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, PrefillStats]:
    """Run the model over `ids` layer by layer, handing each layer's KV to `on_layer`.

    Args:
        model: HF causal LM (weights on the compute device).
        ids: the N context token ids.
        on_layer: called as on_layer(layer, keys, values) with (Hkv, N, D) CPU tensors, post-RoPE keys.
        chunk_size: tokens per chunk.
        progress: called with the number of tokens just processed (for a progress bar).
    Returns:
        the logits (V,) after the last token, and PrefillStats.
    """
    shape = ModelShape.from_config(model.config)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    N = len(ids)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    tokens = torch.tensor(ids, dtype=torch.int64)
    # Residual stream of all N tokens, on the CPU (pinned so chunk copies are fast and async-capable).
    hidden = torch.empty((N, shape.hidden_size), dtype=dtype, pin_memory=device.type == "cuda")
    for s in range(0, N, chunk_size):
        hidden[s:s + chunk_size].copy_(model.model.embed_tokens(tokens[s:s + chunk_size].to(device)))
    for layer_idx, layer in enumerate(model.model.layers):
        keys = torch.empty((1, shape.n_kv_heads, N, shape.head_dim), dtype=dtype, device=device)
        values = torch.empty_like(keys)
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            x = hidden[s:e].to(device, non_blocking=True)[None]                     # (1, T, C)
            cos, sin = rope(model, x, torch.arange(s, e, device=device))
            q, k, v = attention_inputs(layer, x, cos, sin, shape)                   # (1, H|Hkv, T, D)
            keys[:, :, s:e], values[:, :, s:e] = k, v
            out = chunk_attention(q, keys[:, :, :e], values[:, :, :e])              # (1, H, T, D)
            # async device→pinned copy; stream order keeps the next layer's read of it correct
            hidden[s:e].copy_(finish_block(layer, x, out)[0], non_blocking=True)
            if progress is not None:
                progress(e - s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        on_layer(layer_idx, keys[0].cpu(), values[0].cpu())
        del keys, values
    last = final_logits(model, hidden[N - 1:N].to(device)[None])[0].cpu()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return last, PrefillStats(N, time.perf_counter() - t0, peak)
