"""`dflash2-decode` through click's CliRunner: generate (target-only, v1 and v2 drafts, --json,
--baseline), propose, inspect, the embedded default, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.cli import main


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = tiny.write_target(root / "target", seed=2, init_std=0.2)
    return {"target": target,
            "dflash": tiny.write_draft(root / "dflash", target, kind="dflash", block_size=8, seed=3),
            "dflash2": tiny.write_draft(root / "dflash2", target, kind="dflash2", block_size=8, seed=4)}


def run(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kw)


def reference(pair, ids, n):
    """Target-only greedy through the API (the CLI must match it token for token)."""
    return dn.generate(dn.load_target(pair["target"]), None, prompt_ids=ids, max_new_tokens=n)


IDS = "5,17,200,33"


def test_generate_target_only_streams_text(pair):
    r = run("generate", "--target", pair["target"], "--prompt-ids", IDS, "--max-new-tokens", 12)
    assert r.exit_code == 0, r.stderr
    ref = reference(pair, [5, 17, 200, 33], 12)
    assert r.stdout == ref.text + "\n"
    assert "tau" in r.stderr and "tok/s" in r.stderr  # the stats block goes to stderr


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_generate_with_draft_json_stdout(pair, kind):
    r = run("generate", "--target", pair["target"], "--draft", pair[kind], "--prompt-ids", IDS,
            "--max-new-tokens", 20, "--block-size", 5, "--json", "-")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)  # with --json - stdout holds only the object
    ref = reference(pair, [5, 17, 200, 33], 20)
    assert obj["output_ids"] == ref.output_ids and obj["text"] == ref.text  # lossless
    assert obj["draft_kind"] == kind and obj["block_size"] == 5 and obj["draft"] == str(pair[kind])
    assert obj["prompt_ids"] == [5, 17, 200, 33] and obj["finish_reason"] == ref.finish_reason
    s = obj["stats"]
    assert len(s["acceptance_histogram"]) == 5 and sum(s["acceptance_histogram"]) == s["steps"]
    assert sum(s["acceptance_lengths"]) >= len(obj["output_ids"]) - 1
    assert s["tau"] == pytest.approx(sum(s["acceptance_lengths"]) / s["steps"])
    assert s["baseline_tokens_per_s"] is None and s["speedup"] is None


def test_generate_json_file_and_baseline(pair, tmp_path):
    out = tmp_path / "r.json"
    r = run("generate", "--target", pair["target"], "--draft", pair["dflash"], "--prompt",
            "hello world", "--max-new-tokens", 10, "--baseline", "--json", out)
    assert r.exit_code == 0, r.stderr
    obj = json.loads(out.read_text())
    assert r.stdout == obj["text"] + "\n"  # the text still streams with --json PATH
    assert obj["stats"]["baseline_tokens_per_s"] > 0 and obj["stats"]["speedup"] > 0
    assert "speedup" in r.stderr and "differs" not in r.stderr


def test_stop_token_and_sampling_seed(pair):
    ref = reference(pair, [5, 17, 200, 33], 12)
    k = next(i for i in range(1, 12) if ref.output_ids.index(ref.output_ids[i]) == i)
    r = run("generate", "--target", pair["target"], "--draft", pair["dflash2"], "--prompt-ids", IDS,
            "--max-new-tokens", 12, "--stop-token", ref.output_ids[k], "--json", "-")
    obj = json.loads(r.stdout)
    assert obj["output_ids"] == ref.output_ids[:k + 1] and obj["finish_reason"] == "stop"
    args = ("generate", "--target", pair["target"], "--draft", pair["dflash"], "--prompt-ids", IDS,
            "--max-new-tokens", 12, "--temperature", 1.0, "--top-k", 50, "--json", "-")
    a, b = (json.loads(run(*args, "--seed", 9).stdout)["output_ids"] for _ in range(2))
    assert a == b


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_propose_json(pair, kind):
    r = run("propose", "--target", pair["target"], "--draft", pair[kind], "--prompt-ids", IDS,
            "--block-size", 4, "--json", "-")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["anchor"] == reference(pair, [5, 17, 200, 33], 1).output_ids[0]
    assert obj["positions"] == [5, 6, 7] and len(obj["draft_ids"]) == 3 and len(obj["slots"]) == 3
    assert all(len(s["candidate_ids"]) == len(s["candidate_scores"]) > 0 for s in obj["slots"])
    r = run("propose", "--target", pair["target"], "--draft", pair[kind], "--prompt-ids", IDS)
    assert r.exit_code == 0 and "candidates" in r.stdout


def test_inspect(pair):
    r = run("inspect", pair["target"], "--json", "-")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["kind"] == "target" and obj["num_tensors"] > 0
    r = run("inspect", pair["dflash2"])
    assert r.exit_code == 0 and "dflash2" in r.stdout


def _one_line_error(r, name):
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}: "), r.stderr


def test_errors_exit_2_one_line(pair, tmp_path):
    t = pair["target"]
    _one_line_error(run("generate", "--target", tmp_path / "nope", "--prompt", "x"), "CheckpointNotFoundError")
    _one_line_error(run("generate", "--target", t, "--draft", pair["dflash"], "--prompt", "x",
                        "--block-size", 1), "BlockSizeError")
    _one_line_error(run("generate", "--target", t, "--draft", pair["dflash"], "--prompt", "x",
                        "--block-size", 9), "BlockSizeError")
    _one_line_error(run("generate", "--target", t, "--prompt", "x", "--prompt-ids", "1"), "GenerationArgumentError")
    _one_line_error(run("generate", "--target", t, "--prompt-ids", "1,a"), "GenerationArgumentError")
    _one_line_error(run("generate", "--target", t, "--prompt", "x", "--temperature", -1), "GenerationArgumentError")
    _one_line_error(run("propose", "--target", t, "--prompt", "x"), "GenerationArgumentError")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _one_line_error(run("inspect", gguf), "GGUFNotSupportedError")
    _one_line_error(run("generate", "--target", t, "--draft", pair["target"], "--prompt", "x"),
                    "UnknownArchitectureError")
    no_chat = tiny.write_target(tmp_path / "nochat", seed=2, chat_template=False)
    _one_line_error(run("generate", "--target", no_chat, "--prompt", "x", "--chat"), "ChatTemplateMissingError")
    try:
        from numba import cuda
    except ImportError:  # no numba.cuda at all: the device is unavailable too
        cuda = None
    if cuda is None or not cuda.is_available():
        _one_line_error(run("generate", "--target", t, "--prompt", "x", "--device", "cuda"), "DeviceUnavailableError")


def test_default_pair_when_no_target(tmp_path, monkeypatch):
    from dflash2_numba import default

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    r = run("generate", "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--json", "-")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert len(obj["output_ids"]) == 4 or obj["finish_reason"] == "stop"
    if not (default.ASSET_DIR / "target" / "config.json").is_file():
        assert "RANDOM" in r.stderr and (tmp_path / default.TINY_NAME / "target" / "config.json").is_file()
        assert obj["draft_kind"] == "dflash2"


def test_python_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "dflash2_numba", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "generate" in r.stdout and "propose" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dflash2_numba", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and dn.__version__ in r.stdout


def test_prompt_file_equals_prompt(pair, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("héllo wörld", encoding="utf-8")
    a = run("generate", "--target", pair["target"], "--prompt-file", f, "--max-new-tokens", 6, "--json", "-")
    b = run("generate", "--target", pair["target"], "--prompt", "héllo wörld", "--max-new-tokens", 6, "--json", "-")
    assert a.exit_code == b.exit_code == 0
    assert json.loads(a.stdout)["prompt_ids"] == json.loads(b.stdout)["prompt_ids"]
    assert json.loads(a.stdout)["output_ids"] == json.loads(b.stdout)["output_ids"]


def test_threads_option_runs_and_the_stats_say_how_many(pair):
    """--threads N sets numba's thread count for the run; the statistics report it (stats block
    and --json). Red on an option that is parsed but never applied."""
    import numba

    before = numba.get_num_threads()
    try:
        r = run("generate", "--target", pair["target"], "--draft", pair["dflash2"], "--prompt-ids", IDS,
                "--max-new-tokens", 8, "--threads", 1, "--json", "-")
        assert r.exit_code == 0, r.stderr
        assert numba.get_num_threads() == 1 and "1 thread" in r.stderr
        if numba.config.NUMBA_NUM_THREADS >= 2:
            r = run("generate", "--target", pair["target"], "--prompt-ids", IDS, "--max-new-tokens", 4,
                    "--threads", 2)
            assert r.exit_code == 0 and numba.get_num_threads() == 2 and "2 threads" in r.stderr
    finally:
        numba.set_num_threads(before)


def test_default_threads_one_for_a_small_model(pair, monkeypatch):
    """Without --threads: one thread for a model under SMALL_MODEL_PARAMS (its products are too
    small to pay for waking a second thread), the physical cores for a bigger one (the
    threshold lowered here so the tiny test model counts as big). Red when the default ignores
    the model size, or when --threads no longer overrides it."""
    import numba

    from dflash2_numba.kernels import backend

    if numba.config.NUMBA_NUM_THREADS < 2 or backend.physical_cores() < 2:
        pytest.skip("one core: every default is one thread")
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        r = run("generate", "--target", pair["target"], "--prompt-ids", IDS, "--max-new-tokens", 4)
        assert r.exit_code == 0 and numba.get_num_threads() == 1 and "1 thread" in r.stderr
        monkeypatch.setattr(backend, "SMALL_MODEL_PARAMS", 1)
        r = run("generate", "--target", pair["target"], "--prompt-ids", IDS, "--max-new-tokens", 4)
        assert r.exit_code == 0 and numba.get_num_threads() == 2 and "2 threads" in r.stderr
        monkeypatch.undo()
        r = run("generate", "--target", pair["target"], "--prompt-ids", IDS, "--max-new-tokens", 4, "--threads", 2)
        assert r.exit_code == 0 and numba.get_num_threads() == 2 and "2 threads" in r.stderr
    finally:
        numba.set_num_threads(before)


def test_first_run_notice_and_compile_time_kept_out_of_the_stats(pair, monkeypatch):
    """After `warm_up`, the timed generation compiles nothing (red on a warm-up that skips a path
    the run takes, e.g. the draft step — in a process whose kernels start uncompiled: this test
    alone with NUMBA_CACHE_DIR set to an empty directory; in the full suite they are compiled
    already). Then, with a cold cache faked: one notice before anything is compiled, and the
    warm-up's seconds on a `compile` line of the stats block."""
    from dflash2_numba.decode import warmup
    from dflash2_numba.kernels import cache_check

    target = dn.load_target(pair["target"])
    draft = dn.load_draft(pair["dflash2"], target)
    warmup.warm_up(target, draft, prompt_ids=[5, 17, 200, 33], max_new_tokens=20, block_size=5)
    before = cache_check.kernels_compiled()
    dn.generate(target, draft, prompt_ids=[5, 17, 200, 33], max_new_tokens=20, block_size=5)
    assert cache_check.kernels_compiled() == before

    monkeypatch.setattr(warmup, "kernel_cache_is_cold", lambda: True)
    compiled = iter([0, 3])  # pretend the warm-up compiled three specialisations
    monkeypatch.setattr(warmup, "kernels_compiled", lambda: next(compiled))
    r = run("generate", "--target", pair["target"], "--draft", pair["dflash2"], "--prompt-ids", IDS,
            "--max-new-tokens", 8, "--threads", 1)
    assert r.exit_code == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == warmup.NOTICE and sum(line == warmup.NOTICE for line in lines) == 1
    assert any(line.startswith("compile ") and "not in the times above" in line for line in lines)


