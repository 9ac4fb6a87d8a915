"""Prefill: documents → context tokens → layer-wise chunked KV → cache directory."""

from topk_decode.prefill.build import build_cache, pick_device
from topk_decode.prefill.documents import collect_documents, layout_context
from topk_decode.prefill.layerwise import PrefillStats, chunk_attention, prefill_layers

__all__ = ["build_cache", "pick_device", "collect_documents", "layout_context", "PrefillStats",
           "chunk_attention", "prefill_layers"]
