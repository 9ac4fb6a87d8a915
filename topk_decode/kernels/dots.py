"""The dot products of the compiled scans (flat_scan.py, routed's split scan): one bf16 key row against
four queries, `dot4`, in one of two ways chosen by the queries' dtype.

- float32 queries: the key row widened exactly to fp32 inside the loop, one FMA per element and query.
- uint16 queries (bf16 bits): AVX512-BF16's `vdpbf16ps`, which multiplies 32 bf16 pairs and adds them
  into 16 fp32 lanes in one instruction, with no widening. On the 16-core GPU host the fp32 arithmetic,
  not DRAM, bounds flat's scan (docs/BENCHMARKS.md "flat's numba scan against the DRAM floor"); this removes most of it ("flat's numba scan with bf16 dot products").

Same scores as the fp32 path where the query is bf16-exact (the decoder's queries are: the model computes
them in bf16): a product of two bf16 values is exact in fp32, and the sums are fp32 additions, as there;
only their order differs (~1e-6 relative), as between any two fp32 kernels. One difference: the
instruction treats bf16 denormals (|x| < 1.2e-38) as zero, which moves a score by less than D · 2^-126.

Usable only where numba compiles for a CPU that has the instruction: `bf16_available`, after the choice
kernels/jit.py's `instruction_set` makes once per process.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from topk_decode.kernels import jit

_LANES = 32  # bf16 elements per 512-bit register: D must be a multiple
GROUP = 4  # queries per `dot4` call: each key element is loaded once for four products


def bf16_available(head_dim: int) -> bool:
    """Whether `dot4` can take bf16 queries here, for rows of `head_dim` elements (`jit.instruction_set`)."""
    return head_dim % _LANES == 0 and jit.instruction_set() == jit.BF16_DOT


llvm.initialize_native_asmparser()  # numba's JIT needs it to assemble inline asm
_V16F = ir.VectorType(ir.FloatType(), 16)
_V32H = ir.VectorType(ir.IntType(16), _LANES)
_I64 = ir.IntType(64)


def _vdpbf16ps():
    """acc += pairs of a·b, as a callable (a, b, acc) -> acc: AT&T operand order (src2, src1, dst), dst
    tied to the accumulator input."""
    return ir.InlineAsm(ir.FunctionType(_V16F, [_V32H, _V32H, _V16F]), "vdpbf16ps $2, $1, $0", "=v,v,v,0")


def _load_v32h(builder, base, off):
    """The 32 bf16 elements at byte offset `off` (an i64) of `base` (an i8*)."""
    return builder.load(builder.bitcast(builder.gep(base, [off]), _V32H.as_pointer()), align=2)


def _shuffle(builder, a, b, lanes):
    """The lanes of a (0-15) and b (16-31) picked by `lanes`."""
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes))


def _sum_lanes4(builder, a):
    """The lane sums of four <16 x float>s, reduced together: each step adds the halves of two vectors
    packed into one, so the four sums take 6 shuffles, 2 in-lane swaps and 5 adds instead of four
    separate halving trees (28 instructions per key, as much as the dot products themselves)."""
    lo, hi = list(range(8)), list(range(8, 16))
    # (a0 | a1) halves: lanes 0-7 partial sums of a0, 8-15 of a1; likewise a2, a3
    b01 = builder.fadd(
        _shuffle(builder, a[0], a[1], lo + [16 + x for x in lo]),
        _shuffle(builder, a[0], a[1], hi + [16 + x for x in hi]),
    )
    b23 = builder.fadd(
        _shuffle(builder, a[2], a[3], lo + [16 + x for x in lo]),
        _shuffle(builder, a[2], a[3], hi + [16 + x for x in hi]),
    )
    # lanes 4j..4j+3: four partial sums of a_j
    q0 = [0, 1, 2, 3, 8, 9, 10, 11]
    q1 = [4, 5, 6, 7, 12, 13, 14, 15]
    c = builder.fadd(
        _shuffle(builder, b01, b23, q0 + [16 + x for x in q0]), _shuffle(builder, b01, b23, q1 + [16 + x for x in q1])
    )
    c = builder.fadd(c, _shuffle(builder, c, c, [x ^ 2 for x in range(16)]))  # within each group of 4
    c = builder.fadd(c, _shuffle(builder, c, c, [x ^ 1 for x in range(16)]))
    return [builder.extract_element(c, ir.Constant(ir.IntType(32), 4 * j)) for j in range(4)]


@intrinsic
def _dot4_bf16(typingctx, keys, t, q, i):
    """(row t of keys) · (rows i .. i+3 of q), four float32: keys (N, D) and q (Qp, D) bf16 bits (uint16,
    rows contiguous), D a multiple of 32. Only where `bf16_available(D)`."""
    if not (
        isinstance(keys, types.Array)
        and isinstance(q, types.Array)
        and keys.dtype == types.uint16
        and q.dtype == types.uint16
    ):
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
        # two accumulators per query, for even and odd chunks: one chain per query would wait on the
        # instruction's latency (~5 cycles) at every chunk, two keep the unit busy
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in range(4)] for _ in range(2)]
        dp = _vdpbf16ps()

        def chunk(c, acc):  # chunk c (32 elements) of the row into acc[0..3]
            off = builder.mul(c, ir.Constant(_I64, 2 * _LANES))  # bytes
            kv = _load_v32h(builder, kbase, off)
            for g in range(4):
                qv = _load_v32h(builder, qbase, builder.add(off, builder.mul(ir.Constant(_I64, g), qstride)))
                builder.store(builder.call(dp, [kv, qv, builder.load(acc[g])]), acc[g])

        chunks = builder.udiv(builder.extract_value(ka.shape, 1), ir.Constant(_I64, _LANES))
        one = ir.Constant(_I64, 1)
        with cgutils.for_range(builder, builder.lshr(chunks, one)) as loop:
            c = builder.shl(loop.index, one)
            chunk(c, accs[0])
            chunk(builder.add(c, one), accs[1])
        with builder.if_then(builder.trunc(chunks, ir.IntType(1))):  # an odd last chunk (D = 96)
            chunk(builder.sub(chunks, one), accs[0])
        sums = _sum_lanes4(builder, [builder.fadd(builder.load(e), builder.load(o)) for e, o in zip(*accs)])
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


def _rows4_codegen(context, builder, signature, args):
    """`score_rows4` for bf16 queries: the loop over rows in IR, so that the four queries' vectors are
    loaded once for all rows (D = 64 or 128: 8 or 16 registers) rather than once per row."""
    ka, qa, cuta, sca, rowsa = (
        context.make_array(signature.args[j])(context, builder, args[j]) for j in (0, 1, 6, 7, 8)
    )
    t0, t1, ahead, e = (context.cast(builder, args[j], signature.args[j], types.int64) for j in (2, 3, 4, 5))
    i8p, f32 = ir.IntType(8).as_pointer(), ir.FloatType()
    kdata = builder.bitcast(ka.data, i8p)
    kstride = builder.extract_value(ka.strides, 0)
    qdata = builder.bitcast(qa.data, i8p)
    qstride = builder.extract_value(qa.strides, 0)
    cdata = builder.bitcast(cuta.data, f32.as_pointer())
    cuts = [builder.load(builder.gep(cdata, [ir.Constant(_I64, g)])) for g in range(GROUP)]
    scd = builder.bitcast(sca.data, f32.as_pointer())
    rowd = builder.bitcast(rowsa.data, _I64.as_pointer())
    chunks = builder.udiv(builder.extract_value(ka.shape, 1), ir.Constant(_I64, _LANES))
    nh = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))
    dp = _vdpbf16ps()
    zero = ir.Constant(_V16F, None)

    def emit(nchunks):  # the row loop for rows of nchunks × 32 elements
        qv = [
            [
                _load_v32h(
                    builder, qdata, builder.add(builder.mul(ir.Constant(_I64, g), qstride), ir.Constant(_I64, 64 * c))
                )
                for c in range(nchunks)
            ]
            for g in range(GROUP)
        ]
        with cgutils.for_range_slice(builder, t0, t1, ir.Constant(_I64, 1), inc=True) as (t, _):
            ahead_row = builder.add(t, ahead)
            with builder.if_then(builder.icmp_signed("<", ahead_row, e)):
                base = builder.gep(kdata, [builder.mul(ahead_row, kstride)])
                for c in range(nchunks):  # a chunk is one 64-byte line
                    jit.emit_prefetch(builder, builder.gep(base, [ir.Constant(_I64, 64 * c)]))
            row = builder.gep(kdata, [builder.mul(t, kstride)])
            acc = [[zero] * GROUP, [zero] * GROUP]  # even and odd chunks: two chains per query
            for c in range(nchunks):
                kv = _load_v32h(builder, row, ir.Constant(_I64, 64 * c))
                for g in range(GROUP):
                    acc[c % 2][g] = builder.call(dp, [kv, qv[g][c], acc[c % 2][g]])
            sums = _sum_lanes4(builder, [builder.fadd(a, b) for a, b in zip(*acc)])
            n = builder.load(nh)
            o = builder.mul(n, ir.Constant(_I64, GROUP))
            hit = None
            for g in range(GROUP):
                builder.store(sums[g], builder.gep(scd, [builder.add(o, ir.Constant(_I64, g))]))
                h = builder.fcmp_ordered(">=", sums[g], cuts[g])
                hit = h if hit is None else builder.or_(hit, h)
            with builder.if_then(hit, likely=False):
                builder.store(t, builder.gep(rowd, [n]))
                builder.store(builder.add(n, ir.Constant(_I64, 1)), nh)

    with builder.if_else(builder.icmp_unsigned("==", chunks, ir.Constant(_I64, 4))) as (d128, d64):
        with d128:
            emit(4)
        with d64:
            emit(2)
    return builder.load(nh)


@intrinsic
def _score_rows4_bf16(typingctx, keys, q, t0, t1, ahead, e, cut, sc, rows):
    """`score_rows4` with bf16 queries (uint16 bits), D = 64 or 128 only."""
    if not (isinstance(q, types.Array) and q.dtype == types.uint16 and keys.dtype == types.uint16):
        return None
    return types.int64(keys, q, t0, t1, ahead, e, cut, sc, rows), _rows4_codegen


@jit.jit
def score_rows4_f32(keys, q, t0, t1, ahead, e, cut, sc, rows):
    """`score_rows4` with float32 queries (or bf16 ones of another D): `dot4` row by row."""
    c0, c1, c2, c3 = cut[0], cut[1], cut[2], cut[3]
    nh = 0
    for t in range(t0, t1):
        if t + ahead < e:
            jit.prefetch_row(keys, t + ahead)
        a0, a1, a2, a3 = dot4(keys, t, q, 0)
        o = nh * GROUP
        sc[o] = a0
        sc[o + 1] = a1
        sc[o + 2] = a2
        sc[o + 3] = a3
        if (a0 >= c0) | (a1 >= c1) | (a2 >= c2) | (a3 >= c3):
            rows[nh] = t
            nh += 1
    return nh


def score_rows4(keys, q, t0, t1, ahead, e, cut, sc, rows):
    """The rows t of [t0, t1) whose score reaches some query's cut against q's four queries (Qp = 4): their
    positions into rows[:nh] and the four scores of the j-th into sc[4j : 4j + 4]; returns nh. Row t + ahead
    (if below e) is prefetched while row t is scored. Scores are written to the next free slot whether or
    not the row is kept (cheaper than a branch around the stores).

    Args:
        keys: (N, D) uint16 bf16 bits; q: (4, D) float32 queries or uint16 bf16 bits (`dot4`);
        cut: (4,) float32; sc: (≥ 4·(t1 − t0),) float32 out; rows: (≥ t1 − t0,) int64 out.
    """
    raise TypeError("score_rows4 runs inside compiled kernels only")


@jit.jit
def dot4_f32(keys, t, q, i):
    """Row t of keys (uint16 bf16 bits, or int8) · float32 queries i .. i+3 of q (Qp, D), the row widened exactly.

    Indexes the 2-D arrays directly: a row view (keys[t]) would touch the array's shared reference count on
    every call, an atomic that all the threads of a scan contend for."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for j in range(keys.shape[1]):
        x = jit.stored_float(keys[t, j])  # bf16 or int8 → fp32 is exact; vectorizes with the FMAs
        a0 += q[i, j] * x
        a1 += q[i + 1, j] * x
        a2 += q[i + 2, j] * x
        a3 += q[i + 3, j] * x
    return a0, a1, a2, a3


