"""MXFP4 GEMV on the stored bytes (quant/mxfp4_gemv.py) against the format's float64 definition.

Every instruction-set path gives the same bits: tests/test_quant.py::test_every_path_gives_the_same_bits
runs this kernel on each lower path too."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dflash2_numba.quant.mxfp4 import dequantize_mxfp4
from dflash2_numba.quant.mxfp4_gemv import E2M1, gemv_mxfp4


def gemv_mxfp4_reference(x, blocks, scales):
    """[M, N] float64: x times the format's definition (quant/mxfp4.py), dequantized exactly in f32."""
    return np.asarray(x, np.float64) @ dequantize_mxfp4(blocks[None], scales[None])[0].astype(np.float64).T


def _e2m1_reference(code: int) -> float:
    """The OCP MX e2m1 value of a 4-bit code, from its fields (sign, 2-bit exponent, 1 mantissa bit)."""
    sign, e, m = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def test_the_table_is_e2m1():
    assert [float(v) for v in E2M1] == [_e2m1_reference(c) for c in range(16)]


def _case(rng, M, N, K, lo=110, hi=135):
    blocks = rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8)
    scales = rng.integers(lo, hi, (N, K // 32), dtype=np.uint8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    return x, blocks, scales


def _run(x, blocks, scales, parallel=False):
    y = np.full((len(x), blocks.shape[0]), np.nan, np.float32)
    return gemv_mxfp4(x, blocks, scales, y, parallel)


@pytest.mark.parametrize("M,N,K", [(1, 1, 32), (3, 17, 64), (5, 40, 2880), (8, 33, 96)])
def test_matches_the_definition(M, N, K):
    """Within f32 rounding of the float64 product of the dequantized weight (low nibble = even
    element, scale 2^(s - 127)); serial == parallel bit for bit."""
    x, blocks, scales = _case(np.random.default_rng(M * 1000 + N), M, N, K)
    y = _run(x, blocks, scales)
    ref = gemv_mxfp4_reference(x, blocks, scales)
    assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()
    assert np.array_equal(_run(x, blocks, scales, parallel=True), y)


def test_element_order_and_scales_one_by_one():
    """One code at a time: element k of a row is the low nibble of byte k // 2 (k even) or the high
    one (k odd), times 2^(s - 127) of its block; s = 0 is 2^-127 and s = 255 inf, as ldexp gives."""
    K = 64
    x = np.zeros((1, K), np.float32)
    for k in (0, 1, 2, 17, 31, 32, 63):
        for s in (0, 1, 120, 127, 140, 254):
            blocks = np.zeros((1, K // 32, 16), np.uint8)
            blocks[0, k // 32, (k % 32) // 2] = 0x7 if k % 2 == 0 else 0x70  # code 7 = 6.0 at element k
            scales = np.full((1, K // 32), 127, np.uint8)
            scales[0, k // 32] = s
            x[:] = 0
            x[0, k] = 1.0
            want = np.float32(6.0 * np.ldexp(1.0, s - 127))  # s = 254: 6 * 2^127 overflows to inf, as f32 does
            assert _run(x, blocks, scales)[0, 0] == want, (k, s)


def test_rows_are_independent_bit_for_bit():
    x, blocks, scales = _case(np.random.default_rng(3), 11, 45, 160)
    whole = _run(x, blocks, scales)
    for r in range(11):
        assert np.array_equal(_run(x[r:r + 1], blocks, scales)[0], whole[r])
    for m in (2, 3, 4, 5, 8):
        assert np.array_equal(_run(x[:m], blocks, scales), whole[:m])


def test_thread_count_changes_no_bit():
    x, blocks, scales = _case(np.random.default_rng(4), 3, 100, 128)
    saved = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _run(x, blocks, scales, parallel=True)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert np.array_equal(_run(x, blocks, scales, parallel=True), one)
    finally:
        numba.set_num_threads(saved)
