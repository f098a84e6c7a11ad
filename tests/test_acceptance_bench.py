"""Smoke test of bench/acceptance.py on a tiny random pair: the JSON it writes, its own
consistency, and that an output differing from target-only makes it fail."""

import json

import pytest

from dflash2_numba import tiny

from bench_scripts import load_bench

N_PROMPTS, NEW = 2, 8


def _load_bench():
    return load_bench("acceptance.py", "acceptance_bench")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("acc")
    tiny.write_target(d / "t", seed=0, init_std=0.2)
    tiny.write_draft(d / "d2", d / "t", kind="dflash2", block_size=8)
    tiny.write_draft(d / "d1", d / "t", kind="dflash", block_size=8)
    # both accepted prompt shapes: a plain string and an object with text + file
    (d / "p.json").write_text(json.dumps(["the cat sat on the", {"text": "def f(x):\n", "file": "a.py"},
                                          "never read: beyond --n-prompts"]))
    return d


def _argv(d, out):
    return ["--target", str(d / "t"), "--dflash2", str(d / "d2"), "--dflash", str(d / "d1"),
            "--prompts", str(d / "p.json"), "--n-prompts", str(N_PROMPTS),
            "--max-new-tokens", str(NEW), "--block-sizes", "2,4", "--out", str(out)]


def test_writes_json_and_all_outputs_match(pair, capsys):
    bench = _load_bench()
    out = pair / "out" / "acceptance.json"  # the directory does not exist yet
    assert bench.main(_argv(pair, out)) == 0
    res = json.loads(out.read_text())

    assert {"platform", "cpu_count", "numba_threads", "date"} <= set(res["machine"])
    assert res["machine"]["numba_threads"] == 1
    assert [p["file"] for p in res["prompts"]] == [None, "a.py"]
    names = [c["name"] for c in res["configs"]]
    assert names == ["target-only", "dflash2 Q=2", "dflash2 Q=4", "dflash Q=2", "dflash Q=4"]
    assert res["mismatches"] == 0
    assert set(res["dflash2_minus_dflash_tau"]) == {"2", "4"}
    for c in res["configs"]:
        assert c["mismatches"] == 0 and len(c["per_prompt"]) == N_PROMPTS
        assert all(p["matched"] for p in c["per_prompt"])
        assert len(c["acceptance_histogram"]) == c["block_size"]
        assert len(c["per_position_acceptance"]) == c["block_size"] - 1
        # pooled figures agree with the per-step record they summarise
        assert sum(c["acceptance_histogram"]) == c["steps"] == sum(p["steps"] for p in c["per_prompt"])
        hist_tau = sum((i + 1) * n for i, n in enumerate(c["acceptance_histogram"])) / c["steps"]
        assert c["tau"] == pytest.approx(hist_tau)
        # every accepted token is one emitted token: steps * tau = tokens after the prefill one
        # (holds while no stop id truncates, which the random 8-token runs here never hit)
        if all(p["finish_reason"] == "length" for p in c["per_prompt"]):
            assert c["new_tokens"] == N_PROMPTS * NEW
            assert c["steps"] * c["tau"] == pytest.approx(c["decode_tokens"])
        assert c["tokens_per_s"] > 0 and c["speedup"] > 0
    assert res["configs"][0]["speedup"] == pytest.approx(1.0)
    assert "tau(DFlash2) - tau(DFlash) at Q=4" in capsys.readouterr().out


def test_a_differing_output_fails_the_run(pair, monkeypatch):
    bench = _load_bench()
    real = bench.generate

    def corrupt_dflash(target, draft, **kw):  # DFlash v1 "emits" one wrong token
        r = real(target, draft, **kw)
        if draft is not None and draft.kind == "dflash":
            r.output_ids[-1] = (r.output_ids[-1] + 1) % 50
        return r

    monkeypatch.setattr(bench, "generate", corrupt_dflash)
    out = pair / "bad.json"
    assert bench.main(_argv(pair, out)) == 1
    res = json.loads(out.read_text())
    by = {c["name"]: c["mismatches"] for c in res["configs"]}
    assert by == {"target-only": 0, "dflash2 Q=2": 0, "dflash2 Q=4": 0,
                  "dflash Q=2": N_PROMPTS, "dflash Q=4": N_PROMPTS}
    assert res["mismatches"] == 2 * N_PROMPTS
