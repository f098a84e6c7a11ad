"""The drafter protocol the decode loop talks to, and an oracle test double.

A drafter owns a per-request `state` (its context K/V cache). The loop (decode/loop.py) calls:

    state = draft.new_state(max_len)
    draft.extend_context(state, taps, start_pos, token_ids)   # committed tokens start_pos.. (in order)
    prop  = draft.propose(state, anchor_id, anchor_pos, n_rows, sampling, rng)

Contract:
- `extend_context` receives the target's hidden taps `[n, n_taps*H]` (taps of
  `target_layer_ids`, ascending, concatenated) of the committed tokens at positions
  `start_pos .. start_pos+n-1`, and their ids `token_ids [n]` (drafts that read only taps
  ignore the ids; the oracle needs them). Calls arrive in position order with no gaps and no
  overlap; `taps` is None when `target_layer_ids` is empty.
- When `propose` is called the state holds positions `0 .. anchor_pos-1` exactly. The anchor
  (newest committed token, at `anchor_pos`) has no taps yet. `n_rows = Q_runtime` is the block
  length including the anchor row (2 <= n_rows <= block_size); it can be smaller than
  `block_size` (user `--block-size`, or the truncated last step). Propose `n_rows - 1` tokens
  for positions `anchor_pos+1 ..`. Block K/V must not persist in the state.
- `Proposal.q` is the exact distribution each draft token was drawn from (float32
  `[n_rows-1, V]`), or None for a one-hot proposal (argmax / greedy walk). The verifier's
  losslessness depends on q being honest.
- `Proposal.confidence` (optional) is the top-1 probability of each position's distribution,
  a scheduling signal only (decode/width.py); it must not depend on the drawn token.
- `Proposal.info` is free-form debug data for `dflash2-decode propose`; by convention:
  `"slots": [{"candidate_ids": [...], "candidate_scores": [...]}, ...]` (one per draft token),
  and for DFlash2 `"chosen_slots": [...]` (the selector walk). Drafters may hand a `LazyInfo`:
  the decode loop never reads info, so it is only built (lists out of arrays) when asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from .sampling import SamplingParams, mask_padded, target_probs


class LazyInfo(Mapping):
    """A read-only dict built by `build()` on first access (~50-100 us of .tolist() per draft
    step that plain decoding would throw away)."""

    def __init__(self, build: Callable[[], dict]):
        self._build, self._data = build, None

    def _dict(self) -> dict:
        if self._data is None:
            self._data = self._build()
        return self._data

    def __getitem__(self, key):
        return self._dict()[key]

    def __iter__(self):
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())


@dataclass
class Proposal:
    draft_ids: np.ndarray  # int64 [n_rows-1]
    q: np.ndarray | None = None  # float32 [n_rows-1, V], or None = one-hot on draft_ids
    info: Mapping = field(default_factory=dict)
    # float [n_rows-1]: the draft's probability of its top candidate at each position, read from
    # the distribution that position is drawn from (given the earlier drafts), never from the
    # drawn token; a scheduling signal for the adaptive width (decode/width.py). None: not given
    confidence: np.ndarray | None = None


@runtime_checkable
class Drafter(Protocol):
    kind: str  # "dflash" | "dflash2" | "oracle" | ...
    block_size: int  # trained B; the runtime Q may be smaller
    target_layer_ids: list[int]  # taps to request from the target (ascending)
    mask_token_id: int

    def new_state(self, max_len: int) -> object: ...

    def extend_context(self, state, taps: np.ndarray | None, start_pos: int,
                       token_ids: np.ndarray) -> None: ...
    # (taps may be a view of the caller's buffer, rewritten after the call: read it, keep no reference)

    def propose(self, state, anchor_id: int, anchor_pos: int, n_rows: int,
                sampling: SamplingParams, rng: np.random.Generator) -> Proposal: ...


def valid_vocab(target) -> int | None:
    """Number of ids the target may emit (the tokenizer's size; ids above are padding)."""
    v = getattr(target, "valid_vocab", None)
    return int(v() if callable(v) else v) if v is not None else None


# ---------------------------------------------------------------- test double
@dataclass
class _OracleState:
    cache: object  # a scratch target KV cache holding positions 0..anchor_pos-1
    length: int = 0


class OracleDrafter:
    """Proposes the target's own continuation, by running the target itself on a scratch KV
    cache. Greedy (`mode="greedy"`): the target's argmax chain, so under greedy decoding
    every full step accepts all Q-1 drafts (a gate on the loop's bookkeeping: a wrong crop,
    position or context shows up as acceptance < Q). `mode="sample"`: draws each token from
    the target's distribution at `temperature * temperature_scale` and reports that q, so q
    differs from the verifier's p (a test of the lossless residual path)."""

    kind = "oracle"
    mask_token_id = -1  # no mask token: the oracle never embeds one

    def __init__(self, target, block_size: int = 16, mode: str = "greedy",
                 temperature_scale: float = 1.0):
        if mode not in ("greedy", "sample"):
            raise ValueError(f"mode must be 'greedy' or 'sample', got {mode!r}")
        self.target = target
        self.block_size = block_size
        self.target_layer_ids: list[int] = []  # no taps: it reads token ids
        self.mode = mode
        self.temperature_scale = temperature_scale
        self._valid = valid_vocab(target)

    def new_state(self, max_len: int) -> _OracleState:
        return _OracleState(cache=self.target.new_cache(max_len + self.block_size))

    def extend_context(self, state: _OracleState, taps, start_pos: int, token_ids) -> None:
        assert start_pos == state.length == state.cache.length, (start_pos, state.length)
        ids = np.asarray(token_ids, np.int64)  # [n]
        if len(ids):
            self.target.forward(ids, state.cache, last_only=True)  # only the K/V matter
        state.length += len(ids)

    def propose(self, state: _OracleState, anchor_id: int, anchor_pos: int, n_rows: int,
                sampling: SamplingParams, rng: np.random.Generator) -> Proposal:
        assert anchor_pos == state.length, (anchor_pos, state.length)
        sample = self.mode == "sample" and not sampling.greedy
        if sample:
            qp = SamplingParams(sampling.temperature * self.temperature_scale,
                                sampling.top_k, sampling.top_p)
        tok, drafts, qs, slots = int(anchor_id), [], [], []
        for _ in range(n_rows - 1):
            logits, _ = self.target.forward(np.array([tok], np.int64), state.cache)  # [1, V]
            row = mask_padded(logits[-1], self._valid)  # [V]
            if sample:
                q = target_probs(row, qp)  # [V] f64
                tok = int(min(np.searchsorted(np.cumsum(q), rng.random() * q.sum(), side="right"),
                              len(q) - 1))
                qs.append(q.astype(np.float32))
            else:
                tok = int(np.argmax(row))
            drafts.append(tok)
            n_top = min(4, len(row))
            top = np.argpartition(-row, n_top - 1)[:n_top]
            top = top[np.lexsort((top, -row[top]))]  # best few, descending, ties by id
            slots.append({"candidate_ids": top.tolist(), "candidate_scores": row[top].tolist()})
        state.cache.commit(anchor_pos)  # block K/V never persist
        q = np.stack(qs) if sample else None  # [n_rows-1, V]
        return Proposal(np.array(drafts, np.int64), q, {"slots": slots})
