"""The adaptive verify width (`block_size="auto"`, decode/width.py, docs/adaptive_width.md).

- the cost model's choice against an independent brute-force argmax of E(k), with injected
  cost tables: k = 0 when verify rows are expensive, the full width when they are free;
- the survival estimator is censoring-aware (a position past the first rejection, or past the
  verified prefix, is unobserved, not a failure);
- greedy output is identical for every width rule (auto, random widths, plain steps in between)
  on a hash LM, a tiny random pair and the embedded pair, and plain steps keep the draft's
  context complete;
- the cost table is measured once, cached on disk by model / format / threads, and re-measured
  when those change or the file is damaged;
- the block-size argument: "auto" | an integer in 2..B, anything else a BlockSizeError.
The speculative-sampling chi-square test with `auto` and the biased-rule double: test_sampling.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash2_numba.decode import costs as costs_module
from dflash2_numba.decode import width as W
from dflash2_numba.decode.drafter import OracleDrafter, Proposal
from dflash2_numba.decode.loop import generate
from dflash2_numba.errors import BlockSizeError, GenerationArgumentError

from decode_doubles import HashTarget, RandomDrafter, TapCheckingDrafter, greedy_reference


def _prop(conf, k=None):
    conf = np.asarray(conf, np.float64)
    return Proposal(np.zeros(len(conf) if k is None else k, np.int64), None, {}, conf)


def _rule(verify, draft, B=None, **kw):
    verify = np.asarray(verify, np.float64)
    return W.AdaptiveWidth(W.CostTable(verify, draft, "injected"), B or len(verify), online=False, **kw)


# ---------------------------------------------------------------- the cost model
def test_expensive_rows_choose_k0_and_free_rows_the_full_width():
    B = 8
    conf = np.full(B - 1, 0.99)  # a very confident draft: S_j ~ 0.99^j
    expensive = _rule([1.0] + [1e3 * r for r in range(1, B)], 0.2)
    free = _rule(np.full(B, 1.0), 0.0)
    assert expensive.choose(_prop(conf), B - 1) == 0
    assert free.choose(_prop(conf), B - 1) == B - 1
    free_low = _rule(np.full(B, 1.0), 0.0)  # free rows: even unlikely drafts are worth verifying
    assert free_low.choose(_prop(np.full(B - 1, 0.05)), B - 1) == B - 1
    # before drafting, past the warm-up: expensive rows -> a plain target step, free rows -> draft
    e2, f2 = _rule([1.0] + [1e3 * r for r in range(1, B)], 0.2, warm_steps=0), _rule(np.full(B, 1.0), 0.0, warm_steps=0)
    assert [e2.draft_now(B - 1) for _ in range(8)] == [False] * 8
    assert all(f2.draft_now(B - 1) for _ in range(8))
    # the budget caps k
    assert _rule(np.full(B, 1.0), 0.0).choose(_prop(conf), 3) == 3


@pytest.mark.parametrize("a,D4,D8", [(0.5, 0.3, 1.0), (0.95, 0.9, 1.0), (0.8, 0.6, 1.0), (0.3, 1.0, 1.0)])
def test_the_draft_block_is_the_argmax_over_blocks_and_widths(a, D4, D8):
    """With a timed 4-row block beside B = 8: the rule drafts with the block q and width
    k <= q - 1 of the best (1 + a + .. + a^k) / (D(q) + c(k + 1)), against a brute force; a
    cheap short block wins where later drafts are rarely right, the full block where they are."""
    B = 8
    verify = 1.0 + 0.25 * np.arange(B)
    rule = W.AdaptiveWidth(W.CostTable(verify, D8, "injected", draft_rows={4: D4}), B, online=False, warm_steps=0)
    rule.mean_S = a ** np.arange(B, dtype=np.float64)
    rule.drafting = False  # from a plain run: draft when drafting beats a plain step (no hysteresis)
    best = max(((1 + sum(a ** j for j in range(1, k + 1))) / (D + verify[k]), q)
               for q, D in ((4, D4), (8, D8)) for k in range(1, q))
    assert rule.draft_now(B - 1) == (best[0] > 1 / verify[0])
    if best[0] > 1 / verify[0]:
        assert rule.rows == best[1]
    assert rule.ceiling(B - 1) == pytest.approx(
        max(1.0, max((k + 1) / (D + verify[k]) for q, D in ((4, D4), (8, D8)) for k in range(1, q)) * verify[0]))


def test_a_smaller_block_reaches_the_drafter_and_the_full_block_comes_back():
    """The block the rule picks is the drafter's n_rows (and caps the drafts verified); after
    FULL_EVERY drafted steps in a row on the small block one runs B, so the later positions'
    survival is learnt again. Greedy output stays the target's."""
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=5)
    prompt = [4, 2, 9]
    ref = greedy_reference(target, prompt, 60)
    draft = OracleDrafter(target, block_size=8)
    rows, real = [], draft.propose
    draft.propose = lambda st, a, p, n, s, r: rows.append(n) or real(st, a, p, n, s, r)
    verify = 1.0 + 0.25 * np.arange(8)
    rule = W.AdaptiveWidth(W.CostTable(verify, 1.0, "injected", draft_rows={4: 0.1}), 8, online=False,
                           warm_steps=0)
    rule.est.rate = lambda j, b: 0.3  # rarely right past the first drafts: the 4-row block is worth more
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=60, width=rule)
    assert r.output_ids == ref
    assert rows and set(rows) == {4, 8} and rows.count(8) <= len(rows) // (W.FULL_EVERY + 1) + 1
    small = [i for i, n in enumerate(rows) if n == 4]
    assert all(n == 8 for i, n in enumerate(rows) if i > W.FULL_EVERY and rows[i - W.FULL_EVERY:i] == [4] * W.FULL_EVERY)
    assert max(r.stats.block_rows[i] for i in range(len(r.stats.block_rows))) <= 8 and small


def _brute_force_k(a, verify, D, kmax):
    """argmax_k (1 + sum_{j<=k} a^j) / (D + c(k+1)), k in 0..kmax (first maximum)."""
    vals = [(1 + sum(a ** j for j in range(1, k + 1))) / (D + verify[k]) for k in range(kmax + 1)]
    return int(np.argmax(vals))


