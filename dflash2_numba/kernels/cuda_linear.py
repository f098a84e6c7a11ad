"""@cuda.jit GEMV / skinny GEMM with bf16 weights converted on the fly (twin of kernels/linear.py).

    linear_cuda(x [M, K] f32, w [N, K] uint16 (bf16) | float32) -> y [M, N] f32

w is usually a device array uploaded once (cuda_ops caches the model's weights on the device);
a host w is uploaded for this call only. x is uploaded, y comes back to the host unless x was a
device array.

One thread block per output feature n (block-stride loop over n), REDUCE_THREADS threads
striding over K — consecutive threads read consecutive weights, so the weight row is read
coalesced and exactly once per ROW_TILE rows of x. Each thread keeps ROW_TILE partial sums
(one per input row), then a shared-memory tree reduction per row (no warp shuffles: the
simulator has none). Decode-size inputs (M <= ROW_TILE) read the weight matrix once.
Summation order differs from the CPU kernel: results agree within f32 rounding, not bitwise.
"""

from functools import lru_cache

import numpy as np
from numba import cuda, float32

from ..numerics import bf16_to_f32
from .conv import _same
from .cuda_common import REDUCE_THREADS, grid_blocks, is_device_array, to_device

ROW_TILE = 16  # rows of x per pass over a weight row (a Q=16 block in one pass)


def _make_linear_kernel(load, NT):
    """The kernel for one weight dtype (`load`: weight element -> float32), NT threads/block."""

    @cuda.jit
    def kernel(x, w, y):
        # x [M, K] f32, w [N, K], y [M, N] f32
        M, K = x.shape
        N = w.shape[0]
        tid = cuda.threadIdx.x
        part = cuda.shared.array((ROW_TILE, NT), float32)  # [ROW_TILE, NT] partial sums
        acc = cuda.local.array(ROW_TILE, float32)  # [ROW_TILE] this thread's sums
        for n in range(cuda.blockIdx.x, N, cuda.gridDim.x):
            for m0 in range(0, M, ROW_TILE):
                rows = min(ROW_TILE, M - m0)
                for r in range(ROW_TILE):
                    acc[r] = np.float32(0.0)
                for kk in range(tid, K, NT):
                    wk = np.float32(load(w[n, kk]))
                    for r in range(rows):
                        acc[r] += x[m0 + r, kk] * wk  # all float32 (also in the simulator)
                for r in range(ROW_TILE):
                    part[r, tid] = acc[r]
                cuda.syncthreads()
                width = NT // 2
                while width > 0:
                    if tid < width:
                        for r in range(rows):
                            part[r, tid] = np.float32(part[r, tid] + part[r, tid + width])
                    cuda.syncthreads()
                    width //= 2
                for r in range(tid, rows, NT):
                    y[m0 + r, n] = part[r, 0]
                cuda.syncthreads()  # part is rewritten by the next tile

    return kernel


@lru_cache(maxsize=None)
def kernel_for(dtype, threads: int = REDUCE_THREADS):
    """The @cuda.jit GEMV for uint16 (bf16) or float32 weights, `threads` (a power of two) per block."""
    dtype = np.dtype(dtype)
    if dtype == np.uint16:
        return _make_linear_kernel(bf16_to_f32, threads)
    if dtype == np.float32:
        return _make_linear_kernel(_same, threads)
    raise TypeError(f"linear_cuda: weight dtype {dtype}; expected uint16 (bf16) or float32")


def linear_cuda(x, w, out=None, threads: int = REDUCE_THREADS):
    """y = x @ w.T on the GPU. x [M, K] f32 (host or device), w [N, K] uint16 / float32."""
    x_on_device = is_device_array(x)
    if not x_on_device:
        x = np.ascontiguousarray(x, dtype=np.float32)
    M, K = x.shape
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"linear: x has {K} features, weight has {Kw} columns (shape {list(w.shape)})")
    if not is_device_array(w) and w.dtype not in (np.uint16, np.float32):
        w = w.astype(np.float32)  # float16 and friends: rare, converted for this call
    kernel = kernel_for(w.dtype, threads)
    dout = out if out is not None else cuda.device_array((M, N), dtype=np.float32)  # [M, N]
    if M and N:
        kernel[grid_blocks(N), threads](to_device(x), to_device(w), dout)
    if x_on_device or out is not None:
        return dout
    return dout.copy_to_host()
