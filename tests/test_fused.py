"""The fused CPU engine (kernels/fused.py: one numba call per decoder layer, one per draft context
update) against the op-by-op path it replaces (the reference: `model.fused = False`).

The fused layer calls the same kernels in the same order, so the gate is BIT equality
(np.array_equal) of everything the layer writes: logits, taps, the target's K/V cache, the
draft's block states and the block K/V it scribbles past the context. It covers Qwen3 (qk norm)
and Llama (none), a sliding-window layer, f32 and bf16 run modes, 1..16 rows after a prefill,
DFlash and DFlash2 drafts (conv) at power-of-two and other Q, and one and two threads with the
parallel threshold at 0 (so the parallel GEMV / attention drivers run inside the fused call).
A spy checks that the fused layer really ran (equality with itself proves nothing), and the
fused target is also compared with the plain-numpy device, which shares no kernel with it.

Mutations tried on kernels/fused.py, each turning this file red:
- wrong residual order (the MLP normed the layer's INPUT h instead of h after attention):
  every target/draft equality test;
- a row's K/V written at position start+i+1: every target test (logits and cache);
- K/V written for rows 0..n-2 only (the last row dropped): the multi-row target tests;
- DFlash2's mlp conv finish skipped: the dflash2 draft tests;
- the context update without the k_norm, or writing its K/V one position late: the 4 draft tests;
- a thread split that drops the last chunk (prange over items - 1 in panels._gemv_panels_par): not
  visible here as fused-vs-op (both share the GEMV) but red in test_fused_matches_numpy_device
  with two threads and in tests/test_panels.py.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.decode.warmup import parallel_threshold
from dflash2_numba.kernels import fused
from dflash2_numba.models.draft import load_draft
from dflash2_numba.families.qwen3 import TargetModel

PREFILL = 11


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    qwen = tiny.write_target(root / "qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, seed=3, init_std=0.1,
                             extra_config=dict(use_sliding_window=True, sliding_window=4,
                                               layer_types=["full_attention", "sliding_attention",
                                                            "full_attention"]))
    llama = tiny.write_target(root / "llama", architecture="llama", hidden_size=48, intermediate_size=80,
                              num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                              seed=4, init_std=0.1, tie_word_embeddings=True)
    return {"qwen3": qwen, "llama": llama}


class FusedSpy:
    """Counts calls of a fused entry point (the fused path must really run)."""

    def __init__(self, monkeypatch, name: str = "decoder_layer"):
        self.calls, inner = 0, getattr(fused, name)

        def spy(*args):
            self.calls += 1
            return inner(*args)

        monkeypatch.setattr(fused, name, spy)


def run_target(target, rows: int, engine: bool):
    """Prefill PREFILL tokens, then one forward of `rows` tokens; everything it produced."""
    target.fused = engine
    cache = target.new_cache(PREFILL + rows + 8)  # spare rows: a K/V written too far lands in them
    ids = (np.arange(PREFILL + rows) * 37 + 5) % 900
    taps_at = tuple(range(target.config.num_hidden_layers))
    l1, t1 = target.forward(ids[:PREFILL], cache, tap_layers=taps_at)
    l2, t2 = target.forward(ids[PREFILL:], cache, tap_layers=taps_at)
    n = cache.length
    return [l1, t1, l2, t2, cache.k[:, :, :n].copy(), cache.v[:, :, :n].copy()]


def assert_all_equal(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert np.array_equal(a, b), f"output {i}: max |diff| {np.abs(a - b).max()}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_target_fused_equals_op_by_op(targets, monkeypatch, arch, dtype, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba's pool has one thread")
    saved = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        with parallel_threshold(0 if threads > 1 else None):  # threads > 1: the parallel drivers
            target = dn.load_target(targets[arch], dtype=dtype)
            for rows in (1, 2, 5, 8, 16):
                want = run_target(target, rows, engine=False)
                spy = FusedSpy(monkeypatch)
                got = run_target(target, rows, engine=True)
                assert spy.calls == 2 * target.config.num_hidden_layers  # prefill + block, every layer
                assert_all_equal(got, want)
                monkeypatch.undo()
    finally:
        numba.set_num_threads(saved)


def test_fused_matches_numpy_device(targets):
    """Against the plain-numpy reference device (its own GEMV, attention, norms, exp): f32
    rounding only. Two threads and threshold 0, so a parallel split that loses work shows."""
    saved = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        with parallel_threshold(0):
            for arch in ("qwen3", "llama"):
                got = run_target(dn.load_target(targets[arch]), 8, engine=True)
                want = run_target(TargetModel.load(targets[arch], device="numpy"), 8, engine=False)
                for a, b in zip(got, want):
                    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max())
    finally:
        numba.set_num_threads(saved)


def test_block_past_the_kv_buffer_is_refused(targets):
    """The fused layer writes K/V without numpy's bounds checks, so it checks the room itself."""
    target = dn.load_target(targets["qwen3"])
    cache = target.new_cache(4)
    h = np.zeros((3, target.config.hidden_size), np.float32)
    q_pos, k_pos = np.arange(2, 5), np.arange(5)
    cos, sin = target.rope.span(2, 3)
    with pytest.raises(ValueError, match="no room"):
        fused.decoder_layer(h, *target._fused_layers[0], cache.k[0], cache.v[0], 2, q_pos, k_pos, cos, sin,
                            target._fused_shape, True, 0, np.float32(1e-6), False, fused.NEVER)