def test_warm_up_reaches_the_parallel_drivers(pair):
    """With more than one thread, the GEMV / attention go parallel only above a size threshold
    that a short warm-up prompt never reaches but a long context does, mid-run: warm_up must
    compile (or load) the parallel drivers too. A short prompt's run takes the fused layer only,
    whose parallel variant holds them (kernels/fused.py: chosen by the thread count, not by the
    threshold); a long or unknown prompt's warm-up also runs the op-by-op prefill, which calls
    them from Python. Red, in a fresh process (this test alone), on a warm-up without its second,
    threshold-0 pass."""
    import numba

    from dflash2_numba.decode import warmup
    from dflash2_numba.kernels import attention, fused, linear, panels

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only: the parallel drivers are never used")
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        target = dn.load_target(pair["target"])
        draft = dn.load_draft(pair["dflash2"], target)
        warmup.warm_up(target, draft, prompt_ids=[5, 17], max_new_tokens=4)
        assert fused._layer_kernel(False, True).overloads  # compiled, or loaded from the cache
        warmup.warm_up(target, draft, max_new_tokens=4)  # no prompt given: the long-prompt warm-up
    finally:
        numba.set_num_threads(before)
    assert panels._gemv_panels_par.overloads and attention._attention_par.overloads
    assert linear.PARALLEL_MIN_MACS == 1 << 18  # the threshold is restored


