"""CUDA kernels and the `cuda` device on numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by
conftest): conv bit-identity with the CPU kernel, attention / linear parity, the Ops object
(weights resident on the device, device-resident caches) and a greedy decode on device="cuda"
equal to the CPU one. PTX / FMA checks are in test_cuda_ptx.py.

Simulator budget: every CUDA thread is a Python thread (~0.3 ms per conv element, ~20 us per
multiply-add in a kernel loop), so launches stay at a few hundred elements.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import config

cuda = pytest.importorskip("numba.cuda", reason="numba.cuda is not importable: install numba-cuda (the [cuda] extra)")

from dflash2_numba.errors import DeviceUnavailableError, KernelArgumentError, KernelDTypeError
from dflash2_numba.kernels import conv, cuda_ops
from dflash2_numba.kernels.attention import attention, attention_reference
from dflash2_numba.kernels.backend import get_ops
from dflash2_numba.kernels.cuda_attention import attention_cuda
from dflash2_numba.kernels.cuda_conv import grouped_conv_cuda, launch_conv, make_conv_kernel
from dflash2_numba.kernels.cuda_linear import ROW_TILE, linear_cuda
from dflash2_numba.kernels.linear import linear_reference
from dflash2_numba.numerics import bf16_to_f32_array, f32_to_bf16_array, round_bf16

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not config.ENABLE_CUDASIM,
                                reason="written for the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")


@pytest.fixture(scope="module", autouse=True)
def fast_simulator_switching():
    """The simulator's scheduler busy-polls its block threads; a short GIL switch interval
    makes each __syncthreads round trip ~10x cheaper. Restored afterwards."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(old)


