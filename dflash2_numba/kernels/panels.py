"""The bf16 GEMV for decode-size products, on weights repacked into column panels at load.

    w_packed = pack_bf16(w [N, K] uint16)     # once per weight matrix (ops.prepare_weight)
    gemv_panels(x [M, K] f32, w_packed.panels, y [M, N] f32, parallel)   # y = x @ w.T

Why a second layout: in the row layout [N, K] each output is a dot product along K, so every
output ends in a horizontal sum and each converted weight vector feeds few FMAs. In the panel
layout a k-step of one panel holds 32 OUTPUT COLUMNS: one 64-byte load gives 32 bf16 weights,
x[r, k] is broadcast, and a fused multiply-add updates 32 accumulators per input row, with no
horizontal sum at all — the shape of every fast GEMM micro-kernel (llama.cpp repacks its CPU
weights the same way).

Panel layout (N padded with zero rows to a multiple of PANEL_COLS * 4):
    panels [NP, K, 32] uint16;  panels[p, k, 2i] = w[32p + i, k],  panels[p, k, 2i+1] = w[32p + 16 + i, k]
so the 32-bit lane i of a k-step holds column i in its low half and column i+16 in its high
half: `lane << 16` is column i as f32 and `lane & 0xFFFF0000` is column i+16 — the bf16 -> f32
conversion is one shift or one AND per 16 weights, and both halves come out in column order.

The micro-kernels are written as LLVM vector IR (`_tile`): numba's loop vectoriser does not
keep a [rows x 32] accumulator tile in registers (it spills it, or gathers), and explicit
<16 x float> vectors with `llvm.fma` give exactly the loop above on any x86-64 (zmm on
AVX-512, pairs of ymm on AVX2) or other LLVM target.

Numerics: every output y[r, n] is ONE chain of fused multiply-adds over k = 0..K-1 in order,
starting from 0, whatever the tile, the number of rows or the thread split. So a verify of 8
rows gives bit for bit the logits of 8 single-row steps (tests/test_panels.py checks this), and
the result differs from the row-layout kernel (a reassociated vector sum) only by rounding.

Tiles are sized per register file (kernels/isa.py, what numba compiles for):
- 512-bit (32 zmm): <16 x float> vectors; rows in groups of 8 against 1 panel (8 x 32
  accumulators = 16 zmm), then the r < 8 rows left in one pass where a tile holds them: r rows
  against 2 panels for r = 3..6 (7: 4 + 3), 2 rows x 4 panels, 1 row x 2 panels twice. The
  8x1 tile reads each panel from memory once for 8 rows; with 4x2
  tiles only (the earlier choice: on cache-resident shapes 4x2 had beaten 8x1) the second group
  of 4 rows re-read the panels from L2 after the first had streamed them, so reading and FMAs
  overlapped less: streamed [2048, 2048], 8 rows, three alternating runs each, 1 thread
  1130-1232 -> 1059-1100 us (1.80-1.89 -> 1.56-1.64x one row), 2 threads 627-712 -> 590-622 us
  (bench/roofline.py, docs/roofline.md).
- 256-bit (16 ymm: AVX2, AVX-VNNI) and narrower: <8 x float> vectors over HALF a panel (lanes
  0..7 or 8..15: columns 0..7 + 16..23, or 8..15 + 24..31). On 256 bits, 6 rows x half a panel is 12 ymm
  accumulators + 2 weight vectors + 1 broadcast + the mask: all 16 registers, no spill, and
  12 independent FMA chains hide the FMA latency that 8 do not (the 512-bit 4x2 tile needs 32
  ymm accumulators on AVX2 and spilled: ~1/3 of FMA peak). In cache, [256, 2048]: 4 rows x half
  a panel 24.0-26.8 GMAC/s, 6 rows 28.7-30.5 (1 thread, peak 40). Then a group of 4 rows (8
  accumulators; the generic path's only multi-row tile), or 3 or 5 rows left in one such tile;
  remainders 2 rows x 2 half-panels, and 1 row x 2 whole panels, twice (1 row x 4
  half-panels, twice, on the generic path).
The tile shape never changes an output's chain (one fma per k, in order), so every path gives
the same bits.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import isa

PANEL_COLS = 32  # output columns per panel
LANES = PANEL_COLS // 2  # f32 lanes per accumulator vector (one zmm)
ITEM_PANELS = 4  # panels per work item: the largest tile's panel count
ITEM_COLS = PANEL_COLS * ITEM_PANELS
# software prefetch distance in k-steps (x 64 bytes per panel): 32 measured best of 0/8/32/64 on
# the streaming shapes (+5-10% at 4-8 rows: the weights of the next k-steps are in flight while
# the FMAs of this one run), neutral at 1 row and on cache-resident shapes
PREFETCH_STEPS = 32


# ------------------------------------------------------------------ packing
class PackedBF16(np.ndarray):
    """A bf16 weight [N, K] (the original uint16 array, as a view) that also carries its panel
    copy `.panels` [NP, K, 32]. Everything that reads the weight as an array still can (the
    BLAS prefill path, shapes, inspection); `linear` takes the panels. Views and copies of it
    have `.panels = None`: only the object pack_bf16 returned is packed."""

    panels = None

    def __array_finalize__(self, obj):
        self.panels = None


def pack_panels(w: np.ndarray) -> np.ndarray:
    """w [N, K] uint16 -> panels [NP, K, 32] uint16, NP = N / 32 rounded up to a multiple of
    ITEM_PANELS, padding columns zero (their outputs are computed and dropped)."""
    N, K = w.shape
    n_panels = -(-N // ITEM_COLS) * ITEM_PANELS
    padded = np.zeros((n_panels * PANEL_COLS, K), np.uint16)  # [NP*32, K]
    padded[:N] = w
    # [NP, half, i, K] -> [NP, K, i, half]: lane i = (column i, column 16 + i)
    return np.ascontiguousarray(padded.reshape(n_panels, 2, LANES, K).transpose(0, 3, 2, 1)).reshape(
        n_panels, K, PANEL_COLS)


def pack_bf16(w: np.ndarray) -> np.ndarray:
    """A 2-D uint16 (bf16) weight -> PackedBF16 (same values, plus panels); others unchanged."""
    if not isinstance(w, np.ndarray) or w.dtype != np.uint16 or w.ndim != 2 or w.size == 0:
        return w
    packed = np.asarray(w).view(PackedBF16)
    packed.panels = pack_panels(np.asarray(w))
    return packed


def group_panels(weights: list) -> tuple:
    """One product for several weights that read the same input (q, k, v; gate, up): their
    panels concatenated along the panel axis -> (panels [sum NP, K, 32], the first column of
    each part in the grouped output). Each part keeps its padding to whole work items, so
    every weight's `.panels` is re-pointed to its slice of the group (a view: no extra memory)
    and a product over the group gives each output column the same fma chain as the weight
    alone. Quantized weights (quant/weights.py: panels (qw, ws)) group component-wise."""
    parts = [w.panels for w in weights]
    quant = isinstance(parts[0], tuple)
    first = [p[0] if isinstance(p, tuple) else p for p in parts]
    if any(p is None or isinstance(p, tuple) != quant or f.shape[1:] != first[0].shape[1:] or f.dtype != first[0].dtype
           for p, f in zip(parts, first)):
        raise ValueError("group_panels: every weight must be packed alike and read the same input features")
    if quant:
        group = tuple(np.concatenate([p[i] for p in parts], axis=0) for i in range(len(parts[0])))
    else:
        group = np.concatenate(parts, axis=0)  # [sum NP, K, 32]
    offsets, at = [], 0
    for w, f in zip(weights, first):
        offsets.append(at * PANEL_COLS)
        n = f.shape[0]
        w.panels = tuple(g[at:at + n] for g in group) if quant else group[at:at + n]
        at += n
    return group, tuple(offsets)


# ------------------------------------------------------------------ micro-kernels (LLVM IR)
def _tile(R: int, C: int, prefetch_steps: int = 0, V: int = LANES, far: bool = False):
    """An intrinsic tile(x, m0, panels, p0, lane0, y, ycol): for rows m0..m0+R-1 of x [M, K],
    panels p0..p0+C-1 and lanes lane0..lane0+V-1 of each (V = LANES: the whole panel),
    y[m0 + r, ycol + 32c + j] = sum_k x[m0 + r, k] * w(panel p0 + c, k, j) as one fma chain over
    k, for the columns j = lane0 + i and 16 + lane0 + i (i < V) the lanes hold. x, panels, y
    C-contiguous; y [>= m0+R, >= ycol+32C] f32.
    prefetch_steps > 0: each k-step also prefetches its panels that many k-steps ahead (a
    prefetch past the end of the array is harmless: it never faults).
    far: each k-step also prefetches the same k-step of the C panels AFTER this tile's into the
    outer caches (prefetcht2), so the next panels stream in from memory while this tile's FMAs
    run, not only in the first pass over them (a multi-row tile's passes after the first read
    from L2 and would otherwise leave the memory idle)."""

    @intrinsic
    def tile(typingctx, x, m0, panels, p0, lane0, y, ycol):
        if not (isinstance(x, types.Array) and x.layout == "C" and x.dtype == types.float32 and x.ndim == 2
                and isinstance(panels, types.Array) and panels.layout == "C" and panels.ndim == 3
                and panels.dtype == types.uint16 and isinstance(y, types.Array) and y.layout == "C"
                and y.dtype == types.float32 and y.ndim == 2):
            return None
        sig = types.void(x, types.int64, panels, types.int64, types.int64, y, types.int64)

        def codegen(context, builder, signature, args):
            xv, m0, pv, p0, lane0, yv, ycol = args
            xa = context.make_array(signature.args[0])(context, builder, xv)
            pa = context.make_array(signature.args[2])(context, builder, pv)
            ya = context.make_array(signature.args[5])(context, builder, yv)
            K = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            ldy = cgutils.unpack_tuple(builder, ya.shape, 2)[1]
            f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
            vf, vi = ir.VectorType(f32, V), ir.VectorType(i32, V)

            def const(v):
                return ir.Constant(i64, v)

            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                 f"llvm.fma.v{V}f32")
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
                "llvm.prefetch.p0i8")
            zero = ir.Constant(vf, [0.0] * V)
            lo_shift = ir.Constant(vi, [16] * V)
            hi_mask = ir.Constant(vi, [-65536] * V)  # 0xFFFF0000
            panel_words = builder.mul(K, const(LANES))  # u32 words per panel
            x0 = builder.gep(xa.data, [builder.mul(m0, K)])  # &x[m0, 0]
            w0 = builder.gep(builder.bitcast(pa.data, i32.as_pointer()),  # lane lane0 of panel p0
                             [builder.add(builder.mul(p0, panel_words), lane0)])
            y0 = builder.gep(ya.data, [builder.add(builder.mul(m0, ldy), builder.add(ycol, lane0))])

            entry = builder.block
            loop = builder.append_basic_block("tile.k")
            done = builder.append_basic_block("tile.done")
            builder.cbranch(builder.icmp_signed("<=", K, const(0)), done, loop)

            builder.position_at_end(loop)  # one k-step: C panel loads, R broadcasts, 2RC fmas
            k = builder.phi(i64)
            acc = [[builder.phi(vf) for _ in range(2 * C)] for _ in range(R)]
            weights = []
            for c in range(C):
                at = builder.add(builder.mul(const(c), panel_words), builder.mul(k, const(LANES)))
                if prefetch_steps:
                    ahead = builder.gep(w0, [builder.add(at, const(prefetch_steps * LANES))])
                    builder.call(prefetch, [builder.bitcast(ahead, ir.IntType(8).as_pointer()),
                                            ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                if far:  # panel p0 + C + c, the same k-step: locality 1 (prefetcht2)
                    ahead = builder.gep(w0, [builder.add(at, builder.mul(const(C), panel_words))])
                    builder.call(prefetch, [builder.bitcast(ahead, ir.IntType(8).as_pointer()),
                                            ir.Constant(i32, 0), ir.Constant(i32, 1), ir.Constant(i32, 1)])
                lanes = builder.load(builder.bitcast(builder.gep(w0, [at]), vi.as_pointer()), align=4)
                weights.append(builder.bitcast(builder.shl(lanes, lo_shift), vf))  # columns lane0 + i
                weights.append(builder.bitcast(builder.and_(lanes, hi_mask), vf))  # columns 16 + lane0 + i
            undef = ir.Constant(vf, ir.Undefined)
            splat = ir.Constant(vi, [0] * V)
            new = []
            for r in range(R):
                xs = builder.load(builder.gep(x0, [builder.add(builder.mul(const(r), K), k)]))
                xb = builder.shuffle_vector(builder.insert_element(undef, xs, ir.Constant(i32, 0)), undef, splat)
                new.append([builder.call(fma, [xb, weights[c], acc[r][c]]) for c in range(2 * C)])
            k_next = builder.add(k, const(1))
            k.add_incoming(const(0), entry)
            k.add_incoming(k_next, loop)
            for r in range(R):
                for c in range(2 * C):
                    acc[r][c].add_incoming(zero, entry)
                    acc[r][c].add_incoming(new[r][c], loop)
            builder.cbranch(builder.icmp_signed("<", k_next, K), loop, done)

            builder.position_at_end(done)
            out = [[builder.phi(vf) for _ in range(2 * C)] for _ in range(R)]  # phis lead the block
            for r in range(R):
                for c in range(2 * C):
                    out[r][c].add_incoming(zero, entry)
                    out[r][c].add_incoming(new[r][c], loop)
            for r in range(R):
                for c in range(2 * C):
                    # accumulator c: panel c // 2, low (columns lane0 + i) or high (16 + lane0 + i) half
                    at = builder.add(builder.mul(const(r), ldy), const((c // 2) * PANEL_COLS + (c % 2) * LANES))
                    builder.store(out[r][c], builder.bitcast(builder.gep(y0, [at]), vf.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


WIDE = isa.vector_bits() >= 512  # the register file numba compiles for: 32 zmm, or 16 ymm / xmm
# one row, both register files: the whole panel width (<16 x float>: one zmm, or two ymm), each
# 64-byte line read whole, 2 panels a pass and twice per item (2 streams; 4 zmm / 8 ymm
# accumulators, no spill). The half-panel tile had read each line in two passes (the second from
# L2): DFLASH2_ISA=avx2, Zen 5, 1 thread, 22-28 -> 33.8 GB/s with the item's 4 panels in one pass
# (docs/amd_epyc_zen5.md, session 13); 2 panels a pass, twice, read faster again on Zen 4
# ([2048, 2048] streamed, 1 / 2 threads: AVX2 352-365 / 257-308 -> 311-316 / 250-268 us,
# 512-bit 367 / 332 -> 321 / 276 us; docs/roofline.md, session 18). Not used on the generic
# path (SSE2: 4 xmm per vector)
_tile_1x2 = _tile(1, 2, PREFETCH_STEPS)
# `far` (prefetch the next panels too) where a panel is read by several passes or by 8 rows:
# streamed [2048, 2048], alternating processes (docs/roofline.md, session 8), 8 rows: 512-bit
# 1 thread -7%, 2 threads -9%; 256-bit with the 6-row tile 1 thread -10..-20%, 2 threads -3..-10%.
# The 512-bit 4x2 tile (4 rows, where an item's 4 panels are read once each) measured no gain
# (2 threads +6%, within noise) and keeps one stream, as do the 1- and 2-row tiles (memory-bound)
if WIDE:
    _tile_4x2 = _tile(4, 2, PREFETCH_STEPS)
    # 3, 5 and 6 rows in ONE pass over the item's panels (2 at a time, like 4x2: 12 / 20 / 24
    # accumulators), where 2x4 + 1x4 or 4x2 + 1x4 read them twice: streamed [6144, 2048], 1 thread,
    # x one row, 3 rows 1.21 -> 0.90, 5 rows 1.22 -> 1.06, 6 rows 1.37 -> 1.26, 7 rows (4x2 + 3x2)
    # 1.59 -> 1.50 (a 7x2 tile spills: 2.01). A server batch of 3, 5, 6 or 7 requests and a verify
    # of that many rows are such products (docs/roofline.md, session 18)
    _tile_3x2 = _tile(3, 2, PREFETCH_STEPS)
    _tile_5x2 = _tile(5, 2, PREFETCH_STEPS)
    _tile_6x2 = _tile(6, 2, PREFETCH_STEPS)
    _tile_8x1 = _tile(8, 1, PREFETCH_STEPS, far=True)
    _tile_2x4 = _tile(2, 4, PREFETCH_STEPS)
else:  # half-panel tiles of <8 x float>: 12 or 8 accumulators (see the module docstring)
    # the 6-row tile and `far` on the 256-bit register file only: on the generic path (SSE2, 16 xmm,
    # 2 per <8 x float>) every tile spills and the products are compute-bound; measured there,
    # 8 rows +2..+14 % with them, so it keeps the 4-row tile as it was
    _SIX = isa.vector_bits() == 256
    _tile_6x1h = _tile(6, 1, PREFETCH_STEPS, LANES // 2, far=True)
    _tile_4x1h = _tile(4, 1, PREFETCH_STEPS, LANES // 2, far=_SIX)
    # 3 or 5 rows left after the 6-row groups: one half-panel tile for them (256-bit only), where
    # 2x2h + 1x4f or 4x1h + 1x4f read the panels twice: streamed [6144, 2048], DFLASH2_ISA=avx2,
    # 1 thread, x one row: 3 rows 1.56 -> 1.01, 5 rows 1.54 -> 1.19 (7 rows as 4 + 3: no gain)
    _tile_3x1h = _tile(3, 1, PREFETCH_STEPS, LANES // 2, far=True)
    _tile_5x1h = _tile(5, 1, PREFETCH_STEPS, LANES // 2, far=True)
    _tile_2x2h = _tile(2, 2, PREFETCH_STEPS, LANES // 2)
    _tile_1x4h = _tile(1, 4, PREFETCH_STEPS, LANES // 2)


# ------------------------------------------------------------------ drivers
@njit(inline="always")
def _item_wide(x, panels, scratch, p0):
    """512-bit tiles: 8x1 over every group of 8 rows (each panel streamed once for them); the
    remaining r < 8 rows in one pass where a tile holds them: r x 2 panels for r = 3..6 (7: 4 + 3),
    2x4, 1x2 twice. scratch [M, 128] <- the item's padded columns."""
    M = x.shape[0]
    full8 = M - M % 8
    for p in range(ITEM_PANELS):
        for m0 in range(0, full8, 8):
            _tile_8x1(x, m0, panels, p0 + p, 0, scratch, p * PANEL_COLS)
    m0, r = full8, M - full8
    if r >= 3:
        for half in range(2):
            at, left = m0, r
            if left == 7 or left == 4:
                _tile_4x2(x, at, panels, p0 + 2 * half, 0, scratch, half * 2 * PANEL_COLS)
                at, left = at + 4, left - 4
            if left == 3:
                _tile_3x2(x, at, panels, p0 + 2 * half, 0, scratch, half * 2 * PANEL_COLS)
            elif left == 5:
                _tile_5x2(x, at, panels, p0 + 2 * half, 0, scratch, half * 2 * PANEL_COLS)
            elif left == 6:
                _tile_6x2(x, at, panels, p0 + 2 * half, 0, scratch, half * 2 * PANEL_COLS)
    elif r == 2:
        _tile_2x4(x, m0, panels, p0, 0, scratch, 0)
    elif r == 1:
        _tile_1x2(x, m0, panels, p0, 0, scratch, 0)
        _tile_1x2(x, m0, panels, p0 + 2, 0, scratch, 2 * PANEL_COLS)


