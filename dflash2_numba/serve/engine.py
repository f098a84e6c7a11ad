"""The serving engine: ONE thread owns the models and every request's state, and runs the
scheduler. HTTP handlers (serve/app.py) never run a kernel: they `submit` a Job and read the
events the engine hands to the job's `sink` (thread-safe).

Each engine step (continuous batching of speculative steps):
1. drop requests whose client went away (`cancel`), end everything past a shutdown deadline;
2. admit waiting requests while fewer than `max_running` run;
3. prefill: whole PREFILL_CHUNK-token chunks (decode/step.py) of the new requests, oldest
   first, up to PREFILL_CHUNK tokens per step in all, so a long prompt does not stall the rest;
4. ONE draft forward over every running request's block and ONE target verify over all their
   rows (models/batched.step_batch); each request accepts with its own RNG, keeps its own Q and
   budget edge (decode/step.Decoding: the same per-step code `stream_generate` runs). With
   block_size "auto" (the default) the greedy requests share ONE budget of verify rows
   (decode/batch_width.py: who drafts, how many rows, or a plain batched step); a sampled
   request keeps its own one-request rule on the measured cost table;
5. detokenise token by token, match stop strings (serve/stops.py), emit text, retire the
   finished.

A request's output does not depend on what else runs: greedy, token for token its solo
`generate` (any width gives the target's argmax chain); seeded sampling, token for token its
solo run with that seed and block size (models/batched.py; "auto": the solo rule on the
measured table, decode/width.py).

Events a sink receives (dicts): with echo first {"type": "prompt", "text", "logprobs"}; then
{"type": "text", "text", "reasoning", "logprobs"} (reasoning: chat text a thinking format marks
as such, serve/reasoning.py; logprobs: a list of `LogprobEntry` when the request asked for them,
else None), then one of {"type": "done", "finish_reason", "usage", "timings"} or
{"type": "error", "message", "code"}.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ..decode.batch_width import BatchWidth
from ..decode.loop import check_context, check_draft_window, runtime_block_size
from ..decode.width import AUTO, costs_for, parse_block_size
from ..decode.sampling import SamplingParams
from ..decode.step import PREFILL_CHUNK, Decoding
from ..errors import DFlashError, GenerationArgumentError, SelectorRefusedError
from ..models.batched import batches_draft, batches_target, step_batch
from .logprobs import entries
from .metrics import Metrics
from .reasoning import ReplySplit, reasoning_parser
from .protocol import DEFAULT_MAX_TOKENS, BadRequest, GenRequest, QueueFull, Unavailable, as_request_error
from .stops import StopStrings

LOADING, READY, DRAINING, STOPPED, FAILED = "loading", "ready", "draining", "stopped", "failed"


@dataclass
class Job:
    req: GenRequest
    sink: Callable[[dict], None]  # called from the engine thread; must be thread-safe
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: float = field(default_factory=time.time)
    cancelled: bool = False  # set by the HTTP side (client gone); read by the engine
    # engine-side state
    dec: Decoding | None = None
    split: ReplySplit | None = None  # detokeniser (+ reasoning parser of a chat request)
    stops: StopStrings | None = None
    n_out: int = 0  # completion tokens (through the token that completed a stop string)
    chars: int = 0  # characters decoded so far (echoed prompt included): the next token's text_offset
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None


class Engine:
    """`load()` -> (target, draft | None), called on the engine thread (so /health answers 503
    while it runs). `block_size`: the server's default ("auto": the batch's verify-row budget;
    an integer Q or None (the draft's B): a fixed width, the behaviour before "auto"); a
    request's `block_size` overrides it."""

    BUDGET_MAX_ROWS = 128  # the batch cost table's rows at most (max_running x B beyond: clipped)

    def __init__(self, load: Callable[[], tuple], *, max_running: int = 4, max_waiting: int = 16,
                 block_size: int | str | None = AUTO, warm: bool = True,
                 on_fatal: Callable[[], None] = lambda: None, draft_window: int = 0):
        if max_running < 1 or max_waiting < 0:
            raise GenerationArgumentError(
                f"--max-running must be >= 1 and --max-waiting >= 0, got {max_running}, {max_waiting}")
        self._load, self.warm, self.on_fatal = load, warm, on_fatal
        self.max_running, self.max_waiting, self.block_size = int(max_running), int(max_waiting), block_size
        self.draft_window = check_draft_window(None, draft_window)  # the default of requests without one
        self.state, self.load_error = LOADING, None
        self.target = self.draft = None
        self.budget: BatchWidth | None = None  # the greedy "auto" requests' verify-row budget
        self.reasoning = None  # the target tokenizer's thinking format (serve/reasoning.py)
        self.metrics = Metrics()
        self.cond = threading.Condition()
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.deadline: float | None = None  # shutdown: running requests end with an error past it
        self.thread = threading.Thread(target=self._main, name="dflash2-engine", daemon=True)

    # ---------------------------------------------------------------- HTTP side (any thread)
    def start(self) -> "Engine":
        self.thread.start()
        return self

    @property
    def ready(self) -> bool:
        return self.state == READY

    def check(self, req: GenRequest) -> GenRequest:
        """Fill in the default budget and refuse, before queueing, what can never run: a
        block_size outside 2..B, a prompt + max_tokens past the target's positions."""
        limit = getattr(self.target.config, "max_position_embeddings", None)
        if req.max_tokens is None:
            room = DEFAULT_MAX_TOKENS if limit is None else limit - len(req.prompt_ids)
            req.max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
        try:
            check_context(self.target, len(req.prompt_ids), req.max_tokens)
            if self.draft is not None:
                runtime_block_size(self.draft, req.block_size if req.block_size is not None else self.block_size)
            check_draft_window(self.draft, self._draft_window(req))
        except DFlashError as e:
            err = as_request_error(e)
            for param in ("block_size", "draft_window"):
                if param in str(e):
                    err.param = param
            raise err from None
        return req

    def submit(self, job: Job) -> None:
        """Queue a checked request, or raise QueueFull (429) / Unavailable (503)."""
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue the prompts of one request together (all or none), or raise QueueFull (429) /
        Unavailable (503)."""
        with self.cond:
            if len(jobs) > self.max_running + self.max_waiting:  # would never fit: not worth a retry
                for _ in jobs:
                    self.metrics.reject("invalid")
                raise BadRequest(f"{len(jobs)} prompts in one request; this server holds at most "
                                 f"{self.max_running + self.max_waiting} (--max-running + --max-waiting)",
                                 param="prompt", code="too_many_prompts")
            if self.state != READY:
                reason = "not_ready" if self.state == LOADING else "draining"
                for _ in jobs:
                    self.metrics.reject(reason)
                raise Unavailable(f"the server is {self.state}; try again later", code=reason)
            if len(self.waiting) + len(self.running) + len(jobs) > self.max_running + self.max_waiting:
                for _ in jobs:
                    self.metrics.reject("queue_full")
                raise QueueFull(f"{len(self.running)} requests running and {len(self.waiting)} waiting; "
                                f"{len(jobs)} more do not fit (--max-running {self.max_running}, "
                                f"--max-waiting {self.max_waiting})", code="queue_full")
            self.waiting.extend(jobs)
            self.metrics.add("requests_total", len(jobs))
            self._gauges()
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the engine frees the request's slot at its next step."""
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def drain(self, grace_s: float) -> None:
        """SIGTERM: admit nothing new (503); requests already accepted run on until `grace_s`
        from now, then end with an error event."""
        with self.cond:
            if self.state in (READY, LOADING):
                self.state = DRAINING
            self.deadline = time.monotonic() + grace_s
            self.cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cond:
            if self.state != FAILED:
                self.state = STOPPED
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def record_rejected(self, reason: str) -> None:
        """A request refused before it reached `submit` (a 400 / 404), for the counters."""
        self.metrics.reject(reason)

    # ---------------------------------------------------------------- engine thread
    def _main(self) -> None:
        try:
            self.target, self.draft = self._load()
            self.reasoning = reasoning_parser(self.target.tokenizer) if self.target.tokenizer is not None else None
            if self.draft is not None and getattr(self.draft, "refusal_reason", None):
                raise SelectorRefusedError(self.draft.refusal_reason)
            if self.warm:
                self._warm_up()
        except DFlashError as e:
            self.load_error, self.state = e, FAILED
            self.on_fatal()
            return
        except Exception as e:  # a bug: say so in one line, then stop the server
            self.load_error, self.state = e, FAILED
            traceback.print_exc()
            self.on_fatal()
            return
        with self.cond:
            if self.state == LOADING:
                self.state = READY
        print(f"ready: {self.describe()}; --max-running {self.max_running}, --max-waiting {self.max_waiting}",
              file=sys.stderr, flush=True)
        self._loop()

    def _warm_up(self) -> None:
        """Compile the kernels a batched step runs (the solo warm-up, then a two-request batch)."""
        from ..decode.warmup import warm_up

        auto = self.draft is not None and parse_block_size(self.block_size) == AUTO
        Q = self.draft.block_size if auto or (self.draft is not None and self.block_size is None) else self.block_size
        warm_up(self.target, self.draft, block_size=AUTO if auto else Q)  # "auto": the cost table too
        ids = [i % max(1, self.target.valid_vocab) for i in range(1, 9)]
        decs = [self._decoding(GenRequest("completion", "", ids, 6, SamplingParams(0.0), block_size=Q)) for _ in range(2)]
        for d in decs:
            while d.prefill_step() is None:
                pass
        while not all(d.finished for d in decs):
            step_batch(self.target, self.draft, [d for d in decs if not d.finished])
        if auto:
            self._budget()  # the batch cost table: a sweep of up to max_running x B rows (cached)

    def describe(self) -> str:
        """What batches here (printed at start): the draft forward and the verify forward."""
        t = "batched" if batches_target(self.target) else "per request (this target family does not batch)"
        d = "none" if self.draft is None else ("batched" if batches_draft(self.draft) else "per request")
        return f"verify forward: {t}; draft forward: {d}"

    def _budget(self) -> BatchWidth:
        if self.budget is None:
            B = int(self.draft.block_size)
            rows = min(self.max_running * B, max(B, self.BUDGET_MAX_ROWS))
            self.budget = BatchWidth(costs_for(self.target, self.draft, B, rows=rows), B, self.max_running)
        return self.budget

    def _width(self, req: GenRequest):
        """The request's width rule: None (fixed Q); "auto": a seat in the batch's budget
        (greedy), else the one-request rule on the measured table, no online refresh (its draws
        then depend on its seed and the table only: its solo run's)."""
        given = req.block_size if req.block_size is not None else self.block_size
        if self.draft is None or parse_block_size(given) != AUTO:
            return None
        return self._budget().width_for(req.sampling, self.target, self.draft)

    def _decoding(self, req: GenRequest) -> Decoding:
        Q = 1 if self.draft is None else runtime_block_size(
            self.draft, req.block_size if req.block_size is not None else self.block_size)
        return Decoding(self.target, self.draft, req.prompt_ids, req.max_tokens, Q, req.sampling, (), text=False,
                        logprobs=req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None,
                        width=self._width(req), draft_window=self._draft_window(req))

    def _draft_window(self, req: GenRequest) -> int:
        return self.draft_window if req.draft_window is None else req.draft_window

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.waiting or self.running) and self.state != STOPPED:
                    self.cond.wait(0.5)
                if self.state == STOPPED:
                    for job in self.waiting + self.running:
                        self._end_error(job, "the server stopped", "shutdown")
                    self.waiting, self.running = [], []
                    self._gauges()
                    return
                self._drop_cancelled()
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    for job in self.waiting + self.running:
                        self._end_error(job, "the server is shutting down (grace period over)", "shutdown")
                    self.waiting, self.running = [], []
                while self.waiting and len(self.running) < self.max_running:
                    self.running.append(self.waiting.pop(0))
                self._gauges()
                batch = list(self.running)
            if batch:
                self._step(batch)

    def _drop_cancelled(self) -> None:
        for jobs in (self.waiting, self.running):
            for job in [j for j in jobs if j.cancelled]:
                jobs.remove(job)
                self.metrics.add("requests_cancelled_total")

    def _step(self, batch: list[Job]) -> None:
        budget = PREFILL_CHUNK
        for job in batch:  # admission order: the oldest prompt first
            if job.dec is not None and job.dec.prefill_left == 0:
                continue
            if budget <= 0:
                break
            try:
                if job.dec is None:
                    job.dec = self._decoding(job.req)
                    parser = self.reasoning if job.req.kind == "chat" else None
                    job.split = ReplySplit(self.target.tokenizer, parser, job.req.prompt_ids)
                    job.stops = StopStrings(job.req.stop)
                before = job.dec.prefilled
                first = job.dec.prefill_step()
                budget -= job.dec.prefilled - before
                if first is not None:
                    if job.req.echo:
                        self._echo(job)
                    self._emit(job, first)
            except Exception as e:  # a refusal (NonFiniteLogitsError, ...) or a bug: end this request
                if not isinstance(e, DFlashError):
                    traceback.print_exc(file=sys.stderr)
                self._retire_error(job, f"{type(e).__name__}: {e}", "refused")
        live = [j for j in batch if j.dec is not None and j.dec.prefill_left == 0 and not j.dec.finished
                and j in self.running]
        if not live:
            return
        if self.budget is not None:  # requests about to join this batch: prefilling, or queued with room
            self.budget.joining = len(self.running) - len(live) + \
                min(len(self.waiting), self.max_running - len(self.running))
        try:
            steps = step_batch(self.target, self.draft, [j.dec for j in live], self.budget)
        except Exception as e:  # a refusal (NonFiniteLogitsError, ...) or a bug: end this step's requests
            if not isinstance(e, DFlashError):
                traceback.print_exc(file=sys.stderr)
            for job in live:
                self._retire_error(job, f"{type(e).__name__}: {e}", "engine_error")
            return
        self.metrics.add("engine_steps_total")
        if len(live) > 1:
            self.metrics.add("engine_batched_steps_total")
        rows = sum(j.dec.Bv for j in live)  # verify rows of this step
        self.metrics.add("engine_step_rows_total", rows)
        with self.metrics.lock:
            self.metrics.step_rows.observe(rows)
        for job, step in zip(live, steps):
            self._emit(job, step)

    # ---------------------------------------------------------------- output
    def _echo(self, job: Job) -> None:
        """echo: the prompt's text (and its logprobs) before anything generated."""
        tok, ids = self.target.tokenizer, job.req.prompt_ids
        dec, pieces = tok.stream_decoder(), []
        for t in ids:
            pieces.append(dec.feed([t]))
        pieces[-1] += dec.flush()
        lps = entries(tok, job.dec.prompt_lps, pieces, 0) if job.req.logprobs is not None else None
        text = "".join(pieces)
        job.chars = len(text)
        job.sink({"type": "prompt", "text": text, "logprobs": lps})

    def _emit(self, job: Job, step) -> None:
        """Detokenise the step's tokens one at a time through the reasoning parser (chat) and
        the stop-string matcher; send the safe text (and the tokens' logprobs); retire the
        request when it finished (stop id, budget, stop string)."""
        if job.t_first is None:
            job.t_first = time.perf_counter()
            with self.metrics.lock:
                self.metrics.ttft.observe(job.t_first - job.t_submit)
        parts, reasoning, pieces, finish = [], [], [], step.finish_reason
        for j, t in enumerate(step.token_ids):
            job.n_out += 1
            last = j == len(step.token_ids) - 1
            piece, r, content = job.split.feed(t, stop_id=finish == "stop" and last, last=finish is not None and last)
            pieces.append(piece)
            reasoning.append(r)
            parts.append(job.stops.feed(content))
            if job.stops.hit:
                break
        if job.stops.hit:
            finish = "stop"
        elif finish is not None:
            parts.append(job.stops.flush())
        lps = None
        if step.logprobs is not None:
            lps = entries(self.target.tokenizer, step.logprobs[:len(pieces)], pieces, job.chars)
        job.chars += sum(len(p) for p in pieces)
        text, reasoning = "".join(parts), "".join(reasoning)
        if text or reasoning or lps:
            job.sink({"type": "text", "text": text, "reasoning": reasoning, "logprobs": lps})
        if finish is not None:
            self._retire(job, finish)

    def _retire(self, job: Job, finish: str) -> None:
        stats = job.dec.stats
        drafts = [r - 1 for r in stats.block_rows if r > 1]
        accepted = [a - 1 for a, r in zip(stats.acceptance_lengths, stats.block_rows) if r > 1]
        with self.cond:
            if job in self.running:
                self.running.remove(job)
            self._gauges()
        with self.metrics.lock:
            m = self.metrics
            m.success[finish] += 1
            m.counters["prompt_tokens_total"] += stats.prompt_tokens
            m.counters["generation_tokens_total"] += job.n_out
            m.counters["spec_decode_num_drafts_total"] += len(drafts)
            m.counters["spec_decode_num_draft_tokens_total"] += sum(drafts)
            m.counters["spec_decode_num_accepted_tokens_total"] += sum(accepted)
            for a in accepted:
                for pos in range(a):
                    m.accepted_per_pos[pos] += 1
        now = time.perf_counter()
        predicted_s = now - (job.t_first or now)
        usage = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": job.n_out,
                 "total_tokens": stats.prompt_tokens + job.n_out}
        timings = {"prompt_n": stats.prompt_tokens, "prompt_ms": 1000 * stats.prefill_s,
                   "predicted_n": job.n_out, "predicted_ms": 1000 * predicted_s,
                   "predicted_per_second": (job.n_out - 1) / predicted_s if predicted_s > 0 and job.n_out > 1 else None,
                   "ttft_ms": 1000 * ((job.t_first or now) - job.t_submit),
                   "draft_n": sum(drafts), "draft_n_accepted": sum(accepted), "steps": stats.steps,
                   "tau": stats.tau, "block_size": stats.block_size}
        job.sink({"type": "done", "finish_reason": finish, "usage": usage, "timings": timings})

    def _retire_error(self, job: Job, message: str, code: str) -> None:
        with self.cond:
            if job in self.running:
                self.running.remove(job)
            self._gauges()
        self._end_error(job, message, code)

    def _end_error(self, job: Job, message: str, code: str) -> None:
        self.metrics.add("request_errors_total")
        job.sink({"type": "error", "message": message, "code": code})

    def _gauges(self) -> None:
        self.metrics.running, self.metrics.waiting = len(self.running), len(self.waiting)
