"""The adaptive verify width (`block_size="auto"`, docs/adaptive_width.md): per step, how many
of the draft's B-1 positions the target verifies, k in 0..B-1, chosen to maximise expected
committed tokens per second

    E(k) = (1 + sum_{j<=k} S_j) / (D + c(k+1))          E(0) = 1 / c(1) before drafting

S_j = estimated probability that drafts 1..j are all accepted, D = the draft's step time,
c(rows) = the target's verify time for that many rows.

    costs = costs_for(target, draft, B)        # CostTable: measured once (a short timed sweep),
                                               # cached on disk beside the kernel cache
    rule  = AdaptiveWidth(costs, B)
    rule.draft_now(kmax) -> bool               # before drafting: from past statistics only
    rule.catch_up_pays(pending, remaining, kmax) -> bool  # (optional) the draft's context backlog
    rule.choose(proposal, kmax) -> k           # after drafting: from the draft's confidences
    rule.observe(k, accepted, drafted, draft_s, verify_s)

Exactness (spec §5.1, docs/adaptive_width.md): greedy output is the target's argmax chain for
any k. Under sampling, the decision to verify position j may read the draft's distributions
up to j, the earlier drafts, past statistics and timings, never the token drawn at j. So
`choose` walks the positions in order and decides on position j from the confidences of
positions <= j only (the confidence of j+1 may depend on the token drawn at j: a DFlash2 walk
conditions row j+1 on it); positions past j enter only through past averages.

Confidence of position j = the draft's probability of its own top candidate there (the max of
the distribution d_j is drawn from; `Proposal.confidence`, else max of `Proposal.q`), never
q_j(d_j) of the sampled token.
"""

from __future__ import annotations

import numpy as np

from ..errors import BlockSizeError
from .costs import CostTable, cost_cache_dir, costs_for  # noqa: F401  (the rule's API: callers import them here)

AUTO = "auto"


# ---------------------------------------------------------------- the block-size argument
def parse_block_size(value):
    """--block-size / block_size -> "auto" | int | None (None: the draft's B). Anything else
    (0, "abc", 2.5, True) is a BlockSizeError; the range 2..B is checked once the draft is known
    (`check_block_size`)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None if value is None else AUTO
    if isinstance(value, (bool, np.bool_)):
        raise BlockSizeError(f"block_size must be \"auto\" or an integer >= 2, got {value!r}")
    given = value
    if isinstance(value, str):
        try:
            value = int(value.strip(), 10)
        except ValueError:
            raise BlockSizeError(f"block_size (--block-size) must be \"auto\" or an integer >= 2, "
                                 f"got {given!r}") from None
    try:
        ok = int(value) == value
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or int(value) < 2:
        raise BlockSizeError(f"block_size (--block-size) must be \"auto\" or an integer >= 2 (the anchor "
                             f"row + at least one draft row), got {given!r}")
    return int(value)


def check_block_size(value, B: int) -> int | str:
    """The parsed value against the draft's trained block B: "auto" | an int in 2..B."""
    v = parse_block_size(value)
    if v is None:
        return int(B)
    if v != AUTO and v > B:
        raise BlockSizeError(f"block_size must be \"auto\" or an integer in 2..{B} (the draft's trained "
                             f"block size), got {value!r}")
    return v


# ---------------------------------------------------------------- survival of draft positions
CONF_EDGES = np.array([0.2, 0.4, 0.6, 0.75, 0.85, 0.93, 0.98])  # top-1 probability bucket edges
CONF_PRIOR = np.array([0.1, 0.3, 0.5, 0.68, 0.8, 0.89, 0.955, 0.99, 0.6])  # last: no confidence given
NO_CONF = len(CONF_PRIOR) - 1


