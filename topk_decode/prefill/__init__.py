"""Prefill: documents → context tokens → layer-wise chunked KV → cache directory."""

import importlib

# name → submodule; imported on first use, so reading documents (documents.py) does not pull in torch.
_EXPORTS = {
    "build_cache": "build",
    "pick_device": "build",
    "collect_documents": "documents",
    "layout_context": "documents",
    "PrefillStats": "layerwise",
    "chunk_attention": "layerwise",
    "prefill_layers": "layerwise",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "build_cache",
    "pick_device",
    "collect_documents",
    "layout_context",
    "PrefillStats",
    "chunk_attention",
    "prefill_layers",
]
