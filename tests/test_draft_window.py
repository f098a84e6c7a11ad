"""The draft window (`draft_window` N, `--draft-window N`): the draft's block attends to the
last N context positions (p - N .. p - 1) and its own block, and nothing older.

- kernel: attention(first=f) equals the numpy reference with key rows < f masked, at contexts
  crossing tile boundaries;
- draft: block_forward with the window equals tests/draft_reference.py's float64 recomputation
  with context positions < p - N masked, for full, sliding (its window kept) and GQA drafts;
  the window really changes the output (else the comparison gates nothing);
- decode: greedy speculation with a window still emits exactly the target's tokens, the
  statistics carry the window, a drafter without context attention refuses it (typed).
"""

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba.errors import GenerationArgumentError
from dflash2_numba.kernels import attention as attention_module
from dflash2_numba.kernels.attention import TILE, attention, attention_reference

from draft_reference import DraftReference
from test_draft import VARIANTS, B, P, assert_close, fill_context, random_taps, write_v1


@pytest.mark.parametrize("driver", ["serial", "parallel"])
@pytest.mark.parametrize("T,first", [(40, 1), (40, 33), (TILE + 9, TILE - 2), (2 * TILE + 8, TILE + 1), (2 * TILE + 8, 2 * TILE)])
def test_kernel_masks_rows_before_first(monkeypatch, driver, T, first):
    monkeypatch.setattr(attention_module, "use_parallel", lambda macs: driver == "parallel")
    rng = np.random.default_rng(T + first)
    q = rng.standard_normal((8, 4, 16)).astype(np.float32)  # a draft block: 8 rows at the end
    k, v = (rng.standard_normal((2, T, 16)).astype(np.float32) for _ in range(2))
    q_pos, k_pos = np.arange(T - 8, T), np.arange(T)
    for causal in (False, True):
        got = attention(q, k, v, q_pos, k_pos, causal, 0, first=first)
        want = attention_reference(q, k, v, q_pos, k_pos, causal, 0, first=first)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
        sliced = attention_reference(q, k[:, first:], v[:, first:], q_pos, k_pos[first:], causal, 0)
        np.testing.assert_allclose(got, sliced, rtol=0, atol=3e-6)  # the reference's mask, independently
    with pytest.raises(ValueError, match="first key row"):
        attention(q, k, v, q_pos, k_pos, False, 0, first=T + 1)


@pytest.mark.parametrize("variant", ["full-noncausal", "window3-causal", "gqa"])
@pytest.mark.parametrize("N", [1, 4, P - 1])
def test_block_forward_equals_masked_reference(tmp_path, target_dir, target, variant, N):
    draft_dir = write_v1(tmp_path, target_dir, variant, **VARIANTS[variant])
    draft = dn.load_draft(draft_dir, target)
    ref = DraftReference(target_dir, draft_dir)
    taps = random_taps(draft)
    state = fill_context(draft, taps)
    state.draft_window = N
    anchor = 57
    for Q in (B, 3):
        h = draft.block_forward([state], [anchor], [P], Q)  # [Q, H]
        h_ref, _ = ref.forward(taps, anchor, Q, draft_window=N)
        assert_close(h, h_ref, f"{variant} window {N} Q={Q}")
        h_full, _ = ref.forward(taps, anchor, Q)
        changed = np.max(np.abs(h_ref - h_full)) > 1e-3 * np.max(np.abs(h_full))
        # the window matters unless every layer already slides within it (a draft keeps its sliding layers)
        W = VARIANTS[variant].get("sliding_window")
        all_sliding = all(t == "sliding_attention" for t in VARIANTS[variant].get("layer_types", ["full"]))
        assert changed == (N < W - 1 if all_sliding else N < P), (changed, N)
    # the op-by-op path (several requests) honours it too
    other = fill_context(draft, taps)
    other.draft_window = N
    h2 = draft.block_forward([state, other], [anchor, anchor], [P, P], B)
    assert_close(h2[:B], ref.forward(taps, anchor, B, draft_window=N)[0], f"{variant} batched window {N}")


