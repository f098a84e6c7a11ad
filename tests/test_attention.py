"""attention(): numba kernel vs numpy reference vs a brute-force float64 loop written straight
from the visibility rules, over target-style (cache ++ block, causal) and draft-style
(context ++ block, full / symmetric window / causal+window, arbitrary key order) cases."""

import numpy as np
import pytest

from dflash2_numba.kernels import attention as attention_module
from dflash2_numba.kernels.attention import attention, attention_reference
from dflash2_numba.numerics import round_bf16_array


@pytest.fixture(params=["serial", "parallel"], autouse=True)
def driver(request, monkeypatch):
    """Run every case through both numba drivers (the size threshold is forced)."""
    monkeypatch.setattr(attention_module, "use_parallel", lambda macs: request.param == "parallel")
    return request.param


def brute(q, k, v, q_pos, k_pos, causal, window):
    """float64 loops, one (query, head) at a time."""
    nq, nh, hd = q.shape
    nkv, T, _ = k.shape
    out = np.zeros((nq, nh, hd))
    for i in range(nq):
        for h in range(nh):
            kvh = h // (nh // nkv)
            seen = [s for s in range(T)
                    if (not causal or k_pos[s] <= q_pos[i]) and (window == 0 or abs(q_pos[i] - k_pos[s]) <= window - 1)]
            if not seen:
                continue
            sc = np.array([q[i, h].astype(np.float64) @ k[kvh, s] / np.sqrt(hd) for s in seen])
            p = np.exp(sc - sc.max())
            out[i, h] = (p / p.sum()) @ v[kvh, seen].astype(np.float64)
    return out


def case(rng, nq, nh, nkv, hd, T):
    q = rng.standard_normal((nq, nh, hd)).astype(np.float32)
    k = rng.standard_normal((nkv, T, hd)).astype(np.float32)
    v = rng.standard_normal((nkv, T, hd)).astype(np.float32)
    return q, k, v


TARGET = [(1, 4, 4, 16, 1), (1, 4, 2, 16, 37), (4, 8, 2, 16, 24), (16, 8, 1, 32, 40), (20, 4, 2, 8, 20),
          (8, 4, 2, 6, 20), (3, 4, 1, 5, 11)]  # odd head dims


@pytest.mark.parametrize("nq,nh,nkv,hd,T", TARGET)
def test_target_causal_gqa(nq, nh, nkv, hd, T):
    rng = np.random.default_rng(nq * 100 + T)
    q, k, v = case(rng, nq, nh, nkv, hd, T)
    q_pos, k_pos = np.arange(T - nq, T), np.arange(T)
    want = brute(q, k, v, q_pos, k_pos, True, 0)
    for got in (attention(q, k, v, q_pos, k_pos, True, 0), attention_reference(q, k, v, q_pos, k_pos, True, 0)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 1, 3, 6])
def test_draft_context_plus_block(causal, window):
    """Keys = context at positions < p, then the block p..p+Q-1; keys shuffled to make sure
    nothing assumes sorted positions."""
    rng = np.random.default_rng(window * 2 + causal)
    p, Q, nh, nkv, hd = 9, 5, 4, 2, 16
    q, k, v = case(rng, Q, nh, nkv, hd, p + Q)
    q_pos, k_pos = np.arange(p, p + Q), np.arange(p + Q)
    perm = rng.permutation(p + Q)
    k, v, k_pos = k[:, perm], v[:, perm], k_pos[perm]
    want = brute(q, k, v, q_pos, k_pos, causal, window)
    for got in (attention(q, k, v, q_pos, k_pos, causal, window),
                attention_reference(q, k, v, q_pos, k_pos, causal, window)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_strided_cache_view_and_no_visible_key():
    rng = np.random.default_rng(5)
    cache = rng.standard_normal((3, 2, 64, 16)).astype(np.float32)  # [L, nkv, max_len, hd]
    k, v = cache[1, :, :10], cache[2, :, :10]  # non-contiguous views, as the target passes
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    q_pos, k_pos = np.array([-1, 5]), np.arange(10)  # query at -1 sees nothing under causal
    got = attention(q, k, v, q_pos, k_pos, True, 0)
    want = brute(q, k, v, q_pos, k_pos, True, 0)
    assert np.all(got[0] == 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    np.testing.assert_allclose(attention_reference(q, k, v, q_pos, k_pos, True, 0), want, rtol=0, atol=2e-6)


def test_bf16_probs_rounds_weights_not_the_sum():
    """bf16_probs: out = sum_t rnd(exp(s_t - m)) v_t / sum_t exp(s_t - m). Oracle in f64."""
    rng = np.random.default_rng(6)
    q, k, v = case(rng, 3, 2, 1, 16, 12)
    q_pos, k_pos = np.arange(9, 12), np.arange(12)
    want = np.zeros((3, 2, 16))
    for i in range(3):
        for h in range(2):
            n = q_pos[i] + 1
            s = (q[i, h].astype(np.float32) @ k[0, :n].T) * np.float32(0.25)
            p = np.exp(s - s.max()).astype(np.float32)
            want[i, h] = (round_bf16_array(p).astype(np.float64) @ v[0, :n]) / p.astype(np.float64).sum()
    got = attention(q, k, v, q_pos, k_pos, True, 0, bf16_probs=True)
    ref = attention_reference(q, k, v, q_pos, k_pos, True, 0, bf16_probs=True)
    plain = attention(q, k, v, q_pos, k_pos, True, 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
    np.testing.assert_allclose(ref, want, rtol=0, atol=3e-6)
    assert np.abs(plain - want).max() > 1e-4  # the flag changes the result measurably


def test_shape_errors():
    q, k, v = case(np.random.default_rng(0), 2, 3, 2, 8, 4)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v, np.arange(2), np.arange(4))


def test_vectorised_exp_within_two_ulp_of_libm():
    """The kernels' expf (attention._exp_shifted) against numpy's float32 exp on [-87, 0]."""
    x = np.concatenate([np.linspace(-87, 0, 20001, dtype=np.float32),
                        -np.random.default_rng(7).exponential(3.0, 5000).astype(np.float32).clip(0, 87)])
    got = x.copy()
    attention_module._exp_shifted(got, x.shape[0], np.float32(0.0))
    want = np.exp(x)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 2, ulps.max()
