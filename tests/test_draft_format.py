"""`--draft-quantize auto` (quant/draft_format.py): the rule's table, the API and the CLI.

The rule changes how fast a step drafts, never the output: every run here is compared with the
target's own greedy output."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import dflash2_numba as dn
import dflash2_numba.api as api
from dflash2_numba import tiny
from dflash2_numba.cli import main
from dflash2_numba.quant import draft_format
from dflash2_numba.quant.draft_format import AUTO_MIN_BYTES, choose

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BIG = AUTO_MIN_BYTES
IDS = [5, 17, 200, 33]


@pytest.mark.parametrize("target, device, path, nbytes, stored, want", [
    (None, "cpu", "avx512_vnni", BIG, False, "q8_0"),       # measured: half the bytes, same speed per byte
    ("q8_0", "cpu", "avx2", BIG, False, "bf16"),            # measured: AVX2's q8_0 tile is the slow one
    (None, "cpu", "avx512_vnni", BIG - 1, False, "same"),   # a draft that runs from cache
    ("q8_0", "cpu", "avx2", BIG - 1, False, "same"),
    (None, "cpu", "avx512_vnni", BIG, True, "same"),        # stored quantized: runs as stored
    (None, "cuda", "avx512_vnni", BIG, False, "same"),      # the GPU runs the draft as the target
    (None, "cpu", "avx2", BIG, False, "same"),              # bf16 target on AVX2: bf16 is the cheap one
    ("q8_0", "cpu", "avx512_vnni", BIG, False, "same"),     # already q8_0
    ("q4_0", "cpu", "avx2", BIG, False, "same"),            # q4_0's AVX2 draft step beat bf16's: kept
    ("q4_k", "cpu", "avx512_vnni", BIG, False, "same"),     # not measured: the target's
    (None, "cpu", "avx_vnni", BIG, False, "same"),
    (None, "cpu", "generic", BIG, False, "same"),
])
def test_rule_table(target, device, path, nbytes, stored, want):
    fmt, why = choose(target, device, path, nbytes, stored)
    assert fmt == want
    assert why and "\n" not in why


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_format")
    target = tiny.write_target(root / "target", seed=2, init_std=0.2)
    return {"target": target, "dflash2": tiny.write_draft(root / "dflash2", target, kind="dflash2", block_size=8,
                                                          seed=4)}


def _as_large(monkeypatch, path):
    """The tiny draft counted as a large one, on kernel path `path` (the decision only: the
    kernels still compile for this machine's own path)."""
    monkeypatch.setattr(draft_format, "AUTO_MIN_BYTES", 0)
    monkeypatch.setattr(draft_format, "kernel_path", lambda: path)


def test_api_auto_quantizes_a_large_draft_and_keeps_the_output(pair, monkeypatch):
    """A 'large' draft beside a bf16 target on the VNNI path runs q8_0 kernels (draft.ops), the
    target stays bf16, and greedy output is the target's. Mutation: load_draft ignoring the
    rule's answer -> the format asserts turn red."""
    target = dn.load_target(pair["target"])
    ref = dn.generate(target, None, prompt_ids=IDS, max_new_tokens=24).output_ids
    small = dn.load_draft(pair["dflash2"], target)  # the default is auto; a tiny draft keeps bf16
    assert (small.weight_format, small.ops) == ("bf16", target.ops)
    assert "runs from cache" in small.format_reason
    _as_large(monkeypatch, "avx512_vnni")
    draft = dn.load_draft(pair["dflash2"], target)
    assert draft.weight_format == "q8_0" and draft.ops.quantize == "q8_0"
    assert getattr(target.ops, "quantize", None) is None
    assert draft.format_reason.startswith("--draft-quantize auto: avx512_vnni path, bf16 target")
    assert dn.generate(target, draft, prompt_ids=IDS, max_new_tokens=24, block_size=4).output_ids == ref
    same = dn.load_draft(pair["dflash2"], target, quantize="same")  # an explicit choice is not overridden
    assert same.weight_format == "bf16"


def test_api_auto_keeps_a_q8_0_targets_draft_bf16_on_avx2(pair, monkeypatch):
    target = dn.load_target(pair["target"], quantize="q8_0")
    _as_large(monkeypatch, "avx2")
    draft = dn.load_draft(pair["dflash2"], target)
    assert draft.weight_format == "bf16" and getattr(draft.ops, "quantize", None) is None
    ref = dn.generate(target, None, prompt_ids=IDS, max_new_tokens=24).output_ids
    assert dn.generate(target, draft, prompt_ids=IDS, max_new_tokens=24, block_size=4).output_ids == ref


def test_a_stored_quantized_draft_is_left_as_stored(pair, monkeypatch, tmp_path):
    target = dn.load_target(pair["target"])
    _as_large(monkeypatch, "avx512_vnni")
    d = tiny.write_draft(tmp_path / "d", pair["target"], kind="dflash2", block_size=8, seed=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (d / "config.json").write_text(json.dumps(cfg))
    fmt, why = api._auto_draft_format(d, target)
    assert fmt == "same" and "stored quantized" in why


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_cli_says_which_format_the_draft_runs(pair, monkeypatch):
    """The CLI names the draft's format on stderr when auto picked one other than the target's,
    and --json records it; `--draft-quantize same` keeps the target's and says nothing."""
    _as_large(monkeypatch, "avx512_vnni")
    common = ("generate", "--target", pair["target"], "--draft", pair["dflash2"], "--prompt-ids", "5,17,200,33",
              "--max-new-tokens", 16, "--block-size", 4, "--json", "-")
    r = run(*common)
    assert r.exit_code == 0, r.stderr
    assert "draft    q8_0 weights (--draft-quantize auto: avx512_vnni path" in r.stderr
    assert json.loads(r.stdout)["draft_format"] == "q8_0"
    r = run(*common, "--draft-quantize", "same")
    assert r.exit_code == 0, r.stderr
    assert "draft    " not in r.stderr and json.loads(r.stdout)["draft_format"] == "bf16"
    assert "auto" in run("generate", "--help").stdout
