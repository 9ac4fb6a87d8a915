"""bf16 dot products in hardware (AVX512-BF16 `vdpbf16ps`) for flat's numba scan (flat_kernel.py).

The fp32 path widens every bf16 key element to fp32 and runs one FMA per element and query: on the
16-core GPU host that arithmetic, not DRAM, bounds the scan (docs/BENCHMARKS.md run 18). `vdpbf16ps`
multiplies 32 bf16 pairs and adds them into 16 fp32 lanes in one instruction, with no widening.

Same scores as the fp32 path where the query is bf16-exact (the decoder's queries are: the model computes
them in bf16): a product of two bf16 values is exact in fp32, and the sums are fp32 additions, as there;
only their order differs (~1e-6 relative), as between any two fp32 kernels. One difference: the
instruction treats bf16 denormals (|x| < 1.2e-38) as zero, which moves a score by less than D · 2^-126.

Usable only where numba compiles for a CPU that has the instruction: `available()` checks the host's
features and that numba's target is the host itself (a `NUMBA_CPU_NAME` of another CPU could lack it, and
LLVM would abort the process on an instruction its target lacks, not raise).
"""

from __future__ import annotations

import os

from topk_decode.index import compiled

_LANES = 32   # bf16 elements per 512-bit register: D must be a multiple


def available(head_dim: int) -> bool:
    """Whether `dot4_bf16` can run here for rows of `head_dim` elements."""
    if compiled.numba is None or head_dim % _LANES or os.environ.get("TOPK_NO_BF16_DOT"):
        return False
    import numba
    import llvmlite.binding as llvm

    if numba.config.CPU_NAME not in (None, "host") or numba.config.CPU_FEATURES:
        return False
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx512bf16") and features.get("avx512f"))


if compiled.numba is not None:
    import llvmlite.binding as _llvm
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    _llvm.initialize_native_asmparser()   # numba's JIT needs it to assemble inline asm
    _V16F = ir.VectorType(ir.FloatType(), 16)
    _V32H = ir.VectorType(ir.IntType(16), _LANES)
    _I64 = ir.IntType(64)

    def _sum_lanes(builder, v):
        """The sum of a <16 x float>'s lanes (halving tree)."""
        n = 16
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(n))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(n, 2 * n))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))

    @intrinsic
    def dot4_bf16(typingctx, keys, t, q, i):
        """(row t of keys) · (rows i .. i+3 of q), four float32: keys (N, D) and q (Qp, D) bf16 bits (uint16,
        rows contiguous), D a multiple of 32. Only where `available(D)`."""
        if not (isinstance(keys, types.Array) and isinstance(q, types.Array)
                and keys.dtype == types.uint16 and q.dtype == types.uint16):
            return None
        sig = types.UniTuple(types.float32, 4)(keys, t, q, i)

        def codegen(context, builder, signature, args):
            ka = context.make_array(signature.args[0])(context, builder, args[0])
            qa = context.make_array(signature.args[2])(context, builder, args[2])
            i8p = ir.IntType(8).as_pointer()
            row = context.cast(builder, args[1], signature.args[1], types.int64)
            first = context.cast(builder, args[3], signature.args[3], types.int64)
            kbase = builder.gep(builder.bitcast(ka.data, i8p), [builder.mul(row, builder.extract_value(ka.strides, 0))])
            qstride = builder.extract_value(qa.strides, 0)
            qbase = builder.gep(builder.bitcast(qa.data, i8p), [builder.mul(first, qstride)])
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in range(4)]
            # acc += pairs of a·b: AT&T operand order (src2, src1, dst), dst tied to the accumulator input
            dp = ir.InlineAsm(ir.FunctionType(_V16F, [_V32H, _V32H, _V16F]), "vdpbf16ps $2, $1, $0", "=v,v,v,0")
            chunks = builder.udiv(builder.extract_value(ka.shape, 1), ir.Constant(_I64, _LANES))
            with cgutils.for_range(builder, chunks) as loop:
                off = builder.mul(loop.index, ir.Constant(_I64, 2 * _LANES))        # bytes
                kv = builder.load(builder.bitcast(builder.gep(kbase, [off]), _V32H.as_pointer()), align=2)
                for g in range(4):
                    qp = builder.gep(qbase, [builder.add(off, builder.mul(ir.Constant(_I64, g), qstride))])
                    qv = builder.load(builder.bitcast(qp, _V32H.as_pointer()), align=2)
                    builder.store(builder.call(dp, [kv, qv, builder.load(accs[g])]), accs[g])
            sums = [_sum_lanes(builder, builder.load(a)) for a in accs]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen
