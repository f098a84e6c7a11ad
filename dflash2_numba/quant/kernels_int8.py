"""Integer GEMV on q8_0 / q4_0 panels (quant/formats.py), one micro-kernel per instruction set.

    gemv_quant(x [M, K] f32, (qw, ws), y [M, N] f32, parallel)    # y = x @ dequant(w).T

1. Activations are quantized per row and per 32-block by ONE function (`quantize_rows`, every
   row count and path calls it): llama.cpp's AVX quantize_row_q8_0, d = amax / 127 kept as
   fp16, q = rint(x * (127 / amax)) (ties to even), |q| <= 127; plus xc = 128 * sum of the
   block's q (int32), the VNNI paths' correction. Whole blocks of contiguous rows run as 32-lane
   vectors (quant/quantize_ir.py: the same bits, 2.7x faster than numba's scalar loop).
2. Per (row r, column c, block b) the int32 block dot isum = sum_j xq[r, 32b + j] * wq[c, 32b + j],
   exact on every path (|isum| <= 32 * 127 * 127 < 2^24):
     avx512_vnni  vpdpbusd zmm (16 columns x 4 k per instruction). Its unsigned operand is the
                  WEIGHT, stored at load as wq + 128 (formats.pack, unsigned=True), and the
                  signed one the activation's 4 bytes, broadcast from memory (LLVM folds the
                  broadcast into the instruction: {1to16}); the block sum then carries
                  + 128 * sum_j xq, and subtracting xc makes it exact. No per-k extra work.
                  q4_0: the stored nibble (q + 8) itself is the unsigned operand and xc >> 4
                  (= 8 * sum_j xq) the correction: a mask or a shift per weight vector;
     avx_vnni     the same with ymm ({vex} vpdpbusd, or the EVEX form with AVX512-VL);
     avx2         llama.cpp's sign trick: |w| (unsigned) x sign(w)*x (signed) by vpmaddubsw,
                  whose int16 pair sums stay <= 2 * 127 * 127 (no saturation), then vpmaddwd by
                  ones into int32 lanes; q4_0: vpmaddubsw(nibble, x) (pairs <= 2 * 15 * 127),
                  corrected by xc >> 4 as on VNNI;
     generic      plain LLVM vector IR (sign-extend, multiply, add the 4 products of a column),
                  which LLVM legalises on any target.
   The path is fixed when the kernels compile (kernels/isa.py: numba's target features, which
   numba's cache key holds), never per call.
3. ONE float epilogue for every path: acc = fma(ws[c, b] * xs[r, b], float(isum), acc) over
   b = 0, 1, ... in order from acc = 0. The thread split is over columns only. So y is bit for
   bit the same for every instruction set, row count, tile and thread count.

Tiles: rows in groups of 4 (then 2, then 1) against a column group of one panel: 4 x 32
columns = 8 int32 + 8 f32 zmm on AVX-512; 4 x 8 columns on 256-bit / generic (16 ymm: 4 + 4
accumulators and the sign-trick temporaries); a last single row on AVX-512 takes 2 of the
item's panels at once, twice (2 memory streams), on the 256-bit paths the whole panel in one pass. Rows
beyond 32 (prefill) run the same kernel.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..kernels import isa
from ..numerics import _f32_as_u32, _u32_as_f32
from .formats import BLOCK, ITEM_COLS, ITEM_PANELS, PANEL_COLS
from .ir_helpers import ir_column_sums, ir_fn, ir_half_to_float, ir_splat
from .quantize_ir import block_amax_ir, block_quantize_ir

MODES = {"avx512_vnni": "vnni512", "avx_vnni": "vnni256", "avx2": "avx2", "generic": "generic"}
MODE = MODES[isa.selected()]
VNNI = MODE.startswith("vnni")  # the paths that store weights + 128 and subtract xc
V = 16 if MODE == "vnni512" else 8  # int32 lanes (columns) per vector
GROUP_COLS = PANEL_COLS if MODE == "vnni512" else V  # columns per tile
# software prefetch distance in weight bytes: each 32-block's tile also prefetches the panel bytes
# that far ahead (past the array's end never faults; 0: none). One-row streaming GEMV, 576 MB, 1
# thread, Xeon VM, numpy read 15-16 GB/s (bench/quant_stream.py): q4_0 10.3 -> 14.0 GB/s, q8_0
# 13.6 -> 15.2, forced avx2 q4_0 6.3 -> 9.0. On AVX-512 on Zen 4 (isa.software_prefetch() false) the
# hardware prefetcher alone streams faster (one row q8_0 0.72-0.75x the time at 1 thread;
# docs/roofline.md, session 21): none there, and its 4-row tiles prefetch the next panel (`_FAR4`)
_HW_ONLY = MODE == "vnni512" and not isa.software_prefetch()
PREFETCH_BYTES = 0 if _HW_ONLY else 2048


# ------------------------------------------------------------------ activations
@njit(inline="always")
def round_f16(v):
    """f32 v >= 0 -> the nearest fp16 value (ties to even) as f32: how llama.cpp stores d."""
    if v < np.float32(6.103515625e-05):  # below fp16's smallest normal: multiples of 2^-24
        return np.float32(np.rint(np.float64(v) * 16777216.0) / 16777216.0)
    bits = _f32_as_u32(v)
    bits = (bits + np.uint32(0x0FFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    if bits >= np.uint32(0x477FF000):  # rounds past fp16's largest finite value (65504)
        return np.float32(np.inf)
    return _u32_as_f32(bits)


@njit(inline="always")
def quantize_rows(x, Kp):
    """x [M, K] f32 -> (xq [M, Kp] int8, xs [M, Kp/32] f32, xc [M, Kp/32] int32): per row and
    32-block (the last block zero-padded) d = fp16(amax / 127), q = rint(x * (127 / amax)),
    xc = 128 * sum of q. The one activation quantizer."""
    M, K = x.shape
    nb = Kp // BLOCK
    xq = np.zeros((M, Kp), np.int8)
    xs = np.empty((M, nb), np.float32)
    xc = np.empty((M, nb), np.int32)
    vec = x.strides[1] == 4  # a row's elements contiguous: whole blocks go through quantize_ir.py
    for r in range(M):
        for b in range(nb):
            k0, k1 = b * BLOCK, min(K, (b + 1) * BLOCK)
            whole = vec and k1 - k0 == BLOCK
            amax = block_amax_ir(x, r, k0) if whole else np.float32(0.0)  # the same max, 32 lanes at once
            if not whole:
                for k in range(k0, k1):
                    amax = max(amax, abs(x[r, k]))
            xs[r, b] = round_f16(amax / np.float32(127.0))
            inv = np.float32(127.0) / amax if amax > np.float32(0.0) else np.float32(0.0)
            total = block_quantize_ir(x, r, k0, inv, xq) if whole else 0  # the same products, roundings
            if not whole:
                for k in range(k0, k1):
                    q = np.int8(np.rint(x[r, k] * inv))
                    xq[r, k] = q
                    total += np.int32(q)
            xc[r, b] = np.int32(128) * np.int32(total)
    return xq, xs, xc


# ------------------------------------------------------------------ micro-kernel (LLVM IR)
def _tile(R: int, G: int, fmt: str, P: int = 1, far: bool = False):
    """An intrinsic tile(xq, xs, xc, m0, qw, ws, p, col0, y, ycol): rows m0..m0+R-1, columns
    col0 .. col0 + G*V - 1 of panels p .. p+P-1 -> y[m0 + r, ycol + 32 pp + col0 + j] (f32, the
    epilogue of the module docstring). xq [M, Kp] int8, xs [M, nb] f32, xc [M, nb] int32, qw / ws
    the panels, y f32, all C. P > 1 (the one-row tile): the P panels are read side by side, P
    memory streams in flight instead of one; each column's arithmetic is unchanged.
    far: each block also prefetches (prefetcht2) the column group's share of the same block in
    the NEXT panel (P = 1 tiles only)."""
    q4 = fmt == "q4_0"
    raw_nibbles = q4 and MODE != "generic"  # the nibbles (q + 8) are the unsigned operand as stored
    steps = 4 if q4 else 8  # loads per 32-block and group: a q4 load holds two k-quads

    @intrinsic
    def tile(typingctx, xq, xs, xc, m0, qw, ws, p, col0, y, ycol):
        arrays = (xq, xs, xc, qw, ws, y)
        if not all(isinstance(a, types.Array) and a.layout == "C" for a in arrays):
            return None
        if (xq.dtype, xs.dtype, xc.dtype, qw.dtype, ws.dtype, y.dtype) != (
                types.int8, types.float32, types.int32, types.uint8 if q4 else types.int8, types.uint16,
                types.float32):
            return None
        sig = types.void(xq, xs, xc, types.int64, qw, ws, types.int64, types.int64, y, types.int64)

        def codegen(context, builder, signature, args):
            m0, p, col0, ycol = args[3], args[6], args[7], args[9]
            xa, xsa, xca, qa, wa, ya = [context.make_array(signature.args[i])(context, builder, args[i])
                                        for i in (0, 1, 2, 4, 5, 8)]
            i8, i16, i32, i64, f32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                                      ir.FloatType())
            vb, vi, vf = ir.VectorType(i8, 4 * V), ir.VectorType(i32, V), ir.VectorType(f32, V)
            vs16 = ir.VectorType(i16, V)  # the fp16 scales' bits

            def half_to_float(h):
                return ir_half_to_float(builder, h, vi, vf)

            def const(v):
                return ir.Constant(i64, v)

            def fn(name, ret, argtys):
                return ir_fn(builder, name, ret, argtys)

            def splat(scalar, vty):
                return ir_splat(builder, scalar, vty)

            Kp = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            nb = builder.ashr(Kp, const(5))
            ldy = cgutils.unpack_tuple(builder, ya.shape, 2)[1]
            panel_bytes = builder.mul(Kp, const(PANEL_COLS // 2 if q4 else PANEL_COLS))
            w0 = builder.gep(builder.bitcast(qa.data, i8.as_pointer()),
                             [builder.add(builder.mul(p, panel_bytes), builder.mul(col0, const(4)))])
            meta = builder.add(builder.mul(builder.mul(p, nb), const(PANEL_COLS)), col0)  # ws [p, 0, col0]
            s0 = builder.gep(wa.data, [meta])
            panel_metas = builder.mul(nb, const(PANEL_COLS))  # ws elements per panel
            w_at = [builder.gep(w0, [builder.mul(panel_bytes, const(pp))]) for pp in range(P)]
            s_at = [builder.gep(s0, [builder.mul(panel_metas, const(pp))]) for pp in range(P)]
            x0 = builder.gep(xa.data, [builder.mul(m0, Kp)])  # &xq[m0, 0]
            xs0 = builder.gep(xsa.data, [builder.mul(m0, nb)])
            xc0 = builder.gep(xca.data, [builder.mul(m0, nb)])
            y0 = builder.gep(ya.data, [builder.add(builder.mul(m0, ldy), builder.add(ycol, col0))])
            fma = fn(f"llvm.fma.v{V}f32", vf, [vf, vf, vf])
            zero_i, zero_f = ir.Constant(vi, [0] * V), ir.Constant(vf, [0.0] * V)

            if MODE == "vnni512":
                dp = fn("llvm.x86.avx512.vpdpbusd.512", vi, [vi, vb, vb])
            elif MODE == "vnni256":
                dp = fn("llvm.x86.avx512.vpdpbusd.256", vi, [vi, vb, vb])
            elif MODE == "avx2":
                vh = ir.VectorType(i16, 2 * V)
                absb = fn(f"llvm.abs.v{4 * V}i8", vb, [vb, ir.IntType(1)])
                psign = fn("llvm.x86.avx2.psign.b", vb, [vb, vb])
                maddubs = fn("llvm.x86.avx2.pmadd.ub.sw", vh, [vb, vb])
                maddwd = fn("llvm.x86.avx2.pmadd.wd", vi, [vh, vh])
                ones16 = ir.Constant(vh, [1] * (2 * V))
            else:
                vw = ir.VectorType(i32, 4 * V)

            def prep(w):
                """Per weight vector, what every row's dot reuses."""
                if MODE == "avx2" and not raw_nibbles:
                    return w, builder.call(absb, [w, ir.Constant(ir.IntType(1), 0)])
                if MODE == "generic":
                    return builder.sext(w, vw), None
                return w, None

            def dot(acc, xword, wprep):
                """acc += the 4-product sums of xword (4 activation bytes, every column) x w."""
                w, aux = wprep
                xb = builder.bitcast(splat(xword, vi), vb)
                if VNNI:  # unsigned operand: the weights + 128 (q4: + 8); signed: x (xc corrects the offset)
                    return builder.call(dp, [acc, w, xb])
                if raw_nibbles:  # avx2 q4_0: nibble (unsigned, <= 15) x x, pairs <= 2 * 15 * 127
                    return builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [w, xb]), ones16]))
                if MODE == "avx2":
                    sx = builder.call(psign, [xb, w])  # sign(w) * x, |x| <= 127
                    pairs = builder.call(maddubs, [aux, sx])  # |w| * sign(w) x, pairs <= 32258
                    return builder.add(acc, builder.call(maddwd, [pairs, ones16]))
                return builder.add(acc, ir_column_sums(builder, builder.mul(w, builder.sext(xb, vw)), V))

            entry = builder.block
            loop = builder.append_basic_block("qtile.b")
            done = builder.append_basic_block("qtile.done")
            builder.cbranch(builder.icmp_signed("<=", nb, const(0)), done, loop)

            builder.position_at_end(loop)  # one 32-block: int32 dots, then the float epilogue
            b = builder.phi(i64)
            facc = [[builder.phi(vf) for _ in range(G)] for _ in range(R)]
            # integer partial sums per (row, group): CHAINS independent ones over the k-quads
            # (kq % CHAINS), so small tiles are not bound by the dot's latency; integer addition
            # is exact, so how the block's sum is split changes no bit
            chains = max(1, 8 // (R * G))
            iacc = [[[zero_i] * chains for _ in range(G)] for _ in range(R)]
            wblocks = [builder.gep(w, [builder.mul(b, const(steps * PANEL_COLS * 4))]) for w in w_at]
            xblock = builder.mul(b, const(BLOCK))
            prefetch = fn("llvm.prefetch.p0i8", ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
            for wblock in wblocks if PREFETCH_BYTES else ():
                for line in range(0, steps * PANEL_COLS * 4, 64):  # read, high locality, data cache
                    builder.call(prefetch, [builder.gep(wblock, [const(PREFETCH_BYTES + line)]),
                                            ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            if far:  # this block of the NEXT panel, into the outer caches: the column group at col0
                # takes its share of the block's lines (col0 / V of PANEL_COLS / V shares)
                share = steps * 4 * G * V  # bytes of the block in this tile's G * V columns
                nxt = builder.gep(wblocks[0], [builder.sub(panel_bytes, builder.mul(col0, const(4)))])
                for line in range(0, share, 64):
                    at = builder.add(builder.mul(col0, const(steps * 4)), const(line))
                    builder.call(prefetch, [builder.gep(nxt, [at]),
                                            ir.Constant(i32, 0), ir.Constant(i32, 1), ir.Constant(i32, 1)])
            for step in range(steps):
                loads = []
                for g in range(G):  # group g = panel g // (G / P), its columns (g % (G / P)) * V ...
                    ptr = builder.gep(wblocks[g // (G // P)], [const(step * PANEL_COLS * 4 + (g % (G // P)) * V * 4)])
                    loads.append(builder.load(builder.bitcast(ptr, vb.as_pointer()), align=1))
                if raw_nibbles:  # low nibbles: k-quad `step`, high: `step + 4`; each q + 8, used as is
                    mask = ir.Constant(vb, [15] * 4 * V)
                    quads = [(step, [builder.and_(w, mask) for w in loads]),
                             (step + 4, [builder.lshr(w, ir.Constant(vb, [4] * 4 * V)) for w in loads])]
                elif q4:  # the generic path: q + 8 - 8 -> int8, sign-extended
                    off, mask = ir.Constant(vb, [-8] * 4 * V), ir.Constant(vb, [15] * 4 * V)
                    quads = [(step, [builder.add(builder.and_(w, mask), off) for w in loads]),
                             (step + 4, [builder.add(builder.lshr(w, ir.Constant(vb, [4] * 4 * V)), off)
                                         for w in loads])]
                else:
                    quads = [(step, loads)]
                for kq, ws_ in quads:
                    prepped = [prep(w) for w in ws_]
                    for r in range(R):
                        at = builder.add(builder.add(builder.mul(const(r), Kp), xblock), const(4 * kq))
                        xword = builder.load(builder.bitcast(builder.gep(x0, [at]), i32.as_pointer()), align=1)
                        for g in range(G):
                            iacc[r][g][kq % chains] = dot(iacc[r][g][kq % chains], xword, prepped[g])
            new = []
            for r in range(R):
                xsr = builder.load(builder.gep(xs0, [builder.add(builder.mul(const(r), nb), b)]))
                xsb = splat(xsr, vf)
                if VNNI or raw_nibbles:  # xc = 128 sum x: the + 128 offset's sum; q4's + 8 is xc >> 4
                    xcb = splat(builder.load(builder.gep(xc0, [builder.add(builder.mul(const(r), nb), b)])), vi)
                    if q4:
                        xcb = builder.ashr(xcb, ir.Constant(vi, [4] * V))
                row = []
                for g in range(G):
                    at = builder.add(builder.mul(b, const(PANEL_COLS)), const((g % (G // P)) * V))
                    wsh = builder.load(builder.bitcast(builder.gep(s_at[g // (G // P)], [at]), vs16.as_pointer()),
                                       align=2)
                    wsv_ = half_to_float(wsh)
                    isum = iacc[r][g][0]
                    for part in iacc[r][g][1:]:
                        isum = builder.add(isum, part)
                    if VNNI or raw_nibbles:
                        isum = builder.sub(isum, xcb)
                    scale = builder.fmul(wsv_, xsb)  # ws * xs: ONE rounding, the same on every path
                    row.append(builder.call(fma, [scale, builder.sitofp(isum, vf), facc[r][g]]))
                new.append(row)
            b_next = builder.add(b, const(1))
            b.add_incoming(const(0), entry)
            b.add_incoming(b_next, loop)
            for r in range(R):
                for g in range(G):
                    facc[r][g].add_incoming(zero_f, entry)
                    facc[r][g].add_incoming(new[r][g], loop)
            builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)

            builder.position_at_end(done)
            outs = [[builder.phi(vf) for _ in range(G)] for _ in range(R)]  # phis lead the block
            for r in range(R):
                for g in range(G):
                    out = outs[r][g]
                    out.add_incoming(zero_f, entry)
                    out.add_incoming(new[r][g], loop)
                    ycol_g = (g // (G // P)) * PANEL_COLS + (g % (G // P)) * V
                    ptr = builder.gep(y0, [builder.add(builder.mul(const(r), ldy), const(ycol_g))])
                    builder.store(out, builder.bitcast(ptr, vf.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_G = GROUP_COLS // V
# the one-row tile reads 2 panels of an item side by side on AVX-512, twice per item (2 memory
# streams: on Zen 4 faster than 4 side by side, 1 thread q8_0 -18 %, q4_0 -13 %; 4 had beaten 1
# panel by 10-20 % on Zen 5 / Xeon; docs/roofline.md, session 20). The 16-register 256-bit
# paths keep one panel (4 panels there spill and lose ~25% in cache)
_T1P = 2 if MODE == "vnni512" else 1
# `far` on the 256-bit paths, where a panel is read by 4 column-group passes (8 columns each):
# the 2- and 4-row tiles also prefetch the next panel's block, each group its quarter, so the
# memory streams during all the passes, not only the first. Streamed [2048, 2048],
# `DFLASH2_ISA=avx2`, 1 thread, in-process medians (docs/roofline.md, session 8): q8_0 2 / 4 / 6 /
# 8 / 16 rows -6 / -19 / -8 / -12 / -3 %, q4_0 4 / 8 rows -12 / -3 %. Off on AVX-512 (one pass
# over the whole panel: within the noise) and on the generic path (compute-bound: +-1 %)
_FAR = MODE in ("avx2", "vnni256")
# one row on the 256-bit paths: the whole panel in one pass (each 128-byte k-quad group read whole),
# not 4 passes of 8 columns reading a quarter each. Streamed [2048, 2048], DFLASH2_ISA=avx2, Zen 5
# (docs/amd_epyc_zen5.md, session 13): q8_0 1 / 2 threads 200 -> 139 / 128 -> 102 us, q4_0 104 -> 85 us
_WHOLE1 = MODE in ("avx2", "vnni256")
# AVX-512: the q4_0 4-row tile prefetches the next panel too (Zen 5, session 14: 4 / 8 / 16 rows
# 0.97-1.21 / 1.13-1.27 / 1.11x; q8_0, 2-row tiles 0-12 % slower); Zen 4, near prefetch off: q8_0's too (8 rows 0.75-0.85x)
_FAR4 = {"q8_0": _FAR or _HW_ONLY, "q4_0": _FAR or MODE == "vnni512"}
_tiles = {fmt: (_tile(4, _G, fmt, far=_FAR4[fmt]), _tile(2, _G, fmt, far=_FAR), _tile(1, _T1P * _G, fmt, _T1P))
          for fmt in ("q8_0", "q4_0")}
_rows1 = {fmt: _tile(1, PANEL_COLS // V, fmt) for fmt in ("q8_0", "q4_0")} if _WHOLE1 else {}
_q8_4, _q8_2, _q8_1 = _tiles["q8_0"]
_q4_4, _q4_2, _q4_1 = _tiles["q4_0"]


# ------------------------------------------------------------------ drivers
def _make_item(t4, t2, t1, group_cols=GROUP_COLS, t1_panels=1):
    """The driver of one work item (ITEM_PANELS panels) over tiles t4 / t2 / t1 (4 / 2 / 1 rows)
    of `group_cols` columns each (kernels_q4k.py reuses it with its own tiles); t1 covers
    `t1_panels` panels side by side (1, 2 or ITEM_PANELS)."""

    @njit(inline="always")
    def item(xq, xs, xc, qw, ws, y, b):
        """Output columns b*128 .. b*128+127 for every row; y [M, N]."""
        M = xq.shape[0]
        N = y.shape[1]
        scratch = np.empty((M, ITEM_COLS), np.float32)  # [M, 128]
        for pp in range(ITEM_PANELS):
            p = b * ITEM_PANELS + pp
            for col0 in range(0, PANEL_COLS, group_cols):
                m0 = 0
                while M - m0 >= 4:
                    t4(xq, xs, xc, m0, qw, ws, p, col0, scratch, pp * PANEL_COLS)
                    m0 += 4
                if M - m0 >= 2:
                    t2(xq, xs, xc, m0, qw, ws, p, col0, scratch, pp * PANEL_COLS)
                    m0 += 2
                if M - m0 == 1 and pp % t1_panels == 0:
                    t1(xq, xs, xc, m0, qw, ws, p, col0, scratch, pp * PANEL_COLS)
        n0 = b * ITEM_COLS
        for r in range(M):
            for j in range(min(ITEM_COLS, N - n0)):
                y[r, n0 + j] = scratch[r, j]

    return item


_item_q8 = _make_item(_q8_4, _q8_2, _q8_1, t1_panels=_T1P)
_item_q4 = _make_item(_q4_4, _q4_2, _q4_1, t1_panels=_T1P)


def _make_row_item(t1):
    """A product of ONE row on the 256-bit paths (`_WHOLE1`): the whole-panel tile t1 once per
    panel. Its own driver: inlined into the multi-row item, the larger tile made the 4- and 8-row
    products 4-11 % slower (code layout), so those keep their item as it was."""

    @njit(inline="always")
    def row_item(xq, xs, xc, qw, ws, y, b):
        N = y.shape[1]
        scratch = np.empty((1, ITEM_COLS), np.float32)  # [1, 128]
        for pp in range(ITEM_PANELS):
            t1(xq, xs, xc, 0, qw, ws, b * ITEM_PANELS + pp, 0, scratch, pp * PANEL_COLS)
        n0 = b * ITEM_COLS
        for j in range(min(ITEM_COLS, N - n0)):
            y[0, n0 + j] = scratch[0, j]

    return row_item


_row_q8 = _make_row_item(_rows1["q8_0"]) if _WHOLE1 else _item_q8
_row_q4 = _make_row_item(_rows1["q4_0"]) if _WHOLE1 else _item_q4


def quantize_activations(x, ws):  # pragma: no cover - typing stub, see the overload
    raise NotImplementedError


@overload(quantize_activations, inline="always")
def _quantize_activations(x, ws):
    """The activation quantizer the panels' format takes: q8_K per 256 for Q4_K, else q8_0 per 32
    (quantize_rows). Returns (xq, xs, xc) for the item drivers."""
    if ws.dtype == types.uint8:
        from .kernels_q4k import QK_K, quantize_rows_k

        return lambda x, ws: quantize_rows_k(x, ws.shape[1] * QK_K)
    return lambda x, ws: quantize_rows(x, ws.shape[1] * BLOCK)


def _item(xq, xs, xc, qw, ws, y, b):  # pragma: no cover - typing stub, see the overload
    raise NotImplementedError


@overload(_item, inline="always")
def _item_impl(xq, xs, xc, qw, ws, y, b):
    """Work item b (output columns b*128 ..) of the format, chosen by the panels' dtypes at
    compile time: Q4_K panels (kernels_q4k.py) have uint8 metadata, q4_0 uint8 nibbles, q8_0
    int8 weights. A product of one row on the 256-bit paths takes its own driver
    (`_make_row_item`), every other one the multi-row item."""
    if ws.dtype == types.uint8:
        from .kernels_q4k import item_q4k  # imported here: kernels_q4k builds on this module

        return item_q4k.py_func
    row, item = (_row_q4, _item_q4) if qw.dtype == types.uint8 else (_row_q8, _item_q8)

    def work(xq, xs, xc, qw, ws, y, b):
        if _WHOLE1 and xq.shape[0] == 1:
            row(xq, xs, xc, qw, ws, y, b)
        else:
            item(xq, xs, xc, qw, ws, y, b)

    return work


@njit(parallel=True, cache=True, nogil=True)
def _gemv_quant_par(xq, xs, xc, qw, ws, y):
    for b in prange(qw.shape[0] // ITEM_PANELS):
        _item(xq, xs, xc, qw, ws, y, b)


@njit(cache=True, nogil=True)
def _gemv_quant_ser(xq, xs, xc, qw, ws, y):
    for b in range(qw.shape[0] // ITEM_PANELS):
        _item(xq, xs, xc, qw, ws, y, b)


@njit(inline="always")
def gemv_quant(x, w, y, parallel):
    """y [M, N] = x [M, K] @ dequant(w).T, w = (qw, ws) panels (q8_0, q4_0 or Q4_K); callable
    from numba code (kernels/fused.py) and from Python (through kernels/linear.py)."""
    qw, ws = w
    xq, xs, xc = quantize_activations(x, ws)
    if parallel:
        _gemv_quant_par(xq, xs, xc, qw, ws, y)
    else:
        _gemv_quant_ser(xq, xs, xc, qw, ws, y)


@njit(cache=True, nogil=True)
def quantize_rows_entry(x, Kp):
    """quantize_rows callable from Python (tests, the numpy reference's cross-check)."""
    return quantize_rows(x, Kp)


# ------------------------------------------------------------------ numpy int64 reference
def quantize_rows_reference(x: np.ndarray, Kp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy version of quantize_rows (independent code: fp16 rounding by numpy's cast)."""
    M, K = x.shape
    xp = np.zeros((M, Kp), np.float32)
    xp[:, :K] = x
    blocks = xp.reshape(M, Kp // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)  # [M, nb]
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint(blocks * inv[:, :, None]).astype(np.int8).reshape(M, Kp)
    xs = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    xc = 128 * xq.reshape(M, -1, BLOCK).astype(np.int32).sum(axis=2, dtype=np.int32)
    return xq, xs, xc


def block_dots_reference(xq: np.ndarray, q: np.ndarray) -> np.ndarray:
    """int64 isum [M, N, nb] = sum over each 32-block of xq [M, Kp] x q [N, Kp]."""
    M, Kp = xq.shape
    a = xq.reshape(M, -1, BLOCK).astype(np.int64)
    w = q.reshape(q.shape[0], -1, BLOCK).astype(np.int64)
    return np.einsum("mbj,nbj->mnb", a, w)


def gemv_quant_reference(x: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The kernels' result from (q [N, Kp] int8, d [N, nb] f16) by numpy: int64 block dots,
    then acc = fma(d * xs, isum, acc) over blocks in order (fma emulated in f64: the product
    of an f32 and an integer < 2^20 is exact, the sum is rounded once to f64 then to f32)."""
    xq, xs, _ = quantize_rows_reference(np.asarray(x, np.float32), q.shape[1])
    isum = block_dots_reference(xq, q)  # [M, N, nb]
    ds = d.astype(np.float32)  # [N, nb]
    acc = np.zeros((x.shape[0], q.shape[0]), np.float32)
    for b in range(isum.shape[2]):
        scale = (ds[None, :, b] * xs[:, None, b]).astype(np.float32)  # [M, N] one f32 rounding
        acc = (scale.astype(np.float64) * isum[:, :, b] + acc).astype(np.float32)
    return acc