@pytest.mark.parametrize("case", range(40))
def test_choice_is_the_argmax_of_expected_tokens_per_second(case):
    """With a constant acceptance rate a (every position, every confidence) the rule's k must be
    the brute-force argmax of E(k) = (1 + a + ... + a^k) / (D + c(k+1)). Cost curves: convex
    or concave in the rows, drawn at random."""
    rng = np.random.default_rng(case)
    B = int(rng.choice([4, 8, 16]))
    a = float(rng.uniform(0.3, 0.98))
    c1, slope, curve = 1.0, float(rng.uniform(0.02, 0.8)), float(rng.uniform(0.6, 1.8))
    verify = c1 + slope * np.arange(B) ** curve
    D = float(rng.uniform(0.0, 1.5))
    rule = _rule(verify, D, B)
    rule.est.rate = lambda j, b: a  # the survival model pinned: S_j = a^j
    rule.mean_S = a ** np.arange(B, dtype=np.float64)
    kmax = int(rng.integers(1, B))
    want = _brute_force_k(a, verify, D, kmax)
    vals = [(1 + sum(a ** j for j in range(1, k + 1))) / (D + verify[k]) for k in range(kmax + 1)]
    if sorted(vals)[-1] - sorted(vals)[-2] < 1e-9:
        pytest.skip("a tie")
    assert rule.choose(_prop(np.full(B - 1, 0.5)), kmax) == want
    # before drafting: E(0) = 1/c(1) (no draft) against the best k >= 1 with the draft's cost
    e0 = 1.0 / verify[0]
    best = max((1 + sum(a ** j for j in range(1, k + 1))) / (D + verify[k]) for k in range(1, kmax + 1))
    rule.warm_left = 0
    rule.drafting = False  # in a plain run: draft when drafting beats a plain step
    assert rule.draft_now(kmax) == (best > e0)
    rule.plain_run = rule.plain_left = 0  # (a plain verdict also decides the next steps: not a re-test here)
    rule.drafting = True  # in a drafting run (hysteresis): keep drafting while >= (1 - STAY) x plain
    assert rule.draft_now(kmax) == (best > e0 * (1 - W.STAY))


def test_hysteresis_keeps_a_drafting_run_near_break_even_and_a_plain_run_too():
    """Drafting worth 0.95x a plain step: a drafting run goes on (switching costs more than the
    5 %), a plain run stays plain; at 0.85x (below 1 - STAY) a drafting run stops."""
    B, c1 = 8, 1.0
    for ratio, keeps in ((0.95, True), (0.85, False)):
        rule = _rule(np.full(B, c1), 0.0, warm_steps=0, probe_every=(100,))  # no re-test in this test
        rule.drafting_value = lambda kmax, r=ratio: r / c1
        assert rule.drafting  # a new rule starts in the drafting regime (the warm-up drafts)
        assert [rule.draft_now(B - 1) for _ in range(2)] == [keeps] * 2
        rule.drafting = False
        assert not rule.draft_now(B - 1)  # a plain run: 0.95x does not make it draft again


def test_a_plain_run_asks_the_rule_once_per_plain_batch():
    """A plain verdict holds until the next re-test is due: decode/step.py counts the steps down
    without calling the rule, PLAIN_BATCH steps at most, and the output is the target's."""
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=4)
    prompt = [2, 7]
    ref = greedy_reference(target, prompt, 64)
    rule = _rule([1.0] + [1e3 * r for r in range(1, 8)], 0.2, B=8)  # drafting never pays
    rule.retires = None  # (a request that stops feeding its draft: the next test)
    calls = []
    real = rule.draft_now
    rule.draft_now = lambda kmax: calls.append(kmax) or real(kmax)
    r = generate(target, OracleDrafter(target, block_size=8), prompt_ids=prompt, max_new_tokens=64, width=rule)
    assert r.output_ids == ref and r.stats.drafted_steps == 0
    assert len(calls) == -(-r.stats.steps // W.PLAIN_BATCH), (len(calls), r.stats.steps)


@pytest.mark.parametrize("never_pays", [True, False])
def test_a_request_stops_feeding_its_draft_when_no_retest_can_come(never_pays):
    """Drafting that could never pay (re-test due: never) or whose next re-test would come after
    the budget: the request retires its draft at the first plain verdict; its forwards take no
    taps from then on (a target-only step) and the rule is not asked again. A re-test due within
    the budget keeps the draft fed. Greedy output is the target's either way."""
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=4)
    prompt = [2, 7]
    ref = greedy_reference(target, prompt, 64)
    verify = [1.0] + ([1e3 * r for r in range(1, 8)] if never_pays else [1.0 + 0.5 * r for r in range(1, 8)])
    rule = _rule(verify, 0.2, B=8, warm_steps=0)
    rule.est.rate = lambda j, b: 0.01  # drafts almost never right: a plain verdict, re-tests when due
    asked, taps = [], []
    real, forward = rule.draft_now, target.forward
    rule.draft_now = lambda kmax: asked.append(kmax) or real(kmax)
    target.forward = lambda ids, cache, tap_layers=(), **kw: taps.append(tuple(tap_layers)) or forward(
        ids, cache, tap_layers=tap_layers, **kw)
    draft = TapCheckingDrafter(OracleDrafter(target, block_size=8), target, tap_layers=(0, 2))
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=64, width=rule)
    assert r.output_ids == ref
    if never_pays:  # ceiling < 1: due never
        assert len(asked) == 1 and r.stats.drafted_steps == 0 and taps[2:] == [()] * (len(taps) - 2)
    else:  # due after a few plain steps (the schedule's 2 + 1): re-tests happen until the budget
        # left is shorter than the next one's wait (then it retires: no draft could run again)
        assert r.stats.drafted_steps >= 2


