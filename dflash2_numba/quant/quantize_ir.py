"""The two vector halves of the q8_0 activation quantizer (quant/kernels_int8.quantize_rows) in
LLVM IR, for a whole 32-block of one row whose elements are contiguous:

    block_amax_ir(x, r, k0) -> max |x[r, k0 .. k0 + 31]| (f32, NaN ignored, >= 0)
    block_quantize_ir(x, r, k0, inv, xq) -> sum of q (int64)
        q_j = int8(rint(x[r, k0 + j] * inv)) stored at xq[r, k0 + j]

numba's scalar loops do neither as vectors (a max reduction without fast-math flags, and
np.rint per element): 1.1-1.6 ns an element on Zen 5, 1.7 ms of an 8-row verify of a
16-layer q8_0 model. Both are exact in any order (a max; a sum of integers), and the product
x * inv and the rounding (llvm.rint: the current mode, nearest even) are the scalar loop's
operations lane by lane, so the bits are those of the scalar code on every path
(tests/test_quant.py::test_activation_quantizer_matches_numpy checks both against it and numpy).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir_helpers import ir_fn, ir_splat

LANES = 32  # one q8_0 block


def _row_pointer(context, builder, sig_arg, arr, r, k0):
    """&x[r, k0] as float* (the caller has checked that a row's elements are contiguous)."""
    a = context.make_array(sig_arg)(context, builder, arr)
    return builder.bitcast(cgutils.get_item_pointer(context, builder, sig_arg, a, [r, k0]), ir.FloatType().as_pointer())


def _f32_rows(x) -> bool:
    return isinstance(x, types.Array) and x.ndim == 2 and x.dtype == types.float32


@intrinsic
def block_amax_ir(typingctx, x, r, k0):
    if not _f32_rows(x):
        return None
    sig = types.float32(x, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        vf = ir.VectorType(f32, LANES)
        ptr = _row_pointer(context, builder, signature.args[0], args[0], args[1], args[2])
        v = builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4)
        fabs = ir_fn(builder, f"llvm.fabs.v{LANES}f32", vf, [vf])
        vmax = ir_fn(builder, f"llvm.vector.reduce.fmax.v{LANES}f32", f32, [vf])
        maxnum = ir_fn(builder, "llvm.maxnum.f32", f32, [f32, f32])
        # maxnum semantics: a NaN lane loses to any number; all NaN -> NaN, then 0 wins
        return builder.call(maxnum, [builder.call(vmax, [builder.call(fabs, [v])]), ir.Constant(f32, 0.0)])

    return sig, codegen


@intrinsic
def block_quantize_ir(typingctx, x, r, k0, inv, xq):
    if not (_f32_rows(x) and isinstance(xq, types.Array) and xq.ndim == 2 and xq.dtype == types.int8):
        return None
    sig = types.int64(x, types.intp, types.intp, types.float32, xq)

    def codegen(context, builder, signature, args):
        f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
        vf, vi, vb = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES), ir.VectorType(i8, LANES)
        ptr = _row_pointer(context, builder, signature.args[0], args[0], args[1], args[2])
        v = builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4)
        rint = ir_fn(builder, f"llvm.rint.v{LANES}f32", vf, [vf])
        q = builder.fptosi(builder.call(rint, [builder.fmul(v, ir_splat(builder, args[3], vf))]), vi)  # |q| <= 127
        qa = context.make_array(signature.args[4])(context, builder, args[4])
        out = cgutils.get_item_pointer(context, builder, signature.args[4], qa, [args[1], args[2]])
        builder.store(builder.trunc(q, vb), builder.bitcast(out, vb.as_pointer()), align=1)
        total = ir_fn(builder, f"llvm.vector.reduce.add.v{LANES}i32", i32, [vi])
        return builder.sext(builder.call(total, [q]), i64)

    return sig, codegen
