"""DFlash2 grouped dynamic depthwise convolution (spec §4.2).

Rows `n = 0..N-1` are request blocks of length `Q` (= `block_len`, the RUNTIME `1 + k`, never
the checkpoint's block_size) laid end to end; `S = group_size`, `G = H // S`, `g(c) = c // S`:

    coef[n,t,c] = base[t,c] + delta[n,t,g(c)]
    pos[n]      = n & (Q-1)  if Q is a power of two   (the "&" arm)
                = n % Q      otherwise                 (the "%" arm)
    out[n,c]    = coef[n,0,c]*x[n,c] + sum_{t=1..taps-1} [pos[n] >= t] * coef[n,t,c]*x[n-t,c]

Rounding, as eager bf16 PyTorch materialises each step (`rnd` is the identity for float32):

    c_t = rnd(base_t + delta_t)
    acc = rnd(c_0 * x_n)
    for t = 1..taps-1:  acc = rnd(acc + mask_t * rnd(c_t * x_{n-t}))

`[pos >= t]` is an Iverson bracket in Knuth's "strongly zero" sense: a masked tap contributes
NOTHING — x[n-t] is not read (for n < t it does not exist), so values of the previous block
cannot leak in, not even as NaN/inf (0 * inf would be NaN) or as the sign of a zero.

Three implementations, all with the same contract:

    grouped_conv            @njit kernel, authoritative (the CUDA twin must be bit-identical)
    grouped_conv_reference  sequential numpy straight from the formula (the test oracle)
    grouped_conv_numpy      vectorised numpy (the benchmark's baseline)

dtypes: all float32 (no rounding), or all uint16 bf16 bits (rounded after every step, output
uint16). Mixed dtypes are refused with KernelDTypeError: the model calls the conv either in
f32 run mode (all f32) or in bf16 run mode (all bf16), and a silent conversion would hide a
call site that is in the wrong mode.
"""

import numpy as np
from numba import njit

from ..errors import KernelArgumentError, KernelDTypeError
from ..numerics import (
    bf16_to_f32,
    bf16_to_f32_array,
    f32_to_bf16,
    f32_to_bf16_array,
    round_bf16,
    round_bf16_array,
)


# ------------------------------------------------------------------ block position (both arms)
def uses_and_arm(block_len: int) -> bool:
    """True when pos[n] is computed as `n & (Q-1)` (Q a power of two), False for `n % Q`."""
    return block_len > 0 and (block_len & (block_len - 1)) == 0


@njit(inline="always")
def block_pos(n, block_len, and_arm):
    """Position of row n inside its request block. The & arm is only valid for powers of two."""
    if and_arm:
        return n & (block_len - 1)
    return n % block_len


# ------------------------------------------------------------------ per-element math
# The math of one element is two scalar steps on float32 values, built from primitives so that
# ONE definition serves every (dtype, device) pair: CPU == GPU bit-identity holds by construction
# as long as the primitives agree. On the GPU, NVVM contracts `a*b + c` into an FMA (one
# rounding instead of two; checked: the f32 steps below compile to one fma.rn in PTX), so the
# CUDA twin builds its steps with round-to-nearest intrinsics (PTX: mul.rn / add.rn, no fma):
#     make_conv_steps(libdevice.fmul_rn, libdevice.fadd_rn, round_bf16)     (bf16 mode)
# Under NUMBA_ENABLE_CUDASIM the libdevice functions are plain Python and do not type inside
# an njit helper; there the twin passes _mul / _add (the simulator does not contract).
# A CUDA thread per (n, c) then runs: acc = conv_first(...); for t in 1..min(taps, pos+1)-1:
# acc = conv_tap(acc, ...) -- the same sequence as the CPU kernels below.
@njit(inline="always")
def _mul(a, b):
    return a * b  # float32 * float32 -> float32; LLVM does not contract without fastmath


@njit(inline="always")
def _add(a, b):
    return a + b


@njit(inline="always")
def _same(a):
    return a  # rnd / load / store of float32 mode: the identity


def make_conv_steps(mul, add, rnd):
    """Build the two per-element steps from float32 `mul`, `add` and the rounding `rnd`:

        conv_first(base_0, delta_0, x_n)        -> acc = rnd(c_0 * x_n),  c_0 = rnd(base_0 + delta_0)
        conv_tap(acc, base_t, delta_t, x_{n-t}) -> rnd(acc + rnd(c_t * x_{n-t}))
    """

    @njit(inline="always")
    def conv_first(base_0, delta_0, x_n):
        return rnd(mul(rnd(add(base_0, delta_0)), x_n))

    @njit(inline="always")
    def conv_tap(acc, base_t, delta_t, x_nt):
        return rnd(add(acc, rnd(mul(rnd(add(base_t, delta_t)), x_nt))))

    return conv_first, conv_tap


