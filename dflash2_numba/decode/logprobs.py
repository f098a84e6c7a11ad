"""Log-probabilities of tokens under the TARGET's distribution (the numbers an evaluator reads).

    rows = token_logprobs(logits, ids, top_n=5, valid_vocab=4002)   # logits [k, V], ids [k]
    rows[i].logprob    # log p(ids[i] | everything before it), float
    rows[i].top        # [(id, logprob)] of the top_n ids, best first (ties: lower id first)

What is reported is the log-softmax of the target's raw logits row (float64 over the whole
output row, config vocab_size, as transformers and vLLM compute it): never the draft's
proposal, never temperature / top-k / top-p adjusted. Prompt positions come from the prefill
forward, generated positions from the verify forward that accepted them (the anchor row's
logits give the first drafted token, and so on), so speculation changes nothing: the same
positions are scored by the same target whatever the draft accepted. The top list is drawn from
the ids the tokenizer knows (`valid_vocab`): padding rows are never listed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API (completions allow 5; vLLM allows 20)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the first prompt token (nothing conditions it)
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[k, V] float32 logits -> [k, V] float64 log-probabilities (stable: max subtracted)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, ids, top_n: int, valid_vocab: int | None) -> list[TokenLogprob]:
    """One TokenLogprob per row: row i of `logits` [k, V] is the distribution of ids[i]."""
    ids = [int(i) for i in ids]
    assert logits.ndim == 2 and logits.shape[0] == len(ids), (logits.shape, len(ids))
    if not ids:
        return []
    lp = log_softmax(logits)  # [k, V]
    out = []
    for i, t in enumerate(ids):
        top: tuple = ()
        if top_n > 0:
            row = lp[i, :valid_vocab] if valid_vocab is not None else lp[i]
            k = min(top_n, row.shape[0])
            cand = np.argpartition(-row, k - 1)[:k]  # the k largest, unordered
            cand = sorted(cand.tolist(), key=lambda j: (-row[j], j))
            top = tuple((int(j), float(row[j])) for j in cand)
        out.append(TokenLogprob(t, float(lp[i, t]), top))
    return out
