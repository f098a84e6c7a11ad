"""Grouped dynamic depthwise conv (spec §4.2): @njit kernel vs the sequential numpy reference,
hand-computed literals, block-boundary and runtime-block-length gates.

f32 must be exactly equal, bf16 bit-exact (uint16 equality): the op has no reduction-order
freedom, so any difference is a bug (wrong arm, wrong rounding order, wrong tap mask, wrong group).
"""

import numpy as np
import pytest

from dflash2_numba.errors import KernelArgumentError, KernelDTypeError
from dflash2_numba.kernels import conv
from dflash2_numba.kernels.conv import (
    grouped_conv,
    grouped_conv_numpy,
    grouped_conv_reference,
    uses_and_arm,
)
from dflash2_numba.numerics import f32_to_bf16_array

DTYPES = ["f32", "bf16"]


def _as(dtype, a):
    """float32 array -> the tensor dtype of a run mode (bf16 = uint16 bits, rounded to nearest)."""
    a = np.asarray(a, dtype=np.float32)
    return f32_to_bf16_array(a) if dtype == "bf16" else a


def _problem(rng, dtype, n_rows, hidden, group_size, taps):
    """x [N, H], proj-shaped delta [N, 2, taps, G], base_kernel [2, taps, H] in `dtype`."""
    groups = hidden // group_size
    x = _as(dtype, rng.standard_normal((n_rows, hidden)))
    # The model's delta is one projection reshaped [N, 2, taps, G]; each side is a strided view.
    proj = _as(dtype, 0.5 * rng.standard_normal((n_rows, 2 * taps * groups)))
    delta_both = proj.reshape(n_rows, 2, taps, groups)
    base_kernel = _as(dtype, rng.standard_normal((2, taps, hidden)))
    return x, delta_both, base_kernel


def _raw_kernel(x, delta, base, group_size, block_len, and_arm):
    """Call the @njit kernel with an explicitly chosen position arm (bypasses uses_and_arm)."""
    out = np.empty_like(x)
    conv._kernel_for(x.dtype)(x, np.ascontiguousarray(delta), base, out, group_size, block_len, and_arm)
    return out


# ------------------------------------------------------------------ kernel == reference sweep
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("taps", [1, 2, 3])
@pytest.mark.parametrize("block_len", [5, 8, 16])
def test_kernel_matches_reference(dtype, taps, block_len):
    rng = np.random.default_rng(1000 * taps + block_len)
    # (H, S): many small groups, few wide groups, S=1 (G=H), one group (G=1).
    for hidden, group_size in [(32, 4), (48, 16), (12, 1), (16, 16)]:
        n_rows = 3 * block_len + 2  # a partial last block, as a truncated last step has
        x, delta_both, base_kernel = _problem(rng, dtype, n_rows, hidden, group_size, taps)
        outs = []
        for side in (0, 1):
            delta = delta_both[:, side]  # [N, taps, G], non-contiguous view
            base = base_kernel[side]  # [taps, H]
            assert not delta.flags.c_contiguous
            got = grouped_conv(x, delta, base, group_size, block_len)
            want = grouped_conv_reference(x, delta, base, group_size, block_len)
            assert got.dtype == x.dtype and got.shape == x.shape
            np.testing.assert_array_equal(got, want, err_msg=f"H={hidden} S={group_size} side={side}")
            # The vectorised numpy version (the benchmark baseline) obeys the same contract.
            np.testing.assert_array_equal(grouped_conv_numpy(x, delta, base, group_size, block_len), want)
            outs.append(got)
        # The two sides really are different inputs (a wrong-side call would be visible).
        assert not np.array_equal(outs[0], outs[1])


