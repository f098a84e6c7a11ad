"""bf16 helpers and the dtype policy (spec §6).

bf16 is carried as `np.uint16` everywhere (numba rejects ml_dtypes.bfloat16). The scalar
helpers below are `@njit(inline="always")` so that CPU kernels and CUDA kernels (which can
call njit functions as device functions) share ONE definition of the rounding.

    bf16_to_f32(u16)  -> float32       exact (bf16 is the top half of an f32)
    f32_to_bf16(f32)  -> uint16        round-to-nearest-even, NaN stays NaN (quiet)
    round_bf16(f32)   -> float32       rnd(x) of the spec: f32 -> bf16 -> f32
    kv_f32(x)         -> float32       an element of a KV cache of either dtype (f32, or bf16 bits)
    kv_store(buf, x)  -> buf's dtype   an f32 value as an element of `buf` (bf16: rounded)

Vectorised numpy versions (`*_array`) serve the numpy reference paths and the loaders.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

# Run modes: "f32" computes in float32 from bf16 weights (default); "bf16" rounds
# activations to bf16 at every op boundary, as eager PyTorch does.
DTYPE_MODES = ("f32", "bf16")


# ------------------------------------------------------------------ bit casts (LLVM bitcast)
@intrinsic
def _f32_as_u32(typingctx, x):
    """Reinterpret float32 bits as uint32 (no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _u32_as_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as float32 (no conversion).

    Accepts any integer type: numba promotes `uint32 << uint32` to 64 bits."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if x.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif x.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(x), codegen


# ------------------------------------------------------------------ scalar helpers
@njit(inline="always")
def expf_poly(a):
    """Cephes expf of a in [-87, 88] (callers clamp): Cody-Waite reduction a = n ln2 + r, a
    degree-6 polynomial in r, times 2^n built from the exponent bits. Branch-free, so a loop of
    it vectorises; within 2 ulp of libm expf. Not for fastmath callers: reassociation would undo
    the Cody-Waite split. The attention's softmax and the SwiGLU share it."""
    n = np.floor(a * np.float32(1.44269504088896341) + np.float32(0.5))
    r = a - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _u32_as_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))


@njit(inline="always")
def bf16_to_f32(u):
    """uint16 bf16 bits -> float32 (exact)."""
    return _u32_as_f32(np.uint32(u) << np.uint32(16))


@njit(inline="always")
def f32_to_bf16(x):
    """float32 -> uint16 bf16 bits, round to nearest even; NaN -> quiet NaN."""
    bits = _f32_as_u32(np.float32(x))
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep sign, force quiet
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x0040))
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    bits = bits + np.uint32(0x7FFF) + lsb
    return np.uint16(bits >> np.uint32(16))


@njit(inline="always")
def round_bf16(x):
    """rnd(x): float32 rounded to the nearest bf16 value, returned as float32."""
    return bf16_to_f32(f32_to_bf16(x))


# ------------------------------------------------------------------ KV cache elements
# `--kv-dtype bf16` stores the KV cache as uint16 bf16 bits (half the bytes that attention reads
# at long context); "f32" (the default) as float32. The kernels read and write cache elements only
# through these two, so one kernel source serves both (numba compiles one variant per dtype).
KV_DTYPES = {"f32": np.float32, "bf16": np.uint16}


def kv_f32(x):
    """A KV cache element as float32 (pure-Python twin of the overload below)."""
    return bf16_to_f32_array(np.asarray(x)) if np.asarray(x).dtype == np.uint16 else np.float32(x)


@overload(kv_f32)  # not inline="always" (numba-IR inlining of an overload warns); LLVM inlines it
def _kv_f32_impl(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16:  # bf16 bits
        def widen(x):
            return bf16_to_f32(x)
        return widen

    def as_is(x):
        return np.float32(x)
    return as_is


def kv_store(buf, x):
    """f32 x as an element of cache array `buf` (pure-Python twin of the overload below)."""
    return f32_to_bf16_array(np.asarray(x)) if buf.dtype == np.uint16 else np.float32(x)


@overload(kv_store)
def _kv_store_impl(buf, x):
    if isinstance(buf.dtype, types.Integer) and buf.dtype.bitwidth == 16:  # bf16 bits, rounded to nearest even
        def narrow(buf, x):
            return f32_to_bf16(x)
        return narrow

    def as_is(buf, x):
        return np.float32(x)
    return as_is


def kv_array(x: np.ndarray, dtype) -> np.ndarray:
    """f32 rows -> what a cache of `dtype` (np.float32 / np.uint16) stores."""
    return f32_to_bf16_array(x) if np.dtype(dtype) == np.uint16 else np.asarray(x, np.float32)


# ------------------------------------------------------------------ numpy array versions
def bf16_to_f32_array(a: np.ndarray) -> np.ndarray:
    """uint16 [...] -> float32 [...] (new array)."""
    a = np.ascontiguousarray(a, dtype=np.uint16)
    return (a.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_array(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 [...] bf16 bits, round to nearest even, NaN kept quiet."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(nan, quiet_nan, rounded)


def round_bf16_array(x: np.ndarray) -> np.ndarray:
    """rnd(x) elementwise: float32 -> nearest bf16 value, as float32."""
    return bf16_to_f32_array(f32_to_bf16_array(x))


def as_f32(t: np.ndarray) -> np.ndarray:
    """A weight or activation as float32: uint16 is read as bf16 bits, others are cast."""
    if t.dtype == np.uint16:
        return bf16_to_f32_array(t)
    return np.asarray(t, dtype=np.float32)
