"""`--kv-dtype bf16`: the KV caches (target and draft) hold bf16 bits (uint16), half the bytes.

- kernel: attention over a bf16 cache gives, bit for bit, the attention over an f32 cache holding
  the same (bf16-representable) values -- the widening is exact -- and equals the numpy
  reference; Q rows == Q one-row steps bitwise at contexts crossing tiles (row invariance);
- writes: the fused kernels (kv_store) and the op-by-op path (KVCache.write) round K and V to
  bf16 the same way, round-to-nearest-even as numerics.f32_to_bf16_array, so a model's cache
  holds the same bits whichever path ran a block;
- decode: speculation with a bf16 cache emits exactly target-only greedy with a bf16 cache
  (Qwen3 fused and op-by-op, the Qwen3.5 hybrid, DFlash and DFlash2 drafts); the cache bytes
  halve; the statistics name the dtype; bad values are refused (typed) before anything loads.
"""

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba.errors import GenerationArgumentError
from dflash2_numba.kernels import attention as attention_module
from dflash2_numba.kernels.attention import TILE, attention, attention_reference
from dflash2_numba.numerics import bf16_to_f32_array, f32_to_bf16_array, kv_array

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXTS = (TILE - 1, TILE + 1, 3 * TILE + 3)


def _case(seed, nq, nh, nkv, hd, T):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nq, nh, hd)).astype(np.float32)  # [nq, nh, hd]
    k = f32_to_bf16_array(rng.standard_normal((nkv, T + 8, hd)).astype(np.float32))  # [nkv, T+8, hd] bf16 bits
    v = f32_to_bf16_array(rng.standard_normal((nkv, T + 8, hd)).astype(np.float32))
    return q, k, v


@pytest.mark.parametrize("driver", ["serial", "parallel"])
@pytest.mark.parametrize("T", CONTEXTS)
@pytest.mark.parametrize("nq,nh,nkv", [(1, 4, 4), (8, 8, 2)])
def test_bf16_cache_is_the_f32_cache_of_its_values(monkeypatch, driver, T, nq, nh, nkv):
    monkeypatch.setattr(attention_module, "use_parallel", lambda macs: driver == "parallel")
    q, k, v = _case(T + nq, nq, nh, nkv, 16, T)
    kf, vf = bf16_to_f32_array(k), bf16_to_f32_array(v)  # the same values, stored as f32
    q_pos, k_pos = np.arange(T - nq, T), np.arange(T)
    got = attention(q, k, v, q_pos, k_pos, True, 0)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, attention(q, kf, vf, q_pos, k_pos, True, 0))
    want = attention_reference(q, kf[:, :T], vf[:, :T], q_pos, k_pos, True, 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
    # the reference reads bf16 bits as bf16 too (not as integers)
    np.testing.assert_allclose(attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, True, 0), want, atol=1e-6)


@pytest.mark.parametrize("T", CONTEXTS)
def test_bf16_cache_rows_equal_one_row_steps(T):
    q, k, v = _case(7 * T, 8, 8, 2, 16, T)
    q_pos, k_pos = np.arange(T - 8, T), np.arange(T)
    block = attention(q, k, v, q_pos, k_pos, True, 0)
    for i in range(8):
        p = T - 8 + i
        one = attention(q[i:i + 1], k, v, q_pos[i:i + 1], k_pos[:p + 1], True, 0)
        np.testing.assert_array_equal(block[i], one[0])


def _pair(tmp_path, kind="dflash2"):
    from dflash2_numba import tiny

    tdir = tiny.write_target(tmp_path / "t", hidden_size=64, intermediate_size=128, num_hidden_layers=4, seed=3)
    ddir = tiny.write_draft(tmp_path / kind, tdir, kind=kind, num_hidden_layers=2, seed=4)
    return tdir, ddir


