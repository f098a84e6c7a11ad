"""bench/scaled_pair.py: the widened copy of the embedded pair computes what the pair computes.

The script's own check compares the widened target's logits and taps and both widened drafts'
block states with the originals (first copy of each replicated vector) and the DFlash2 proposal;
it exits 1 on any difference above 1e-4 of max|value|. Red on: the fc input blocks not widened
per tap (draft block 0.15-0.2 off), the conv projection's groups repeated instead of tiled
(DFlash2 block 0.77 off, proposal different)."""

import importlib.util
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _load_bench():
    spec = importlib.util.spec_from_file_location("scaled_pair", ROOT / "bench" / "scaled_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_widened_pair_matches_the_original(tmp_path, one_thread):
    bench = _load_bench()
    assert bench.main(["2", "--out", str(tmp_path)]) == 0
    cfg = json.loads((tmp_path / "target" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["tie_word_embeddings"]) == (512, 16, False)
    report = bench.check(bench.ASSETS, tmp_path, 2)
    assert report["proposal equal"] and max(v for k, v in report.items() if k != "proposal equal") < 1e-4


def test_linear_widening_preserves_the_product():
    """y' = x' W'^T with x' = K copies of x gives K copies of y (independent numpy check)."""
    bench = _load_bench()
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((6, 10)).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    y = bench.linear(w, 4) @ np.tile(x, 4)  # [24]
    np.testing.assert_allclose(y, np.tile(w @ x, 4), rtol=1e-5, atol=1e-5)
    wf = rng.standard_normal((6, 30)).astype(np.float32)  # fc over three taps of 10 features
    taps = rng.standard_normal((3, 10)).astype(np.float32)
    y = bench.linear(wf, 4, in_blocks=3) @ np.tile(taps, (1, 4)).reshape(-1)  # each tap widened
    np.testing.assert_allclose(y, np.tile(wf @ taps.reshape(-1), 4), rtol=1e-5, atol=1e-5)


def test_deepened_pair_is_bit_identical(tmp_path, one_thread):
    """--deepen 3 (not widened): 12 target layers, 8 of them inert, taps re-pointed. Every value
    the check compares is EXACTLY the original's (x + 0 == x; no summation order changes at
    K = 1). Red on: an inert copy whose down_proj is kept (logits and later taps move), taps
    not re-pointed (the draft reads layer 0 / 2 / 3 of the deep target: block states move)."""
    bench = _load_bench()
    assert bench.main(["1", "--deepen", "3", "--out", str(tmp_path)]) == 0
    target = json.loads((tmp_path / "target" / "config.json").read_text())
    draft = json.loads((tmp_path / "dflash2" / "config.json").read_text())
    assert target["num_hidden_layers"] == 12 and len(target["layer_types"]) == 12
    assert draft["dflash_config"]["target_layer_ids"] == [2, 8, 11] and draft["num_target_layers"] == 12
    report = bench.check(bench.ASSETS, tmp_path, 1)
    assert report["proposal equal"]
    assert all(v == 0.0 for k, v in report.items() if k != "proposal equal"), report
