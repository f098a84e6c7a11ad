"""The speculative decode loop (spec §5) as ONE streaming generator.

    for step in stream_generate(target, draft, "prompt", max_new_tokens=64):
        print(step.text, end="")

`draft=None` is plain autoregressive decoding through the same code (one token per step).

Per step, with `start` = position of the anchor (the newest committed token, not yet in the
target KV cache) and `Q` the runtime block length:

    Bv = min(Q, remaining budget)        # rows VERIFIED this step; the last step shrinks
                                         # (block_size "auto": Bv = k+1 <= that, decode/width.py;
                                         #  k = 0 is a plain target step without a draft forward)
    draft.extend_context(taps of committed tokens not yet in the draft context)
    drafts = draft.propose(anchor, start, Q)[:Bv-1]         # the draft runs Q rows (auto: or a smaller block)
    logits, taps = target.forward([anchor, d_1..], cache)   # ONE verify forward, positions start..
    a, x = verify_block(...)                                # a drafts accepted, x = bonus/correction
    emit d_1..d_a, x (truncated inclusively at the first stop id)
    cache.commit(start + a + 1); taps[0 : a+1] become the next draft context

The draft block is non-causal, so its length changes every row's output: it runs Q rows (like
vLLM and the z-lab reference; under "auto" the width rule may pick a smaller block it timed,
before drafting) and the budget trims only the verify to `Bv` rows. Emitting
at most `Bv` tokens keeps the output exactly max_new_tokens long when no stop id appears.

The per-step logic (prefill chunks, Bv, draft context, verify, accept, commit) is
decode/step.py's `Decoding`, which the server's batching engine drives as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ..errors import ContextLengthError, GenerationArgumentError, SelectorRefusedError
from .drafter import valid_vocab
from .sampling import SamplingParams, mask_padded
from .stats import DecodeStats
from .width import AUTO, AdaptiveWidth, check_block_size, costs_for, parse_block_size
from .step import Decoding, StepResult, check_draft_window, check_finite, pick_token, run_draft, tokenizer_of  # noqa: F401 (public names)


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str
    stats: DecodeStats
    prompt_ids: list[int]


def _vocab_size(target) -> int:
    cfg = getattr(target, "config", None)
    return int(cfg.vocab_size) if cfg is not None else int(target.vocab_size)


def resolve_prompt_ids(target, prompt, prompt_ids, chat: bool, enable_thinking: bool = False,
                       **template_kwargs) -> list[int]:
    """Prompt token ids from `prompt_ids` (used as given) or the text `prompt` (chat: rendered
    with the chat template, `template_kwargs` its extra variables, e.g. reasoning_effort)."""
    if prompt_ids is not None:
        ids = [int(i) for i in prompt_ids]
    else:
        if prompt is None:
            raise GenerationArgumentError("no prompt: pass a prompt string or prompt_ids")
        tok = tokenizer_of(target)
        if tok is None:
            raise GenerationArgumentError("a text prompt needs the target's tokenizer; pass prompt_ids")
        ids = tok.encode_prompt(prompt, chat=chat, enable_thinking=enable_thinking, **template_kwargs)
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


def runtime_block_size(draft, block_size: int | str | None) -> int:
    """Runtime Q (anchor + draft rows): the draft's trained B unless the user asks for fewer
    ("auto" runs the draft's B rows and lets decode/width.py trim the verify). A value that is
    neither "auto" nor an integer in 2..B is a BlockSizeError."""
    B = int(draft.block_size)
    Q = check_block_size(block_size, B)
    return B if Q == AUTO else Q


def width_rule(target, draft, block_size, sampling: SamplingParams, rule=None):
    """The verify width rule of a run: `rule` when given (a test double or a caller's own),
    AdaptiveWidth for block_size "auto", else None (fixed: min(Q, budget) rows every step)."""
    if draft is None:
        return None
    if rule is not None:
        return rule
    if parse_block_size(block_size) != AUTO:
        return None
    B = int(draft.block_size)
    costs = costs_for(target, draft, B)
    # a seeded sampled run reads the measured table only (no online refresh): its draws then
    # depend on the seed and the cached table, not on what ran before it in this process
    frozen = not sampling.greedy and sampling.seed is not None
    return AdaptiveWidth(costs.frozen() if frozen else costs, B, online=not frozen)


def stream_generate(target, draft, prompt: str | None = None, *, max_new_tokens: int = 128,
                    block_size: int | str | None = AUTO, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None,
                    stop_token_ids: Sequence[int] = (), chat: bool = False,
                    prompt_ids: Sequence[int] | None = None, width=None,
                    draft_window: int = 0) -> Iterator[StepResult]:
    """Yield one StepResult per committed chunk: first the prefill token, then one per verify
    step. `block_size`: "auto" (default: the draft runs its B rows and each step verifies the
    number of them that maximises expected tokens per second, decode/width.py), or a fixed
    runtime Q in 2..draft.block_size (None: draft.block_size); ignored when draft is None.
    `width`: a width rule object (decode/width.py's interface) in place of "auto"'s.
    `draft_window` N > 0: the draft attends to the last N context positions only (its own
    sliding layers keep their windows too); 0 = the whole context.
    Stop ids = tokenizer stop set ∪ stop_token_ids."""
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise GenerationArgumentError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    Q = 1 if draft is None else runtime_block_size(draft, block_size)
    ids = resolve_prompt_ids(target, prompt, prompt_ids, chat)
    stop_token_ids = check_stop_ids(target, stop_token_ids)
    check_context(target, len(ids), int(max_new_tokens))
    if max_new_tokens >= 2:  # a draft step is scheduled: refuse now if it is certain to refuse
        _refuse_certain(draft)
    rule = width_rule(target, draft, block_size, sampling, width) if max_new_tokens >= 2 else None
    return _run(target, draft, ids, int(max_new_tokens), Q, sampling, stop_token_ids, rule,
                check_draft_window(draft, draft_window))


def _refuse_certain(draft) -> None:
    """A drafter that knows at load time that every proposal will be refused (a DFlash2 draft
    whose selector cannot run faithfully) is refused before the prefill token is emitted."""
    reason = getattr(draft, "refusal_reason", None)
    if reason:
        raise SelectorRefusedError(reason)


def _run(target, draft, prompt_ids: list[int], max_new: int, Q: int, sampling: SamplingParams,
         stop_token_ids, width=None, draft_window: int = 0) -> Iterator[StepResult]:
    """One request through the per-step logic of decode/step.py, with its own forwards."""
    dec = Decoding(target, draft, prompt_ids, max_new, Q, sampling, stop_token_ids, width=width,
                   draft_window=draft_window)
    step = None
    while step is None:
        step = dec.prefill_step()
    yield step
    while not dec.finished:
        call = dec.begin_step()
        block = dec.verify_ids(run_draft(draft, call))  # [Bv]
        logits, taps = target.forward(block, dec.cache, tap_layers=dec.tap_layers)  # [Bv, V], [Bv, T*H]
        yield dec.accept(logits, taps)
    if getattr(width, "online", False) and hasattr(width.costs, "save"):
        width.costs.save()  # what this decode measured: the next process starts from it


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


def propose_once(target, draft, prompt: str | None = None, *, block_size: int | str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, chat: bool = False,
                 prompt_ids: Sequence[int] | None = None, enable_thinking: bool = False) -> dict:
    """One proposal round stopping before verification (`dflash2-decode propose`): prefill,
    pick the anchor from the last prompt row, feed the prompt taps to the draft, propose.
    Returns {"anchor", "anchor_position", "positions", "draft_ids", "slots", ...info}."""
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    Q = runtime_block_size(draft, block_size)
    ids = resolve_prompt_ids(target, prompt, prompt_ids, chat, enable_thinking=enable_thinking)
    check_context(target, len(ids), 1)
    _refuse_certain(draft)
    n, rng = len(ids), sampling.rng()
    cache = target.new_cache(n + Q)
    logits, taps = target.forward(np.asarray(ids, np.int64), cache,
                                  tap_layers=tuple(draft.target_layer_ids), last_only=True)  # [1, V]
    check_finite(logits, "prefill", n - 1)
    anchor = pick_token(mask_padded(logits[-1], valid_vocab(target)), sampling, rng)
    state = draft.new_state(n + Q)
    draft.extend_context(state, taps, 0, np.asarray(ids, np.int64))
    prop = draft.propose(state, anchor, n, Q, sampling, rng)
    out = {"prompt_ids": ids, "anchor": anchor, "anchor_position": n,
           "positions": list(range(n + 1, n + Q)),
           "draft_ids": [int(d) for d in prop.draft_ids]}
    out.update(prop.info)
    return out
