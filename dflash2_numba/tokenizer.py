"""Tokenizer, stop set, chat template and streaming detokenisation of a HF model directory.

    tok = Tokenizer.from_dir("models/Qwen3-8B")
    ids = tok.encode_prompt("Hi", chat=True)           # chat template rendered, then encoded
    tok.stop_ids(extra=[7])                            # generation_config ∪ config eos ∪ extra (§5.2)
    tok.takes("reasoning_effort")                      # does the chat template read this variable?
    dec = tok.stream_decoder(); dec.feed([..]); dec.flush()

Files read: `tokenizer.json` (required), `tokenizer_config.json` (chat_template, bos/eos token
strings, add_bos_token), `chat_template.jinja`, `generation_config.json` and `config.json`
(`eos_token_id`, an int or a list). Chat templates are rendered the way Hugging Face renders
them: a jinja2 ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks) with
`raise_exception`, `tojson`, `strftime_now` and the special-token strings.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .config_checks import get_bool
from .errors import ChatTemplateError, ChatTemplateMissingError, CheckpointNotFoundError, ConfigError
from .input_files import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, model_file, read_json_object, read_text_file


def _read_json(path: Path) -> dict | None:
    """Parsed JSON object, or None when the (optional) file is absent (a dangling symlink
    counts as absent; a device or FIFO in its place is refused, not read)."""
    if not path.exists():
        return None
    return read_json_object(path, MAX_CONFIG_BYTES, ConfigError)


def _eos_ids(obj: dict | None, path: Path) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: int -> (int,), list -> tuple, absent/null -> ()."""
    value = (obj or {}).get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)


