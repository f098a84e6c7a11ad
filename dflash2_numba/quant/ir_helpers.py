"""LLVM IR helpers of the integer micro-kernels (quant/kernels_int8.py, quant/kernels_q4k.py):
declaring an intrinsic, splatting a scalar, summing a column's 4 products, fp16 -> f32."""

from llvmlite import ir
from numba.core import cgutils


def ir_fn(builder, name, ret, argtys):
    """Declare (once per module) and return the LLVM function `name`."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtys), name)


def ir_splat(builder, scalar, vty):
    """<n x T> of `scalar` in every lane."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count))


def ir_column_sums(builder, prod, V):
    """<4V x i32> products, 4 per column in a row -> <V x i32> each column's sum (generic path)."""
    undef = ir.Constant(prod.type, ir.Undefined)
    part = [builder.shuffle_vector(prod, undef, ir.Constant(ir.VectorType(ir.IntType(32), V),
                                                            [4 * i + j for i in range(V)])) for j in range(4)]
    return builder.add(builder.add(part[0], part[1]), builder.add(part[2], part[3]))


def ir_half_to_float(builder, h, vi, vf):
    """<V x i16> fp16 bits -> <V x float>, exact, in integer ops and one multiply: the magnitude
    bits shifted into an f32 are the value times 2^-112 (normal and subnormal fp16 alike), so
    times 2^112 is the value; then the sign. (LLVM's fpext from half needs F16C or a runtime
    call numba's JIT lacks; scales are never inf or NaN.)"""
    i32, f32 = ir.IntType(32), ir.FloatType()
    w = builder.zext(h, vi)
    mag = builder.shl(builder.and_(w, ir_splat(builder, ir.Constant(i32, 0x7FFF), vi)),
                      ir_splat(builder, ir.Constant(i32, 13), vi))
    sign = builder.shl(builder.and_(w, ir_splat(builder, ir.Constant(i32, 0x8000), vi)),
                       ir_splat(builder, ir.Constant(i32, 16), vi))
    val = builder.fmul(builder.bitcast(mag, vf), ir_splat(builder, ir.Constant(f32, 2.0 ** 112), vf))
    return builder.bitcast(builder.or_(builder.bitcast(val, vi), sign), vf)