def dot4(keys, t, q, i):
    """Row t of keys (N, D) uint16 bf16 bits · queries i .. i+3 of q (Qp, D): four float32 scores.

    q float32: `dot4_f32`. q uint16 (the bf16 bits of bf16-exact queries, only where `bf16_available`):
    `vdpbf16ps`, the same scores up to the order of the fp32 sums."""
    raise TypeError("dot4 runs inside compiled kernels only")


@jit.jit
def pad_queries(q, qf, qb):
    """qf (Qp, D) float32 = q (Q, D) float32 padded with zero rows to whole groups of GROUP; qb (Qp, D) the
    same as bf16 bits where qb is uint16 (a float32 qb, which may be qf itself, is not written). Returns
    whether qb holds them exactly (qb uint16 and every query bf16-exact): then `dot4` over qb gives qf's
    scores up to summation order."""
    for i in range(qf.shape[0]):
        for j in range(qf.shape[1]):
            qf[i, j] = q[i, j] if i < q.shape[0] else np.float32(0.0)
    if qb.itemsize != 2:  # float32 qb (no bf16 path here, or qb is qf itself): left as it is
        return False
    exact = True
    bits = qf.view(np.uint32)
    for i in range(qf.shape[0]):
        for j in range(qf.shape[1]):
            b = bits[i, j]
            if b & np.uint32(0xFFFF):
                exact = False
            qb[i, j] = b >> np.uint32(16)
    return exact


@overload(dot4, jit_options={"nogil": True, "fastmath": jit.FASTMATH})
def _dot4_typed(keys, t, q, i):
    if q.dtype == types.uint16:
        return lambda keys, t, q, i: _dot4_bf16(keys, t, q, i)
    return lambda keys, t, q, i: dot4_f32(keys, t, q, i)


@overload(score_rows4, jit_options={"nogil": True, "fastmath": jit.FASTMATH})
def _score_rows4_typed(keys, q, t0, t1, ahead, e, cut, sc, rows):
    if q.dtype == types.uint16:

        def bf16_rows(keys, q, t0, t1, ahead, e, cut, sc, rows):
            if keys.shape[1] == 128 or keys.shape[1] == 64:
                return _score_rows4_bf16(keys, q, t0, t1, ahead, e, cut, sc, rows)
            return score_rows4_f32(keys, q, t0, t1, ahead, e, cut, sc, rows)

        return bf16_rows
    return lambda keys, q, t0, t1, ahead, e, cut, sc, rows: score_rows4_f32(keys, q, t0, t1, ahead, e, cut, sc, rows)