def _bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, so that -0.0 != 0.0 and NaN payloads count."""
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


def _as(dtype, a):
    a = np.asarray(a, dtype=np.float32)
    return f32_to_bf16_array(a) if dtype == "bf16" else a


def _conv_problem(rng, dtype, n_rows, hidden, group_size, taps):
    """x [N, H], delta both sides [N, 2, taps, G], base_kernel [2, taps, H] in the run dtype."""
    groups = hidden // group_size
    x = rng.standard_normal((n_rows, hidden))
    x[rng.random(x.shape) < 0.05] *= 1e4  # large values: products that round differently
    proj = 0.5 * rng.standard_normal((n_rows, 2 * taps * groups))
    base = rng.standard_normal((2, taps, hidden))
    return _as(dtype, x), _as(dtype, proj).reshape(n_rows, 2, taps, groups), _as(dtype, base)


# ------------------------------------------------------------------ conv: bit identity
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("block_len", [5, 8, 16])
def test_conv_bit_identical_to_cpu(dtype, block_len):
    """Taps 1-3, both sides, group sizes S=4 and S=1, a partial last block; equal BITS."""
    rng = np.random.default_rng(100 * block_len + (dtype == "bf16"))
    n_rows = 2 * block_len + 3  # partial last block, as a truncated last step has
    for taps in (1, 2, 3):
        hidden, group_size = (16, 4) if taps != 2 else (8, 1)
        x, delta_both, base_kernel = _conv_problem(rng, dtype, n_rows, hidden, group_size, taps)
        for side in (0, 1):
            delta, base = delta_both[:, side], base_kernel[side]  # strided view, [taps, H]
            got = grouped_conv_cuda(x, delta, base, group_size, block_len)
            want = conv.grouped_conv(x, delta, base, group_size, block_len)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(_bits(got), _bits(want),
                                          err_msg=f"taps={taps} side={side} H={hidden} S={group_size}")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_conv_both_position_arms(dtype):
    """Q=8 through the '&' arm and the '%' arm (forced), and Q=6 through '%', each vs the CPU
    kernel run with the same arm."""
    rng = np.random.default_rng(7)
    for block_len, arms in ((8, (True, False)), (6, (False,))):
        x, delta_both, base_kernel = _conv_problem(rng, dtype, 2 * block_len + 1, 8, 2, 3)
        delta = np.ascontiguousarray(delta_both[:, 1])
        for and_arm in arms:
            want = np.empty_like(x)
            conv._kernel_for(x.dtype)(x, delta, base_kernel[1], want, 2, block_len, and_arm)
            d_out = cuda.device_array(x.shape, x.dtype)
            launch_conv(cuda.to_device(x), cuda.to_device(delta), cuda.to_device(base_kernel[1]),
                        d_out, 2, block_len, and_arm)
            np.testing.assert_array_equal(_bits(d_out.copy_to_host()), _bits(want), err_msg=f"and_arm={and_arm}")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_conv_design_literals(dtype):
    # spec §4.2: block 2, taps 2, base 1, delta 0, x=[10,20,30,40] -> [10,30,30,70]
    got = grouped_conv_cuda(_as(dtype, [[10], [20], [30], [40]]), _as(dtype, np.zeros((4, 2, 1))),
                            _as(dtype, np.ones((2, 1))), 1, 2)
    np.testing.assert_array_equal(got, _as(dtype, [[10], [30], [30], [70]]))
    # G=2, S=2, one tap, base=[1,2,3,4], delta=[10,100] -> [11,12,103,104]
    got = grouped_conv_cuda(_as(dtype, np.ones((1, 4))), _as(dtype, [[[10, 100]]]),
                            _as(dtype, [[1, 2, 3, 4]]), 2, 1)
    np.testing.assert_array_equal(got, _as(dtype, [[11, 12, 103, 104]]))


def test_conv_bf16_per_step_rounding_literal():
    """The hand-checked case of test_conv.py: rounding after every step gives 2.0, rounding the
    row once gives 2.015625 (see test_literal_bf16_rounds_after_every_step)."""
    x = _as("bf16", [[207 / 1024], [1.0]])
    delta = _as("bf16", [[[0], [1]], [[0], [1]]])
    base = _as("bf16", [[1], [4]])
    np.testing.assert_array_equal(grouped_conv_cuda(x, delta, base, 1, 2), _as("bf16", [[207 / 1024], [2.0]]))


def test_conv_masked_taps_do_not_leak():
    """NaN / inf in the previous block must not reach the first rows of the next block."""
    x = np.ones((6, 4), np.float32)
    x[2] = np.nan  # last row of block 0 (Q=3)
    x[1] = np.inf
    delta = np.zeros((6, 3, 4), np.float32)
    base = np.ones((3, 4), np.float32)
    got = grouped_conv_cuda(x, delta, base, 1, 3)
    np.testing.assert_array_equal(got[3:], conv.grouped_conv(x, delta, base, 1, 3)[3:])
    np.testing.assert_array_equal(got[3:], [[1] * 4, [2] * 4, [3] * 4])


def test_conv_device_arrays_stay_on_device():
    rng = np.random.default_rng(3)
    x, delta_both, base_kernel = _conv_problem(rng, "bf16", 10, 8, 4, 2)
    delta = np.ascontiguousarray(delta_both[:, 0])
    out = grouped_conv_cuda(cuda.to_device(x), cuda.to_device(delta), cuda.to_device(base_kernel[0]), 4, 5)
    assert not isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out.copy_to_host(), conv.grouped_conv(x, delta, base_kernel[0], 4, 5))


def test_conv_refusals_match_cpu():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(KernelDTypeError, match="uint16"):
        grouped_conv_cuda(x, np.zeros((4, 2, 2), np.uint16), np.zeros((2, 8), np.float32), 4, 2)
    with pytest.raises(KernelArgumentError, match="G=2"):
        grouped_conv_cuda(x, np.zeros((4, 2, 3), np.float32), np.zeros((2, 8), np.float32), 4, 2)
    with pytest.raises(KernelArgumentError, match="group_size"):
        grouped_conv_cuda(x, np.zeros((4, 2, 2), np.float32), np.zeros((2, 8), np.float32), 3, 2)


def test_sweep_data_detects_a_rounding_order_change():
    """Positive control: a CUDA conv that skips the rounding of each tap's product before the
    add (bf16: rnd(acc + c*x) instead of rnd(acc + rnd(c*x))) differs from the CPU on the same
    kind of data the sweep uses — so the bit-identity sweep would go red on it."""

    from numba import njit

    first, _ = conv.make_conv_steps(conv._mul, conv._add, round_bf16)

    @njit(inline="always")
    def tap_fused(acc, base_t, delta_t, x_nt):
        return round_bf16(acc + round_bf16(base_t + delta_t) * x_nt)

    from dflash2_numba.numerics import bf16_to_f32, f32_to_bf16

    wrong = make_conv_kernel(bf16_to_f32, f32_to_bf16, first, tap_fused)
    rng = np.random.default_rng(11)
    x, delta_both, base_kernel = _conv_problem(rng, "bf16", 21, 16, 4, 3)
    delta = np.ascontiguousarray(delta_both[:, 0])
    d_out = cuda.device_array(x.shape, x.dtype)
    wrong[2, 32](cuda.to_device(x), cuda.to_device(delta), cuda.to_device(base_kernel[0]), d_out, 4, 8, True)
    want = conv.grouped_conv(x, delta, base_kernel[0], 4, 8)
    assert not np.array_equal(d_out.copy_to_host(), want)


# ------------------------------------------------------------------ attention parity
def _qkv(rng, nq, nh, nkv, hd, T):
    q = rng.standard_normal((nq, nh, hd)).astype(np.float32)
    k = rng.standard_normal((nkv, T, hd)).astype(np.float32)
    v = rng.standard_normal((nkv, T, hd)).astype(np.float32)
    return q, k, v


ATTENTION_CASES = {
    # name: (nq, nh, nkv, hd, T, q_pos, k_pos, causal, window)
    "target_verify_gqa": (4, 4, 2, 16, 11, np.arange(7, 11), np.arange(11), True, 0),
    "draft_block_noncausal": (5, 4, 1, 8, 12, np.arange(7, 12), np.arange(12), False, 0),
    "draft_sliding_window": (5, 2, 2, 8, 13, np.arange(8, 13), np.arange(13), False, 3),
    "gapped_positions_causal_window": (3, 2, 1, 16, 6, np.array([3, 9, 10]),
                                       np.array([0, 2, 3, 8, 9, 10]), True, 2),
    # keys in two of the CPU kernel's tiles (TILE = 256): bf16 weights round against their tile's max
    "verify_over_two_tiles": (2, 2, 1, 8, 300, np.arange(298, 300), np.arange(300), True, 0),
}


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
@pytest.mark.parametrize("bf16_probs", [False, True])
def test_attention_matches_cpu(name, bf16_probs):
    nq, nh, nkv, hd, T, q_pos, k_pos, causal, window = ATTENTION_CASES[name]
    rng = np.random.default_rng(len(name))
    q, k, v = _qkv(rng, nq, nh, nkv, hd, T)
    got = attention_cuda(q, k, v, q_pos, k_pos, causal, window, bf16_probs)
    want = attention(q, k, v, q_pos, k_pos, causal, window, bf16_probs)
    if not bf16_probs:  # f32: only the summation order differs
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, attention_reference(q, k, v, q_pos, k_pos, causal, window),
                                   rtol=1e-5, atol=1e-6)
        return
    # bf16 probabilities: exp may differ by an ulp between devices and land on the other side of
    # a bf16 rounding boundary (one bf16 ulp of one weight), which is rare; so all rows within
    # that bound, and nearly all (query, head) rows within the f32 tolerance. Weighting with
    # unrounded probabilities moves almost every row by ~1e-3 and fails the second check.
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    close_rows = np.all(np.isclose(got, want, rtol=1e-5, atol=1e-6), axis=-1)  # [nq, nh]
    assert close_rows.mean() >= 0.9, f"only {close_rows.mean():.0%} of rows within 1e-5"


def test_attention_deeper_reduction_tree_and_strided_device_kv():
    """8 threads per block (three levels of the shared-memory tree) on a device-resident,
    strided K/V slice — what a DeviceBuffer cache hands over."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 3, 4, 2, 16, 9)
    buf_k, buf_v = cuda_ops.DeviceBuffer((2, 2, 20, 16)), cuda_ops.DeviceBuffer((2, 2, 20, 16))
    buf_k[1, :, 0:9] = k  # layer 1 of a [L, nkv, max_len, hd] cache
    buf_v[1, :, 0:9] = v
    q_pos, k_pos = np.arange(6, 9), np.arange(9)
    got = attention_cuda(q, buf_k[1, :, :9], buf_v[1, :, :9], q_pos, k_pos, True, 0, threads=8)
    np.testing.assert_allclose(got, attention(q, k, v, q_pos, k_pos, True, 0), rtol=1e-5, atol=1e-6)


