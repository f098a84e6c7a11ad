"""The block attention of kernels/attention.py at long contexts: tiles of TILE keys, a partial
softmax per (tile, KV head) for every query row and head of the GQA group, merged per row in a
fixed tile order, tiles split over threads.

- equals the numpy reference at contexts that cross every tile boundary (T = TILE - 1, TILE,
  TILE + 1, several tiles and a partial one), for 1..16 rows, GQA groups of 1, 2 and 4 heads,
  with and without a sliding window, through the serial and the parallel driver;
- row invariance: a causal Q-row block (a verify) gives, bit for bit, the rows of Q one-row
  steps at positions start..start+Q-1 (each with keys 0..p), the parallel driver the bits of the
  serial one, on every instruction-set path (DFLASH2_ISA=avx2 / generic in a subprocess).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from dflash2_numba.kernels import attention as attention_module
from dflash2_numba.kernels.attention import NO_SINKS, TILE, attention, attention_reference

# contexts crossing the tile boundaries (3 * TILE + 3: a block whose early rows see 3 tiles, its
# late ones 4 -- two-tile merges commute, three do not); the block's rows sit at its end
CONTEXTS = (TILE - 1, TILE, TILE + 1, 2 * TILE + 3, 3 * TILE + 3, 4 * TILE + TILE // 2)


def _case(seed, nq, nh, nkv, hd, T):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nq, nh, hd)).astype(np.float32)  # [nq, nh, hd]
    k = rng.standard_normal((nkv, T + 8, hd)).astype(np.float32)  # [nkv, T + scratch, hd]
    v = rng.standard_normal((nkv, T + 8, hd)).astype(np.float32)
    k[:, T:] = np.nan  # rows past the keys: never read
    v[:, T:] = np.nan
    return q, k, v


def _force(monkeypatch, driver):
    monkeypatch.setattr(attention_module, "use_parallel", lambda macs: driver == "parallel")


@pytest.mark.parametrize("driver", ["serial", "parallel"])
@pytest.mark.parametrize("T", CONTEXTS)
@pytest.mark.parametrize("nq,nh,nkv", [(1, 4, 4), (4, 8, 4), (8, 8, 2), (16, 4, 2)])
@pytest.mark.parametrize("window", [0, 200])
def test_equals_reference_across_tiles(monkeypatch, driver, T, nq, nh, nkv, window):
    _force(monkeypatch, driver)
    q, k, v = _case(T * 31 + nq, nq, nh, nkv, 16, T)
    q_pos, k_pos = np.arange(T - nq, T), np.arange(T)
    got = attention(q, k, v, q_pos, k_pos, True, window)
    want = attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, True, window)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)


@pytest.mark.parametrize("T", CONTEXTS)
def test_non_causal_draft_block_across_tiles(monkeypatch, T):
    """The draft's use: context ++ block, bidirectional, GQA 4, keys over several tiles."""
    _force(monkeypatch, "parallel")
    q, k, v = _case(T, 8, 8, 2, 16, T)
    q_pos, k_pos = np.arange(T - 8, T), np.arange(T)
    for window in (0, 300):
        got = attention(q, k, v, q_pos, k_pos, False, window)
        want = attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, False, window)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)



@pytest.mark.parametrize("hd", [16, 64])
def test_keys_in_any_position_order(monkeypatch, hd):
    """k_pos need not increase: with shuffled key positions a row's visible keys are scattered
    inside [lo, hi) of a tile, and the unseen ones among them must weigh nothing."""
    _force(monkeypatch, "parallel")
    T = 2 * TILE + 37
    q, k, v = _case(hd + T, 6, 4, 2, hd, T)
    k_pos = np.random.default_rng(hd).permutation(T)  # [T] each key's position, shuffled
    q_pos = np.arange(T - 6, T) - 200  # [6] rows that see about 90% of the keys
    for causal, window in ((True, 0), (True, 500), (False, 300)):
        got = attention(q, k, v, q_pos, k_pos, causal, window)
        want = attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, causal, window)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)