@njit(inline="always")
def _item_narrow(x, panels, scratch, p0):
    """256-bit tiles: per panel and lane half, 6 rows at a time (not on the generic path), then
    the 3, 4 or 5 rows left in one tile (3 and 5: not on the generic path; there groups of 4);
    then 2 rows x 2 panels per lane half, and 1 row x 2 whole panels twice (1 row x 4 half-panels
    per lane half on the generic path)."""
    M = x.shape[0]
    full6 = M - M % 6 if _SIX else 0
    odd = M - full6 if _SIX and (M - full6 == 3 or M - full6 == 5) else 0  # rows for a 3- or 5-row tile
    full = M if odd else full6 + (M - full6) // 4 * 4
    for p in range(ITEM_PANELS):
        for lane0 in range(0, LANES, LANES // 2):
            for m0 in range(0, full6, 6):
                _tile_6x1h(x, m0, panels, p0 + p, lane0, scratch, p * PANEL_COLS)
            if odd == 3:
                _tile_3x1h(x, full6, panels, p0 + p, lane0, scratch, p * PANEL_COLS)
            elif odd == 5:
                _tile_5x1h(x, full6, panels, p0 + p, lane0, scratch, p * PANEL_COLS)
            else:
                for m0 in range(full6, full, 4):
                    _tile_4x1h(x, m0, panels, p0 + p, lane0, scratch, p * PANEL_COLS)
    m0 = full
    if M - m0 >= 2:
        for lane0 in range(0, LANES, LANES // 2):
            for p in range(0, ITEM_PANELS, 2):
                _tile_2x2h(x, m0, panels, p0 + p, lane0, scratch, p * PANEL_COLS)
        m0 += 2
    if M - m0 == 1:
        if _SIX:
            _tile_1x2(x, m0, panels, p0, 0, scratch, 0)
            _tile_1x2(x, m0, panels, p0 + 2, 0, scratch, 2 * PANEL_COLS)
        else:
            for lane0 in range(0, LANES, LANES // 2):
                _tile_1x4h(x, m0, panels, p0, lane0, scratch, 0)


_item_tiles = _item_wide if WIDE else _item_narrow


@njit(inline="always")
def _item(x, panels, y, b):
    """Output columns b*128 .. b*128+127 (panels 4b..4b+3) for every row of x; y [M, N]."""
    M = x.shape[0]
    N = y.shape[1]
    scratch = np.empty((M, ITEM_COLS), np.float32)  # [M, 128] the item's padded columns
    _item_tiles(x, panels, scratch, b * ITEM_PANELS)
    n0 = b * ITEM_COLS
    for r in range(M):
        for j in range(min(ITEM_COLS, N - n0)):
            y[r, n0 + j] = scratch[r, j]


@njit(parallel=True, cache=True, nogil=True)
def _gemv_panels_par(x, panels, y):
    for b in prange(panels.shape[0] // ITEM_PANELS):
        _item(x, panels, y, b)


@njit(cache=True, nogil=True)
def _gemv_panels_ser(x, panels, y):
    for b in range(panels.shape[0] // ITEM_PANELS):
        _item(x, panels, y, b)


@njit(inline="always")
def gemv_panels(x, panels, y, parallel):
    """y [M, N] = x [M, K] @ w.T from w's panels [NP, K, 32]; all C-contiguous. Callable from
    numba code (kernels/fused.py) and, through `linear_packed`, from Python."""
    if parallel:
        _gemv_panels_par(x, panels, y)
    else:
        _gemv_panels_ser(x, panels, y)


def check_panels(x: np.ndarray, panels: np.ndarray, N: int) -> None:
    if panels.ndim != 3 or panels.shape[1] != x.shape[1] or panels.shape[2] != PANEL_COLS \
            or panels.shape[0] % ITEM_PANELS or panels.shape[0] * PANEL_COLS < N:
        raise ValueError(f"gemv_panels: panels {list(panels.shape)} for x {list(x.shape)} and {N} outputs")
