"""The inner loops of the block attention (kernels/attention.py) written in LLVM IR: 16-lane
fused multiply-adds where numba's loops give 8-lane multiplies and adds, a horizontal sum per
key and a memory round trip of the accumulator per key (docs/long_context.md, section 4).

    scores16_ir(q, i, h, k, kvh, t0, scale, s, si, sh, c0, lo, hi, vis, mx)
        s[si, sh, c0 + j] = (q[i, h] . k[kvh, t0 + c0 + j]) * scale     for the 16 keys j of a chunk
        mx[si, sh, j] = max(mx[si, sh, j], that score) where c0 + j in [lo, hi) and vis[si, c0 + j]
    scores_ir(q, i, h, k, kvh, t0, scale, s, si, sh, lo, hi, vis, mx)
        the same key by key for t in [lo, hi) (a chunk that runs past the rows of k), the max
        in mx[si, sh, 0]
    prefetch_rows_ir(a, i0, r0, r1)
        a hint: the 64-byte lines of rows r0 .. min(r1, rows) - 1 of a[i0] (a 3-D C array) into L1
    pv_chunk_ir(s, si, sh, vis, v, kvh, t0, c0, lo, hi, mx, lacc, pacc, b, i, h, bf16_probs)
        w_j = exp(s[si, sh, c0 + j] - mx) where c0 + j in [lo, hi) and vis, else 0
        lacc[si, sh, j] += w_j;  pacc[b, i, h, :] += sum_j w'_j * v[kvh, t0 + c0 + j, :]
        (w' = w rounded to bf16, nearest even, when bf16_probs)

q, s, pacc f32; k, v f32 or uint16 bf16 bits (a `--kv-dtype bf16` cache, widened exactly as
they are loaded); vis bool; all C-contiguous; hd (the last axis) a multiple of 16
(`supported(hd)`; other head sizes take the numba loops).

Every key's score is the same fixed sequence whatever the chunk, the rows or the heads computed
beside it: lane-wise FMAs over hd in 16-column chunks in column order, then a fixed tree over
the 16 lanes (8 + 8, 4 + 4, 2 + 2, 1 + 1), then the scale. `scores16_ir` runs the 16 trees of a
chunk as one transpose-and-add network (the same adds), `scores_ir` key by key: the same bits.
Every (row, head)'s weighted sum of V runs over its keys of a chunk in key order in two
interleaved chains, one FMA per column. So a row's bits depend on its query, its keys and its
visible range only, not on the other rows of a block nor on the threads (the row invariance of
kernels/attention.py), and `llvm.fma` rounds once on every instruction-set path (AVX-512, AVX2,
generic), and the exp is written operation by operation, so the bits are the same on all of them.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16  # f32 lanes per vector: one zmm, two ymm on AVX2 (LLVM splits it, same bits)
BLOCK = 4  # vectors of V columns accumulated in registers per pass over the keys (64 columns)
KEYS = 4  # keys whose scores are computed together (independent chains that overlap)


def supported(hd: int) -> bool:
    return hd % LANES == 0


def _f32_ptr(builder, ptr):
    return builder.bitcast(ptr, ir.FloatType().as_pointer())


def _load_f32x16(builder, ptr, is_bf16):
    """<16 x float> from 16 consecutive elements at ptr (f32, or bf16 bits widened exactly)."""
    f32, i16, i32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)
    vf = ir.VectorType(f32, LANES)
    if is_bf16:
        raw = builder.load(builder.bitcast(ptr, ir.VectorType(i16, LANES).as_pointer()), align=2)
        wide = builder.shl(builder.zext(raw, ir.VectorType(i32, LANES)),
                           ir.Constant(ir.VectorType(i32, LANES), [16] * LANES))
        return builder.bitcast(wide, vf)
    return builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4)


def _splat(builder, x):
    vf = ir.VectorType(ir.FloatType(), LANES)
    one = builder.insert_element(ir.Constant(vf, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vf, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


def _hsum(builder, acc):
    """The 16 lanes summed in a fixed tree: (lanes 0-7) + (8-15), then halves again."""
    n = LANES
    while n > 1:
        n //= 2
        mask = lambda off: ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(off, off + n)))  # noqa: E731
        acc = builder.fadd(builder.shuffle_vector(acc, acc, mask(0)), builder.shuffle_vector(acc, acc, mask(n)))
    return builder.extract_element(acc, ir.Constant(ir.IntType(32), 0))


def _fma(builder):
    vf = ir.VectorType(ir.FloatType(), LANES)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                          f"llvm.fma.v{LANES}f32")


def _visible_at(builder, visp, t):
    """i1: vis[t] != 0 (visp: the row's bool bytes)."""
    return builder.icmp_unsigned("!=", builder.load(builder.gep(visp, [t])), ir.Constant(visp.type.pointee, 0))


def _c3(a):
    return isinstance(a, types.Array) and a.ndim == 3 and a.layout == "C"


def _c2(a):
    return isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C"


def _score_types(q, k, s, vis, mx) -> bool:
    """The score kernels' array types: q, s, mx f32 3-D, k f32 or bf16 bits 3-D, vis bool 2-D, C layout."""
    return (_c3(q) and _c3(k) and _c3(s) and q.dtype == types.float32 and s.dtype == types.float32
            and k.dtype in (types.float32, types.uint16) and _c2(vis) and vis.dtype == types.boolean
            and _c3(mx) and mx.dtype == types.float32)


def _score_pointers(context, builder, signature, pos, arrays, i_, h_, si_, sh_, t):
    """hd, hd / 16 and the pointers of the score kernels: &q[i, h, 0], &s[si, sh, t],
    &vis[si, t], &mx[si, sh, 0] (pos: the argument positions of q, s, vis, mx)."""
    qa, sa, visa, mxa = arrays
    zero = ir.Constant(context.get_value_type(types.intp), 0)
    hd = cgutils.unpack_tuple(builder, qa.shape, 3)[2]
    nchunks = builder.sdiv(hd, ir.Constant(hd.type, LANES))
    ptr = lambda j, a, idx: cgutils.get_item_pointer(context, builder, signature.args[pos[j]], a, idx)  # noqa: E731
    return (hd, nchunks, _f32_ptr(builder, ptr(0, qa, [i_, h_, zero])), _f32_ptr(builder, ptr(1, sa, [si_, sh_, t])),
            ptr(2, visa, [si_, t]), ptr(3, mxa, [si_, sh_, zero]))


@intrinsic
def scores_ir(typingctx, q, i, h, k, kvh, t0, scale, s, si, sh, lo, hi, vis, mx):
    if not _score_types(q, k, s, vis, mx):
        return None
    is_bf16 = k.dtype == types.uint16
    sig = types.void(q, types.intp, types.intp, k, types.intp, types.intp, types.float32, s, types.intp,
                     types.intp, types.intp, types.intp, vis, mx)

    def codegen(context, builder, signature, args):
        qa, ka, sa, visa, mxa = (context.make_array(signature.args[j])(context, builder, args[j])
                                 for j in (0, 3, 7, 12, 13))
        i_, h_, kvh_, t0_, scale_, si_, sh_, lo_, hi_ = (args[j] for j in (1, 2, 4, 5, 6, 8, 9, 10, 11))
        intp = context.get_value_type(types.intp)
        zero = ir.Constant(intp, 0)
        hd, nchunks, qp, sp, visp, mxp = _score_pointers(context, builder, signature, (0, 7, 12, 13),
                                                         (qa, sa, visa, mxa), i_, h_, si_, sh_, zero)
        fma = _fma(builder)
        vf = ir.VectorType(ir.FloatType(), LANES)
        slots = [cgutils.alloca_once(builder, vf) for _ in range(KEYS)]
        m_slot = cgutils.alloca_once(builder, ir.FloatType())
        builder.store(builder.load(mxp), m_slot)

        def visible_max(t, x):
            """m = max(m, x) when key t is visible (a select: no branch)."""
            seen = _visible_at(builder, visp, t)
            m = builder.load(m_slot)
            builder.store(builder.select(builder.and_(seen, builder.fcmp_ordered(">", x, m)), x, m), m_slot)

        def keys(t, m):
            """Scores of keys t .. t + m - 1: m independent FMA chains (each key's arithmetic is the
            same whatever m: grouping only lets the chains overlap)."""
            kps = [cgutils.get_item_pointer(context, builder, signature.args[3], ka,
                                            [kvh_, builder.add(t0_, builder.add(t, ir.Constant(intp, r))), zero])
                   for r in range(m)]
            for slot in slots[:m]:
                builder.store(ir.Constant(vf, None), slot)
            with cgutils.for_range(builder, nchunks) as chunk:
                off = builder.mul(chunk.index, ir.Constant(intp, LANES))
                qv = builder.load(builder.bitcast(builder.gep(qp, [off]), vf.as_pointer()), align=4)
                for kp, slot in zip(kps, slots):
                    kv = _load_f32x16(builder, builder.gep(kp, [off]), is_bf16)
                    builder.store(builder.call(fma, [qv, kv, builder.load(slot)]), slot)
            for r, slot in enumerate(slots[:m]):
                x = builder.fmul(_hsum(builder, builder.load(slot)), scale_)
                tr = builder.add(t, ir.Constant(intp, r))
                builder.store(x, builder.gep(sp, [tr]))
                visible_max(tr, x)

        n = builder.sub(hi_, lo_)
        groups = builder.sdiv(n, ir.Constant(intp, KEYS))
        with cgutils.for_range(builder, groups) as g:
            keys(builder.add(lo_, builder.mul(g.index, ir.Constant(intp, KEYS))), KEYS)
        with cgutils.for_range(builder, builder.sub(n, builder.mul(groups, ir.Constant(intp, KEYS)))) as r:
            keys(builder.add(lo_, builder.add(builder.mul(groups, ir.Constant(intp, KEYS)), r.index)), 1)
        builder.store(builder.load(m_slot), mxp)
        return context.get_dummy_value()

    return sig, codegen


def _combine(builder, a, b, width):
    """One level of the 16-lane tree for several keys at once. a and b each hold keys in groups
    of 2 * width lanes; the result holds each key's (first width lanes) + (next width lanes), a's
    keys then b's: the same adds, in the same tree, as `_hsum` does key by key."""
    lo, hi = [], []
    for src in (0, LANES):  # a's lanes, then b's
        for g0 in range(0, LANES, 2 * width):
            lo += [src + g0 + j for j in range(width)]
            hi += [src + g0 + width + j for j in range(width)]
    mask = lambda idx: ir.Constant(ir.VectorType(ir.IntType(32), LANES), idx)  # noqa: E731
    return builder.fadd(builder.shuffle_vector(a, b, mask(lo)), builder.shuffle_vector(a, b, mask(hi)))


def _counts(builder, c0, lo, hi, visp):
    """<16 x i1>: key c0 + j counts for the row: c0 + j in [lo, hi) and vis (the bytes at visp)."""
    i32 = ir.IntType(32)
    vi = ir.VectorType(i32, LANES)
    lane = builder.add(ir.Constant(vi, list(range(LANES))), _splat_i32(builder, builder.trunc(c0, i32)))
    inside = builder.and_(builder.icmp_signed(">=", lane, _splat_i32(builder, builder.trunc(lo, i32))),
                          builder.icmp_signed("<", lane, _splat_i32(builder, builder.trunc(hi, i32))))
    vb = ir.VectorType(visp.type.pointee, LANES)
    seen = builder.icmp_unsigned("!=", builder.load(builder.bitcast(visp, vb.as_pointer()), align=1), ir.Constant(vb, None))
    return builder.and_(inside, seen)


def _store_and_max(builder, f, sp, visp, mxp, c0, lo, hi):
    """Store the 16 scores f at sp and raise the running max of each lane (16 floats at mxp) by
    the lanes that count: c0 + j in [lo, hi), vis (bytes at visp), not NaN. The caller takes the
    max over the 16 lanes at the end (a max is exact in any order)."""
    f32 = ir.FloatType()
    vf = ir.VectorType(f32, LANES)
    builder.store(f, builder.bitcast(sp, vf.as_pointer()), align=4)
    ok = builder.and_(_counts(builder, c0, lo, hi, visp), builder.fcmp_ordered("==", f, f))
    m = builder.select(ok, f, _splat(builder, ir.Constant(f32, float("-inf"))))
    mp = builder.bitcast(mxp, vf.as_pointer())
    old = builder.load(mp, align=4)
    builder.store(builder.select(builder.fcmp_ordered(">", m, old), m, old), mp, align=4)


@intrinsic
def scores16_ir(typingctx, q, i, h, k, kvh, t0, scale, s, si, sh, c0, lo, hi, vis, mx):
    """The scores of the 16 keys t0 + c0 .. t0 + c0 + 15 (all readable rows of k) into
    s[si, sh, c0:c0 + 16] (s and vis padded to a multiple of 16 keys), and mx[si, sh, j] raised to
    the max of those with c0 + j in [lo, hi) and vis[si, c0 + j]. Each key's score has the bits
    of `scores_ir`'s (the same FMA chain over hd and the same lane tree), but the 16 trees run
    as one transpose-and-add network: 15 vector adds instead of 60 for 16 horizontal sums."""
    if not _score_types(q, k, s, vis, mx):
        return None
    is_bf16 = k.dtype == types.uint16
    sig = types.void(q, types.intp, types.intp, k, types.intp, types.intp, types.float32, s, types.intp,
                     types.intp, types.intp, types.intp, types.intp, vis, mx)

    def codegen(context, builder, signature, args):
        qa, ka, sa, visa, mxa = (context.make_array(signature.args[j])(context, builder, args[j])
                                 for j in (0, 3, 7, 13, 14))
        i_, h_, kvh_, t0_, scale_, si_, sh_, c0_, lo_, hi_ = (args[j] for j in (1, 2, 4, 5, 6, 8, 9, 10, 11, 12))
        intp = context.get_value_type(types.intp)
        f32 = ir.FloatType()
        vf = ir.VectorType(f32, LANES)
        zero = ir.Constant(intp, 0)
        hd, nchunks, qp, sp, visp, mxp = _score_pointers(context, builder, signature, (0, 7, 13, 14),
                                                         (qa, sa, visa, mxa), i_, h_, si_, sh_, c0_)
        fma = _fma(builder)
        half = LANES // 2
        slots = [cgutils.alloca_once(builder, vf) for _ in range(half)]

        kbase = cgutils.get_item_pointer(context, builder, signature.args[3], ka,
                                         [kvh_, builder.add(t0_, c0_), zero])  # k[kvh, t0 + c0, 0]

        def eight_keys(r0, hd_const):
            """Keys r0 .. r0 + 7: 8 independent FMA chains over hd, then three levels of the
            tree: one vector of 8 keys x 2 lanes. hd_const: hd known here (constant offsets from
            one pointer, the chunk loop unrolled), else None (a loop over hd's chunks)."""
            row = ir.Constant(intp, hd_const) if hd_const else hd  # C layout: key rows hd apart
            kps = [builder.gep(kbase, [builder.mul(row, ir.Constant(intp, r0 + r))]) for r in range(half)]
            for slot in slots:
                builder.store(ir.Constant(vf, None), slot)

            def chunk(off):
                qv = builder.load(builder.bitcast(builder.gep(qp, [off]), vf.as_pointer()), align=4)
                for kp, slot in zip(kps, slots):
                    kv = _load_f32x16(builder, builder.gep(kp, [off]), is_bf16)
                    builder.store(builder.call(fma, [qv, kv, builder.load(slot)]), slot)
            if hd_const:
                for c in range(hd_const // LANES):
                    chunk(ir.Constant(intp, c * LANES))
            else:
                with cgutils.for_range(builder, nchunks) as loop:
                    chunk(builder.mul(loop.index, ir.Constant(intp, LANES)))
            x = [builder.load(slot) for slot in slots]
            width = half
            while len(x) > 1:  # widths 8, 4, 2: pairs of neighbours, keys kept in order
                x = [_combine(builder, x[j], x[j + 1], width) for j in range(0, len(x), 2)]
                width //= 2
            return x[0]

        f_slot = cgutils.alloca_once(builder, vf)

        def sixteen_keys(hd_const):
            first = eight_keys(0, hd_const)
            builder.store(_combine(builder, first, eight_keys(half, hd_const), 1), f_slot)  # 16 keys in order
        _by_head_size(builder, hd, sixteen_keys)
        _store_and_max(builder, builder.fmul(builder.load(f_slot), _splat(builder, scale_)), sp, visp, mxp,
                       c0_, lo_, hi_)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_rows_ir(typingctx, a, i0, r0, r1):
    """Prefetch into L1 the lines of rows [r0, min(r1, rows)) of a[i0] (a [n, rows, m] C array):
    one `llvm.prefetch` per 64 bytes. A hint, so nothing computed changes; no line past the
    array is named (r1 is clamped) and an empty range issues nothing."""
    if not (isinstance(a, types.Array) and a.ndim == 3 and a.layout == "C"):
        return None
    sig = types.void(a, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        i0, r0, r1 = args[1], args[2], args[3]
        intp = context.get_value_type(types.intp)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        _, rows, m = cgutils.unpack_tuple(builder, arr.shape, 3)
        r1 = builder.select(builder.icmp_signed("<", r1, rows), r1, rows)
        start = builder.bitcast(cgutils.get_item_pointer(context, builder, signature.args[0], arr,
                                                         [i0, r0, ir.Constant(intp, 0)]), i8p)
        item = ir.Constant(intp, context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype)))
        nbytes = builder.mul(builder.mul(builder.sub(r1, r0), m), item)
        lines = builder.sdiv(builder.add(nbytes, ir.Constant(intp, 63)), ir.Constant(intp, 64))
        prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                  "llvm.prefetch.p0i8")
        with cgutils.for_range(builder, lines) as loop:  # no trips when r1 <= r0
            ptr = builder.gep(start, [builder.mul(loop.index, ir.Constant(intp, 64))])
            builder.call(prefetch, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


HEAD_SIZES = (64, 128)  # compiled with hd as a constant; other multiples of 16 take a loop


def _by_head_size(builder, hd, emit):
    """emit(hd_const) under a branch per HEAD_SIZES entry, emit(None) for any other hd: the same
    arithmetic either way, only the addressing and the unrolling differ."""
    done = builder.append_basic_block("hd_done")
    for size in HEAD_SIZES:
        here, other = builder.append_basic_block(f"hd_{size}"), builder.append_basic_block(f"hd_not_{size}")
        builder.cbranch(builder.icmp_signed("==", hd, ir.Constant(hd.type, size)), here, other)
        builder.position_at_end(here)
        emit(size)
        builder.branch(done)
        builder.position_at_end(other)
    emit(None)
    builder.branch(done)
    builder.position_at_end(done)


def _splat_i32(builder, x):
    vi = ir.VectorType(ir.IntType(32), LANES)
    one = builder.insert_element(ir.Constant(vi, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vi, ir.Undefined), ir.Constant(vi, [0] * LANES))


def _round_bf16_vec(builder, w):
    """<16 x float> rounded to bf16 (nearest even), as `pv_ir`'s weight() does per key."""
    i32 = ir.IntType(32)
    vi = ir.VectorType(i32, LANES)
    bits = builder.bitcast(w, vi)
    c = lambda x: ir.Constant(vi, [x] * LANES)  # noqa: E731
    lsb = builder.and_(builder.lshr(bits, c(16)), c(1))
    return builder.bitcast(builder.and_(builder.add(builder.add(bits, c(0x7FFF)), lsb), c(-65536)),
                           ir.VectorType(ir.FloatType(), LANES))


def _exp_vec(builder, x):
    """exp(x) for x <= 0, 16 lanes: the Cephes expf of attention._exp_f32, operation for operation
    (separate multiplies and adds, so the lanes have the bits of the scalar version)."""
    f32, i32 = ir.FloatType(), ir.IntType(32)
    vf, vi = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)
    c = lambda v: ir.Constant(vf, [v] * LANES)  # noqa: E731
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.floor.v{LANES}f32")
    x = builder.select(builder.fcmp_ordered(">", x, c(-87.0)), x, c(-87.0))
    n = builder.call(floor, [builder.fadd(builder.fmul(x, c(1.44269504088896341)), c(0.5))])
    r = builder.fsub(x, builder.fmul(n, c(0.693359375)))
    r = builder.fsub(r, builder.fmul(n, c(-2.12194440e-4)))
    p = c(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.fadd(builder.fmul(p, r), c(coef))
    p = builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), c(1.0))
    two_n = builder.shl(builder.add(builder.fptosi(n, vi), ir.Constant(vi, [127] * LANES)), ir.Constant(vi, [23] * LANES))
    return builder.fmul(p, builder.bitcast(two_n, vf))


