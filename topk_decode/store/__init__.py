"""The on-disk cache directory: atomic writer, validating memory-mapped reader."""

from topk_decode.store.cache_dir import CacheWriter, ContextKV, open_cache
from topk_decode.store.format import FORMAT_VERSION, MANIFEST

__all__ = ["CacheWriter", "ContextKV", "open_cache", "FORMAT_VERSION", "MANIFEST"]
