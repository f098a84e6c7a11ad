"""The server's batched verify-row budget (decode/batch_width.py), through models/batched.step_batch
as the engine runs it, on the embedded pair:

- greedy identity: every greedy request seated in the budget emits its target-only greedy
  tokens, under the measured cost table and under injected tables that make the rule choose
  plain batched steps (rows expensive) or the full width (rows free);
- the rule's choices: rows expensive -> N = 0 and no draft after the warm steps; rows free ->
  every drafted step verifies every draft the block and budget allow; a confident request's
  rows are admitted before an unconfident one's (the ranking);
- a seeded sampled request batched with seated greedy ones == its solo `generate --block-size
  auto` run (its own rule on the measured table), token for token.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba.decode.batch_width import BatchWidth
from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.decode.step import Decoding
from dflash2_numba.decode.width import AUTO, CostTable, costs_for
from test_batched import pair, run_batched  # noqa: F401  (pair: the embedded pair, a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REQUESTS = [  # (prompt, max_new, temperature, seed)
    ("The cat sat on", 40, 0.0, None),
    ("def fibonacci(n):", 48, 0.0, None),
    ("Once upon a time there was", 33, 0.8, 3),
    ("import numpy as np\n", 25, 0.0, None),
    ("class Foo:", 6, 0.0, None),
]
MAX_RUNNING = len(REQUESTS)


def injected(B: int, growth: float) -> CostTable:
    """verify seconds of r = 1..MAX_RUNNING x B rows: 1 ms x growth^(r-1) (drafting free)."""
    return CostTable(1e-3 * growth ** np.arange(MAX_RUNNING * B), 0.0, "injected")


def run(target, draft, rule, requests=REQUESTS):
    """The requests batched as the engine runs them (decode/step.Decoding, step_batch) with
    the budget `rule` -> (tokens per request, the Decodings)."""
    tok = target.tokenizer
    decs = [Decoding(target, draft, tok.encode(p), n, draft.block_size, SamplingParams(t, 0, 1.0, s), (),
                     width=rule.width_for(SamplingParams(t, 0, 1.0, s), target, draft)) for p, n, t, s in requests]
    return run_batched(target, draft, decs, rule), decs


def solo(target, draft, prompt, n, t, s):
    if t == 0.0:  # greedy: the target alone
        return dn.generate(target, None, prompt, max_new_tokens=n).output_ids
    return dn.generate(target, draft, prompt, max_new_tokens=n, temperature=t, seed=s, block_size=AUTO).output_ids


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
@pytest.mark.parametrize("costs", ["measured", "expensive", "free"])
def test_batched_auto_greedy_identity_and_seeded_solo(pair, kind, costs):
    target, drafts = pair
    draft = drafts[kind]
    B = draft.block_size
    table = {"measured": lambda: costs_for(target, draft, B, rows=MAX_RUNNING * B),
             "expensive": lambda: injected(B, 10.0), "free": lambda: injected(B, 1.0)}[costs]()
    fixed = costs != "measured"
    rule = BatchWidth(table, B, MAX_RUNNING, draft_costs=[table.draft_s] * MAX_RUNNING if fixed else None,
                      online=not fixed)
    # an injected table decides for greedy requests alone (a sampled one keeps its own rule on
    # the measured table, and its rows would change the batch's balance)
    requests = REQUESTS if costs == "measured" else [r for r in REQUESTS if r[2] == 0.0]
    got, decs = run(target, draft, rule, requests)
    assert got == [solo(target, draft, *r) for r in requests]
    greedy = [d for d, r in zip(decs, requests) if r[2] == 0.0]
    rows = [r for d in greedy for r in d.stats.block_rows]
    if costs == "expensive":  # plain batched steps only: the warm steps draft and verify no draft, then none
        assert rule.warm_left == 0 and rows == [1] * len(rows)
        assert all(d.stats.drafted_steps <= 3 for d in greedy)
    elif costs == "free":  # every drafted step verifies the whole block the budget allows
        for d in greedy:
            assert all(r == min(B, left) for r, left in zip(d.stats.block_rows, budget_left(d)))
    else:
        assert max(rows) > 1  # it did speculate
    if costs != "expensive":
        assert sum(d.stats.tau for d in greedy) / len(greedy) > 1.0  # drafts accepted


def budget_left(d) -> list[int]:
    """Per step of a finished Decoding: tokens left to generate before the step."""
    left, out = d.max_new - 1, []  # the prefill token first
    for a in d.stats.acceptance_lengths:
        out.append(left)
        left -= a
    return out


# ---------------------------------------------------------------- the ranking, on stand-ins
class Seated(SimpleNamespace):
    """What plan / allot read of a Decoding."""

    def budget_kmax(self):
        return self.kmax


def test_rows_go_to_the_confident_request_first():
    B = 8
    table = CostTable(0.010 + 0.002 * np.arange(1, 2 * B + 1), 0.0, "injected")  # 2 ms a row
    rule = BatchWidth(table, B, 2, draft_costs=[0.0, 0.0], warm_steps=0)
    sure, unsure = (Seated(kmax=B - 1, Bv=B, draft=True, width=rule.seat()) for _ in range(2))
    for _ in range(30):  # teach the estimator: confident drafts survive, unconfident ones die at once
        sure.width.buckets = rule.est.buckets(np.full(B - 1, 0.99), B - 1)
        sure.width.observe(B - 1, B - 1, True, None, 0.0)
        unsure.width.buckets = rule.est.buckets(np.full(B - 1, 0.05), B - 1)
        unsure.width.observe(B - 1, 0, True, None, 0.0)
    props = [SimpleNamespace(confidence=np.full(B - 1, 0.05), q=None),
             SimpleNamespace(confidence=np.full(B - 1, 0.99), q=None)]
    rule.allot([unsure, sure], props)
    assert sure.width.k == B - 1 and unsure.width.k == 0
