"""The speculative loop's bookkeeping (spec §5): greedy output == target-only greedy AND the
acceptance is exactly what an oracle drafter must get (a bookkeeping bug that keeps the output
right shows up only there).

Two targets: `HashTarget` (tests/decode_doubles.py, a causal hash-LM: microseconds per token, so
the sweep is exhaustive) and a real tiny Qwen3 TargetModel written by `tiny.write_target`.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dflash2_numba.decode.drafter import OracleDrafter
from dflash2_numba.decode.loop import generate, stream_generate
from dflash2_numba.errors import GenerationArgumentError

from decode_doubles import HashTarget, RandomDrafter, TapCheckingDrafter, greedy_reference

PROMPT_LENGTHS = (1, 7, 60)
QS = (2, 3, 5, 8, 16)
N_NEW = 103  # 102 after the prefill token: full steps for every Q, then a partial last step


def _prompt(n, V, seed=0):
    return np.random.default_rng(seed).integers(0, V, n).tolist()


def _check_oracle_run(target, draft, prompt, Q, n_new, ref):
    """Output == reference (which may end early at a stop id), exactly Q accepted per full
    step, the partial last step fully accepted, ONE target forward of Bv rows per step."""
    if hasattr(target, "forward_rows"):
        target.forward_rows.clear()
    steps = list(stream_generate(target, draft, prompt_ids=prompt, max_new_tokens=n_new, block_size=Q))
    stats = steps[-1].stats
    out = [t for s in steps for t in s.token_ids]
    assert out == ref
    reason = "length" if len(ref) == n_new else "stop"
    assert steps[-1].finish_reason == reason and all(s.finish_reason is None for s in steps[:-1])
    # rows per step: Q while the budget allows, then the remainder; stop once ref is covered
    remaining, rows = n_new - 1, []
    while remaining and sum(rows) < len(ref) - 1:
        rows.append(min(Q, remaining))
        remaining -= rows[-1]
    assert stats.block_rows == rows
    assert stats.acceptance_lengths == rows, "oracle drafts must all be accepted"
    assert [s.accepted for s in steps] == [0] + [r - 1 for r in rows]
    assert stats.steps == len(rows) and stats.new_tokens == len(ref)
    assert stats.tau == pytest.approx(sum(rows) / len(rows) if rows else 0.0)
    if hasattr(target, "forward_rows"):  # prefill + exactly one verify forward per step
        assert target.forward_rows == [len(prompt)] + rows
    return rows


@pytest.mark.parametrize("n_prompt", PROMPT_LENGTHS)
def test_oracle_hash_target_all_q(n_prompt):
    target = HashTarget(vocab_size=48, valid=44, seed=3)
    prompt = _prompt(n_prompt, 44, n_prompt)
    ref = greedy_reference(target, prompt, N_NEW)
    target.forward_rows.clear()
    assert generate(target, None, prompt_ids=prompt, max_new_tokens=N_NEW).output_ids == ref
    assert target.forward_rows == [n_prompt] + [1] * (N_NEW - 1)
    for Q in QS:
        oracle = OracleDrafter(HashTarget(vocab_size=48, valid=44, seed=3), block_size=16)
        draft = TapCheckingDrafter(oracle, HashTarget(vocab_size=48, valid=44, seed=3),
                                   tap_layers=(0, 2))  # context == taps of a fresh prefill
        rows = _check_oracle_run(target, draft, prompt, Q, N_NEW, ref)
        # the draft saw every committed position before the last proposing step's anchor
        last = max(i for i, r in enumerate(rows) if r >= 2)
        assert draft.checked_rows == n_prompt + sum(rows[:last])


@pytest.mark.parametrize("Q", QS)
def test_bad_drafter_still_exact(Q):
    """Random drafts: almost everything rejected, output still the target's greedy output."""
    target = HashTarget(vocab_size=48, valid=44, seed=4)
    prompt = _prompt(7, 44, 1)
    ref = greedy_reference(target, prompt, N_NEW)
    r = generate(target, RandomDrafter(target, block_size=16, seed=Q), prompt_ids=prompt,
                 max_new_tokens=N_NEW, block_size=Q)
    assert r.output_ids == ref and r.finish_reason == "length"
    assert sum(r.stats.acceptance_lengths) == N_NEW - 1
    # with rejections, only the anchor + accepted rows' taps may become draft context
    draft = TapCheckingDrafter(RandomDrafter(target, block_size=16, seed=Q), HashTarget(
        vocab_size=48, valid=44, seed=4), tap_layers=(1, 3))
    assert generate(target, draft, prompt_ids=prompt, max_new_tokens=N_NEW, block_size=Q).output_ids == ref


