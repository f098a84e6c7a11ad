"""Integer GEMV on Q4_K panels (quant/q4_k.py) with q8_K activations, one micro-kernel per
instruction set (the paths of kernels_int8.py).

    kernels_int8.gemv_quant(x [M, K] f32, (qw, meta), y [M, N] f32, parallel)   # y = x @ dequant(w).T

1. Activations: llama.cpp's q8_K, per row and 256-block, by ONE function (`quantize_rows_k`,
   every row count and path): quantize_row_q8_K_ref, m = the signed element of largest
   magnitude (the first), iscale = -127 / m, q = min(127, nearest_int(iscale * x)), d = 1 / iscale
   (f32), plus the sum of q per 32 (llama.cpp's bsums, per 16, added in pairs).
2. Per (row r, column c, super-block b), exact int32 (no saturation on any path):
       isum = sum_j sc_j * dot_j,   dot_j = sum over sub-block j of q4 * q8   (|isum| < 2^25)
       msum = sum_j m_j * bsum_j                                              (|msum| < 2^21)
   dot_j: avx512_vnni / avx_vnni: vpdpbusd with the nibbles (0..15) as its unsigned operand and
   the activation's 4 bytes broadcast as the signed one (no correction term); avx2: vpmaddubsw
   (pair sums <= 2 * 15 * 127) then vpmaddwd by ones; generic: plain vector IR.
3. ONE float epilogue for every path, per super-block in order from acc = 0:
       acc += (d * xd) * float(isum) - (dmin * xd) * float(msum)
   (d, dmin the block's fp16 scales widened exactly; each operation one f32 rounding, no fma),
   so y is bit for bit the same for every instruction set, row count, tile and thread count,
   and a numpy reference reproduces it exactly (gemv_q4k_reference).

Tiles: 4 / 2 / 1 rows against one vector of columns (16 on AVX-512, 8 on the 256-bit and generic
paths): per row a dot, isum and msum accumulator and the float accumulator.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .formats import PANEL_COLS
from .ir_helpers import ir_column_sums, ir_fn, ir_half_to_float, ir_splat
from .kernels_int8 import MODE, VNNI, V, _make_item
from .q4_k import META_BYTES, QK_K, SUB, nearest_int, unpack_blocks

GROUP_COLS = V  # columns per tile


# ------------------------------------------------------------------ activations (q8_K)
@njit(inline="always")
def quantize_rows_k(x, Kp):
    """x [M, K] f32 (K == Kp, a multiple of 256) -> (xq [M, Kp] int8, xd [M, Kp/256] f32,
    xb [M, Kp/32] int32): quantize_row_q8_K_ref per row, xb the sums of q per 32."""
    M = x.shape[0]
    nsb = Kp // QK_K
    xq = np.zeros((M, Kp), np.int8)
    xd = np.zeros((M, nsb), np.float32)
    xb = np.zeros((M, Kp // SUB), np.int32)
    for r in range(M):
        for b in range(nsb):
            k0 = b * QK_K
            amax, mx = np.float32(0.0), np.float32(0.0)
            for k in range(k0, k0 + QK_K):
                ax = abs(x[r, k])
                if ax > amax:
                    amax, mx = ax, x[r, k]
            if amax == np.float32(0.0):
                continue  # d = 0, q = 0
            iscale = np.float32(-127.0) / mx
            for j in range(QK_K // SUB):
                total = 0
                for k in range(k0 + SUB * j, k0 + SUB * (j + 1)):
                    q = min(127, nearest_int(iscale * x[r, k]))
                    xq[r, k] = q
                    total += q
                xb[r, b * (QK_K // SUB) + j] = total
            xd[r, b] = np.float32(1.0) / iscale
    return xq, xd, xb


@njit(cache=True, nogil=True)
def quantize_rows_k_entry(x, Kp):
    """quantize_rows_k callable from Python."""
    return quantize_rows_k(x, Kp)


# ------------------------------------------------------------------ micro-kernel (LLVM IR)
def _tile(R: int):
    """An intrinsic tile(xq, xd, xb, m0, qw, meta, p, col0, y, ycol): rows m0..m0+R-1, columns
    col0 .. col0 + V - 1 of panel p -> y[m0 + r, ycol + col0 + j] (the epilogue of the module
    docstring). xq [M, Kp] int8, xd [M, nsb] f32, xb [M, Kp/32] int32, qw [NP, Kp/2, 32] uint8,
    meta [NP, nsb, 640] uint8, y f32, all C."""

    @intrinsic
    def tile(typingctx, xq, xd, xb, m0, qw, meta, p, col0, y, ycol):
        arrays = (xq, xd, xb, qw, meta, y)
        if not all(isinstance(a, types.Array) and a.layout == "C" for a in arrays):
            return None
        if (xq.dtype, xd.dtype, xb.dtype, qw.dtype, meta.dtype, y.dtype) != (
                types.int8, types.float32, types.int32, types.uint8, types.uint8, types.float32):
            return None
        sig = types.void(xq, xd, xb, types.int64, qw, meta, types.int64, types.int64, y, types.int64)

        def codegen(context, builder, signature, args):
            m0, p, col0, ycol = args[3], args[6], args[7], args[9]
            xa, xda, xba, qa, ma, ya = [context.make_array(signature.args[i])(context, builder, args[i])
                                        for i in (0, 1, 2, 4, 5, 8)]
            i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
            vb, vi, vf = ir.VectorType(i8, 4 * V), ir.VectorType(i32, V), ir.VectorType(f32, V)
            vc8, vs16 = ir.VectorType(i8, V), ir.VectorType(i16, V)

            def const(v):
                return ir.Constant(i64, v)

            def load(ptr, vty, offset, align=1):
                return builder.load(builder.bitcast(builder.gep(ptr, [offset]), vty.as_pointer()), align=align)

            Kp = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            nsb = builder.ashr(Kp, const(8))
            nb32 = builder.ashr(Kp, const(5))
            ldy = cgutils.unpack_tuple(builder, ya.shape, 2)[1]
            bytes_ = i8.as_pointer()
            w0 = builder.gep(builder.bitcast(qa.data, bytes_),  # qw[p, 0, col0]: a panel is Kp * 16 bytes
                             [builder.add(builder.mul(p, builder.mul(Kp, const(PANEL_COLS // 2))),
                                          builder.mul(col0, const(4)))])
            meta0 = builder.gep(builder.bitcast(ma.data, bytes_), [builder.mul(builder.mul(p, nsb), const(META_BYTES))])
            x0 = builder.gep(xa.data, [builder.mul(m0, Kp)])  # &xq[m0, 0]
            xd0 = builder.gep(xda.data, [builder.mul(m0, nsb)])
            xb0 = builder.gep(xba.data, [builder.mul(m0, nb32)])
            y0 = builder.gep(ya.data, [builder.add(builder.mul(m0, ldy), builder.add(ycol, col0))])
            zero_i, zero_f = ir.Constant(vi, [0] * V), ir.Constant(vf, [0.0] * V)
            mask, four = ir.Constant(vb, [15] * 4 * V), ir.Constant(vb, [4] * 4 * V)

            if VNNI:
                dp = ir_fn(builder, "llvm.x86.avx512.vpdpbusd.512" if MODE == "vnni512" else
                           "llvm.x86.avx512.vpdpbusd.256", vi, [vi, vb, vb])
            elif MODE == "avx2":
                vh = ir.VectorType(i16, 2 * V)
                maddubs = ir_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", vh, [vb, vb])
                maddwd = ir_fn(builder, "llvm.x86.avx2.pmadd.wd", vi, [vh, vh])
                ones16 = ir.Constant(vh, [1] * (2 * V))
            else:
                vw = ir.VectorType(i32, 4 * V)

            def dot(acc, xword, w):
                """acc += per column the 4 products of nibbles w (u8 0..15) and xword's 4 bytes (s8)."""
                xv = builder.bitcast(ir_splat(builder, xword, vi), vb)
                if VNNI:
                    return builder.call(dp, [acc, w, xv])
                if MODE == "avx2":
                    return builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [w, xv]), ones16]))
                prod = builder.mul(builder.zext(w, vw), builder.sext(xv, vw))  # [4V] int32
                return builder.add(acc, ir_column_sums(builder, prod, V))

            entry = builder.block
            loop = builder.append_basic_block("q4k.b")
            done = builder.append_basic_block("q4k.done")
            builder.cbranch(builder.icmp_signed("<=", nsb, const(0)), done, loop)

            builder.position_at_end(loop)  # one super-block: int32 sums, then the float epilogue
            b = builder.phi(i64)
            facc = [builder.phi(vf) for _ in range(R)]
            wsb = builder.gep(w0, [builder.mul(b, const(QK_K // 2 * PANEL_COLS))])
            msb = builder.gep(meta0, [builder.mul(b, const(META_BYTES))])
            xsb = builder.mul(b, const(QK_K))
            chains = max(1, 8 // R)  # independent partial dots per row (exact: integer addition)
            isum, msum = [zero_i] * R, [zero_i] * R
            for j in range(QK_K // SUB):
                part = [[zero_i] * chains for _ in range(R)]
                for step in range(4):  # a load holds k-quads `step` (low nibbles) and `step + 4` (high)
                    w = load(wsb, vb, const((4 * j + step) * PANEL_COLS * 4))
                    for kq, wv in ((step, builder.and_(w, mask)), (step + 4, builder.lshr(w, four))):
                        for r in range(R):
                            at = builder.add(builder.add(builder.mul(const(r), Kp), xsb), const(SUB * j + 4 * kq))
                            xword = load(x0, i32, at)
                            part[r][kq % chains] = dot(part[r][kq % chains], xword, wv)
                sc = builder.zext(load(msb, vc8, builder.add(col0, const(j * PANEL_COLS))), vi)
                mn = builder.zext(load(msb, vc8, builder.add(col0, const((8 + j) * PANEL_COLS))), vi)
                for r in range(R):
                    d = part[r][0]
                    for other in part[r][1:]:
                        d = builder.add(d, other)
                    isum[r] = builder.add(isum[r], builder.mul(d, sc))
                    at = builder.add(builder.add(builder.mul(const(r), nb32), builder.mul(b, const(8))), const(j))
                    bs = builder.load(builder.gep(xb0, [at]))
                    msum[r] = builder.add(msum[r], builder.mul(mn, ir_splat(builder, bs, vi)))
            col2 = builder.mul(col0, const(2))
            dv = ir_half_to_float(builder, load(msb, vs16, builder.add(col2, const(16 * PANEL_COLS)), 2), vi, vf)
            mv = ir_half_to_float(builder, load(msb, vs16, builder.add(col2, const(18 * PANEL_COLS)), 2), vi, vf)
            new = []
            for r in range(R):
                xdv = ir_splat(builder, builder.load(builder.gep(xd0, [builder.add(builder.mul(const(r), nsb), b)])), vf)
                a = builder.fmul(builder.fmul(dv, xdv), builder.sitofp(isum[r], vf))
                c = builder.fmul(builder.fmul(mv, xdv), builder.sitofp(msum[r], vf))
                new.append(builder.fadd(facc[r], builder.fsub(a, c)))
            b_next = builder.add(b, const(1))
            b.add_incoming(const(0), entry)
            b.add_incoming(b_next, loop)
            for r in range(R):
                facc[r].add_incoming(zero_f, entry)
                facc[r].add_incoming(new[r], loop)
            builder.cbranch(builder.icmp_signed("<", b_next, nsb), loop, done)

            builder.position_at_end(done)
            outs = [builder.phi(vf) for _ in range(R)]
            for r in range(R):
                outs[r].add_incoming(zero_f, entry)
                outs[r].add_incoming(new[r], loop)
                ptr = builder.gep(y0, [builder.mul(const(r), ldy)])
                builder.store(outs[r], builder.bitcast(ptr, vf.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


# the work-item driver; kernels_int8's drivers (_gemv_quant_par / _ser, gemv_quant) pick it for
# Q4_K panels (uint8 metadata), and its quantize_activations picks quantize_rows_k
item_q4k = _make_item(_tile(4), _tile(2), _tile(1), GROUP_COLS)


# ------------------------------------------------------------------ numpy references
def quantize_rows_k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy q8_K (independent code: argmax for the first largest magnitude, np.rint for ties to even)."""
    M, K = x.shape
    blocks = np.asarray(x, np.float32).reshape(M, K // QK_K, QK_K)
    at = np.abs(blocks).argmax(axis=2)
    mx = np.take_along_axis(blocks, at[:, :, None], axis=2)[:, :, 0]  # [M, nsb] signed
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        xd = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    xq = np.minimum(127, np.rint(blocks * iscale[:, :, None])).astype(np.int8).reshape(M, K)
    xb = xq.reshape(M, -1, SUB).astype(np.int32).sum(axis=2, dtype=np.int32)
    return xq, xd, xb


def gemv_q4k_reference(x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """The kernels' result from llama.cpp's block bytes [N, nsb, 144] by numpy: int64 sub-block
    dots, isum / msum per super-block, then the f32 epilogue in the same operation order."""
    q, sc, m, d, dmin = unpack_blocks(blocks)
    N, K = q.shape
    nsb = K // QK_K
    xq, xd, xb = quantize_rows_k_reference(x)
    dots = np.einsum("msjk,nsjk->mnsj", xq.reshape(-1, nsb, 8, SUB).astype(np.int64),
                     q.reshape(N, nsb, 8, SUB).astype(np.int64))  # [M, N, nsb, 8]
    isum = (dots * sc[None].astype(np.int64)).sum(axis=3)  # [M, N, nsb]
    msum = (xb.reshape(-1, 1, nsb, 8).astype(np.int64) * m[None].astype(np.int64)).sum(axis=3)
    df, mf = d.astype(np.float32), dmin.astype(np.float32)  # [N, nsb]
    acc = np.zeros((x.shape[0], N), np.float32)
    for s in range(nsb):
        a = (df[None, :, s] * xd[:, None, s]) * isum[:, :, s].astype(np.float32)
        c = (mf[None, :, s] * xd[:, None, s]) * msum[:, :, s].astype(np.float32)
        acc = acc + (a - c)
    return acc
