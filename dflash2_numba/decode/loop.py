"""The speculative decode loop (spec §5) as ONE streaming generator.

    for step in stream_generate(target, draft, "prompt", max_new_tokens=64):
        print(step.text, end="")

`draft=None` is plain autoregressive decoding through the same code (one token per step).

Per step, with `start` = position of the anchor (the newest committed token, not yet in the
target KV cache) and `Q` the runtime block length:

    Bv = min(Q, remaining budget)        # rows VERIFIED this step; the last step shrinks
    draft.extend_context(taps of committed tokens not yet in the draft context)
    drafts = draft.propose(anchor, start, Q)[:Bv-1]         # the draft always runs Q rows
    logits, taps = target.forward([anchor, d_1..], cache)   # ONE verify forward, positions start..
    a, x = verify_block(...)                                # a drafts accepted, x = bonus/correction
    emit d_1..d_a, x (truncated inclusively at the first stop id)
    cache.commit(start + a + 1); taps[0 : a+1] become the next draft context

The draft block is non-causal, so its length changes every row's output: it always runs Q
rows (like vLLM and the z-lab reference), and only the verify is trimmed to `Bv` rows. Emitting
at most `Bv` tokens keeps the output exactly max_new_tokens long when no stop id appears.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numba
import numpy as np

from ..errors import ContextLengthError, GenerationArgumentError, NonFiniteLogitsError, SelectorRefusedError
from .drafter import valid_vocab
from .sampling import (SamplingParams, greedy_token, mask_padded, sample_token, target_probs,
                       verify_block)
from .stats import DecodeStats


@dataclass
class StepResult:
    token_ids: list[int]  # tokens committed this step (after stop truncation)
    text: str  # UTF-8-safe text delta (may be "" while a character is incomplete)
    accepted: int  # drafts accepted this step (0 for the prefill token and autoregressive steps)
    finish_reason: str | None  # None while running, then "stop" | "length"
    stats: DecodeStats = field(repr=False, default=None)  # live statistics of this request


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str
    stats: DecodeStats
    prompt_ids: list[int]


def _tokenizer_of(target):
    tok = getattr(target, "tokenizer", None)
    if tok is None and getattr(target, "model_dir", None) is not None:
        from ..tokenizer import Tokenizer  # lazy: targets built without a directory have none
        tok = Tokenizer.from_dir(target.model_dir)
        target.tokenizer = tok
    return tok


def _vocab_size(target) -> int:
    cfg = getattr(target, "config", None)
    return int(cfg.vocab_size) if cfg is not None else int(target.vocab_size)


def resolve_prompt_ids(target, prompt, prompt_ids, chat: bool) -> list[int]:
    """Prompt token ids from `prompt_ids` (used as given) or the text `prompt`."""
    if prompt_ids is not None:
        ids = [int(i) for i in prompt_ids]
    else:
        if prompt is None:
            raise GenerationArgumentError("no prompt: pass a prompt string or prompt_ids")
        tok = _tokenizer_of(target)
        if tok is None:
            raise GenerationArgumentError("a text prompt needs the target's tokenizer; pass prompt_ids")
        ids = tok.encode_prompt(prompt, chat=chat)
    if not ids:
        raise GenerationArgumentError("the prompt is empty (0 tokens); the target needs at least one")
    V = _vocab_size(target)
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise GenerationArgumentError(f"prompt ids {bad[:5]} are outside the target vocabulary 0..{V - 1}")
    return ids


def check_context(target, n_prompt: int, max_new: int) -> None:
    """Refuse, before anything is allocated, what cannot fit the target's positions: the prompt
    alone, or the prompt plus the whole budget (the KV cache is sized for both up front)."""
    cfg = getattr(target, "config", None)
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is None:
        return
    where = getattr(cfg, "source", "config.json")
    if n_prompt > limit:
        raise ContextLengthError(f"the prompt has {n_prompt} tokens, more than the target's "
                                 f"max_position_embeddings = {limit} ({where})")
    if n_prompt + max_new > limit:
        raise ContextLengthError(
            f"prompt {n_prompt} tokens + max_new_tokens {max_new} = {n_prompt + max_new} positions exceed the "
            f"target's max_position_embeddings = {limit} ({where}); max_new_tokens can be at most {limit - n_prompt}")


def check_stop_ids(target, stop_token_ids) -> list[int]:
    """--stop-token ids must be token ids of the target's vocabulary (a -1 would never match)."""
    V = _vocab_size(target)
    ids = list(stop_token_ids)
    bad = [i for i in ids if isinstance(i, bool) or int(i) != i or not 0 <= i < V]
    if bad:
        raise GenerationArgumentError(
            f"stop_token_ids (--stop-token) {bad[:5]} are outside the target vocabulary 0..{V - 1}")
    return [int(i) for i in ids]


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