def test_draft_quantize_sets_the_drafts_format_alone(pair, monkeypatch):
    """--draft-quantize bf16 beside --quantize q8_0: the draft loads as stored, the target
    quantized, and the output is the q8_0 target's own greedy output. Mutation: `_load` ignoring
    the option (the draft follows --quantize) -> red."""
    import dflash2_numba.api as api

    seen = []
    real = api.load_draft

    def spy(draft_dir, target, quantize="same"):
        d = real(draft_dir, target, quantize=quantize)
        seen.append((quantize, getattr(d.ops, "quantize", None), getattr(target.ops, "quantize", None)))
        return d

    monkeypatch.setattr(api, "load_draft", spy)
    r = run("generate", "--target", pair["target"], "--draft", pair["dflash2"], "--prompt-ids", IDS,
            "--max-new-tokens", 16, "--block-size", 4, "--quantize", "q8_0", "--draft-quantize", "bf16", "--json", "-")
    assert r.exit_code == 0, r.stderr
    assert seen == [("bf16", None, "q8_0")]
    ref = dn.generate(dn.load_target(pair["target"], quantize="q8_0"), None, prompt_ids=[5, 17, 200, 33],
                      max_new_tokens=16)
    assert json.loads(r.stdout)["output_ids"] == ref.output_ids
    _one_line_error(run("generate", "--target", pair["target"], "--prompt", "x", "--draft-quantize", "q8_0"),
                    "GenerationArgumentError")
    assert all("--draft-quantize" in run(cmd, "--help").stdout for cmd in ("generate", "propose", "serve"))
