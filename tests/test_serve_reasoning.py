"""Reasoning content through the real `openai` client: a Qwen3-style thinking template
(`<think>...</think>`, `enable_thinking` through chat_template_kwargs) and a harmony template
(gpt-oss channels), each with `reasoning_content` apart from `content`, streamed and not.

The models here are a character-level tokenizer built in the test (the markers are added
tokens, as in the real vocabularies) and a scripted target: whatever the prompt, its greedy
continuation is a fixed token script, so the expected split is known exactly.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
from tokenizers import Tokenizer as HFTokenizer, decoders, models  # noqa: E402

from dflash2_numba.serve.engine import Engine  # noqa: E402
from dflash2_numba.serve.reasoning import Harmony, ThinkTags, reasoning_parser  # noqa: E402
from dflash2_numba.serve.server import Server  # noqa: E402
from dflash2_numba.tokenizer import Tokenizer  # noqa: E402

from test_serve import WAIT_S, wait_until  # noqa: E402

CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?:\n")
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
OPEN_TEMPLATE = (  # thinking models whose template opens the block (Qwen3-*-Thinking-2507 style)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}")
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]


def write_tokenizer(d, template: str, added: list[str], specials: list[str], eos: str):
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    hf.decoder = decoders.Fuse()
    hf.add_tokens(added)
    hf.add_special_tokens(specials)
    d.mkdir(parents=True)
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "chat_template": template}))
    tok = Tokenizer.from_dir(d)
    return tok


class ScriptCache:
    def __init__(self, max_len):
        self.max_len, self.length, self.prompt_len = max_len, 0, None

    def commit(self, n):
        assert 0 <= n <= self.length
        self.length = n


class ScriptTarget:
    """Greedy continuation of any prompt = `script` then eos (logits: a peak at the next token)."""

    def __init__(self, tokenizer, script: list[int]):
        V = tokenizer.vocab_size
        self.tokenizer, self.script, self.valid_vocab = tokenizer, script, V
        self.eos = sorted(tokenizer.stop_ids())[0]
        self.config = SimpleNamespace(vocab_size=V, eos_token_id=[self.eos], max_position_embeddings=4096,
                                      num_hidden_layers=1, hidden_size=4)

    def new_cache(self, max_len):
        return ScriptCache(max_len)

    def forward(self, ids, cache, tap_layers=(), last_only=False):
        ids = np.asarray(ids).reshape(-1)
        if cache.prompt_len is None:
            cache.prompt_len = len(ids)
        V = self.config.vocab_size
        logits = np.zeros((len(ids), V), np.float32)
        for i in range(len(ids)):
            g = cache.length + i + 1 - cache.prompt_len  # index of the generated token this row predicts
            logits[i, self.script[g] if 0 <= g < len(self.script) else self.eos] = 20.0
        cache.length += len(ids)
        return (logits[-1:] if last_only else logits), None


def serve(tok, script_text):
    script = tok.encode(script_text, add_special_tokens=False)
    s = Server(Engine(lambda: (ScriptTarget(tok, script), None), warm=False), "m", port=0, grace_s=1.0)
    s.start_in_thread()
    wait_until(lambda: httpx.get(s.url + "/health").status_code == 200, "the server to be ready")
    return s


def ask(server, stream: bool, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    args = dict(model="m", messages=[{"role": "user", "content": "Why?"}], max_tokens=200, temperature=0, **kw)
    if not stream:
        m = client.chat.completions.create(**args).choices[0].message
        return getattr(m, "reasoning_content", None), m.content
    reasoning, content, n_chunks = "", "", 0
    for ch in client.chat.completions.create(stream=True, **args):
        for c in ch.choices:
            extra = c.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            n_chunks += 1
    return reasoning or None, content


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("qwen") / "m", QWEN_TEMPLATE, ["<think>", "</think>"],
                           ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


@pytest.fixture(scope="module")
def qwen(qwen_tok):
    s = serve(qwen_tok, "<think>\nLet me see. It is 42.\n</think>\n\nThe answer is 42!")
    yield s
    s.shutdown()
    s.join(WAIT_S)


@pytest.fixture(scope="module")
def qwen_no_think(qwen_tok):
    s = serve(qwen_tok, "The answer is 42!")
    yield s
    s.shutdown()
    s.join(WAIT_S)


@pytest.fixture(scope="module")
def opens_in_prompt(tmp_path_factory):
    tok = write_tokenizer(tmp_path_factory.mktemp("open") / "m", OPEN_TEMPLATE, ["<think>", "</think>"],
                          ["<|im_start|>", "<|im_end|>"], "<|im_end|>")
    s = serve(tok, "I ponder.</think>The answer.")
    yield s
    s.shutdown()
    s.join(WAIT_S)


@pytest.mark.parametrize("stream", [False, True])
def test_enable_thinking_reaches_a_template_that_opens_the_block(opens_in_prompt, stream):
    on = ask(opens_in_prompt, stream, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on == ("I ponder.", "The answer.")
    off = ask(opens_in_prompt, stream)  # the server's default: thinking off, nothing opened
    assert off == (None, "I ponder.The answer.")


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    tok = write_tokenizer(tmp_path_factory.mktemp("harmony") / "m", HARMONY_TEMPLATE, [], HARMONY_SPECIALS,
                          "<|return|>")
    s = serve(tok, "<|channel|>analysis<|message|>User asks why. Think.<|end|>"
                   "<|start|>assistant<|channel|>final<|message|>Because, friend.<|return|>")
    yield s
    s.shutdown()
    s.join(WAIT_S)


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_thinking_is_reasoning_content(qwen, stream):
    reasoning, content = ask(qwen, stream, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert reasoning == "\nLet me see. It is 42.\n"
    assert content == "\n\nThe answer is 42!"


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_thinking_off_closes_the_block_in_the_prompt(qwen_no_think, stream):
    # the template closed an empty block in the prompt: what comes is content
    reasoning, content = ask(qwen_no_think, stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (reasoning, content) == (None, "The answer is 42!")


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_analysis_channel_is_reasoning_content(harmony, stream):
    reasoning, content = ask(harmony, stream)
    assert (reasoning, content) == ("User asks why. Think.", "Because, friend.")


def test_parsers_are_chosen_by_the_vocabulary(tmp_path):
    q = write_tokenizer(tmp_path / "q", QWEN_TEMPLATE, ["<think>", "</think>"], ["<|im_end|>"], "<|im_end|>")
    h = write_tokenizer(tmp_path / "h", HARMONY_TEMPLATE, [], HARMONY_SPECIALS, "<|return|>")
    n = write_tokenizer(tmp_path / "n", QWEN_TEMPLATE, [], ["<|im_end|>"], "<|im_end|>")
    assert isinstance(reasoning_parser(q), ThinkTags) and isinstance(reasoning_parser(h), Harmony)
    assert reasoning_parser(n) is None
    # a template that opens the block itself: generation starts inside it
    p = reasoning_parser(q).start(q.encode("<|im_end|>x<think>\n", add_special_tokens=False))
    assert p.feed(q.token_to_id("a"), "a") == ("a", "")
    assert p.feed(q.token_to_id("</think>"), "</think>") == ("", "")
    assert p.feed(q.token_to_id("b"), "b") == ("", "b")
    p = reasoning_parser(q).start(q.encode("<think>x</think>\n", add_special_tokens=False))
    assert p.feed(q.token_to_id("a"), "a") == ("", "a")