def test_a_catch_up_veto_does_not_retire_the_draft():
    """A request retires only right after the rule's own plain verdict: a step made plain by the
    catch-up veto (the draft's backlog too dear for the tokens left) says nothing of when the
    next re-test comes, so the draft keeps its context (taps on every forward)."""
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=6)
    prompt = [3, 9]
    ref = greedy_reference(target, prompt, 30)
    rule = _rule(np.full(8, 1.0), 0.0, warm_steps=0)
    rule.catch_up_pays = lambda pending, remaining, kmax: False  # every step vetoed
    rule.retires = lambda remaining: True  # would retire if asked
    draft = TapCheckingDrafter(OracleDrafter(target, block_size=8), target, tap_layers=(0, 2))
    taps, forward = [], target.forward
    target.forward = lambda ids, cache, tap_layers=(), **kw: taps.append(tuple(tap_layers)) or forward(
        ids, cache, tap_layers=tap_layers, **kw)
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=30, width=rule)
    assert r.output_ids == ref and r.stats.drafted_steps == 0
    assert taps == [(0, 2)] * len(taps) and len(taps) == r.stats.steps + 1


def test_the_first_plain_step_after_a_draft_is_drafting_s_price_not_c1():
    """The first plain step after a drafted step runs with the draft's code and data in the
    caches: its extra over c(1) is added to drafting's realized seconds, and c(1) is refreshed
    from the plain steps after it, PLAIN_BATCH at a time (at the weight so many samples have)."""
    B = 8
    rule = W.AdaptiveWidth(W.CostTable(np.full(B, 1.0), 0.5, "injected"), B)
    rule._buckets = np.full(B - 1, W.NO_CONF)
    rule.observe(3, 3, True, 0.5, 1.0)  # a drafted step: 4 tokens in 1.5 s
    assert (rule.real_tokens, rule.real_s) == (4.0, 1.5)
    rule.observe(0, 0, False, None, 1.4)  # the first plain step after it: 0.4 s over c(1)
    rule.plain_left = 10 ** 6  # inside a run of plain steps the rule decided (draft_now sets it)
    assert rule.costs.verify_s[0] == 1.0 and rule.real_s == pytest.approx(1.5 + rule.real_weight * 0.4)
    for _ in range(W.PLAIN_BATCH - 1):
        rule.observe(0, 0, False, None, 1.2)
        assert rule.costs.verify_s[0] == 1.0  # not yet: a batch of plain steps
    rule.observe(0, 0, False, None, 1.2)
    assert rule.costs.verify_s[0] == pytest.approx(1.0 + (1 - 0.9 ** W.PLAIN_BATCH) * 0.2)


def test_retests_and_warm_up_follow_what_drafting_could_gain():
    """Where even drafts always accepted cannot pay, no re-test is ever due; the closer that
    ceiling is to 1x, the longer a plain run before a re-test, and below WARM_CEILING the first
    steps are not forced to draft."""
    B = 8

    def rule(D):
        r = _rule(1.0 + 0.1 * np.arange(B), D, B, warm_steps=3)
        r.mean_S = 0.3 ** np.arange(B, dtype=np.float64)  # drafting does not pay on average
        return r

    dues, ceilings = [], []
    for D in (0.5, 2.0, 3.0, 4.0, 10.0):
        r = rule(D)
        ceilings.append(r.ceiling(B - 1))
        dues.append(r._retest_due(B - 1))
    assert ceilings == sorted(ceilings, reverse=True) and ceilings[0] > W.WARM_CEILING and ceilings[-1] == 1.0  # k = 0 is the best: 1x
    assert dues == sorted(dues) and dues[0] < dues[-2] < float("inf") == dues[-1], dues
    # D = 4: a re-test (3 rows) loses 4 + 1.2 - (1 + 0.3 + 0.09) x 1.0 = 3.81 s against plain steps;
    # the share, RETEST_SHARE scaled by (ceiling - 1) / (WARM_CEILING - 1), pays for it after
    share = W.RETEST_SHARE * (ceilings[3] - 1.0) / (W.WARM_CEILING - 1.0)
    assert dues[3] == pytest.approx(3.81 / share)
    assert rule(0.5).draft_now(B - 1)  # a high ceiling: the warm-up drafts
    low = rule(4.0)
    assert 1.0 < low.ceiling(B - 1) < W.WARM_CEILING and not low.draft_now(B - 1) and low.warm_left == 0


def test_choice_reads_confidences_of_earlier_positions_only():
    """Position j's verify decision may read confidences 1..j, not j+1.. (under sampling, a
    DFlash2 walk's row j+1 depends on the token drawn at j): changing the confidence of the
    positions after the chosen prefix + 1 never changes k."""
    B = 8
    verify = 1.0 + 0.15 * np.arange(B)
    rng = np.random.default_rng(3)
    for _ in range(200):
        conf = rng.uniform(0.0, 1.0, B - 1)
        k = _rule(verify, 0.4).choose(_prop(conf), B - 1)
        if k + 1 < B - 1:  # positions k+2.. were never looked at
            conf2 = conf.copy()
            conf2[k + 1:] = rng.uniform(0.0, 1.0, B - 2 - k)
            assert _rule(verify, 0.4).choose(_prop(conf2), B - 1) == k


def test_cost_table_is_monotone_and_refreshed_online():
    t = W.CostTable(np.array([1.0, 0.8, 3.0, 2.0]), 0.5)  # a burst of load on rows 1 and 3
    assert t.verify_s.tolist() == [0.8, 0.8, 2.0, 2.0]
    # rows 2 take 1.2: offset (1.2 - 0.8) * 0.5 = 0.2 for row 2 and for the wider rows not seen
    # yet; one row (a plain step) keeps its swept 0.8: it learns from plain steps only
    t.observe_verify(2, 1.2, weight=0.5)
    np.testing.assert_allclose(t.verify_s, [0.8, 1.0, 2.2, 2.2])
    # rows 4 take 10 (a burst): clipped to 1.5 x 2.2 = 3.3; offset of row 4 (and the unseen
    # row 3) 0.2 + 0.5 (1.3 - 0.2) = 0.75; row 2 keeps 0.2, row 1 its sweep
    t.observe_verify(4, 10.0, weight=0.5)
    np.testing.assert_allclose(t.verify_s, [0.8, 1.0, 2.75, 2.75])
    # a plain step of 0.9: row 1's own offset 0.5 (0.9 - 0.8) = 0.05; the wider rows keep theirs
    t.observe_verify(1, 0.9, weight=0.5)
    np.testing.assert_allclose(t.verify_s, [0.85, 1.0, 2.75, 2.75])
    t.observe_verify(3, 2.0, weight=0.5)  # row 3 seen now: from the wider rows' 0.75 toward 0
    np.testing.assert_allclose(t.verify_s, [0.85, 1.0, 2.375, 2.75])
    # no draft step timed yet: D follows c(1) in proportion, 0.5 x 0.85 / 0.8 = 0.53125
    assert t.draft_s == 0.53125
    t.observe_draft(5.0, weight=0.5)  # clipped to 1.5 x 0.53125 = 0.796875
    assert t.draft_s == 0.53125 + 0.5 * (0.796875 - 0.53125)
    t.observe_verify(1, 1.2, weight=0.5)  # c(1) moves again; D, timed now, does not follow it
    assert t.draft_s == 0.53125 + 0.5 * (0.796875 - 0.53125)
    assert t.frozen().verify_s.tolist() == [0.8, 0.8, 2.0, 2.0] and t.frozen().draft_s == 0.5


