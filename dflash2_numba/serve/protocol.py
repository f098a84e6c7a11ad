"""The OpenAI request fields the server reads, checked into a typed `GenRequest`, and the typed
errors that become OpenAI error bodies `{"error": {"message", "type", "param", "code"}}`.

    req = parse_request(body, kind="chat" | "completion", model_ids={...}, tokenizer=tok)
    raise BadRequest("...", param="top_p", code="invalid_value")    # -> 400 JSON body

    reqs = parse_requests(body, ...)   # completions: one GenRequest per prompt (index 0, 1, ...)

Read: model, messages (chat) / prompt (completions: a string, a list of token ids, or a list of
either: each prompt is its own choice), max_completion_tokens > max_tokens, temperature
(default 1, as OpenAI), top_p, top_k, seed, stop (a string or up to 16), stream,
stream_options.include_usage, chat_template_kwargs (chat), reasoning_effort (chat: "low" |
"medium" | "high", for a template that reads it, as gpt-oss's), logprobs (completions: top N,
0..20; chat: a boolean, with top_logprobs N), echo (completions; with max_tokens 0 it scores
the prompt only), the `block_size` extension (runtime Q of this request). n = 1 and zero
penalties are accepted as the no-ops they are; any other field is a named 400
(`unsupported_parameter`), never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import (ChatTemplateError, ChatTemplateMissingError, ContextLengthError, DFlashError,
                      GenerationArgumentError)
from ..decode.logprobs import MAX_TOP_LOGPROBS
from ..decode.sampling import SamplingParams
from ..decode.width import AUTO

DEFAULT_MAX_TOKENS = 256  # when a request names no max_tokens (capped by the context left)
MAX_STOP_STRINGS = 16  # OpenAI allows 4; evaluators (lm-eval's `until` + eos) may send more, as vLLM accepts
MAX_PROMPTS = 64  # prompts in one completions request (each its own choice)
REASONING_EFFORTS = ("low", "medium", "high")  # what gpt-oss's template prints as "Reasoning: ..."

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                 "stream_options", "block_size", "draft_window", "n", "logprobs", "presence_penalty", "frequency_penalty",
                 "user"}
FIELDS = {"chat": COMMON_FIELDS | {"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs",
                                    "reasoning_effort"},
          "completion": COMMON_FIELDS | {"prompt", "echo"}}


# ---------------------------------------------------------------- typed errors -> HTTP
class RequestError(DFlashError):
    """A refusal sent to the client as an OpenAI error body with `status`."""
    status, type = 400, "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(RequestError):
    status = 400


class ModelNotFound(RequestError):
    status = 404


class QueueFull(RequestError):
    status, type = 429, "rate_limit_error"
    retry_after_s = 1


class Unavailable(RequestError):
    status, type = 503, "unavailable_error"


class ServerError(RequestError):
    status, type = 500, "server_error"


def as_request_error(e: DFlashError) -> RequestError:
    """A refusal of the decoding core (bad sampling values, context, chat template) as a 400."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, ContextLengthError):
        return BadRequest(str(e), param="max_tokens", code="context_length_exceeded")
    if isinstance(e, (ChatTemplateError, ChatTemplateMissingError)):
        return BadRequest(str(e), param="messages", code="chat_template_error")
    if isinstance(e, GenerationArgumentError):
        return BadRequest(str(e), code="invalid_value")
    return BadRequest(f"{type(e).__name__}: {e}", code="refused")


# ---------------------------------------------------------------- the request
@dataclass
class GenRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    block_size: int | str | None = None  # "auto" | Q | None (the server's default)
    draft_window: int | None = None  # the draft attends to the last N context positions (None: the server's)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top N alternatives per token (0: the token's own only); None: off
    echo: bool = False  # completions: the prompt (and its logprobs) comes back before the output
    index: int = 0  # this prompt's choice index
    enable_thinking: bool = False  # chat: what the template was rendered with


def _typed(body: dict, name: str, types, what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"'{name}' must be {what}, got {value!r}", param=name, code="invalid_type")
    if not isinstance(value, types):
        raise BadRequest(f"'{name}' must be {what}, got {type(value).__name__} {value!r}", param=name,
                         code="invalid_type")
    return value


def _block_size(body: dict) -> int | str | None:
    """The `block_size` extension: "auto" or an integer (2..B, checked by the engine)."""
    if body.get("block_size") == AUTO:
        return AUTO
    return _typed(body, "block_size", int, 'an integer or "auto"', None)


