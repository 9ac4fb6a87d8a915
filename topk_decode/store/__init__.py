"""The on-disk cache directory: locked atomic writer, validating memory-mapped reader (docs/DESIGN.md "Cache format")."""

from topk_decode.store.cache_dir import CacheWriter, ContextKV, check_cache, open_cache
from topk_decode.store.format import FORMAT_VERSION, MANIFEST

__all__ = ["CacheWriter", "ContextKV", "open_cache", "check_cache", "FORMAT_VERSION", "MANIFEST"]