def test_first_samples_are_averaged_with_the_sweep():
    """A count's first samples (default weight) move its cost to the plain mean of the sweep's
    value and the samples, up to nine of them, then by the exponential weight 0.1."""
    rng = np.random.default_rng(7)
    t = W.CostTable(np.array([1.0, 2.0]), 1.0)
    xs = rng.uniform(2.1, 2.6, 12)  # within the 1.5x clip of every estimate on the way
    for n, x in enumerate(xs[:9], start=1):
        t.observe_verify(2, x)
        assert np.isclose(t.verify_s[1], (2.0 + xs[:n].sum()) / (n + 1))
    want = t.verify_s[1] + 0.1 * (xs[9] - t.verify_s[1])
    t.observe_verify(2, xs[9])
    assert np.isclose(t.verify_s[1], want)
    ds = rng.uniform(1.1, 1.4, 3)
    for n, x in enumerate(ds, start=1):
        t.observe_draft(x)
        assert np.isclose(t.draft_s, (1.0 + ds[:n].sum()) / (n + 1))


def test_untimed_counts_follow_the_plain_step_drift():
    """Only plain steps timed (a plain run on a host slower than at the sweep): the wider
    counts and D follow c(1) in proportion, so drafting does not look cheaper than it is; once a
    wider count is timed, the others take its offset instead."""
    t = W.CostTable(np.array([1.0, 2.0, 3.0, 4.0]), 2.0)
    t.observe_verify(1, 1.4, weight=1.0)  # the host 1.4x slower
    np.testing.assert_allclose(t.verify_s, [1.4, 2.8, 4.2, 5.6])
    assert np.isclose(t.draft_s, 2.8)
    t.observe_verify(4, 4.5, weight=1.0)  # a drafted 4-row verify: + 0.5 over its sweep
    np.testing.assert_allclose(t.verify_s, [1.4, 2.5, 3.5, 4.5])


# ---------------------------------------------------------------- survival, censoring-aware
def test_survival_counts_only_observed_positions():
    est = W.SurvivalEstimator(8, forget=1.0)
    b = np.array([7, 7, 7, 7, 7], np.int64)
    est.observe(b, k=5, accepted=1)  # position 1 accepted, 2 rejected, 3..5 censored
    assert est.n[1:, 7].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert est.acc[1:, 7].tolist() == [1, 0, 0, 0, 0, 0, 0]
    est.observe(b[:2], k=2, accepted=2)  # both accepted; nothing known past 2 (not verified)
    assert est.n[1:, 7].tolist() == [2, 2, 0, 0, 0, 0, 0] and est.acc[1:, 7].tolist() == [2, 1, 0, 0, 0, 0, 0]


def test_censored_positions_are_not_failures():
    """Steps verify 3 drafts and accept all 3, 100 times: positions 4..7 were never verified.
    Their estimate must not fall below the bucket's prior (a censoring-blind estimator, which
    counts them as rejections, puts them near 0)."""
    est = W.SurvivalEstimator(8)
    b = np.full(7, 4, np.int64)  # confidence bucket 4 (0.75..0.85), prior 0.8
    for _ in range(100):
        est.observe(b, k=3, accepted=3)
    assert all(est.rate(j, 4) > 0.95 for j in (1, 2, 3))
    assert all(est.rate(j, 4) >= W.CONF_PRIOR[4] for j in (4, 5, 6, 7))
    # and rejections do lower it: position 1 rejected 100 times
    est2 = W.SurvivalEstimator(8)
    for _ in range(100):
        est2.observe(b, k=7, accepted=0)
    assert est2.rate(1, 4) < 0.05


def test_buckets_of_confidence():
    assert W.SurvivalEstimator.buckets(None, 3).tolist() == [W.NO_CONF] * 3
    assert W.SurvivalEstimator.buckets(np.array([0.1, 0.5, 0.999, 0.2]), 4).tolist() == [0, 2, 7, 1]


# ---------------------------------------------------------------- greedy identity, any rule
class RandomWidth:
    """A width rule test double: plain steps and widths 0..kmax at random (never reading a
    draft token)."""
    name = "random"

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.plain = self.drafted = 0

    def draft_now(self, kmax):
        d = bool(self.rng.random() < 0.7)
        self.drafted += d
        self.plain += not d
        return d

    def choose(self, prop, kmax):
        return int(self.rng.integers(0, kmax + 1))

    def observe(self, *a):
        pass


@pytest.mark.parametrize("seed", range(6))
def test_greedy_identity_for_every_width_rule_hash_lm(seed):
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=seed)
    prompt = [1 + seed, 7, 3]
    ref = greedy_reference(target, prompt, 60)
    injected = lambda: _rule(1.0 + 0.2 * np.arange(8), 0.3)  # noqa: E731 (mixed widths)
    for draft in (OracleDrafter(target, block_size=8), RandomDrafter(target, block_size=8, seed=seed)):
        for rule in (RandomWidth(seed), injected(), None):
            r = generate(target, draft, prompt_ids=prompt, max_new_tokens=60, width=rule,
                         block_size="auto" if rule is None else None)
            assert r.output_ids == ref, (type(draft).__name__, rule)
            assert sum(r.stats.acceptance_lengths) == 59 and len(r.stats.block_rows) == r.stats.steps
            assert r.stats.width_histogram == [r.stats.block_rows.count(i + 1) for i in range(8)]


