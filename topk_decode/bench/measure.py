"""Memory facts and limits: CPU RSS, peak GPU memory, the GPU budget, and fit estimates; a CUDA timer for the probes."""

from __future__ import annotations

import gc
import re

import torch

from topk_decode.errors import TopkError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}
GIB = float(1 << 30)


def parse_bytes(text: str) -> int:
    """'16GiB' → 17179869184, '500MB' → 500000000, '1024' → 1024.

    Args:
        text: a number with an optional unit (B, KB/KiB, MB/MiB, GB/GiB, TB/TiB).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise TopkError(f"cannot read {text!r} as a size (e.g. 16GiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_tokens(text: str) -> int:
    """'128K' → 131072, '1M' → 1048576, '5000' → 5000 (K and M are binary, as context lengths usually are).

    Args:
        text: a token count with an optional K/M suffix.
    """
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise TopkError(f"cannot read {text!r} as a context length (e.g. 32K, 128K, 1M, 5000)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]


def anon_huge_pages() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages (/proc/self/smaps_rollup; 0 elsewhere)."""
    try:
        text = open("/proc/self/smaps_rollup").read()
    except OSError:
        return 0
    m = re.search(r"AnonHugePages:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def cpu_rss() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes (Linux /proc; zeros elsewhere)."""
    try:
        text = open("/proc/self/status").read()
    except OSError:
        return 0, 0
    get = lambda key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024  # noqa: E731
    return get("VmRSS"), get("VmHWM")


def set_gpu_budget(device: torch.device, budget: int | None) -> None:
    """Cap this process's CUDA caching allocator at `budget` bytes (None: the whole GPU).

    Args:
        device: the CUDA device (no-op on CPU).
        budget: bytes, or None to lift the cap.
    """
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" names no index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / total), index)


def sync(device: torch.device) -> None:
    """Wait for the device's work (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what Python no longer references, on the host and the device; reset the peak counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gpu(device: torch.device) -> int | None:
    """Peak bytes allocated on the device since the last `release` (None on CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_gpu(device: torch.device) -> int | None:
    """Bytes the device could still give this process (None on CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def is_oom(e: BaseException) -> bool:
    """True for device (or host) out-of-memory errors."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def cuda_median_ms(fn, reps: int) -> float:
    """Median milliseconds of fn(i) for i in range(reps), each timed by CUDA events (one untimed call first)."""
    fn(0)
    out = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]