def test_fused_and_op_by_op_writes_round_alike(tmp_path):
    """The same 9-token prefill through the fused layer kernel (kv_store in numba) and the
    op-by-op forward (KVCache.write in numpy): identical bf16 cache bits, == RNE of the f32
    cache's values."""
    tdir, _ = _pair(tmp_path)
    target = dn.load_target(tdir, kv_dtype="bf16")
    ids = np.arange(3, 12)
    fused_cache = target.new_cache(16)
    assert fused_cache.k.dtype == np.uint16
    target.forward(ids, fused_cache)
    plain_cache = target.new_cache(16)
    target._fused_layers = None  # the op-by-op path of families/qwen3.py
    target.forward(ids, plain_cache)
    n = len(ids)
    np.testing.assert_array_equal(fused_cache.k[:, :, :n], plain_cache.k[:, :, :n])
    np.testing.assert_array_equal(fused_cache.v[:, :, :n], plain_cache.v[:, :, :n])
    # layer 0's K/V do not depend on the cache (later layers read attention over it): they are
    # the f32 cache's values rounded to nearest even
    f32 = dn.load_target(tdir)
    f32_cache = f32.new_cache(16)
    f32.forward(ids, f32_cache)
    np.testing.assert_array_equal(fused_cache.k[0, :, :n], kv_array(f32_cache.k[0, :, :n], np.uint16))
    np.testing.assert_array_equal(fused_cache.v[0, :, :n], kv_array(f32_cache.v[0, :, :n], np.uint16))
    truncated = (f32_cache.k[0, :, :n].view(np.uint32) >> 16).astype(np.uint16)
    assert not np.array_equal(fused_cache.k[0, :, :n], truncated), \
        "rounding == truncation here: the check would not see a truncating writer"


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("Q", [2, 4, "auto"])
def test_speculation_with_a_bf16_cache_is_lossless(tmp_path, kind, Q):
    tdir, ddir = _pair(tmp_path, kind)
    target = dn.load_target(tdir, kv_dtype="bf16")
    draft = dn.load_draft(ddir, target)
    assert draft.new_state(8).k.dtype == np.uint16  # the draft's context cache follows the target's
    prompt = [5, 9, 2, 7, 11, 3, 8]
    ref = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=24)
    out = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=24, block_size=Q)
    assert out.output_ids == ref.output_ids
    assert out.stats.kv_dtype == "bf16"


def test_hybrid_target_with_a_bf16_cache(tmp_path):
    from dflash2_numba import tiny
    from dflash2_numba.tiny_hybrid import write_qwen3_5_target

    tdir = write_qwen3_5_target(tmp_path / "t", layout="text", seed=5)
    ddir = tiny.write_draft(tmp_path / "d", tdir, kind="dflash2", num_hidden_layers=2, seed=6)
    target = dn.load_target(tdir, kv_dtype="bf16")
    assert target.new_cache(8).kv.k.dtype == np.uint16
    prompt = [4, 8, 15, 16, 23, 42]
    ref = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=16)
    out = dn.generate(target, dn.load_draft(ddir, target), prompt_ids=prompt, max_new_tokens=16, block_size=4)
    assert out.output_ids == ref.output_ids


def test_embedded_pair_greedy_and_logit_difference():
    """The trained embedded pair: the bf16 cache keeps target-only greedy identical to the f32
    cache's on a 64-token run, and the last-position logits differ by < 1e-2 (absolute; the
    logits are O(10))."""
    from dflash2_numba.default import default_pair

    tdir, _ = default_pair(notice=False)
    f32, bf16 = dn.load_target(tdir), dn.load_target(tdir, kv_dtype="bf16")
    prompt = f32.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    a = dn.generate(f32, None, prompt_ids=prompt, max_new_tokens=64)
    b = dn.generate(bf16, None, prompt_ids=prompt, max_new_tokens=64)
    assert b.output_ids == a.output_ids
    assert b.stats.kv_cache_bytes * 2 == a.stats.kv_cache_bytes
    assert "(bf16 K and V)" in b.stats.format()
    ids = prompt + a.output_ids
    la, _ = f32.forward(ids, f32.new_cache(len(ids)), last_only=True)  # [1, V]
    lb, _ = bf16.forward(ids, bf16.new_cache(len(ids)), last_only=True)
    diff = np.abs(la - lb).max()
    print(f"max |logit(f32 cache) - logit(bf16 cache)| = {diff:.3g} over {la.shape[1]} logits, {len(ids)} positions")
    assert 0 < diff < 3e-2, diff  # 0 would mean the cache was not rounded at all


def test_refusals():
    from dflash2_numba.default import default_pair

    tdir, _ = default_pair(notice=False)
    with pytest.raises(GenerationArgumentError, match="kv_dtype must be one of .*'f16'"):
        dn.load_target(tdir, kv_dtype="f16")
    with pytest.raises(GenerationArgumentError, match="kv_dtype='bf16' is implemented on the CPU only"):
        dn.load_target(tdir, device="cuda", kv_dtype="bf16")


def test_cli_kv_dtype(tmp_path):
    from click.testing import CliRunner

    from dflash2_numba.cli import main

    r = CliRunner().invoke(main, ["generate", "--prompt", "def f(x):", "--max-new-tokens", "8", "--kv-dtype", "bf16"])
    assert r.exit_code == 0, r.output
    assert "(bf16 K and V)" in r.output
    r = CliRunner().invoke(main, ["generate", "--prompt", "x", "--kv-dtype", "f16"])
    assert r.exit_code == 2 and "'f16' is not one of" in r.output