@pytest.mark.parametrize("driver", ["serial", "parallel"])
@pytest.mark.parametrize("T", (TILE + 1, 3 * TILE + 3))
def test_sinks_across_tiles(monkeypatch, driver, T):
    """gpt-oss's sink logits (one per query head, joined after the tile merge) equal the
    reference's extra softmax column, and a Q-row causal block with sinks still gives the bits of
    its one-row steps."""
    _force(monkeypatch, driver)
    q, k, v = _case(T + 5, 8, 8, 2, 16, T)
    sinks = np.random.default_rng(T).normal(2.0, 2.0, 8).astype(np.float32)  # [nh]: some above every score
    q_pos, k_pos = np.arange(T - 8, T), np.arange(T)
    got = attention(q, k, v, q_pos, k_pos, True, 0, sinks=sinks)
    want = attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, True, 0, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
    assert not np.allclose(got, attention(q, k, v, q_pos, k_pos, True, 0), atol=1e-3)  # the sinks matter
    for i in range(8):  # row i alone, keys 0..its position
        one = attention(q[i:i + 1], k, v, q_pos[i:i + 1], np.arange(q_pos[i] + 1), True, 0, sinks=sinks)
        assert np.array_equal(one[0], got[i])

def row_invariance_failures(contexts=CONTEXTS, rows=(2, 4, 8, 16), windows=(0, 100, 300), hd=16) -> list:
    """Every (context, rows, window, driver) whose Q-row causal block differs in any bit from Q
    one-row steps, or whose parallel driver differs from the serial one. Also run as a script
    (the ISA subprocess test)."""
    bad = []
    drivers = {"serial": attention_module._attention_ser, "parallel": attention_module._attention_par}

    def run(driver, q, k, v, q_pos, T, window):
        out = np.empty(q.shape, np.float32)
        drivers[driver](q, k, v, q_pos, np.arange(T), 0, T, True, window, False, NO_SINKS, out)
        return out

    for T in contexts:
        for Q in rows:
            q, k, v = _case(T * 7 + Q, Q, 8, 2, hd, T)
            q_pos = np.arange(T - Q, T)
            for window in windows:
                block = {d: run(d, q, k, v, q_pos, T, window) for d in drivers}
                if not np.array_equal(block["serial"], block["parallel"]):
                    bad.append((T, Q, window, "parallel != serial"))
                for r, p in enumerate(q_pos):
                    one = run("serial", np.ascontiguousarray(q[r:r + 1]), k, v, q_pos[r:r + 1], p + 1, window)
                    if not np.array_equal(one[0], block["serial"][r]):
                        bad.append((T, Q, window, f"row {r} (position {p}) != its one-row step"))
    return bad


def test_q_rows_equal_q_one_row_steps_bitwise():
    assert row_invariance_failures() == []


