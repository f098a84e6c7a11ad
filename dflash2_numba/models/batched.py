"""Forwards over several requests at once (the server's continuous batching, serve/engine.py).

    props = propose_batch(draft, calls)                  # ONE draft forward over every block
    outs  = verify_batch(target, blocks, caches, taps)   # ONE target forward over every row

Stacked rows go through the products together (every weight streamed once per step instead
of once per request); attention, RoPE positions, caches and the conv stay per request. Each
product runs in chunks of <= 32 rows (layers.in_row_chunks), the panel GEMV's row-invariant
range, so every request's rows get exactly the bits its own one-request forward gives (the
fused layer is bit-identical to the op-by-op path: tests/test_fused.py): a request's output
does not depend on what else runs. tests/test_batched.py checks it.

What batches: the draft for DFlash / DFlash2 drafts on any target; the target verify for the
plain Qwen3 / Llama `TargetModel` on the numba CPU device. Anything else (Qwen3.5 hybrid, whose
recurrent state replays per request; Muse-Glimmer, whose layer is its own; the CUDA device;
test drafters) runs request by request through its own `forward` / `propose`, in the same step:
correct, just not amortised. `batches_target` / `batches_draft` say which applies.
"""

from __future__ import annotations

import time

import numpy as np

from ..decode.step import run_draft
from .draft import DFlashDraft
from .layers import in_row_chunks
from ..families.qwen3 import TargetModel
from .base import Span, forward_ids, tap_columns


def batches_target(target) -> bool:
    """True when verify_batch stacks this target's rows: a plain Qwen3 / Llama on the CPU whose
    weights the fused engine reads (panels: the row-invariant GEMV; float32 checkpoints take
    the row GEMV, whose vectorised reduction may differ between row groups)."""
    cls = type(target)
    return (isinstance(target, TargetModel) and cls._layer is TargetModel._layer
            and cls.forward is TargetModel.forward and target.ops.device == "cpu"
            and target._fused_layers is not None and hasattr(target.lm_head_w, "panels"))


def batches_draft(draft) -> bool:
    """True when propose_batch stacks this drafter's blocks (DFlash / DFlash2 on the CPU, panel
    weights) and the target's head it reads."""
    return (isinstance(draft, DFlashDraft) and draft.ops.device == "cpu" and draft._fusable()
            and hasattr(draft.fc, "panels") and hasattr(getattr(draft.target, "lm_head_w", None), "panels"))


def verify_batch(target, blocks: list[np.ndarray], caches: list, tap_layers=()) -> list[tuple]:
    """blocks[r] [n_r] ids at positions caches[r].length.. -> [(logits [n_r, V], taps
    [n_r, T*H] | None)] per request, as `target.forward(blocks[r], caches[r], tap_layers)`
    gives them (the same bits), appending each block's K/V to its own cache."""
    if len(blocks) == 1 or not batches_target(target):
        return [target.forward(b, c, tap_layers=tap_layers) for b, c in zip(blocks, caches)]
    c = target.config
    blocks = [forward_ids(b, tap_layers, c.num_hidden_layers, type(target).__name__) for b in blocks]
    sizes = [b.shape[0] for b in blocks]
    bounds = np.cumsum([0] + sizes)
    spans = []
    for r, (cache, n) in enumerate(zip(caches, sizes)):
        start = cache.length
        cache.reserve(n)
        spans.append(Span(cache, start, np.arange(start, start + n, dtype=np.int64),
                          np.arange(start + n, dtype=np.int64), slice(int(bounds[r]), int(bounds[r + 1]))))
    cos, sin = target.rope(np.concatenate([sp.q_pos for sp in spans]))  # [N, hd]
    H = c.hidden_size
    h = target.embed_input(np.concatenate(blocks))  # [N, H]
    taps = np.empty((h.shape[0], len(tap_layers) * H), np.float32) if len(tap_layers) else None
    linear = lambda x, w: in_row_chunks(lambda rows: target.ops.linear(rows, w), x)  # noqa: E731
    at = tap_columns(tap_layers, H)  # {layer: its columns of taps}
    for i, layer in enumerate(target.layers):
        h = target._layer_ops(i, layer, h, cos, sin, spans, linear)
        for cols in at.get(i, ()):  # residual stream AFTER layer i
            taps[:, cols] = h
    for sp, n in zip(spans, sizes):
        sp.cache.length = sp.start + n
    logits = in_row_chunks(lambda rows: target.logits(target.final_norm(rows)), h)  # [N, V]
    return [(logits[sp.rows], None if taps is None else taps[sp.rows]) for sp in spans]


