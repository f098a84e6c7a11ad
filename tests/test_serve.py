"""`dflash2-decode serve` through the real `openai` client (max_retries=0: it retries 429 / 5xx by
default) against servers on free loopback ports, on the embedded default pair (its target with
a chat template added: it ships none).

Every answer is compared with the solo run of the same request (`stream_generate` on a
separately loaded pair): greedy and seeded sampling, chat and completions, streamed and not,
N concurrent mixed requests, A / B / A. Also: the SSE chunk sequence, `length` / `stop`
(a stop string that ends inside an accepted block, split over two steps), 400 / 404 / 429,
a client disconnect freeing its slot, and SIGTERM of a server subprocess (tests/test_serve_sigterm.py).
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install -e '.[test]')")
httpx = pytest.importorskip("httpx", reason="the serve tests need httpx")
pytest.importorskip("starlette", reason="dflash2-decode serve needs starlette (the 'serve' extra)")
pytest.importorskip("uvicorn", reason="dflash2-decode serve needs uvicorn (the 'serve' extra)")

import dflash2_numba as dn  # noqa: E402
from dflash2_numba.default import ASSET_DIR  # noqa: E402
from dflash2_numba.kernels.backend import set_threads  # noqa: E402
from dflash2_numba.serve.engine import Engine  # noqa: E402
from dflash2_numba.serve.metrics import parse_metrics  # noqa: E402
from dflash2_numba.serve.reference import solo_answer  # noqa: E402
from dflash2_numba.serve.server import Server  # noqa: E402

MODEL = "embedded"
WAIT_S = 60  # bound on every wait in this module
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}think:{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded target plus a chat_template.jinja (weights symlinked)."""
    if not (ASSET_DIR / "target" / "config.json").is_file():
        pytest.skip("the embedded default pair is not shipped in this checkout")
    d = tmp_path_factory.mktemp("serve") / MODEL
    d.mkdir()
    for f in (ASSET_DIR / "target").iterdir():
        if f.suffix == ".safetensors":
            (d / f.name).symlink_to(f)
        else:
            shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


def _load(model_dir):
    target = dn.load_target(model_dir)
    return target, dn.load_draft(ASSET_DIR / "dflash2", target)


def start_server(model_dir, **engine_kw) -> Server:
    def load():
        set_threads(1)  # numba's thread count is per thread: the engine thread's own
        return _load(model_dir)

    server = Server(Engine(load, **engine_kw), MODEL, port=0, grace_s=2.0).start_in_thread()
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, "the server to be ready")
    return server


def wait_until(cond, what: str, timeout: float = WAIT_S) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            if cond():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def server(model_dir):
    s = start_server(model_dir, max_running=4, max_waiting=8)
    yield s
    s.shutdown()
    s.join(WAIT_S)


@pytest.fixture(scope="module")
def solo_pair(model_dir):
    """A pair of its own for the solo reference runs (the server's models belong to its thread)."""
    set_threads(1)
    return _load(model_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def metrics(server) -> dict:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=WAIT_S).text)


# ---------------------------------------------------------------- solo references
def solo(pair, prompt=None, messages=None, max_tokens=32, temperature=0.0, seed=None, block_size="auto",
         top_k=0, stop=(), **template_kw):
    """(text, completion_tokens, finish_reason, steps' texts) the server should answer (serve/reference.py)."""
    target, draft = pair
    tok = target.tokenizer
    if messages is not None:
        ids = tok.encode(tok.apply_chat_template(messages, **template_kw), add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    a = solo_answer(target, draft, ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                    block_size=block_size, top_k=top_k, stop=stop)
    return a.text, a.completion_tokens, a.finish_reason, a.step_texts


# ---------------------------------------------------------------- basics
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = metrics(server)
    assert m["requests_running"] == 0 and "requests_total" in m


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 11)])
def test_completion_equals_solo(client, solo_pair, temperature, seed):
    prompt = "The cat sat on"
    text, n, finish, _ = solo(solo_pair, prompt, max_tokens=40, temperature=temperature, seed=seed)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=temperature, seed=seed)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, finish)
    assert finish == "length"
    t = r.model_extra["timings"]
    assert t["predicted_n"] == n and t["steps"] >= 1 and t["draft_n"] >= t["draft_n_accepted"] >= 0
    assert t["tau"] == pytest.approx(1 + t["draft_n_accepted"] / t["steps"])