conv_first_f32, conv_tap_f32 = make_conv_steps(_mul, _add, _same)
conv_first_bf16, conv_tap_bf16 = make_conv_steps(_mul, _add, round_bf16)


# ------------------------------------------------------------------ CPU kernels
# The loops run tap by tap over whole rows, so every inner loop is a long branch-free loop over
# channels that vectorises; per element the arithmetic is still exactly conv_first,
# conv_tap(t=1), conv_tap(t=2), ... of spec §4.2. The f32 and bf16 kernels are the same loop
# with different load / store / steps; they are spelled out twice (not built by a factory)
# because numba's disk cache misses on closures (measured), and compiling both costs seconds.
@njit(inline="always")
def _spread_groups(delta_nt, d_row, group_size):
    """d_row[c] = delta_nt[c // S]: channels g*S .. g*S+S-1 share group g's delta."""
    for g in range(delta_nt.shape[0]):
        for s in range(group_size):
            d_row[g * group_size + s] = delta_nt[g]


@njit(cache=True, nogil=True)
def _grouped_conv_f32(x, delta, base, out, group_size, block_len, and_arm):
    # x [N, H] f32, delta [N, taps, G] f32, base [taps, H] f32 -> out [N, H] f32
    n_rows, hidden = x.shape
    acc = np.empty(hidden, dtype=np.float32)  # [H] one row's accumulator
    d_row = np.empty(hidden, dtype=np.float32)  # [H] delta[n, t, g(c)]
    for n in range(n_rows):
        pos = block_pos(n, block_len, and_arm)
        # Taps t <= pos stay inside the block; the others are masked (contribute nothing).
        for t in range(min(base.shape[0], pos + 1)):
            _spread_groups(delta[n, t], d_row, group_size)
            base_t, x_prev = base[t], x[n - t]  # [H], [H] (row n-t of the same block)
            if t == 0:
                for c in range(hidden):
                    acc[c] = conv_first_f32(base_t[c], d_row[c], x_prev[c])
            else:
                for c in range(hidden):
                    acc[c] = conv_tap_f32(acc[c], base_t[c], d_row[c], x_prev[c])
        for c in range(hidden):  # a loop, not out[n] = acc: numba's array assignment drags in
            out[n, c] = acc[c]  # its error-message string formatting (~2 s of a cold compile)


@njit(cache=True, nogil=True)
def _grouped_conv_bf16(x, delta, base, out, group_size, block_len, and_arm):
    # x [N, H] u16, delta [N, taps, G] u16, base [taps, H] u16 -> out [N, H] u16 (bf16 bits)
    n_rows, hidden = x.shape
    acc = np.empty(hidden, dtype=np.float32)  # [H] one row's accumulator (bf16 values)
    d_row = np.empty(hidden, dtype=np.uint16)  # [H] delta[n, t, g(c)]
    for n in range(n_rows):
        pos = block_pos(n, block_len, and_arm)
        for t in range(min(base.shape[0], pos + 1)):  # same tap mask as the f32 kernel
            _spread_groups(delta[n, t], d_row, group_size)
            base_t, x_prev = base[t], x[n - t]  # [H], [H]
            if t == 0:
                for c in range(hidden):
                    acc[c] = conv_first_bf16(bf16_to_f32(base_t[c]), bf16_to_f32(d_row[c]),
                                             bf16_to_f32(x_prev[c]))
            else:
                for c in range(hidden):
                    acc[c] = conv_tap_bf16(acc[c], bf16_to_f32(base_t[c]), bf16_to_f32(d_row[c]),
                                           bf16_to_f32(x_prev[c]))
        out_n = out[n]  # [H]
        for c in range(hidden):
            out_n[c] = f32_to_bf16(acc[c])  # exact: acc already holds a bf16 value


def _kernel_for(dtype):
    return _grouped_conv_f32 if dtype == np.float32 else _grouped_conv_bf16