def _pick(row: np.ndarray, sampling: SamplingParams, rng) -> int:
    """Next token from one masked logits row [V] (the prefill token / a plain AR step)."""
    if sampling.greedy:
        return greedy_token(row)
    return sample_token(target_probs(row, sampling), rng)


def runtime_block_size(draft, block_size: int | None) -> int:
    """Runtime Q (anchor + draft rows): the draft's trained B unless the user asks for fewer."""
    B = int(draft.block_size)
    Q = B if block_size is None else block_size
    if int(Q) != Q or not 2 <= Q <= B:
        raise GenerationArgumentError(
            f"block_size must be an integer in 2..{B} (the draft's trained block size), got {block_size!r}")
    return int(Q)


def stream_generate(target, draft, prompt: str | None = None, *, max_new_tokens: int = 128,
                    block_size: int | None = None, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None,
                    stop_token_ids: Sequence[int] = (), chat: bool = False,
                    prompt_ids: Sequence[int] | None = None) -> Iterator[StepResult]:
    """Yield one StepResult per committed chunk: first the prefill token, then one per verify
    step. `block_size` is the runtime Q (2..draft.block_size; default draft.block_size);
    ignored when draft is None. Stop ids = tokenizer stop set ∪ stop_token_ids."""
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise GenerationArgumentError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    Q = 1 if draft is None else runtime_block_size(draft, block_size)
    ids = resolve_prompt_ids(target, prompt, prompt_ids, chat)
    stop_token_ids = check_stop_ids(target, stop_token_ids)
    check_context(target, len(ids), int(max_new_tokens))
    if max_new_tokens >= 2:  # a draft step is scheduled: refuse now if it is certain to refuse
        _refuse_certain(draft)
    return _run(target, draft, ids, int(max_new_tokens), Q, sampling, stop_token_ids)


def _refuse_certain(draft) -> None:
    """A drafter that knows at load time that every proposal will be refused (a DFlash2 draft
    whose selector cannot run faithfully) is refused before the prefill token is emitted."""
    reason = getattr(draft, "refusal_reason", None)
    if reason:
        raise SelectorRefusedError(reason)