def test_chat_equals_solo_streamed_and_not(client, solo_pair):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a function"}]
    text, n, finish, _ = solo(solo_pair, messages=messages, max_tokens=30, block_size=4)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                       extra_body={"block_size": 4})
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, finish)
    assert r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, extra_body={"block_size": 4}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # chat_template_kwargs reach the template (enable_thinking changes the prompt)
    think, _, _, _ = solo(solo_pair, messages=messages, max_tokens=30, block_size=4, enable_thinking=True)
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                        extra_body={"block_size": 4, "chat_template_kwargs": {"enable_thinking": True}})
    assert r2.choices[0].message.content == think and r2.usage.prompt_tokens > r.usage.prompt_tokens


def sse_events(url: str, body: dict) -> list:
    """Raw SSE of one streamed request: the decoded data objects, and "[DONE]"."""
    with httpx.stream("POST", url, json=body, timeout=WAIT_S) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_stream_chunk_sequence(server, solo_pair):
    text, n, _, _ = solo(solo_pair, messages=[{"role": "user", "content": "hi"}], max_tokens=20)
    ev = sse_events(server.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]" and "[DONE]" not in ev[:-1]
    chunks = ev[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # role first
    usage_chunk, last = chunks[-1], chunks[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == n
    assert last["choices"][0]["finish_reason"] == "length" and "timings" in last
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert all(c["usage"] is None for c in chunks[:-1])  # null on every chunk but the usage chunk
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == text
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "chat.completion.chunk"
    # completions stream: text chunks, finish_reason last, [DONE]; no usage chunk unless asked
    ev = sse_events(server.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5,
                                                     "temperature": 0, "stream": True})
    assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["choices"] for c in ev[:-1])


def test_stop_string_inside_a_block_and_split_over_steps(client, solo_pair):
    prompt, Q = "def main():", 8
    full, _, _, steps = solo(solo_pair, prompt, max_tokens=60, block_size=Q)
    # a stop string made of the end of one step's text and the start of the next one's, which
    # ends inside that next step's accepted block (at least 2 characters of it follow)
    k = next(k for k in range(1, len(steps) - 1) if len(steps[k]) >= 2 and len(steps[k + 1]) >= 4
             and full.find(steps[k][-2:] + steps[k + 1][:2]) == len("".join(steps[:k + 1])) - 2)
    stop = steps[k][-2:] + steps[k + 1][:2]
    text, n, finish, _ = solo(solo_pair, prompt, max_tokens=60, block_size=Q, stop=[stop])
    assert finish == "stop" and text == "".join(steps[:k + 1])[:-2]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "zzzz"],
                                      stream=stream, extra_body={"block_size": Q},
                                      **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            got, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert (got, reason, usage.completion_tokens) == (text, "stop", n)


# ---------------------------------------------------------------- concurrency and isolation
MIXED = [  # prompt, max_tokens, block_size, temperature, seed, stream
    ("The cat sat on", 40, 8, 0.0, None, False),
    ("Once upon a time", 33, 4, 0.8, 7, True),
    ("import numpy as np", 25, 3, 0.0, None, True),
    ("def main():", 48, 8, 1.0, 123, False),
    ("x = 1\n" * 100, 16, 6, 0.0, None, True),
    ("class Foo:", 7, 2, 0.7, 5, False),
    ("The quick brown fox", 30, "auto", 0.0, None, True),  # the batch's verify-row budget
    ("Dear diary,", 28, "auto", 0.9, 17, False),  # its own rule: == solo --block-size auto --seed 17
]


