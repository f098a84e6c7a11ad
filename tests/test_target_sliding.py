"""Qwen3 targets with sliding-window attention vs transformers' Qwen3 (the independent oracle).

transformers 5.24 resolves the window like this (Qwen3Config.__post_init__): sliding_window
counts only with use_sliding_window; without layer_types, layers i >= max_window_layers slide;
a sliding layer masks key s from query t unless t - s < sliding_window. The tiny checkpoints
are written by transformers' own save_pretrained; the window (3-4 tokens) is much shorter than
the prompt, so every sliding layer really drops keys.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")
from test_target_hf import H, LAYERS, PROMPT, TAPS, build_hf_model, greedy, hf_forward, hf_greedy, load_hf, run_blocks
from transformers import Qwen3Config

from dflash2_numba.families.qwen3 import resolve_target_config
from dflash2_numba.families.qwen3 import TargetModel

torch.set_num_threads(1)

F32_TOL = 1e-4

CASES = {
    # name: extra Qwen3Config keys (LAYERS = 3 layers)
    "max-window-layers": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "layer-types": dict(use_sliding_window=True, sliding_window=3,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for seed, (name, extra) in enumerate(CASES.items()):
        d = build_hf_model(tmp_path_factory.mktemp(name), "qwen3", False, 2, torch.float32, False, 40 + seed,
                           extra=extra)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def seq():
    return np.random.default_rng(7).integers(0, 300, PROMPT + 21).tolist()


@pytest.mark.parametrize("case", CASES)
def test_windows_resolve_like_transformers(models, case):
    import json

    raw = json.loads((models[case] / "config.json").read_text())
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
    cfg = resolve_target_config(raw, source=str(models[case] / "config.json"))
    expect = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    assert cfg.layer_window == expect and any(w is not None for w in expect)


@pytest.mark.parametrize("case", CASES)
def test_sliding_logits_and_taps_match_hf(models, seq, case):
    """Prefill + incremental blocks (the cache grows past the window) vs HF's full forward."""
    target = TargetModel.load(models[case], dtype="f32")
    ref_logits, ref_taps = hf_forward(load_hf(models[case], torch.float32), seq, TAPS)
    logits, taps = run_blocks(target, seq, TAPS)
    scale = np.abs(ref_logits).max()
    diff = np.abs(logits - ref_logits).max()
    # the window matters: the same weights with full attention are far off
    target.layer_windows = [0] * LAYERS
    full, _ = run_blocks(target, seq, TAPS)
    full_diff = np.abs(full - ref_logits).max()
    print(f"\n  {case}: max|diff| {diff:.2e} (full attention instead: {full_diff:.2e}), max|ref| {scale:.2f}")
    assert diff <= F32_TOL * scale
    assert full_diff > 100 * F32_TOL * scale
    for j, l in enumerate(TAPS):
        assert np.abs(taps[:, j * H:(j + 1) * H] - ref_taps[l]).max() <= F32_TOL * np.abs(ref_taps[l]).max()


@pytest.mark.parametrize("case", CASES)
def test_sliding_greedy_identical_to_hf(models, seq, case):
    mine = greedy(TargetModel.load(models[case], dtype="f32"), seq[:PROMPT], 24)
    ref = hf_greedy(load_hf(models[case], torch.float32), seq[:PROMPT], 24)
    assert mine == ref


ABSENT = object()


@pytest.mark.parametrize("use", [True, False])
@pytest.mark.parametrize("window", [ABSENT, None, 4])
@pytest.mark.parametrize("max_window_layers", [ABSENT, 0, 2, 5])
@pytest.mark.parametrize("layer_types", [ABSENT, ["full_attention", "sliding_attention", "sliding_attention"]])
def test_window_resolution_agrees_with_qwen3config(use, window, max_window_layers, layer_types):
    """Every combination resolves to transformers' per-layer windows, or is refused by name
    exactly when transformers would leave a layer that should slide without a window (it then
    runs full attention: use_sliding_window with a null window, or sliding layer_types without
    use_sliding_window)."""
    import json

    from dflash2_numba.errors import ConfigValueError

    keys = dict(use_sliding_window=use, sliding_window=window, max_window_layers=max_window_layers,
                layer_types=layer_types)
    keys = {k: v for k, v in keys.items() if v is not ABSENT}
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    hf = Qwen3Config(**base, **keys)
    raw = json.loads(json.dumps({"architectures": ["Qwen3ForCausalLM"], **base, **keys}))
    hf_windows = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    slides_without_window = "sliding_attention" in hf.layer_types and hf.sliding_window is None
    if (use and window is None) or slides_without_window:
        with pytest.raises(ConfigValueError, match="sliding_window|use_sliding_window"):
            resolve_target_config(raw)
    else:
        assert resolve_target_config(raw).layer_window == hf_windows