# ------------------------------------------------------------------ spec §4.2 literals
@pytest.mark.parametrize("dtype", DTYPES)
def test_literal_block2_taps2(dtype):
    # block 2, taps 2, base 1, delta 0: out[n] = x[n] + [pos>=1] x[n-1]
    #   n=0 (pos 0): 10; n=1 (pos 1): 20+10=30; n=2 (pos 0, new block): 30; n=3: 40+30=70
    x = _as(dtype, [[10], [20], [30], [40]])
    delta = _as(dtype, np.zeros((4, 2, 1)))
    base = _as(dtype, np.ones((2, 1)))
    want = _as(dtype, [[10], [30], [30], [70]])
    for fn in (grouped_conv, grouped_conv_reference):
        np.testing.assert_array_equal(fn(x, delta, base, 1, 2), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_literal_groups(dtype):
    # G=2, S=2, one tap, x=1: channels 0,1 take delta[0]=10, channels 2,3 take delta[1]=100.
    x = _as(dtype, np.ones((1, 4)))
    delta = _as(dtype, [[[10, 100]]])
    base = _as(dtype, [[1, 2, 3, 4]])
    want = _as(dtype, [[11, 12, 103, 104]])
    for fn in (grouped_conv, grouped_conv_reference):
        np.testing.assert_array_equal(fn(x, delta, base, 2, 1), want)


def test_literal_bf16_rounds_after_every_step():
    # bf16 keeps 8 significant bits: on [1, 2) the grid is 2^-7 = 8/1024, on [2, 4) it is 16/1024.
    # One channel, block 2, taps 2; base = [1, 4], delta = [0, 1] -> c_0 = 1, c_1 = rnd(4+1) = 5.
    # x = [207/1024, 1]   (207 < 256, so 207/1024 is exactly a bf16 value)
    #
    # Row 0 (pos 0): rnd(1 * 207/1024) = 207/1024.
    # Row 1 (pos 1):
    #   acc          = rnd(c_0 * x_1) = rnd(1) = 1
    #   c_1 * x_0    = 5 * 207/1024 = 1035/1024 (exact in f32) -- NOT a bf16 value:
    #                  neighbours 1032/1024 and 1040/1024, nearer is 1032 -> rnd = 1032/1024
    #   acc + that   = 1 + 1032/1024 = 2056/1024: exactly half way between 2048/1024 and 2064/1024
    #                  -> ties to even -> 2048/1024 = 2.0             <- per-step rounding (§4.2)
    # Rounding once at the end instead: 1 + 1035/1024 = 2059/1024, above the midpoint 2056
    #                  -> 2064/1024 = 2.015625                         <- what a fused kernel gives
    x = _as("bf16", [[207 / 1024], [1.0]])
    delta = _as("bf16", [[[0], [1]], [[0], [1]]])  # [N=2, taps=2, G=1]
    base = _as("bf16", [[1], [4]])  # [taps=2, H=1]
    want = _as("bf16", [[207 / 1024], [2.0]])
    # The case discriminates: the same row computed in f32 and rounded once differs in bits.
    once = f32_to_bf16_array(np.float32(1) * np.float32(1) + np.float32(5) * np.float32(207 / 1024))
    assert once != want[1, 0]
    for fn in (grouped_conv, grouped_conv_reference, grouped_conv_numpy):
        np.testing.assert_array_equal(fn(x, delta, base, 1, 2), want)


# ------------------------------------------------------------------ position arms
def test_uses_and_arm():
    assert [q for q in range(1, 20) if uses_and_arm(q)] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_percent_arm_is_taken_at_q5(dtype):
    rng = np.random.default_rng(5)
    block_len = 5
    x, delta_both, base_kernel = _problem(rng, dtype, 4 * block_len, 16, 4, 3)
    delta, base = delta_both[:, 0], base_kernel[0]
    want = grouped_conv_reference(x, delta, base, 4, block_len)
    assert not uses_and_arm(block_len)
    got = grouped_conv(x, delta, base, 4, block_len)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(_raw_kernel(x, delta, base, 4, block_len, and_arm=False), got)
    # The & arm at Q=5 computes n & 4, a different position: the data above tells the arms apart,
    # so `got == want` means the % arm ran.
    assert not np.array_equal(_raw_kernel(x, delta, base, 4, block_len, and_arm=True), want)


@pytest.mark.parametrize("block_len", [1, 2, 8, 16])
def test_both_arms_agree_at_powers_of_two(block_len):
    rng = np.random.default_rng(block_len)
    x, delta_both, base_kernel = _problem(rng, "bf16", 3 * block_len + 1, 16, 4, 3)
    delta, base = delta_both[:, 1], base_kernel[1]
    assert uses_and_arm(block_len)
    and_out = _raw_kernel(x, delta, base, 4, block_len, and_arm=True)
    np.testing.assert_array_equal(and_out, _raw_kernel(x, delta, base, 4, block_len, and_arm=False))
    np.testing.assert_array_equal(and_out, grouped_conv_reference(x, delta, base, 4, block_len))


# ------------------------------------------------------------------ block boundaries
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_boundary_never_leaks(dtype):
    rng = np.random.default_rng(7)
    block_len, n_blocks, hidden, group_size, taps = 5, 3, 16, 4, 3
    n_rows = block_len * n_blocks
    x, delta_both, base_kernel = _problem(rng, dtype, n_rows, hidden, group_size, taps)
    delta, base = np.ascontiguousarray(delta_both[:, 0]), base_kernel[0]
    before = grouped_conv(x, delta, base, group_size, block_len)
    for b in range(n_blocks):
        rows = slice(b * block_len, (b + 1) * block_len)
        x2, delta2 = x.copy(), delta.copy()
        # Poison block b: new values, and NaN / inf that a "0 * value" mask would spread.
        x2[rows] = _as(dtype, rng.standard_normal((block_len, hidden)))
        x2[rows.start + 3, :2] = _as(dtype, [np.nan, np.inf])
        delta2[rows] = _as(dtype, rng.standard_normal((block_len, taps, hidden // group_size)))
        after = grouped_conv(x2, delta2, base, group_size, block_len)
        others = np.ones(n_rows, bool)
        others[rows] = False
        # Every other block (the next one, and via index wrap-around n-t < 0 the first one) is
        # bit-identical; block b itself did change, so the comparison is not vacuous.
        np.testing.assert_array_equal(after[others], before[others], err_msg=f"block {b} leaked")
        assert not np.array_equal(after[rows], before[rows])


def test_taps_reach_back_inside_a_block():
    # Changing only the first row of block 1 changes rows 1 and 2 of that block (taps 3), but not
    # row 3: the taps really read x[n-1] and x[n-2], and no further.
    rng = np.random.default_rng(8)
    block_len = 5
    x, delta_both, base_kernel = _problem(rng, "f32", 2 * block_len, 8, 2, 3)
    delta, base = delta_both[:, 0], base_kernel[0]
    before = grouped_conv(x, delta, base, 2, block_len)
    x2 = x.copy()
    x2[block_len] += 1.0
    changed = (grouped_conv(x2, delta, base, 2, block_len) != before).any(axis=1)
    assert changed.tolist() == [False] * 5 + [True, True, True, False, False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_length_is_the_runtime_one(dtype):
    # A B=8 draft run with --block-size 5: rows are blocks of 5. A kernel that took its block
    # length from the checkpoint (8) must give a different answer on this data.
    rng = np.random.default_rng(9)
    x, delta_both, base_kernel = _problem(rng, dtype, 16, 16, 4, 2)
    delta, base = delta_both[:, 1], base_kernel[1]
    runtime = grouped_conv_reference(x, delta, base, 4, 5)
    np.testing.assert_array_equal(grouped_conv(x, delta, base, 4, 5), runtime)
    assert not np.array_equal(grouped_conv(x, delta, base, 4, 8), runtime)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_rows", [0, 1, 2])
def test_fewer_rows_than_taps(dtype, n_rows):
    # N < taps: no row may reach back before row 0 (numba would silently wrap x[-1] around).
    rng = np.random.default_rng(10 + n_rows)
    x, delta_both, base_kernel = _problem(rng, dtype, n_rows, 8, 4, 3)
    delta, base = delta_both[:, 0], base_kernel[0]
    got = grouped_conv(x, delta, base, 4, 5)
    assert got.shape == (n_rows, 8)
    np.testing.assert_array_equal(got, grouped_conv_reference(x, delta, base, 4, 5))


# ------------------------------------------------------------------ argument checks
def test_refuses_mixed_dtypes():
    x = np.ones((4, 8), np.float32)
    delta = np.zeros((4, 2, 2), np.uint16)
    base = np.ones((2, 8), np.float32)
    with pytest.raises(KernelDTypeError, match="delta=uint16") as e:
        grouped_conv(x, delta, base, 4, 2)
    assert isinstance(e.value, TypeError)
    with pytest.raises(KernelDTypeError, match="x=float64"):
        grouped_conv(x.astype(np.float64), delta.astype(np.float32), base, 4, 2)


@pytest.mark.parametrize(
    "x_shape, delta_shape, base_shape, group_size, block_len, match",
    [
        ((4, 8), (4, 2, 2), (2, 8), 3, 2, "group_size must be a positive divisor of H=8"),
        ((4, 8), (4, 2, 3), (2, 8), 4, 2, r"delta expected \[N=4, taps=2, G=2\]"),
        ((4, 8), (3, 2, 2), (2, 8), 4, 2, r"delta expected \[N=4"),
        ((4, 8), (4, 2, 2), (2, 6), 4, 2, "base expected"),
        ((4, 8), (4, 2, 2), (2, 8), 4, 0, "block_len must be an int >= 1"),
        ((8,), (4, 2, 2), (2, 8), 4, 2, r"x must be \[N, H\]"),
    ],
)
def test_refuses_bad_shapes(x_shape, delta_shape, base_shape, group_size, block_len, match):
    args = [np.zeros(s, np.float32) for s in (x_shape, delta_shape, base_shape)]
    with pytest.raises(KernelArgumentError, match=match):
        grouped_conv(*args, group_size, block_len)