@intrinsic
def pv_chunk_ir(typingctx, s, si, sh, vis, v, kvh, t0, c0, lo, hi, mx, lacc, pacc, b, i, h, bf16_probs):
    """One (row, head) over the keys c0 + j, j < 16, of a chunk, of which [lo, hi) (a sub-range of
    the chunk, non-empty) lie in the row's visible range:
        w_j = exp(s[si, sh, c0 + j] - mx) for c0 + j in [lo, hi) and vis[si, c0 + j], else 0
        lacc[si, sh, :] += w                (the weights' sum, lane j = key j; summed later)
        pacc[b, i, h, :] += sum over c0 + j in [lo, hi) of w'_j * v[kvh, t0 + c0 + j, :]
    with w' = w rounded to bf16 (nearest even) when bf16_probs. The 16 weights are one vector
    (the exp, the mask, the rounding); the keys run in key order in two interleaved chains (even
    and odd offsets from lo), one FMA per column, unrolled when the chunk is whole. A row's bits
    depend on its [lo, hi) per chunk and its max only: the rows of a block and the one-row step at
    the same position compute the same sequence."""
    if not (_c3(s) and _c3(v) and _c2(vis) and _c3(lacc) and isinstance(pacc, types.Array) and pacc.ndim == 4
            and pacc.layout == "C" and s.dtype == types.float32 and pacc.dtype == types.float32
            and lacc.dtype == types.float32 and vis.dtype == types.boolean and v.dtype in (types.float32, types.uint16)):
        return None
    is_bf16 = v.dtype == types.uint16
    sig = types.void(s, types.intp, types.intp, vis, v, types.intp, types.intp, types.intp, types.intp, types.intp,
                     types.float32, lacc, pacc, types.intp, types.intp, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        sa, visa, va, la, pa = (context.make_array(signature.args[j])(context, builder, args[j])
                                for j in (0, 3, 4, 11, 12))
        si_, sh_, kvh_, t0_, c0_, lo_, hi_, mx_, b_, i_, h_, round_ = (args[j] for j in (1, 2, 5, 6, 7, 8, 9, 10,
                                                                                             13, 14, 15, 16))
        i32, f32 = ir.IntType(32), ir.FloatType()
        intp = context.get_value_type(types.intp)
        vf, vi = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)
        zero = ir.Constant(intp, 0)
        hd = cgutils.unpack_tuple(builder, va.shape, 3)[2]
        sp = _f32_ptr(builder, cgutils.get_item_pointer(context, builder, signature.args[0], sa, [si_, sh_, c0_]))
        visp = cgutils.get_item_pointer(context, builder, signature.args[3], visa, [si_, c0_])
        lp = builder.bitcast(cgutils.get_item_pointer(context, builder, signature.args[11], la, [si_, sh_, zero]),
                             vf.as_pointer())
        op = _f32_ptr(builder, cgutils.get_item_pointer(context, builder, signature.args[12], pa, [b_, i_, h_, zero]))
        vbase = cgutils.get_item_pointer(context, builder, signature.args[4], va, [kvh_, builder.add(t0_, c0_), zero])
        fma = _fma(builder)
        # the 16 weights: exp(s - mx) where the key counts, else 0
        w = _exp_vec(builder, builder.fsub(builder.load(builder.bitcast(sp, vf.as_pointer()), align=4),
                                           _splat(builder, mx_)))
        w = builder.select(_counts(builder, c0_, lo_, hi_, visp), w, ir.Constant(vf, None))
        builder.store(builder.fadd(builder.load(lp, align=4), w), lp, align=4)
        w = builder.select(round_, _round_bf16_vec(builder, w), w)
        wbuf = cgutils.alloca_once(builder, vf)  # the weights, for a partial chunk's loop over its keys
        builder.store(w, wbuf)
        wp = builder.bitcast(wbuf, f32.as_pointer())
        lanes = [builder.shuffle_vector(w, w, ir.Constant(vi, [j] * LANES)) for j in range(LANES)]  # whole chunk
        whole = builder.icmp_signed("==", builder.sub(hi_, lo_), ir.Constant(intp, LANES))

        def columns(col, nvec, hd_const, unrolled):
            """Columns col .. col + 16 nvec - 1: the keys in two chains (even / odd offsets from lo),
            nvec accumulators each, then even + odd is added to pacc."""
            row = ir.Constant(intp, hd_const) if hd_const else hd
            slots = [cgutils.alloca_once(builder, vf) for _ in range(2 * nvec)]
            for slot in slots:
                builder.store(ir.Constant(vf, None), slot)

            def key(j, chain, wj=None):  # j: the key's index in the chunk (intp value); wj: its weight splat
                if wj is None:  # a broadcast from the stack copy (a partial chunk)
                    wj = _splat(builder, builder.load(builder.gep(wp, [j])))
                vp = builder.gep(vbase, [builder.add(builder.mul(row, j), col)])
                for c, slot in enumerate(chain):
                    vv = _load_f32x16(builder, builder.gep(vp, [ir.Constant(intp, c * LANES)]), is_bf16)
                    builder.store(builder.call(fma, [wj, vv, builder.load(slot)]), slot)
            even, odd = slots[:nvec], slots[nvec:]
            if unrolled:
                for j in range(LANES):  # weights broadcast from the register (a stack reload of a
                    key(ir.Constant(intp, j), even if j % 2 == 0 else odd, lanes[j])  # just-stored vector stalls)
            else:
                j0 = builder.sub(lo_, c0_)
                n = builder.sub(hi_, lo_)
                pairs = builder.sdiv(n, ir.Constant(intp, 2))
                with cgutils.for_range(builder, pairs) as loop:
                    j = builder.add(j0, builder.mul(loop.index, ir.Constant(intp, 2)))
                    key(j, even)
                    key(builder.add(j, ir.Constant(intp, 1)), odd)
                with builder.if_then(builder.icmp_signed("!=", builder.mul(pairs, ir.Constant(intp, 2)), n)):
                    key(builder.sub(builder.sub(hi_, c0_), ir.Constant(intp, 1)), even)
            for c in range(nvec):
                dst = builder.bitcast(builder.gep(op, [builder.add(col, ir.Constant(intp, c * LANES))]), vf.as_pointer())
                part = builder.fadd(builder.load(even[c]), builder.load(odd[c]))
                builder.store(builder.fadd(builder.load(dst, align=4), part), dst, align=4)

        def emit(hd_const, unrolled):
            if hd_const:
                for col in range(0, hd_const, BLOCK * LANES):
                    columns(ir.Constant(intp, col), min(BLOCK, (hd_const - col) // LANES), hd_const, unrolled)
                return
            width = ir.Constant(intp, BLOCK * LANES)
            nblocks = builder.sdiv(hd, width)
            with cgutils.for_range(builder, nblocks) as blk:
                columns(builder.mul(blk.index, width), BLOCK, None, unrolled)
            col = builder.mul(nblocks, width)
            rest = builder.sdiv(builder.sub(hd, col), ir.Constant(intp, LANES))  # 0..BLOCK-1 vectors left
            for nvec in range(1, BLOCK):
                with builder.if_then(builder.icmp_signed("==", rest, ir.Constant(intp, nvec))):
                    columns(col, nvec, None, unrolled)
        with builder.if_else(whole) as (then, otherwise):
            with then:
                _by_head_size(builder, hd, lambda hc: emit(hc, True))
            with otherwise:
                _by_head_size(builder, hd, lambda hc: emit(hc, False))
        return context.get_dummy_value()

    return sig, codegen