# head sizes: 16, 64, 80 take the LLVM IR inner loops (attention_ir.py: 64 = one block of four
# 16-column accumulators, 80 = a block and a one-vector remainder), 24 the numba loops
@pytest.mark.parametrize("hd", [24, 64, 80])
def test_head_sizes_equal_reference_and_rows_invariant(monkeypatch, hd):
    for driver in ("serial", "parallel"):
        _force(monkeypatch, driver)
        for T in (TILE + 1, 3 * TILE + 3):
            q, k, v = _case(T + hd, 8, 8, 2, hd, T)
            q_pos, k_pos = np.arange(T - 8, T), np.arange(T)
            for window in (0, 300):
                got = attention(q, k, v, q_pos, k_pos, True, window)
                want = attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, True, window)
                np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
    # run mode "bf16" within one tile (across tiles each tile rounds exp(s - its own max), not the
    # reference's exp(s - the global max)); a weight whose exp lands near a bf16 rounding boundary may
    # still round the other way than np.exp's (one bf16 ulp, 2^-8 of that weight: np.exp's last
    # bits differ between numpy's SIMD paths, so which weights flip is the CPU's). So: a few
    # elements off by at most a few flips, the rest within 2e-5 (rounding the other way, or
    # truncating, moves most of them)
    T = TILE - 40
    q, k, v = _case(T - hd, 8, 8, 2, hd, T)
    q_pos, k_pos = np.arange(T - 8, T), np.arange(T)
    got = attention(q, k, v, q_pos, k_pos, True, 0, bf16_probs=True)
    diff = np.abs(got - attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, True, 0, bf16_probs=True))
    assert (diff > 2e-5).mean() < 0.03 and diff.max() < 4 * 2.0 ** -8 * np.abs(v[:, :T]).max(), \
        ((diff > 2e-5).mean(), diff.max())
    assert not np.allclose(got, attention(q, k, v, q_pos, k_pos, True, 0), rtol=0, atol=1e-5)  # it does round
    # the same in tile 1 alone: a window that shows the rows tile-1 keys only (100 keys a row, so
    # a flipped rounding moves an output by up to ~1e-4)
    T, window = 2 * TILE - 40, 100
    q, k, v = _case(T + 2 * hd, 8, 8, 2, hd, T)
    q_pos, k_pos = np.arange(T - 8, T), np.arange(T)
    got = attention(q, k, v, q_pos, k_pos, True, window, bf16_probs=True)
    np.testing.assert_allclose(got, attention_reference(q, k[:, :T], v[:, :T], q_pos, k_pos, True, window,
                                                        bf16_probs=True), rtol=0, atol=1e-4)
    assert not np.allclose(got, attention(q, k, v, q_pos, k_pos, True, window), rtol=0, atol=1e-4)
    assert row_invariance_failures(contexts=(TILE + 1, 3 * TILE + 3), rows=(4, 8), windows=(0, 300), hd=hd) == []


