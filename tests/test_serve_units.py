"""The server's pure pieces, without a server: stop strings (serve/stops.py), request parsing
(serve/protocol.py), metrics text (serve/metrics.py)."""

import pytest

from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.serve.metrics import Metrics, parse_metrics
from dflash2_numba.serve.protocol import BadRequest, ModelNotFound, parse_request
from dflash2_numba.serve.stops import StopStrings


def feed_all(stops, pieces):
    s = StopStrings(stops)
    out = []
    for p in pieces:
        out.append(s.feed(p))
        if s.hit:
            break
    return "".join(out) + s.flush(), s.hit, out


def test_stop_string_split_over_pieces_is_held_back_and_cut():
    text, hit, out = feed_all(["END"], ["ab", "cE", "N", "Dxyz"])
    assert (text, hit) == ("abc", True)
    assert out[:3] == ["ab", "c", ""]  # "E", then "EN", held back: they may begin "END"


def test_partial_match_that_fails_is_released():
    text, hit, out = feed_all(["END"], ["aE", "Nb", "c"])
    assert (text, hit) == ("aENbc", False) and out == ["a", "ENb", "c"]


def test_earliest_of_several_stops_wins_and_no_stop_passes_through():
    assert feed_all(["yz", "b c"], ["a b cxyz"])[:2] == ("a ", True)
    assert feed_all([], ["a", "b"])[:2] == ("ab", False)


class _Tok:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 + 1 for c in text]

    def apply_chat_template(self, messages, enable_thinking=False, **kw):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("T" if enable_thinking else "")


def parse(body, kind="completion"):
    return parse_request({"model": "m", **body}, kind, {"m"}, _Tok(), vocab=64)


def test_fields_are_read_with_openai_defaults_and_precedence():
    r = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "max_tokens": 9, "max_completion_tokens": 5, "stop": "x", "seed": 3, "top_k": 4}, "chat")
    assert r.max_tokens == 5 and r.stop == ["x"] and r.sampling == SamplingParams(1.0, 4, 1.0, 3)
    assert r.prompt_ids == _Tok().encode("<user>hi")
    r = parse({"prompt": [1, 2, 3], "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
               "block_size": 3})
    assert (r.prompt_ids, r.stream, r.include_usage, r.block_size, r.max_tokens) == ([1, 2, 3], True, True, 3, None)
    assert parse({"prompt": "a", "block_size": "auto"}).block_size == "auto"  # the batch's budget
    assert parse({"prompt": "a"}).block_size is None  # the server's default


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": [[1, 2], 3]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": "a", "n": 3}, "n"),
    ({"prompt": "a", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": [1, 99]}, "prompt"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "block_size": "fast"}, "block_size"),
    ({"prompt": "a", "top_p": "high"}, "top_p"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stop": ""}, "stop"),
    ({}, "prompt"),
])
def test_bad_fields_name_the_parameter(body, param):
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert e.value.param == param and e.value.status == 400
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_model_is_required_and_must_exist():
    with pytest.raises(BadRequest):
        parse_request({"prompt": "a"}, "completion", {"m"}, _Tok(), 64)
    with pytest.raises(ModelNotFound) as e:
        parse_request({"model": "other", "prompt": "a"}, "completion", {"m"}, _Tok(), 64)
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_metrics_render_parses_back():
    m = Metrics()
    m.add("requests_total", 3)
    m.reject("queue_full")
    m.ttft.observe(0.03)
    got = parse_metrics(m.render())
    assert got["requests_total"] == 4 and got['requests_rejected_total{reason="queue_full"}'] == 1
    assert got['time_to_first_token_seconds_bucket{le="0.05"}'] == 1 and got["time_to_first_token_seconds_count"] == 1


def test_prompt_lists_become_one_request_per_prompt_in_order():
    from dflash2_numba.serve.protocol import parse_requests
    reqs = parse_requests({"model": "m", "prompt": ["ab", [1, 2], "c"], "echo": True, "logprobs": 3, "max_tokens": 0},
                          "completion", {"m"}, _Tok(), vocab=64)
    assert [r.index for r in reqs] == [0, 1, 2]
    assert [r.prompt_ids for r in reqs] == [_Tok().encode("ab"), [1, 2], _Tok().encode("c")]
    assert all(r.echo and r.logprobs == 3 and r.max_tokens == 0 for r in reqs)
    with pytest.raises(BadRequest) as e:
        parse_requests({"model": "m", "prompt": [[1]] * 65}, "completion", {"m"}, _Tok(), vocab=64)
    assert e.value.param == "prompt"


def test_chat_logprobs_fields():
    r = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4}, "chat")
    assert r.logprobs == 4
    r = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "chat")
    assert r.logprobs == 0
    r = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": False}, "chat")
    assert r.logprobs is None
    for body in ({"logprobs": 2}, {"echo": True}, {"chat_template_kwargs": {"enable_thinking": "yes"}}):
        with pytest.raises(BadRequest):
            parse({"messages": [{"role": "user", "content": "hi"}], **body}, "chat")
