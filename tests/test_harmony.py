"""Harmony chat (gpt-oss): the real chat template, the stop set, and a reply that runs through
`<|end|>` into its final message, via `generate --chat` and via the server with the `openai`
client.

The model is tests/harmony_fixture.py's: gpt-oss's vocabulary ids, tokenizer / generation
files and chat template, and a hand-built Qwen3 target whose greedy reply to the rendered
prompt is `<|channel|>analysis<|message|>User asks why. Answer briefly<|end|><|start|>assistant
<|channel|>final<|message|>Because, friend!<|return|>`. A stop on `<|end|>` (200007) would cut
the reply after its analysis; a prompt that does not end in the template's `<|start|>assistant`
gets a different reply.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from click.testing import CliRunner

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.cli import main
from dflash2_numba.decode.drafter import OracleDrafter
from dflash2_numba.serve.protocol import BadRequest, parse_requests
from dflash2_numba.serve.reasoning import ReplySplit, reasoning_parser
from dflash2_numba.tokenizer import Tokenizer

from harmony_fixture import (ANALYSIS, CALL, END, ENDOFTEXT, FINAL, RETURN, TEMPLATE_PATH, reply_ids,
                             write_harmony_target)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_harmony_target(tmp_path_factory.mktemp("harmony") / "gpt-oss-tiny")


@pytest.fixture(scope="module")
def target(model_dir):
    return dn.load_target(model_dir)


def expected_prompt(effort: str, developer: str = "Be brief.") -> str:
    """The harmony prompt as OpenAI's format guide writes it (system, developer, user, then the
    assistant's header left open), written out by hand."""
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            "Knowledge cutoff: 2024-06\n"
            f"Current date: {datetime.now().strftime('%Y-%m-%d')}\n\n"
            f"Reasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
            f"<|start|>developer<|message|># Instructions\n\n{developer}\n\n<|end|>"
            "<|start|>user<|message|>Why?<|end|>"
            "<|start|>assistant")


# ---------------------------------------------------------------- template and stops
@pytest.mark.parametrize("effort", [None, "high"])
def test_the_template_renders_harmony_as_transformers_does(model_dir, effort):
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.from_dir(model_dir)
    kw = {} if effort is None else {"reasoning_effort": effort}
    ours = tok.apply_chat_template(MESSAGES, **kw)
    assert ours == expected_prompt(effort or "medium")  # the template's default effort is medium
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"),
                                              chat_template=TEMPLATE_PATH.read_text(encoding="utf-8"))
    theirs = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kw)
    assert ours == theirs
    ids = tok.encode_prompt(MESSAGES, chat=True, **kw)
    assert ids == hf.encode(theirs, add_special_tokens=False)
    assert ids[-2:] == [tok.token_to_id("<|start|>"), tok.token_to_id("assistant")]
    # a developer message is the same slot as a system one
    dev = [{"role": "developer", "content": "Be brief."}, MESSAGES[1]]
    assert tok.apply_chat_template(dev, **kw) == ours


def test_takes_reads_the_template_variables(model_dir, tmp_path):
    assert Tokenizer.from_dir(model_dir).takes("reasoning_effort")
    qwen = Tokenizer.from_dir(tiny.write_target(tmp_path / "q", num_hidden_layers=1))
    assert qwen.takes("enable_thinking") and not qwen.takes("reasoning_effort")


def _with(model_dir, tmp_path, gen=None, cfg=None, tc=None) -> Tokenizer:
    """The fixture's tokenizer files with generation_config / config / tokenizer_config replaced."""
    d = tmp_path
    d.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        (d / name).write_bytes((model_dir / name).read_bytes())
    for name, obj in (("generation_config.json", gen), ("config.json", cfg), ("tokenizer_config.json", tc)):
        (d / name).write_text(json.dumps(obj if obj is not None else json.loads((model_dir / name).read_text())))
    return Tokenizer.from_dir(d)


def test_stops_are_return_endoftext_call_never_end(model_dir, tmp_path):
    tok = Tokenizer.from_dir(model_dir)
    assert tok.harmony and tok.token_to_id("<|end|>") == END
    assert tok.stop_ids() == {RETURN, ENDOFTEXT, CALL}  # generation_config ∪ config eos
    # files that name <|end|> (a re-upload's "fix") or leave only tokenizer_config's eos_token
    assert _with(model_dir, tmp_path / "a", gen={"eos_token_id": [RETURN, END]}).stop_ids() == {RETURN}
    assert _with(model_dir, tmp_path / "b", gen={}, cfg={"eos_token_id": END}).stop_ids() == set()
    assert _with(model_dir, tmp_path / "c", gen={}, cfg={}, tc={"eos_token": "<|end|>"}).stop_ids() == set()
    assert _with(model_dir, tmp_path / "d", gen={}, cfg={}).stop_ids() == {RETURN}  # eos_token <|return|>
    assert tok.stop_ids(extra=[END]) == {RETURN, ENDOFTEXT, CALL, END}  # --stop-token 200007: asked for


# ---------------------------------------------------------------- the split, message by message
@pytest.mark.parametrize("reply, expected", [
    # (reasoning, content): analysis then final; then commentary; a cut-off analysis; analysis only
    ("<|channel|>analysis<|message|>Two\nsteps<|end|><|start|>assistant<|channel|>final<|message|>"
     "Done.\nBye", ("Two\nsteps", "Done.\nBye")),
    ("<|channel|>analysis<|message|>Two\nsteps<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Done.\nBye", ("Two\nsteps", "Done.\nBye")),
    ("<|channel|>analysis<|message|>Two\nst", ("Two\nst", "")),
    ("<|channel|>analysis<|message|>Two\nsteps<|end|>", ("Two\nsteps", "")),
])
def test_split_by_channel(target, reply, expected):
    tok = target.tokenizer
    prompt = tok.encode_prompt(MESSAGES, chat=True)
    split = ReplySplit(tok, reasoning_parser(tok), prompt)
    ids = tok.encode(reply, add_special_tokens=False)
    parts = [split.feed(t, last=j == len(ids) - 1)[1:] for j, t in enumerate(ids)]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected


