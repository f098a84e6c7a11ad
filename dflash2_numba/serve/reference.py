"""What the server must answer for a request, computed from its SOLO run (`stream_generate`):
the tests and the load test (bench/bench_serve.py) compare every answer with it.

    ans = solo_answer(target, draft, prompt_ids, max_tokens=32, block_size=4, temperature=0.0,
                      seed=None, top_k=0, top_p=1.0, stop=["\\n\\n"])
    ans.text, ans.completion_tokens, ans.finish_reason, ans.step_texts

The server's conventions, restated: a stop id ends the output with finish_reason "stop" and is
counted in completion_tokens, its text is not content; a stop string ends the text before it,
and completion_tokens counts the tokens up to the one that completed it."""

from __future__ import annotations

from dataclasses import dataclass

from ..decode.loop import stream_generate


@dataclass
class SoloAnswer:
    text: str
    completion_tokens: int
    finish_reason: str
    step_texts: list[str]  # the text each solo step emitted (the stop tests pick boundaries from it)
    token_ids: list[int] = None  # the first completion_tokens output ids (what logprobs are reported for)


def solo_answer(target, draft, prompt_ids, *, max_tokens: int, block_size: int | None = None,
                temperature: float = 0.0, seed: int | None = None, top_k: int = 0, top_p: float = 1.0,
                stop=()) -> SoloAnswer:
    tok = target.tokenizer
    steps = list(stream_generate(target, draft, prompt_ids=prompt_ids, max_new_tokens=max_tokens,
                                 temperature=temperature, seed=seed, block_size=block_size, top_k=top_k,
                                 top_p=top_p))
    out = [t for s in steps for t in s.token_ids]
    finish = steps[-1].finish_reason
    content = out[:-1] if finish == "stop" else out  # the stop id's text is not content
    text, n_tokens = tok.decode(content), len(out)
    hits = [text.index(s) for s in stop if s in text]
    if hits:
        cut = min(hits)
        end = cut + next(len(s) for s in stop if s in text and text.index(s) == cut)
        n_tokens = next(k for k in range(1, len(content) + 1) if len(tok.decode(content[:k])) >= end)
        text, finish = text[:cut], "stop"
    return SoloAnswer(text, n_tokens, finish, [s.text for s in steps], out[:n_tokens])
