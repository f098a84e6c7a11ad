"""Sampling: target_probs against transformers' logits warpers, the sampler, and LOSSLESS
speculative sampling (spec §5.1) tested statistically.

Statistical tests use fixed seeds (deterministic) and a chi-square goodness-of-fit with bins of
expected count < 5 pooled; the p-value comes from the Wilson-Hilferty normal approximation
(no scipy). Threshold: p > 1e-3 passes. Broken verifiers give p < 1e-10 (see
test_speculative_sampling_matches_exact_distribution)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from dflash2_numba.decode.drafter import OracleDrafter
from dflash2_numba.decode.loop import generate
from dflash2_numba.decode.sampling import (SamplingParams, greedy_token, mask_padded, sample_token,
                                           target_probs, verify_block)
from dflash2_numba.errors import GenerationArgumentError

from decode_doubles import HashTarget, RandomDrafter, SelectorDrafter


# ---------------------------------------------------------------- chi-square helpers
def chi2_pvalue(stat: float, dof: int) -> float:
    """Upper tail of chi-square(dof) at stat, Wilson-Hilferty approximation."""
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def gof_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Goodness of fit of observed counts {cell: count} to exact probs {cell: p}; cells with
    expected < 5 pooled into one bin (which then must have expected >= 5 or is dropped)."""
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e, o = n * p, counts.get(cell, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            dof += 1
        else:
            pool_obs, pool_exp = pool_obs + o, pool_exp + e
    assert sum(counts.values()) == n
    assert set(counts) <= set(probs), f"sequences with zero probability: {set(counts) - set(probs)}"
    if pool_exp >= 5:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    return chi2_pvalue(stat, dof)


def two_sample_pvalue(a: dict, b: dict) -> float:
    """Chi-square test that two samples of equal size come from one distribution."""
    cells = sorted(set(a) | set(b))
    stat, dof, pa, pb = 0.0, -1, 0, 0
    for c in cells:
        x, y = a.get(c, 0), b.get(c, 0)
        if x + y >= 10:
            stat += (x - y) ** 2 / (x + y)
            dof += 1
        else:
            pa, pb = pa + x, pb + y
    if pa + pb >= 10:
        stat += (pa - pb) ** 2 / (pa + pb)
        dof += 1
    return chi2_pvalue(stat, dof)


def test_chi2_pvalue_sanity():
    # chi2(10): median 9.342, 99.9th percentile 29.588 (tables)
    assert abs(chi2_pvalue(9.342, 10) - 0.5) < 0.01
    assert abs(chi2_pvalue(29.588, 10) - 0.001) < 0.0005


# ---------------------------------------------------------------- target_probs vs transformers
def _hf_probs(logits, t, k, p):
    x = torch.tensor(logits, dtype=torch.float64)[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    x = TemperatureLogitsWarper(t)(ids, x)
    if k:
        x = TopKLogitsWarper(k)(ids, x)
    if p < 1:
        x = TopPLogitsWarper(p)(ids, x)
    return torch.softmax(x, -1)[0].numpy()


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                   (0.9, 7, 0.6), (2.0, 1, 1.0), (1.0, 0, 0.05)])
def test_target_probs_matches_transformers_warpers(t, k, p):
    rng = np.random.default_rng(7)
    for _ in range(20):
        logits = (2.0 * rng.standard_normal(40)).astype(np.float32)
        ours = target_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p))
        np.testing.assert_allclose(ours, _hf_probs(logits, t, k, p), atol=1e-9)
        assert abs(ours.sum() - 1) < 1e-12


def test_padded_ids_masked_before_anything():
    logits = np.array([1.0, 2.0, 0.5, 9.0, 8.0], np.float32)  # ids 3,4 are padding
    m = mask_padded(logits, 3)
    assert greedy_token(m) == 1
    p = target_probs(m, SamplingParams(temperature=1.0, top_k=2))
    assert p[3] == p[4] == 0 and p[2] == 0 and abs(p[0] + p[1] - 1) < 1e-12
    # top_p: the nucleus is taken among real ids only
    p = target_probs(m, SamplingParams(temperature=1.0, top_p=0.5))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_greedy_ties_lowest_id_and_nan_never_wins():
    assert greedy_token(np.array([0.0, 3.0, 3.0, 1.0], np.float32)) == 1
    row = mask_padded(np.array([np.nan, 1.0, 2.0, np.nan], np.float32), None)
    assert greedy_token(row) == 2
    p = target_probs(np.array([5.0, 5.0, 1.0], np.float32), SamplingParams())
    assert p.tolist() == [1.0, 0.0, 0.0]


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=-1),
                dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-3)):
        with pytest.raises(GenerationArgumentError):
            SamplingParams(**bad)


