"""Names and dtypes of the cache directory format (see docs/DESIGN.md "Cache format")."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations: imported where used, so start-up needs neither
    import numpy as np
    import torch

# v2 (this version): manifest carries FORMAT_MARKER and its own checksum (`manifest_blake2b`); strategy
# done.json files record their artifacts' sizes and checksums. v1 caches still open (no manifest checksum).
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
FORMAT_MARKER = "topk-decode-cache"
MANIFEST = "manifest.json"
TOKENS = "tokens.i32"
LAST_LOGITS = "last_logits.f32"
# What a cache directory may hold at its top level (anything else means it is not only ours).
TOP_LEVEL = frozenset({MANIFEST, TOKENS, LAST_LOGITS, "kv", "index"})
KV_FILE = re.compile(r"(keys|values|key_scales|value_scales)\.\d{3,}\.bin")


def lock_path(out: Path) -> Path:
    """The lock file beside cache `out` that writers hold (flock) for a whole prefill."""
    return out.with_name(f".{out.name}.lock")


def partial_path(out: Path) -> Path:
    """The one partial directory a prefill of `out` fills before its commit (kept for --resume)."""
    return out.with_name(f".{out.name}.partial")


def keys_file(layer: int) -> str:
    """File holding layer `layer`'s post-RoPE keys, (Hkv, N, D) row-major."""
    return f"kv/keys.{layer:03d}.bin"


def values_file(layer: int) -> str:
    """File holding layer `layer`'s values, (Hkv, N, D) row-major."""
    return f"kv/values.{layer:03d}.bin"


def key_scales_file(layer: int) -> str:
    """An int8 cache's per-channel key scales of layer `layer`, (Hkv, D) float32 (store/quant.py)."""
    return f"kv/key_scales.{layer:03d}.bin"


def value_scales_file(layer: int) -> str:
    """An int8 cache's per-token value scales of layer `layer`, (Hkv, N) float32 (store/quant.py)."""
    return f"kv/value_scales.{layer:03d}.bin"


def layer_files(layer: int) -> tuple[str, ...]:
    """Every file a layer of the KV may have (the scales only in int8 caches)."""
    return keys_file(layer), values_file(layer), key_scales_file(layer), value_scales_file(layer)


# Manifest dtype name → (numpy storage dtype, bytes per element). bf16 has no numpy dtype: it is stored
# as raw 16-bit words and reinterpreted by torch. The torch dtype is torch's attribute of the same name.
# numpy and torch are imported only when an array is made: `topk info` and error paths start without them.
# int8 (`topk prefill --kv-dtype int8`) is stored with float32 scales beside it (store/quant.py).
_STORAGE = {"float32": ("float32", 4), "float16": ("float16", 2), "bfloat16": ("uint16", 2), "int8": ("int8", 1)}
KV_DTYPES = tuple(_STORAGE)
QUANTIZED = "int8"  # the one KV dtype stored with scales


def check_kv_dtype(kv_dtype: str | None) -> None:
    """Refuse, with a one-line TopkError, a `--kv-dtype` other than int8 (None: the model's dtype)."""
    from topk_decode.errors import TopkError

    if kv_dtype not in (None, QUANTIZED):
        raise TopkError(f"--kv-dtype must be {QUANTIZED} (or left out: the model's dtype), got {kv_dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of a torch dtype."""
    import torch

    for name in _STORAGE:
        if getattr(torch, name) == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


def numpy_storage(name: str) -> np.dtype:
    """The numpy dtype used to memory-map a stored array of this manifest dtype."""
    import numpy as np

    return np.dtype(_STORAGE[name][0])


def itemsize(name: str) -> int:
    """Bytes per stored element of this manifest dtype."""
    return _STORAGE[name][1]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name."""
    import torch

    if name not in _STORAGE:
        raise KeyError(name)
    return getattr(torch, name)


def as_torch(arr: np.ndarray, name: str) -> torch.Tensor:
    """Zero-copy torch view of a memory-mapped array (read-only maps are viewed, not copied)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        # torch warns that read-only memory maps are not writable; we never write through them.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch_dtype(name))


def blake2_stream(f) -> str:
    """blake2b-128 of an open binary file from its position to the end, read in 8 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    while block := f.read(8 << 20):
        h.update(block)
    return h.hexdigest()


def blake2_file(path) -> str:
    """blake2b-128 of a whole file (the checksum every cache file and artifact records)."""
    with open(path, "rb") as f:
        return blake2_stream(f)
