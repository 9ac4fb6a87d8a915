"""Copies of large arrays in memory backed by transparent huge pages (Linux), for scans that read scattered rows.

routed's compiled scan reads clusters of a few rows scattered over GiBs of keys and values. With 4 KiB pages
nearly every cluster read is a TLB miss and a page walk; in 2 MiB pages the walks mostly go away
(docs/BENCHMARKS.md runs 16 and 17). Transparent huge pages are only given to anonymous memory advised
MADV_HUGEPAGE before it is first touched (hosts commonly run THP in `madvise` mode), so the arrays are copied
into such a mapping; a memory-mapped file stays in 4 KiB pages.
"""

from __future__ import annotations

import mmap

import torch


def supported() -> bool:
    """Whether this platform can advise huge pages (Linux with MADV_HUGEPAGE)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in an anonymous mapping advised MADV_HUGEPAGE before its first touch (same shape and
    dtype, contiguous); the mapping lives as long as the tensor. Where huge pages cannot be advised, a plain
    contiguous copy.

    Args:
        t: a CPU tensor (any layout; memory-mapped or in RAM).
    """
    nbytes = t.numel() * t.element_size()
    if not supported() or nbytes == 0:
        return t.contiguous().clone()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)  # keeps `buf` alive
    out.copy_(t)
    return out


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
