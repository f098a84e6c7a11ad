"""@cuda.jit twin of the grouped dynamic depthwise conv (spec §4.2), BIT-IDENTICAL to the CPU
kernel of kernels/conv.py (the authoritative one), for float32 and bf16 (uint16) tensors.

    grouped_conv_cuda(x [N, H], delta [N, taps, G], base [taps, H], group_size, block_len)
        -> out [N, H] in x's dtype; host arrays in -> host array out, any device array in ->
           device array out (nothing copied back).

One thread per output element (n, c) runs exactly the CPU sequence of scalar steps

    acc = conv_first(base[0,c], delta[n,0,g], x[n,c])
    for t in 1 .. min(taps, pos+1)-1:  acc = conv_tap(acc, base[t,c], delta[n,t,g], x[n-t,c])

with conv_first / conv_tap built by the SAME `make_conv_steps` and the same bf16 helpers
(numerics.py) as the CPU kernel, and the same `block_pos` for both position arms. What differs
is only the float primitives: NVVM contracts `a*b + c` into one fma.rn (one rounding instead of
two), so on a GPU the steps are built from libdevice's round-to-nearest `fmul_rn` / `fadd_rn`
(PTX mul.rn / add.rn, never contracted; tests/test_cuda_ptx.py checks the PTX has no fma).
Under the CUDA simulator the libdevice functions are plain Python and do not type inside an
@njit helper, so the shim passes the CPU's `_mul` / `_add` there (the simulator runs numpy
float32 arithmetic and never contracts).
"""

import numpy as np
from numba import cuda

from ..errors import KernelDTypeError
from ..numerics import bf16_to_f32, f32_to_bf16, round_bf16
from .conv import _add, _mul, _same, block_pos, check_conv_args, make_conv_steps, uses_and_arm
from .cuda_common import ELEMENT_THREADS, MAX_BLOCKS, SIMULATOR, is_device_array, to_device

if SIMULATOR:
    _MUL, _ADD = _mul, _add  # simulator shim: numpy float32 ops, no contraction to worry about
else:
    from numba.cuda import libdevice

    _MUL, _ADD = libdevice.fmul_rn, libdevice.fadd_rn  # PTX mul.rn.f32 / add.rn.f32


def make_conv_kernel(load, store, conv_first, conv_tap):
    """A @cuda.jit conv for one tensor dtype: `load` element -> f32, `store` f32 -> element."""

    @cuda.jit
    def kernel(x, delta, base, out, group_size, block_len, and_arm):
        # x [N, H], delta [N, taps, G], base [taps, H] -> out [N, H]; one thread per (n, c),
        # grid-stride so any launch size covers every element.
        n_rows, hidden = x.shape
        taps = base.shape[0]
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for i in range(start, n_rows * hidden, stride):
            n = i // hidden
            c = i - n * hidden
            g = c // group_size
            pos = block_pos(n, block_len, and_arm)
            # np.float32(...) around every scalar: a no-op on the GPU, but under the simulator an
            # @njit helper called from Python returns a Python float, which would make the next
            # helper compile (and compute) for float64.
            acc = np.float32(conv_first(np.float32(load(base[0, c])), np.float32(load(delta[n, 0, g])),
                                        np.float32(load(x[n, c]))))
            # Taps t <= pos stay inside the block; the others are masked: x[n-t] is not read.
            for t in range(1, min(taps, pos + 1)):
                acc = np.float32(conv_tap(acc, np.float32(load(base[t, c])), np.float32(load(delta[n, t, g])),
                                          np.float32(load(x[n - t, c]))))
            out[n, c] = store(acc)

    return kernel


_first_f32, _tap_f32 = make_conv_steps(_MUL, _ADD, _same)
_first_bf16, _tap_bf16 = make_conv_steps(_MUL, _ADD, round_bf16)
_conv_f32 = make_conv_kernel(_same, _same, _first_f32, _tap_f32)
_conv_bf16 = make_conv_kernel(bf16_to_f32, f32_to_bf16, _first_bf16, _tap_bf16)


def kernel_for(dtype):
    """The @cuda.jit kernel for float32 or uint16 (bf16) tensors (a numpy dtype)."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return _conv_f32
    if dtype == np.uint16:
        return _conv_bf16
    raise KernelDTypeError(f"grouped_conv_cuda: dtype {dtype}; expected float32 or uint16 (bf16)")


def launch_conv(x, delta, base, out, group_size: int, block_len: int, and_arm: bool) -> None:
    """Launch on device arrays (no checks): the arm is explicit so tests can force either."""
    n_elements = x.shape[0] * x.shape[1]
    if n_elements == 0:
        return
    blocks = max(1, min(MAX_BLOCKS, (n_elements + ELEMENT_THREADS - 1) // ELEMENT_THREADS))
    kernel_for(x.dtype)[blocks, ELEMENT_THREADS](x, delta, base, out, int(group_size),
                                                 int(block_len), bool(and_arm))


def grouped_conv_cuda(x, delta, base, group_size: int, block_len: int, out=None):
    """The conv on the GPU; same contract as kernels/conv.grouped_conv, bit-identical output.

    Host inputs are uploaded (delta is usually a strided view of the projection: it is made
    contiguous first); if any input is a device array the result stays on the device."""
    check_conv_args("grouped_conv_cuda", x, delta, base, group_size, block_len)
    on_device = any(is_device_array(a) for a in (x, delta, base))
    dx, dd, db = to_device(x), to_device(delta), to_device(base)
    dout = out if out is not None else cuda.device_array(tuple(x.shape), dtype=x.dtype)  # [N, H]
    launch_conv(dx, dd, db, dout, group_size, block_len, uses_and_arm(int(block_len)))
    if on_device or out is not None:
        return dout
    return dout.copy_to_host()
