"""The inner loops of the block attention (kernels/attention.py) written in LLVM IR: 16-lane
fused multiply-adds where numba's loops give 8-lane multiplies and adds, a horizontal sum per
key and a memory round trip of the accumulator per key (docs/long_context.md, section 4).

    scores_ir(q, i, h, k, kvh, t0, scale, s, si, sh, lo, hi, vis, mx)
        s[si, sh, t] = (q[i, h] . k[kvh, t0 + t]) * scale          for t in [lo, hi)
        mx[si, sh] = max(mx[si, sh], the s[si, sh, t] with vis[si, t])   (exact in any order)
    pv_ir(s, si, sh, vis, v, kvh, t0, lo, hi, pacc, b, i, h, bf16_probs)
        pacc[b, i, h, :] += sum over t in [lo, hi) with vis[si, t] of w_t * v[kvh, t0 + t, :]
        with w_t = s[si, sh, t], rounded to bf16 (nearest even) when bf16_probs
        (the keys in order, one FMA per key and column: a (row, head) that walks its keys in
        several calls over consecutive ranges gets the bits of one call over all of them)

q, s, pacc f32; k, v f32 or uint16 bf16 bits (a `--kv-dtype bf16` cache, widened exactly as
they are loaded); vis bool; all C-contiguous; hd (the last axis) a multiple of 16
(`supported(hd)`; other head sizes take the numba loops).

Every key's score is the same fixed sequence whatever [lo, hi) holds: lane-wise FMAs over hd in
16-column chunks in column order, then a fixed tree over the 16 lanes (8 + 8, 4 + 4, 2 + 2,
1 + 1), then the scale. Every (row, head)'s weighted sum of V runs over its visible keys in key
order, one FMA per column. So a row's bits depend on its query, its keys and its visible range
only, not on the other rows of a block nor on the threads (the row invariance of
kernels/attention.py), and `llvm.fma` rounds once on every instruction-set path (AVX-512, AVX2,
generic), so the bits are the same on all of them.
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


@intrinsic
def scores_ir(typingctx, q, i, h, k, kvh, t0, scale, s, si, sh, lo, hi, vis, mx):
    if not (_c3(q) and _c3(k) and _c3(s) and q.dtype == types.float32 and s.dtype == types.float32
            and k.dtype in (types.float32, types.uint16) and _c2(vis) and vis.dtype == types.boolean
            and _c2(mx) and mx.dtype == types.float32):
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
        hd = cgutils.unpack_tuple(builder, qa.shape, 3)[2]
        nchunks = builder.sdiv(hd, ir.Constant(intp, LANES))
        qp = _f32_ptr(builder, cgutils.get_item_pointer(context, builder, signature.args[0], qa, [i_, h_, zero]))
        sp = _f32_ptr(builder, cgutils.get_item_pointer(context, builder, signature.args[7], sa, [si_, sh_, zero]))
        visp = cgutils.get_item_pointer(context, builder, signature.args[12], visa, [si_, zero])
        mxp = cgutils.get_item_pointer(context, builder, signature.args[13], mxa, [si_, sh_])
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


@intrinsic
def pv_ir(typingctx, s, si, sh, vis, v, kvh, t0, lo, hi, pacc, b, i, h, bf16_probs):
    if not (_c3(s) and _c3(v) and _c2(vis) and isinstance(pacc, types.Array) and pacc.ndim == 4 and pacc.layout == "C"
            and s.dtype == types.float32 and pacc.dtype == types.float32
            and vis.dtype == types.boolean and v.dtype in (types.float32, types.uint16)):
        return None
    is_bf16 = v.dtype == types.uint16
    sig = types.void(s, types.intp, types.intp, vis, v, types.intp, types.intp, types.intp, types.intp, pacc,
                     types.intp, types.intp, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        sa, visa, va, pa = (context.make_array(signature.args[j])(context, builder, args[j]) for j in (0, 3, 4, 9))
        si_, sh_, kvh_, t0_, lo_, hi_, b_, i_, h_, round_ = (args[j] for j in (1, 2, 5, 6, 7, 8, 10, 11, 12, 13))
        i32 = ir.IntType(32)
        intp = context.get_value_type(types.intp)
        zero = ir.Constant(intp, 0)
        hd = cgutils.unpack_tuple(builder, va.shape, 3)[2]
        sp = _f32_ptr(builder, cgutils.get_item_pointer(context, builder, signature.args[0], sa, [si_, sh_, zero]))
        visp = cgutils.get_item_pointer(context, builder, signature.args[3], visa, [si_, zero])
        op = _f32_ptr(builder, cgutils.get_item_pointer(context, builder, signature.args[9], pa, [b_, i_, h_, zero]))
        fma = _fma(builder)
        vf = ir.VectorType(ir.FloatType(), LANES)
        slots = [cgutils.alloca_once(builder, vf) for _ in range(2 * BLOCK)]  # two chains

        def weight(t):
            """s[si, sh, t], rounded to bf16 (nearest even; weights are in [0, 1], never NaN) when round_."""
            w = builder.load(builder.gep(sp, [t]))
            bits = builder.bitcast(w, i32)
            lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
            rounded = builder.and_(builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), lsb),
                                   ir.Constant(i32, 0xFFFF0000))
            return builder.select(round_, builder.bitcast(rounded, ir.FloatType()), w)

        def columns(c0, nvec):
            """Columns c0 .. c0 + 16 nvec - 1: the keys in two interleaved chains (even and odd
            offsets from lo), nvec accumulators each, held in registers; then even + odd is added
            to the running sums of earlier calls."""
            even, odd = slots[:nvec], slots[BLOCK:BLOCK + nvec]
            for slot in even + odd:
                builder.store(ir.Constant(vf, None), slot)
            n = builder.sub(hi_, lo_)

            def key(t, chain):
                seen = _visible_at(builder, visp, t)
                with builder.if_then(seen, likely=True):
                    w = _splat(builder, weight(t))
                    vp = cgutils.get_item_pointer(context, builder, signature.args[4], va,
                                                  [kvh_, builder.add(t0_, t), c0])
                    for j, slot in enumerate(chain):
                        vv = _load_f32x16(builder, builder.gep(vp, [ir.Constant(intp, j * LANES)]), is_bf16)
                        builder.store(builder.call(fma, [w, vv, builder.load(slot)]), slot)

            pairs = builder.sdiv(n, ir.Constant(intp, 2))
            with cgutils.for_range(builder, pairs) as loop:
                t = builder.add(lo_, builder.mul(loop.index, ir.Constant(intp, 2)))
                key(t, even)
                key(builder.add(t, ir.Constant(intp, 1)), odd)
            with builder.if_then(builder.icmp_signed("!=", builder.mul(pairs, ir.Constant(intp, 2)), n)):
                key(builder.sub(hi_, ir.Constant(intp, 1)), even)
            for j in range(nvec):
                dst = builder.bitcast(builder.gep(op, [builder.add(c0, ir.Constant(intp, j * LANES))]), vf.as_pointer())
                part = builder.fadd(builder.load(even[j]), builder.load(odd[j]))
                builder.store(builder.fadd(builder.load(dst, align=4), part), dst, align=4)

        width = ir.Constant(intp, BLOCK * LANES)
        nblocks = builder.sdiv(hd, width)
        with cgutils.for_range(builder, nblocks) as blk:
            columns(builder.mul(blk.index, width), BLOCK)
        c = builder.mul(nblocks, width)
        rest = builder.sdiv(builder.sub(hd, c), ir.Constant(intp, LANES))  # 0..BLOCK-1 vectors left
        for nvec in range(1, BLOCK):
            with builder.if_then(builder.icmp_signed("==", rest, ir.Constant(intp, nvec))):
                columns(c, nvec)
        return context.get_dummy_value()

    return sig, codegen
