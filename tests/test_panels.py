"""The panel GEMV (kernels/panels.py) against plain numpy, and the properties its design claims.

Mutations tried on kernels/panels.py, each turning this file red:
- pack_panels with the two halves of a lane swapped (column i+16 in the low half):
  test_matches_reference_over_shapes;
- the 2x4 tile skipped for a 2- or 3-row remainder: test_matches_reference_over_shapes
  (rows 2, 3, 6, 7, ...);
- a parallel split that drops the last work item (prange over items - 1):
  test_parallel_split_equals_serial and test_matches_reference_over_shapes (threshold 0);
- a k loop that stops one step early (K-1): test_matches_reference_over_shapes.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dflash2_numba.decode.warmup import parallel_threshold
from dflash2_numba.kernels import panels as P
from dflash2_numba.kernels.linear import linear, linear_reference
from dflash2_numba.numerics import f32_to_bf16_array


def bf16_weight(rng, N, K):
    return f32_to_bf16_array(rng.standard_normal((N, K)).astype(np.float32))  # [N, K] uint16


@pytest.mark.parametrize("N,K", [(1, 1), (5, 3), (31, 17), (32, 64), (33, 64), (127, 40), (128, 8),
                                 (129, 33), (300, 96), (1000, 24)])
def test_matches_reference_over_shapes(N, K):
    """Every row count 1..17 and 32 (each tile and remainder), N around the 32/128 column
    boundaries, odd K; one and two threads with the parallel threshold at 0."""
    rng = np.random.default_rng(N * 1000 + K)
    w = bf16_weight(rng, N, K)
    packed = P.pack_bf16(w)
    assert packed.panels is not None and packed.shape == (N, K) and np.array_equal(np.asarray(packed), w)
    saved = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            with parallel_threshold(0):
                for M in list(range(1, 18)) + [32]:
                    x = rng.standard_normal((M, K)).astype(np.float32)
                    y = np.full((M, N), np.nan, np.float32)
                    linear(x, packed, out=y)
                    ref = x.astype(np.float64) @ linear_reference(np.eye(K, dtype=np.float32), w).astype(np.float64)
                    tol = 1e-5 * np.sqrt(K) * max(1.0, np.abs(ref).max())
                    assert np.abs(y - ref).max() <= tol, (threads, M, np.abs(y - ref).max())
    finally:
        numba.set_num_threads(saved)


def test_rows_are_independent_bit_for_bit():
    """Each output is one fma chain over k, so row r of an M-row product equals the 1-row
    product of x[r] exactly, for every tile (8x1, 4x2, 2x4, 1x4 on 512-bit; the half-panel
    tiles on 256-bit; the one-pass 3-, 5- and 6-row tiles of both): a verify of Q rows sees the
    logits of Q single steps."""
    rng = np.random.default_rng(7)
    w = P.pack_bf16(bf16_weight(rng, 200, 72))
    x = rng.standard_normal((16, 72)).astype(np.float32)
    whole = linear(x, w)
    for r in range(16):
        assert np.array_equal(linear(x[r:r + 1], w)[0], whole[r])
    for M in range(2, 17):
        assert np.array_equal(linear(x[:M], w), whole[:M])


def test_prefill_rows_keep_the_one_row_bits():
    """A packed weight takes the panel kernel at every row count, a 512-token prefill chunk too
    (not BLAS on a converted copy): row r of a 70-row product is the 1-row product of x[r] bit
    for bit, serial and parallel, so a prompt's K/V and taps are those of one-row steps."""
    rng = np.random.default_rng(9)
    w = P.pack_bf16(bf16_weight(rng, 300, 64))
    x = rng.standard_normal((70, 64)).astype(np.float32)
    saved = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            with parallel_threshold(0):
                whole = linear(x, w)
                for r in (0, 31, 32, 33, 69):
                    assert np.array_equal(linear(x[r:r + 1], w)[0], whole[r]), (threads, r)
    finally:
        numba.set_num_threads(saved)


def test_parallel_split_equals_serial():
    rng = np.random.default_rng(8)
    w = P.pack_bf16(bf16_weight(rng, 700, 40))  # 6 work items of 128 columns, the last partial
    x = rng.standard_normal((6, 40)).astype(np.float32)
    ser = np.full((6, 700), np.nan, np.float32)
    par = np.full((6, 700), np.nan, np.float32)
    P._gemv_panels_ser(x, w.panels, ser)
    P._gemv_panels_par(x, w.panels, par)
    assert np.array_equal(ser, par) and not np.isnan(par).any()


def test_views_and_non_bf16_are_not_packed():
    """Only the object pack_bf16 returned carries panels: a slice of it is a different matrix."""
    rng = np.random.default_rng(9)
    w = P.pack_bf16(bf16_weight(rng, 64, 16))
    assert w[:10].panels is None and w.T.panels is None and np.asarray(w).__class__ is np.ndarray
    x = rng.standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(linear(x, w[:10]), linear(x, w)[:, :10], rtol=1e-5, atol=1e-5)
    f32 = rng.standard_normal((8, 4)).astype(np.float32)
    assert P.pack_bf16(f32) is f32


def test_layout_of_one_panel():
    """pack_panels: lane i of a k-step = (column i, column 16 + i), padding zero."""
    w = (np.arange(40 * 3).reshape(40, 3) + 1).astype(np.uint16)  # distinct values
    panels = P.pack_panels(w)
    assert panels.shape == (P.ITEM_PANELS, 3, 32)
    for k in range(3):
        assert list(panels[0, k, 0:4]) == [w[0, k], w[16, k], w[1, k], w[17, k]]
        assert panels[1, k, 0] == w[32, k] and panels[1, k, 2 * 8] == 0  # column 40: padding


def test_grouped_product_equals_the_separate_ones():
    """group_panels: one product over q | k | v gives each part's columns bit for bit, and each
    weight's panels become a view of the group (no second copy in memory)."""
    rng = np.random.default_rng(10)
    ws = [P.pack_bf16(bf16_weight(rng, n, 48)) for n in (96, 40, 40)]
    alone = [np.asarray(w.panels).copy() for w in ws]
    x = rng.standard_normal((5, 48)).astype(np.float32)
    separate = [linear(x, w) for w in ws]
    group, offsets = P.group_panels(ws)
    assert offsets == (0, 128, 256)  # each part padded to whole 128-column work items
    for w, a in zip(ws, alone):
        assert np.shares_memory(w.panels, group) and np.array_equal(w.panels, a)
    y = np.empty((5, group.shape[0] * P.PANEL_COLS), np.float32)
    P.gemv_panels(x, group, y, False)
    for sep, at, w in zip(separate, offsets, ws):
        assert np.array_equal(y[:, at:at + w.shape[0]], sep)
        assert np.array_equal(linear(x, w), sep)  # the op-by-op path, now on the view
