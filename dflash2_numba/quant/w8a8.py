"""W8A8: int8 weights with a per-output-channel scale, int8 activations quantized per token at
run time (compressed-tensors int-quantized with `input_activations: {num_bits 8, type int,
strategy token, dynamic true, symmetric true}`).

Activation rule (compressed-tensors' dynamic per-token symmetric int8, read from its
calculate_qparams / quantize: q range [-128, 127], so the scale is max|x| / 127.5):

    s_x[m] = max_k |x[m, k]| / 127.5                (f32; an all-zero row: q = 0)
    q_x[m, k] = clamp(round_half_even(x[m, k] / s_x[m]), -128, 127)

    y[m, n] = f32(sum_k q_x[m, k] * q_w[n, k]) * (s_x[m] * s_w[n])

The integer sum is exact (int32; |sum| < K * 128 * 128), the epilogue one fixed expression, and
each row is quantized on its own: a Q-row product equals Q one-row products bit for bit.
`linear_w8a8_reference` is the same in numpy (int64 sums).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .bytes_kernel import COLS

Q_MIN, Q_MAX, HALF_RANGE = -128, 127, np.float32(127.5)
EPS = np.float32(np.finfo(np.float32).eps)


def quantize_tokens(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] f32 -> (q int8 [M, K], scale f32 [M]) by the rule above (numpy: IEEE f32 divide
    and round-half-even, as torch computes it)."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    s = (amax / HALF_RANGE).astype(np.float32)
    s = np.where(s == 0, EPS, s).astype(np.float32)
    q = np.clip(np.rint(x / s[:, None]), Q_MIN, Q_MAX).astype(np.int8)
    return q, s


@njit(inline="always")
def _w8a8_cols(xq, xs, w, ws, y, n0, n1):
    M, K = xq.shape
    for n in range(n0, n1):
        for m in range(M):
            acc = np.int32(0)
            for k in range(K):
                acc += np.int32(xq[m, k]) * np.int32(w[n, k])
            y[m, n] = np.float32(acc) * (xs[m] * ws[n])


@njit(nogil=True, cache=True)
def _w8a8_ser(xq, xs, w, ws, y):
    _w8a8_cols(xq, xs, w, ws, y, 0, w.shape[0])


@njit(parallel=True, nogil=True, cache=True)
def _w8a8_par(xq, xs, w, ws, y):
    N = w.shape[0]
    for c in prange((N + COLS - 1) // COLS):
        _w8a8_cols(xq, xs, w, ws, y, c * COLS, min(N, (c + 1) * COLS))


def matmul_w8a8(arrays: dict, x: np.ndarray, y: np.ndarray, parallel: bool) -> np.ndarray:
    """arrays {"w": int8 [N, K], "scale": f32 [N]}."""
    xq, xs = quantize_tokens(x)
    (_w8a8_par if parallel else _w8a8_ser)(xq, xs, arrays["w"], arrays["scale"], y)
    return y


def dequantize_w8a8(arrays: dict, shape) -> np.ndarray:
    """The weight alone, f32 [N, K] (the activations are quantized at run time)."""
    return arrays["w"].astype(np.float32) * arrays["scale"][:, None]


def linear_w8a8_reference(x: np.ndarray, arrays: dict) -> np.ndarray:
    xq, xs = quantize_tokens(x)
    isum = xq.astype(np.int64) @ arrays["w"].astype(np.int64).T  # [M, N] exact
    return isum.astype(np.float32) * (xs[:, None] * arrays["scale"][None, :])