def _run(target, draft, prompt_ids: list[int], max_new: int, Q: int, sampling: SamplingParams,
         stop_token_ids) -> Iterator[StepResult]:
    tok = _tokenizer_of(target)
    if tok is not None:
        stops = set(tok.stop_ids(stop_token_ids))
    else:
        stops = {int(i) for i in stop_token_ids} | set(getattr(getattr(target, "config", None), "eos_token_id", []) or [])
    vv = valid_vocab(target)
    decoder = tok.stream_decoder() if tok is not None else None
    rng = sampling.rng()
    n = len(prompt_ids)
    max_len = n + max_new
    tap_layers = tuple(draft.target_layer_ids) if draft is not None else ()
    stats = DecodeStats(block_size=Q, prompt_tokens=n, threads=numba.get_num_threads())

    ids = list(prompt_ids)  # prompt + committed tokens

    def commit(new: list[int], accepted: int) -> StepResult:
        """Append new tokens, truncating inclusively at the first stop id / the budget."""
        reason = None
        for j, t in enumerate(new):
            if t in stops:
                new, reason = new[:j + 1], "stop"
                break
        assert len(ids) - n + len(new) <= max_new, "the loop emitted past max_new_tokens"
        ids.extend(new)
        if reason is None and len(ids) - n == max_new:
            reason = "length"
        stats.new_tokens = len(ids) - n
        text = ""
        if decoder is not None:
            text = decoder.feed(new) + (decoder.flush() if reason else "")
        return StepResult(list(new), text, accepted, reason, stats)

    # ---- prefill: target KV(0..n-1), taps(0..n-1), first token from the last prompt row
    t0 = time.perf_counter()
    cache = target.new_cache(max_len)
    logits, taps = target.forward(np.asarray(ids, np.int64), cache, tap_layers=tap_layers,
                                  last_only=True)  # [1, V] (only the last row is sampled)
    check_finite(logits, "prefill", n - 1)
    first = _pick(mask_padded(logits[-1], vv), sampling, rng)
    stats.prefill_s = time.perf_counter() - t0
    step = commit([first], 0)
    yield step
    if step.finish_reason:
        return

    dstate = draft.new_state(max_len) if draft is not None else None
    ctx_taps, ctx_start = taps, 0  # committed tokens not yet in the draft context
    start = n  # anchor position
    while True:
        # invariant: the target cache holds positions 0..start-1; ids[start] is the anchor
        assert cache.length == start and len(ids) == start + 1, (cache.length, start, len(ids))
        Bv = min(Q, max_len - 1 - start)  # remaining budget = max_len - (start + 1) + 1
        drafts, q = np.zeros(0, np.int64), None
        t0 = time.perf_counter()  # decode_s counts the loop's own time, not the consumer's
        if Bv >= 2:
            draft.extend_context(dstate, ctx_taps, ctx_start, np.asarray(ids[ctx_start:start], np.int64))
            ctx_taps, ctx_start = None, start
            # the draft block is non-causal: its length changes every row's output, so it always
            # runs the runtime Q rows (as vLLM and z-lab do); the budget only trims what is verified
            prop = draft.propose(dstate, ids[start], start, Q, sampling, rng)
            drafts, q = np.asarray(prop.draft_ids, np.int64), prop.q  # [Q-1, V] | None
            if drafts.shape != (Q - 1,):
                raise RuntimeError(f"{type(draft).__name__}.propose returned {drafts.shape[0]} drafts "
                                   f"for a {Q}-row block (expected {Q - 1})")
            drafts = drafts[:Bv - 1]  # [Bv-1]
            q = None if q is None else q[:Bv - 1]  # [Bv-1, V]
            if q is not None:
                check_finite(q, f"step {stats.steps + 1}: draft proposal distribution", start + 1)
        t1 = time.perf_counter()

        block = np.concatenate([[ids[start]], drafts]).astype(np.int64)  # [Bv]
        logits, taps = target.forward(block, cache, tap_layers=tap_layers)  # [Bv, V], [Bv, T*H]
        check_finite(logits, f"step {stats.steps + 1}: verify", start)
        a, x = verify_block(mask_padded(logits, vv), drafts, q, sampling, rng)
        cache.commit(start + a + 1)  # keep the anchor and the a accepted drafts (any layer kind)
        if draft is not None and taps is not None:
            acc = taps[:a + 1]  # [a+1, T*H], positions start..start+a
            ctx_taps = acc if ctx_taps is None else np.concatenate([ctx_taps, acc])
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.record_step(Bv, a)

        step = commit([int(d) for d in drafts[:a]] + [x], a)
        stats.decode_s += time.perf_counter() - t0
        yield step
        if step.finish_reason:
            return
        start += a + 1


def generate(target, draft, prompt: str | None = None, *, chat: bool = False,
             prompt_ids: Sequence[int] | None = None, **kwargs) -> GenerationResult:
    """Run stream_generate to the end and collect the result (same keyword arguments)."""
    ids = resolve_prompt_ids(target, prompt, prompt_ids, chat)
    out, text, reason, stats = [], [], None, None
    for step in stream_generate(target, draft, prompt_ids=ids, **kwargs):
        out.extend(step.token_ids)
        text.append(step.text)
        reason, stats = step.finish_reason, step.stats
    return GenerationResult(out, "".join(text), reason, stats, ids)


def propose_once(target, draft, prompt: str | None = None, *, block_size: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, chat: bool = False,
                 prompt_ids: Sequence[int] | None = None) -> dict:
    """One proposal round stopping before verification (`dflash2-decode propose`): prefill,
    pick the anchor from the last prompt row, feed the prompt taps to the draft, propose.
    Returns {"anchor", "anchor_position", "positions", "draft_ids", "slots", ...info}."""
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    Q = runtime_block_size(draft, block_size)
    ids = resolve_prompt_ids(target, prompt, prompt_ids, chat)
    check_context(target, len(ids), 1)
    _refuse_certain(draft)
    n, rng = len(ids), sampling.rng()
    cache = target.new_cache(n + Q)
    logits, taps = target.forward(np.asarray(ids, np.int64), cache,
                                  tap_layers=tuple(draft.target_layer_ids), last_only=True)  # [1, V]
    check_finite(logits, "prefill", n - 1)
    anchor = _pick(mask_padded(logits[-1], valid_vocab(target)), sampling, rng)
    state = draft.new_state(n + Q)
    draft.extend_context(state, taps, 0, np.asarray(ids, np.int64))
    prop = draft.propose(state, anchor, n, Q, sampling, rng)
    out = {"prompt_ids": ids, "anchor": anchor, "anchor_position": n,
           "positions": list(range(n + 1, n + Q)),
           "draft_ids": [int(d) for d in prop.draft_ids]}
    out.update(prop.info)
    return out
