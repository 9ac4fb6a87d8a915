"""Names and dtypes of the cache directory format (see README "Cache format")."""

from __future__ import annotations

import numpy as np
import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.i32"


def keys_file(layer: int) -> str:
    """File holding layer `layer`'s post-RoPE keys, (Hkv, N, D) row-major."""
    return f"kv/keys.{layer:03d}.bin"


def values_file(layer: int) -> str:
    """File holding layer `layer`'s values, (Hkv, N, D) row-major."""
    return f"kv/values.{layer:03d}.bin"


# bf16 has no numpy dtype: it is stored as raw 16-bit words and reinterpreted by torch.
_STORAGE = {
    "float32": (np.float32, torch.float32),
    "float16": (np.float16, torch.float16),
    "bfloat16": (np.uint16, torch.bfloat16),
}


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of a torch dtype."""
    for name, (_, t) in _STORAGE.items():
        if t == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


def numpy_storage(name: str) -> np.dtype:
    """The numpy dtype used to memory-map a stored array of this manifest dtype."""
    return np.dtype(_STORAGE[name][0])


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name."""
    return _STORAGE[name][1]


def as_torch(arr: np.ndarray, name: str) -> torch.Tensor:
    """Zero-copy torch view of a memory-mapped array (read-only maps are viewed, not copied)."""
    import warnings

    with warnings.catch_warnings():
        # torch warns that read-only memory maps are not writable; we never write through them.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch_dtype(name))
