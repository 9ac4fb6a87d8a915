"""Synthetic context KV: random keys/values of a model's shape, built fast, for decode-only runs.

Decode speed does not depend on what the keys say, only on their shape and dtype, so when a real
prefill would not fit the time budget (512K and 1M tokens) the benchmark decodes over random KV.
Filling 57 GiB with `randn` would take minutes; we draw one random pool (≤ 2^20 rows) and copy it
into every (layer, head) at a random rotation: fast memcpy speed, and no two heads alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

from topk_decode.store.cache_dir import CacheWriter, ContextKV, open_cache
from topk_decode.store.format import FORMAT_VERSION, QUANTIZED, dtype_name
from topk_decode.store.quant import quantize_keys, quantize_values

_POOL_ROWS = 1 << 20


def kv_bytes(n_layers: int, n_kv_heads: int, head_dim: int, n_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a context's keys and values."""
    return 2 * n_layers * n_kv_heads * n_tokens * head_dim * torch.empty((), dtype=dtype).element_size()


def _fill(dst: torch.Tensor, pool: torch.Tensor, gen: torch.Generator) -> None:
    """Fill (N, D) rows with the pool rotated by a random offset."""
    n, p = dst.shape[0], pool.shape[0]
    off = int(torch.randint(0, p, (1,), generator=gen))
    s = 0
    while s < n:
        take = min(n - s, p - off)
        dst[s : s + take].copy_(pool[off : off + take])
        s += take
        off = 0


def shape_manifest(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    n_tokens: int,
    dtype: torch.dtype,
    model_type: str,
    synthetic: bool = True,
    n_heads: int | None = None,
    model: str = "<synthetic>",
) -> dict:
    """The manifest of a benchmark's cache: random KV (`synthetic`) or a named shape's prefill with random weights."""
    name = dtype_name(dtype)
    return {
        "format_version": FORMAT_VERSION,
        "synthetic": synthetic,
        "model": {"path": model, "fingerprint": model, "model_type": model_type, "dtype": name},
        "shape": {
            "n_layers": n_layers,
            "n_heads": n_heads or n_kv_heads,
            "n_kv_heads": n_kv_heads,
            "head_dim": head_dim,
            "vocab_size": 0,
        },
        "kv_dtype": name,
        "n_tokens": n_tokens,
        "documents": [],
        "files": {},
    }


def synthetic_kv(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    n_tokens: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    path: str | Path | None = None,
    model_type: str = "llama",
    kv_dtype: str | None = None,
) -> ContextKV:
    """Random context KV of a given shape, in RAM (path=None) or written as a real cache directory.

    Args:
        n_layers, n_kv_heads, head_dim: the model's attention shape.
        n_tokens: context length N.
        dtype: KV dtype (the model's compute dtype).
        seed: random seed.
        path: write a cache directory there (via CacheWriter) and open it memory-mapped; None keeps
            the tensors in RAM (faster to build; the decoder reads them the same way).
        model_type: recorded in the manifest.
        kv_dtype: "int8": stored as `topk prefill --kv-dtype int8` stores them (store/quant.py); None: `dtype`.
    Returns:
        a ContextKV whose keys[l], values[l] are (Hkv, N, D).
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((min(n_tokens, _POOL_ROWS), head_dim), generator=gen).to(dtype)
    vpool = torch.randn((min(n_tokens, _POOL_ROWS), head_dim), generator=gen).to(dtype)
    tokens = [3 + (i % 97) for i in range(n_tokens)]
    writer = CacheWriter(path, kv_dtype=kv_dtype) if path is not None else None
    keys, values, key_scales, value_scales = [], [], [], []
    for _ in range(n_layers):
        k = torch.empty((n_kv_heads, n_tokens, head_dim), dtype=dtype)
        v = torch.empty_like(k)
        for h in range(n_kv_heads):
            _fill(k[h], pool, gen)
            _fill(v[h], vpool, gen)
        if writer is not None:
            writer.write_layer(len(keys), k, v)
            keys.append(None)
            values.append(None)
        elif kv_dtype == QUANTIZED:
            for stored, scales, (x8, sx) in (
                (keys, key_scales, quantize_keys(k)),
                (values, value_scales, quantize_values(v)),
            ):
                stored.append(x8)
                scales.append(sx)
        else:
            keys.append(k)
            values.append(v)
    manifest = shape_manifest(n_layers, n_kv_heads, head_dim, n_tokens, dtype, model_type)
    manifest["kv_dtype"] = kv_dtype or manifest["kv_dtype"]
    if writer is None:
        scaled = {"key_scales": key_scales, "value_scales": value_scales} if kv_dtype == QUANTIZED else {}
        return ContextKV(path=Path("<memory>"), manifest=manifest, tokens=tokens, keys=keys, values=values, **scaled)
    writer.write_tokens(tokens)
    manifest = {k: v for k, v in manifest.items() if k not in ("format_version", "files")}
    return open_cache(writer.commit(manifest), verify=False)


def kv_in_memory(keys: list[torch.Tensor], values: list[torch.Tensor], tokens: list[int], model_type: str) -> ContextKV:
    """Wrap per-layer (Hkv, N, D) CPU tensors (e.g. a prefill's output) as an in-RAM ContextKV.

    Args:
        keys, values: per layer (Hkv, N, D).
        tokens: the N context token ids.
        model_type: recorded in the manifest.
    """
    L = len(keys)
    hkv, n, d = keys[0].shape
    manifest = shape_manifest(L, hkv, d, n, keys[0].dtype, model_type)
    manifest["synthetic"] = False
    return ContextKV(path=Path("<memory>"), manifest=manifest, tokens=list(tokens), keys=keys, values=values)
