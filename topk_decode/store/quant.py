"""The int8 KV format (`topk prefill --kv-dtype int8`): half of bf16's bytes, searched and attended as stored.

Symmetric int8 with float32 scales, split as KIVI and KVQuant split them (keys have outlier channels, values
outlier tokens), chosen by measurement (docs/history/eval-2026-11.md "KV formats": dense's answer on 108 of 108
questions, KL against dense 3× bf16's and 40× below fp8's with the same scales; int4 lost answers):

    keys    k ≈ k8 ⊙ s_k      s_k (Hkv, D): per KV head and channel, max |k| over the layer's tokens / 127
    values  v ≈ v8 · s_v      s_v (Hkv, N): per KV head and token, max |v| over the row / 127

Neither is widened into a copy. A per-channel key scale folds into the query, q·k ≈ (q ⊙ s_k)·k8, so a strategy
searches the int8 keys with `scaled_queries(q)` and its scores are the dequantised keys' exact scores; a
per-token value scale folds into the attention weight, Σ w_i v_i ≈ Σ (w_i s_v,i) v8_i (decode/context.py).

    >>> import torch
    >>> k, v = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    >>> k8, sk = quantize_keys(k)
    >>> v8, sv = quantize_values(v)
    >>> k8.dtype, tuple(sk.shape), tuple(sv.shape)
    (torch.int8, (2, 4), (2, 5))
    >>> bool((dequantize_keys(k8, sk) - k).abs().max() <= sk.max() / 2 + 1e-6)
    True
"""

from __future__ import annotations

import torch

QMAX = 127.0  # symmetric: −127..127 (−128 unused, so that negation stays in range)
TINY_SCALE = 1e-30  # the scale of an all-zero channel or row (any positive number: its codes are 0)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x scaled by max |x| over `dim`, rounded to int8; the scale with `dim` squeezed out (float32)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=dim, keepdim=True) / QMAX).clamp_min(TINY_SCALE)
    return torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale.squeeze(dim)


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hkv, N, D) keys → int8 keys and float32 scales (Hkv, D), one per KV head and channel."""
    return _quantize(keys, 1)


def quantize_values(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hkv, N, D) values → int8 values and float32 scales (Hkv, N), one per KV head and token."""
    return _quantize(values, 2)


def quantize_context(ckv):
    """An in-RAM context's KV (a `ContextKV` of float layers) as `topk prefill --kv-dtype int8` stores it, layer by
    layer (each layer's float tensors are dropped from `ckv` once its int8 ones exist); the returned ContextKV holds
    the int8 layers and their scales."""
    import dataclasses

    from topk_decode.store.format import QUANTIZED

    key_scales, value_scales = [], []
    for layer in range(ckv.n_layers):
        ckv.keys[layer], ks = quantize_keys(ckv.keys[layer])
        ckv.values[layer], vs = quantize_values(ckv.values[layer])
        key_scales.append(ks)
        value_scales.append(vs)
    manifest = dict(ckv.manifest, kv_dtype=QUANTIZED)
    return dataclasses.replace(ckv, manifest=manifest, key_scales=key_scales, value_scales=value_scales)


def dequantize_keys(k8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 keys (Hkv, M, D) with their (Hkv, D) scales → float32 keys."""
    return k8.float() * scales[:, None, :]


def dequantize_values(v8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 values (Hkv, M, D) with their (Hkv, M) scales → float32 values."""
    return v8.float() * scales[..., None]


def scaled_queries(q: torch.Tensor, key_scales: torch.Tensor) -> torch.Tensor:
    """(Hkv, Q, D) float32 queries ⊙ the layer's (Hkv, D) key scales: their dot products with the int8 keys are
    the scores against the dequantised keys."""
    return q * key_scales[:, None, :]
