"""@cuda.jit twins of the Gated DeltaNet kernels (kernels/gdn.py, same contracts):

    short_conv_cuda(window [K-1+n, C], w [C, K], bf16=False) -> [n, C] f32 (host)
    gated_delta_cuda(q, k, v, g, beta, state_in, state_out) -> o [n, Hv, dv] f32 (host)

Short conv: one thread per output element (t, c), grid-stride, the CPU kernel's loop order.

Delta rule: one thread per (value head h, value column j). Column j of S_h only ever meets
column j of the update (S <- a S; m_j = sum_i S_ij k_i; S_ij += k_i beta (v_j - m_j);
o_j = sum_i S_ij q_i), so a thread owns its dk entries of S for the whole block and needs no
other thread: no shared memory, no synchronisation. Each thread recomputes the L2 norms of its
head's q_t, k_t (dk multiply-adds, cheaper than a cross-thread broadcast at decode sizes). The
per-column operation order is the CPU kernel's, so results agree with it to f32 rounding (NVVM
may contract a*b+c into an fma on a GPU; under the simulator there is no contraction).

The states may be device arrays (the hybrid cache allocates them with `ops.zeros`, so they stay
on the GPU across steps: a slice `buffer[j]` of a DeviceBuffer is a device view) or host arrays
(uploaded, and state_out copied back). state_in may be state_out (in-place recurrence).
"""

import math

import numpy as np
from numba import cuda

from ..numerics import round_bf16
from .cuda_common import ELEMENT_THREADS, MAX_BLOCKS, is_device_array, to_device
from .gdn import L2_EPS, check_delta_args, check_short_conv_args


@cuda.jit
def _short_conv_kernel(window, w, bf16, out):
    # window [K-1+n, C], w [C, K] -> out [n, C]; one thread per (t, c), grid-stride
    n, C = out.shape
    K = w.shape[1]
    for idx in range(cuda.grid(1), n * C, cuda.gridsize(1)):
        t = idx // C
        c = idx - t * C
        acc = np.float32(0.0)
        for j in range(K):
            acc += w[c, j] * window[t + j, c]
        if bf16:
            acc = np.float32(round_bf16(acc))
        y = acc / (np.float32(1.0) + np.float32(math.exp(-acc)))
        out[t, c] = np.float32(round_bf16(y)) if bf16 else y


@cuda.jit
def _delta_kernel(q, k, v, g, beta, state_in, state_out, o):
    # q, k [n, Hk, dk], v [n, Hv, dv], g, beta [n, Hv], states [Hv, dk, dv] -> o [n, Hv, dv];
    # one thread per (value head h, value column j), grid-stride over the Hv * dv columns
    n, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    r = Hv // Hk
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(dk)))
    for idx in range(cuda.grid(1), Hv * dv, cuda.gridsize(1)):
        h = idx // dv
        j = idx - h * dv
        kh = h // r
        for i in range(dk):
            state_out[h, i, j] = state_in[h, i, j]
        for t in range(n):
            sq = np.float32(0.0)
            sk = np.float32(0.0)
            for i in range(dk):
                sq += q[t, kh, i] * q[t, kh, i]
                sk += k[t, kh, i] * k[t, kh, i]
            inv_q = np.float32(1.0) / np.float32(math.sqrt(sq + np.float32(L2_EPS)))
            inv_k = np.float32(1.0) / np.float32(math.sqrt(sk + np.float32(L2_EPS)))
            decay = np.float32(math.exp(g[t, h]))
            mem = np.float32(0.0)
            for i in range(dk):
                s = state_out[h, i, j] * decay
                state_out[h, i, j] = s
                mem += s * (k[t, kh, i] * inv_k)
            delta = (v[t, h, j] - mem) * beta[t, h]
            acc = np.float32(0.0)
            for i in range(dk):
                s = state_out[h, i, j] + (k[t, kh, i] * inv_k) * delta
                state_out[h, i, j] = s
                acc += s * (q[t, kh, i] * inv_q * scale)
            o[t, h, j] = acc


def _launch_size(items: int) -> int:
    return max(1, min(MAX_BLOCKS, (items + ELEMENT_THREADS - 1) // ELEMENT_THREADS))


def _f32(a):
    return to_device(a, np.float32) if not is_device_array(a) else a


def short_conv_cuda(window, w, bf16: bool = False) -> np.ndarray:
    """The short conv on the GPU -> host [n, C] f32."""
    check_short_conv_args("short_conv_cuda", window, w)
    n, C = window.shape[0] - (w.shape[1] - 1), w.shape[0]
    out = cuda.device_array((n, C), dtype=np.float32)  # [n, C]
    if n * C:
        _short_conv_kernel[_launch_size(n * C), ELEMENT_THREADS](_f32(window), _f32(w), bool(bf16), out)
    return out.copy_to_host()


def gated_delta_cuda(q, k, v, g, beta, state_in, state_out) -> np.ndarray:
    """The gated delta rule on the GPU -> host o [n, Hv, dv]; state_out written in place."""
    check_delta_args("gated_delta_cuda", q, k, v, g, beta, state_in, state_out)
    host_out = not is_device_array(state_out)
    d_out = to_device(state_out, np.float32) if host_out else state_out
    d_in = d_out if state_in is state_out else _f32(state_in)
    Hv, dv = v.shape[1], v.shape[2]
    o = cuda.device_array(tuple(v.shape), dtype=np.float32)  # [n, Hv, dv]
    _delta_kernel[_launch_size(Hv * dv), ELEMENT_THREADS](_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta),
                                                          d_in, d_out, o)
    if host_out:
        state_out[...] = d_out.copy_to_host()
    return o.copy_to_host()
