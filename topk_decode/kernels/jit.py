"""The one loader of the compiled kernels: numba's jit flags, the intrinsics they share, and the instruction
set of the dot products, chosen once per process and logged.

Torch-free, as is all of `topk_decode.kernels`: the kernels take numpy arrays (bf16 keys as their uint16
bits, widened exactly to fp32 inside functions that release the GIL); the strategies in `topk_decode.index`
make those views of their tensors.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

log = logging.getLogger("topk_decode.kernels")

# Reassociation lets the dot products use SIMD lanes; no "ninf"/"nnan": −inf marks rows, slots, clusters.
FASTMATH = {"reassoc", "contract"}
BF16_DOT = "avx512bf16"  # `instruction_set()`'s answer where the hardware bf16 dot product runs
FP32_DOT = "fp32"


@functools.lru_cache(maxsize=1)
def instruction_set() -> str:
    """The dot products' instruction set (kernels/dots.py), chosen once per process and logged: BF16_DOT where the
    CPU has AVX512-BF16 and numba compiles for this CPU itself, FP32_DOT otherwise or with TOPK_NO_BF16_DOT set.

    A `NUMBA_CPU_NAME` of another CPU could lack the instruction, and LLVM aborts the process on an instruction
    its target lacks rather than raising: then the fp32 path."""
    if os.environ.get("TOPK_NO_BF16_DOT"):
        choice, why = FP32_DOT, "TOPK_NO_BF16_DOT is set"
    elif numba.config.CPU_NAME not in (None, "host") or numba.config.CPU_FEATURES:
        choice, why = FP32_DOT, "numba targets another CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)"
    else:
        features = llvm.get_host_cpu_features()
        has = bool(features.get("avx512bf16") and features.get("avx512f"))
        choice, why = (BF16_DOT, "the CPU has it") if has else (FP32_DOT, "the CPU lacks AVX512-BF16")
    log.info("compiled kernels: %s dot products (%s)", choice, why)
    return choice


def jit(fn):
    """fn compiled by numba on first call (nogil: tasks run in parallel threads; cached on disk)."""
    return numba.njit(nogil=True, cache=True, fastmath=FASTMATH)(fn)


def pjit(fn):
    """fn compiled with its `prange` loops run on numba's threads (`jit` otherwise).

    One such call per layer replaces a Python thread pool's map, whose futures and GIL hand-offs cost
    about as much as a head's work (docs/BENCHMARKS.md "routing on the device"). Outside its `prange` loops, numba also turns
    every array expression (np.zeros, a.sum(), a - b) into a parallel region of its own: write those as loops
    or in `jit` helpers (docs/BENCHMARKS.md "segmented k-means, Qwen2.5-7B at 1M, one position array, huge pages")."""
    return numba.njit(nogil=True, cache=True, fastmath=FASTMATH, parallel=True)(fn)


def pjit_ieee(fn):
    """`pjit` without fast-math: each operation rounded as written, so results equal a C reference's bit for bit
    (kernels/pq_codes.py: faiss' codes)."""
    return numba.njit(nogil=True, cache=True, parallel=True)(fn)


prange = numba.prange


_SET = threading.local()  # the count this thread last set through `set_threads` (numba's is per thread too)


def set_threads(n: int) -> None:
    """Run this thread's later `pjit` calls on at most n of numba's threads (a per-thread setting)."""
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    # numba's setter checks its thread pool on every call, once per layer here (docs/BENCHMARKS.md "huge pages over a whole step, a faster top-k, less Python per layer")
    if getattr(_SET, "n", None) != n:
        numba.set_num_threads(n)
        _SET.n = n


@intrinsic
def prefetch(typingctx, addr):
    """Ask for the cache line at byte address `addr` (an integer: `a.ctypes.data` + offset) to be loaded.

    routed's scan reads small clusters scattered over the layout; without a hint each row is a serial
    DRAM miss (docs/BENCHMARKS.md "prefetching, and the heads' work split over the whole team"). A hint costs one instruction and never faults."""
    if not isinstance(addr, numba.types.Integer):
        return None

    def codegen(context, builder, signature, args):
        emit_prefetch(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()))
        return context.get_dummy_value()

    return numba.types.void(addr), codegen


def emit_prefetch(builder, ptr) -> None:
    """IR for a prefetch of the line at `ptr` (an i8*): read, highest temporal locality, data cache."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
    )
    builder.call(fn, [ptr, i32(0), i32(3), i32(1)])


@jit
def prefetch_row(a, row):
    """Request the cache lines of a[row] (a row of a 2-D array, an element of a 1-D one)."""
    base = a.ctypes.data + row * a.strides[0]
    for b in range(0, a.strides[0], 64):
        prefetch(base + b)
    prefetch(base + a.strides[0] - 1)  # a row that straddles one more line


@intrinsic
def stored_float(typingctx, b):
    """The float32 value of a stored key element: a bf16's bits (an unsigned 16-bit integer) or an int8 (a cache
    of `--kv-dtype int8`, its scale folded into the query). Exact, and a plain zero-extend, shift and bitcast
    (bf16) or one signed conversion (int8) that LLVM vectorizes inside a dot-product loop (a widening loop
    through a uint32 buffer did not vectorize)."""
    if not isinstance(b, numba.types.Integer) or (b.bitwidth, b.signed) not in ((16, False), (8, True)):
        return None

    def codegen(context, builder, signature, args):
        if signature.args[0].bitwidth == 8:
            return builder.sitofp(args[0], ir.FloatType())
        i32 = ir.IntType(32)
        return builder.bitcast(builder.shl(builder.zext(args[0], i32), i32(16)), ir.FloatType())

    return numba.types.float32(b), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (x86: rdtsc, constant rate), int64: timestamps inside compiled code."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter"
        )
        return builder.call(fn, [])

    return numba.types.int64(), codegen


@jit
def now() -> int:
    """`cycles` read from Python (a compiled call: the same clock as the stamps taken inside kernels)."""
    return cycles()


@functools.lru_cache(maxsize=1)
def cycles_per_second() -> float:
    """The rate of `cycles`, measured once per process against time.perf_counter over ~20 ms."""
    now()  # compile first
    t0, c0 = time.perf_counter(), now()
    time.sleep(0.02)
    t1, c1 = time.perf_counter(), now()
    return (c1 - c0) / (t1 - t0)