def test_attention_verify_rows_equal_one_row_steps_bitwise():
    """A Q-row causal verify gives, bit for bit, Q one-row steps (keys 0..p each), with 8 threads
    per block striding over 61 keys (several keys per thread, a partial last stride), windowed
    too; and `first` (the draft window) masks key rows before it as the CPU kernel does."""
    rng = np.random.default_rng(9)
    T, Q = 61, 5
    q, k, v = _qkv(rng, Q, 4, 2, 8, T)
    q_pos = np.arange(T - Q, T)
    for window in (0, 20):
        block = attention_cuda(q, k, v, q_pos, np.arange(T), True, window, threads=8)
        for r, p in enumerate(q_pos):
            one = attention_cuda(q[r:r + 1], k[:, :p + 1], v[:, :p + 1], q_pos[r:r + 1], np.arange(p + 1), True,
                                 window, threads=8)
            assert np.array_equal(one[0], block[r]), (window, r)
    got = attention_cuda(q, k, v, q_pos, np.arange(T), False, 0, threads=8, first=9)
    np.testing.assert_allclose(got, attention_reference(q, k, v, q_pos, np.arange(T), False, 0, first=9),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, attention(q, k, v, q_pos, np.arange(T), False, 0, first=9), rtol=1e-5, atol=1e-6)


