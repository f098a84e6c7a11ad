"""The server's batched verify width (`block_size="auto"` in `serve`, docs/adaptive_width.md):
ONE budget of verify rows for the whole batch. Per engine step, every (request, position j)
gets its estimated survival S_{r,j} (the probability that drafts 1..j of request r are all
accepted, decode/width.SurvivalEstimator), the pairs are ranked by it, and the best N are
verified, N chosen by the tokens-per-second rule of decode/width.py over the batch's cost:

    E(N) = (R + sum of the N best S_{r,j}) / (D(n) + c(rows + N))     R requests, n drafting

c(rows) = seconds of a batched verify of that many rows in all (a CostTable over 1..max_running
x B rows: measured at load, cached on disk, refreshed online from real batched steps, the same
code as the one-request table), D(n) = seconds of the batched draft forward of n requests
(prior: the one-request draft time scaled like the target's row cost, refreshed online).
N = 0 after drafting, or no draft at all (n = 0), is a plain batched step; the committed
tokens' tap rows then wait in each request's pending draft context (decode/step.py), so
speculation resumes on a complete context.

    rule = BatchWidth(costs, B, max_running)
    dec = Decoding(..., width=rule.seat())      # a greedy request joins the budget
    step_batch(target, draft, decodings, rule)  # plan -> draft -> allot -> verify -> record

Which requests join: greedy ones. Greedy output is the target's argmax chain whatever rows are
verified, so the batch may decide on anything. A sampled request keeps its own one-request rule
(decode/width.AdaptiveWidth on the measured table, no online refresh): its widths, so its random
draws, then depend on its seed and the table only, and a seeded request gives token for token
its solo `generate --block-size auto` run, whatever else runs (the server's contract). Its rows
count in c(rows) like everyone's.

Before drafting (`plan`): n in 0..R requests draft (the ones with the best average survival);
n = 0 (a plain batched step) unless drafting beats it. Drafting n requests is valued by its
realized gain at this batch size R where one was measured in the last GAIN_STALE steps
(committed tokens over measured seconds of such steps, over the same of the plain steps at R:
ratios of decayed sums, so load hits both alike; a catch-up step's draft counts without its
backlog rows, at the table's price per row), else by E(N) under the average survival of each
request's past drafted steps (a new request starts at the server's average, and its first
drafted step moves it half way only). In the first
`warm_steps` steps one request always drafts, and a request alone in the batch drafts its
first `alone_warm_steps` steps there whatever the one-request gain (measured on the requests
before it) says (with one client, how well the draft predicts is each prompt's). While others
are about to join (`joining`: prefilling, or queued with room, as at the start of a burst), no
request drafts: the step's R is not the batch's, and a drafting request's context catch-up
would serve one step. After a run of
plain steps whose time is 1 / PROBE_SHARE x what a re-test costs (measured), and where drafts
always accepted could pay, one request drafts anyway and verifies at least 2 drafts (a
re-test: the estimates go stale; at once where one request drafting paid when last measured
at this R, 256 steps or more ago); each re-test that commits fewer tokens a second than plain
steps halves that share at its batch size (down to PROBE_SHARE / 8: where drafting never
pays, as for 4-8 requests on a CPU, re-tests cost ~0.2 % of the time), one that pays restores it.
After drafting (`allot`): this step's confidences give S_{r,j}; the N best pairs (a prefix of
each request, since S_{r,j} falls with j) are verified.
"""

from __future__ import annotations

import numpy as np

from .width import AUTO, AdaptiveWidth, CostTable, SurvivalEstimator, costs_for, proposal_confidence


GAIN_STALE = 256  # steps after which a realized gain no longer decides (the model does again)
RATE_DECAY = 0.9  # per step, of the realized rates' sums (about the last 10 steps of each kind)
PROBE_SHARE = 0.015  # a re-test may cost up to this share of the plain steps' time since the last
PROBE_SHARE_MIN = PROBE_SHARE / 8  # ... halved after each re-test that did not pay, down to this


