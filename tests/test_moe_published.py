"""The published MoE targets and their DFlash drafts, as configured on the Hub (tests/data/moe/:
the config.json keys of Qwen3-Coder-30B-A3B-Instruct + z-lab/Qwen3-Coder-30B-A3B-DFlash (8 full
layers, B = 16 top level, taps [1, 12, 23, 34, 45]) and Qwen3.6-35B-A3B + z-lab/Qwen3.6-35B-A3B-
DFlash (5 sliding-4096 layers + 1 full, B = 16 nested, 8 taps), restated from docs/moe.md).

1. At full size: every config resolves, the draft pairs with its target, and the inventories have
   the published shapes (no tensor is materialised).
2. Scaled down (sizes shrunk, every other key as published): the draft config drives the real
   loader and the decode loop against a tiny MoE target of the same family; speculative output
   == target-only greedy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_fixtures import build_qwen3_5_moe, build_qwen3_moe

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.config import check_pairing, resolve_draft_config
from dflash2_numba.families import target_family
from dflash2_numba.inventory import expected_draft_tensors

DATA = Path(__file__).parent / "data" / "moe"
PAIRS = {"qwen3-coder": ("qwen3-coder-30b-a3b.config.json", "qwen3-coder-30b-a3b-dflash.config.json"),
         "qwen3.6": ("qwen3.6-35b-a3b.config.json", "qwen3.6-35b-a3b-dflash.config.json")}


def _load(name):
    return json.loads((DATA / name).read_text())


@pytest.mark.parametrize("pair", list(PAIRS))
def test_full_size_configs_resolve_and_pair(pair):
    t_name, d_name = PAIRS[pair]
    raw_t, raw_d = _load(t_name), _load(d_name)
    family = target_family(raw_t)
    tc = family.resolve(raw_t, t_name)
    dc = resolve_draft_config(raw_d, tc, d_name)
    check_pairing(dc, tc)
    assert dc.block_size == 16 and dc.kind == "dflash"
    expected = family.expected_tensors(tc)
    if pair == "qwen3-coder":
        assert family.name == "qwen3_moe"
        assert (tc.num_experts, tc.num_experts_per_tok, tc.moe_intermediate_size, tc.norm_topk_prob) == (128, 8, 768, True)
        assert tc.moe_layers == list(range(48))
        assert dc.target_layer_ids == [1, 12, 23, 34, 45] and dc.mask_token_id == 151669
        assert dc.layer_window == [None] * 8
        fused = expected.pick(["model.layers.0.mlp.experts.gate_up_proj"])
        assert fused["model.layers.0.mlp.experts.gate_up_proj"] == (128, 1536, 2048)
        per = expected.pick([])
        assert per["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    else:
        assert family.name == "qwen3_5_moe"
        assert (tc.num_experts, tc.num_experts_per_tok, tc.shared_expert_intermediate_size) == (256, 8, 512)
        assert tc.layer_types.count("full_attention") == 10 and tc.prefix == "model.language_model."
        assert dc.layer_window == [4096] * 5 + [None] and dc.mask_token_id == 248077
        assert dc.target_layer_ids == [1, 6, 11, 16, 22, 27, 32, 37]
        fused = expected.pick([f"model.language_model.layers.{i}.mlp.experts.gate_up_proj" for i in range(40)])
        assert fused["model.language_model.layers.39.mlp.experts.down_proj"] == (256, 2048, 512)
        assert fused["model.language_model.layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    d_shapes = expected_draft_tensors(dc, tc.vocab_size)
    assert d_shapes["fc.weight"] == (2048, len(dc.target_layer_ids) * 2048)


SCALE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_scaled_published_draft_runs_lossless(pair, tmp_path):
    """The published draft config with only sizes (and ids of the tiny vocabulary) shrunk."""
    if pair == "qwen3-coder":
        target_dir = build_qwen3_moe(tmp_path / "t", seed=4, num_hidden_layers=6, mlp_only_layers=[])
        taps, L = [0, 1, 2, 4, 5], 6
    else:
        target_dir = build_qwen3_5_moe(tmp_path / "t", seed=4)
        taps, L = [0, 1, 2, 3, 0, 1, 2, 3], 4
    raw_d = _load(PAIRS[pair][1])
    n_layers = raw_d["num_hidden_layers"]
    nkv = 2 if raw_d["num_key_value_heads"] == 8 else 1  # GQA 4:1 -> 4:2 / 8:1 -> 4:1
    draft_dir = tiny.write_draft(tmp_path / "d", target_dir, kind="dflash", num_hidden_layers=n_layers,
                                 block_size=16, target_layer_ids=taps, num_attention_heads=4, num_key_value_heads=nkv,
                                 head_dim=16, intermediate_size=128, mask_token_id=255, seed=2, init_std=0.2,
                                 layer_types=raw_d.get("layer_types"), sliding_window=raw_d.get("sliding_window") and 6)
    cfg = dict(raw_d, **SCALE, num_key_value_heads=nkv, num_target_layers=L, vocab_size=256)
    where = cfg["dflash_config"] if "block_size" in cfg["dflash_config"] else cfg
    where["block_size"] = 16
    cfg["dflash_config"] = dict(cfg["dflash_config"], mask_token_id=255, target_layer_ids=taps)
    if "sliding_window" in cfg:
        cfg["sliding_window"] = 6  # 4096 -> 6: shorter than the prompts, so the window acts
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    target = dn.load_target(target_dir)
    draft = dn.load_draft(draft_dir, target)
    assert draft.config.layer_window == ([None] * 8 if pair == "qwen3-coder" else [6] * 5 + [None])
    prompt = list(range(5, 29))
    base = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=20).output_ids
    for Q in (4, 16):
        assert dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=20, block_size=Q).output_ids == base