def test_attention_bf16_weights_verify_rows_equal_one_row_steps_bitwise_over_two_tiles():
    """bf16 probabilities round against each 256-key tile's max (as the CPU kernel); tiles are fixed
    key rows, so a Q-row verify over 270 keys still gives the bits of Q one-row steps."""
    rng = np.random.default_rng(10)
    T, Q = 270, 3
    q, k, v = _qkv(rng, Q, 2, 1, 8, T)
    q_pos = np.arange(T - Q, T)
    block = attention_cuda(q, k, v, q_pos, np.arange(T), True, 0, True, threads=8)
    for r, p in enumerate(q_pos):
        one = attention_cuda(q[r:r + 1], k[:, :p + 1], v[:, :p + 1], q_pos[r:r + 1], np.arange(p + 1), True, 0, True,
                             threads=8)
        assert np.array_equal(one[0], block[r]), r


def test_attention_query_that_sees_nothing_is_zero():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 2, 2, 1, 8, 4)
    q_pos, k_pos = np.array([3, 50]), np.arange(4)  # query at 50: outside a window of 2
    got = attention_cuda(q, k, v, q_pos, k_pos, False, 2)
    assert np.all(got[1] == 0) and np.any(got[0] != 0)
    np.testing.assert_allclose(got, attention(q, k, v, q_pos, k_pos, False, 2), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ linear parity
@pytest.mark.parametrize("wdtype", ["bf16", "f32"])
def test_linear_matches_reference(wdtype):
    rng = np.random.default_rng(9)
    w = _as(wdtype, rng.standard_normal((12, 24)))  # [N, K]
    for M, threads in ((1, 2), (3, 8), (ROW_TILE + 2, 2)):  # the last crosses a row tile
        x = rng.standard_normal((M, 24)).astype(np.float32)
        got = linear_cuda(x, w, threads=threads)
        want = linear_reference(x, w)
        scale = np.abs(x) @ np.abs(bf16_to_f32_array(w) if wdtype == "bf16" else w).T  # [M, N]
        assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-7), f"M={M} threads={threads}"