def _best_n(scores: np.ndarray, tokens: float, rows: int, D: float, c: np.ndarray) -> tuple[int, float]:
    """argmax_N (tokens + sum of the N best scores) / (D + c(rows + N)), N in 0..len(scores)
    and rows + N within the table -> (N, value). scores sorted best first. (On Python floats:
    numpy scalars cost ~5x more per access, and the planner calls this once per drafting count
    each step: 272 us a step at 8 requests before.)"""
    scores = scores.tolist() if isinstance(scores, np.ndarray) else scores
    c = c.tolist() if isinstance(c, np.ndarray) else c
    best_n, best = 0, tokens / max(D + c[rows - 1], 1e-12)
    t = tokens
    for N in range(1, min(len(scores), len(c) - rows) + 1):
        t += scores[N - 1]
        v = t / max(D + c[rows + N - 1], 1e-12)
        if v > best:
            best_n, best = N, v
    return best_n, best


class _Seat:
    """One greedy request's place in the budget: the Decoding's width rule (decode/step.py
    calls draft_now / choose / observe), answering with what the batch decided."""

    name = AUTO

    def __init__(self, rule: "BatchWidth"):
        self.rule = rule
        self.mean_S = rule.mean_S.copy()  # [B] average survival of this request's drafted steps
        self.seen = False
        self.draft = False  # this step: draft (plan)
        self.k = 0  # this step: drafts to verify (allot)
        self.buckets = np.zeros(0, np.int64)
        self.last_drafted = 0  # step counter of this request's last drafted step
        self.alone_warm = rule.alone_warm_steps  # its first steps alone in the batch draft (plan)

    def draft_now(self, kmax: int) -> bool:
        return self.draft

    def choose(self, prop, kmax: int) -> int:
        return min(self.k, kmax)

    def observe(self, k: int, accepted: int, drafted: bool, draft_s, verify_s) -> None:
        if drafted:  # timings: the batch records them (record)
            self.rule.est.observe(self.buckets, k, accepted)