# ---------------------------------------------------------------- generate --chat
def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    return tiny.write_draft(tmp_path_factory.mktemp("harmony-draft") / "d", model_dir, kind="dflash2",
                            num_hidden_layers=1, block_size=4, mask_token_id=200000)


def test_generate_chat_runs_through_end_and_splits_the_reply(model_dir, target):
    r = run("generate", "--target", model_dir, "--prompt", "Why?", "--chat", "--max-new-tokens", 64)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == FINAL + "\n"  # the answer alone on stdout
    assert f"--- reasoning ---\n{ANALYSIS}\n--- end of reasoning ---\n" in r.stderr
    hidden = run("generate", "--target", model_dir, "--prompt", "Why?", "--chat", "--reasoning", "hide",
                 "--max-new-tokens", 64)
    assert hidden.stdout == FINAL + "\n" and ANALYSIS not in hidden.stderr


def test_generate_chat_json_with_a_draft(model_dir, draft_dir, target):
    r = run("generate", "--target", model_dir, "--draft", draft_dir, "--prompt", "Why?", "--chat",
            "--reasoning-effort", "low", "--max-new-tokens", 64, "--json", "-")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    want = reply_ids(target.tokenizer.hf)
    assert out["output_ids"] == want and END in want[:-1]  # decoded on past <|end|> ...
    assert out["finish_reason"] == "stop" and want[-1] == RETURN  # ... to <|return|>
    assert (out["reasoning"], out["content"]) == (ANALYSIS, FINAL)
    assert out["prompt_ids"] == target.tokenizer.encode_prompt(
        [{"role": "user", "content": "Why?"}], chat=True, reasoning_effort="low")
    raw = run("generate", "--target", model_dir, "--prompt", "Why?", "--chat", "--reasoning", "raw",
              "--max-new-tokens", 64)
    assert raw.stdout == target.tokenizer.decode(want) + "\n"


def test_reasoning_effort_needs_chat_and_a_template_that_reads_it(model_dir, tmp_path):
    r = run("generate", "--target", model_dir, "--prompt", "x", "--reasoning-effort", "low")
    assert r.exit_code == 2 and "needs --chat" in r.stderr
    qwen = tiny.write_target(tmp_path / "q", num_hidden_layers=1)
    r = run("generate", "--target", qwen, "--prompt", "x", "--chat", "--reasoning-effort", "low")
    assert r.exit_code == 2 and "does not read reasoning_effort" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- the server
try:  # the CLI tests above run without the serving extras
    import openai
except ImportError:
    openai = None
WAIT_S = 60  # bound on every wait of the server tests


@pytest.fixture(scope="module")
def server(target):
    """Speculative with an oracle draft (the target's own greedy chain), so accepted blocks
    hold <|end|> in their middle."""
    if openai is None:
        pytest.skip("the serve tests need the openai client")
    httpx = pytest.importorskip("httpx")
    from dflash2_numba.serve.engine import Engine
    from dflash2_numba.serve.server import Server
    from test_serve import wait_until

    s = Server(Engine(lambda: (target, OracleDrafter(target, block_size=8)), warm=False), "gpt-oss", port=0,
               grace_s=1.0)
    s.start_in_thread()
    wait_until(lambda: httpx.get(s.url + "/health").status_code == 200, "the server to be ready")
    yield s
    s.shutdown()
    s.join(WAIT_S)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def ask(server, **kw):
    return client(server).chat.completions.create(model="gpt-oss", messages=MESSAGES, max_tokens=64,
                                                  temperature=0, **kw)


def test_server_reasoning_content_and_content(server):
    r = ask(server)
    m, choice = r.choices[0].message, r.choices[0]
    assert (m.model_extra.get("reasoning_content"), m.content) == (ANALYSIS, FINAL)
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == 20
    assert r.model_extra["timings"]["tau"] > 1  # drafted blocks were accepted


def test_server_streams_reasoning_then_content(server):
    reasoning, content, finish, order = "", "", None, []
    for ch in ask(server, stream=True):
        for c in ch.choices:
            r = (c.delta.model_extra or {}).get("reasoning_content") or ""
            reasoning, content = reasoning + r, content + (c.delta.content or "")
            order += ["r"] * bool(r) + ["c"] * bool(c.delta.content)
            finish = c.finish_reason or finish
    assert (reasoning, content, finish) == (ANALYSIS, FINAL, "stop")
    assert order == sorted(order, key=lambda k: k == "c")  # every reasoning delta before the content


def test_server_reasoning_effort_reaches_the_template(server, target):
    for effort in ("low", "high"):
        r = ask(server, reasoning_effort=effort)
        want = target.tokenizer.encode_prompt(MESSAGES, chat=True, reasoning_effort=effort)
        assert r.usage.prompt_tokens == len(want) and r.choices[0].message.content == FINAL
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort" and e.value.body["code"] == "invalid_value"


def test_reasoning_effort_refused_for_a_template_without_it(tmp_path):
    tok = Tokenizer.from_dir(tiny.write_target(tmp_path / "q", num_hidden_layers=1))
    body = {"model": "m", "messages": MESSAGES, "reasoning_effort": "low"}
    with pytest.raises(BadRequest) as e:
        parse_requests(body, "chat", {"m"}, tok, tok.vocab_size)
    assert e.value.param == "reasoning_effort" and e.value.code == "unsupported_parameter"
