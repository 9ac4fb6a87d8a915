"""What the compiled (numba) search paths share: the optional import, the jit flags, the dtype they read.

flat's `backend=numba` (flat_kernel.py) and routed's compiled path (routed_kernel.py) both read bf16
keys as their uint16 bits and widen them exactly to fp32 inside functions that release the GIL.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

try:  # without numba, flat and routed run their torch paths
    import numba
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None

# Reassociation lets the dot products use SIMD lanes; no "ninf"/"nnan": −inf marks rows, slots, clusters.
FASTMATH = {"reassoc", "contract"}
# What the compiled paths read: bf16 (what GPU prefills write). fp32/fp16 caches take the torch paths.
KEY_DTYPES = (torch.bfloat16,)


def available() -> bool:
    """Whether the compiled paths can run (numba is importable)."""
    return numba is not None


def jit(fn):
    """fn compiled by numba on first call (nogil: tasks run in parallel threads; cached on disk), or fn
    itself without numba."""
    return numba.njit(nogil=True, cache=True, fastmath=FASTMATH)(fn) if numba is not None else fn


def pjit(fn):
    """fn compiled with its `prange` loops run on numba's threads (`jit` otherwise).

    One such call per layer replaces a Python thread pool's map, whose futures and GIL hand-offs cost
    about as much as a head's work (docs/BENCHMARKS.md run 14). Outside its `prange` loops, numba also turns
    every array expression (np.zeros, a.sum(), a - b) into a parallel region of its own: write those as loops
    or in `jit` helpers (docs/BENCHMARKS.md run 16)."""
    return numba.njit(nogil=True, cache=True, fastmath=FASTMATH, parallel=True)(fn) if numba is not None else fn


prange = numba.prange if numba is not None else range


_SET = threading.local()   # the count this thread last set through `set_threads` (numba's is per thread too)


def set_threads(n: int) -> None:
    """Run this thread's later `pjit` calls on at most n of numba's threads (a per-thread setting)."""
    if numba is not None:
        n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
        # numba's setter checks its thread pool on every call, once per layer here (docs/BENCHMARKS.md run 17)
        if getattr(_SET, "n", None) != n:
            numba.set_num_threads(n)
            _SET.n = n


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's storage as uint16 (a view, no copy)."""
    return t.view(torch.int16).numpy().view(np.uint16)


if numba is not None:
    @intrinsic
    def prefetch(typingctx, addr):
        """Ask for the cache line at byte address `addr` (an integer: `a.ctypes.data` + offset) to be loaded.

        routed's scan reads small clusters scattered over the layout; without a hint each row is a serial
        DRAM miss (docs/BENCHMARKS.md run 15). A hint costs one instruction and never faults."""
        if not isinstance(addr, numba.types.Integer):
            return None

        def codegen(context, builder, signature, args):
            emit_prefetch(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()))
            return context.get_dummy_value()

        return numba.types.void(addr), codegen

    def emit_prefetch(builder, ptr) -> None:
        """IR for a prefetch of the line at `ptr` (an i8*): read, highest temporal locality, data cache."""
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
else:  # pragma: no cover - exercised where numba is absent
    def prefetch(addr: int) -> None:
        """A no-op without numba."""


@jit
def prefetch_row(a, row):
    """Request the cache lines of a[row] (a row of a 2-D array, an element of a 1-D one)."""
    base = a.ctypes.data + row * a.strides[0]
    for b in range(0, a.strides[0], 64):
        prefetch(base + b)
    prefetch(base + a.strides[0] - 1)                   # a row that straddles one more line


if numba is not None:
    @intrinsic
    def bf16_float(typingctx, b):
        """The float32 value of a bf16's bits (an unsigned 16-bit integer): exact, and a plain zero-extend,
        shift and bitcast that LLVM vectorizes inside a dot-product loop (a widening loop through a uint32
        buffer did not vectorize)."""
        if not isinstance(b, numba.types.Integer) or b.bitwidth != 16:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            return builder.bitcast(builder.shl(builder.zext(args[0], i32), i32(16)), ir.FloatType())

        return numba.types.float32(b), codegen
else:  # pragma: no cover - exercised where numba is absent
    def bf16_float(b: int) -> float:
        """The float value of a bf16's bits, without numba."""
        return float(np.array([int(b) << 16], dtype=np.uint32).view(np.float32)[0])


if numba is not None:
    @intrinsic
    def cycles(typingctx):
        """The CPU's cycle counter (x86: rdtsc, constant rate), int64: timestamps inside compiled code."""
        def codegen(context, builder, signature, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                "llvm.readcyclecounter")
            return builder.call(fn, [])

        return numba.types.int64(), codegen
else:  # pragma: no cover - exercised where numba is absent
    def cycles() -> int:
        """Nanoseconds without numba (then `cycles_per_second` is 1e9)."""
        return time.perf_counter_ns()


@jit
def now() -> int:
    """`cycles` read from Python (a compiled call: the same clock as the stamps taken inside kernels)."""
    return cycles()


_RATE: list[float] = []


def cycles_per_second() -> float:
    """The rate of `cycles`, measured once per process against time.perf_counter over ~20 ms."""
    if not _RATE:
        if numba is None:  # pragma: no cover
            _RATE.append(1e9)
        else:
            now()                                              # compile first
            t0, c0 = time.perf_counter(), now()
            time.sleep(0.02)
            t1, c1 = time.perf_counter(), now()
            _RATE.append((c1 - c0) / (t1 - t0))
    return _RATE[0]