class BatchWidth:
    """The batch's verify-row budget (module docstring). `costs`: verify seconds of 1..len
    rows in all (max_running x B); `draft_costs`: injected batched draft seconds per drafting
    request count (tests), else a prior. `online`: refresh both from the measured steps (off:
    an injected table stays as given)."""

    def __init__(self, costs: CostTable, B: int, max_running: int, draft_costs=None, warm_steps: int = 3,
                 probe_every: tuple[int, ...] = (2, 4, 8, 16, 24), mean_weight: float = 0.25, online: bool = True,
                 alone_warm_steps: int = 3):
        self.costs, self.B, self.max_running, self.online = costs, int(B), int(max_running), online
        self.alone_warm_steps = int(alone_warm_steps)
        self.joining = 0  # requests about to join the batch (prefilling, or queued with room; the server sets it)
        c = costs.verify_s
        if draft_costs is None:  # one draft block scaled like the target's cost of n blocks of rows
            base = c[min(self.B, len(c)) - 1]
            draft_costs = [costs.draft_s * c[min(n * self.B, len(c)) - 1] / max(base, 1e-12)
                           for n in range(1, self.max_running + 1)]
        self.draft_costs = CostTable(np.asarray(draft_costs, np.float64), 0.0, costs.source)  # [n-1]: n drafting
        self.est = SurvivalEstimator(self.B)  # shared: one pair, confidence-conditioned
        self.mean_S = 0.7 ** np.arange(self.B, dtype=np.float64)  # [B] server average S_j (S_0 = 1)
        self.mean_weight, self.warm_left = mean_weight, warm_steps
        self.probe_every, self.probe_level, self.plain_run = probe_every, 0, 0
        self.steps = 0
        self._probe: _Seat | None = None
        # realized gain of n drafting requests in a batch of R, per (R, n): an exponential average
        # of (committed tokens / measured seconds) over the realized rate of plain steps at R
        # (both measured alike, so load and the table's errors cancel; the table's E(0) until
        # a plain step at R has run)
        self.gain: dict[tuple[int, int], float] = {}
        # realized rates as decayed sums [tokens, seconds] (a ratio of sums: one step's tokens
        # are bimodal, 2 or B, and an average of per-step ratios swung by +-50 % on the x8 pair)
        self.plain_sums: dict[int, list[float]] = {}  # R -> of plain steps at R
        self.draft_sums: dict[tuple[int, int], list[float]] = {}  # (R, n) -> of steps drafting n at R
        self.gain_step: dict[tuple[int, int], int] = {}  # (R, n) -> the step its gain was last updated
        self._R = 0  # requests in the step in progress
        self.decay = RATE_DECAY
        self._key: tuple | None = None  # this step drafts: (R, n, E(0), a plain step's seconds)
        self.probe_extra: float | None = None  # measured extra seconds of a re-test step
        self.probe_share: dict[int, float] = {}  # R -> the re-tests' share of plain time (halved while they do not pay)
        self._plain_step_s = 0.0  # a plain step's estimated seconds (plan)
        self.plain_s = 0.0  # estimated seconds of the plain steps since the last drafted one

    def seat(self) -> _Seat:
        return _Seat(self)

    def width_for(self, sampling, target, draft):
        """A request's width rule under "auto": greedy, a seat in this budget; sampled, the
        one-request rule on the measured table without online refresh (its widths, so its
        draws, depend on its seed and the table only: its solo run's, decode/loop.width_rule)."""
        if sampling.greedy:
            return self.seat()
        return AdaptiveWidth(costs_for(target, draft, self.B).frozen(), self.B, online=False)

    # ---------------------------------------------------------------- the costs
    def D(self, n: int) -> float:
        return 0.0 if n <= 0 else float(self.draft_costs.verify_s[min(n, len(self.draft_costs.verify_s)) - 1])

    def record(self, drafting: int, draft_s: float, rows: int, verify_s: float, tokens: int,
               trimmed: bool = False, backlog: int = 0) -> None:
        """The measured seconds of a batched step: its draft forward (n requests; `backlog`: the
        context rows its requests fed past one block, in all: a prompt's, or a run of plain
        steps'; 0, a typical draft step) and its verify of `rows` rows in all, and the tokens it
        committed (`trimmed`: a drafting request's block was cut by its token budget)."""
        if not self.online:
            return
        typical = backlog == 0
        if self._probe is not None:  # what a re-test really costs over a plain step (context catch-up included)
            extra = draft_s + verify_s - self._key[3]
            self.probe_extra = extra if self.probe_extra is None else self.probe_extra + 0.3 * (extra - self.probe_extra)
        if drafting == 0:
            self._add(self.plain_sums, self._R, tokens, verify_s)
        elif self._key is not None and not trimmed:  # a budget's last steps say little of drafting
            # a context catch-up (the prompt's, or a run of plain steps' backlog) is the price of
            # resuming, not of drafting: such a step counts its draft without the backlog's rows
            # (at the table's price per row), or at the draft's usual cost where that is unknown
            seconds = self.costs.without_backlog(draft_s, backlog)  # (draft_s itself when backlog is 0)
            if seconds is None:
                seconds = self.D(drafting)
            R, n, plain, _ = self._key
            self._add(self.draft_sums, (R, n), tokens, seconds + verify_s)
            self.gain[R, n] = self._rate(self.draft_sums[R, n]) / max(self.plain_rate(R, plain), 1e-12)
            self.gain_step[R, n] = self.steps
            if self._probe is not None:  # a re-test that did not pay makes the next one wait twice as long
                paid = tokens / max(seconds + verify_s, 1e-12) > self.plain_rate(R, plain)
                share = self.probe_share.get(R, PROBE_SHARE)
                self.probe_share[R] = PROBE_SHARE if paid else max(PROBE_SHARE_MIN, share / 2)
        if 1 <= rows <= self.costs.B:
            self.costs.observe_verify(rows, verify_s)
        if typical and 1 <= drafting <= self.draft_costs.B:
            self.draft_costs.observe_verify(drafting, draft_s)

    def plain_rate(self, R: int, model: float) -> float:
        """Tokens per second of plain steps at R: measured, else the table's E(0) `model`."""
        sums = self.plain_sums.get(R)
        return model if sums is None else self._rate(sums)

    def _add(self, table: dict, key, tokens: float, seconds: float) -> None:
        sums = table.get(key)
        if sums is None:
            table[key] = [float(tokens), float(seconds)]
        else:
            sums[0] = self.decay * sums[0] + tokens
            sums[1] = self.decay * sums[1] + seconds

    @staticmethod
    def _rate(sums: list[float]) -> float:
        return sums[0] / max(sums[1], 1e-12)

    def _others(self, decodings: list, kmax: list[int]) -> tuple[int, float, int]:
        """(rows, expected tokens, drafting requests) of a step before the seats' drafts: one
        row and one token per request, plus the drafts of requests under another rule
        (kmax[i] rows at most, worth the server's average survival)."""
        rows, tokens, drafting = len(decodings), float(len(decodings)), 0
        for d, k in zip(decodings, kmax):
            if not isinstance(d.width, _Seat) and d.draft is not None and k >= 1:
                rows, tokens, drafting = rows + k, tokens + float(self.mean_S[1:k + 1].sum()), drafting + 1
        return rows, tokens, drafting

    # ---------------------------------------------------------------- before drafting
    def plan(self, decodings: list) -> None:
        """Decide which seated requests draft this step (sets seat.draft)."""
        self.steps, self._R = self.steps + 1, len(decodings)
        seats = [(d, d.width) for d in decodings if isinstance(d.width, _Seat)]
        for _, s in seats:
            s.draft, s.k = False, 0
        self._probe, self._key = None, None
        able = [(d, s) for d, s in seats if d.budget_kmax() >= 1]
        if not able or self.joining > 0:  # (others about to join: this step's R is not the batch's)
            return
        rows, tokens, others = self._others(decodings, [d.budget_kmax() for d in decodings])
        c = self.costs.verify_s
        rows = min(rows, len(c))
        self._plain_step_s = self.D(others) + c[rows - 1]
        plain = tokens / max(self._plain_step_s, 1e-12)  # E(0): a plain batched step
        R = len(decodings)
        if self.warm_left > 0:  # statistics to start from, from ONE request: a first burst of
            # 8 requests all drafting cost 6x a plain step, three times (x8 pair, 1 thread)
            self.warm_left -= 1
            self._draft(able, 1, R, plain)
            return
        if R == 1 and self._alone_warm(able[0], tokens, rows, others, plain):
            self._draft(able, 1, R, plain)
            return
        # requests ranked by their average survival: the n best draft. Drafting n is valued by
        # its realized gain at this batch size when it has one, else by the model
        surv = [(d, s, s.mean_S[1:d.budget_kmax() + 1].tolist()) for d, s in able]  # [kmax] each
        surv.sort(key=lambda dss: -sum(dss[2]))
        able = [(d, s) for d, s, _ in surv]
        best_n, best, scores, whole, retest = 0, plain, [], True, False
        for n in range(1, len(able) + 1):
            scores = sorted(scores + surv[n - 1][2], reverse=True)  # the first n requests' positions, best first
            # a gain was measured on whole blocks: a request near its budget's end (fewer drafts
            # to verify) is valued by the model (a 2-row step there cost 3x a plain one for 1 token)
            whole = whole and len(surv[n - 1][2]) >= self.B - 1
            g = self.gain.get((R, n))
            fresh = g is not None and self.steps - self.gain_step[R, n] <= GAIN_STALE
            if fresh and whole:
                v = g * plain
            else:
                v = _best_n(scores, tokens, rows, self.D(n + others), c)[1]
                # one request drafting paid when last measured at this size, long ago: measure
                # it again now rather than trust the model's survival (read low: a one-client
                # server decoded target-only for whole requests after the other sizes' steps
                # had aged its gain)
                retest = retest or (n == 1 and whole and g is not None and not fresh and g > 1.0)
            if v > best:
                best_n, best = n, v
        if best_n > 0:
            self.probe_level = 0
            self._draft(able, best_n, R, plain)
            return
        if retest:
            self._draft(able[:1], 1, R, plain, probe=True)
            return
        self.plain_run += 1
        self.plain_s += tokens / max(plain, 1e-12)  # this plain step's estimated seconds
        probe_cost = self.D(1 + others) - self.D(others) + c[min(rows + 2, len(c)) - 1] - c[rows - 1]
        if self.probe_extra is not None:
            probe_cost = max(probe_cost, self.probe_extra)
        if self.plain_run > self.probe_every[self.probe_level] and self.plain_s * self.probe_share.get(R, PROBE_SHARE) >= probe_cost and \
                self._could_pay(tokens, rows, others, plain):
            # re-test: the request that drafted least recently, at least 2 drafts verified
            self.probe_level = min(self.probe_level + 1, len(self.probe_every) - 1)
            d, s = min(able, key=lambda ds: ds[1].last_drafted)
            self._draft([(d, s)], 1, R, plain, probe=True)

    def _could_pay(self, tokens: float, rows: int, others: int, plain: float) -> bool:
        """Whether one more request drafting, its drafts all accepted, would beat `plain` (the
        plain step's tokens a second, E(0)). (`_best_n` values N once the draft has run: its
        N = 0 carries the draft's cost, so it is not the comparison here.)"""
        return _best_n(np.ones(self.B - 1), tokens, rows, self.D(1 + others), self.costs.verify_s)[1] > plain

    def _alone_warm(self, ds: tuple, tokens: float, rows: int, others: int, plain: float) -> bool:
        """A request alone in the batch drafts its first `alone_warm_steps` steps there (where
        drafts always accepted could pay), whatever the one-request gain says: that gain was
        measured on the requests before it, and how well a draft predicts is a property of the
        prompt (one client, x8 pair, 1 thread: after two prompts the draft predicted badly, the
        next six requests ran target-only). Its steps then join that gain's sums (dropping the
        earlier requests' sums instead measured worse: a request's first blocks, on a short
        context, are its weakest)."""
        d, s = ds
        if s.alone_warm <= 0 or d.budget_kmax() < self.B - 1:
            return False
        if not self._could_pay(tokens, rows, others, plain):
            s.alone_warm = 0
            return False
        s.alone_warm -= 1
        return True

    def _draft(self, able: list, n: int, R: int, plain: float, probe: bool = False) -> None:
        """The first n of `able` draft this step (`probe`: a re-test, at least 2 drafts verified)."""
        for _, s in able[:n]:
            s.draft = True
        if probe:
            self._probe = able[0][1]
        self._key, self.plain_run, self.plain_s = (R, n, plain, self._plain_step_s), 0, 0.0

    # ---------------------------------------------------------------- after drafting
    def allot(self, decodings: list, props: list) -> None:
        """The drafting seats' k from this step's confidences: the N best (request, position)."""
        seats, pairs = [], []  # pairs: (-S, j, seat index)
        # another rule's request: Bv - 1 is its upper bound here (it decides in verify_ids)
        rows, tokens, _ = self._others(decodings, [d.Bv - 1 if p is not None else 0 for d, p in zip(decodings, props)])
        drafting = sum(p is not None for p in props)
        for d, p in zip(decodings, props):
            if p is None or not isinstance(d.width, _Seat):
                continue
            s, kmax = d.width, d.kmax
            s.buckets = self.est.buckets(proposal_confidence(p), kmax)
            S = np.cumprod([self.est.rate(j, int(s.buckets[j - 1])) for j in range(1, kmax + 1)])  # [kmax]
            # the server's average is the prior: one step's confidences (a first block that went
            # wrong) must not stop a request from drafting for the rest of its budget
            w = self.mean_weight if s.seen else 0.5
            s.mean_S[1:kmax + 1] += w * (S - s.mean_S[1:kmax + 1])
            self.mean_S[1:kmax + 1] += self.mean_weight * (S - self.mean_S[1:kmax + 1])
            s.seen, s.last_drafted = True, self.steps
            seats.append(s)
            pairs += [(-float(S[j - 1]), j, len(seats) - 1) for j in range(1, kmax + 1)]
        if not seats:
            return
        pairs.sort()
        c = self.costs.verify_s
        N, _ = _best_n(np.array([-p[0] for p in pairs]), tokens, min(rows, len(c)), self.D(drafting), c)
        for _, j, i in pairs[:N]:  # S falls with j, ties broken by j: a prefix of each request
            seats[i].k = max(seats[i].k, j)
        if self._probe is not None:
            self._probe.k = max(self._probe.k, min(2, self._probe.buckets.shape[0]))