def test_sample_token_matches_p_and_skips_zeros():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    n = 20000
    counts = np.bincount([sample_token(p, rng) for _ in range(n)], minlength=6)
    assert counts[0] == counts[2] == counts[5] == 0
    pv = gof_pvalue({i: c for i, c in enumerate(counts) if c}, {i: x for i, x in enumerate(p) if x}, n)
    assert pv > 1e-3, pv


# ---------------------------------------------------------------- verify_block, one row
@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_block_first_token_is_distributed_as_p(one_hot):
    """d ~ q, then verify: the emitted first token (accepted d, or the correction) ~ p exactly,
    for q far from p. 20000 draws, chi-square p > 1e-3."""
    rng = np.random.default_rng(1)
    V = 6
    logits = np.array([[2.0, 0.5, -1.0, 1.5, 0.0, -3.0], [0.0] * 6], np.float32)  # [2, V]
    params = SamplingParams(temperature=1.0)
    p = target_probs(logits[0], params)
    q = np.array([0.05, 0.05, 0.6, 0.1, 0.2, 0.0], np.float32)  # q puts mass where p has little
    n, counts = 20000, {}
    for _ in range(n):
        if one_hot:  # argmax proposal from some other model: always id 2
            d, qq = 2, None
        else:
            d, qq = sample_token(q, rng), q[None]
        a, x = verify_block(logits, np.array([d]), qq, params, rng)
        first = d if a == 1 else x
        counts[first] = counts.get(first, 0) + 1
    assert gof_pvalue(counts, {i: float(p[i]) for i in range(V)}, n) > 1e-3


# ---------------------------------------------------------------- end to end, exact distribution
def exact_sequence_probs(target, prompt, n_new, params):
    """P(x_1..x_n) = prod_i p(x_i | prompt, x_<i) by enumeration over the valid ids."""
    probs = {}

    def rec(prefix, prob):
        if len(prefix) == n_new:
            probs[tuple(prefix)] = prob
            return
        ids = list(prompt) + prefix
        logits, _ = target.forward(np.asarray(ids), target.new_cache(len(ids)))
        p = target_probs(mask_padded(logits[-1], target.valid_vocab), params)
        for x in np.nonzero(p)[0]:
            rec(prefix + [int(x)], prob * p[x])

    rec([], 1.0)
    return probs


def _sample_sequences(target, draft, n, params, n_new, Q, seed0):
    counts = {}
    for i in range(n):
        r = generate(target, draft, prompt_ids=[3, 1], max_new_tokens=n_new, block_size=Q,
                     temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                     seed=seed0 + i)
        seq = tuple(r.output_ids)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


DRAFTERS = {
    "oracle-hot-q": lambda t: OracleDrafter(t, block_size=4, mode="sample", temperature_scale=2.5),
    "random-uniform-q": lambda t: RandomDrafter(t, block_size=4, seed=5),
    "greedy-one-hot": lambda t: OracleDrafter(t, block_size=4, mode="greedy"),
    # the real DFlash2 selector's Gumbel walk and its q (tests/decode_doubles.SelectorDrafter)
    "dflash2-selector-walk": lambda t: SelectorDrafter(t, block_size=4, seed=3),
}


PARAMS = {"T1": SamplingParams(temperature=1.0),
          "T0.8-k4-p0.9": SamplingParams(temperature=0.8, top_k=4, top_p=0.9)}
N_SAMPLES, N_NEW = 3000, 4


def _hash_target():
    return HashTarget(vocab_size=8, valid=6, scale=1.2, seed=11)


@functools.lru_cache(maxsize=None)
def _target_only_counts(params_id):
    return _sample_sequences(_hash_target(), None, N_SAMPLES, PARAMS[params_id], N_NEW, None, 10**6)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("params_id", list(PARAMS))
