"""FP8 dynamic per-token activations (compressed-tensors float-quantized "FP8_DYNAMIC":
`input_activations: {num_bits 8, type float, strategy token, dynamic true}`), in front of the
one-byte weight kernel (bytes_kernel.py).

compressed-tensors' rule (calculate_qparams with the e4m3 range [-448, 448], then its
quantize-dequantize), per activation row m:

    s[m] = max_k |x[m, k]| / 448                      (f32; an all-zero row: the f32 epsilon)
    x'[m, k] = e4m3(clamp(x[m, k] / s[m], -448, 448)) * s[m]

with e4m3(.) the round-to-nearest-even cast to float8_e4m3fn. x' then meets the FP8 weights in
the byte kernel (each product of two e4m3 values is exact in f32; the sums are the kernel's fixed
order). Rows are quantized on their own: Q rows == Q one-row products, bit for bit.
"""

from __future__ import annotations

import numpy as np

from .bytes_kernel import matmul_bytes

E4M3_MAX = np.float32(448.0)
EPS = np.float32(np.finfo(np.float32).eps)


def round_e4m3(v: np.ndarray) -> np.ndarray:
    """f32 values with |v| <= 448 -> the nearest e4m3fn value (ties to even), as f32. Normal
    e4m3 numbers have 3 mantissa bits (a quantum of 2^(e-3) in [2^e, 2^(e+1))); below 2^-6 the
    subnormals have the fixed quantum 2^-9. v / quantum is exact (a power of two), np.rint rounds
    half to even, and the product back is exact."""
    v = np.asarray(v, np.float32)
    _, E = np.frexp(v)  # v = m 2^E, 0.5 <= |m| < 1: the binade [2^(E-1), 2^E)
    quantum = np.ldexp(np.float32(1.0), np.maximum(E - 4, -9)).astype(np.float32)
    return (np.rint(v / quantum) * quantum).astype(np.float32)


def quantize_tokens_fp8(x: np.ndarray) -> np.ndarray:
    """x [M, K] f32 -> x' [M, K] f32 by the rule above."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    s = (amax / E4M3_MAX).astype(np.float32)
    s = np.where(s == 0, EPS, s).astype(np.float32)[:, None]
    return np.ascontiguousarray(round_e4m3(np.clip(x / s, -E4M3_MAX, E4M3_MAX)) * s, dtype=np.float32)


def matmul_fp8_dynamic(arrays: dict, x: np.ndarray, y: np.ndarray, parallel: bool) -> np.ndarray:
    return matmul_bytes(arrays, quantize_tokens_fp8(x), y, parallel)