# ------------------------------------------------------------------ simulator shared memory
@pytest.fixture
def racy_shared_allocation(monkeypatch):
    """Widen the window in which the simulator creates a block's shared array: allocation
    sleeps (handing the GIL to the block's other threads) and returns NaN-poisoned memory, so
    a thread that got a private copy instead of the block's array reads NaN, not stale values
    that happen to be right. Before cuda_common serialised the allocation, every kernel below
    failed here in a large share of launches (and the decode tests now and then)."""
    import time

    real_empty = np.empty

    def slow_poisoned_empty(shape, dtype=float, *args, **kwargs):
        time.sleep(2e-3)
        a = real_empty(shape, dtype, *args, **kwargs)
        if np.issubdtype(a.dtype, np.floating):
            a.fill(np.nan)
        return a

    monkeypatch.setattr(np, "empty", slow_poisoned_empty)


def test_shared_arrays_are_one_per_block_under_racy_allocation(racy_shared_allocation):
    """Every thread of a block sees the other threads' writes to a shared array (the property
    the reductions in cuda_linear / cuda_attention rely on), launch after launch."""
    from numba import float32

    nt = 4

    @cuda.jit
    def neighbour(out):
        tid = cuda.threadIdx.x
        buf = cuda.shared.array(nt, float32)
        buf[tid] = float32(tid)
        cuda.syncthreads()
        out[tid] = buf[(tid + 1) % nt]

    for _ in range(10):
        out = np.full(nt, -1.0, dtype=np.float32)
        neighbour[1, nt](out)
        assert out.tolist() == [1.0, 2.0, 3.0, 0.0]


def test_reduction_kernels_are_deterministic_under_racy_allocation(racy_shared_allocation):
    """linear and attention give bit-identical results launch after launch (and agree with the
    CPU) while the shared-array allocation is slow and poisoned."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal((4, 16)).astype(np.float32)
    q, k, v = _qkv(rng, 2, 2, 1, 8, 5)
    q_pos, k_pos = np.array([3, 4]), np.arange(5)
    want_y = linear_reference(x, w)
    want_a = attention(q, k, v, q_pos, k_pos, True, 0)
    first_y = first_a = None
    for _ in range(5):
        y = linear_cuda(x, w, threads=4)
        a = attention_cuda(q, k, v, q_pos, k_pos, True, 0, threads=4)
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-6)
        if first_y is None:
            first_y, first_a = y, a
        assert np.array_equal(_bits(y), _bits(first_y)) and np.array_equal(_bits(a), _bits(first_a))


# ------------------------------------------------------------------ the Ops object
def test_get_ops_cuda_has_the_cpu_methods():
    cpu, gpu = get_ops("cpu"), get_ops("cuda")
    assert gpu.device == "cuda"
    for name in ("linear", "attention", "grouped_conv", "prepare_weight", "short_conv", "gated_delta"):
        assert callable(getattr(gpu, name)) and callable(getattr(cpu, name))


def test_prepared_weights_are_uploaded_once():
    """After prepare_weight the device copy is used: changing the host array afterwards does
    not change the result (it would if linear re-uploaded w on every call)."""
    ops = get_ops("cuda")
    rng = np.random.default_rng(2)
    w = f32_to_bf16_array(rng.standard_normal((6, 8)))
    x = rng.standard_normal((2, 8)).astype(np.float32)
    assert ops.prepare_weight(w) is w and ops.weight_bytes == w.nbytes
    before = ops.linear(x, w)
    w[:] = 0  # host only
    np.testing.assert_array_equal(ops.linear(x, w), before)
    assert np.any(before != 0)
    np.testing.assert_array_equal(get_ops("cuda").linear(x, w), 0)  # unprepared: uploaded per call


def test_cuda_ops_refuse_without_a_device(monkeypatch):
    monkeypatch.setattr(cuda_ops, "cuda_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="no CUDA device is available"):
        get_ops("cuda")


def test_cli_device_cuda_without_gpu_says_so(tmp_path):
    """With the simulator off and no GPU, `--device cuda` is a one-line named refusal."""
    from dflash2_numba import tiny

    t = tiny.write_target(tmp_path / "t", hidden_size=32, intermediate_size=32, num_hidden_layers=1)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    probe = subprocess.run([sys.executable, "-c", "from numba import cuda; print(cuda.is_available())"],
                           env=env, capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() == "True":
        pytest.skip("a real CUDA device is available here")
    proc = subprocess.run([sys.executable, "-m", "dflash2_numba", "generate", "--target", str(t),
                           "--prompt-ids", "1,2", "--device", "cuda"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "DeviceUnavailableError" in proc.stderr and "no CUDA device is available" in proc.stderr


# ------------------------------------------------------------------ models on device="cuda"
TINY_TARGET = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, tokenizer_vocab_size=300, seed=1, init_std=0.5)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from dflash2_numba import tiny

    root = tmp_path_factory.mktemp("cuda_pair")
    t = tiny.write_target(root / "target", **TINY_TARGET)
    d = tiny.write_draft(root / "draft", t, kind="dflash2", num_hidden_layers=1, block_size=4,
                         conv_kernel_size=3, conv_group_size=8, seed=2, init_std=0.5)
    return t, d


def test_greedy_decode_on_cuda_equals_cpu(tiny_pair):
    """DFlash2 pair (conv on both sides of both sublayers), greedy: device="cuda" emits the CPU's
    tokens, which are the target's own greedy tokens (lossless)."""
    import dflash2_numba as dn

    t, d = tiny_pair
    out = {}
    for device in ("cpu", "cuda"):
        target = dn.load_target(t, device=device)
        draft = dn.load_draft(d, target)
        assert target.ops.device == device and draft.ops is target.ops
        out[device] = dn.generate(target, draft, prompt_ids=[5, 6, 7], max_new_tokens=6)
    assert out["cuda"].output_ids == out["cpu"].output_ids
    assert len(out["cuda"].output_ids) == 6
    ar = dn.generate(dn.load_target(t), None, prompt_ids=[5, 6, 7], max_new_tokens=6)
    assert out["cuda"].output_ids == ar.output_ids