def _ask(client, prompt, max_tokens, Q, temperature, seed, stream):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
              extra_body={"block_size": Q})
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return ("".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens,
            [c.choices[0].finish_reason for c in chunks if c.choices][-1])


def test_concurrent_mixed_requests_each_equal_solo(server, client, solo_pair):
    want = [solo(solo_pair, p, max_tokens=n, block_size=Q, temperature=t, seed=s)[:3] for p, n, Q, t, s, _ in MIXED]
    before = metrics(server)
    with ThreadPoolExecutor(len(MIXED)) as pool:
        got = list(pool.map(lambda r: _ask(client, *r), MIXED * 2))  # 16 requests, 4 run at a time
    assert got == want * 2
    after = metrics(server)
    assert after["engine_batched_steps_total"] > before["engine_batched_steps_total"]  # they did share steps
    assert after['request_success_total{finished_reason="length"}'] - before.get(
        'request_success_total{finished_reason="length"}', 0) == 2 * len(MIXED)


def test_a_b_a_gives_a_twice(client):
    a = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0.9, seed=42)
    first = client.completions.create(**a).choices[0].text
    client.completions.create(model=MODEL, prompt="def main():", max_tokens=45, temperature=1.0, seed=1)
    assert client.completions.create(**a).choices[0].text == first


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("body,param,code", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter"),
    ({"n": 2}, "n", "unsupported_parameter"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "invalid_value"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ({"extra_body": {"block_size": 99}}, "block_size", "invalid_value"),
    ({"temperature": -1}, None, "invalid_value"),
    ({"stop": [chr(97 + i) for i in range(17)]}, "stop", "invalid_value"),
])
def test_bad_requests_are_named_400s(client, body, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **body)
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == code and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    assert e.value.body["code"] == "model_not_found"


def test_bad_json_is_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


@pytest.fixture(scope="module")
def one_slot(model_dir):
    """A server with ONE running slot and no waiting room."""
    s = start_server(model_dir, max_running=1, max_waiting=0, warm=False)
    yield s
    s.shutdown()
    s.join(WAIT_S)


LONG = {"model": MODEL, "prompt": "The", "max_tokens": 1900, "temperature": 0, "stream": True}


def test_queue_full_is_429_and_a_disconnect_frees_the_slot(one_slot):
    c = openai.OpenAI(base_url=one_slot.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    with httpx.stream("POST", one_slot.url + "/v1/completions", json=LONG, timeout=WAIT_S) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # the long request is running
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert e.value.response.headers["retry-after"] == "1" and e.value.body["code"] == "queue_full"
    # the client closed the stream mid-way: the engine drops the request at its next step
    wait_until(lambda: metrics(one_slot)["requests_running"] == 0, "the slot to be freed", 10)
    m = metrics(one_slot)
    assert m["requests_cancelled_total"] == 1 and m['requests_rejected_total{reason="queue_full"}'] == 1
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].finish_reason == "length"


def test_health_is_503_while_loading_and_a_failed_load_stops_the_server(model_dir):
    import threading

    from dflash2_numba.errors import GenerationArgumentError

    release = threading.Event()

    def slow_load():
        assert release.wait(WAIT_S)
        set_threads(1)
        return _load(model_dir)

    s = Server(Engine(slow_load, warm=False), MODEL, port=0).start_in_thread()
    try:
        wait_until(lambda: httpx.get(s.url + "/health").status_code == 503, "the server to answer")
        assert httpx.get(s.url + "/health").json() == {"status": "loading"}
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=WAIT_S)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        release.set()
        wait_until(lambda: httpx.get(s.url + "/health").status_code == 200, "the load to finish")
    finally:
        release.set()
        s.shutdown()
        s.join(WAIT_S)

    def bad_load():
        raise GenerationArgumentError("no such model")

    s = Server(Engine(bad_load), MODEL, port=0).start_in_thread()
    s.join(WAIT_S)
    assert not s.thread.is_alive() and isinstance(s.engine.load_error, GenerationArgumentError)