def _token_string(value) -> str | None:
    """tokenizer_config token entry: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value, path: Path) -> str | None:
    """chat_template is a string, or (older files) a list of {"name", "template"}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = [t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"]
        if named and isinstance(named[0], str):
            return named[0]
    raise ConfigError(f"{path}: chat_template must be a string or a list with a 'default' "
                      f"entry, got {type(value).__name__}")


# ---------------------------------------------------------------- chat template rendering
def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF overrides jinja's tojson, which would HTML-escape characters inside the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment Hugging Face renders chat templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """A template compiled in the sandboxed environment Hugging Face uses."""
    return _environment().from_string(source)


# harmony (gpt-oss): a message is <|start|>{header}<|message|>{body}<|end|>; <|end|> closes a
# message (the analysis one, say) and the reply goes on, so it is never a stop of the model
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
MESSAGE_END = "<|end|>"


# ---------------------------------------------------------------- the tokenizer
class Tokenizer:
    """A `tokenizers` tokenizer plus what a decoder needs from the model directory."""

    def __init__(self, hf_tokenizer: _HFTokenizer, *, model_dir: Path | None = None,
                 chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool = False,
                 generation_eos_ids: Sequence[int] = (), config_eos_ids: Sequence[int] = (),
                 chat_template_source: str | None = None):
        self.hf = hf_tokenizer
        self.chat_template_source = chat_template_source  # the file it came from (for errors)
        self.model_dir = model_dir
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.generation_eos_ids = tuple(generation_eos_ids)
        self.config_eos_ids = tuple(config_eos_ids)
        self._template: jinja2.Template | None = None
        self._variables: frozenset[str] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointNotFoundError(f"{model_dir}: model directory does not exist")
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.exists():
            raise CheckpointNotFoundError(f"{tok_path}: tokenizer.json not found in {model_dir}")
        # read here (bounded, a regular file), parsed by `tokenizers` from the string
        text = read_text_file(model_file(tok_path, "tokenizer.json"), MAX_TOKENIZER_BYTES, "", ConfigError)
        try:
            hf = _HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError(f"{tok_path}: cannot load tokenizer ({e})") from e
        tc_path = model_dir / "tokenizer_config.json"
        tok_config = _read_json(tc_path) or {}
        # chat_template.jinja (what recent transformers save) wins over the JSON entry
        jinja_path = model_dir / "chat_template.jinja"
        has_jinja = jinja_path.exists()
        template = (read_text_file(model_file(jinja_path, "chat_template.jinja"), MAX_CONFIG_BYTES, "",
                                   ConfigError) if has_jinja
                    else _pick_template(tok_config.get("chat_template"), tc_path))
        gen_path, cfg_path = model_dir / "generation_config.json", model_dir / "config.json"
        return cls(
            hf, model_dir=model_dir, chat_template=template,
            bos_token=_token_string(tok_config.get("bos_token")),
            eos_token=_token_string(tok_config.get("eos_token")),
            add_bos_token=get_bool(tok_config, "add_bos_token", str(tc_path), default=False),  # "false" is truthy
            generation_eos_ids=_eos_ids(_read_json(gen_path), gen_path),
            config_eos_ids=_eos_ids(_read_json(cfg_path), cfg_path),
            chat_template_source=(f"{jinja_path}" if has_jinja
                                  else f"{tc_path}: chat_template"),
        )

    # ---- ids <-> text
    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (added tokens included); config.vocab_size may be larger."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.hf.token_to_id(self.bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens as in HF: the tokenizer's post-processor
        (e.g. Llama's BOS); with `add_bos_token` set, BOS is prepended if it did not."""
        return self.with_bos(self.hf.encode(text, add_special_tokens=add_special_tokens).ids, add_special_tokens)

    def with_bos(self, ids: list[int], add_special_tokens: bool = True) -> list[int]:
        """`add_bos_token`: BOS prepended to the tokenizer's ids when its post-processor did not."""
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(int(token_id))

    @property
    def harmony(self) -> bool:
        """The vocabulary has harmony's message markers as tokens (gpt-oss)."""
        return all(self.hf.token_to_id(m) is not None for m in HARMONY_MARKERS)

    def stop_ids(self, extra: Iterable[int] = ()) -> frozenset[int]:
        """generation_config eos ∪ config.json eos ∪ `extra` (spec §5.2). When neither file
        names an eos id, the tokenizer_config eos_token (if it is a known token) stands in.
        In a harmony vocabulary `<|end|>` is left out of what the files name (a file that lists
        it would end every reply after its analysis message); `extra` is kept as given."""
        ids = set(self.generation_eos_ids) | set(self.config_eos_ids)
        if not ids and self.eos_token is not None and self.hf.token_to_id(self.eos_token) is not None:
            ids.add(self.hf.token_to_id(self.eos_token))
        if self.harmony:
            ids.discard(self.hf.token_to_id(MESSAGE_END))
        return frozenset(ids | {int(i) for i in extra})

    # ---- chat
    def takes(self, variable: str) -> bool:
        """The chat template reads `variable` (e.g. gpt-oss's reasoning_effort, Qwen3's
        enable_thinking); False without a template."""
        if self.chat_template is None:
            return False
        if self._variables is None:
            try:
                ast = _environment().parse(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise self._syntax_error(e) from e
            self._variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        return variable in self._variables

    def apply_chat_template(self, messages: str | list[dict], enable_thinking: bool = False,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the model's own chat template. A str is one user message."""
        if self.chat_template is None:
            where = self.model_dir if self.model_dir is not None else "<tokenizer>"
            raise ChatTemplateMissingError(
                f"{where}: no chat template (looked for 'chat_template' in "
                f"{Path(where) / 'tokenizer_config.json'} and for {Path(where) / 'chat_template.jinja'}); "
                "run without --chat or add a template")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        where = self.chat_template_source or "chat_template"
        if self._template is None:
            try:
                self._template = compile_chat_template(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise self._syntax_error(e) from e
        context = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                       enable_thinking=enable_thinking, bos_token=self.bos_token or "",
                       eos_token=self.eos_token or "")
        try:
            return self._template.render(**{**context, **kwargs})  # e.g. tools=..., documents=...
        except Exception as e:  # the template is the model's code: raise_exception(...), 1/0, ...
            raise ChatTemplateError(f"{where}: the chat template failed while rendering: "
                                    f"{type(e).__name__}: {e}") from e

    def _syntax_error(self, e: jinja2.TemplateSyntaxError) -> ChatTemplateError:
        return ChatTemplateError(f"{self.chat_template_source or 'chat_template'}: the chat template does not "
                                 f"compile: {e.message} (template line {e.lineno})")

    def encode_prompt(self, prompt: str | list[dict], chat: bool = False,
                      enable_thinking: bool = False, **template_kwargs) -> list[int]:
        """Prompt ids. chat=True renders the template (with `template_kwargs`, e.g.
        reasoning_effort="high") and encodes WITHOUT special tokens (the template already
        holds them, as in HF), so Llama does not get two BOS."""
        if chat:
            text = self.apply_chat_template(prompt, enable_thinking=enable_thinking, **template_kwargs)
            return self.encode(text, add_special_tokens=False)
        if not isinstance(prompt, str):
            raise TypeError("a message list needs chat=True")
        return self.encode(prompt)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


# ---------------------------------------------------------------- streaming detokenisation
class StreamDecoder:
    """Incremental detokeniser: `feed(ids)` returns only newly completed text.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character; decoding such a prefix
    yields U+FFFD. We decode a window starting a few tokens back (`prefix`), which also keeps
    decoders that treat the first token specially (leading spaces) consistent, and emit the
    new suffix only when it does not end in U+FFFD. `flush()` emits whatever is held back.
    The concatenation of everything returned equals `decode(all ids)` for byte-level BPE.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: a token boundary at a complete character
        self._read = 0    # ids[:read] have been emitted as text

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, ids: int | Iterable[int]) -> str:
        self.ids.extend([int(ids)] if isinstance(ids, int) else [int(i) for i in ids])
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        # Try all new ids, then drop trailing ones: a partial character is at most 3 bytes,
        # so at most 3 trailing tokens, when several ids arrive at once (a speculative step).
        for end in range(len(self.ids), max(self._read, len(self.ids) - 4), -1):
            text = self._decode(self.ids[self._prefix:end])
            if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
                self._prefix, self._read = self._read, end
                return text[len(prefix_text):]
        return ""  # nothing new, or a character still incomplete: hold it back

    def flush(self) -> str:
        """Everything not yet emitted (a dangling partial character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):]
