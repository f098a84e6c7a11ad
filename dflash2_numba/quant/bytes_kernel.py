"""One byte per weight, a float scale per [bn, bk] block: FP8 e4m3 (quant_method "fp8", and
compressed-tensors float-quantized) and int8 weight-only (compressed-tensors int-quantized
without activation quantization).

    y[m, n] = sum over k-blocks b of  scale[n // bn, b] * (sum_{k in b} x[m, k] * lut[w[n, k]])

`lut` maps the stored byte to its exact f32 value (e4m3: 254 finite codes and 2 NaN; int8: the
signed value), so a block of the weight is decoded into a small f32 buffer and dotted with each
activation row in a FIXED order (8 interleaved partial sums, combined pairwise), then scaled.
Each output's arithmetic is the same sequence whatever the row count or thread split (threads
take whole output columns), so a Q-row product equals Q one-row products bit for bit.
No fastmath: the order is the one written.

`linear_bytes_reference` (numpy) dequantizes the whole matrix: the definition the kernel is tested
against; it agrees to f32 rounding (the kernel scales each block's partial sum).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

COLS = 16  # output columns per parallel work item


def e4m3_table() -> np.ndarray:
    """f32 value of each e4m3fn byte (sign, 4 exponent bits with bias 7, 3 mantissa bits;
    exponent 0 is subnormal; S.1111.111 is NaN; no infinities)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    v = sign * v
    v[(e == 15) & (m == 7)] = np.nan
    return v.astype(np.float32)


def int8_table() -> np.ndarray:
    """f32 value of each byte read as a signed int8."""
    return np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)


E4M3 = e4m3_table()
INT8 = int8_table()


@njit(inline="always")
def dot_lanes(x, m, buf, k0, L):
    """x[m, k0:k0+L] . buf[0:L] in a fixed order: 8 interleaved partial sums (lane = j % 8),
    combined ((0+1)+(2+3))+((4+5)+(6+7)). Independent of anything but L."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    j = 0
    while j + 8 <= L:
        a0 += x[m, k0 + j] * buf[j]
        a1 += x[m, k0 + j + 1] * buf[j + 1]
        a2 += x[m, k0 + j + 2] * buf[j + 2]
        a3 += x[m, k0 + j + 3] * buf[j + 3]
        a4 += x[m, k0 + j + 4] * buf[j + 4]
        a5 += x[m, k0 + j + 5] * buf[j + 5]
        a6 += x[m, k0 + j + 6] * buf[j + 6]
        a7 += x[m, k0 + j + 7] * buf[j + 7]
        j += 8
    r = L - j  # tail: lanes 0..r-1
    if r > 0:
        a0 += x[m, k0 + j] * buf[j]
    if r > 1:
        a1 += x[m, k0 + j + 1] * buf[j + 1]
    if r > 2:
        a2 += x[m, k0 + j + 2] * buf[j + 2]
    if r > 3:
        a3 += x[m, k0 + j + 3] * buf[j + 3]
    if r > 4:
        a4 += x[m, k0 + j + 4] * buf[j + 4]
    if r > 5:
        a5 += x[m, k0 + j + 5] * buf[j + 5]
    if r > 6:
        a6 += x[m, k0 + j + 6] * buf[j + 6]
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@njit(inline="always")
def _bytes_cols(x, w, lut, scale, bn, bk, y, n0, n1, buf, acc):
    """Columns n0..n1-1 of y = x @ W.T, W[n, k] = lut[w[n, k]] * scale[n // bn, k // bk]."""
    M, K = x.shape
    nkb = (K + bk - 1) // bk
    for n in range(n0, n1):
        for m in range(M):
            acc[m] = np.float32(0.0)
        srow = n // bn
        for b in range(nkb):
            k0 = b * bk
            L = min(bk, K - k0)
            for j in range(L):
                buf[j] = lut[w[n, k0 + j]]
            s = scale[srow, b]
            for m in range(M):
                acc[m] = acc[m] + dot_lanes(x, m, buf, k0, L) * s
        for m in range(M):
            y[m, n] = acc[m]


@njit(nogil=True, cache=True)
def _bytes_ser(x, w, lut, scale, bn, bk, y):
    buf = np.empty(bk, np.float32)
    acc = np.empty(x.shape[0], np.float32)
    _bytes_cols(x, w, lut, scale, bn, bk, y, 0, w.shape[0], buf, acc)


@njit(parallel=True, nogil=True, cache=True)
def _bytes_par(x, w, lut, scale, bn, bk, y):
    N = w.shape[0]
    for c in prange((N + COLS - 1) // COLS):
        buf = np.empty(bk, np.float32)
        acc = np.empty(x.shape[0], np.float32)
        _bytes_cols(x, w, lut, scale, bn, bk, y, c * COLS, min(N, (c + 1) * COLS), buf, acc)


def matmul_bytes(arrays: dict, x: np.ndarray, y: np.ndarray, parallel: bool) -> np.ndarray:
    """StoredWeight hook: arrays {"w": uint8 [N, K], "lut": f32 [256], "scale": f32 [gn, gk],
    "block": int64 [2] (bn, bk)}."""
    bn, bk = int(arrays["block"][0]), int(arrays["block"][1])
    (_bytes_par if parallel else _bytes_ser)(x, arrays["w"], arrays["lut"], arrays["scale"], bn, bk, y)
    return y


def dequantize_bytes(arrays: dict, shape) -> np.ndarray:
    """Dense f32 [N, K]: lut[w] * the scale of its block (numpy reference)."""
    N, K = shape
    bn, bk = int(arrays["block"][0]), int(arrays["block"][1])
    s = np.repeat(np.repeat(arrays["scale"], bn, axis=0)[:N], bk, axis=1)[:, :K]  # [N, K]
    return arrays["lut"][arrays["w"]] * s


def linear_bytes_reference(x: np.ndarray, arrays: dict, shape) -> np.ndarray:
    return np.asarray(x, np.float32) @ dequantize_bytes(arrays, shape).T
