"""q8_0 / q4_0 quantization straight into the kernels' panels, in numba (the load-time path).

    qw, ws = quantize_pack(w [N, K] bf16 bits | f32, "q4_0", unsigned)   # == formats.pack(quantize_q4_0(w))

formats.py holds the same math in vectorised numpy (llama.cpp's reference quantizers) and the
panel layout; it stays the reference the tests compare with. The numpy version makes several
full-size f32 / f64 temporaries and then re-packs: a 30B MoE at q4_0 spent minutes of its load
there. This one reads each 32-block once and writes its bytes where the panels want them,
with no temporary beyond one block, and releases the GIL (the loader's thread pool runs several
tensors at once). Per block, exactly formats.py's f32 operations, in the same order:
    q8_0: d = amax / 127, id = 1 / d (0 if d = 0), q = roundf(x * id)      (ties away from zero)
    q4_0: m = first element of largest |x|, d = m / -8, id = 1 / d (0 if d = 0),
          q = min(15, trunc(x * id + 8.5)) - 8
    d is stored as fp16 bits, rounded to nearest even (numpy's astype(float16), overflow -> inf).
K must be a multiple of 32 (quant/weights.py checks it); N is padded with zero columns to whole
work items of 128, as formats.pack does.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..numerics import _f32_as_u32, _u32_as_f32
from .formats import BLOCK, ITEM_COLS, ITEM_PANELS, PANEL_COLS


@njit(inline="always")
def f16_bits(v):
    """f32 -> IEEE fp16 bits, round to nearest even (numpy's astype(np.float16)): normals,
    subnormals (multiples of 2^-24), overflow to inf, NaN kept NaN."""
    b = _f32_as_u32(v)
    sign = np.uint16((b >> np.uint32(16)) & np.uint32(0x8000))
    e = np.int64((b >> np.uint32(23)) & np.uint32(0xFF))
    m = np.int64(b & np.uint32(0x7FFFFF))
    if e == 0xFF:
        return sign | np.uint16(0x7C00 | (0x200 if m else 0))
    E = e - 127
    if E > 15:
        return sign | np.uint16(0x7C00)
    if E >= -14:  # an fp16 normal: keep 10 of the 23 mantissa bits; a carry rounds into the exponent
        full = ((E + 15) << 10) | (m >> 13)
        rem = m & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (full & 1)):
            full += 1
        return sign | np.uint16(full)
    if E < -25 or e == 0:  # below half the smallest subnormal (f32 subnormals included): zero
        return sign
    mant = m | 0x800000  # value = mant * 2^(E - 23) = (mant >> s) * 2^-24, s = -E - 1 in 14 .. 24
    s = -E - 1
    q = mant >> s
    rem = mant & ((1 << s) - 1)
    half = 1 << (s - 1)
    if rem > half or (rem == half and (q & 1)):
        q += 1
    return sign | np.uint16(q)


def _load(w, n, k):  # pragma: no cover - typing stub, see the overload
    raise NotImplementedError


@overload(_load, inline="always")
def _load_impl(w, n, k):
    """w[n, k] as f32: bf16 bits (uint16) widened exactly, or f32 as is."""
    if w.dtype == types.uint16:
        return lambda w, n, k: _u32_as_f32(np.uint32(w[n, k]) << np.uint32(16))
    return lambda w, n, k: np.float32(w[n, k])


@njit(inline="always")
def _roundf(v):
    """C roundf of an f32 (half away from zero), exact in f64."""
    x = np.float64(v)
    return np.trunc(x + 0.5) if x >= 0.0 else np.trunc(x - 0.5)


@njit(inline="always")
def _block_q4_0(w, n, k0, q):
    """One 32-block of row n -> q[0:32] in -8..7; returns d (quantize_row_q4_0_ref)."""
    amax, m = np.float32(0.0), np.float32(0.0)
    for j in range(BLOCK):
        x = _load(w, n, k0 + j)
        if abs(x) > amax:  # strict: the first of equal magnitudes wins
            amax, m = abs(x), x
    d = m / np.float32(-8.0)
    inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    for j in range(BLOCK):
        v = _load(w, n, k0 + j) * inv + np.float32(8.5)
        q[j] = min(15, np.int32(np.trunc(v))) - 8
    return d


@njit(inline="always")
def _block_q8_0(w, n, k0, q):
    """One 32-block of row n -> q[0:32] in -127..127; returns d (quantize_row_q8_0_ref)."""
    amax = np.float32(0.0)
    for j in range(BLOCK):
        amax = max(amax, abs(_load(w, n, k0 + j)))
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    for j in range(BLOCK):
        q[j] = np.int32(_roundf(_load(w, n, k0 + j) * inv))
    return d


@njit(cache=True, nogil=True)
def _pack_q4_0(w, p0, p1, qw, ws):
    """Panels p0 .. p1-1 of w [N, K] -> qw [NP, K/2, 32] uint8, ws [NP, nb, 32] fp16 bits.
    Block bytes [h < 4][column][j]: low nibble = q + 8 of k-quad h, high nibble of k-quad h + 4."""
    N, K = w.shape
    q = np.zeros(BLOCK, np.int32)
    for p in range(p0, p1):
        flat = qw[p].reshape(-1)  # the panel's bytes
        for c in range(PANEL_COLS):
            n = p * PANEL_COLS + c
            for b in range(K // BLOCK):
                d = _block_q4_0(w, n, b * BLOCK, q) if n < N else np.float32(0.0)
                if n >= N:
                    q[:] = 0
                ws[p, b, c] = f16_bits(d)
                for h in range(4):
                    for j in range(4):
                        lo, hi = q[4 * h + j] + 8, q[16 + 4 * h + j] + 8
                        flat[b * 512 + h * 128 + c * 4 + j] = np.uint8(lo | (hi << 4))


@njit(cache=True, nogil=True)
def _pack_q8_0(w, unsigned, p0, p1, qw, ws):
    """Panels p0 .. p1-1 of w [N, K] -> qw [NP, K, 32] int8, ws [NP, nb, 32] fp16 bits. Bytes
    [k-quad][column][j]; the VNNI paths (unsigned) store q + 128."""
    N, K = w.shape
    q = np.zeros(BLOCK, np.int32)
    for p in range(p0, p1):
        flat = qw[p].reshape(-1)
        for c in range(PANEL_COLS):
            n = p * PANEL_COLS + c
            for b in range(K // BLOCK):
                d = _block_q8_0(w, n, b * BLOCK, q) if n < N else np.float32(0.0)
                if n >= N:
                    q[:] = 0
                ws[p, b, c] = f16_bits(d)
                for kq in range(8):
                    for j in range(4):
                        v = q[4 * kq + j] + (128 if unsigned else 0)
                        flat[(b * 8 + kq) * 128 + c * 4 + j] = np.int8(np.uint8(v & 0xFF))


def panel_count(N: int) -> int:
    """Panels (of 32 columns) of an N-row weight, padded to whole work items (formats.pack)."""
    return -(-N // ITEM_COLS) * ITEM_PANELS


def empty_panels(N: int, K: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    NP = panel_count(N)
    if fmt == "q4_0":
        return np.empty((NP, K // 2, PANEL_COLS), np.uint8), np.empty((NP, K // BLOCK, PANEL_COLS), np.uint16)
    return np.empty((NP, K, PANEL_COLS), np.int8), np.empty((NP, K // BLOCK, PANEL_COLS), np.uint16)


def quantize_pack_range(w: np.ndarray, fmt: str, unsigned: bool, panels, p0: int, p1: int) -> None:
    """Fill panels p0 .. p1-1 of `panels` (empty_panels) from w [N, K] (uint16 bf16 bits or f32)."""
    qw, ws = panels
    if fmt == "q4_0":
        _pack_q4_0(w, p0, p1, qw, ws)
    else:
        _pack_q8_0(w, unsigned, p0, p1, qw, ws)


def quantize_pack(w: np.ndarray, fmt: str, unsigned: bool) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (qw, ws), the panels formats.pack(QUANTIZERS[fmt](w)) gives, in one pass."""
    panels = empty_panels(w.shape[0], w.shape[1], fmt)
    quantize_pack_range(w, fmt, unsigned, panels, 0, panels[0].shape[0])
    return panels