def test_target_with_device_resident_kv_cache(tiny_pair):
    """The target's own cache on the cuda ops is device-resident (KVCache allocates through
    `ops.zeros`) and works with the unchanged forward: prefill growing past max_len (reserve
    copies on the device), crop, verify block; logits equal those of a host-cache run on the
    same ops and are close to the CPU's."""
    import dflash2_numba as dn
    from dflash2_numba.models.base import KVCache

    t, _ = tiny_pair
    gpu, cpu = dn.load_target(t, device="cuda"), dn.load_target(t)
    c = gpu.config
    caches = {"device": gpu.new_cache(2),
              "host": KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 2, zeros=np.zeros),
              "cpu": cpu.new_cache(2)}
    logits = {}
    for name, cache in caches.items():
        model = cpu if name == "cpu" else gpu
        model.forward(np.array([5, 6, 7]), cache)  # grows past max_len 2: reserve copies
        cache.commit(2)  # reject position 2
        logits[name], _ = model.forward(np.array([9, 4]), cache)  # overwrites position 2
    assert not isinstance(caches["device"].k, np.ndarray) and isinstance(caches["host"].k, np.ndarray)
    assert caches["device"].k.shape == caches["device"].v.shape
    np.testing.assert_allclose(logits["device"], logits["host"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits["device"], logits["cpu"], rtol=1e-4, atol=1e-4)


def test_gpu_check_small_runs_on_the_simulator(capsys):
    """bench/gpu_check.py --small: every check (conv bit-identity, attention, linear, cuda vs cpu
    decode) runs its real logic on tiny shapes and passes; exit status 0."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--small"]) == 0
    out = capsys.readouterr().out
    for kind in ("conv", "attention", "linear", "gdn", "decode"):
        assert any(line.startswith(kind) and " PASS " in line for line in out.splitlines()), kind
    assert "FAIL" not in out and "18/18 passed" in out
