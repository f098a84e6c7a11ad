"""DFlash v1 draft (spec §2.2, §3) against the independent float64 forward of
tests/draft_reference.py: full recomputation of [context ++ block] with an explicit visibility
mask, for causal / non-causal, sliding-window (W=3, small enough to cut the context) and GQA
drafts. The context cache is fed in several chunks; block K/V must never persist.

Mutations tried on models/draft.py (each turned this file red): context through the layer's
input_layernorm; no k_norm on the context; window off by one (|q-s| <= W); causal flag ignored;
block positions starting at p+1; anchor row embedded as a mask; block attending only to itself
(context dropped); lm_head on rows 0..Q-2 instead of the mask rows; sampled drafts drawn from
softmax(z) instead of the reported q, or taken as argmax(q); argmax drafting while sampling.
"""

from __future__ import annotations

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.decode.sampling import SamplingParams, target_probs
from dflash2_numba.errors import GenerationArgumentError, PairingError
from dflash2_numba.models.draft import DFlashDraft

from draft_reference import DraftReference, check_greedy_equals_target_only, check_seeded_sampling

H = 64  # = conftest.DRAFT_TEST_HIDDEN, the hidden size of the `target` fixture
P = 11  # context length (committed tokens before the anchor)
B = 8  # trained block size of the tiny drafts

VARIANTS = {
    "full-noncausal": dict(is_causal=False),
    "full-causal": dict(is_causal=True),
    # sliding layer with window 3 (sees 2 positions each side) next to a full layer
    "window3-noncausal": dict(is_causal=False, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=3),
    "window3-causal": dict(is_causal=True, layer_types=["full_attention", "sliding_attention"],
                           sliding_window=3),
    # GQA 4:1 with nh*hd = 128 != H
    "gqa": dict(is_causal=False, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                layer_types=["sliding_attention", "sliding_attention"], sliding_window=4),
}


def write_v1(tmp, target_dir, name, seed=2, **kw):
    return tiny.write_draft(tmp / name, target_dir, kind="dflash", block_size=B, seed=seed,
                            init_std=0.2, **kw)


def random_taps(draft, n=P, seed=0):
    return np.random.default_rng(seed).standard_normal((n, draft.config.n_taps * H)).astype(np.float32)


def fill_context(draft, taps, chunks=(4, 1, 6)):
    """Feed the context in several extend_context calls (as the decode loop does)."""
    state = draft.new_state(64)
    start = 0
    for n in chunks:
        draft.extend_context(state, taps[start:start + n], start, np.zeros(n, np.int64))
        start += n
    assert state.length == start == len(taps)
    return state


def assert_close(got, ref, what, tol=2e-5):
    """f32 kernels vs a float64 recomputation (or f32 vs f32 in another order): max error
    relative to the tensor's largest value."""
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err < tol, f"{what}: max error {err:.2e} relative to the largest value"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_v1_matches_reference(tmp_path, target_dir, target, variant):
    draft_dir = write_v1(tmp_path, target_dir, variant, **VARIANTS[variant])
    draft = dn.load_draft(draft_dir, target)
    assert isinstance(draft, DFlashDraft) and draft.kind == "dflash"
    ref = DraftReference(target_dir, draft_dir)
    taps = random_taps(draft)
    state = fill_context(draft, taps)
    anchor = 57
    for Q in (B, 3):
        h = draft.block_forward([state], [anchor], [P], Q)  # [Q, H]
        h_ref, z_ref = ref.forward(taps, anchor, Q)
        assert_close(h, h_ref, f"{variant} Q={Q} final states")
        assert_close(target.lm_head(h[1:]), z_ref, f"{variant} Q={Q} mask-row logits")
        prop = draft.propose(state, anchor, P, Q, SamplingParams(), None)
        z_ref[:, target.valid_vocab:] = -np.inf
        assert prop.q is None and prop.draft_ids.tolist() == np.argmax(z_ref, -1).tolist()
        assert [s["candidate_ids"][0] for s in prop.info["slots"]] == prop.draft_ids.tolist()
        assert state.length == P  # block K/V never persist