# ------------------------------------------------------------------ argument checks
def check_conv_args(who, x, delta, base, group_size, block_len):
    """The shape / dtype rules of grouped_conv on anything with .dtype / .shape / .ndim (numpy or
    CUDA device arrays); `who` names the caller in the messages. Raises KernelDTypeError /
    KernelArgumentError naming what is wrong."""
    dtypes = {"x": x.dtype, "delta": delta.dtype, "base": base.dtype}
    if not (all(d == np.float32 for d in dtypes.values()) or all(d == np.uint16 for d in dtypes.values())):
        shown = ", ".join(f"{k}={v}" for k, v in dtypes.items())
        raise KernelDTypeError(
            f"{who}: expected x, delta, base all float32 (f32 mode) or all uint16 bf16 "
            f"(bf16 mode), got {shown}")
    if x.ndim != 2:
        raise KernelArgumentError(f"{who}: x must be [N, H], got shape {tuple(x.shape)}")
    if base.ndim != 2:
        raise KernelArgumentError(f"{who}: base must be [taps, H] (one side of "
                                  f"base_kernel[2, taps, H]), got shape {tuple(base.shape)}")
    n_rows, hidden = x.shape
    taps = base.shape[0]
    if taps < 1 or base.shape[1] != hidden:
        raise KernelArgumentError(f"{who}: base expected [taps>=1, H={hidden}], got {tuple(base.shape)}")
    if not isinstance(group_size, (int, np.integer)) or group_size < 1 or hidden % group_size:
        raise KernelArgumentError(
            f"{who}: group_size must be a positive divisor of H={hidden}, got {group_size!r}")
    if not isinstance(block_len, (int, np.integer)) or block_len < 1:
        raise KernelArgumentError(f"{who}: block_len must be an int >= 1, got {block_len!r}")
    groups = hidden // group_size
    if tuple(delta.shape) != (n_rows, taps, groups):
        raise KernelArgumentError(
            f"{who}: delta expected [N={n_rows}, taps={taps}, G={groups}] "
            f"(G = H {hidden} // group_size {group_size}), got {tuple(delta.shape)}")


def _check(x, delta, base, group_size, block_len):
    """Validate numpy arguments; return C-contiguous (x, delta, base)."""
    for name, a in (("x", x), ("delta", delta), ("base", base)):
        if not isinstance(a, np.ndarray):
            raise KernelDTypeError(f"grouped_conv: {name} must be a numpy array, got {type(a).__name__}")
    check_conv_args("grouped_conv", x, delta, base, group_size, block_len)
    # delta is usually a strided view of proj.reshape(N, 2, taps, G)[:, side]: tiny, so copying
    # it (and base) keeps the kernel to one C-layout specialisation per dtype.
    return np.ascontiguousarray(x), np.ascontiguousarray(delta), np.ascontiguousarray(base)


# ------------------------------------------------------------------ public API
def grouped_conv(x, delta, base, group_size: int, block_len: int) -> np.ndarray:
    """The @njit conv. x [N, H], delta [N, taps, G], base [taps, H] -> out [N, H] (x's dtype)."""
    x, delta, base = _check(x, delta, base, group_size, block_len)
    out = np.empty_like(x)  # [N, H]
    _kernel_for(x.dtype)(x, delta, base, out, int(group_size), int(block_len),
                         uses_and_arm(int(block_len)))
    return out


def _float_ops(dtype):
    """(load, rnd, store) numpy helpers for a tensor dtype."""
    if dtype == np.uint16:
        return bf16_to_f32_array, round_bf16_array, f32_to_bf16_array
    return (lambda a: a), (lambda a: a), (lambda a: a)


def grouped_conv_reference(x, delta, base, group_size: int, block_len: int) -> np.ndarray:
    """Sequential numpy reference, written from the §4.2 formula (loops over rows and taps)."""
    x, delta, base = _check(x, delta, base, group_size, block_len)
    load, rnd, store = _float_ops(x.dtype)
    x, delta, base = load(x), load(delta), load(base)    # [N, H], [N, taps, G], [taps, H] f32
    n_rows, hidden = x.shape
    taps = base.shape[0]
    group_of = np.arange(hidden) // group_size           # [H] g(c)
    out = np.empty((n_rows, hidden), dtype=np.float32)
    for n in range(n_rows):
        pos = n % block_len                              # position inside the request block
        coef = rnd(base + delta[n][:, group_of])         # [taps, H]
        acc = rnd(coef[0] * x[n])                        # [H]
        for t in range(1, taps):
            if pos >= t:                                 # the tap stays inside the block
                acc = rnd(acc + rnd(coef[t] * x[n - t]))
        out[n] = acc
    return store(out)


def grouped_conv_numpy(x, delta, base, group_size: int, block_len: int) -> np.ndarray:
    """Vectorised numpy version (whole-array ops per tap): the benchmark's baseline."""
    x, delta, base = _check(x, delta, base, group_size, block_len)
    load, rnd, store = _float_ops(x.dtype)
    x, delta, base = load(x), load(delta), load(base)
    n_rows, hidden = x.shape
    taps = base.shape[0]
    pos = np.arange(n_rows) % block_len                               # [N]
    coef = rnd(base[None] + np.repeat(delta, group_size, axis=2))     # [N, taps, H]
    acc = rnd(coef[:, 0] * x)                                         # [N, H]
    for t in range(1, taps):
        inside = pos >= t                                             # [N] rows whose tap t is live
        shifted = np.zeros_like(x)
        shifted[t:] = x[:-t]                                          # [N, H] x[n-t]
        acc = np.where(inside[:, None], rnd(acc + rnd(coef[:, t] * shifted)), acc)
    return store(acc)