def test_speculative_sampling_matches_exact_distribution(drafter, params_id):
    """4-token sequences over 6 valid ids (+2 padded) of a causal hash-LM: token 1 from the
    prefill, tokens 2-4 from ONE 3-row speculative step (2 drafts + bonus). 3000 speculative
    samples vs the exact enumerated distribution, and vs 3000 target-only samples; both
    chi-square p > 1e-3 (pooling cells with expected count < 5)."""
    params, n, n_new = PARAMS[params_id], N_SAMPLES, N_NEW
    target = _hash_target()
    draft = DRAFTERS[drafter](_hash_target())  # an identical model, so its calls are not counted
    exact = exact_sequence_probs(target, [3, 1], n_new, params)
    spec = _sample_sequences(target, draft, n, params, n_new, 4, 0)
    base = _target_only_counts(params_id)
    p_exact = gof_pvalue(spec, exact, n)
    p_base = gof_pvalue(base, exact, n)
    p_two = two_sample_pvalue(spec, base)
    assert p_exact > 1e-3 and p_two > 1e-3, (p_exact, p_two)
    assert p_base > 1e-3, p_base  # the reference sampler itself


def test_seed_reproducibility_and_variation():
    target = HashTarget(vocab_size=40, valid=36, scale=1.0, seed=2)
    draft = OracleDrafter(HashTarget(vocab_size=40, valid=36, scale=1.0, seed=2), block_size=4, mode="sample")
    kw = dict(prompt_ids=[1, 2, 3], max_new_tokens=30, temperature=1.0, block_size=4)
    a = generate(target, draft, seed=123, **kw).output_ids
    b = generate(target, draft, seed=123, **kw).output_ids
    c = generate(target, draft, seed=124, **kw).output_ids
    assert a == b and a != c


# ---------------------------------------------------------------- the adaptive width stays exact
def _auto_rule():
    """The `auto` rule (decode/width.py) with an injected cost table, shared by every sampled
    run so that its survival statistics carry over (past statistics are allowed to steer):
    verify rows cost 1 + 0.35 (r - 1), the draft 0.3, so widths 0, 1 and 2 all occur."""
    from dflash2_numba.decode.width import AdaptiveWidth, CostTable

    return AdaptiveWidth(CostTable(1.0 + 0.35 * np.arange(4), 0.3, "injected"), 4, online=False)


class BiasedWidth:
    """A FORBIDDEN width rule (test double): keeps draft j only while q_j(d_j), the probability
    of the token actually drawn at j, is above tau. Verifying a position then depends on the
    token drawn there, and the output leans towards tokens the draft likes."""
    name = "biased"

    def __init__(self, tau: float):
        self.tau = tau

    def draft_now(self, kmax):
        return True

    def choose(self, prop, kmax):
        k = 0
        while k < kmax and (1.0 if prop.q is None else prop.q[k, prop.draft_ids[k]]) > self.tau:
            k += 1
        return k

    def observe(self, *a):
        pass


def _sample_with_rule(target, draft, rule, params, n, seed0):
    counts, widths = {}, set()
    for i in range(n):
        r = generate(target, draft, prompt_ids=[3, 1], max_new_tokens=N_NEW, width=rule,
                     temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed0 + i)
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
        widths.update(r.stats.block_rows)
    return counts, widths


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("params_id", list(PARAMS))
def test_auto_width_sampling_matches_exact_distribution(drafter, params_id):
    """The chi-square test of test_speculative_sampling_matches_exact_distribution with the
    `auto` width rule deciding every step (plain steps, 1 or 2 drafts verified): exact, and
    not vacuously so (several widths were chosen)."""
    params, n = PARAMS[params_id], N_SAMPLES
    target = _hash_target()
    draft = DRAFTERS[drafter](_hash_target())
    exact = exact_sequence_probs(target, [3, 1], N_NEW, params)
    spec, widths = _sample_with_rule(target, draft, _auto_rule(), params, n, 0)
    assert len(widths) >= 2, widths
    p_exact, p_two = gof_pvalue(spec, exact, n), two_sample_pvalue(spec, _target_only_counts(params_id))
    assert p_exact > 1e-3 and p_two > 1e-3, (p_exact, p_two)


def test_biased_width_rule_is_caught():
    """The same test turns red for a rule that looks at the drawn token (keep d_j only when
    q(d_j) is high): the gate has teeth."""
    params, n = PARAMS["T1"], N_SAMPLES
    target = _hash_target()
    draft = DRAFTERS["oracle-hot-q"](_hash_target())
    exact = exact_sequence_probs(target, [3, 1], N_NEW, params)
    spec, widths = _sample_with_rule(target, draft, BiasedWidth(0.2), params, n, 0)
    assert len(widths) >= 2
    assert gof_pvalue(spec, exact, n) < 1e-6