class SurvivalEstimator:
    """Conditional acceptance a(j, b) = P(draft j accepted | drafts < j accepted, confidence
    bucket b of position j), from censored observations: after a step that verified k drafts
    and accepted A, positions 1..A are acceptances, position A+1 (when <= k) a rejection, and
    positions past that are unobserved, not failures. Counts decay by `forget` per observation
    (recent behaviour counts most). A cell with few observations leans on its bucket's pooled
    rate over all positions, which leans on the bucket's prior (the confidence itself: a
    calibrated draft's top-1 probability is its acceptance rate)."""

    def __init__(self, B: int, forget: float = 0.99, m_cell: float = 3.0, m_pool: float = 3.0):
        nb = len(CONF_PRIOR)
        # counts on Python floats (a step reads and writes a few dozen of them: numpy scalars
        # cost ~10x more per access); `acc` / `n` / `pool_*` show them as arrays
        self._acc, self._n = [[0.0] * nb for _ in range(B)], [[0.0] * nb for _ in range(B)]  # [j][b], j 1..B-1
        self._pool_acc, self._pool_n = [0.0] * nb, [0.0] * nb
        self._prior = CONF_PRIOR.tolist()
        self.forget, self.m_cell, self.m_pool = forget, m_cell, m_pool

    acc = property(lambda self: np.array(self._acc))  # [position j (1..B-1; 0 unused), bucket]
    n = property(lambda self: np.array(self._n))
    pool_acc = property(lambda self: np.array(self._pool_acc))
    pool_n = property(lambda self: np.array(self._pool_n))

    @staticmethod
    def buckets(conf: np.ndarray | None, k: int) -> np.ndarray:
        if conf is None:
            return np.full(k, NO_CONF, np.int64)
        return np.searchsorted(CONF_EDGES, np.asarray(conf[:k], np.float64), side="right").astype(np.int64)

    def rate(self, j: int, b: int) -> float:
        pool = (self._pool_acc[b] + self.m_pool * self._prior[b]) / (self._pool_n[b] + self.m_pool)
        return (self._acc[j][b] + self.m_cell * pool) / (self._n[j][b] + self.m_cell)

    def observe(self, buckets, k: int, accepted: int) -> None:
        """buckets[j-1] of positions 1..k verified, `accepted` of them accepted (a prefix)."""
        f, acc, n, pacc, pn = self.forget, self._acc, self._n, self._pool_acc, self._pool_n
        for j in range(1, min(accepted + 1, k) + 1):
            b, y = int(buckets[j - 1]), float(j <= accepted)
            acc[j][b] = f * acc[j][b] + y
            n[j][b] = f * n[j][b] + 1.0
            pacc[b] = f * pacc[b] + y
            pn[b] = f * pn[b] + 1.0


def proposal_confidence(prop) -> np.ndarray | None:
    """[n] top-1 probability of the distribution each draft was drawn from (never of the drawn
    token), or None when the drafter reports neither confidences nor distributions."""
    conf = getattr(prop, "confidence", None)
    if conf is not None:
        return np.asarray(conf, np.float64)
    if prop.q is not None:
        return np.asarray(prop.q, np.float64).max(axis=-1)
    return None


# ---------------------------------------------------------------- the rule
# Hysteresis of draft_now: once drafting, keep drafting while its value is at least (1 - STAY) x
# a plain step's. A plain step inside `auto` costs more than the cost table's c(1) says: 7 %
# more than a target-only step after plain steps (the draft's tap rows, the rule), ~20 % more
# right after a drafted step (docs/adaptive_width.md). Switching at break-even pays both.
STAY = 0.1
PLAIN_BATCH = 8  # a plain run asks the rule (and refreshes c(1)) once per this many steps at most
RETEST_SHARE = 0.05  # a re-test's expected loss may be this share of the plain run before it
FULL_EVERY = 8  # drafted steps in a row on a smaller block before one runs the full block B
WARM_CEILING = 1.5  # the first steps draft (statistics to start from) where drafting could gain this much


