"""Thread control without process-wide side effects: the per-head search pool and per-thread OpenMP.

OpenMP's thread count (`omp_set_num_threads`) is a per-thread setting: it applies to the parallel
regions the calling thread starts, and other threads keep theirs. `torch.set_num_threads` and a
Faiss call made on the caller's thread are not scoped that way (torch's also sets the default of
every thread that starts later), so a host application's own torch or Faiss work would change speed.
Here the setting is made only on threads we own (the pool's workers) or for the duration of one call
on the current thread (`omp_threads`).

Every count starts from `topk_decode.cpus.usable_cpus()` (TOPK_THREADS, else the CPUs this process may
run on): the pools never hold more threads than that, and their workers run single-threaded inside, so
the per-head searches, torch's OpenMP threads and Faiss's never multiply.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

from topk_decode.cpus import usable_cpus

T = TypeVar("T")
R = TypeVar("R")


def default_threads() -> int:
    """Threads for per-head searches: one per usable CPU (`usable_cpus`), each search single-threaded inside."""
    return usable_cpus()


def _torch_openmp():
    """The OpenMP runtime torch's CPU ops run on, if it can be reached and is per-thread; else None."""
    lib_dir = Path(torch.__file__).parent / "lib"
    candidates = [
        p
        for pattern in ("libgomp*.so*", "libiomp*.so*", "libomp*.so*", "libomp*.dylib")
        for p in sorted(lib_dir.glob(pattern))
    ]
    for path in [str(p) for p in candidates] + [None]:  # None: the symbols the process has already loaded
        try:
            lib = ctypes.CDLL(path)
            set_n, get_n = lib.omp_set_num_threads, lib.omp_get_max_threads
        except (OSError, AttributeError):
            continue
        set_n.argtypes, get_n.restype = [ctypes.c_int], ctypes.c_int
        torch.get_num_threads()  # torch sets this thread's count lazily once: let it happen first
        before = get_n()
        set_n(1)
        works = torch.get_num_threads() == 1 or before == 1
        set_n(before)
        if works:
            return lib
    return None


_OMP = _torch_openmp()


@contextmanager
def omp_threads(n: int | None) -> Iterator[None]:
    """Run the body's torch CPU ops on at most `n` OpenMP threads, on this thread only.

    Args:
        n: the thread count; None leaves everything as it is. Where torch's OpenMP runtime cannot be
            reached (not seen on Linux wheels), torch.set_num_threads is switched around the body instead.
    """
    if n is None:
        yield
        return
    if _OMP is None:  # no per-thread control reachable: fall back to torch's process-wide setting
        before = torch.get_num_threads()
        torch.set_num_threads(min(n, before))
        try:
            yield
        finally:
            torch.set_num_threads(before)
        return
    before = _OMP.omp_get_max_threads()
    if before <= n:
        yield
        return
    _OMP.omp_set_num_threads(n)
    try:
        yield
    finally:
        _OMP.omp_set_num_threads(before)


def _single_threaded_worker() -> None:
    # Faiss parallelises one search over its queries only (G·T of them per head): the pool runs the
    # heads in parallel, so each search stays on one thread. Set on the worker only (see the module doc).
    try:
        import faiss  # optional at import time: the torch scan paths (flat, routed) run without it
    except ImportError:
        faiss = None
    if faiss is not None:
        faiss.omp_set_num_threads(1)
    if _OMP is not None:
        _OMP.omp_set_num_threads(1)


def _in_inference_mode(fn: Callable[[T], R]) -> Callable[[T], R]:
    """fn, run under torch.inference_mode (a tensor made under it may only be written under it)."""

    def run(item: T) -> R:
        with torch.inference_mode():
            return fn(item)

    return run


class HeadPool:
    """A pool that runs one function per KV head in parallel, each on a single OpenMP thread.

    Args:
        threads: worker threads; 1 runs the heads in the caller's thread, one after another.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="topk-heads", initializer=_single_threaded_worker)
            if threads > 1
            else None
        )

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """[fn(i) for i in items], in parallel when the pool has threads.

        Args:
            fn: the per-item work (one KV head's search).
            items: the items (head indices).
        """
        if not self._pool:
            return [fn(i) for i in items]
        if torch.is_inference_mode_enabled():  # thread-local: a worker writing the caller's tensors needs it too
            fn = _in_inference_mode(fn)
        futures = [self._pool.submit(fn, i) for i in items]
        try:
            return [f.result() for f in futures]
        except BaseException:
            # An interrupted step (Ctrl-C) or a failed task: no task may still be writing into the
            # strategy's buffers when the next step reuses them.
            for f in futures:
                f.cancel()
            wait(futures)
            raise

    def close(self) -> None:
        """Stop the worker threads (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
