"""@cuda.jit attention: a block of queries over a key set — same contract as kernels/attention.py.

    attention_cuda(q [nq, nh, hd], k [nkv, >=T, hd], v [nkv, >=T, hd], q_pos [nq], k_pos [T],
                   causal=True, window=0, bf16_probs=False) -> [nq, nh, hd] f32

Serves both callers of the CPU kernel: the target's verify block (k/v = cache ++ block,
causal) and the draft block (context K/V ++ block, GQA, causal or not, symmetric window,
explicit positions). k and v may be host arrays (uploaded) or device arrays — e.g. a
device-resident KV cache slice `cache.k[i, :, :end]` (any strides: the kernel is specialised
per layout); q is small and always uploaded if on the host. The result comes back to the host
unless q was a device array.

One thread block per (query i, head h), REDUCE_THREADS threads:
  1. scores s_t = (q . k_t) * hd^-0.5 for visible keys (-inf otherwise), threads striding over
     keys, written to a global scratch row [T]; block max by a shared-memory tree reduction;
  2. p_t = exp(s_t - max) (0 for invisible keys), block sum (shared-memory tree); in bf16_probs
     mode, as the CPU kernel's tiles do, p_t = bf16(exp(s_t - m_b)) * exp(m_b - max) with m_b the
     max over the key's TILE (keys b*TILE .. b*TILE+TILE-1) while the sum takes the unrounded
     weights (rounding against the global max instead differs by ~1e-3 once T > TILE);
  3. threads striding over hd: out[j] = sum_t p_t v[t, j] * (1 / sum).
Shared-memory reductions only (no warp shuffles: the simulator has none). Summation order
differs from the CPU kernel, so results agree within a tolerance (f32: ~1e-6 relative), not
bit for bit. A query that sees no key gets a zero row, as on the CPU.
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from ..numerics import round_bf16
from .attention import TILE, _check, _check_first
from .cuda_common import REDUCE_THREADS, grid_blocks, is_device_array, to_device

MAX_HEAD_DIM = 256  # q row staged in shared memory: [MAX_HEAD_DIM] f32


@lru_cache(maxsize=None)
def kernel_for(threads: int = REDUCE_THREADS):
    """The @cuda.jit attention kernel with `threads` (a power of two) per block."""
    return _make_attention_kernel(threads)


def _make_attention_kernel(NT):
    @cuda.jit
    def kernel(q, k, v, q_pos, k_pos, first, causal, window, bf16_probs, scratch, out):
        # q [nq, nh, hd], k/v [nkv, T, hd], q_pos [nq], k_pos [T] int64, scratch [nq*nh, T] f32,
        # out [nq, nh, hd] f32. Block-stride loop over (query, head) items.
        nq, nh, hd = q.shape
        T = k.shape[1]
        group = nh // k.shape[0]  # GQA: query head h reads KV head h // group
        tid = cuda.threadIdx.x
        q_row = cuda.shared.array(MAX_HEAD_DIM, float32)  # [hd] this item's query
        red = cuda.shared.array(NT, float32)  # [NT] reduction scratch
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(hd)))
        neg_inf = np.float32(-math.inf)
        for item in range(cuda.blockIdx.x, nq * nh, cuda.gridDim.x):
            i = item // nh
            h = item - i * nh
            kvh = h // group
            qp = q_pos[i]
            s_row = scratch[item]  # [T]
            for j in range(tid, hd, NT):
                q_row[j] = q[i, h, j]
            cuda.syncthreads()

            # 1. scores and the block max
            mx = neg_inf
            for t in range(tid, T, NT):
                d = qp - k_pos[t]
                if t < first or (causal and d < 0) or (window > 0 and (d > window - 1 or d < 1 - window)):
                    s_row[t] = neg_inf
                    continue
                acc = np.float32(0.0)
                for j in range(hd):
                    acc = np.float32(acc + q_row[j] * np.float32(k[kvh, t, j]))
                acc = np.float32(acc * scale)
                s_row[t] = acc
                if acc > mx:
                    mx = acc
            red[tid] = mx
            cuda.syncthreads()
            width = NT // 2
            while width > 0:
                if tid < width and red[tid + width] > red[tid]:
                    red[tid] = red[tid + width]
                cuda.syncthreads()
                width //= 2
            mx = red[0]
            cuda.syncthreads()  # everyone has read red[0] before it is reused

            if mx == neg_inf:  # nothing visible (uniform over the block): zero row
                for j in range(tid, hd, NT):
                    out[i, h, j] = np.float32(0.0)
                cuda.syncthreads()
                continue

            # 2. probabilities (in place) and the block sum
            total = np.float32(0.0)
            if not bf16_probs:
                for t in range(tid, T, NT):
                    s = s_row[t]
                    p = np.float32(0.0)
                    if s != neg_inf:
                        p = np.float32(math.exp(np.float32(s - mx)))
                    total = np.float32(total + p)
                    s_row[t] = p
            else:  # as the CPU kernel: rounded relative to the key's TILE max mb, then times exp(mb - max)
                for t0 in range(0, T, TILE):
                    t1 = min(T, t0 + TILE)
                    mb = neg_inf
                    for t in range(t0 + tid, t1, NT):
                        if s_row[t] > mb:
                            mb = s_row[t]
                    # the tile's max: the tree above, inline (a device function makes compile_ptx need a driver)
                    red[tid] = mb
                    cuda.syncthreads()
                    width = NT // 2
                    while width > 0:
                        if tid < width and red[tid + width] > red[tid]:
                            red[tid] = red[tid + width]
                        cuda.syncthreads()
                        width //= 2
                    mb = red[0]
                    cuda.syncthreads()
                    c = np.float32(0.0)
                    if mb != neg_inf:
                        c = np.float32(math.exp(np.float32(mb - mx)))
                    for t in range(t0 + tid, t1, NT):
                        s = s_row[t]
                        p = np.float32(0.0)
                        if s != neg_inf:
                            e = np.float32(math.exp(np.float32(s - mb)))
                            total = np.float32(total + np.float32(e * c))  # the sum from unrounded weights
                            p = np.float32(np.float32(round_bf16(e)) * c)
                        s_row[t] = p
            red[tid] = total
            cuda.syncthreads()  # also publishes s_row (global memory) to the whole block
            width = NT // 2
            while width > 0:
                if tid < width:
                    red[tid] = np.float32(red[tid] + red[tid + width])
                cuda.syncthreads()
                width //= 2
            inv = np.float32(1.0) / red[0]

            # 3. weighted sum of V, one output feature per thread
            for j in range(tid, hd, NT):
                acc = np.float32(0.0)
                for t in range(T):
                    acc = np.float32(acc + s_row[t] * np.float32(v[kvh, t, j]))
                out[i, h, j] = np.float32(acc * inv)
            cuda.syncthreads()  # before the next item overwrites q_row / red

    return kernel


def attention_cuda(q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False, out=None,
                   threads: int = REDUCE_THREADS, first: int = 0):
    """GPU attention; same contract as kernels/attention.attention (f32 in, f32 out)."""
    q_on_device = is_device_array(q)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    if not q_on_device:
        q = np.ascontiguousarray(q, dtype=np.float32)
    nq, nh, hd = q.shape
    if is_device_array(k) or is_device_array(v):
        _check_device(q, k, v, q_pos, k_pos)
    else:
        if k.dtype != np.float32 or v.dtype != np.float32:
            k, v = k.astype(np.float32), v.astype(np.float32)
        _check(q, k, v, q_pos, k_pos)
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"attention_cuda: head_dim {hd} > {MAX_HEAD_DIM} (the shared q row)")
    T = k_pos.shape[0]  # keys = rows 0..T-1 of k / v; later rows are ignored
    dq, dk, dv = to_device(q), to_device(k[:, :T]), to_device(v[:, :T])
    scratch = cuda.device_array((nq * nh, max(T, 1)), dtype=np.float32)  # [nq*nh, T]
    dout = out if out is not None else cuda.device_array((nq, nh, hd), dtype=np.float32)
    if nq * nh:
        kernel_for(threads)[grid_blocks(nq * nh), threads](
            dq, dk, dv, to_device(q_pos), to_device(k_pos), _check_first(first, T), bool(causal), int(window),
            bool(bf16_probs), scratch, dout)
    if q_on_device or out is not None:
        return dout
    return dout.copy_to_host()


def _check_device(q, k, v, q_pos, k_pos):
    """Device k / v must already be float32; then the CPU's shape rules."""
    if k.dtype != np.float32 or v.dtype != np.float32:
        raise TypeError(f"attention_cuda: device k / v must be float32, got {k.dtype} / {v.dtype}")
    _check(q, k, v, q_pos, k_pos)