class AdaptiveWidth:
    """Per step: `draft_now` (before drafting) compares E(0) = 1/c(1) with the best E(k>=1)
    under the average survival of past drafted steps; `choose` (after drafting) extends the
    verified prefix position by position while some longer prefix, valued with this step's
    confidences up to j and past averages beyond, beats stopping. `online`: refresh the costs
    from the measured step times (off for a seeded sampled run, whose draws then depend only on
    the cached table). A plain step still feeds the draft's context (decode/step.py)."""

    name = AUTO

    def __init__(self, costs: CostTable, B: int, online: bool = True, warm_steps: int = 3,
                 probe_every: tuple[int, ...] = (2, 4, 8, 16, 24), mean_weight: float = 0.25,
                 stay: float = STAY, retest_share: float = RETEST_SHARE):
        if costs.B < B:
            raise ValueError(f"cost table for {costs.B} rows, block of {B}")
        self.costs, self.B, self.online = costs, int(B), online
        self.choices = costs.draft_choices(self.B)  # runtime draft blocks: the timed smaller ones and B
        self.retest_share = float(retest_share)
        self.stay = float(stay)  # hysteresis: a drafting run goes on while drafting >= (1 - stay) x plain
        self.drafting = True  # the regime of the last decision (the warm-up drafts)
        self.est = SurvivalEstimator(B)
        self.mean_S = 0.7 ** np.arange(B, dtype=np.float64)  # [B] average survival S_j of drafted steps (S_0 = 1)
        self.mean_weight = mean_weight
        self.mean_seen = False
        self.warm_left = warm_steps  # the first drafted steps always draft (statistics to start from)
        self.probe_every, self.probe_level, self.plain_run = probe_every, 0, 0
        self._buckets, self._probe = np.zeros(0, np.int64), False
        # realized tokens and seconds of recent drafted steps (exponential averages): what
        # drafting has actually paid under the current choice of k
        self.real_tokens = self.real_s = 0.0
        self.real_weight = 0.2
        # a run of plain steps: `plain_left` more steps are plain without asking the rule (the
        # caller counts them down, decode/step.py); their one-row times are refreshed into the
        # table PLAIN_BATCH at a time; the first plain step after a drafted step (the models'
        # caches swapped back: ~1.2-1.5x a plain step's time) is a price of drafting, not of c(1)
        self.plain_left, self._after_draft = 0, False
        self._plain_sum, self._plain_n = 0.0, 0
        # the draft's runtime block of the step in progress (decode/step.py reads it): B, or a
        # smaller block the sweep timed where its cheaper proposal is worth more (`_pick_rows`)
        self.rows = self._model_rows = self.B
        self._small_run = 0  # drafted steps in a row on a smaller block
        self._due = 0.0  # the plain-run length of the next re-test (set by a plain verdict)

    # -- before drafting
    def drafting_value(self, kmax: int) -> float:
        """Expected tokens per second of a drafted step: the larger of the model's best E(k >= 1)
        (average survival of recent drafted steps, the cost table) and the realized rate of
        recent drafted steps (tokens over measured seconds)."""
        self._model_rows, best = self._pick_rows(kmax, self.mean_S.tolist())
        if self.real_s > 0 and self.real_tokens / self.real_s > best:
            best = self.real_tokens / self.real_s
        return best

    def catch_up_pays(self, pending: int, remaining: int, kmax: int) -> bool:
        """Drafting now first feeds the draft the `pending` context rows it has not seen (the
        prompt, at the first draft: pending x feed_s seconds). Worth it only if perfect drafts over
        the `remaining` tokens of the budget could save more than that: remaining x (c(1) - the
        seconds per token of a step whose drafts are all accepted). Else stay with plain steps
        (and their backlog), warm-up and re-tests included. feed_s 0 (not measured): no veto."""
        cost = pending * self.costs.feed_s
        if cost <= self.costs.draft_s:  # a step's usual context (a few rows): part of a draft step
            return True
        if kmax < 1:
            return False
        c1, top = self.costs.verify_list[0], self.ceiling(kmax)
        gain = c1 - c1 / top if top > 0 else 0.0  # seconds saved per token, at best (every draft accepted)
        return cost < remaining * gain

    def ceiling(self, kmax: int) -> float:
        """What drafting could gain at most: the best E(k) with every draft accepted, over E(0).
        (Python floats, no arrays: a plain run asks it every PLAIN_BATCH steps, up to 3 times.)"""
        c = self.costs.verify_list
        return max(1.0 / max(c[0], 1e-12), self._pick_rows(kmax, None)[1]) * c[0]

    def _pick_rows(self, kmax: int, S) -> tuple[int, float]:
        """The runtime draft block q (B or a smaller timed one) and k <= min(kmax, q - 1) with
        the best E(k) = (1 + S_1 + .. + S_k) / (D(q) + c(k + 1)), survival S (None: every draft
        accepted) -> (q, that E). A smaller block proposes fewer drafts for less."""
        c, costs = self.costs.verify_list, self.costs
        best_q, best = self.B, 0.0
        for q in self.choices:
            D = costs.draft_for(q)
            tokens = 1.0
            for k in range(1, min(kmax, q - 1) + 1):  # comparisons, not max(): per plain batch
                tokens += 1.0 if S is None else S[k]
                d = D + c[k]
                v = tokens / (d if d > 1e-12 else 1e-12)
                if v > best:
                    best_q, best = q, v
        return best_q, best

    def draft_now(self, kmax: int) -> bool:
        if self.warm_left > 0:
            if self.ceiling(kmax) >= WARM_CEILING:
                self.rows = self._pick_rows(kmax, self.mean_S.tolist())[0]
                return True
            self.warm_left = 0  # drafting could gain little even at full acceptance: no forced drafts
        plain = 1.0 / max(self.costs.verify_list[0], 1e-12)  # E(0)
        if self.drafting_value(kmax) > (plain * (1.0 - self.stay) if self.drafting else plain):  # E(k >= 1) vs E(0)
            self.plain_run, self.probe_level, self._probe = 0, 0, False
            self.drafting, self.rows = True, self._explore(self._model_rows)
            return True
        self.drafting = False
        self.plain_run += 1
        # re-test now and then (estimates go stale), unless even drafts that are always accepted
        # could not pay for their rows
        due = self._due = self._retest_due(kmax)
        if self.plain_run >= due:
            self.plain_run, self._probe, self.rows = 0, True, self._retest_rows()
            self.probe_level = min(self.probe_level + 1, len(self.probe_every) - 1)
            return True
        # the verdict holds until the re-test is due (the statistics do not move in a plain run;
        # c(1) drifts slowly): the next steps are plain without this arithmetic, PLAIN_BATCH at most
        ahead = int(min(PLAIN_BATCH - 1, due - self.plain_run - 1))  # (due: a float, or inf)
        if ahead > 0:
            self.plain_left = ahead
            self.plain_run += ahead
        return False

    def retires(self, remaining: int) -> bool:
        """After a plain verdict: True when the next re-test would come after the `remaining`
        tokens of the request's budget (a plain run commits one a step). The verdict cannot turn
        before: a plain run moves no survival statistic, and c(1)'s drift moves the untimed
        costs with it (decode/costs.py), so the request can stop feeding its draft."""
        return not self.drafting and self.warm_left <= 0 and self.plain_run + remaining < self._due

    def _retest_due(self, kmax: int) -> float:
        """The length of a plain run at which a re-test drafts: after the schedule's next count of
        plain steps, and once a share of the run's time pays for the re-test's expected loss (its
        draft and 3-row verify against the tokens it commits at plain cost). The share is
        RETEST_SHARE where drafting could gain WARM_CEILING x or more at full acceptance, less
        below, down to nothing at 1x: never (inf) when even drafts always accepted cannot pay."""
        top = self.ceiling(kmax)
        if top <= 1.0:
            return float("inf")
        c, D, S = self.costs.verify_list, self.costs.draft_for(self._retest_rows()), self.mean_S
        k = min(2, kmax)
        loss = D + c[k] - (1.0 + float(S[1:k + 1].sum())) * c[0]
        share = self.retest_share * min(1.0, (top - 1.0) / (WARM_CEILING - 1.0))  # less where less is to gain
        by_budget = loss / (share * c[0]) if loss > 0 else 0.0
        return max(self.probe_every[self.probe_level] + 1, by_budget)

    def _explore(self, q: int) -> int:
        """A smaller block verifies positions < q only, so the survival of the later ones stops
        being learnt: after FULL_EVERY drafted steps in a row on smaller blocks, one runs B."""
        if q >= self.B:
            self._small_run = 0
            return q
        self._small_run += 1
        if self._small_run > FULL_EVERY:
            self._small_run = 0
            return self.B
        return q

    def _retest_rows(self) -> int:
        """A re-test's draft block: the cheapest that proposes the two drafts it verifies."""
        return min((q for q in self.choices if q >= 3), key=self.costs.draft_for, default=self.B)

    # -- after drafting
    def choose(self, prop, kmax: int) -> int:
        conf = proposal_confidence(prop)
        b = self.est.buckets(conf, kmax)
        self._buckets = b
        bl = b.tolist()
        c, D = self.costs.verify_list, self.costs.draft_for(self.rows)  # Python floats: cheaper per step
        rate = self.est.rate
        # the step's own survival of every position, for the average the gate uses (past
        # statistics for later steps; this step's decision reads positions <= j only, below)
        S_full = [1.0] * (kmax + 1)
        for j in range(1, kmax + 1):
            S_full[j] = S_full[j - 1] * rate(j, bl[j - 1])
        w = self.mean_weight if self.mean_seen else 1.0  # the first drafted step replaces the prior
        self.mean_seen = True
        mS = self.mean_S.tolist()
        for j in range(1, kmax + 1):
            mS[j] += w * (S_full[j] - mS[j])
        self.mean_S[1:kmax + 1] = mS[1:kmax + 1]
        k, tokens = 0, 1.0
        for j in range(1, kmax + 1):
            Sj = S_full[j]  # reads confidences 1..j only
            stop = tokens / (D + c[j - 1])  # verify k = j-1: j rows
            t, s, go = tokens + Sj, Sj, False
            for m in range(j, kmax + 1):  # verify up to m >= j; beyond j by past average ratios
                if m > j:
                    s *= min(1.0, mS[m] / mS[m - 1]) if mS[m - 1] > 0 else 0.0
                    t += s
                if t / (D + c[m]) > stop:
                    go = True
                    break
            if not go:
                break
            k, tokens = j, tokens + Sj
        if self._probe:  # a re-test verifies at least two positions (else nothing is learnt)
            k = max(k, min(2, kmax))
        if self.warm_left > 0:
            self.warm_left -= 1
        return k

    # -- after verifying
    def observe(self, k: int, accepted: int, drafted: bool, draft_s: float, verify_s: float) -> None:
        if not drafted and self.online:
            self._observe_plain(verify_s)
            return
        if drafted:
            self.est.observe(self._buckets, k, accepted)
            self._probe, self._after_draft = False, True
        if drafted and self.online:  # timings: not for a frozen table (a seeded run's draws)
            seconds = (self.costs.draft_s if draft_s is None else draft_s) + verify_s
            w = self.real_weight if self.real_s > 0 else 1.0
            self.real_tokens += w * (accepted + 1 - self.real_tokens)
            self.real_s += w * (seconds - self.real_s)
        if self.online:
            self.costs.observe_verify(k + 1, verify_s)
            if drafted and draft_s is not None:  # None: a catch-up step whose feed price is unknown
                self.costs.observe_draft(draft_s, rows=self.rows)

    def _observe_plain(self, verify_s: float) -> None:
        """A plain step's one-row time. The first after a drafted step goes to drafting's realized
        seconds (its extra over c(1)); the others reach c(1) as the mean of up to PLAIN_BATCH
        steps, at the weight that many observations would have had."""
        if self._after_draft:
            self._after_draft = False
            extra = verify_s - self.costs.verify_list[0]
            if extra > 0 and self.real_s > 0:
                self.real_s += self.real_weight * extra
            return
        self._plain_sum += verify_s
        self._plain_n += 1
        if self._plain_n >= PLAIN_BATCH or self.plain_left == 0:
            n = self._plain_n
            self.costs.observe_verify(1, self._plain_sum / n, weight=1.0 - 0.9 ** n)
            self._plain_sum, self._plain_n = 0.0, 0
