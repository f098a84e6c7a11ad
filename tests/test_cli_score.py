"""`dflash2-decode score` (the server's echo + logprobs numbers, offline) and `--think/--no-think`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dflash2_numba import tiny
from dflash2_numba.cli import main
from dflash2_numba.families.qwen3 import TargetModel

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny.write_target(tmp_path_factory.mktemp("score") / "target", seed=2, init_std=0.2)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def ref_logp(target_dir, ids):
    """Row i: log p(. | ids[:i+1]), numpy backend, log-softmax written here."""
    t = TargetModel.load(target_dir, device="numpy")
    x = t.forward(np.asarray(ids, np.int64), t.new_cache(len(ids)))[0].astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def test_score_json_equals_the_numpy_reference(target):
    ids = [5, 17, 200, 33, 9, 41]
    r = run("score", "--target", target, "--prompt-ids", ",".join(map(str, ids)), "--top", 2, "--json", "-")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    ref = ref_logp(target, ids)
    got = [t["logprob"] for t in obj["tokens"]]
    assert got[0] is None and [t["id"] for t in obj["tokens"]] == ids
    np.testing.assert_allclose(got[1:], [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=2e-4, rtol=0)
    assert obj["logprob_sum"] == pytest.approx(sum(got[1:]), abs=1e-9)
    assert all(len(t["top"]) == 2 for t in obj["tokens"][1:])


def test_score_continuation_sums_only_the_continuation(target):
    r = run("score", "--target", target, "--prompt", "hello there", "--continuation", " friend", "--json", "-")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    n = obj["n_context"]
    ids = obj["prompt_ids"]
    ref = ref_logp(target, ids)
    want = sum(ref[i - 1, ids[i]] for i in range(n, len(ids)))
    assert len(ids) > n and obj["logprob_sum"] == pytest.approx(want, abs=1e-3)


def test_think_renders_the_template_with_thinking(target):
    ids = {}
    for flag in ("--think", "--no-think"):
        r = run("score", "--target", target, "--prompt", "hi", "--chat", flag, "--json", "-")
        assert r.exit_code == 0, r.stderr
        ids[flag] = json.loads(r.stdout)["prompt_ids"]
    from dflash2_numba.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(target)
    for flag, on in (("--think", True), ("--no-think", False)):
        assert ids[flag] == tok.encode(tok.apply_chat_template("hi", enable_thinking=on), add_special_tokens=False)
    assert ids["--think"] != ids["--no-think"]


def test_think_without_chat_is_a_one_line_error(target):
    r = CliRunner().invoke(main, ["generate", "--target", str(target), "--prompt", "x", "--think"])
    assert r.exit_code == 2 and "needs --chat" in r.stderr and len(r.stderr.strip().splitlines()) == 1
