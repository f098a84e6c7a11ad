"""llama.cpp's Q4_K: the block bytes (ggml's reference quantizer's algorithm, operation for operation) and the
panel layout the q4_k kernels read (quant/kernels_q4k.py).

    blocks = quantize_q4_k(w [N, K])          # uint8 [N, K/256, 144]: llama.cpp's block_q4_K bytes
    w = dequantize_q4_k(blocks)                # f32 [N, K]: ggml's dequantize_row_q4_K
    qw, meta = pack(blocks, N)                 # the panels

A super-block is 256 weights of one row, eight sub-blocks of 32 (ggml-common.h block_q4_K):

    bytes 0..1    d     fp16   scale of the sub-block scales
    bytes 2..3    dmin  fp16   scale of the sub-block mins
    bytes 4..15   scales[12]   8 six-bit scales sc_j and 8 six-bit mins m_j (get_scale_min_k4):
                               j < 4: sc_j = s[j] & 63, m_j = s[j+4] & 63;
                               j >= 4: sc_j = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
                                       m_j = (s[j+4] >> 4) | (s[j] >> 6) << 4
    bytes 16..143 qs[128]      nibbles: byte 32c + l holds weight 64c + l (low) and 64c + 32 + l (high)

    w[32j + i] = d * sc_j * q[32j + i] - dmin * m_j        (q in 0..15)

The quantizer is ggml-quants.c quantize_row_q4_K_ref (what llama_model_quantize runs for Q4_K
without an importance matrix): per sub-block make_qkx2_quants(32, 15, x, weights = av_x + |x|,
rmin -1, rdelta 0.1, nstep 20) fits (scale, min) by weighted least squares over 21 trial
scales; the eight scales and mins are quantized to 6 bits against their maxima (d = max / 63 in
fp16), and the nibbles are requantized with the stored d * sc, dmin * m. Every float operation
is the C code's, in f32, in the C order (no fma: ggml-base is built without -march flags), and
nearest_int is ggml's own bit trick (x + 1.5 * 2^23, ties to even), so the bytes equal
llama.cpp's (tests/test_q4_k.py checks against llama.cpp's ggml_quantize_chunk).

Panel layout (N padded with zero columns to whole work items, as formats.pack):
    qw   uint8 [NP, K/2, 32]       per 32-block: [pair h < 4][column c][byte j]: low nibble =
                                   q of k = 4h + j, high nibble = q of k = 4(h + 4) + j (the
                                   q4_0 panel order; q stays 0..15: vpdpbusd's unsigned operand)
    meta uint8 [NP, K/256, 640]    per (panel, super-block): [16][32] six-bit sc_0..7 then
                                   m_0..7 per column, then 32 fp16 d and 32 fp16 dmin (bits)
So a loaded weight holds 0.578 bytes a weight (llama.cpp's block: 0.5625).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..errors import QuantizeError
from ..numerics import _f32_as_u32
from .formats import ITEM_COLS, ITEM_PANELS, PANEL_COLS
from .kernels_int8 import round_f16

QK_K = 256
SUB = 32
BLOCK_BYTES = 144
META_BYTES = 16 * PANEL_COLS + 4 * PANEL_COLS  # 640: scales / mins, d, dmin per (panel, super-block)


# ------------------------------------------------------------------ ggml's reference quantizer
@njit(inline="always")
def nearest_int(v):
    """ggml's nearest_int: f32 v + 12582912 (1.5 * 2^23) keeps the rounded integer in the low
    mantissa bits (round to nearest even; |v| <= 4194303 as the C code asserts)."""
    bits = _f32_as_u32(np.float32(v + np.float32(12582912.0)))
    return np.int32(bits & np.uint32(0x007FFFFF)) - np.int32(0x00400000)


@njit(inline="always")
def _clamp(v, hi):
    return max(0, min(hi, v))


@njit(inline="always")
def make_qkx2_quants(x, w, L, Laux, nmax, rmin, rdelta, nstep):
    """ggml-quants.c make_qkx2_quants (use_mad false) on x[0:n] with weights w -> (scale, the_min);
    L holds the chosen levels. Every operation f32, in the C order."""
    n = x.shape[0]
    fmax = np.float32(nmax)
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > np.float32(0.0):
        mn = np.float32(0.0)
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), -mn
    iscale = fmax / (mx - mn)
    scale = np.float32(1.0) / iscale
    best_error = np.float32(0.0)
    for i in range(n):
        L[i] = _clamp(nearest_int(iscale * (x[i] - mn)), nmax)
        diff = scale * np.float32(L[i]) + mn - x[i]
        best_error += w[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + fmax) / (mx - mn)
        sum_l, sum_l2, sum_xl = np.float32(0.0), np.float32(0.0), np.float32(0.0)
        for i in range(n):
            lv = _clamp(nearest_int(iscale * (x[i] - mn)), nmax)
            Laux[i] = lv
            lf = np.float32(lv)
            sum_l += w[i] * lf
            sum_l2 += w[i] * lf * lf
            sum_xl += w[i] * lf * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > np.float32(0.0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > np.float32(0.0):
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = np.float32(0.0)
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                cur_error += w[i] * (diff * diff)
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(inline="always")
def scale_min_k4(j, s):
    """get_scale_min_k4: the 6-bit (scale, min) of sub-block j from the 12 packed bytes s."""
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


@njit(inline="always")
def _quantize_row(x, out, dd, n):
    """Row n of x [N, K] f32 (K % 256 == 0) -> out[n] [K/256, 144] uint8: quantize_row_q4_K_ref,
    with d and dmin (fp16 values) in dd[n] [K/256, 2] f32 (the caller stores their fp16 bits)."""
    K = x.shape[1]
    L = np.zeros(QK_K, np.uint8)
    Laux = np.zeros(SUB, np.uint8)
    wts = np.empty(SUB, np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    for b in range(K // QK_K):
        xb = x[n, b * QK_K:(b + 1) * QK_K]
        y = out[n, b]
        max_scale, max_min = np.float32(0.0), np.float32(0.0)
        for j in range(8):
            xs = xb[SUB * j:SUB * (j + 1)]
            sum_x2 = np.float32(0.0)
            for i in range(SUB):
                sum_x2 += xs[i] * xs[i]
            av_x = np.float32(np.sqrt(sum_x2 / np.float32(32.0)))
            for i in range(SUB):
                wts[i] = av_x + abs(xs[i])
            scales[j], mins[j] = make_qkx2_quants(xs, wts, L[SUB * j:SUB * (j + 1)], Laux, 15,
                                                  np.float32(-1.0), np.float32(0.1), 20)
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = np.float32(63.0) / max_scale if max_scale > np.float32(0.0) else np.float32(0.0)
        inv_min = np.float32(63.0) / max_min if max_min > np.float32(0.0) else np.float32(0.0)
        s = y[4:16]
        for j in range(8):
            ls = min(63, nearest_int(inv_scale * scales[j]) & 255)  # (uint8_t) then MIN
            lm = min(63, nearest_int(inv_min * mins[j]) & 255)
            if j < 4:
                s[j] = ls
                s[j + 4] = lm
            else:
                s[j + 4] = (ls & 15) | ((lm & 15) << 4)
                s[j - 4] |= (ls >> 4) << 6
                s[j] |= (lm >> 4) << 6
        d = round_f16(max_scale / np.float32(63.0))  # GGML_FP32_TO_FP16, read back as f32
        dmin = round_f16(max_min / np.float32(63.0))
        dd[n, b, 0], dd[n, b, 1] = d, dmin
        for j in range(8):
            sc, m = scale_min_k4(j, s)
            dj = d * np.float32(sc)
            if dj == np.float32(0.0):
                continue  # L keeps make_qkx2_quants' levels, as in the C code
            dm = dmin * np.float32(m)
            for i in range(SUB):
                L[SUB * j + i] = _clamp(nearest_int((xb[SUB * j + i] + dm) / dj), 15)
        for c in range(4):
            for i in range(32):
                y[16 + 32 * c + i] = L[64 * c + i] | (L[64 * c + 32 + i] << 4)


@njit(cache=True, nogil=True)
def _quantize_rows_ser(x, out, dd):
    for n in range(x.shape[0]):
        _quantize_row(x, out, dd, n)


@njit(cache=True, nogil=True, parallel=True)
def _quantize_rows_par(x, out, dd):
    """Rows on every thread: each row's bytes are computed alone (the same for any thread count).
    Used for big tensors only: its parfor costs ~3 s more to compile than the serial loop."""
    for n in prange(x.shape[0]):
        _quantize_row(x, out, dd, n)


PARALLEL_MIN_ELEMS = 1 << 22  # ~0.3 s of serial quantizing


def check(w, name: str) -> None:
    """QuantizeError unless w is a non-empty 2-D bf16 (uint16) / f16 / f32 array with K % 256 == 0."""
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.size == 0:
        raise QuantizeError(f"{name}: q4_k needs a non-empty 2-D weight, got {getattr(w, 'shape', type(w).__name__)}")
    if w.shape[1] % QK_K:
        raise QuantizeError(f"{name}: q4_k needs input features (shape[1]) a multiple of {QK_K} (its super-block), "
                            f"got shape {list(w.shape)} (llama.cpp falls back to q5_0 there; use q4_0 or q8_0)")
    if w.dtype not in (np.uint16, np.float32, np.float16):
        raise QuantizeError(f"{name}: q4_k quantizes bf16 / f16 / f32 weights, got dtype {w.dtype}")


def as_f32(w: np.ndarray, name: str) -> np.ndarray:
    """A checked weight -> f32 (bf16 widened exactly)."""
    check(w, name)
    if w.dtype == np.uint16:
        return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.ascontiguousarray(w, np.float32)


def quantize_q4_k(w: np.ndarray, name: str = "weight") -> np.ndarray:
    """w [N, K] -> uint8 [N, K/256, 144]: llama.cpp's block_q4_K bytes of every row."""
    x = as_f32(w, name)
    out = np.zeros((x.shape[0], x.shape[1] // QK_K, BLOCK_BYTES), np.uint8)
    dd = np.zeros((x.shape[0], x.shape[1] // QK_K, 2), np.float32)
    (_quantize_rows_par if x.size >= PARALLEL_MIN_ELEMS else _quantize_rows_ser)(x, out, dd)
    out[:, :, 0:4] = dd.astype(np.float16).view(np.uint8)  # exact: the values are fp16 already
    return out


# ------------------------------------------------------------------ reading the blocks (numpy)
def unpack_blocks(blocks: np.ndarray):
    """uint8 [N, nsb, 144] -> (q uint8 [N, K] 0..15, sc uint8 [N, nsb, 8], m uint8 [N, nsb, 8],
    d f16 [N, nsb], dmin f16 [N, nsb]), ggml's field layout (get_scale_min_k4, the nibble order)."""
    N, nsb, _ = blocks.shape
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    dmin = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
    s = blocks[:, :, 4:16]
    lo = s[:, :, 0:4], s[:, :, 4:8], s[:, :, 8:12]
    sc = np.concatenate([lo[0] & 63, (lo[2] & 15) | ((lo[0] >> 6) << 4)], axis=2)
    m = np.concatenate([lo[1] & 63, (lo[2] >> 4) | ((lo[1] >> 6) << 4)], axis=2)
    qs = blocks[:, :, 16:].reshape(N, nsb, 4, 32)  # [.., chunk c, l]: weights 64c + l, 64c + 32 + l
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, nsb * QK_K)  # [.., c, half, l]
    return q, sc, m, d, dmin


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [N, nsb, 144] -> f32 [N, nsb*256], ggml's dequantize_row_q4_K: d1 = d * sc,
    m1 = dmin * m (f32), w = d1 * q - m1."""
    q, sc, m, d, dmin = unpack_blocks(blocks)
    N, nsb = d.shape
    d1 = d.astype(np.float32)[:, :, None] * sc.astype(np.float32)  # [N, nsb, 8]
    m1 = dmin.astype(np.float32)[:, :, None] * m.astype(np.float32)
    qf = q.reshape(N, nsb, 8, SUB).astype(np.float32)
    return (d1[..., None] * qf - m1[..., None]).astype(np.float32).reshape(N, nsb * QK_K)


# ------------------------------------------------------------------ panel layout
def pack(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [N, nsb, 144] -> (qw uint8 [NP, K/2, 32], meta uint8 [NP, nsb, 640]) (module docstring)."""
    q, sc, m, d, dmin = unpack_blocks(blocks)
    N, K = q.shape
    nsb = K // QK_K
    NP = -(-N // ITEM_COLS) * ITEM_PANELS
    C = NP * PANEL_COLS

    def padded(a):
        out = np.zeros((C,) + a.shape[1:], a.dtype)
        out[:N] = a
        return out

    quads = padded(q).reshape(NP, PANEL_COLS, K // 4, 4).transpose(0, 2, 1, 3)  # [NP, kq, c, j]
    u = quads.reshape(NP, K // SUB, 8, PANEL_COLS, 4)
    qw = np.ascontiguousarray(u[:, :, :4] | (u[:, :, 4:] << np.uint8(4))).reshape(NP, K // 2, PANEL_COLS)
    meta = np.zeros((NP, nsb, META_BYTES), np.uint8)
    sm = np.concatenate([padded(sc), padded(m)], axis=2)  # [C, nsb, 16]
    meta[:, :, :16 * PANEL_COLS] = sm.reshape(NP, PANEL_COLS, nsb, 16).transpose(0, 2, 3, 1).reshape(NP, nsb, -1)
    for i, h in enumerate((d, dmin)):
        bits = padded(h).view(np.uint16).reshape(NP, PANEL_COLS, nsb).transpose(0, 2, 1)  # [NP, nsb, 32]
        at = 16 * PANEL_COLS + i * 2 * PANEL_COLS
        meta[:, :, at:at + 2 * PANEL_COLS] = np.ascontiguousarray(bits).view(np.uint8)
    return qw, meta


def resident_bytes_per_weight() -> float:
    return 0.5 + META_BYTES / (PANEL_COLS * QK_K)
