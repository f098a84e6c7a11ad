"""One request's speculative decode state and its per-step logic (spec §5), shared by
`stream_generate` (one request at a time, decode/loop.py) and the server's engine (many
requests whose draft and verify forwards are batched: serve/engine.py, models/batched.py).

    dec = Decoding(target, draft, prompt_ids, max_new, Q, sampling, stop_ids)
    first = None
    while first is None:
        first = dec.prefill_step()          # one chunk of <= PREFILL_CHUNK prompt tokens
    while not dec.finished:
        call = dec.begin_step()             # Bv -> the draft work (DraftCall) | None
        prop = run_draft(draft, call)       # context update + propose (batched in the engine)
        block = dec.verify_ids(prop)        # [Bv] anchor + drafts
        logits, taps = target.forward(block, dec.cache, dec.tap_layers)   # (batched too)
        step = dec.accept(logits, taps)     # StepResult

Everything a request owns lives here (caches, draft context, committed ids, its own RNG, stop
set, detokeniser, statistics), so nothing leaks from one request into the next and a request
draws its random numbers in the same order whatever else runs.

Prefill runs in chunks of PREFILL_CHUNK tokens, solo and in the server alike: a long prompt
does not stall the other requests of a server, and both paths compute the same bits (each
chunk is one `target.forward` of that request alone; a prompt up to PREFILL_CHUNK tokens is
the single forward it always was).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numba
import numpy as np

from ..errors import GenerationArgumentError, NonFiniteLogitsError
from .drafter import valid_vocab
from .logprobs import TokenLogprob, token_logprobs
from .sampling import SamplingParams, greedy_token, mask_padded, sample_token, target_probs, verify_block
from .stats import DecodeStats

PREFILL_CHUNK = 512  # prompt tokens per prefill forward


@dataclass
class StepResult:
    token_ids: list[int]  # tokens committed this step (after stop truncation)
    text: str  # UTF-8-safe text delta (may be "" while a character is incomplete)
    accepted: int  # drafts accepted this step (0 for the prefill token and autoregressive steps)
    finish_reason: str | None  # None while running, then "stop" | "length"
    stats: DecodeStats = field(repr=False, default=None)  # live statistics of this request
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for (decode/logprobs.py)


@dataclass
class DraftCall:
    """This request's draft work of one step (decode/drafter.py): `draft.extend_context(state,
    *context)` (the committed tokens not yet in the draft context), then `draft.propose(*args)`."""
    state: object
    context: tuple  # (taps [n, T*H] | None, start_pos, token_ids [n])
    anchor_id: int
    anchor_pos: int
    n_rows: int
    sampling: SamplingParams
    rng: np.random.Generator

    @property
    def args(self) -> tuple:
        return self.state, self.anchor_id, self.anchor_pos, self.n_rows, self.sampling, self.rng


def run_draft(draft, call: DraftCall | None):
    """One request's draft work (None when the step verifies the anchor alone) -> Proposal | None."""
    if call is None:
        return None
    draft.extend_context(call.state, *call.context)
    return draft.propose(*call.args)


def check_finite(logits: np.ndarray, what: str, first_position: int) -> None:
    """A NaN / Inf logits row (NaN / Inf weights, a zero norm without eps, an overflow) would be
    masked to -inf and decode as token 0: refuse it at the step where it appears."""
    finite = np.isfinite(logits).all(axis=-1)  # [rows]
    if not finite.all():
        i = int(np.argmin(finite))
        row = logits[i]
        raise NonFiniteLogitsError(
            f"{what}: logits row {i} (position {first_position + i}) holds {int(np.isnan(row).sum())} NaN and "
            f"{int(np.isinf(row).sum())} Inf of {row.shape[-1]} values: the model computed garbage "
            "(NaN / Inf weights or an overflow); nothing is emitted from it")


def pick_token(row: np.ndarray, sampling: SamplingParams, rng) -> int:
    """Next token from one masked logits row [V] (the prefill token / a plain AR step)."""
    if sampling.greedy:
        return greedy_token(row)
    return sample_token(target_probs(row, sampling), rng)


def tokenizer_of(target):
    tok = getattr(target, "tokenizer", None)
    if tok is None and getattr(target, "model_dir", None) is not None:
        from ..tokenizer import Tokenizer  # lazy: targets built without a directory have none
        tok = Tokenizer.from_dir(target.model_dir)
        target.tokenizer = tok
    return tok


def check_draft_window(draft, n) -> int:
    """`draft_window` N >= 0 (0 = the whole context) -> int; refused for a drafter that cannot
    limit its context attention (the oracle, a model-free drafter)."""
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise GenerationArgumentError(f"draft_window must be an integer >= 0 (0 = the whole context), got {n!r}")
    if n and draft is not None and not getattr(draft, "supports_draft_window", False):
        raise GenerationArgumentError(f"draft_window {n}: the {type(draft).__name__} drafter has no context "
                                      "attention to limit")
    return int(n)


class Decoding:
    """The decode state of one request. `text=False` skips detokenising (the server decodes
    token by token itself, to find where a stop string ends).

    `logprobs` = N (0..): every StepResult carries the target's log-probability of each token it
    commits and the top N alternatives (decode/logprobs.py); `prompt_logprobs`: the prefill
    keeps every prompt row's logits and scores the prompt too (`self.prompt_lps`, the first
    token's logprob None). `max_new = 0` scores the prompt and generates nothing."""

    def __init__(self, target, draft, prompt_ids: list[int], max_new: int, Q: int,
                 sampling: SamplingParams, stop_token_ids, text: bool = True,
                 logprobs: int | None = None, prompt_logprobs: bool = False, width=None, draft_window: int = 0):
        tok = tokenizer_of(target)
        if tok is not None:
            self.stops = set(tok.stop_ids(stop_token_ids))
        else:
            eos = getattr(getattr(target, "config", None), "eos_token_id", []) or []
            self.stops = {int(i) for i in stop_token_ids} | set(eos)
        self.target, self.draft, self.Q, self.sampling = target, draft, int(Q), sampling
        self.vv = valid_vocab(target)
        self.decoder = tok.stream_decoder() if tok is not None and text else None
        self.rng = sampling.rng()
        self.n = len(prompt_ids)
        self.max_new = int(max_new)
        self.max_len = self.n + self.max_new
        self.tap_layers = tuple(draft.target_layer_ids) if draft is not None else ()
        # the verify width rule (decode/width.py; None: every step verifies min(Q, budget) rows)
        self.width = width if draft is not None else None
        self.stats = DecodeStats(block_size=self.Q, prompt_tokens=self.n, threads=numba.get_num_threads(),
                                 width="fixed" if self.width is None else getattr(self.width, "name", "custom"),
                                 draft_window=check_draft_window(draft, draft_window))
        self.ids = list(prompt_ids)  # prompt + committed tokens
        self.finish_reason: str | None = None
        self.cache = None  # target cache, made at the first prefill chunk
        self.prefilled = 0  # prompt tokens in the target cache
        self.dstate = None  # draft context state
        # committed tokens not yet in the draft context, from ctx_start on: the prefill's tap rows
        # ([n, T*H] pieces) and then the decode steps' rows, copied into one buffer that every
        # step reuses (`_keep_rows`); joined once when the draft next runs
        self.ctx_taps, self.ctx_start = [], 0
        self._rows, self._rows_n = None, 0  # [capacity, T*H] f32, rows held
        self.start = self.n  # anchor position
        self.Bv = 0  # rows verified by the step in progress
        self.kmax = 0  # drafts the step in progress could verify (block and budget)
        self._drafted = False  # the step in progress ran the draft
        self._Qd = self.Q  # its draft block (the width rule may choose a smaller one)
        self.retired = False  # the width rule will not draft again in this request (`_draft_this_step`)
        self._ctx_n = 0  # context tokens it fed to the draft
        self._drafts, self._q, self._t0 = np.zeros(0, np.int64), None, 0.0
        self.logprobs = logprobs  # top N per token, None: not computed
        self.prompt_logprobs = bool(prompt_logprobs)
        self.prompt_lps: list[TokenLogprob] = []  # prompt positions, filled by the prefill

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_left(self) -> int:
        return self.n - self.prefilled

    # ---------------------------------------------------------------- prefill
    def prefill_step(self, max_tokens: int = PREFILL_CHUNK) -> StepResult | None:
        """Run the next chunk of the prompt; the StepResult of the first token once the whole
        prompt is in the cache, else None."""
        t0 = time.perf_counter()
        if self.cache is None:
            self.cache = self.target.new_cache(self.max_len)
        a = self.prefilled
        b = min(self.n, a + min(int(max_tokens), PREFILL_CHUNK))
        score = self.prompt_logprobs
        logits, taps = self.target.forward(np.asarray(self.ids[a:b], np.int64), self.cache,
                                           tap_layers=self.tap_layers, last_only=not score)  # [1 | b-a, V]
        if taps is not None:
            self.ctx_taps.append(taps)
        self.prefilled = b
        if score:  # row i is the distribution of the token at position a+i+1
            check_finite(logits, "prefill", a)
            if a == 0:
                self.prompt_lps.append(TokenLogprob(self.ids[0], None))
            k = min(b - a, self.n - 1 - a)
            self.prompt_lps += token_logprobs(logits[:k], self.ids[a + 1:a + 1 + k], self._top_n, self.vv)
        if b < self.n:
            self.stats.prefill_s += time.perf_counter() - t0
            return None
        if self.max_new == 0:  # scoring only
            self.stats.prefill_s += time.perf_counter() - t0
            self.finish_reason = "length"
            return StepResult([], "", 0, "length", self.stats, [] if self.logprobs is not None else None)
        check_finite(logits[-1:], "prefill", self.n - 1)
        first = pick_token(mask_padded(logits[-1], self.vv), self.sampling, self.rng)
        self.stats.prefill_s += time.perf_counter() - t0
        step = self._commit([first], 0)
        self._score(step, logits[-1:])
        if not step.finish_reason and self.draft is not None:
            self.dstate = self.draft.new_state(self.max_len)
            if self.stats.draft_window:
                self.dstate.draft_window = self.stats.draft_window  # read by the draft's block_forward
        return step

    @property
    def _top_n(self) -> int:
        return self.logprobs or 0

    def _score(self, step: StepResult, rows: np.ndarray) -> None:
        """The committed tokens' logprobs: rows[j] [V] is the target's distribution of token j."""
        if self.logprobs is not None:
            step.logprobs = token_logprobs(rows[:len(step.token_ids)], step.token_ids, self._top_n, self.vv)

    # ---------------------------------------------------------------- one verify step
    def budget_kmax(self) -> int:
        """Drafts the next step could verify: the block and the token budget (before begin_step)."""
        return min(self.Q, self.max_len - 1 - self.start) - 1

    def begin_step(self) -> DraftCall | None:
        """Start a step: Bv = rows to verify; when a draft runs (Bv >= 2), the draft work to do:
        the context update and the proposal (the draft runs the runtime Q rows, or the smaller
        block a width rule chose: its block is non-causal, so its length changes every row; the
        budget only trims the verify). With a width rule, the rule may decide on a plain target
        step (Bv = 1, no draft): the committed tokens' taps then wait (ctx_taps, the row buffer)
        and reach the draft context at the next drafted step, so speculation resumes on a
        complete context."""
        assert self.cache.length == self.start and len(self.ids) == self.start + 1, (
            self.cache.length, self.start, len(self.ids))
        self.Bv = self.budget_kmax() + 1  # remaining budget
        self.kmax, self._drafted = self.Bv - 1, False
        self._drafts, self._q = np.zeros(0, np.int64), None
        self._t0 = time.perf_counter()
        if self.Bv < 2:
            return None
        if self.width is not None and not self._draft_this_step():
            self.Bv = 1  # a plain target step
            return None
        self._drafted = True
        # the draft's runtime block this step: Q, or a smaller one the width rule chose (its
        # cheaper proposal over fewer drafts, decode/width.py), which caps the drafts verified
        self._Qd = rows = min(self.Q, getattr(self.width, "rows", self.Q) or self.Q)
        self.kmax = min(self.kmax, rows - 1)
        # (the buffer's rows go as a view: the draft reads them before this request's next accept)
        parts = self.ctx_taps + ([self._rows[:self._rows_n]] if self._rows_n else [])
        taps = None if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)  # [n, T*H]
        context = (taps, self.ctx_start, np.asarray(self.ids[self.ctx_start:self.start], np.int64))
        self._ctx_n = self.start - self.ctx_start  # committed tokens this step feeds to the draft
        self.ctx_taps, self._rows_n, self.ctx_start = [], 0, self.start
        return DraftCall(self.dstate, context, self.ids[self.start], self.start, rows, self.sampling, self.rng)

    def _draft_this_step(self) -> bool:
        """The width rule's verdict: a run of plain steps it has already decided (`plain_left`)
        is counted down here, without calling it."""
        if self.retired:
            return False
        w = self.width
        left = getattr(w, "plain_left", 0)
        if left > 0:
            w.plain_left = left - 1
            return False
        if not self._catch_up_pays():
            return False
        if w.draft_now(self.kmax):
            return True
        retires = getattr(w, "retires", None)  # (asked right after the rule's plain verdict)
        if retires is not None and retires(self.max_len - 1 - self.start):
            # no re-test before the budget ends and drafting does not pay now: the rest of this
            # request is plain steps, so the draft's context (the taps every forward copies for
            # it, its state) is of no use any more: the steps become target-only ones
            self.retired, self.tap_layers, self.dstate = True, (), None
            self.ctx_taps, self._rows, self._rows_n = [], None, 0
        return False

    def _catch_up_pays(self) -> bool:
        """The width rule's verdict on the draft's context backlog (rows start - ctx_start: the
        prompt before the first draft) against the tokens left in the budget."""
        pays = getattr(self.width, "catch_up_pays", None)
        return pays is None or pays(self.start - self.ctx_start, self.max_len - 1 - self.start, self.kmax)

    def verify_ids(self, prop) -> np.ndarray:
        """The verify block [Bv]: anchor + the proposal's drafts trimmed to the budget."""
        Q, Bv = self._Qd, self.Bv
        if prop is not None:
            drafts, q = np.asarray(prop.draft_ids, np.int64), prop.q  # [Q-1, V] | None
            if drafts.shape != (Q - 1,):
                raise RuntimeError(f"{type(self.draft).__name__}.propose returned {drafts.shape[0]} drafts "
                                   f"for a {Q}-row block (expected {Q - 1})")
            if self.width is not None:  # k drafts to verify, from the draft's distributions (decode/width.py)
                Bv = self.Bv = 1 + self.width.choose(prop, self.kmax)
            self._drafts = drafts[:Bv - 1]  # [Bv-1]
            self._q = None if q is None else q[:Bv - 1]  # [Bv-1, V]
            if self._q is not None:
                check_finite(self._q, f"step {self.stats.steps + 1}: draft proposal distribution", self.start + 1)
        self._t1 = time.perf_counter()
        return np.concatenate([[self.ids[self.start]], self._drafts]).astype(np.int64)  # [Bv]

    def accept(self, logits: np.ndarray, taps: np.ndarray | None) -> StepResult:
        """Verify logits [Bv, V] (and taps [Bv, T*H]) of the block -> the committed tokens."""
        start = self.start
        check_finite(logits, f"step {self.stats.steps + 1}: verify", start)
        a, x = verify_block(mask_padded(logits, self.vv), self._drafts, self._q, self.sampling, self.rng)
        self.cache.commit(start + a + 1)  # keep the anchor and the a accepted drafts (any layer kind)
        if self.draft is not None and taps is not None and not self.retired:  # [a+1, T*H], positions start..start+a
            self._keep_rows(taps, a + 1)
        t2 = time.perf_counter()
        self.stats.draft_s += self._t1 - self._t0
        self.stats.verify_s += t2 - self._t1
        self.stats.record_step(self.Bv, a, self._drafted)
        # a draft step that fed more than a block of context (the prompt's) is not a typical step
        catch_up = self._drafted and self._ctx_n > self.Q
        if catch_up:
            self.stats.catch_up_steps += 1
            self.stats.catch_up_draft_s += self._t1 - self._t0
        if self.width is not None and not self.retired:  # (the rules read draft_s on drafted steps only)
            self.width.observe(self.Bv - 1, a, self._drafted, self._typical_draft_s(catch_up), t2 - self._t1)
        step = self._commit([int(d) for d in self._drafts[:a]] + [x], a)
        self._score(step, logits)  # row j: the distribution of the j-th committed token
        self.stats.decode_s += time.perf_counter() - self._t0
        self.start += a + 1
        return step

    def _keep_rows(self, taps: np.ndarray, n: int) -> None:
        """Copy a step's first n tap rows into the reused buffer (doubling it when full). Kept
        as the forward's own arrays instead, a plain run's rows piled up in fresh memory, a
        new page every step or two."""
        held, buf = self._rows_n, self._rows
        if buf is None or held + n > buf.shape[0]:
            grown = np.empty((max(64, 2 * (held + n)), taps.shape[1]), np.float32)  # [capacity, T*H]
            if held:
                grown[:held] = buf[:held]
            self._rows = buf = grown
        buf[held:held + n] = taps[:n]
        self._rows_n = held + n

    def _typical_draft_s(self, catch_up: bool) -> float | None:
        """The draft seconds of this step as a typical drafted step's: a catch-up step's feed of
        the rows past one block (the prompt, or a plain run's tokens: the price of the plain run)
        taken out at the table's per-row price. Its propose after a plain run, slower while the
        draft's weights come back into the caches, stays in: that is what resuming costs. None
        where the price per row is unknown."""
        seconds = self._t1 - self._t0
        if not catch_up:
            return seconds
        costs = getattr(self.width, "costs", None)
        return None if costs is None else costs.without_backlog(seconds, self._ctx_n - self.Q)

    # ---------------------------------------------------------------- committing
    def _commit(self, new: list[int], accepted: int) -> StepResult:
        """Append new tokens, truncating inclusively at the first stop id / the budget."""
        reason = None
        for j, t in enumerate(new):
            if t in self.stops:
                new, reason = new[:j + 1], "stop"
                break
        assert len(self.ids) - self.n + len(new) <= self.max_new, "the loop emitted past max_new_tokens"
        self.ids.extend(new)
        if reason is None and len(self.ids) - self.n == self.max_new:
            reason = "length"
        self.stats.new_tokens = len(self.ids) - self.n
        kv = getattr(self.cache, "kv", self.cache)  # a hybrid target's attention layers hold a KVCache
        if hasattr(kv, "bytes_at"):
            self.stats.kv_cache_bytes = kv.bytes_at(len(self.ids))
            self.stats.kv_dtype = "bf16" if kv.dtype == np.uint16 else "f32"
        text = ""
        if self.decoder is not None:
            text = self.decoder.feed(new) + (self.decoder.flush() if reason else "")
        self.finish_reason = reason
        return StepResult(list(new), text, accepted, reason, self.stats)
