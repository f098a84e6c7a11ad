"""Reasoning text apart from the answer: `reasoning_content` vs `content` of a chat response.

    parser = reasoning_parser(tokenizer)            # None: this tokenizer has no thinking format
    p = parser.start(prompt_ids)                     # the state the rendered prompt leaves
    reasoning, content = p.feed(token_id, text)      # one generated token and its decoded text

    split = ReplySplit(tokenizer, parser, prompt_ids)  # detokeniser + parser, for a chat reply
    piece, reasoning, content = split.feed(token_id, stop_id=False, last=False)

Two formats, recognised by their marker tokens in the vocabulary (one token each, so no marker
is ever split across steps and nothing is held back):

- think tags (Qwen3, DeepSeek-R1, ...): text between `<think>` and `</think>` is reasoning,
  the rest content. A prompt whose last tag is an open `<think>` (templates that open the
  thinking block themselves) starts inside it; Qwen3's enable_thinking=false template closes an
  empty block in the prompt, so everything generated is content.
- harmony (gpt-oss): messages `<|start|>{header}<|channel|>{name}<|message|>{body}<|end|>`;
  the bodies of the `analysis` channel are reasoning, those of `final` (and `commentary`, the
  preambles gpt-oss writes to the user before a tool call) content; headers and markers are
  neither. A reply is `analysis` message, `<|end|>`, `<|start|>assistant`, `final` message,
  `<|return|>`: `<|end|>` is not a stop (tokenizer.py keeps it out of the stop set).

The starting state is found by running the same machine over the prompt's ids (the template's
generation prompt, e.g. harmony's `<|start|>assistant`, leaves it in a header).
"""

from __future__ import annotations

from ..tokenizer import HARMONY_MARKERS as HARMONY

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY_ENDS = ("<|return|>", "<|call|>")  # end a message like <|end|> (they are stop tokens too)
REASONING_CHANNELS = {"analysis"}


def _strip_marker(text: str, marker: str) -> str:
    """The text a marker token's decode carried before the marker itself (held-back bytes)."""
    return text[:-len(marker)] if text.endswith(marker) else ""


class ThinkTags:
    def __init__(self, open_id: int, close_id: int):
        self.open_id, self.close_id = open_id, close_id
        self.inside = False

    def start(self, prompt_ids) -> "ThinkTags":
        p = ThinkTags(self.open_id, self.close_id)
        for t in reversed(prompt_ids):
            if t in (self.open_id, self.close_id):
                p.inside = t == self.open_id
                break
        return p

    def feed(self, token_id: int, text: str) -> tuple[str, str]:
        if token_id == self.open_id:
            before, self.inside = _strip_marker(text, THINK_OPEN), True
            return "", before
        if token_id == self.close_id:
            before, self.inside = _strip_marker(text, THINK_CLOSE), False
            return before, ""
        return (text, "") if self.inside else ("", text)


class Harmony:
    HEADER, CHANNEL, BODY = "header", "channel", "body"

    def __init__(self, ids: dict[str, int], decode):
        self.ids, self.decode = ids, decode
        self.by_id = {v: k for k, v in ids.items()}
        self.state, self.channel, self.buf = self.HEADER, "", ""

    def start(self, prompt_ids) -> "Harmony":
        p = Harmony(self.ids, self.decode)
        tail = list(prompt_ids)
        starts = [i for i, t in enumerate(tail) if t == self.ids["<|start|>"]]
        for t in tail[starts[-1] if starts else 0:]:  # the machine over the last message only
            p.feed(t, self.decode(t))
        return p

    def feed(self, token_id: int, text: str) -> tuple[str, str]:
        marker = self.by_id.get(token_id)
        if marker is None:
            if self.state == self.BODY:
                return (text, "") if self.channel in REASONING_CHANNELS else ("", text)
            self.buf += text  # a header: role, channel name, recipient, content type
            return "", ""
        out = ("", "")
        if self.state == self.BODY:  # bytes held back by the decoder before the marker
            before = _strip_marker(text, marker)
            out = (before, "") if self.channel in REASONING_CHANNELS else ("", before)
        if marker == "<|channel|>":
            self.state, self.buf = self.CHANNEL, ""
        elif marker == "<|message|>":
            if self.state == self.CHANNEL:
                words = self.buf.split()
                self.channel = words[0] if words else ""
            self.state, self.buf = self.BODY, ""
        else:  # <|start|>, <|end|>, <|return|>, <|call|>
            self.state, self.channel, self.buf = self.HEADER, "", ""
        return out


def reasoning_parser(tokenizer):
    """The thinking format this tokenizer's vocabulary has marker tokens for, or None."""
    tid = tokenizer.token_to_id
    harmony = {m: tid(m) for m in HARMONY + HARMONY_ENDS}
    if tokenizer.harmony:
        ids = {m: i for m, i in harmony.items() if i is not None}
        return Harmony(ids, lambda t: tokenizer.decode([t]))
    o, c = tid(THINK_OPEN), tid(THINK_CLOSE)
    if o is not None and c is not None:
        return ThinkTags(o, c)
    return None


class ReplySplit:
    """A chat reply's ids -> text, token by token, split into (reasoning, content) by the
    tokenizer's thinking format (`parser` None: all content). `feed` returns the token's
    decoded piece too (logprobs report it); a stop id's text is neither reasoning nor content;
    `last` flushes characters the detokeniser still holds."""

    def __init__(self, tokenizer, parser, prompt_ids):
        self.decoder = tokenizer.stream_decoder()
        self.parser = parser.start(prompt_ids) if parser is not None else None

    def feed(self, token_id: int, stop_id: bool = False, last: bool = False) -> tuple[str, str, str]:
        piece = "" if stop_id else self.decoder.feed([token_id])
        if last:
            piece += self.decoder.flush()
        if self.parser is None:
            return piece, "", piece
        reasoning, content = self.parser.feed(token_id, piece)
        return piece, reasoning, content
