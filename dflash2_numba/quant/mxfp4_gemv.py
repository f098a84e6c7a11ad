"""MXFP4 GEMV on the bytes as stored (f32 activations): y [M, N] = x [M, K] @ dequant(blocks, scales).T

    gemv_mxfp4(x [M, K] f32, blocks u8 [N, K/32, 16], scales u8 [N, K/32], y [M, N] f32, parallel)

The stored layout is out-major: output row n, block b holds 32 e2m1 codes in 16 bytes (LOW nibble
= element 2j, HIGH = element 2j + 1) and one E8M0 scale 2^(s - 127). Each output is a dot
product along k, computed on those bytes in place (no repacking, no dense copy):

1. x is de-interleaved once per call, per 32-block: xe[m, 32b + j] = x[m, 32b + 2j] and
   xe[m, 32b + 16 + j] = x[m, 32b + 2j + 1], so the low nibbles of a block's 16 bytes pair with
   xe's first 16 values and the high nibbles with the next 16.
2. Per (output n, block b): the 16 bytes are widened to 16 int32 lanes; `and 15` / `shift 4` give
   the 32 codes, which become f32 e2m1 values in registers by a table permute (AVX-512
   `vpermps` zmm over the 16-entry table; AVX2 `vpermps` ymm over the 8 magnitudes + the sign
   bit; the generic path computes the value's bits from the code). Exact.
3. Per row: t = w_lo * xe_lo + w_hi * xe_hi (lanes), then acc = fma(t, 2^(s - 127), acc); after
   the last block the lanes are summed in a fixed tree. Every row's operations are the same
   whatever the row count (a Q-row verify == Q one-row steps bit for bit), threads own whole
   outputs, and the values and their order are the same on every path: the same bits everywhere.
quant/mxfp4.py holds the format's definition (`dequantize_mxfp4`) and the loaded tensors; the
tests hold this kernel to that definition's float64 product (the order differs from transformers'
dense f32 product only by rounding).

Speed: one byte holds two weights; per 32 weights the decode costs a load, a widen, a shift and
two permutes, shared by the rows (the scale 2^(s - 127) is a broadcast load from a 256-entry
table: no shuffle-port work); each row adds three float ops. Weight bytes are prefetched 2 KB
ahead (as the integer kernels, quant/kernels_int8.py). Blocks alternate between two sets of
accumulators (even / odd blocks, added at the end): one FMA chain per output would wait on the
FMA latency every block. `bench/quant_stream.py`, one row, 1 thread, quiet: 10.5 GB/s = 0.63 of
a numpy read at the same time (q4_0 0.83, q8_0 0.91).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kernels import isa
from .kernels_int8 import ir_fn, ir_splat  # the IR helpers the integer kernels share

BLOCK = 32
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # [16] code -> value
VBITS = isa.vector_bits()
V = 16 if VBITS == 512 else 8  # f32 lanes per vector
PREFETCH_BYTES = 2048


# ------------------------------------------------------------------ the per-output tile (LLVM IR)
def _tile(R: int):
    """An intrinsic tile(xe, blocks, scales, pow2, m0, n, y): y[m0 + r, n] for r < R (module
    docstring); pow2 [256] f32 = 2^(s - 127), read per block by a broadcast load."""

    @intrinsic
    def tile(typingctx, xe, blocks, scales, pow2, m0, n, y):
        arrays = (xe, blocks, scales, pow2, y)
        if not all(isinstance(a, types.Array) and a.layout == "C" for a in arrays):
            return None
        if (xe.dtype, blocks.dtype, scales.dtype, pow2.dtype, y.dtype) != (
                types.float32, types.uint8, types.uint8, types.float32, types.float32):
            return None
        sig = types.void(xe, blocks, scales, pow2, types.int64, types.int64, y)

        def codegen(context, builder, signature, args):
            m0, n = args[4], args[5]
            xa, ba, sa, pa, ya = [context.make_array(signature.args[i])(context, builder, args[i])
                                  for i in (0, 1, 2, 3, 6)]
            i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
            vi, vf = ir.VectorType(i32, V), ir.VectorType(f32, V)

            def const(v):
                return ir.Constant(i64, v)

            def ivec(v):
                return ir.Constant(vi, [v] * V)

            def fn(name, ret, argtys):
                return ir_fn(builder, name, ret, argtys)

            def splat(scalar, vty):
                return ir_splat(builder, scalar, vty)

            fma = fn(f"llvm.fma.v{V}f32", vf, [vf, vf, vf])
            prefetch = fn("llvm.prefetch.p0i8", ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
            if VBITS == 512:
                perm = fn("llvm.x86.avx512.permvar.sf.512", vf, [vf, vi])
                table = ir.Constant(vf, [float(v) for v in E2M1])
            elif VBITS == 256:
                perm = fn("llvm.x86.avx2.permps", vf, [vf, vi])
                table = ir.Constant(vf, [float(v) for v in E2M1[:8]])

            def decode(codes):
                """<V x i32> codes 0..15 -> <V x float> e2m1 values (exact)."""
                if VBITS == 512:
                    return builder.call(perm, [table, codes])
                if VBITS == 256:  # 8 magnitudes by permute, then the sign bit
                    mag = builder.call(perm, [table, builder.and_(codes, ivec(7))])
                    sign = builder.shl(builder.and_(codes, ivec(8)), ivec(28))
                    return builder.bitcast(builder.xor(builder.bitcast(mag, vi), sign), vf)
                # generic: the value's f32 bits from the code. m = code & 7 = (e, mantissa bit):
                # m >= 2: 2^(e - 1) * (1 + mb / 2) -> exponent e + 126, top mantissa bit mb;
                # m = 1: 0.5; m = 0: 0; then the sign
                m = builder.and_(codes, ivec(7))
                e = builder.lshr(m, ivec(1))
                normal = builder.or_(builder.shl(builder.add(e, ivec(126)), ivec(23)),
                                     builder.shl(builder.and_(m, ivec(1)), ivec(22)))
                small = builder.select(builder.icmp_unsigned("==", m, ivec(1)), ivec(126 << 23), ivec(0))
                bits = builder.select(builder.icmp_unsigned(">=", m, ivec(2)), normal, small)
                sign = builder.shl(builder.and_(codes, ivec(8)), ivec(28))
                return builder.bitcast(builder.or_(bits, sign), vf)

            K = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            nb = builder.ashr(K, const(5))
            N = cgutils.unpack_tuple(builder, ya.shape, 2)[1]
            b0 = builder.gep(ba.data, [builder.mul(builder.mul(n, nb), const(16))])  # &blocks[n, 0, 0]
            s0 = builder.gep(sa.data, [builder.mul(n, nb)])  # &scales[n, 0]
            x0 = builder.gep(xa.data, [builder.mul(m0, K)])  # &xe[m0, 0]
            zero_f = ir.Constant(vf, [0.0] * V)
            G = 16 // V  # vectors per 16 logical lanes: lane j of the block pairs bytes j (lo, hi)

            def block(b, acc):
                """IR of block b for every row: acc [R][G] -> the accumulators after it."""
                src = builder.gep(b0, [builder.mul(b, const(16))])
                builder.call(prefetch, [builder.gep(src, [const(PREFETCH_BYTES)]), ir.Constant(i32, 0),
                                        ir.Constant(i32, 3), ir.Constant(i32, 1)])
                lo, hi = [], []  # per group g: bytes g*V .. g*V+V-1 widened; their low / high nibbles decoded
                for g in range(G):
                    raw = builder.load(builder.bitcast(builder.gep(src, [const(g * V)]),
                                                       ir.VectorType(i8, V).as_pointer()), align=1)
                    d = builder.zext(raw, vi)
                    # elements 2j: pair with xe[32b + j] (vpermps zmm reads only an index's low 4 bits)
                    lo.append(decode(d if VBITS == 512 else builder.and_(d, ivec(15))))
                    hi.append(decode(builder.lshr(d, ivec(4))))  # elements 2j + 1: with xe[32b + 16 + j]
                s = builder.zext(builder.load(builder.gep(s0, [b])), i64)
                scale = splat(builder.load(builder.gep(pa.data, [s])), vf)  # 2^(s - 127): a broadcast load
                new = []
                for r in range(R):
                    xb = builder.gep(x0, [builder.add(builder.mul(const(r), K), builder.mul(b, const(BLOCK)))])
                    row = []
                    for g in range(G):
                        xl = builder.load(builder.bitcast(builder.gep(xb, [const(g * V)]), vf.as_pointer()), align=4)
                        xh = builder.load(builder.bitcast(builder.gep(xb, [const(16 + g * V)]), vf.as_pointer()),
                                          align=4)
                        t = builder.call(fma, [hi[g], xh, builder.fmul(lo[g], xl)])  # lane j: w_2j x_2j + w_2j+1 x_2j+1
                        row.append(builder.call(fma, [t, scale, acc[r][g]]))
                    new.append(row)
                return new

            def phis(sources):
                """[R][G] phis merging (value set, predecessor block) pairs."""
                out = [[builder.phi(vf) for _ in range(G)] for _ in range(R)]
                for vals, pred in sources:
                    for r in range(R):
                        for g in range(G):
                            out[r][g].add_incoming(vals[r][g], pred)
                return out

            # blocks in pairs: even blocks into accumulator set A, odd ones into B (two independent
            # FMA chains: one chain per output would wait on the FMA latency every block); an odd
            # last block goes into A; then A + B. The same order for every row count and path.
            zeros = [[zero_f] * G for _ in range(R)]
            npairs = builder.ashr(nb, const(1))
            entry = builder.block
            loop = builder.append_basic_block("mx.pairs")
            after = builder.append_basic_block("mx.after")
            tail = builder.append_basic_block("mx.tail")
            done = builder.append_basic_block("mx.done")
            builder.cbranch(builder.icmp_signed("<=", npairs, const(0)), after, loop)
            builder.position_at_end(loop)
            i = builder.phi(i64)
            accA = [[builder.phi(vf) for _ in range(G)] for _ in range(R)]
            accB = [[builder.phi(vf) for _ in range(G)] for _ in range(R)]
            newA = block(builder.mul(i, const(2)), accA)
            newB = block(builder.add(builder.mul(i, const(2)), const(1)), accB)
            i_next = builder.add(i, const(1))
            loop_end = builder.block
            i.add_incoming(const(0), entry)
            i.add_incoming(i_next, loop_end)
            for r in range(R):
                for g in range(G):
                    accA[r][g].add_incoming(zero_f, entry)
                    accA[r][g].add_incoming(newA[r][g], loop_end)
                    accB[r][g].add_incoming(zero_f, entry)
                    accB[r][g].add_incoming(newB[r][g], loop_end)
            builder.cbranch(builder.icmp_signed("<", i_next, npairs), loop, after)

            builder.position_at_end(after)
            A = phis([(zeros, entry), (newA, loop_end)])
            B = phis([(zeros, entry), (newB, loop_end)])
            odd = builder.icmp_signed("!=", builder.and_(nb, const(1)), const(0))
            builder.cbranch(odd, tail, done)
            builder.position_at_end(tail)
            A_tail = block(builder.sub(nb, const(1)), A)
            tail_end = builder.block
            builder.branch(done)

            builder.position_at_end(done)
            A_done = phis([(A, after), (A_tail, tail_end)])
            for r in range(R):
                outs = [builder.fadd(A_done[r][g], B[r][g]) for g in range(G)]
                # the 16 logical lanes summed in a fixed tree, [0, w/2) + [w/2, w), on every path
                out, width = (outs[0], 16) if G == 1 else (builder.fadd(outs[0], outs[1]), 8)
                while width > 1:
                    width //= 2
                    undef = ir.Constant(ir.VectorType(f32, width * 2), ir.Undefined)
                    a = builder.shuffle_vector(out, undef, ir.Constant(ir.VectorType(i32, width), list(range(width))))
                    c = builder.shuffle_vector(out, undef, ir.Constant(ir.VectorType(i32, width),
                                                                        list(range(width, 2 * width))))
                    out = builder.fadd(a, c)
                total = builder.extract_element(out, ir.Constant(i32, 0))
                at = builder.add(builder.mul(builder.add(m0, const(r)), N), n)
                builder.store(total, builder.gep(ya.data, [at]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


_t4, _t2, _t1 = _tile(4), _tile(2), _tile(1)
COLS = 16  # outputs per parallel work item
# 2^(s - 127) for every E8M0 byte s (s = 0: 2^-127, a subnormal; 255, NaN in the MX spec: inf)
with np.errstate(over="ignore"):
    POW2 = np.ldexp(np.float64(1.0), np.arange(256) - 127).astype(np.float32)  # [256]


@njit(inline="always")
def _deinterleave(x):
    """x [M, K] -> xe [M, K]: per 32-block the even elements, then the odd ones."""
    M, K = x.shape
    xe = np.empty((M, K), np.float32)
    for m in range(M):
        for b in range(0, K, BLOCK):
            for j in range(16):
                xe[m, b + j] = x[m, b + 2 * j]
                xe[m, b + 16 + j] = x[m, b + 2 * j + 1]
    return xe


@njit(inline="always")
def _outputs(xe, blocks, scales, pow2, y, n0, n1):
    M = xe.shape[0]
    for n in range(n0, n1):
        m0 = 0
        while M - m0 >= 4:
            _t4(xe, blocks, scales, pow2, m0, n, y)
            m0 += 4
        if M - m0 >= 2:
            _t2(xe, blocks, scales, pow2, m0, n, y)
            m0 += 2
        if M - m0 == 1:
            _t1(xe, blocks, scales, pow2, m0, n, y)


@njit(cache=True, nogil=True)
def _gemv_ser(x, blocks, scales, pow2, y):
    xe = _deinterleave(x)
    _outputs(xe, blocks, scales, pow2, y, 0, blocks.shape[0])


@njit(parallel=True, cache=True, nogil=True)
def _gemv_par(x, blocks, scales, pow2, y):
    xe = _deinterleave(x)
    N = blocks.shape[0]
    for c in prange((N + COLS - 1) // COLS):
        _outputs(xe, blocks, scales, pow2, y, c * COLS, min(N, (c + 1) * COLS))


def gemv_mxfp4(x: np.ndarray, blocks: np.ndarray, scales: np.ndarray, y: np.ndarray, parallel: bool) -> np.ndarray:
    """y [M, N] = x [M, K] @ W.T, W the MXFP4 (blocks, scales) of the module docstring."""
    x = np.ascontiguousarray(x, np.float32)
    blocks, scales = np.ascontiguousarray(blocks), np.ascontiguousarray(scales)
    (_gemv_par if parallel else _gemv_ser)(x, blocks, scales, POW2, y)
    return y
