"""bench/moe_pair.py's conversion (a dense Qwen3 -> a Qwen3-MoE of E identical experts behind a
random renormalised top-k router computes the same tokens) and bench/moe_profile.py's import."""

import json

import numpy as np

from dflash2_numba import generate, load_target, tiny
from dflash2_numba.checkpoint import open_checkpoint

from bench_scripts import load_bench

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def test_identical_experts_keep_the_dense_tokens(tmp_path, one_thread):
    mp = load_bench("moe_pair.py", "moe_pair")
    dense = tiny.write_target(tmp_path / "dense", seed=5, dtype="bf16", init_std=0.5, **SHAPE)
    moe = mp.convert_to_moe(dense, tmp_path / "moe", E=4, k=2, seed=1)
    cfg = json.loads((moe / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["norm_topk_prob"],
            cfg["moe_intermediate_size"]) == (["Qwen3MoeForCausalLM"], 4, 2, True, SHAPE["intermediate_size"])
    a, b = open_checkpoint(dense), open_checkpoint(moe)
    for e in range(4):  # every expert is the dense MLP, bit for bit
        assert np.array_equal(b.get(f"model.layers.1.mlp.experts.{e}.down_proj.weight"),
                              a.get("model.layers.1.mlp.down_proj.weight"))
    assert b.info("model.layers.0.mlp.gate.weight").shape == (4, SHAPE["hidden_size"])
    td, tm = load_target(dense), load_target(moe)
    prompt = list(range(5, 25))
    out_d = generate(td, None, prompt_ids=prompt, max_new_tokens=24, temperature=0.0).output_ids
    tm.fused, tm.routing_counts = False, {}
    out_m = generate(tm, None, prompt_ids=prompt, max_new_tokens=24, temperature=0.0).output_ids
    assert out_m == out_d
    assert 0 < tm.routing_counts["experts"] <= 4 * 2 * (24 + 1)  # the op-by-op path counted its union
    tm.fused, tm.routing_counts = True, None
    assert generate(tm, None, prompt_ids=prompt, max_new_tokens=24, temperature=0.0).output_ids == out_d


def test_expected_union():
    mp = load_bench("moe_pair.py", "moe_pair")
    assert mp.expected_union(16, 2, 1) == 2
    assert abs(mp.expected_union(16, 2, 4) - 16 * (1 - (14 / 16) ** 4)) < 1e-12
    assert mp.expected_union(16, 16, 3) == 16


def test_moe_profile_imports():
    load_bench("moe_profile.py", "moe_profile")