def test_prefill_longer_than_the_fused_rows_runs_op_by_op(targets, monkeypatch):
    target = dn.load_target(targets["qwen3"])
    spy = FusedSpy(monkeypatch)
    target.forward(np.arange(fused.GEMV_MAX_ROWS + 1), target.new_cache(64))
    assert spy.calls == 0


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_draft_fused_equals_op_by_op(targets, tmp_path, monkeypatch, kind, dtype):
    """The context K/V (fused.context_update) after a prefill and a 3-token step; block states
    of one request at Q = 2, 5 (not a power of two: the conv's modulo arm), 8 and 16 =
    block_size, and the block K/V written past the context."""
    target = dn.load_target(targets["qwen3"], dtype=dtype)
    d = tiny.write_draft(tmp_path / kind, targets["qwen3"], kind=kind, block_size=16, conv_kernel_size=3,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                         input_embedding_scale=1.5, init_std=0.2, seed=5)
    draft = load_draft(d, target)
    _, taps = target.forward(np.arange(PREFILL + 3) + 7, target.new_cache(64), tap_layers=draft.target_layer_ids)
    contexts = []
    for engine in (False, True):  # the context update: a prefill of PREFILL rows, then 3 more
        draft.fused = engine
        state = draft.new_state(64)
        spy = FusedSpy(monkeypatch, "context_update")
        draft.extend_context(state, taps[:PREFILL], 0, np.arange(PREFILL))
        draft.extend_context(state, taps[PREFILL:], PREFILL, np.arange(3))
        assert spy.calls == (2 if engine else 0)
        monkeypatch.undo()
        contexts.append([state.k[:, :, :PREFILL + 3].copy(), state.v[:, :, :PREFILL + 3].copy()])
    assert_all_equal(contexts[1], contexts[0])
    state.length = PREFILL  # the block below sits at PREFILL (rows past it are scratch)
    for Q in (2, 5, 8, 16):
        out = []
        for engine in (False, True):
            draft.fused = engine
            spy = FusedSpy(monkeypatch)
            h = draft.block_forward([state], [11], [PREFILL], Q)
            assert spy.calls == (draft.config.num_hidden_layers if engine else 0)
            monkeypatch.undo()
            out.append([h, state.k[:, :, PREFILL:PREFILL + Q].copy(), state.v[:, :, PREFILL:PREFILL + Q].copy()])
            state.k[:, :, PREFILL:] = np.nan  # the next run must write every block row itself
            state.v[:, :, PREFILL:] = np.nan
        assert_all_equal(out[1], out[0])
