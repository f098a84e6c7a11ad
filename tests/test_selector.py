"""DFlash2 candidate selector (spec §4.3, §4.4).

References here are written independently of models/selector.py: top-K by Python `sorted`,
scores by explicit float64 loops (and an f32 einsum), walks by plain loops, bf16 weights
decoded with ml_dtypes. Constructed cases make each wrong variant (scalar order, missing
scalar, wrong predecessor, wrong tie direction) pick a different draft, and the test asserts
both that the selector matches the right answer and that the wrong answer really differs.

Statistics: the Gumbel walk is checked with chi-square goodness of fit (p-value by the
Wilson-Hilferty approximation, pass at p > 1e-3; fixed seeds, so deterministic)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (the [test] extra) is not installed: the independent bf16 decoding needs it")

from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.config import resolve_draft_config
from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.errors import SelectorRefusedError
from dflash2_numba.models.selector import (TENSORS, CandidateSelector, RefusedSelector, keyed_gumbel,
                                           keyed_uniform)
from dflash2_numba.numerics import f32_to_bf16_array
from dflash2_numba.tiny import save_safetensors

GREEDY = SamplingParams()


# ---------------------------------------------------------------- helpers
def bf16_bits_to_f64(w: np.ndarray) -> np.ndarray:
    """Independent bf16 decoding: reinterpret the bits with ml_dtypes."""
    return w.view(ml_dtypes.bfloat16).astype(np.float64)


def random_selector(seed: int, r=6, H=16, V=40, K=5, mult=1.0, cap=None, valid=None, bf16=True):
    """A selector with random weights (bf16 bits by default) and the float64 weights it holds."""
    rng = np.random.default_rng(seed)
    Wp, A, Bc = (rng.standard_normal(s).astype(np.float32) for s in ((r, H), (V, r), (V, r)))
    if bf16:
        Wp, A, Bc = (f32_to_bf16_array(t) for t in (Wp, A, Bc))
        ref = [bf16_bits_to_f64(t) for t in (Wp, A, Bc)]
    else:
        ref = [t.astype(np.float64) for t in (Wp, A, Bc)]
    return CandidateSelector(Wp, A, Bc, K, mult, cap, valid_vocab=valid), ref


def ref_topk(z_row, K, valid=None):
    """Descending value, ties by ascending id; padding ids and NaN are -inf."""
    z = [(-math.inf if (valid is not None and i >= valid) or math.isnan(x) else float(x))
         for i, x in enumerate(z_row)]
    return sorted(range(len(z)), key=lambda i: (-z[i], i))[:K]


def ref_scalars(v, mult, cap):
    """§4.3 in float64: multiplier, then softcap; a -inf value stays -inf."""
    u = np.asarray(v, np.float64) * mult
    if cap:
        u = np.where(np.isneginf(u), -np.inf, cap * np.tanh(u / cap))
    return u


def ref_scores_loops(h, ids, u, anchor, Wp, A, Bc, pred_rule="chain"):
    """S[l,a,c] = u[l,c] + sum_r A[pred(l,a),r] * pi[l,r] * Bc[ids[l,c],r], float64 loops.
    pred_rule names a wrong variant for the mutation checks ("anchor": always the anchor,
    "same_row": ids_l[a] instead of ids_{l-1}[a])."""
    k, K = ids.shape
    r, H = Wp.shape
    S = np.zeros((k, K, K))
    for l in range(k):
        pi = [sum(float(h[l, j]) * Wp[i, j] for j in range(H)) for i in range(r)]
        for a in range(K):
            if pred_rule == "chain":
                pred = anchor if l == 0 else ids[l - 1, a]
            elif pred_rule == "anchor":
                pred = anchor
            else:
                pred = ids[l, a]
            for c in range(K):
                S[l, a, c] = u[l, c] + sum(A[pred, i] * pi[i] * Bc[ids[l, c], i] for i in range(r))
    return S


def ref_walk(S):
    """Greedy walk with plain Python comparisons: strict '>' keeps the lowest slot on a tie;
    NaN compares False so it never wins; an all -inf row keeps slot 0."""
    prev, slots = 0, []
    for l in range(S.shape[0]):
        best, best_val = 0, -math.inf
        for c in range(S.shape[2]):
            x = float(S[l, prev, c])
            if x > best_val:
                best, best_val = c, x
        slots.append(best)
        prev = best
    return slots


def chi2_pvalue(stat: float, dof: int) -> float:
    """Upper tail of chi-square(dof) at stat (Wilson-Hilferty)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of counts to probs (cells with expected < 5 pooled)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c, exp_c = list(counts[big]), list(exp[big])
    if exp[~big].sum() >= 5:
        obs_c.append(counts[~big].sum())
        exp_c.append(exp[~big].sum())
    obs_c, exp_c = np.array(obs_c, float), np.array(exp_c, float)
    return chi2_pvalue(float(((obs_c - exp_c) ** 2 / exp_c).sum()), len(obs_c) - 1)


def softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------- top-K
def test_topk_ties_by_ascending_id_and_padding_never_chosen():
    rng = np.random.default_rng(0)
    V, K, valid, k = 30, 6, 26, 40
    sel, _ = random_selector(0, V=V, K=K, valid=valid)
    z = rng.integers(-2, 3, size=(k, V)).astype(np.float32)  # few distinct values: many ties
    z[:, valid:] = 100.0  # padding ids with the largest logits: must still never be chosen
    z[0, :] = -np.inf  # all -inf: the K lowest valid ids
    z[1, 3] = np.nan  # NaN is -inf
    z[2, :valid - 2] = -np.inf  # only 2 finite valid ids: the rest are the lowest -inf ids
    z[3, 2:] = np.nan  # mostly NaN: NaN ids rank as -inf, after the 2 finite ones
    ids, vals = sel.candidates(z)
    for l in range(k):
        want = ref_topk(z[l], K, valid)
        assert ids[l].tolist() == want, l
        np.testing.assert_array_equal(vals[l], np.where(np.isnan(z[l, want]), -np.inf, z[l, want]))
    assert (ids < valid).all()
    assert ids[0].tolist() == list(range(K))
    assert ids.dtype == np.int64 and vals.dtype == np.float32


def test_topk_boundary_tie_takes_lowest_ids():
    """K-th value shared by more ids than fit: the lowest ids make the cut, in ascending order."""
    sel, _ = random_selector(1, V=40, K=4)
    z = np.zeros((1, 40), np.float32)
    z[0, [33, 7]] = 5.0  # two clear winners, tied: 7 before 33
    z[0, [39, 12, 25, 2]] = 1.0  # boundary value shared by 4 ids, 2 places left: 2 and 12
    ids, vals = sel.candidates(z)
    assert ids[0].tolist() == [7, 33, 2, 12] == ref_topk(z[0], 4)
    assert vals[0].tolist() == [5.0, 5.0, 1.0, 1.0]


@pytest.mark.parametrize("K", [1, 16, 64])
def test_topk_kernel_on_a_real_vocab_against_sorting(K):
    """V = 4096 rows (bf16-like coarse values: many ties, some -inf, NaN and padding ids)."""
    rng = np.random.default_rng(K)
    V, valid = 4096, 4000
    sel, _ = random_selector(K, V=V, K=K, valid=valid)
    z = np.round(rng.standard_normal((6, V)) * 4).astype(np.float32)
    z[1, rng.integers(0, V, 500)] = np.nan
    z[2, : V - 10] = -np.inf  # fewer finite ids than K for K = 16, 64
    z[3, valid:] = 1e9  # padding ids hold the best logits
    ids, vals = sel.candidates(z)
    for l in range(z.shape[0]):
        assert ids[l].tolist() == ref_topk(z[l], K, valid), l