def propose_batch(draft, calls: list) -> list:
    """calls: decode/step.DraftCall per request -> the Proposal of each, as its own
    context update + `draft.propose(*call.args)` give it (the same bits, the same random draws from each
    request's own rng: the selector / sampling runs per request, in order)."""
    if len(calls) == 1 or not batches_draft(draft):
        return [run_draft(draft, call) for call in calls]
    draft.extend_contexts([c.state for c in calls], *zip(*(c.context for c in calls)))
    for call in calls:
        draft._check_propose(call.n_rows)
    rows = [call.n_rows for call in calls]
    h = draft.block_forward([c.state for c in calls], [c.anchor_id for c in calls],
                            [c.anchor_pos for c in calls], rows)  # [sum Q_r, H]
    bounds = np.cumsum([0] + rows)
    mask_rows = np.concatenate([np.arange(a + 1, b) for a, b in zip(bounds[:-1], bounds[1:])])  # [sum Q_r - R]
    hm = h[mask_rows]  # [M, H]
    z = in_row_chunks(draft.target.lm_head, hm)  # [M, V]
    out, m0 = [], 0
    for call, Q in zip(calls, rows):
        m1 = m0 + Q - 1
        out.append(draft.proposal_from(hm[m0:m1], z[m0:m1], call.anchor_id, call.anchor_pos,
                                       call.sampling, call.rng))
        m0 = m1
    return out


def step_batch(target, draft, decodings: list, rule=None) -> list:
    """One speculative step of every request (decode/step.Decoding, prefill done, not
    finished): ONE draft forward over all their blocks, ONE verify forward over all their rows,
    then each request accepts with its own rng -> the StepResult of each, in order. `rule`: the
    batch's verify-row budget (decode/batch_width.BatchWidth) for the requests seated in it:
    it decides who drafts before the draft forward and how many rows after, and learns the
    batched step's measured costs."""
    if rule is not None:
        rule.plan(decodings)
    calls = [d.begin_step() for d in decodings]
    drafting = [i for i, c in enumerate(calls) if c is not None]
    props = [None] * len(decodings)
    t0 = time.perf_counter()
    for i, p in zip(drafting, propose_batch(draft, [calls[i] for i in drafting]) if drafting else ()):
        props[i] = p
    t1 = time.perf_counter()
    if rule is not None:
        rule.allot(decodings, props)
    blocks = [d.verify_ids(p) for d, p in zip(decodings, props)]  # [Bv_r] each
    tap_layers = next((d.tap_layers for d in decodings if d.tap_layers), ())  # (a retired request has none)
    t2 = time.perf_counter()
    outs = verify_batch(target, blocks, [d.cache for d in decodings], tap_layers)
    t3 = time.perf_counter()
    results = [d.accept(logits, taps) for d, (logits, taps) in zip(decodings, outs)]
    if rule is not None:  # a draft step that fed a prompt's context is not a typical one
        backlog = sum(max(0, decodings[i]._ctx_n - decodings[i].Q) for i in drafting)  # context rows past a block
        trimmed = any(decodings[i].kmax < decodings[i].Q - 1 for i in drafting)
        rule.record(len(drafting), t1 - t0, sum(len(b) for b in blocks), t3 - t2,
                    sum(len(r.token_ids) for r in results), trimmed, backlog)
    return results
