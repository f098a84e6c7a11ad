"""Sampling and lossless verification (spec §5.1).

    SamplingParams(temperature, top_k, top_p, seed)    temperature 0 = greedy
    mask_padded(logits, valid_vocab)                   padded ids -> -inf, before anything else
    greedy_token(logits)                               argmax, ties -> lowest id, NaN never wins
    target_probs(logits, params)                       temperature -> top-k -> top-p -> normalise (f64)
    sample_token(p, rng)                               inverse-CDF draw, zero-probability ids never drawn
    verify_block(logits, draft_ids, q, params, rng)    -> (n_accepted, next_token)

Verification (Leviathan et al.): with `p_i` the target distribution at verify row i and `q_i`
the distribution the draft token d_{i+1} was drawn from, accept iff `u * q_i(d) < p_i(d)`; at
the first rejection draw from `normalize(max(p_i - q_i, 0))` (falling back to `p_i` when that
is all zero); when every draft is accepted draw the bonus from the last row. `q = None` means a
one-hot proposal (argmax drafting). The emitted sequence is then distributed exactly as
target-only sampling, whatever the draft does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GenerationArgumentError


# A policy, not a limit of the math: below 1e-5 a draw is the argmax for any logit gap above
# ~1e-3 (exp(-100)), above 1e5 it is within ~0.1% of uniform for logits spread over < 100. Both
# are far outside any sampling setting in use, so a value there is refused as a likely typo
# rather than computed (1e-320 used to overflow logits / T into NaN and sample a padding id).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax, ties -> lowest id)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = fresh OS entropy

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (np.isfinite(t) and t >= 0):
            raise GenerationArgumentError(f"temperature must be a finite number >= 0, got {t!r}")
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise GenerationArgumentError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t!r}: "
                "outside that range the distribution is numerically greedy or uniform (use 0 for greedy)")
        if int(k) != k or k < 0:
            raise GenerationArgumentError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not (0.0 < p <= 1.0):
            raise GenerationArgumentError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None and (int(self.seed) != self.seed or self.seed < 0):
            raise GenerationArgumentError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def mask_padded(logits: np.ndarray, valid_vocab: int | None) -> np.ndarray:
    """Copy of logits [..., V] with ids >= valid_vocab (padding the tokenizer does not know)
    set to -inf, so they are never emitted nor proposed. NaN is also mapped to -inf."""
    out = np.array(logits, dtype=np.float32, copy=True)  # [..., V]
    if valid_vocab is not None and valid_vocab < out.shape[-1]:
        out[..., valid_vocab:] = -np.inf
    out[np.isnan(out)] = -np.inf
    return out


def greedy_token(logits: np.ndarray) -> int:
    """argmax of a [V] row; np.argmax returns the first maximum, i.e. the lowest id on a tie.
    An all -inf row gives id 0 (callers mask NaN first, see mask_padded)."""
    return int(np.argmax(logits))


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Target distribution p [V] (float64, sums to 1) of one masked logits row [V].

    Greedy (temperature 0): the one-hot of the argmax. Otherwise: logits / T, then keep the
    top_k largest (ties at the k-th value are kept, as Hugging Face does), then the smallest
    set of most probable ids whose mass reaches top_p (the id that crosses top_p is kept)."""
    V = logits.shape[-1]
    if params.greedy:
        p = np.zeros(V, np.float64)  # [V]
        p[greedy_token(logits)] = 1.0
        return p
    # float32 logits (|z| < 3.5e38) over T >= MIN_TEMPERATURE stay far below float64's overflow
    z = logits.astype(np.float64) / params.temperature  # [V]
    if 0 < params.top_k < V:
        kth = np.partition(z, V - params.top_k)[V - params.top_k]  # k-th largest value
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max()
    p = np.exp(z)  # [V]
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")  # descending; ties by ascending id
        mass_before = np.cumsum(p[order]) - p[order]  # mass of strictly more probable ids
        drop = order[mass_before >= params.top_p]  # the id crossing top_p has mass_before < top_p
        p[drop] = 0.0
        p /= p.sum()
    return p


def sample_token(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from p [V] (non-negative, not necessarily normalised). Ids with p == 0 are
    never drawn: searchsorted(side="right") skips the flat steps of the CDF."""
    cdf = np.cumsum(p, dtype=np.float64)  # [V]
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(p) - 1))


def verify_block(logits: np.ndarray, draft_ids: np.ndarray, q: np.ndarray | None,
                 params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """Accept a prefix of the drafts and pick the next token.

    logits    [Bv, V] f32, MASKED (mask_padded); row i predicts the token after verify row i
    draft_ids [Bv-1]  int; draft_ids[i] is the proposal verified by row i
    q         [Bv-1, V] proposal distributions, or None for one-hot (argmax) proposals
    returns   (a, x): drafts 0..a-1 accepted, x = the correction (a < Bv-1) or bonus token.
    """
    k = len(draft_ids)
    assert logits.shape[0] == k + 1, (logits.shape, k)
    if params.greedy:
        # p_i is one-hot: accept iff d == argmax, and the residual max(p - q, 0) is the argmax
        # itself, so both cases emit argmax(row a). No random numbers are used.
        targets = np.argmax(logits, axis=-1)  # [Bv], ties -> lowest id
        a = 0
        while a < k and int(draft_ids[a]) == int(targets[a]):
            a += 1
        return a, int(targets[a])
    for i in range(k):
        p = target_probs(logits[i], params)  # [V] f64
        d = int(draft_ids[i])
        q_d = 1.0 if q is None else float(q[i, d])
        if rng.random() * q_d < p[d]:
            continue  # accepted
        if q is None:  # one-hot q: the residual is p with d removed
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q[i].astype(np.float64), 0.0)  # [V]
        if residual.sum() <= 0.0:
            residual = p
        return i, sample_token(residual, rng)
    return k, sample_token(target_probs(logits[k], params), rng)
