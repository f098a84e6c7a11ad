"""kernels/rowwise.py (numba RMSNorm and RoPE) against models/layers.py, bit for bit.

The numba versions exist only to cut numpy's per-call overhead; any difference in bits would
make the "cpu" and "numpy" devices (and the HF bf16 comparisons built on layers.py) drift apart,
so equality is exact. Row lengths take every branch of numpy's pairwise sum: < 8, <= 128 with
and without a tail, and the recursive halving above 128."""

import numpy as np
import pytest

from dflash2_numba.kernels import rowwise
from dflash2_numba.models import layers


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("shape", [(1, 5), (3, 8), (2, 100), (4, 128), (2, 129), (8, 256), (3, 300),
                                   (2, 1000), (5, 4, 32), (2, 8, 6)])
def test_rms_norm_bit_identical(shape, bf16):
    rng = np.random.default_rng(sum(shape) + bf16)
    x = (rng.standard_normal(shape) * rng.exponential(4.0, shape[:-1] + (1,))).astype(np.float32)
    if bf16:
        x = layers.round_bf16_array(x)
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    want = layers.rms_norm(x, w, 1e-6, bf16)
    got = rowwise.rms_norm(x, w, 1e-6, bf16)
    assert got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("n,heads,hd", [(1, 8, 32), (8, 4, 32), (3, 2, 6), (16, 1, 128)])
def test_apply_rope_bit_identical(n, heads, hd, bf16):
    rng = np.random.default_rng(n * heads + hd + bf16)
    x = rng.standard_normal((n, heads, hd)).astype(np.float32)
    pos = rng.integers(0, 4000, n)
    cos, sin = layers.rope_tables(pos, hd, 10000.0, bf16)
    if bf16:
        x = layers.round_bf16_array(x)
    want = layers.apply_rope(x, cos, sin, bf16)
    got = rowwise.apply_rope(x, cos, sin, bf16)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_strided_input_and_shape_errors():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 2, 64)).astype(np.float32)[:, 1, ::2]  # [6, 32] strided view
    w = np.ones(32, np.float32)
    np.testing.assert_array_equal(_bits(rowwise.rms_norm(x, w, 1e-5)), _bits(layers.rms_norm(x, w, 1e-5)))
    with pytest.raises(ValueError, match="weight"):
        rowwise.rms_norm(x, np.ones(31, np.float32), 1e-5)
    with pytest.raises(ValueError, match="apply_rope"):
        rowwise.apply_rope(np.zeros((2, 1, 8), np.float32), np.zeros((2, 6), np.float32), np.zeros((2, 6), np.float32))


@pytest.mark.parametrize("bf16", [False, True])
def test_rope_table_cache_serves_the_same_bits(bf16):
    """models.layers.RopeTables (one growing table) against rope_tables computed fresh."""
    rope = layers.RopeTables(32, 10000.0, bf16)
    for positions in (np.arange(3), np.arange(250, 262), np.array([5, 1000, 7]), np.arange(4090, 4100)):
        cos, sin = rope(positions)
        want_cos, want_sin = layers.rope_tables(positions, 32, 10000.0, bf16)
        np.testing.assert_array_equal(_bits(cos), _bits(want_cos))
        np.testing.assert_array_equal(_bits(sin), _bits(want_sin))
    assert rope.cos.shape[0] >= 4100


def _silu64(x):
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def test_swiglu_within_a_few_ulp_of_float64_and_its_edges():
    """SwiGLU (the branch-free Cephes exp inside, kernels/rowwise._silu) against float64: every
    finite output within 4e-7 relative over [-100, 100] (the denormal range aside), and the
    edges as libm / torch give them: -0 where exp(-x) overflows f32 (x < -88.73), x itself for
    large x, NaN in NaN out, silu(-inf) NaN and silu(+inf) inf; rows and columns independent."""
    x = np.linspace(-100, 100, 400_001, dtype=np.float32).reshape(1, -1)
    u = np.ones_like(x)
    y = rowwise.swiglu(x, u)
    ref = _silu64(x)
    big = np.abs(ref) > 1e-36  # below that f32 goes denormal (and -88.72..-88 clamps, docstring)
    rel = np.abs(y[big] - ref[big]) / np.abs(ref[big])
    assert rel.max() < 2.5e-7, rel.max()  # ~2 ulp; measured 1.6e-7 (a coefficient off by 7%: 3.4e-7)
    edges = np.array([[-1e4, -89.0, -88.8, 88.8, 1e4, np.nan, np.inf, -np.inf, -0.0, 0.0]], np.float32)
    got = rowwise.swiglu(edges, np.ones_like(edges))[0]
    assert np.array_equal(_bits(got[:2]), _bits(np.float32([-0.0, -0.0])))  # -0, not a tiny number
    assert got[2] == 0 and np.signbit(got[2])
    np.testing.assert_array_equal(got[3:5], np.float32([88.8, 1e4]))
    assert np.isnan(got[5]) and got[6] == np.inf and np.isnan(got[7])
    assert np.array_equal(_bits(got[8:]), _bits(np.float32([-0.0, 0.0])))
    rng = np.random.default_rng(5)
    g = (rng.standard_normal((6, 70)) * 6).astype(np.float32)
    up = rng.standard_normal((6, 70)).astype(np.float32)
    whole = rowwise.swiglu(g, up)
    assert np.array_equal(rowwise.swiglu(g[2:3, 5:40], up[2:3, 5:40]), whole[2:3, 5:40])
    np.testing.assert_allclose(whole, (_silu64(g) * up).astype(np.float32), rtol=1e-6, atol=1e-30)


def test_swiglu_bf16_mode_rounds_twice():
    """bf16 mode: rnd(rnd(silu(g)) * u), each rnd to the nearest bf16 (ties to even): every output
    a bf16 value, equal to that formula on float64 silu except where silu sits within its f32
    error of a bf16 rounding boundary (a few in a thousand at most)."""
    rng = np.random.default_rng(6)
    g = layers.round_bf16_array((rng.standard_normal((4, 500)) * 4).astype(np.float32))
    u = layers.round_bf16_array(rng.standard_normal((4, 500)).astype(np.float32))
    y = rowwise.swiglu(g, u, bf16=True)
    assert not (_bits(y) & 0xFFFF).any()
    want = layers.round_bf16_array(layers.round_bf16_array(_silu64(g).astype(np.float32)) * u)
    assert np.mean(y != want) < 5e-3, np.mean(y != want)