def test_plain_steps_keep_the_draft_context_fed():
    """Random plain steps between drafted ones: the oracle (whose context is the target's own
    KV cache) still accepts every draft it is asked to verify, and the taps it receives are
    exactly those of a fresh prefill (TapCheckingDrafter)."""
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=9)
    prompt = [3, 1, 4, 1, 5]
    ref = greedy_reference(target, prompt, 80)
    draft = TapCheckingDrafter(OracleDrafter(target, block_size=8), target, tap_layers=(0, 2))
    rule = RandomWidth(4)
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=80, width=rule)
    assert r.output_ids == ref and rule.plain >= 5 and rule.drafted >= 5
    for rows, acc in zip(r.stats.block_rows, r.stats.acceptance_lengths):
        assert acc == rows  # every verified oracle draft accepted
    assert draft.checked_rows >= len(prompt) + len(ref) - 8


def test_injected_costs_end_to_end():
    """Expensive verify rows: after the warm-up every step is a plain target step (or a probe);
    free rows: every step verifies the full block (budget permitting)."""
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=2)
    prompt = [5, 6]
    ref = greedy_reference(target, prompt, 64)
    draft = OracleDrafter(target, block_size=8)
    exp_rule = _rule([1.0] + [1e3 * r for r in range(1, 8)], 0.2)
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=64, width=exp_rule)
    assert r.output_ids == ref
    # even drafts that are always accepted cannot pay (ceiling < 1): no warm-up, no re-test
    assert r.stats.width_histogram[0] == r.stats.steps and r.stats.drafted_steps == 0
    # rows not free but affordable for a perfect draft: the plain steps are re-tested (probes)
    mid_rule = _rule(1.0 + 0.5 * np.arange(8), 0.5)
    mid_rule.est.rate = lambda j, b: 0.05  # a draft that is almost never right
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=64, width=mid_rule)
    assert r.output_ids == ref and 3 < r.stats.drafted_steps < 3 + 8
    assert r.stats.width_histogram[0] > r.stats.steps - r.stats.drafted_steps
    free_rule = _rule(np.ones(8), 0.0)
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=64, width=free_rule)
    assert r.output_ids == ref
    assert r.stats.block_rows[:-1] == [8] * (r.stats.steps - 1) and r.stats.drafted_steps == r.stats.steps


class _SlowFeed:
    """A drafter double: the wrapped drafter, its context update 1 ms per row fed."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def extend_context(self, state, taps, start, ids):
        import time

        time.sleep(1e-3 * len(ids))
        return self.inner.extend_context(state, taps, start, ids)


class _Scripted:
    """A width rule double: `plain` plain steps, then full-width drafted steps; records the
    draft seconds each drafted step reports."""
    name = "scripted"

    def __init__(self, costs, plain):
        self.costs, self.plain, self.asked, self.draft_s = costs, plain, 0, []

    def draft_now(self, kmax):
        self.asked += 1
        return self.asked > self.plain

    def choose(self, prop, kmax):
        return kmax

    def observe(self, k, accepted, drafted, draft_s, verify_s):
        if drafted:
            self.draft_s.append(draft_s)


def test_a_catch_up_step_reports_a_typical_draft_step():
    """After 12 plain steps the first drafted step feeds the draft 17 rows (the 5-token prompt and
    the plain run), 9 past a block of 8. The rule hears its draft seconds less those 9 rows at the
    table's price per row (1 ms, as the double spends): about the 8 ms of a typical step's feed,
    as the next drafted steps report (all 7 oracle drafts accepted: 8 rows each). With no price
    per row known it hears None (the step's time says nothing of a typical one)."""
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=3)
    prompt = [2, 7, 1, 8, 2]
    ref = greedy_reference(target, prompt, 40)
    draft = _SlowFeed(OracleDrafter(target, block_size=8))
    rule = _Scripted(W.CostTable(np.ones(8), 0.01, "injected", feed_s=1e-3), plain=12)
    r = generate(target, draft, prompt_ids=prompt, max_new_tokens=40, width=rule)
    assert r.output_ids == ref and r.stats.catch_up_steps == 1 and len(rule.draft_s) >= 3
    first, later = rule.draft_s[0], rule.draft_s[1:-1]  # (the last step: the budget trims it)
    assert r.stats.catch_up_draft_s >= 0.017 and 0.008 <= first < 0.0105, (first, r.stats.catch_up_draft_s)
    assert all(0.008 <= x < 0.0105 for x in later), later
    rule = _Scripted(W.CostTable(np.ones(8), 0.01, "injected"), plain=12)  # feed_s unknown (0)
    generate(target, draft, prompt_ids=prompt, max_new_tokens=40, width=rule)
    assert rule.draft_s[0] is None and rule.draft_s[1] is not None


def test_context_catch_up_is_priced_before_drafting():
    """The draft's first step feeds it the whole prompt (pending x feed_s seconds): worth it only
    if perfect drafts over the tokens left could save more. Costs c(r) = 1 + 0.1 (r - 1), D = 0.2,
    B = 8: with every draft accepted k = 7 is best, 8 tokens per 1.9 s, so a token saves at most
    1 - 1.9 / 8 = 0.7625 s; 1000 rows at 10 ms = 10 s pay back over 14 tokens, not over 13."""
    B = 8
    verify = 1.0 + 0.1 * np.arange(B)
    rule = W.AdaptiveWidth(W.CostTable(verify, 0.2, "injected", feed_s=0.01), B, online=False)
    assert not rule.catch_up_pays(1000, 13, B - 1)
    assert rule.catch_up_pays(1000, 14, B - 1)
    assert rule.catch_up_pays(20, 1, B - 1)  # a step's usual context (0.2 s <= D): never vetoed
    assert W.AdaptiveWidth(W.CostTable(verify, 0.2, "injected"), B, online=False).catch_up_pays(10**6, 1, B - 1)
    # end to end: a 300-token prompt at 1 s a row against 40 tokens -> no draft at all, warm-up
    # included; unknown feed cost (0) -> the warm-up drafts as before
    target = HashTarget(vocab_size=40, valid=36, scale=2.0, seed=4)
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, 36, 300)]
    ref = greedy_reference(target, prompt, 40)
    draft = OracleDrafter(target, block_size=8)
    for feed_s, drafted in ((1.0, 0), (0.0, None)):
        rule = W.AdaptiveWidth(W.CostTable(verify, 0.2, "injected", feed_s=feed_s), B, online=False)
        r = generate(target, draft, prompt_ids=prompt, max_new_tokens=40, width=rule)
        assert r.output_ids == ref
        assert r.stats.drafted_steps == drafted if drafted is not None else r.stats.drafted_steps >= 3


