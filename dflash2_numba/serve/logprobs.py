"""Logprobs in OpenAI's two response shapes, from the engine's per-token numbers
(decode/logprobs.TokenLogprob: the TARGET's log-softmax at each position).

    es = entries(tokenizer, token_logprobs, pieces, offset)   # engine thread: strings + offsets
    completion_logprobs(es)   # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    chat_logprobs(es)         # {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}

A token's string is its own decode (`tokenizer.decode([id])`); `text_offset` is where its text
starts in the choice's text (the echoed prompt included), from the streaming detokeniser's
pieces, so the offsets add up to the text the client receives. The first prompt token of an
echo has logprob null and top_logprobs null (nothing conditions it), as OpenAI and vLLM report.
Completions' top_logprobs is a {token: logprob} dict (two ids that decode alike keep the higher
one), chat's a list.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] | None  # None for the unconditioned first prompt token
    offset: int


def entries(tokenizer, lps, pieces: list[str], offset: int) -> list[LogprobEntry]:
    """TokenLogprobs + the text each token added (pieces) -> LogprobEntry list."""
    cache: dict[int, str] = {}

    def s(t: int) -> str:
        if t not in cache:
            cache[t] = tokenizer.decode([t])
        return cache[t]

    out = []
    for lp, piece in zip(lps, pieces):
        top = None if lp.logprob is None else tuple((s(j), v) for j, v in lp.top)
        out.append(LogprobEntry(s(lp.token_id), lp.logprob, top, offset))
        offset += len(piece)
    return out


def completion_logprobs(es: list[LogprobEntry]) -> dict:
    tops = []
    for e in es:
        if e.top is None:
            tops.append(None)
            continue
        d: dict[str, float] = {}
        for tok, v in e.top:
            d.setdefault(tok, v)  # best first: a duplicate string keeps the higher value
        tops.append(d)
    return {"tokens": [e.token for e in es], "token_logprobs": [e.logprob for e in es],
            "top_logprobs": tops, "text_offset": [e.offset for e in es]}


def _b(tok: str) -> list[int]:
    return list(tok.encode("utf-8"))


def chat_logprobs(es: list[LogprobEntry]) -> dict:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _b(e.token),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": _b(t)} for t, v in (e.top or ())]}
                        for e in es]}
