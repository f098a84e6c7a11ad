"""Gated DeltaNet kernels (kernels/gdn.py) against their numpy references, literal hand-computed
values and transformers' own `torch_recurrent_gated_delta_rule`; the @cuda.jit twins
(kernels/cuda_gdn.py) on numba's CUDA simulator, and a hybrid target decoding on device "cuda".
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
from numba import config

from dflash2_numba.errors import KernelArgumentError
from dflash2_numba.kernels import gdn
from dflash2_numba.numerics import round_bf16_array

SIM = pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="written for the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")


def _delta_problem(rng, n=5, Hk=2, r=2, dk=8, dv=4):
    Hv = Hk * r
    q = rng.standard_normal((n, Hk, dk)).astype(np.float32)
    k = rng.standard_normal((n, Hk, dk)).astype(np.float32)
    v = rng.standard_normal((n, Hv, dv)).astype(np.float32)
    g = -rng.uniform(0.05, 2.0, (n, Hv)).astype(np.float32)  # log-decay <= 0
    beta = rng.uniform(0.1, 0.9, (n, Hv)).astype(np.float32)
    s0 = rng.standard_normal((Hv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, s0


# ---------------------------------------------------------------- short conv
def test_short_conv_literal():
    """K = 2, one channel: out[t] = silu(w0 * x[t] + w1 * x[t+1]) over the window rows."""
    window = np.array([[1.0], [2.0], [-3.0]], np.float32)  # [K-1+n = 3, C = 1]
    w = np.array([[0.5, 2.0]], np.float32)  # [C, K]: w[:, K-1] multiplies the newest row
    pre = np.array([0.5 * 1 + 2 * 2, 0.5 * 2 + 2 * -3])  # 4.5, -5
    want = pre / (1 + np.exp(-pre))
    for fn in (gdn.short_conv, gdn.short_conv_reference):
        np.testing.assert_allclose(fn(window, w)[:, 0], want, rtol=1e-6)


@pytest.mark.parametrize("bf16", [False, True])
def test_short_conv_kernel_matches_reference_and_torch(bf16):
    rng = np.random.default_rng(0)
    K, n, C = 4, 7, 24
    window = rng.standard_normal((K - 1 + n, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    if bf16:
        window, w = round_bf16_array(window), round_bf16_array(w)
    got, ref = gdn.short_conv(window, w, bf16), gdn.short_conv_reference(window, w, bf16)
    np.testing.assert_allclose(got, ref, rtol=0, atol=(2**-7 if bf16 else 1e-6) * np.abs(ref).max())
    # transformers' causal_conv1d fallback: F.conv1d(groups=C) + silu in the same dtype
    dt = torch.bfloat16 if bf16 else torch.float32
    x = torch.from_numpy(window.T.copy()).to(dt)[None]  # [1, C, K-1+n]
    out = torch.nn.functional.conv1d(x, torch.from_numpy(w).to(dt)[:, None, :], groups=C)  # valid conv
    want = torch.nn.functional.silu(out)[0].T.float().numpy()  # [n, C]
    if bf16:  # torch's bf16 conv: f32 accumulation, one rounding, then a bf16 silu: bit-equal
        assert np.mean(got == want) > 0.97
    np.testing.assert_allclose(got, want, rtol=0, atol=(2**-7 if bf16 else 1e-6) * np.abs(want).max())


def test_short_conv_refusals():
    with pytest.raises(KernelArgumentError, match="fewer than K-1"):
        gdn.short_conv(np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32))
    with pytest.raises(KernelArgumentError, match=r"w \[C, K\]"):
        gdn.short_conv(np.zeros((5, 3), np.float32), np.zeros((4, 4), np.float32))


# ---------------------------------------------------------------- delta rule
def test_delta_rule_literal_scalar_state():
    """dk = dv = 1: k_hat = k/sqrt(k^2+eps), S1 = a S0 + beta k_hat (v - a S0 k_hat), o = S1 q_hat."""
    q, k, v = np.array([[[2.0]]], np.float32), np.array([[[-0.5]]], np.float32), np.array([[[3.0]]], np.float32)
    g, beta, s0 = np.array([[math.log(0.5)]], np.float32), np.array([[0.25]], np.float32), np.array([[[4.0]]], np.float32)
    kh, qh = -0.5 / math.sqrt(0.25 + 1e-6), 2.0 / math.sqrt(4.0 + 1e-6)
    s_dec = 0.5 * 4.0
    s1 = s_dec + kh * 0.25 * (3.0 - s_dec * kh)
    for fn in (gdn.gated_delta_rule, gdn.gated_delta_rule_reference):
        out = np.zeros((1, 1, 1), np.float32)
        o = fn(q, k, v, g, beta, s0, out)
        assert o[0, 0, 0] == pytest.approx(s1 * qh, rel=1e-6) and out[0, 0, 0] == pytest.approx(s1, rel=1e-6)
        assert s0[0, 0, 0] == 4.0  # state_in untouched


def test_delta_rule_matches_reference_and_transformers():
    pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: its delta rule is the reference")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, s0 = _delta_problem(np.random.default_rng(1))
    s_kernel, s_ref = np.zeros_like(s0), np.zeros_like(s0)
    o = gdn.gated_delta_rule(q, k, v, g, beta, s0, s_kernel)
    o_ref = gdn.gated_delta_rule_reference(q, k, v, g, beta, s0, s_ref)
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-5 * np.abs(o_ref).max())
    np.testing.assert_allclose(s_kernel, s_ref, rtol=0, atol=1e-5 * np.abs(s_ref).max())
    t = lambda a: torch.from_numpy(a)[None]  # noqa: E731  batch of one
    o_hf, s_hf = torch_recurrent_gated_delta_rule(t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(s0),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(o, o_hf[0].numpy(), rtol=0, atol=1e-5 * np.abs(o_ref).max())
    np.testing.assert_allclose(s_kernel, s_hf[0].numpy(), rtol=0, atol=1e-5 * np.abs(s_ref).max())


def test_delta_rule_prefix_replay_is_bit_identical():
    """What the hybrid cache relies on: rows 0..m-1 replayed from the same state_in give the
    state the full run had after row m-1, bit for bit; in place == two buffers."""
    q, k, v, g, beta, s0 = _delta_problem(np.random.default_rng(2), n=6)
    step = s0.copy()
    for m in range(1, 7):
        replay = np.empty_like(s0)
        gdn.gated_delta_rule(q[:m], k[:m], v[:m], g[:m], beta[:m], s0, replay)
        gdn.gated_delta_rule(q[m - 1:m], k[m - 1:m], v[m - 1:m], g[m - 1:m], beta[m - 1:m], step, step)  # in place
        assert np.array_equal(replay, step), m


def test_delta_rule_refusals():
    q, k, v, g, beta, s0 = _delta_problem(np.random.default_rng(3), Hk=2, r=2)
    with pytest.raises(KernelArgumentError, match="state_out"):
        gdn.gated_delta_rule(q, k, v, g, beta, s0, np.zeros((4, 8, 5), np.float32))
    with pytest.raises(KernelArgumentError, match="Hv % Hk"):
        gdn.gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], s0[:3], s0[:3].copy())
    with pytest.raises(KernelArgumentError, match="C-contiguous float32"):
        gdn.gated_delta_rule(q, k, v, g, beta, s0, np.zeros((4, 8, 4), np.float64))


# ---------------------------------------------------------------- CUDA twins (simulator)
@pytest.fixture()
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(old)


@SIM
@pytest.mark.parametrize("bf16", [False, True])
def test_cuda_short_conv_matches_cpu(bf16, fast_switching):
    from dflash2_numba.kernels.cuda_gdn import short_conv_cuda

    rng = np.random.default_rng(4)
    window = round_bf16_array(rng.standard_normal((3 + 5, 12)).astype(np.float32))
    w = round_bf16_array(rng.standard_normal((12, 4)).astype(np.float32))
    cpu = gdn.short_conv(window, w, bf16)
    np.testing.assert_allclose(short_conv_cuda(window, w, bf16), cpu, rtol=0,
                               atol=(2**-8 if bf16 else 1e-6) * np.abs(cpu).max())


@SIM
def test_cuda_delta_rule_matches_cpu_host_and_device_states(fast_switching):
    from numba import cuda

    from dflash2_numba.kernels.cuda_gdn import gated_delta_cuda

    q, k, v, g, beta, s0 = _delta_problem(np.random.default_rng(5), n=3, dk=4, dv=4)
    s_cpu = np.empty_like(s0)
    o_cpu = gdn.gated_delta_rule(q, k, v, g, beta, s0, s_cpu)
    tol = 1e-5 * np.abs(s_cpu).max()
    s_host = np.zeros_like(s0)
    o = gated_delta_cuda(q, k, v, g, beta, s0, s_host)  # host states: copied back
    np.testing.assert_allclose(o, o_cpu, rtol=0, atol=tol)
    np.testing.assert_allclose(s_host, s_cpu, rtol=0, atol=tol)
    d_in, d_out = cuda.to_device(s0), cuda.to_device(np.zeros_like(s0))
    gated_delta_cuda(q, k, v, g, beta, d_in, d_out)  # device states stay on the device
    np.testing.assert_allclose(d_out.copy_to_host(), s_cpu, rtol=0, atol=tol)
    assert np.array_equal(d_in.copy_to_host(), s0)
    gated_delta_cuda(q, k, v, g, beta, d_in, d_in)  # in place
    np.testing.assert_allclose(d_in.copy_to_host(), s_cpu, rtol=0, atol=tol)


@SIM
def test_hybrid_target_decodes_on_cuda_like_cpu(tmp_path, fast_switching):
    """A 2-layer hybrid (GDN, attention) on device "cuda": recurrent states live in device
    buffers; logits close to the CPU's; speculative greedy output (DFlash2 draft, rejections
    and rollbacks of the device states) equal to the CPU target's own greedy output."""
    import dflash2_numba as dn
    from dflash2_numba import tiny
    from dflash2_numba.kernels.cuda_ops import DeviceBuffer
    from dflash2_numba.tiny_hybrid import write_qwen3_5_target

    t = write_qwen3_5_target(tmp_path / "t", hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, tokenizer_vocab_size=300,
                             init_std=0.5, seed=1)
    d = tiny.write_draft(tmp_path / "d", t, kind="dflash2", num_hidden_layers=1, block_size=4,
                         conv_kernel_size=2, conv_group_size=8, target_layer_ids=[0], seed=2, init_std=0.5)
    cpu, gpu = dn.load_target(t), dn.load_target(t, device="cuda")
    logits = {}
    for device, target in (("cpu", cpu), ("cuda", gpu)):
        cache = target.new_cache(2)  # grows
        logits[device], _ = target.forward(np.array([5, 6, 7]), cache)
    assert isinstance(cache.state, DeviceBuffer) and isinstance(cache.pre, DeviceBuffer)
    ref = dn.generate(cpu, None, prompt_ids=[5, 6, 7], max_new_tokens=4).output_ids
    spec = dn.generate(gpu, dn.load_draft(d, gpu), prompt_ids=[5, 6, 7], max_new_tokens=4)
    assert spec.output_ids == ref and spec.stats.steps >= 1
    np.testing.assert_allclose(logits["cuda"], logits["cpu"], rtol=0, atol=1e-4 * np.abs(logits["cpu"]).max())