def test_window_reaching_past_the_context_is_the_full_draft(tmp_path, target_dir, target):
    draft = dn.load_draft(write_v1(tmp_path, target_dir, "full-noncausal", **VARIANTS["full-noncausal"]), target)
    state = fill_context(draft, random_taps(draft))
    full = draft.block_forward([state], [57], [P], B)
    state.draft_window = P
    assert np.array_equal(draft.block_forward([state], [57], [P], B), full)


def test_generate_with_window_is_lossless_and_reported(tmp_path, target_dir, target):
    draft = dn.load_draft(write_v1(tmp_path, target_dir, "full-noncausal", **VARIANTS["full-noncausal"]), target)
    prompt = np.random.default_rng(4).integers(0, target.valid_vocab, 12).tolist()
    ref = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=24)
    out = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=24, block_size=4, draft_window=5)
    assert out.output_ids == ref.output_ids
    assert out.stats.draft_window == 5 and ref.stats.draft_window == 0
    with pytest.raises(GenerationArgumentError, match="draft_window"):
        dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=4, draft_window=-1)
    with pytest.raises(GenerationArgumentError, match="no context attention"):
        dn.generate(target, dn.OracleDrafter(target, block_size=4), prompt_ids=prompt, max_new_tokens=4,
                    draft_window=8)


def test_statistics_separate_the_context_catch_up(tmp_path, target_dir, target):
    """A 12-token prompt at Q=4: the first drafted step feeds the whole prompt to the draft (a
    catch-up: more than a block of context), every later one at most a block (the accepted
    tokens). Fixed width: every step drafts but a last one the budget leaves one row. A 3-token
    prompt has no catch-up."""
    draft = dn.load_draft(write_v1(tmp_path, target_dir, "full-noncausal", **VARIANTS["full-noncausal"]), target)
    prompt = np.random.default_rng(4).integers(0, target.valid_vocab, 12).tolist()
    s = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=24, block_size=4).stats
    assert s.drafted_steps >= s.steps - 1 >= 3 and s.catch_up_steps == 1
    assert 0 < s.catch_up_draft_s < s.draft_s
    assert s.draft_s_per_step == pytest.approx((s.draft_s - s.catch_up_draft_s) / (s.drafted_steps - 1))
    assert "draft context catch-up" in s.format() and s.to_dict()["draft_s_per_step"] == s.draft_s_per_step
    short = dn.generate(target, draft, prompt_ids=prompt[:3], max_new_tokens=24, block_size=4).stats
    assert short.catch_up_steps == 0 and short.draft_s_per_step == pytest.approx(short.draft_s / short.drafted_steps)


def test_server_request_field_and_refusals(target):
    """`draft_window` in a request body: parsed, typed (400 on a wrong type), and refused with its
    param named for a drafter without context attention or a negative value."""
    from dflash2_numba.decode.sampling import SamplingParams
    from dflash2_numba.serve.engine import Engine
    from dflash2_numba.serve.protocol import BadRequest, GenRequest
    from test_serve_units import parse

    assert parse({"prompt": [1, 2], "draft_window": 64}).draft_window == 64
    assert parse({"prompt": [1, 2]}).draft_window is None
    with pytest.raises(BadRequest) as e:
        parse({"prompt": [1, 2], "draft_window": "64"})
    assert e.value.param == "draft_window"
    engine = Engine.__new__(Engine)  # the checks only: no model load, no worker thread
    engine.target, engine.block_size, engine.draft_window = target, None, 32
    for draft, window in ((dn.OracleDrafter(target, block_size=4), 8), (None, -1)):
        engine.draft = draft
        with pytest.raises(Exception) as e:
            engine.check(GenRequest("completion", "m", [1, 2], 4, SamplingParams(0.0), draft_window=window))
        assert getattr(e.value, "param", None) == "draft_window", e.value
    engine.draft = None
    assert engine._draft_window(GenRequest("completion", "m", [1, 2], 4, SamplingParams(0.0))) == 32
