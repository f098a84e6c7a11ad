"""Scoring a prompt: the target's log-probability of every token given the ones before it (the
numbers `/v1/completions` returns with echo + logprobs + max_tokens 0, offline).

    lps = score(target, ids, top_n=0)        # [TokenLogprob]; lps[0].logprob is None
    sum(x.logprob for x in lps[n_context:])  # log p(continuation | context)

The same prefill the decoder and the server run (decode/step.Decoding, PREFILL_CHUNK-token
chunks), each chunk's logits kept for every row.
"""

from __future__ import annotations

from .logprobs import TokenLogprob
from .loop import check_context
from .sampling import SamplingParams
from .step import Decoding


def score(target, ids: list[int], top_n: int = 0) -> list[TokenLogprob]:
    check_context(target, len(ids), 0)
    dec = Decoding(target, None, list(ids), 0, 1, SamplingParams(0.0), (), text=False, logprobs=top_n,
                   prompt_logprobs=True)
    while dec.prefill_step() is None:
        pass
    return dec.prompt_lps