# ---------------------------------------------------------------- stop tokens, mask, budget
def test_stop_token_mid_block_truncates_inclusively():
    target = HashTarget(vocab_size=48, valid=44, seed=5)
    prompt = _prompt(5, 44, 2)
    ref = greedy_reference(target, prompt, 60)
    Q = 8
    # a stop id whose first occurrence is in the middle of a block: index 1..8 is block 1
    k = next(i for i in range(3, 60) if ref.index(ref[i]) == i and i % Q not in (0, 1))
    stop = ref[k]
    oracle = OracleDrafter(HashTarget(vocab_size=48, valid=44, seed=5), block_size=Q)
    steps = list(stream_generate(target, oracle, prompt_ids=prompt, max_new_tokens=60,
                                 stop_token_ids=[stop]))
    out = [t for s in steps for t in s.token_ids]
    assert out == ref[:k + 1] and steps[-1].finish_reason == "stop"
    assert steps[-1].token_ids[-1] == stop and len(steps[-1].token_ids) < Q  # cut mid-block
    assert steps[-1].stats.new_tokens == k + 1
    # target-only decoding stops at the same place
    r = generate(target, None, prompt_ids=prompt, max_new_tokens=60, stop_token_ids=[stop])
    assert r.output_ids == ref[:k + 1] and r.finish_reason == "stop"


def test_stop_on_prefill_token():
    target = HashTarget(seed=6)
    prompt = [1, 2]
    first = greedy_reference(target, prompt, 1)[0]
    for draft in (None, OracleDrafter(HashTarget(seed=6), block_size=4)):
        steps = list(stream_generate(target, draft, prompt_ids=prompt, max_new_tokens=10, stop_token_ids=[first]))
        assert len(steps) == 1 and steps[0].token_ids == [first] and steps[0].finish_reason == "stop"


def test_mask_token_is_kept():
    """A committed token that equals the draft's mask_token_id is a real token."""
    target = HashTarget(seed=7)
    prompt = [4, 5, 6]
    ref = greedy_reference(target, prompt, 40)
    oracle = OracleDrafter(HashTarget(seed=7), block_size=6)
    oracle.mask_token_id = ref[9]
    r = generate(target, oracle, prompt_ids=prompt, max_new_tokens=40)
    assert r.output_ids == ref and ref.count(oracle.mask_token_id) >= 1


@pytest.mark.parametrize("n_new", [1, 2, 3, 7, 8, 9, 15, 16, 17])
def test_exact_max_new_tokens(n_new):
    target = HashTarget(seed=8)
    ref = greedy_reference(target, [9], n_new)
    for draft in (None, OracleDrafter(HashTarget(seed=8), block_size=8),
                  RandomDrafter(target, block_size=8, seed=1)):
        r = generate(target, draft, prompt_ids=[9], max_new_tokens=n_new)
        assert r.output_ids == ref and len(r.output_ids) == n_new and r.finish_reason == "length"


def test_argument_errors():
    target = HashTarget(seed=9)
    oracle = OracleDrafter(HashTarget(seed=9), block_size=8)
    for bad in (dict(block_size=1), dict(block_size=0), dict(block_size=9), dict(block_size=2.5),
                dict(max_new_tokens=0), dict(temperature=-1.0), dict(prompt_ids=[]),
                dict(prompt_ids=[48]), dict(prompt_ids=[-1])):
        kw = dict(prompt_ids=[1, 2], max_new_tokens=4) | bad
        with pytest.raises(GenerationArgumentError):
            stream_generate(target, oracle, **kw)  # raised at the call, before the first step
    # target-only decoding ignores block_size
    assert len(generate(target, None, prompt_ids=[1], max_new_tokens=3, block_size=1).output_ids) == 3


# ---------------------------------------------------------------- a real tiny Qwen3 target
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from dflash2_numba import tiny
    from dflash2_numba.api import load_target

    # one thread: a tiny model's kernels are dominated by thread-pool wake-ups otherwise
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    path = tiny.write_target(tmp_path_factory.mktemp("spec") / "target", seed=0, init_std=0.2)
    yield load_target(path)
    numba.set_num_threads(threads)


@pytest.mark.parametrize("n_prompt", PROMPT_LENGTHS)
def test_oracle_real_target_all_q(tiny_target, n_prompt):
    """Greedy speculative == manual argmax loop over TargetModel.forward, and all Q-1 oracle
    drafts accepted on every full step, for Q in 2,3,5,8,16 and 103 new tokens."""
    target = tiny_target
    prompt = _prompt(n_prompt, target.valid_vocab, 10 + n_prompt)
    ref = greedy_reference(target, prompt, N_NEW, target.tokenizer.stop_ids())
    assert generate(target, None, prompt_ids=prompt, max_new_tokens=N_NEW).output_ids == ref
    for Q in QS:
        _check_oracle_run(target, OracleDrafter(target, block_size=16), prompt, Q, N_NEW, ref)


def test_real_target_context_taps(tiny_target):
    """The draft context equals the taps of a fresh prefill over the committed ids (within
    f32 noise: the loop computes them in verify blocks), with a bad drafter (rejections)."""
    target = tiny_target
    prompt = _prompt(7, target.valid_vocab, 3)
    ref = greedy_reference(target, prompt, 40, target.tokenizer.stop_ids())
    draft = TapCheckingDrafter(RandomDrafter(target, block_size=8, seed=2), target,
                               tap_layers=(0, 2), atol=1e-4)
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=40, block_size=5)
    assert r.output_ids == ref and draft.checked_rows >= 7 + len(ref) - 6