def test_topk_screened_chunks_on_a_qwen_sized_vocab():
    """V = 151936 (Qwen's head): the kernel screens chunks of TOPK_CHUNK ids against the K-th
    kept value and skips the ones that cannot enter. Rising rows (every chunk enters), a late
    tie at the K-th value (must NOT enter: the lower id stays), late winners in the last chunk,
    coarse values with many ties, fine values (late entries at the K-th place)."""
    from dflash2_numba.models.selector import TOPK_CHUNK

    rng = np.random.default_rng(7)
    V, valid, K = 151936, 151665, 16
    sel, _ = random_selector(3, V=V, K=K, valid=valid)
    z = np.round(rng.standard_normal((6, V)) * 3).astype(np.float32)
    z[1] = np.arange(V, dtype=np.float32)  # rising: every chunk holds a new best
    z[2, :] = 0.0
    z[2, 5:5 + K] = 1.0  # the K best early; a tie with the K-th late must stay out
    z[2, V - 2 * TOPK_CHUNK - 3] = 1.0
    z[3, valid - 1] = 50.0  # winners in the last valid chunk
    z[3, valid - TOPK_CHUNK // 2] = 49.0
    z[4, rng.integers(0, V, 20000)] = np.nan
    z[0] = rng.standard_normal(V)  # fine values
    z[5, :] = 0.0
    z[5, 5:5 + K - 1] = 2.0  # K-1 early at 2.0, the K-th at 1.0 ...
    z[5, 5 + K - 1] = 1.0
    z[5, V - 5 * TOPK_CHUNK] = 1.5  # ... beaten late by a value between the K-th and the one above
    ids, _ = sel.candidates(z)
    for l in range(z.shape[0]):
        assert ids[l].tolist() == ref_topk(z[l], K, valid), l


# ---------------------------------------------------------------- scalars (§4.3)
def test_scalars_order_and_f32():
    rng = np.random.default_rng(2)
    v = (rng.standard_normal((4, 7)) * 30).astype(np.float32)
    v[0, 0] = -np.inf
    for mult, cap in ((0.196, 20.0), (1.0, None), (2.5, None), (0.5, 3.0)):
        sel, _ = random_selector(2, K=7, mult=mult, cap=cap)
        u = sel.scalars(v)
        assert u.dtype == np.float32
        np.testing.assert_allclose(u, ref_scalars(v, mult, cap), rtol=3e-7, atol=1e-6)
        assert u[0, 0] == -np.inf  # a masked candidate stays out under softcap


def _scalar_case(mult, cap, bonus):
    """One row, two candidates (ids 0, 1 with logits 10 and 9.5), r = 1 and pi = 1, so
    S[0,0,:] = [u(10), u(9.5) + bonus] exactly: the walk picks slot 1 iff bonus > u(10)-u(9.5)."""
    H, V = 4, 8
    Wp = np.zeros((1, H), np.float32)
    Wp[0, 0] = 1.0
    A = np.zeros((V, 1), np.float32)
    A[5, 0] = 1.0  # anchor id 5
    Bc = np.zeros((V, 1), np.float32)
    Bc[1, 0] = bonus
    sel = CandidateSelector(Wp, A, Bc, 2, mult, cap)
    h = np.zeros((1, H), np.float32)
    h[0, 0] = 1.0
    z = np.full((1, V), -5.0, np.float32)
    z[0, :2] = [10.0, 9.5]
    return sel, h, z


@pytest.mark.parametrize("bonus", [0.003, 0.05])
def test_scalars_decide_the_walk(bonus):
    """mult 0.5, cap 2: u-gap = 2tanh(2.5) - 2tanh(2.375) = 0.0076. Swapped order (cap then
    mult) and no-multiplier give gaps ~1e-4; no softcap gives 0.25. bonus 0.003 separates
    the correct result from swapped/no-mult, bonus 0.05 from no-cap."""
    mult, cap = 0.5, 2.0
    sel, h, z = _scalar_case(mult, cap, bonus)
    gap = {
        "right": cap * math.tanh(10 * mult / cap) - cap * math.tanh(9.5 * mult / cap),
        "swapped": mult * cap * (math.tanh(10 / cap) - math.tanh(9.5 / cap)),
        "no_mult": cap * (math.tanh(10 / cap) - math.tanh(9.5 / cap)),
        "no_cap": mult * 0.5,
        "neither": 0.5,
    }
    choice = {name: int(bonus > g) for name, g in gap.items()}
    wrong = [n for n in gap if n != "right" and choice[n] != choice["right"]]
    assert wrong == (["swapped", "no_mult"] if bonus == 0.003 else ["no_cap", "neither"])  # the case has power
    draft, q, info = sel.select(h, z, 5, np.array([9]), GREEDY)
    assert info["chosen_slots"] == [choice["right"]]
    assert draft.tolist() == [choice["right"]]  # candidate ids are 0, 1 in slot order


# ---------------------------------------------------------------- scores
@pytest.mark.parametrize("bf16", [True, False])
def test_scores_match_independent_loops(bf16):
    rng = np.random.default_rng(3)
    k, H, r, V, K = 4, 16, 6, 40, 5
    sel, (Wp, A, Bc) = random_selector(3, r=r, H=H, V=V, K=K, mult=0.7, cap=4.0, bf16=bf16)
    h = rng.standard_normal((k, H)).astype(np.float32)
    z = rng.standard_normal((k, V)).astype(np.float32)
    anchor = 17
    ids, vals = sel.candidates(z)
    u = sel.scalars(vals)
    S = sel.scores(h, ids, u, anchor)
    assert S.shape == (k, K, K) and S.dtype == np.float32
    ref = ref_scores_loops(h, ids, u.astype(np.float64), anchor, Wp, A, Bc)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(S, ref, rtol=0, atol=1e-5 * scale)
    # f32 einsum with the same inputs: the formula as one expression
    pred = np.vstack([np.full((1, K), anchor), ids[:-1]])  # [k, K]
    pi = np.einsum("lh,rh->lr", h, Wp.astype(np.float32))
    ein = u[:, None, :] + np.einsum("lar,lr,lcr->lac", A[pred].astype(np.float32), pi,
                                    Bc[ids].astype(np.float32))
    np.testing.assert_allclose(S, ein, rtol=0, atol=1e-5 * scale)


def test_predecessor_chain_decides_the_walk():
    """pred(0,a) = anchor, pred(l,a) = ids_{l-1}[a]. Over random cases with a strong bilinear
    term, the select() drafts equal the reference walk on chain scores; the wrong predecessor
    rules (always anchor; ids_l instead of ids_{l-1}) give different drafts in some cases."""
    rng = np.random.default_rng(4)
    k, H, r, V, K = 4, 8, 3, 30, 4
    differs = {"anchor": 0, "same_row": 0}
    for case in range(25):
        sel, (Wp, A, Bc) = random_selector(100 + case, r=r, H=H, V=V, K=K)
        h = (3 * rng.standard_normal((k, H))).astype(np.float32)
        z = (0.3 * rng.standard_normal((k, V))).astype(np.float32)  # close candidate values
        anchor = int(rng.integers(V))
        draft, q, info = sel.select(h, z, anchor, np.arange(k) + 10, GREEDY)
        assert q is None
        ids = np.array([ref_topk(z[l], K) for l in range(k)])
        u = z[np.arange(k)[:, None], ids].astype(np.float64)  # mult 1, no cap
        slots = ref_walk(ref_scores_loops(h, ids, u, anchor, Wp, A, Bc))
        assert info["chosen_slots"] == slots, case
        assert draft.tolist() == [int(ids[l, s]) for l, s in enumerate(slots)], case
        for rule in differs:
            wrong = ref_walk(ref_scores_loops(h, ids, u, anchor, Wp, A, Bc, pred_rule=rule))
            differs[rule] += wrong != slots
    assert all(n >= 3 for n in differs.values()), differs  # the cases have power


# ---------------------------------------------------------------- greedy walk
def test_walk_ties_nan_and_all_neg_inf():
    inf, nan = np.inf, np.nan
    S = np.zeros((5, 4, 4), np.float32)
    S[0, 0] = [1.0, 3.0, 3.0, 2.0]  # tie between slots 1 and 2 -> 1
    S[1, 1] = [nan, 0.5, nan, 0.7]  # NaN never wins -> 3 (prev = 1: row 1 reads S[1, 1])
    S[1, 0] = [9.0, 9.0, 9.0, 9.0]  # the row a wrong prev would read
    S[2, 3] = [-inf, -inf, -inf, -inf]  # all -inf -> 0
    S[3, 0] = [nan, -inf, nan, -inf]  # NaN and -inf only -> 0
    S[4, 0] = [-inf, -inf, 2.0, 2.0]  # tie after -infs -> 2
    slots = CandidateSelector.walk_greedy(S)
    assert slots.tolist() == ref_walk(S) == [1, 3, 0, 0, 2]


def test_walk_random_matches_reference():
    rng = np.random.default_rng(5)
    for _ in range(50):
        S = rng.integers(-3, 3, size=(6, 5, 5)).astype(np.float32)  # ties everywhere
        S[rng.random(S.shape) < 0.1] = np.nan
        S[rng.random(S.shape) < 0.1] = -np.inf
        assert CandidateSelector.walk_greedy(S).tolist() == ref_walk(S)


# ---------------------------------------------------------------- sampled walk
def test_keyed_noise_is_a_pure_function_of_the_key():
    u = keyed_uniform(7, np.array([3, 3, 4]), np.array([11, 12, 11]))
    assert u.tolist() == keyed_uniform(7, np.array([3, 3, 4]), np.array([11, 12, 11])).tolist()
    assert len(set(u.tolist())) == 3  # position and token both enter the key
    assert keyed_uniform(8, np.array([3]), np.array([11]))[0] != u[0]  # and the seed
    big = keyed_uniform(1, np.arange(200_000) // 1000, np.arange(200_000) % 1000)
    assert 0.0 < big.min() and big.max() < 1.0
    counts = np.histogram(big, bins=20, range=(0, 1))[0]
    assert gof_pvalue(counts, np.full(20, 0.05)) > 1e-3
    g = keyed_gumbel(1, np.arange(100_000), 5)
    assert abs(g.mean() - 0.5772156649) < 0.02 and abs(g.var() - math.pi ** 2 / 6) < 0.05


def _sampling_case(seed=6, k=2, K=5, V=30, same_ids=True):
    """Scores with a visible structure: row 1's law depends on the slot taken at row 0."""
    rng = np.random.default_rng(seed)
    sel, _ = random_selector(seed, V=V, K=K)
    ids = np.tile(rng.permutation(V)[:K], (k, 1)) if same_ids else \
        np.array([rng.permutation(V)[:K] for _ in range(k)])
    S = rng.normal(0, 1.2, size=(k, K, K)).astype(np.float32)
    return sel, ids, S


def test_sampled_walk_q_is_the_softmax_on_candidates():
    sel, ids, S = _sampling_case()
    T = 0.7
    slots, q = sel.walk_sampled(S, ids, T, seed=3, positions=np.array([20, 21]))
    assert q.dtype == np.float32 and q.shape == (2, sel.vocab_size)
    prev = [0, slots[0]]
    for l in range(2):
        np.testing.assert_allclose(q[l, ids[l]], softmax64(S[l, prev[l]].astype(np.float64) / T), rtol=1e-6)
        assert abs(float(q[l].sum(dtype=np.float64)) - 1.0) < 1e-6
        off = np.setdiff1d(np.arange(sel.vocab_size), ids[l])
        assert (q[l, off] == 0).all()
    again = sel.walk_sampled(S, ids, T, seed=3, positions=np.array([20, 21]))
    assert again[0].tolist() == slots.tolist() and np.array_equal(again[1], q)  # reproducible
    # an all -inf row: slot 0, and q is the one-hot of its candidate (the walk's true law)
    S2 = S.copy()
    S2[0, 0] = -np.inf
    slots2, q2 = sel.walk_sampled(S2, ids, T, seed=3, positions=np.array([20, 21]))
    assert slots2[0] == 0 and q2[0, ids[0, 0]] == 1.0 and q2[0].sum() == 1.0


def test_sampled_walk_frequencies_match_q_chi_square():
    """Joint law of (slot_0, slot_1) over many keys = q_0(s0) * softmax(S[1, s0, :]/T)(s1),
    the product of the q the selector reports. Rows 0 and 1 share candidate ids, so noise that
    ignored the position would correlate the rows and fail here."""
    sel, ids, S = _sampling_case()
    K, T, n = ids.shape[1], 0.8, 6000
    counts = np.zeros((K, K))
    for i in range(n):
        seed, pos = divmod(i, 100)  # vary both parts of the key
        slots, q = sel.walk_sampled(S, ids, T, seed=seed, positions=np.array([pos, pos + 1]))
        counts[slots[0], slots[1]] += 1
    p0 = softmax64(S[0, 0] / T)
    joint = np.array([[p0[a] * softmax64(S[1, a] / T)[c] for c in range(K)] for a in range(K)])
    assert gof_pvalue(counts.ravel(), joint.ravel()) > 1e-3


def test_sampled_walk_noise_follows_the_token_not_the_slot():
    """Keyed by candidate TOKEN id: listing the same candidates in another slot order (scores
    permuted alike) draws the same token."""
    sel, ids, S = _sampling_case(k=1, same_ids=False)
    perm = np.array([3, 0, 4, 1, 2])
    same = 0
    for seed in range(40):
        s1, _ = sel.walk_sampled(S, ids, 1.0, seed, np.array([5]))
        s2, _ = sel.walk_sampled(S[:, :, perm], ids[:, perm], 1.0, seed, np.array([5]))
        same += ids[0, s1[0]] == ids[0, perm][s2[0]]
    assert same == 40


def test_select_sampled_end_to_end():
    rng = np.random.default_rng(8)
    sel, _ = random_selector(8, V=40, K=5, mult=0.5, cap=6.0, valid=37)
    h = rng.standard_normal((3, 16)).astype(np.float32)
    z = rng.standard_normal((3, 40)).astype(np.float32)
    params = SamplingParams(temperature=0.9, seed=11)
    draft, q, info = sel.select(h, z, 4, np.array([7, 8, 9]), params)
    ids = np.array([s["candidate_ids"] for s in info["slots"]])
    slots = info["chosen_slots"]
    assert draft.tolist() == [ids[l, s] for l, s in enumerate(slots)]
    for l in range(3):  # q at the draft = softmax of the edge scores the walk compared, / T in
        # f32 as the walk divides (logits near -34 turn an f32 ulp of S/T into ~2e-6 of q)
        scaled = np.array(info["slots"][l]["candidate_scores"], np.float32) / np.float32(0.9)
        np.testing.assert_allclose(q[l, ids[l]], softmax64(scaled.astype(np.float64)), rtol=1e-6)
    assert (q[:, 37:] == 0).all()
    again = sel.select(h, z, 4, np.array([7, 8, 9]), params)
    assert again[0].tolist() == draft.tolist() and np.array_equal(again[1], q)
    # seed None: the step seed comes from the loop rng, so a seeded rng reproduces
    a = sel.select(h, z, 4, np.array([7, 8, 9]), SamplingParams(temperature=0.9), np.random.default_rng(1))
    b = sel.select(h, z, 4, np.array([7, 8, 9]), SamplingParams(temperature=0.9), np.random.default_rng(1))
    assert a[0].tolist() == b[0].tolist()


# ---------------------------------------------------------------- loading and refusals
def _draft_cfg(H=16, r=6, K=5, mult=0.25, cap=10.0):
    raw = {"architectures": ["DFlash2DraftModel"], "hidden_size": H, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_target_layers": 4,
           "dflash_config": {"block_size": 4, "mask_token_id": 1, "target_layer_ids": [1],
                             "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": r,
                             "selector_top_k": K, "output_multiplier": mult,
                             "final_logit_softcapping": cap}}
    return resolve_draft_config(raw, source="draft/config.json")


def _write_selector(tmp_path, V=40, r=6, H=16, drop=(), rows=None):
    rng = np.random.default_rng(9)
    t = {TENSORS[0]: rng.standard_normal((r, H)), TENSORS[1]: rng.standard_normal((rows or V, r)),
         TENSORS[2]: rng.standard_normal((rows or V, r))}
    t = {n: f32_to_bf16_array(a.astype(np.float32)) for n, a in t.items() if n not in drop}
    save_safetensors(tmp_path / "model.safetensors", t)
    return open_checkpoint(tmp_path), t


def test_from_checkpoint_wires_weights_and_scalars(tmp_path):
    cfg = _draft_cfg()
    ckpt, t = _write_selector(tmp_path)
    assert CandidateSelector.refusal_reason(ckpt, cfg, 40, valid_vocab=38) is None
    sel = CandidateSelector.from_checkpoint(ckpt, cfg, 40, valid_vocab=38)
    direct = CandidateSelector(t[TENSORS[0]], t[TENSORS[1]], t[TENSORS[2]], 5, 0.25, 10.0, valid_vocab=38)
    rng = np.random.default_rng(10)
    h, z = rng.standard_normal((3, 16)).astype(np.float32), (20 * rng.standard_normal((3, 40))).astype(np.float32)
    got, want = sel.select(h, z, 2, np.arange(3), GREEDY), direct.select(h, z, 2, np.arange(3), GREEDY)
    assert got[0].tolist() == want[0].tolist() and got[2] == want[2]
    values = np.array([s["candidate_values"] for s in got[2]["slots"]])
    ids = np.array([s["candidate_ids"] for s in got[2]["slots"]])
    np.testing.assert_allclose(values, ref_scalars(z[np.arange(3)[:, None], ids], 0.25, 10.0), rtol=1e-6)
    assert (ids < 38).all()


@pytest.mark.parametrize("drop", TENSORS)
def test_refuses_absent_tensor(tmp_path, drop):
    ckpt, _ = _write_selector(tmp_path, drop=(drop,))
    reason = CandidateSelector.refusal_reason(ckpt, _draft_cfg(), 40)
    assert drop in reason and "absent" in reason
    with pytest.raises(SelectorRefusedError, match=drop.replace(".", r"\.")):
        CandidateSelector.from_checkpoint(ckpt, _draft_cfg(), 40)


def test_refuses_codebook_rows_not_target_vocab(tmp_path):
    ckpt, _ = _write_selector(tmp_path, rows=36)
    with pytest.raises(SelectorRefusedError, match=r"predecessor_codebook.*\[36, 6\].*\[40, 6\].*target vocab"):
        CandidateSelector.from_checkpoint(ckpt, _draft_cfg(), 40)


def test_refuses_top_k_above_valid_vocab(tmp_path):
    ckpt, t = _write_selector(tmp_path)
    with pytest.raises(SelectorRefusedError, match=r"selector_top_k = 5 .*valid vocab 4"):
        CandidateSelector.from_checkpoint(ckpt, _draft_cfg(), 40, valid_vocab=4)
    assert CandidateSelector.refusal_reason(ckpt, _draft_cfg(), 40, valid_vocab=5) is None  # K == valid is fine
    with pytest.raises(SelectorRefusedError, match=r"selector_top_k = 41 .*40 valid vocab"):
        CandidateSelector(t[TENSORS[0]], t[TENSORS[1]], t[TENSORS[2]], 41)


def test_refuses_quantized_selector_tensor():
    """A dtype the reader may learn later (int8 ...) must not be read as if it were bf16."""
    infos = {n: SimpleNamespace(dtype="BF16", shape=s) for n, s in zip(TENSORS, ((6, 16), (40, 6), (40, 6)))}
    infos[TENSORS[2]] = SimpleNamespace(dtype="I8", shape=(40, 6))
    ckpt = type("Stub", (), {"directory": "draft", "info": staticmethod(infos.__getitem__),
                             "__contains__": lambda self, n: n in infos})()
    reason = CandidateSelector.refusal_reason(ckpt, _draft_cfg(), 40)
    assert TENSORS[2] in reason and "I8" in reason


def test_refuses_logits_of_another_vocab_and_deferred_refusal(tmp_path):
    sel, _ = random_selector(11, V=40)
    with pytest.raises(SelectorRefusedError, match=r"logits have shape \[2, 41\].*40"):
        sel.select(np.zeros((2, 16), np.float32), np.zeros((2, 41), np.float32), 0, np.arange(2), GREEDY)
    ckpt, _ = _write_selector(tmp_path, drop=(TENSORS[1],))
    deferred = CandidateSelector.from_checkpoint(ckpt, _draft_cfg(), 40, defer_refusal=True)
    assert isinstance(deferred, RefusedSelector) and TENSORS[1] in deferred.notice
    with pytest.raises(SelectorRefusedError, match=TENSORS[1].replace(".", r"\.")):
        deferred.select(np.zeros((2, 16), np.float32), np.zeros((2, 40), np.float32), 0, np.arange(2), GREEDY)
