"""4-bit integer weights with a scale and an integer zero per (output, group): the one layout
compressed-tensors pack-quantized, AWQ and GPTQ are all computed on (their planners:
compressed_tensors.py, awq_gptq.py).

Layout held in memory (`arrays` of a StoredWeight, kind "int4"):

    packed   uint32 [N, ceil(K/8)]  the code of (n, k) in word k // 8, bits 4*(k % 8) .. +3
                                    (least significant nibble first: compressed-tensors' own
                                    packing, so its weight_packed is used as mapped, zero-copy;
                                    AWQ / GPTQ are repacked once at load, still 4 bits a weight)
    zero     uint8 [N, G]          the code that means 0 (symmetric int4: 8)
    scale    f32 [N, G]
    seg      int32 [S + 1]         k offsets of the segments (each one group's run of columns)
    seg_group int32 [S]            the group of each segment
    perm     int32 [K] or absent   GPTQ desc_act: column k of the packed weight is column perm[k]
                                   of the model's weight (the activation is gathered the same way)

    W[n, perm[k]] = (code(n, k) - zero[n, g]) * scale[n, g],   g = seg_group of k's segment

The kernel decodes one segment of a weight row into a small f32 buffer (codes minus zero are
small integers: exact), dots it with each activation row in bytes_kernel.dot_lanes' fixed order
and adds `partial * scale` to that output's accumulator, segment by segment: every output's
arithmetic is independent of the row count and of the thread split (threads own whole output
columns), so a Q-row product equals Q one-row products bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .bytes_kernel import COLS, dot_lanes


@njit(inline="always")
def _int4_cols(x, packed, zero, scale, seg, seg_group, y, n0, n1, buf, acc):
    M = x.shape[0]
    S = seg_group.shape[0]
    for n in range(n0, n1):
        for m in range(M):
            acc[m] = np.float32(0.0)
        for s in range(S):
            k0, k1, g = seg[s], seg[s + 1], seg_group[s]
            z = np.int32(zero[n, g])
            for k in range(k0, k1):
                u = (packed[n, k >> 3] >> np.uint32((k & 7) * 4)) & np.uint32(15)
                buf[k - k0] = np.float32(np.int32(u) - z)
            sc = scale[n, g]
            for m in range(M):
                acc[m] = acc[m] + dot_lanes(x, m, buf, k0, k1 - k0) * sc
        for m in range(M):
            y[m, n] = acc[m]


@njit(nogil=True, cache=True)
def _int4_ser(x, packed, zero, scale, seg, seg_group, maxlen, y):
    buf = np.empty(maxlen, np.float32)
    acc = np.empty(x.shape[0], np.float32)
    _int4_cols(x, packed, zero, scale, seg, seg_group, y, 0, packed.shape[0], buf, acc)


@njit(parallel=True, nogil=True, cache=True)
def _int4_par(x, packed, zero, scale, seg, seg_group, maxlen, y):
    N = packed.shape[0]
    for c in prange((N + COLS - 1) // COLS):
        buf = np.empty(maxlen, np.float32)
        acc = np.empty(x.shape[0], np.float32)
        _int4_cols(x, packed, zero, scale, seg, seg_group, y, c * COLS, min(N, (c + 1) * COLS), buf, acc)


def matmul_int4(arrays: dict, x: np.ndarray, y: np.ndarray, parallel: bool) -> np.ndarray:
    perm = arrays.get("perm")
    if perm is not None:
        x = np.ascontiguousarray(x[:, perm])  # [M, K] in the packed column order
    seg = arrays["seg"]
    maxlen = max(1, int(np.max(np.diff(seg)))) if seg.shape[0] > 1 else 1
    (_int4_par if parallel else _int4_ser)(x, arrays["packed"], arrays["zero"], arrays["scale"], seg,
                                           arrays["seg_group"], maxlen, y)
    return y


# ------------------------------------------------------------------ layout helpers (numpy, load time)
def unpack_codes(packed: np.ndarray, K: int) -> np.ndarray:
    """uint32 [N, ceil(K/8)] -> uint8 codes [N, K] (least significant nibble first)."""
    p = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(8, dtype=np.uint32) * 4)
    codes = ((p[:, :, None] >> shifts) & np.uint32(15)).astype(np.uint8)  # [N, KW, 8]
    return codes.reshape(p.shape[0], -1)[:, :K]


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [N, K] (0..15) -> uint32 [N, ceil(K/8)], least significant nibble first."""
    N, K = codes.shape
    KW = -(-K // 8)
    c = np.zeros((N, KW * 8), np.uint32)
    c[:, :K] = codes
    c = c.reshape(N, KW, 8) << (np.arange(8, dtype=np.uint32) * 4)
    return np.bitwise_or.reduce(c, axis=2).astype(np.uint32)


def group_segments(K: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous groups of `group` columns (the last one shorter): (seg [S+1], seg_group [S])."""
    seg = np.append(np.arange(0, K, group), K).astype(np.int32)
    return seg, np.arange(seg.shape[0] - 1, dtype=np.int32)


def index_segments(g_idx: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """A per-column group index -> (perm or None, seg, seg_group): columns stably sorted by group
    (perm None when they already are), each run of one group a segment."""
    g_idx = np.asarray(g_idx, np.int64)
    order = np.argsort(g_idx, kind="stable")
    perm = None if np.all(np.diff(g_idx) >= 0) else order.astype(np.int32)
    sg = g_idx[order]
    starts = np.flatnonzero(np.r_[True, sg[1:] != sg[:-1]])
    seg = np.append(starts, g_idx.shape[0]).astype(np.int32)
    return perm, seg, sg[starts].astype(np.int32)


def make_arrays(packed, zero, scale, seg, seg_group, perm=None) -> dict:
    out = {"packed": packed, "zero": np.ascontiguousarray(zero, np.uint8), "scale": np.ascontiguousarray(scale, np.float32),
           "seg": np.ascontiguousarray(seg, np.int32), "seg_group": np.ascontiguousarray(seg_group, np.int32)}
    if perm is not None:
        out["perm"] = np.ascontiguousarray(perm, np.int32)
    return out


def dequantize_int4(arrays: dict, shape) -> np.ndarray:
    """Dense f32 [N, K] (numpy reference): (code - zero) * scale per segment, columns put back
    in the model's order."""
    N, K = shape
    codes = unpack_codes(arrays["packed"], K).astype(np.float32)  # [N, K] packed order
    seg, sg = arrays["seg"], arrays["seg_group"]
    gcol = np.repeat(sg, np.diff(seg))  # [K] group of each packed column
    w = (codes - arrays["zero"][:, gcol].astype(np.float32)) * arrays["scale"][:, gcol]
    perm = arrays.get("perm")
    if perm is not None:
        out = np.empty_like(w)
        out[:, perm] = w
        w = out
    return w


def resident(N: int, K: int, G: int, perm: bool) -> int:
    return N * (-(-K // 8)) * 4 + N * G * 5 + (4 * K if perm else 0) + 8 * (G + 1)
