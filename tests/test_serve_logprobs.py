"""Logprobs, echo and prompt batches of `dflash2-decode serve`, checked against an independent
reference: the embedded target loaded on the plain numpy backend (`device="numpy"`), ONE forward
over prompt + generated tokens, and a log-softmax written here in numpy. The generated tokens
come from the solo `stream_generate` of the same request (the server's contract).

Reported logprobs must equal the reference at every position, with and without a draft, greedy
and sampled (temperature / top-k change which tokens come out, never the numbers reported for
them); echo with max_tokens 0 scores the prompt, its first token null.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client")
httpx = pytest.importorskip("httpx", reason="the serve tests need httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import dflash2_numba as dn  # noqa: E402
from dflash2_numba.default import ASSET_DIR  # noqa: E402
from dflash2_numba.kernels.backend import set_threads  # noqa: E402
from dflash2_numba.serve.engine import Engine  # noqa: E402
from dflash2_numba.serve.server import Server  # noqa: E402

from test_serve import MODEL, WAIT_S, model_dir, wait_until  # noqa: E402,F401  (fixture re-used)

TOL = 2e-4  # numba f32 kernels vs the numpy f32 backend


def _server(model_dir, with_draft: bool) -> Server:
    def load():
        set_threads(1)
        target = dn.load_target(model_dir)
        return target, (dn.load_draft(ASSET_DIR / "dflash2", target) if with_draft else None)

    s = Server(Engine(load, max_running=4, max_waiting=8, block_size=4), MODEL, port=0, grace_s=2.0)
    s.start_in_thread()
    wait_until(lambda: httpx.get(s.url + "/health").status_code == 200, "the server to be ready")
    return s


@pytest.fixture(scope="module")
def servers(model_dir):
    out = {"draft": _server(model_dir, True), "plain": _server(model_dir, False)}
    yield out
    for s in out.values():
        s.shutdown()
        s.join(WAIT_S)


@pytest.fixture(scope="module")
def solo(model_dir):
    set_threads(1)
    target = dn.load_target(model_dir)
    return target, dn.load_draft(ASSET_DIR / "dflash2", target)


@pytest.fixture(scope="module")
def reference(model_dir):
    """ids -> [len(ids), V] log-probabilities, row i = log p(. | ids[:i+1]) (numpy backend)."""
    from dflash2_numba.families.qwen3 import TargetModel
    target = TargetModel.load(model_dir, device="numpy")

    def logp(ids):
        logits, _ = target.forward(np.asarray(ids, np.int64), target.new_cache(len(ids)))  # [n, V]
        x = logits.astype(np.float64)
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return logp


def post(server, path, body) -> dict:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def generated_ids(solo, prompt_ids, max_tokens, with_draft=True, **kw) -> list[int]:
    target, draft = solo
    draft = draft if with_draft else None  # a seeded run's tokens depend on the draft (its draws)
    return [t for s in dn.stream_generate(target, draft, prompt_ids=prompt_ids, max_new_tokens=max_tokens,
                                          block_size=4, **kw) for t in s.token_ids]


PROMPT = [12, 400, 37, 1501, 8, 90, 2222, 5, 61]


@pytest.mark.parametrize("which", ["draft", "plain"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7, "top_k": 40}])
def test_completion_logprobs_are_the_targets_log_softmax(servers, solo, reference, which, sampling):
    out = post(servers[which], "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "logprobs": 3,
                                                   "echo": True, **sampling})
    gen = generated_ids(solo, PROMPT, 24, with_draft=which == "draft", **sampling)
    ids = PROMPT + gen
    ref = reference(ids)  # row i: the distribution of ids[i+1]
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) == len(lp["tokens"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=TOL, rtol=0)
    tok = solo[0].tokenizer
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    for i in range(1, len(ids)):  # the top 3: the reference's 3 best ids (within the known vocabulary)
        row = ref[i - 1, :solo[0].valid_vocab]
        best = np.argsort(-row, kind="stable")[:3]
        assert list(lp["top_logprobs"][i].values()) == pytest.approx(row[best].tolist(), abs=TOL)
        assert list(lp["top_logprobs"][i]) == [tok.decode([int(j)]) for j in best]
    text = out["choices"][0]["text"]
    assert text == tok.decode(PROMPT) + tok.decode(gen)
    assert [text[o:o + 1] for o in lp["text_offset"]][:3] == [s[:1] for s in lp["tokens"][:3]]


def test_logprobs_with_and_without_draft_agree(servers):
    body = {"prompt": PROMPT, "max_tokens": 30, "logprobs": 2, "temperature": 0.0}
    a, b = (post(servers[w], "/v1/completions", body)["choices"][0] for w in ("draft", "plain"))
    assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    # bit for bit: the panel GEMV is row-invariant, so a verify row of a Q-row block (with a draft) and the
    # one-row step (without) compute the same logits
    assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
    assert a["logprobs"]["top_logprobs"] == b["logprobs"]["top_logprobs"]
    assert len(a["logprobs"]["tokens"]) == 30


def test_echo_with_max_tokens_0_scores_the_prompt(servers, reference, solo):
    out = post(servers["draft"], "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    c = out["choices"][0]
    ref = reference(PROMPT)
    assert c["logprobs"]["token_logprobs"][0] is None
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:],
                               [ref[i - 1, PROMPT[i]] for i in range(1, len(PROMPT))], atol=TOL, rtol=0)
    assert c["logprobs"]["top_logprobs"][1:] == [{} for _ in PROMPT[1:]]
    assert c["text"] == solo[0].tokenizer.decode(PROMPT) and c["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT)}


def test_a_prompt_longer_than_a_prefill_chunk_is_scored_across_chunks(servers, reference):
    from dflash2_numba.decode import step
    ids = [int(i) for i in np.random.default_rng(3).integers(1, 3999, step.PREFILL_CHUNK + 40)]
    out = post(servers["plain"], "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    got = out["choices"][0]["logprobs"]["token_logprobs"]
    ref = reference(ids)
    assert len(got) == len(ids) and got[0] is None
    np.testing.assert_allclose(got[1:], [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=TOL, rtol=0)


def test_prompt_list_gives_one_choice_per_prompt_in_order(servers, solo):
    prompts = [PROMPT, "The cat sat on", [5, 6, 7], "Once upon a time"]
    out = post(servers["draft"], "/v1/completions", {"prompt": prompts, "max_tokens": 12, "temperature": 0})
    tok = solo[0].tokenizer
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for c, p in zip(out["choices"], prompts):
        ids = p if isinstance(p, list) else tok.encode(p)
        assert c["text"] == tok.decode(generated_ids(solo, ids, 12, temperature=0.0))
    n_prompt = sum(len(p if isinstance(p, list) else tok.encode(p)) for p in prompts)
    assert out["usage"]["prompt_tokens"] == n_prompt and out["usage"]["completion_tokens"] == 4 * 12


def test_prompt_list_streams_every_choice(servers, solo):
    client = openai.OpenAI(base_url=servers["draft"].url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    prompts = [[5, 6, 7], PROMPT]
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for ch in client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    tok = solo[0].tokenizer
    assert texts == {i: tok.decode(generated_ids(solo, p, 10, temperature=0.0)) for i, p in enumerate(prompts)}
    assert finishes == {0: "length", 1: "length"} and usage.completion_tokens == 20


def test_chat_logprobs_and_top_logprobs(servers, solo, reference):
    client = openai.OpenAI(base_url=servers["draft"].url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=2)
    target = solo[0]
    prompt = target.tokenizer.encode(target.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    gen = generated_ids(solo, prompt, 16, temperature=0.0)
    ref = reference(prompt + gen)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [target.tokenizer.decode([t]) for t in gen]
    np.testing.assert_allclose([c.logprob for c in content],
                               [ref[len(prompt) - 1 + j, t] for j, t in enumerate(gen)], atol=TOL, rtol=0)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - TOL for c in content)
    streamed = []
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                             logprobs=True, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [c.logprob for c in ch.choices[0].logprobs.content]
    assert streamed == [c.logprob for c in content]


def test_lm_eval_loglikelihood_payload(servers, reference):
    """The exact body lm-eval's local-completions sends for log-likelihoods (batch of 2), read
    the way its parse_logprobs reads it: sum(token_logprobs[ctxlen:-1]), is_greedy via top_logprobs."""
    ctx, conts = [12, 400, 37, 1501], [[8, 90], [2222]]
    body = {"prompt": [ctx + c for c in conts], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = post(servers["draft"], "/v1/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, cont in zip(sorted(out["choices"], key=lambda c: c["index"]), conts):
        ids = ctx + cont
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1  # the prompt echoed, then the one generated token
        ref = reference(ids)
        want = sum(ref[i - 1, ids[i]] for i in range(len(ctx), len(ids)))
        assert sum(lps[len(ctx):-1]) == pytest.approx(want, abs=TOL)
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(lps[len(ctx):-1], tops))
        assert greedy == all(int(np.argmax(ref[i - 1, :4002])) == ids[i] for i in range(len(ctx), len(ids)))


def test_more_prompts_than_the_server_holds_is_refused(servers):
    r = httpx.post(servers["plain"].url + "/v1/completions",
                   json={"model": MODEL, "prompt": [[5, 6]] * 13, "max_tokens": 2}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"  # 4 running + 8 waiting: never
    r = httpx.post(servers["plain"].url + "/v1/completions",
                   json={"model": MODEL, "prompt": [[5, 6]] * 12, "max_tokens": 2}, timeout=WAIT_S)
    assert r.status_code == 200 and len(r.json()["choices"]) == 12


@pytest.mark.parametrize("stream", [False, True])
def test_echo_without_logprobs_returns_prompt_then_output(servers, solo, stream):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "stream": stream}
    tok = solo[0].tokenizer
    want = tok.decode(PROMPT) + tok.decode(generated_ids(solo, PROMPT, 6, temperature=0.0))
    if not stream:
        c = post(servers["draft"], "/v1/completions", body)["choices"][0]
        assert c["text"] == want and c["logprobs"] is None
        return
    text = ""
    with httpx.stream("POST", servers["draft"].url + "/v1/completions", json={"model": MODEL, **body},
                      timeout=WAIT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                assert ch["logprobs"] is None
                text += ch["text"]
    assert text == want
