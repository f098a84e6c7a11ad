"""Speculative decoding on a Qwen3.5 hybrid target (tiny, written by transformers): exact state
rollback of the hybrid cache, greedy equality with DFlash2 / DFlash drafts from the project's
writer (tiny.write_draft), and lossless sampling.

The rollback gate: an oracle drafter right for exactly `a` rows then wrong, for every a in
0..Q-1; after each step the cache must hold exactly the state of a fresh target run over the
committed prefix (recurrent + conv state, and the next logits, <= 1e-6 relative in f32).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.decode.drafter import OracleDrafter
from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.models.draft import load_draft
from dflash2_numba.models.hybrid_cache import REPLAY_ROWS
from dflash2_numba.families.qwen3_5 import Qwen3_5Model
from dflash2_numba.families.qwen3_5 import resolve_qwen3_5_config

from decode_doubles import rowwise_ops
from draft_reference import check_greedy_equals_target_only
from qwen3_5_fixtures import V, build_hf_qwen3_5
from test_sampling import exact_sequence_probs, gof_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")

REL = 1e-6  # the bound; with row-wise ops (below) the measured difference is 0
MASK_ID = V - 1
TAP_IDS = [1, 2]  # a GDN layer and an attention layer


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_hf_qwen3_5(tmp_path_factory.mktemp("hybrid"), multimodal=True, tied=False, seed=5)


@pytest.fixture(scope="module")
def target(target_dir):
    return Qwen3_5Model.load(target_dir)


@pytest.fixture(scope="module")
def drafts(target_dir, target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drafts")
    out = {}
    for kind in ("dflash2", "dflash"):
        d = tiny.write_draft(tmp / kind, target_dir, kind=kind, block_size=16, target_layer_ids=TAP_IDS,
                             mask_token_id=MASK_ID, num_hidden_layers=2, seed=3, init_std=0.2)
        out[kind] = load_draft(d, target, kind=kind)
    return out


def load_target_config_any(d):
    return resolve_qwen3_5_config(json.loads((d / "config.json").read_text()))


def fresh_run(target, ids):
    """(last-row logits, cache) of a fresh target over ids (one prefill)."""
    cache = target.new_cache(len(ids))
    logits, _ = target.forward(np.asarray(ids), cache, last_only=True)
    return logits[-1], cache


def greedy_chain(target, prompt, n):
    cache = target.new_cache(len(prompt) + n)
    logits, _ = target.forward(np.asarray(prompt), cache, last_only=True)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits, _ = target.forward(np.array([out[-1]]), cache)
    return out


def rel_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-30))




@pytest.mark.parametrize("Q", [5, 16])
def test_rollback_is_exact_for_every_accepted_count(target_dir, Q):
    """For every a in 0..Q-1, three verify steps with drafts right for exactly a rows: the
    acceptance is a, and after each commit the recurrent state, the conv state and the next
    logits equal a fresh run over the committed prefix."""
    target = Qwen3_5Model(load_target_config_any(target_dir), open_checkpoint(target_dir), rowwise_ops())
    rng = np.random.default_rng(Q)
    prompt = rng.integers(0, V, 11).tolist()  # longer than the conv window (K - 1 = 3)
    steps = 3
    chain = greedy_chain(target, prompt, 1 + steps * Q)  # the committed tokens of greedy decoding
    worst = {"state": 0.0, "conv": 0.0, "logits": 0.0}
    for a in range(Q):
        cache = target.new_cache(8)
        target.forward(np.asarray(prompt), cache, last_only=True)
        ids = prompt + chain[:1]  # the anchor (first token, from the prefill) is ids[-1]
        for _ in range(steps):
            start = len(ids) - 1
            right = chain[len(ids) - len(prompt):][:a]  # the greedy continuation after the anchor
            wrong = (chain[len(ids) - len(prompt) + a] + 1) % V
            junk = rng.integers(0, V, max(0, Q - 2 - a)).tolist()  # a = Q-1: all right, no wrong row
            block = np.array([ids[-1]] + right + [wrong] + junk)[:Q]  # [Q]
            logits, _ = target.forward(block, cache)  # [Q, V]
            picks = np.argmax(logits, axis=1)
            accepted = next((i for i in range(Q - 1) if picks[i] != block[i + 1]), Q - 1)
            assert accepted == a, (a, accepted)
            cache.commit(start + a + 1)
            ids += right + [int(picks[a])]  # the a accepted drafts + the correction
            # the state now must be that of a fresh run over ids[:-1] (the anchor is not in it)
            _, fresh = fresh_run(target, ids[:-1])
            want_logits, _ = fresh_run(target, ids)
            for name in ("state", "conv"):
                d = rel_diff(getattr(cache, name), getattr(fresh, name))
                worst[name] = max(worst[name], d)
                assert d <= REL, (a, name, d)
            probe, _ = target.forward(np.array([ids[-1]]), cache)  # the next anchor's logits
            d = rel_diff(probe[-1], want_logits)
            worst["logits"] = max(worst["logits"], d)
            assert d <= REL, (a, d)
            cache.commit(len(ids) - 1)  # undo the probe (a 0-row replay)
    print(f"\n  Q={Q}, a = 0..{Q - 1}: worst relative difference to a fresh run: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


def test_commit_refuses_below_the_floor(target):
    cache = target.new_cache()
    target.forward(np.arange(6), cache)
    cache.commit(4)
    with pytest.raises(ValueError, match=r"commit\(3\).*4\.\.4"):
        cache.commit(3)
    # a block longer than REPLAY_ROWS (a prefill) is sealed, its rows never captured
    target.forward(np.arange(REPLAY_ROWS + 1) % V, cache)
    assert cache.floor == cache.length == 4 + REPLAY_ROWS + 1 and not any(cache.captured)
    with pytest.raises(ValueError, match="is gone"):
        cache.commit(cache.length - 1)


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
def test_greedy_speculative_equals_target_only(target, drafts, kind):
    check_greedy_equals_target_only(target, drafts[kind], block_sizes=(2, 5, 8, 16), n_new=40)


@pytest.mark.parametrize("Q", [2, 5, 8, 16])
def test_oracle_drafter_accepts_everything(target, Q):
    """The oracle runs the target row by row and commits back to its anchor (several forwards
    between commits): every full step accepts all Q-1 drafts and the output is the greedy one."""
    prompt = np.random.default_rng(1).integers(0, V, 9).tolist()
    ref = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=34).output_ids
    r = dn.generate(target, OracleDrafter(target, block_size=16), prompt_ids=prompt, max_new_tokens=34,
                    block_size=Q)
    assert r.output_ids == ref
    assert r.stats.acceptance_lengths[:-1] == [Q] * (len(r.stats.acceptance_lengths) - 1)


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
def test_seeded_sampling_reproducible(target, drafts, kind):
    kw = dict(prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=20, block_size=4, temperature=0.8, top_k=20)
    runs = [dn.generate(target, drafts[kind], seed=11, **kw).output_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20
    assert runs[0] != dn.generate(target, drafts[kind], seed=12, **kw).output_ids


def test_speculative_sampling_matches_exact_distribution(target_dir, tmp_path):
    """3-token continuations over 6 valid ids (the rest masked as padding): token 1 from the
    prefill, tokens 2-3 from ONE speculative step of the DFlash2 draft (selector q, rejections
    and a rollback of the hybrid state on most samples). 1500 samples vs the exact enumerated
    distribution, chi-square p > 1e-3."""
    target = Qwen3_5Model.load(target_dir)
    target.valid_vocab = 6  # before the draft loads: its selector masks the same ids
    d = tiny.write_draft(tmp_path / "d2", target_dir, kind="dflash2", block_size=4, target_layer_ids=TAP_IDS,
                         mask_token_id=MASK_ID, seed=4, init_std=0.3, selector_top_k=4)
    draft = load_draft(d, target, kind="dflash2")
    params, n, prompt = SamplingParams(temperature=1.5), 1500, [3, 1, 4, 1, 5]
    exact = exact_sequence_probs(target, prompt, 3, params)
    counts, accepted = {}, 0
    for i in range(n):
        r = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=3, block_size=3,
                        temperature=params.temperature, seed=i)
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
        accepted += sum(r.stats.acceptance_lengths) - len(r.stats.acceptance_lengths)
    p = gof_pvalue(counts, exact, n)
    print(f"\n  {len(counts)} sequences seen, drafts accepted {accepted / n:.2f} per sample, p = {p:.3g}")
    assert 0.1 < accepted / n < 1.9  # both branches (accept, reject + rollback) are exercised
    assert p > 1e-3