def test_window_and_causality_matter(tmp_path, target_dir):
    """The reference itself: the variants really differ (else the sweep above gates nothing)."""
    taps = np.random.default_rng(0).standard_normal((P, 2 * H))
    outs = {}
    for variant in ("full-noncausal", "full-causal", "window3-noncausal"):
        outs[variant] = DraftReference(target_dir, write_v1(tmp_path, target_dir, variant, **VARIANTS[variant])
                                       ).forward(taps, 57, B)[1]
    a, b, c = outs.values()
    assert np.max(np.abs(a - b)) > 1e-2 * np.max(np.abs(a))
    assert np.max(np.abs(a - c)) > 1e-2 * np.max(np.abs(a))


def test_context_chunks_equal_one_shot(tmp_path, target_dir, target):
    draft = dn.load_draft(write_v1(tmp_path, target_dir, "w", **VARIANTS["window3-causal"]), target)
    taps = random_taps(draft, n=20, seed=3)
    one = fill_context(draft, taps, chunks=(20,))
    many = fill_context(draft, taps, chunks=(1, 7, 2, 1, 9))
    np.testing.assert_allclose(many.k[:, :, :20], one.k[:, :, :20], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(many.v[:, :, :20], one.v[:, :, :20], rtol=1e-6, atol=1e-6)
    assert_close(draft.block_forward([many], [5], [20], 6), draft.block_forward([one], [5], [20], 6),
                 "chunked vs one-shot context", tol=1e-5)
    with pytest.raises(GenerationArgumentError, match="start_pos"):  # a gap is refused
        draft.extend_context(many, taps[:2], 21, np.zeros(2, np.int64))


def test_block_kv_never_persist(tmp_path, target_dir, target):
    draft = dn.load_draft(write_v1(tmp_path, target_dir, "full", **VARIANTS["full-noncausal"]), target)
    taps = random_taps(draft, n=P + 1)
    state = fill_context(draft, taps[:P])
    first = draft.block_forward([state], [9], [P], 5)
    draft.block_forward([state], [300], [P], B)  # another block in between
    np.testing.assert_array_equal(draft.block_forward([state], [9], [P], 5), first)
    # the block scratch past the context is overwritten by the next committed token's K/V
    draft.extend_context(state, taps[P:], P, np.zeros(1, np.int64))
    fresh = fill_context(draft, taps, chunks=(P + 1,))
    assert_close(draft.block_forward([state], [9], [P + 1], 4), draft.block_forward([fresh], [9], [P + 1], 4),
                 "after a block, context extended", tol=1e-5)
    with pytest.raises(GenerationArgumentError, match="context holds"):
        draft.propose(state, 9, P, 4, SamplingParams(), None)


def test_batched_requests_match_single(tmp_path, target_dir, target):
    """block_forward over two requests (rows end to end) == each request alone."""
    draft = dn.load_draft(write_v1(tmp_path, target_dir, "w", **VARIANTS["window3-noncausal"]), target)
    s1 = fill_context(draft, random_taps(draft, n=P, seed=1))
    s2 = fill_context(draft, random_taps(draft, n=7, seed=2), chunks=(7,))
    both = draft.block_forward([s1, s2], [3, 4], [P, 7], 5)  # [10, H]
    assert_close(both[:5], draft.block_forward([s1], [3], [P], 5), "request 1 of 2", tol=1e-5)
    assert_close(both[5:], draft.block_forward([s2], [4], [7], 5), "request 2 of 2", tol=1e-5)


def test_sampled_proposal_reports_its_own_distribution(tmp_path, target_dir, target):
    draft_dir = write_v1(tmp_path, target_dir, "s", **VARIANTS["full-causal"])
    draft = dn.load_draft(draft_dir, target)
    taps = random_taps(draft)
    state = fill_context(draft, taps)
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    _, z_ref = DraftReference(target_dir, draft_dir).forward(taps, 57, 6)
    z_ref[:, target.valid_vocab:] = -np.inf
    prop = draft.propose(state, 57, P, 6, sampling, np.random.default_rng(0))
    assert prop.q.dtype == np.float32 and prop.q.shape == (5, target.config.vocab_size)
    expect = np.stack([target_probs(row, sampling) for row in z_ref])  # [5, V]
    np.testing.assert_allclose(prop.q, expect, atol=1e-5)
    assert all(prop.q[i, d] > 0 for i, d in enumerate(prop.draft_ids))
    assert not prop.q[:, target.valid_vocab:].any()  # padding never proposed
    # the draws follow q: over many proposals slot 0's frequencies match q[0] (chi-square)
    rng, counts = np.random.default_rng(1), np.zeros(target.config.vocab_size)
    for _ in range(200):
        counts[draft.propose(state, 57, P, 2, sampling, rng).draft_ids[0]] += 1
    support = prop.q[0] > 0  # at most top_k = 5 ids: chi-square with <= 4 degrees of freedom
    exp = 200 * prop.q[0][support]
    chi2 = float(np.sum((counts[support] - exp) ** 2 / exp))
    assert counts[~support].sum() == 0 and chi2 < 25.0, (chi2, support.sum())


def test_bf16_mode_zero_copy_and_close_to_f32(tmp_path, target_dir, target):
    draft_dir = write_v1(tmp_path, target_dir, "b", **VARIANTS["window3-causal"])
    t16 = dn.load_target(target_dir, dtype="bf16")
    d16, d32 = dn.load_draft(draft_dir, t16), dn.load_draft(draft_dir, target)
    w = d16.layers[0]["q"]
    assert w.dtype == np.uint16 and not w.flags.owndata and not w.flags.writeable  # a view of the file map
    taps = np.round(random_taps(d32) * 64) / 64  # bf16-representable, as the target's taps are
    h16 = d16.block_forward([fill_context(d16, taps)], [57], [P], B)
    h32 = d32.block_forward([fill_context(d32, taps)], [57], [P], B)
    from dflash2_numba.numerics import round_bf16_array
    np.testing.assert_array_equal(h16, round_bf16_array(h16))  # activations are bf16 values
    err = np.max(np.abs(h16 - h32)) / np.max(np.abs(h32))
    assert 0 < err < 5e-2, err


def test_pairing_refusals(tmp_path, target_dir, target):
    other = tiny.write_target(tmp_path / "wide", hidden_size=96, intermediate_size=128, num_hidden_layers=4)
    with pytest.raises(PairingError, match="hidden_size 96 != target hidden_size 64"):
        dn.load_draft(tiny.write_draft(tmp_path / "d96", other, kind="dflash"), target)
    with pytest.raises(PairingError, match=r"target_layer_ids \[7\]"):
        dn.load_draft(tiny.write_draft(tmp_path / "d7", target_dir, kind="dflash", target_layer_ids=[1, 7]), target)


def test_greedy_speculative_equals_target_only(tmp_path, target_dir, target):
    check_greedy_equals_target_only(target, dn.load_draft(write_v1(tmp_path, target_dir, "e2e", **VARIANTS["window3-causal"]), target))


def test_sampled_generation_runs_with_draft_q(tmp_path, target_dir, target):
    check_seeded_sampling(target, dn.load_draft(write_v1(tmp_path, target_dir, "s", **VARIANTS["full-causal"]), target))


def test_lazy_info_builds_once_on_first_access():
    """Proposal.info may be a LazyInfo: nothing is built until read, then built exactly once."""
    from dflash2_numba.decode.drafter import LazyInfo

    calls = []
    info = LazyInfo(lambda: calls.append(1) or {"slots": [1, 2], "chosen_slots": [0]})
    assert calls == []
    assert info["slots"] == [1, 2] and dict(info) == {"slots": [1, 2], "chosen_slots": [0]}
    assert len(info) == 2 and calls == [1]