# ---------------------------------------------------------------- real models
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    import numba

    from dflash2_numba import tiny
    from dflash2_numba.api import load_draft, load_target

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    d = tmp_path_factory.mktemp("aw")
    tiny.write_target(d / "target", seed=0, init_std=0.2)
    tiny.write_draft(d / "dflash2", d / "target", kind="dflash2", block_size=8, seed=1)
    tiny.write_draft(d / "dflash", d / "target", kind="dflash", block_size=8, seed=2)
    target = load_target(d / "target")
    yield target, {k: load_draft(d / k, target) for k in ("dflash2", "dflash")}
    numba.set_num_threads(threads)


def test_greedy_identity_tiny_pair(tiny_pair):
    target, drafts = tiny_pair
    for seed in range(3):
        prompt = [int(x) for x in np.random.default_rng(seed).integers(1, target.valid_vocab, 6)]
        base = generate(target, None, prompt_ids=prompt, max_new_tokens=48).output_ids
        for kind, draft in drafts.items():
            auto = generate(target, draft, prompt_ids=prompt, max_new_tokens=48)  # the default: auto
            fixed = generate(target, draft, prompt_ids=prompt, max_new_tokens=48, block_size=4)
            assert auto.stats.width == "auto" and fixed.stats.width == "fixed"
            assert auto.output_ids == base == fixed.output_ids, (kind, seed)
            rnd = generate(target, draft, prompt_ids=prompt, max_new_tokens=48, width=RandomWidth(seed))
            assert rnd.output_ids == base, (kind, seed)


def test_greedy_identity_embedded_pair():
    import numba

    from dflash2_numba.api import load_draft, load_target
    from dflash2_numba.default import ASSET_DIR

    if not (ASSET_DIR / "dflash2" / "config.json").is_file():
        pytest.skip("no embedded pair in this install")
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        target = load_target(ASSET_DIR / "target")
        draft = load_draft(ASSET_DIR / "dflash2", target)
        for text in ("def fibonacci(n):", "The capital of France is", "import numpy as np\n"):
            base = generate(target, None, text, max_new_tokens=64)
            auto = generate(target, draft, text, max_new_tokens=64)  # this machine's table: may not draft
            cheap = generate(target, draft, text, max_new_tokens=64, width=_rule(1.0 + 0.1 * np.arange(8), 0.3))
            fixed = generate(target, draft, text, max_new_tokens=64, block_size=4)
            assert auto.output_ids == base.output_ids == fixed.output_ids == cheap.output_ids, text
            assert cheap.stats.drafted_steps >= 3  # the trained pair does speculate under a table that pays
    finally:
        numba.set_num_threads(threads)