def ir_output_digest() -> str:
    """sha256 of the bits of attention_ir's loops (the 16-key scores, the per-key scores at the end
    of the buffer, the exp-and-weights-times-V pass) on fixed cases: hd 16, 64, 80, f32 and bf16
    caches, plain and bf16-rounded weights, some keys unseen (also run as a script: the cross-ISA
    test). The rest of the kernel (sums vectorised by numba) may differ between paths; these
    loops may not."""
    import hashlib

    from numba import njit

    from dflash2_numba.kernels.attention_ir import pv_chunk_ir, scores16_ir, scores_ir
    from dflash2_numba.numerics import f32_to_bf16_array

    @njit
    def loops(q, k, v, s, vis, mx, lacc, pacc, rnd):
        n, lo, hi = k.shape[1], 3, k.shape[1] - 5  # keys [lo, hi) of a 108-row buffer
        for hh in range(q.shape[1]):
            for c0 in range(0, n, 16):
                a0, a1 = max(c0, lo), min(c0 + 16, hi)
                if a1 > a0 and c0 + 16 <= n:
                    scores16_ir(q, 0, hh, k, 0, 0, np.float32(0.125), s, 0, hh, c0, a0, a1, vis, mx)
                elif a1 > a0:  # the last chunk runs past the buffer: key by key
                    scores_ir(q, 0, hh, k, 0, 0, np.float32(0.125), s, 0, hh, a0, a1, vis, mx)
            m = np.float32(-np.inf)
            for j in range(16):
                m = max(m, mx[0, hh, j])
            for c0 in range(0, n, 16):
                a0, a1 = max(c0, lo), min(c0 + 16, hi)
                if a1 > a0:
                    pv_chunk_ir(s, 0, hh, vis, v, 0, 0, c0, a0, a1, m, lacc, pacc, 0, 0, hh, rnd)

    h = hashlib.sha256()
    for hd in (16, 64, 80):
        q, k, v = _case(hd, 1, 2, 1, hd, 100)  # k, v [1, 108, hd]
        vis = (np.arange(112) % 7 != 3)[None, :]  # [1, 112] some keys unseen
        for kk, vv in ((k, v), (f32_to_bf16_array(k), f32_to_bf16_array(v))):
            for rnd in (False, True):
                s = np.zeros((1, 2, 112), np.float32)
                pacc = np.zeros((1, 1, 2, hd), np.float32)
                mx = np.full((1, 2, 16), -np.inf, np.float32)
                lacc = np.zeros((1, 2, 16), np.float32)
                loops(q, np.nan_to_num(kk), np.nan_to_num(vv), s, vis, mx, lacc, pacc, rnd)
                h.update(s.tobytes() + mx.tobytes() + lacc.tobytes() + pacc.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_row_invariance_on_lower_isa_paths(isa):
    """The same check compiled for a lower instruction-set path (kernels/isa.py override)."""
    env = dict(os.environ, DFLASH2_ISA=isa)  # numba's cache key holds the feature string: no collision
    code = ("import sys; sys.path.insert(0, 'tests'); from dflash2_numba.kernels import isa; "
            f"assert isa.selected() == {isa!r}, isa.selected(); "
            "from test_block_attention import row_invariance_failures as f; "
            "bad = f(rows=(4, 8), windows=(0, 300)); print(bad); sys.exit(1 if bad else 0)")
    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_ir_path_gives_the_same_bits_on_every_isa(isa):
    """The IR inner loops (llvm.fma, a fixed lane tree) give the native path's bits on a lower
    instruction-set path too (and do compute something: the digest differs from zeros')."""
    env = dict(os.environ, DFLASH2_ISA=isa)
    code = ("import sys; sys.path.insert(0, 'tests'); from dflash2_numba.kernels import isa; "
            f"assert isa.selected() == {isa!r}, isa.selected(); "
            "from test_block_attention import ir_output_digest; print(ir_output_digest())")
    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == ir_output_digest()


@pytest.mark.parametrize("hd", [16, 48, 64, 128])  # 64, 128: hd compiled as a constant; 16, 48: a loop
def test_16_key_scores_have_the_bits_of_the_per_key_scores(hd):
    """scores16_ir (a chunk's 16 lane trees as one transpose-and-add network) and scores_ir (key
    by key, used where a chunk runs past the rows of k) give every key the same bits, and the
    same maxima, so which of the two computes a key never shows (f32 and bf16 caches)."""
    from numba import njit

    from dflash2_numba.kernels.attention_ir import scores16_ir, scores_ir
    from dflash2_numba.numerics import as_f32, f32_to_bf16_array

    @njit
    def both(q, k, vis, s16, s1, m16, m1):
        n = k.shape[1]
        for hh in range(q.shape[1]):
            for c0 in range(0, n, 16):
                scores16_ir(q, 0, hh, k, 0, 0, np.float32(0.1), s16, 0, hh, c0, 5, n - 3, vis, m16)
            scores_ir(q, 0, hh, k, 0, 0, np.float32(0.1), s1, 0, hh, 5, n - 3, vis, m1)

    q, k, _ = _case(hd, 1, 3, 1, hd, 88)  # k [1, 96, hd]
    vis = (np.arange(96) % 5 != 2)[None, :]
    k = np.nan_to_num(k)  # rows 88.. are NaN in _case
    for kk in (k, f32_to_bf16_array(k)):
        s16, s1 = np.zeros((1, 3, 96), np.float32), np.zeros((1, 3, 96), np.float32)
        m16, m1 = np.full((1, 3, 16), -np.inf, np.float32), np.full((1, 3, 16), -np.inf, np.float32)
        both(q, kk, vis, s16, s1, m16, m1)
        assert np.array_equal(s16[:, :, 5:93].view(np.uint32), s1[:, :, 5:93].view(np.uint32))
        assert np.array_equal(m16.max(axis=2), m1[:, :, 0])
        want = (q[0] @ as_f32(kk)[0].T * np.float32(0.1))  # [3, 96] the scores, float32 matmul
        np.testing.assert_allclose(s16[0, :, 5:93], want[:, 5:93], rtol=0, atol=1e-5)
        np.testing.assert_allclose(m16[0].max(axis=1), np.where(vis[0, 5:93], want[:, 5:93], -np.inf).max(axis=1),
                                   rtol=0, atol=1e-5)  # the max over the visible keys of [5, 93) only
