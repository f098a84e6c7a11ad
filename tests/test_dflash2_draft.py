"""DFlash2 draft (spec §4): the conv around every sublayer, input_embedding_scale, the runtime
conv block length, the selector wiring and its refusals.

Gates:
- identity conv (taps 1, base 1, projection 0) + scale 1: the DFlash2 block forward is
  BIT-IDENTICAL to the DFlash v1 forward of the same weights (f32 and bf16 run modes);
- against tests/draft_reference.py (float64, the §4.2 conv written again loop by loop) with
  random conv weights (tap-0 base 1 + 0.1 noise, older taps 0.1 noise, projection std 0.2), taps 2 and 3,
  input_embedding_scale 1.7, at Q = block_size and at a runtime Q = 5 < block_size, and for two
  requests laid end to end (where a block length taken from the checkpoint makes the taps of one
  request read the other's rows).

Mutations tried on models/dflash2.py / models/draft.py, each turning this file red: delete each
of the four conv call sites (attention prepare, attention finish, mlp prepare, mlp finish);
prepare on side 1 and finish on side 0; only the finish base from side 0; side and tap axes of
the projection confused (reshape [N, taps, 2, G]); conv block length = config.block_size (red in
test_two_requests_end_to_end by value and in test_v2_matches_reference by the call spy; with one
request of Q <= B rows the position n % Q == n % B, so a single block cannot show it by value);
input_embedding_scale dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.errors import SelectorRefusedError
from dflash2_numba.models.dflash2 import DFlash2Draft

from draft_reference import DraftReference, check_greedy_equals_target_only, check_seeded_sampling
from test_draft import B, H, P, assert_close, fill_context, random_taps

GREEDY = SamplingParams()
SCALE = 1.7


def write_v2(path, target_dir, taps=2, seed=2, **kw):
    """Random conv weights: base = perturbed identity with sizeable older taps, projection
    std 0.2 (deltas of order 1 after a normed input)."""
    kw = dict(dict(block_size=B, conv_kernel_size=taps, conv_group_size=16, selector_rank=8,
                   selector_top_k=6, input_embedding_scale=SCALE, is_causal=False,
                   layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                   init_std=0.2), **kw)
    return tiny.write_draft(path, target_dir, kind="dflash2", seed=seed, **kw)


class ConvSpy:
    """Wraps ops.grouped_conv of one draft: records (rows, block_len, dtype) of every call."""

    def __init__(self, draft):
        self.calls, self.inner = [], draft.ops.grouped_conv
        draft.fused = False  # the spy watches the op-by-op call sites; test_fused.py: fused == op by op
        draft.ops = dataclasses.replace(draft.ops, grouped_conv=self)

    def __call__(self, x, delta, base, group_size, block_len):
        self.calls.append((x.shape[0], block_len, x.dtype))
        return self.inner(x, delta, base, group_size, block_len)


# ---------------------------------------------------------------- identity conv == DFlash v1
@pytest.mark.parametrize("dtype", ("f32", "bf16"))
def test_identity_conv_is_bit_identical_to_v1(tmp_path, target_dir, dtype):
    common = dict(block_size=B, seed=5, init_std=0.2, is_causal=True,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    v1_dir = tiny.write_draft(tmp_path / "v1", target_dir, kind="dflash", **common)
    v2_dir = tiny.write_draft(tmp_path / "v2", target_dir, kind="dflash2", conv_kernel_size=1,
                              identity_conv=True, input_embedding_scale=1.0, **common)
    t = dn.load_target(target_dir, dtype=dtype)
    v1, v2 = dn.load_draft(v1_dir, t), dn.load_draft(v2_dir, t)
    assert isinstance(v2, DFlash2Draft) and not isinstance(v1, DFlash2Draft)
    spy = ConvSpy(v2)
    taps = np.round(random_taps(v1) * 64) / 64  # bf16-representable
    for Q in (B, 5):
        h1 = v1.block_forward([fill_context(v1, taps)], [57], [P], Q)
        h2 = v2.block_forward([fill_context(v2, taps)], [57], [P], Q)
        np.testing.assert_array_equal(h2, h1)
        np.testing.assert_array_equal(t.lm_head(h2[1:]), t.lm_head(h1[1:]))
    # ... and the conv really ran (4 call sites x 2 layers per forward) in the run mode's dtype
    assert len(spy.calls) == 2 * 8 and {c[2] for c in spy.calls} == {np.dtype(np.uint16 if dtype == "bf16" else np.float32)}


# ---------------------------------------------------------------- against the float64 reference
@pytest.mark.parametrize("taps", (2, 3))
def test_v2_matches_reference(tmp_path, target_dir, target, taps):
    draft_dir = write_v2(tmp_path / f"t{taps}", target_dir, taps=taps)
    draft = dn.load_draft(draft_dir, target)
    ref = DraftReference(target_dir, draft_dir)
    ctx = random_taps(draft)
    state = fill_context(draft, ctx)
    spy = ConvSpy(draft)
    for Q in (B, 5, 3):  # the trained block size, then runtime Q smaller than it
        h = draft.block_forward([state], [57], [P], Q)
        h_ref, z_ref = ref.forward(ctx, 57, Q)
        assert_close(h, h_ref, f"taps={taps} Q={Q} final states")
        assert_close(target.lm_head(h[1:]), z_ref, f"taps={taps} Q={Q} mask-row logits")
        assert all(call[:2] == (Q, Q) for call in spy.calls[-8:])  # conv block = the runtime Q
    assert state.length == P


def test_two_requests_end_to_end(tmp_path, target_dir, target):
    """Rows of two requests laid end to end (§4.2): taps must not cross the request boundary,
    which holds only with the conv block length = the runtime Q (5 here, on a B=8 draft)."""
    draft_dir = write_v2(tmp_path / "d", target_dir, taps=3)
    draft, ref = dn.load_draft(draft_dir, target), DraftReference(target_dir, draft_dir)
    c1, c2 = random_taps(draft, n=P, seed=1), random_taps(draft, n=6, seed=2)
    s1, s2 = fill_context(draft, c1), fill_context(draft, c2, chunks=(6,))
    h = draft.block_forward([s1, s2], [57, 91], [P, 6], 5)  # [10, H]
    assert_close(h[:5], ref.forward(c1, 57, 5)[0], "request 1")
    assert_close(h[5:], ref.forward(c2, 91, 5)[0], "request 2")


def test_reference_is_sensitive_to_each_conv_ingredient(tmp_path, target_dir):
    """The reference gates something: the conv moves the output, and so do the scale and the sides."""
    draft_dir = write_v2(tmp_path / "d", target_dir, taps=2)
    ref = DraftReference(target_dir, draft_dir)
    ctx = np.random.default_rng(0).standard_normal((P, 2 * H))
    base = ref.forward(ctx, 57, B)[0]
    ref.scale = 1.0
    assert np.max(np.abs(ref.forward(ctx, 57, B)[0] - base)) > 1e-2
    ref.scale = SCALE
    for name, w in ref.W.items():
        if name.endswith("base_kernel"):
            ref.W[name] = w[::-1].copy()  # sides swapped
    assert np.max(np.abs(ref.forward(ctx, 57, B)[0] - base)) > 1e-2


def test_bf16_mode_conv_in_bf16(tmp_path, target_dir, target):
    draft_dir = write_v2(tmp_path / "d", target_dir)
    t16 = dn.load_target(target_dir, dtype="bf16")
    d16, d32 = dn.load_draft(draft_dir, t16), dn.load_draft(draft_dir, target)
    spy = ConvSpy(d16)
    ctx = np.round(random_taps(d32) * 64) / 64
    h16 = d16.block_forward([fill_context(d16, ctx)], [57], [P], 6)
    h32 = d32.block_forward([fill_context(d32, ctx)], [57], [P], 6)
    assert {c[2] for c in spy.calls} == {np.dtype(np.uint16)} and len(spy.calls) == 8
    err = np.max(np.abs(h16 - h32)) / np.max(np.abs(h32))
    assert 0 < err < 5e-2, err


# ---------------------------------------------------------------- selector wiring
def test_zero_selector_walk_is_the_reference_argmax(tmp_path, target_dir, target):
    """Codebooks 0 and no scalars: the selector walk picks each row's best logit, so the
    draft ids follow from the independent forward (wiring of rows, anchor and positions)."""
    draft_dir = write_v2(tmp_path / "d", target_dir, zero_selector=True)
    draft = dn.load_draft(draft_dir, target)
    ctx = random_taps(draft)
    state = fill_context(draft, ctx)
    for Q in (B, 4):
        prop = draft.propose(state, 57, P, Q, GREEDY, None)
        _, z_ref = DraftReference(target_dir, draft_dir).forward(ctx, 57, Q)
        z_ref[:, target.valid_vocab:] = -np.inf
        assert prop.q is None and prop.draft_ids.tolist() == np.argmax(z_ref, -1).tolist()
        assert len(prop.info["chosen_slots"]) == Q - 1 and len(prop.info["slots"]) == Q - 1


def test_selector_gets_the_final_normed_mask_rows(tmp_path, target_dir, target):
    draft = dn.load_draft(write_v2(tmp_path / "d", target_dir), target)
    state = fill_context(draft, random_taps(draft))
    h = draft.block_forward([state], [57], [P], 6)[1:]
    expect, _, _ = draft.selector.select(h, target.lm_head(h), 57, np.arange(P + 1, P + 6), GREEDY)
    prop = draft.propose(state, 57, P, 6, GREEDY, None)
    assert prop.draft_ids.tolist() == expect.tolist()
    sampled = draft.propose(state, 57, P, 6, SamplingParams(temperature=1.0, seed=3), None)
    assert sampled.q.shape == (5, target.config.vocab_size)
    assert all(sampled.q[i, d] > 0 for i, d in enumerate(sampled.draft_ids))


# ---------------------------------------------------------------- selector refusals
def _refused(draft_dir, target, capsys, boundary):
    draft = dn.load_draft(draft_dir, target)  # loading succeeds ...
    notice = capsys.readouterr().err
    assert "notice" in notice and boundary in notice, notice  # ... with a startup notice
    spy = ConvSpy(draft)
    state = fill_context(draft, random_taps(draft))
    with pytest.raises(SelectorRefusedError, match=boundary):
        draft.propose(state, 57, P, 5, GREEDY, None)
    assert len(spy.calls) == 2 * 4 and all(c[:2] == (5, 5) for c in spy.calls)  # the forward ran, conv included
    with pytest.raises(SelectorRefusedError):  # never a silent argmax fallback, sampled or not
        dn.generate(target, draft, prompt_ids=[5, 6, 7], max_new_tokens=8, temperature=1.0, seed=0)


def test_refusal_selector_tensors_absent(tmp_path, target_dir, target, capsys):
    _refused(write_v2(tmp_path / "d", target_dir, include_selector=False), target, capsys, "absent")


def test_refusal_top_k_above_vocab(tmp_path, target_dir, target, capsys):
    V = target.config.vocab_size
    _refused(write_v2(tmp_path / "d", target_dir, selector_top_k=V + 1), target, capsys, "selector_top_k")


def test_refusal_codebook_rows_not_target_vocab(tmp_path, target_dir, target, capsys):
    V = target.config.vocab_size
    other = tiny.write_target(tmp_path / "big", hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                              vocab_size=V + 64, seed=1)
    _refused(write_v2(tmp_path / "d", other), target, capsys, "codebook")


# ---------------------------------------------------------------- end to end
def test_greedy_speculative_equals_target_only(tmp_path, target_dir, target):
    check_greedy_equals_target_only(target, dn.load_draft(write_v2(tmp_path / "d", target_dir, taps=3), target))


def test_sampled_generation_runs_with_draft_q(tmp_path, target_dir, target):
    check_seeded_sampling(target, dn.load_draft(write_v2(tmp_path / "d", target_dir), target))