# ---------------------------------------------------------------- the cost table on disk
def test_cost_table_cached_by_model_format_threads(tiny_pair, tmp_path, monkeypatch):
    import numba

    target, drafts = tiny_pair
    monkeypatch.setenv("DFLASH2_COST_CACHE", str(tmp_path))
    draft = drafts["dflash2"]
    draft.__dict__.pop("_width_costs", None)
    t1 = W.costs_for(target, draft, 8)
    assert t1.source == "sweep" and t1.B == 8 and np.all(np.diff(t1.verify_s) >= 0) and t1.draft_s > 0
    assert t1.feed_s > 0  # the draft's context catch-up, per row
    files = list(tmp_path.glob("costs-*.json"))
    assert len(files) == 1
    raw = json.loads(files[0].read_text())
    assert raw["identity"]["threads"] == numba.get_num_threads() and raw["identity"]["B"] == 8
    assert raw["verify_s"] == [float(x) for x in t1.verify_s]
    assert W.costs_for(target, draft, 8) is t1  # this process: the same (online-refreshed) table
    draft.__dict__.pop("_width_costs")  # a new process: read from disk, no sweep

    def no_sweep(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(costs_module, "measure_costs", no_sweep)
    t2 = W.costs_for(target, draft, 8)
    assert t2.source == "cache" and t2.verify_s.tolist() == t1.verify_s.tolist() and t2.draft_s == t1.draft_s and t2.feed_s == t1.feed_s
    monkeypatch.undo()
    monkeypatch.setenv("DFLASH2_COST_CACHE", str(tmp_path))
    # another thread count -> another table; a damaged file -> measured again
    saved = numba.get_num_threads()
    draft.__dict__.pop("_width_costs")
    numba.set_num_threads(1 if saved > 1 else min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        if numba.get_num_threads() != saved:
            assert W.costs_for(target, draft, 8).source == "sweep"
            assert len(list(tmp_path.glob("costs-*.json"))) == 2
    finally:
        numba.set_num_threads(saved)
    draft.__dict__.pop("_width_costs")
    old_layout = {k: v for k, v in json.loads(files[0].read_text()).items() if k != "feed_s"}
    files[0].write_text(json.dumps(old_layout))  # a table written before feed_s: measured again
    assert W.costs_for(target, draft, 8).source == "sweep"
    draft.__dict__.pop("_width_costs")
    files[0].write_text("{ truncated")
    assert W.costs_for(target, draft, 8).source == "sweep"
    assert json.loads(files[0].read_text())["verify_s"]  # rewritten whole


def test_refreshed_costs_are_saved_for_the_next_process(tiny_pair, tmp_path, monkeypatch):
    """Once a decode has timed a plain step and a drafted one, the refreshed costs replace the
    cached table on disk (the next process reads them, not the sweep); before that, nothing is
    written. The decode loop saves after a decode with an online rule, not with a frozen one
    (a seeded sampled run's table must stay the measured one)."""
    target, drafts = tiny_pair
    monkeypatch.setenv("DFLASH2_COST_CACHE", str(tmp_path))
    draft = drafts["dflash2"]
    draft.__dict__.pop("_width_costs", None)
    t = W.costs_for(target, draft, 8)
    path = next(tmp_path.glob("costs-*.json"))
    swept = json.loads(path.read_text())
    t.observe_verify(1, 2 * t.verify_s[0])  # a plain step only: not saved yet
    assert not t.save() and json.loads(path.read_text()) == swept
    t.observe_draft(3 * t.draft_s)
    t.observe_verify(8, 1.4 * t.verify_s[7])
    assert t.save()
    draft.__dict__.pop("_width_costs")  # a new process
    t2 = W.costs_for(target, draft, 8)
    assert t2.source == "cache" and np.allclose(t2.verify_s, t.verify_s) and np.isclose(t2.draft_s, t.draft_s)
    assert t2.verify_s[0] > swept["verify_s"][0] and t2.draft_s > swept["draft_s"]  # the refreshed ones
    saves = []
    monkeypatch.setattr(W.CostTable, "save", lambda self: saves.append(self) or True)
    prompt = [1, 2, 3, 4]
    generate(target, draft, prompt_ids=prompt, max_new_tokens=6, block_size="auto")
    assert saves == [t2]
    generate(target, draft, prompt_ids=prompt, max_new_tokens=6, block_size="auto", temperature=0.8, seed=3)
    generate(target, draft, prompt_ids=prompt, max_new_tokens=6, block_size=4)
    assert saves == [t2]  # frozen (seeded sampled) and fixed-width runs save nothing
    draft.__dict__.pop("_width_costs")


def test_warm_up_writes_the_run_s_caches_through_once(tiny_pair, monkeypatch):
    """The first decode of a process faulted its cache pages in as it ran (~4 % of the README
    command's speculative run, timed before its baseline): the warm-up allocates a target cache
    and a draft state of the run's length and writes every array of them once. A budget whose
    cache could not be allocated is left to the run's own named refusal."""
    from dflash2_numba.decode import warmup

    target, drafts = tiny_pair
    draft = drafts["dflash2"]
    made, new_cache, new_state = [], target.new_cache, draft.new_state

    def poisoned(real):
        def make(n):
            st = real(n)
            for a in warmup._arrays(st):
                a[...] = np.nan if a.dtype.kind == "f" else 1  # what a write-through must overwrite
            made.append((n, st))
            return st
        return make

    monkeypatch.setattr(target, "new_cache", poisoned(new_cache))
    monkeypatch.setattr(draft, "new_state", poisoned(new_state))
    warmup._settle_memory(target, draft, 23)
    full = [st for n, st in made if n == 23]
    assert len(full) == 2 and all(np.all(a == 0) for st in full for a in warmup._arrays(st))
    made.clear()
    warmup._settle_memory(target, draft, 10 ** 9)  # 100+ GiB: not allocated at all
    assert [n for n, _ in made] == [1, 1]


def test_sweep_times_the_verify_step_not_the_forward_alone(tiny_pair, monkeypatch):
    """c(r) is what the decode loop times as a verify (decode/step.py, t1 -> t2): the forward
    and the acceptance on its logits. An acceptance made 3 ms slower must show in every count;
    a sweep that times the forward alone does not see it."""
    import time

    from dflash2_numba.decode import sampling

    target, drafts = tiny_pair
    fast = costs_module.measure_costs(target, drafts["dflash2"], 4, reps=1)
    real = sampling.verify_block

    def slow_verify(*args, **kwargs):
        time.sleep(0.003)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "verify_block", slow_verify)
    slow = costs_module.measure_costs(target, drafts["dflash2"], 4, reps=1)
    assert np.all(slow.verify_s >= fast.verify_s.min() + 0.0028), (slow.verify_s, fast.verify_s)


def test_sweep_times_plain_steps_in_a_row_and_wider_verifies_after_a_draft(tiny_pair, monkeypatch):
    """The two models evict each other's code and data, so the decode loop's first forward after
    a draft step is slower than one after another forward. The sweep times each count as the
    loop runs it: c(1) in a run of one-row verifies (a plain run), c(r >= 2) right after a draft
    step. A target made 3 ms slower on its first forward after a proposal: c(1) must not carry
    the 3 ms, every wider count must. (The previous order, c(1) right after the draft step and the
    wider counts one after another, gets both wrong.)"""
    import time

    target, drafts = tiny_pair
    draft = drafts["dflash2"]
    cold = {"after_draft": False}
    forward, propose = target.forward, draft.propose

    def slow_first_forward(*args, **kwargs):
        if cold["after_draft"]:
            cold["after_draft"] = False
            time.sleep(0.003)
        return forward(*args, **kwargs)

    def propose_then_cold(*args, **kwargs):
        cold["after_draft"] = True
        return propose(*args, **kwargs)

    monkeypatch.setattr(target, "forward", slow_first_forward)
    monkeypatch.setattr(draft, "propose", propose_then_cold)
    t = costs_module.measure_costs(target, draft, 4, reps=2)
    assert np.all(t.verify_s[1:] >= t.verify_s[0] + 0.0028), t.verify_s


def test_sweep_times_draft_steps_after_a_wide_verify(tiny_pair, monkeypatch):
    """In a drafting run a draft step follows a verify of several rows; right after a one-row
    verify (resuming after a plain step) it is slower. A proposal made 3 ms slower when the last
    target forward had one row: D must not carry it (the sweep of recipe 5 timed D after a one-row
    verify and read a drafting run's D too low on the embedded pair: it carries it)."""
    import time

    target, drafts = tiny_pair
    draft = drafts["dflash2"]
    last = {"rows": 0}
    forward, propose = target.forward, draft.propose

    def counting_forward(ids, *args, **kwargs):
        last["rows"] = len(ids)
        return forward(ids, *args, **kwargs)

    def propose_slow_after_one_row(*args, **kwargs):
        if last["rows"] == 1:
            last["slow"] = last.get("slow", 0) + 1
            time.sleep(0.003)
        return propose(*args, **kwargs)

    monkeypatch.setattr(target, "forward", counting_forward)
    monkeypatch.setattr(draft, "propose", propose_slow_after_one_row)
    t = costs_module.measure_costs(target, draft, 4, reps=2)
    assert last.get("slow", 0) >= 1  # the sweep does resume after its plain run (untimed): the double bites
    assert t.draft_s < 0.003, t.draft_s


def test_sweep_takes_the_median_not_the_luckiest_sample(tiny_pair, monkeypatch):
    """A host where one proposal and one verify in eight run 3 ms faster than the rest (bursts of
    load the other way round): the table must read the typical step, as a decode meets it. The
    minimum (recipes <= 6), taken over D's many samples, read a decode's D 15-30 % too low."""
    import time

    target, drafts = tiny_pair
    draft = drafts["dflash2"]
    luck = np.random.default_rng(5)  # one call in eight is lucky, at random (not in step with the sweep)
    forward, propose = target.forward, draft.propose

    def mostly_slow(real):
        def wrapped(*args, **kwargs):
            if luck.random() >= 0.125:
                time.sleep(0.003)
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(target, "forward", mostly_slow(forward))
    monkeypatch.setattr(draft, "propose", mostly_slow(propose))
    t = costs_module.measure_costs(target, draft, 4, reps=10, budget_s=10.0)
    assert t.draft_s >= 0.003 and np.all(t.verify_s >= 0.003), (t.draft_s, t.verify_s)


def test_default_cost_cache_is_beside_the_kernel_cache(monkeypatch):
    from dflash2_numba.kernels.fused import kernel_variants

    monkeypatch.delenv("DFLASH2_COST_CACHE")
    from pathlib import Path

    assert W.cost_cache_dir().parent == Path(kernel_variants()[0]._cache._cache_path)


# ---------------------------------------------------------------- the argument
@pytest.mark.parametrize("value,want", [("auto", "auto"), ("AUTO", "auto"), (" auto ", "auto"), (None, None),
                                        (2, 2), ("3", 3), (16, 16), (np.int64(5), 5), (4.0, 4)])
def test_block_size_parse(value, want):
    assert W.parse_block_size(value) == want


@pytest.mark.parametrize("value", [0, 1, -3, "0", "abc", "", "2.5", 2.5, True, False, "8x", [4], float("nan")])
def test_block_size_refused(value):
    with pytest.raises(BlockSizeError) as e:
        W.parse_block_size(value)
    assert isinstance(e.value, GenerationArgumentError) and "auto" in str(e.value) and repr(value) in str(e.value)


def test_block_size_above_B_refused():
    assert W.check_block_size("auto", 8) == "auto" and W.check_block_size(None, 8) == 8
    assert W.check_block_size(8, 8) == 8
    with pytest.raises(BlockSizeError, match=r"2\.\.8.*9"):
        W.check_block_size(9, 8)
    target = HashTarget()
    with pytest.raises(BlockSizeError):
        generate(target, OracleDrafter(target, block_size=4), prompt_ids=[1], max_new_tokens=4, block_size=5)
    with pytest.raises(BlockSizeError):
        generate(target, OracleDrafter(target, block_size=4), prompt_ids=[1], max_new_tokens=4, block_size="abc")


# ---------------------------------------------------------------- the drafts' confidences
def test_draft_confidences_read_the_distributions(tiny_pair):
    """DFlash v1 greedy: softmax of the draft's logits at its argmax (recomputed here from the
    block states); sampled: the max of q (the distribution d_j is drawn from), not q(d_j).
    DFlash2: the walk's conditional top-1 probability, in (0, 1]; sampled: max of q."""
    from dflash2_numba.decode.sampling import SamplingParams, mask_padded

    target, drafts = tiny_pair
    prompt = np.arange(1, 9, dtype=np.int64)
    cache = target.new_cache(32)
    for kind, draft in drafts.items():
        cache = target.new_cache(32)
        _, taps = target.forward(prompt, cache, tap_layers=tuple(draft.target_layer_ids))
        st = draft.new_state(32)
        draft.extend_context(st, taps, 0, prompt)
        g = draft.propose(st, 5, len(prompt), 8, SamplingParams(), np.random.default_rng(0))
        s = draft.propose(st, 5, len(prompt), 8, SamplingParams(temperature=0.9), np.random.default_rng(0))
        assert g.confidence.shape == (7,) and np.all((g.confidence > 0) & (g.confidence <= 1))
        np.testing.assert_allclose(s.confidence, s.q.max(axis=-1), rtol=1e-6)
        assert np.any(s.confidence != s.q[np.arange(7), s.draft_ids]) or np.all(s.q.max(-1) == 1)
        if kind == "dflash":
            h = draft.block_forward([st], [5], [len(prompt)], 8)[1:]
            z = mask_padded(target.lm_head(h), target.valid_vocab).astype(np.float64)
            want = np.exp(z.max(-1) - z.max(-1)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1)
            np.testing.assert_allclose(g.confidence, want, rtol=1e-5)


def test_seeded_sampling_with_auto_is_reproducible_in_a_process():
    """A seeded sampled `auto` run reads the measured table only: other runs refreshing the
    process's table in between (and a different verify cost now) do not change its tokens."""
    target = HashTarget(vocab_size=40, valid=36, scale=1.0, seed=2)
    draft = OracleDrafter(HashTarget(vocab_size=40, valid=36, scale=1.0, seed=2), block_size=8, mode="sample",
                          temperature_scale=1.5)
    kw = dict(prompt_ids=[1, 2, 3], max_new_tokens=40, temperature=1.0, block_size="auto")
    first = generate(target, draft, seed=7, **kw)
    table = W.costs_for(target, draft, 8)
    for i in range(3):  # online refresh by other runs; then the machine "gets slower" at 2+ rows
        generate(target, draft, **dict(kw, temperature=0.0))
    table.verify_s[1:] *= 50.0
    table.draft_s *= 50.0
    again = generate(target, draft, seed=7, **kw)
    assert again.output_ids == first.output_ids and again.stats.block_rows == first.stats.block_rows
    assert generate(target, draft, **dict(kw, temperature=0.0)).stats.drafted_steps <= 3 + 2  # the live table moved