def _refuse_unsupported(body: dict, kind: str) -> None:
    for name in body:
        if name not in FIELDS[kind]:
            raise BadRequest(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if _typed(body, "n", int, "an integer", 1) != 1:
        raise BadRequest("'n' > 1 is not supported (one choice per request)", param="n", code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if _typed(body, name, (int, float), "a number", 0) != 0:
            raise BadRequest(f"'{name}' other than 0 is not supported (it would change the target "
                             "distribution the verifier samples)", param=name, code="unsupported_parameter")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", param="messages", code="invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", param="messages",
                                     code="unsupported_parameter")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise BadRequest(f"messages[{i}]: {sorted(extra)[0]!r} is not supported", param="messages",
                             code="unsupported_parameter")
        out.append({"role": m["role"], "content": content})
    return out


def _check_ids(ids: list[int], vocab: int, param: str) -> list[int]:
    if not ids:
        raise BadRequest("the prompt is empty (0 tokens)", param=param)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param=param)
    return ids


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def chat_prompt(body: dict, tokenizer) -> tuple[list[int], bool]:
    """The chat template rendered with `chat_template_kwargs` -> (prompt ids, enable_thinking)."""
    messages = _messages(body)
    kwargs = dict(_typed(body, "chat_template_kwargs", dict, "an object", {}))
    thinking = kwargs.pop("enable_thinking", False)
    if not isinstance(thinking, bool):
        raise BadRequest(f"chat_template_kwargs.enable_thinking must be a boolean, got {thinking!r}",
                         param="chat_template_kwargs", code="invalid_type")
    effort = _typed(body, "reasoning_effort", str, "a string", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise BadRequest(f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
                             param="reasoning_effort", code="invalid_value")
        if not tokenizer.takes("reasoning_effort"):
            raise BadRequest("'reasoning_effort' is not supported by this model (its chat template does not read "
                             "reasoning_effort)", param="reasoning_effort", code="unsupported_parameter")
        kwargs.setdefault("reasoning_effort", effort)  # chat_template_kwargs.reasoning_effort, if given, wins
    text = tokenizer.apply_chat_template(messages, enable_thinking=thinking, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False), thinking  # the template holds the specials


def completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    """`prompt`: a string, a list of token ids, or a non-empty list of strings / id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt and _is_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request",
                             param="prompt", code="invalid_value")
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                out.append(tokenizer.encode(p))
            elif isinstance(p, list) and _is_ids(p):
                out.append(list(p))
            else:
                raise BadRequest(f"prompt[{i}] must be a string or a list of token ids, got {type(p).__name__}",
                                 param="prompt", code="invalid_type")
        return out
    raise BadRequest("'prompt' must be a string, a list of token ids, or a non-empty list of those",
                     param="prompt", code="invalid_type")


def _logprobs(body: dict, kind: str) -> int | None:
    """Completions: logprobs = N (top N); chat: logprobs true (+ top_logprobs N). None: off."""
    if kind == "chat":
        on = _typed(body, "logprobs", bool, "a boolean", False)
        top = _typed(body, "top_logprobs", int, "an integer", None)
        if top is not None and not on:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        n, name = (top or 0) if on else None, "top_logprobs"
    else:
        n, name = _typed(body, "logprobs", int, "an integer (the number of top alternatives)", None), "logprobs"
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'{name}' must be in 0..{MAX_TOP_LOGPROBS}, got {n}", param=name, code="invalid_value")
    return n


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                         "strings", param="stop", code="invalid_value")
    return stop


def parse_requests(body, kind: str, model_ids, tokenizer, vocab: int) -> list[GenRequest]:
    """A decoded JSON body -> one GenRequest per prompt (chat: one), or a RequestError naming
    the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    _refuse_unsupported(body, kind)
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest("'model' is required (a string; see GET /v1/models)", param="model", code="invalid_type")
    if model not in model_ids:
        raise ModelNotFound(f"the model {model!r} does not exist; this server has {sorted(model_ids)}",
                            param="model", code="model_not_found")
    stream = _typed(body, "stream", bool, "a boolean", False)
    options = _typed(body, "stream_options", dict, "an object", None)
    if options is not None and not stream:
        raise BadRequest("'stream_options' is only allowed with stream: true", param="stream_options")
    if options is not None and set(options) - {"include_usage"}:
        raise BadRequest(f"stream_options.{sorted(set(options) - {'include_usage'})[0]} is not supported",
                         param="stream_options", code="unsupported_parameter")
    include_usage = bool(_typed(options or {}, "include_usage", bool, "a boolean", False))
    echo = bool(_typed(body, "echo", bool, "a boolean", False))
    logprobs = _logprobs(body, kind)
    max_tokens = _typed(body, "max_completion_tokens", int, "an integer", None) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int, "an integer", None)
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise BadRequest(f"'max_tokens' must be >= 1 (0 only with echo: true, to score the prompt), got "
                         f"{max_tokens}", param="max_tokens", code="invalid_value")
    thinking = False
    try:
        sampling = SamplingParams(float(_typed(body, "temperature", (int, float), "a number", 1.0)),
                                  _typed(body, "top_k", int, "an integer", 0),
                                  float(_typed(body, "top_p", (int, float), "a number", 1.0)),
                                  _typed(body, "seed", int, "an integer", None))
        if kind == "chat":
            ids, thinking = chat_prompt(body, tokenizer)
            prompts = [_check_ids(ids, vocab, "messages")]
        else:
            prompts = [_check_ids(p, vocab, "prompt") for p in completion_prompts(body, tokenizer)]
    except DFlashError as e:
        raise as_request_error(e) from None
    block_size, stop = _block_size(body), _stop(body)
    draft_window = _typed(body, "draft_window", int, "an integer", None)
    return [GenRequest(kind, model, ids, max_tokens, sampling, block_size=block_size, draft_window=draft_window,
                       stop=stop, stream=stream,
                       include_usage=include_usage, logprobs=logprobs, echo=echo, index=i,
                       enable_thinking=thinking)
            for i, ids in enumerate(prompts)]


def parse_request(body, kind: str, model_ids, tokenizer, vocab: int) -> GenRequest:
    """`parse_requests` for a body with one prompt."""
    reqs = parse_requests(body, kind, model_ids, tokenizer, vocab)
    if len(reqs) != 1:
        raise BadRequest(f"expected one prompt, got {len(reqs)}", param="prompt")
    return reqs[0]
