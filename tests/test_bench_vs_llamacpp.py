"""bench/bench_vs_llamacpp.py's GGUF writer, checked without llama.cpp: a tiny Qwen3 written to
GGUF and read back with gguf.GGUFReader (names, shapes, types, bytes, metadata)."""


import numpy as np
import pytest

from dflash2_numba import tiny
from dflash2_numba.checkpoint import open_checkpoint

from bench_scripts import load_bench

gguf = pytest.importorskip("gguf")

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1024)


def _load_bench():
    return load_bench("bench_vs_llamacpp.py", "bench_vs_llamacpp")


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_round_trip(bench, tmp_path, tied):
    src = tiny.write_target(tmp_path / "t", seed=3, dtype="bf16", tie_word_embeddings=tied, **SHAPE)
    out = bench.write_gguf(src, tmp_path / "t.gguf")
    assert not (tmp_path / "t.gguf.partial").exists()
    reader = gguf.GGUFReader(out)
    ck = open_checkpoint(src)
    names = bench.gguf_tensor_names(SHAPE["num_hidden_layers"], tied)

    # every checkpoint tensor, under its llama.cpp name, and nothing else
    got = {t.name: t for t in reader.tensors}
    assert set(got) == set(names.values())
    assert ("output.weight" in got) == (not tied)
    L, H, I, V = SHAPE["num_hidden_layers"], SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    nq, nkv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    ne = {"token_embd.weight": (H, V), "output_norm.weight": (H,)}  # ggml order: ne0 = the row length
    if not tied:
        ne["output.weight"] = (H, V)
    for i in range(L):
        ne.update({f"blk.{i}.attn_q.weight": (H, nq), f"blk.{i}.attn_k.weight": (H, nkv),
                   f"blk.{i}.attn_v.weight": (H, nkv), f"blk.{i}.attn_output.weight": (nq, H),
                   f"blk.{i}.ffn_gate.weight": (H, I), f"blk.{i}.ffn_up.weight": (H, I),
                   f"blk.{i}.ffn_down.weight": (I, H), f"blk.{i}.attn_norm.weight": (H,),
                   f"blk.{i}.ffn_norm.weight": (H,), f"blk.{i}.attn_q_norm.weight": (SHAPE["head_dim"],),
                   f"blk.{i}.attn_k_norm.weight": (SHAPE["head_dim"],)})
    assert set(ne) == set(got)
    for hf_name, gg_name in names.items():
        t = got[gg_name]
        assert tuple(int(x) for x in t.shape) == ne[gg_name], gg_name
        w = ck.get(hf_name)
        if w.ndim == 1:  # norms: F32, the exact bf16 values
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, gg_name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(-1),
                                          (w.astype(np.uint32) << 16).view(np.float32))
        else:  # matrices: BF16, the safetensors bytes unchanged
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16, gg_name
            assert np.asarray(t.data).tobytes() == w.tobytes(), gg_name

    meta = _fields(reader)
    expect = {
        "general.architecture": "qwen3", "general.file_type": int(gguf.LlamaFileType.MOSTLY_BF16),
        "qwen3.block_count": L, "qwen3.embedding_length": H, "qwen3.feed_forward_length": I,
        "qwen3.attention.head_count": SHAPE["num_attention_heads"],
        "qwen3.attention.head_count_kv": SHAPE["num_key_value_heads"],
        "qwen3.attention.key_length": SHAPE["head_dim"], "qwen3.attention.value_length": SHAPE["head_dim"],
        "qwen3.rope.dimension_count": SHAPE["head_dim"], "qwen3.vocab_size": V,
        "qwen3.context_length": 4096, "tokenizer.ggml.model": "none",
    }
    for k, v in expect.items():
        assert meta.get(k) == v, (k, meta.get(k))
    assert meta["qwen3.rope.freq_base"] == pytest.approx(1e6)
    assert meta["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    # the data section is aligned as the format requires
    assert reader.alignment == 32 and all(t.data_offset % 32 == 0 for t in reader.tensors)


def test_gguf_refuses_llama(bench, tmp_path):
    src = tiny.write_target(tmp_path / "l", architecture="llama", seed=0, **SHAPE)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM / Qwen3MoeForCausalLM only"):
        bench.write_gguf(src, tmp_path / "l.gguf")
    assert not (tmp_path / "l.gguf").exists()


def test_weight_bytes_per_token(bench, tmp_path):
    for tied in (False, True):
        src = tiny.write_target(tmp_path / f"t{tied}", seed=0, tie_word_embeddings=tied, **SHAPE)
        H, I, V, L = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"], SHAPE["num_hidden_layers"]
        nq, nkv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
        per_layer = H * nq * 2 + H * nkv * 2 + 3 * H * I
        assert bench.weight_bytes_per_token(src) == 2 * (L * per_layer + V * H)


def test_agreement(bench):
    a = bench.agreement([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 6], 6)
    assert a == {"compared": 6, "prefix_agree": 4, "positions_agree": 5, "first_divergence": 4, "ok": True}
    assert not bench.agreement([1, 2, 3, 4], [1, 7, 3, 4], 4)["ok"]
    assert bench.agreement([1, 2], [1, 2], 32)["first_divergence"] is None


def test_a_different_first_token_is_a_near_tie_only_when_the_logits_say_so(bench):
    """The verdict on a first greedy token that differs: the same model whose top-2 are closer
    than the two engines' measured difference moves two tokens (a warning), or not (a failure:
    a clear winner flipped, or another model's logits)."""
    rng = np.random.default_rng(5)
    ours = rng.standard_normal(4096).astype(np.float32)
    top = np.argsort(ours)[-2:]
    ours[top[1]] = ours[top[0]] + 0.01  # our top-2 gap: 0.01
    close = ours + rng.standard_normal(4096).astype(np.float32) * 0.02
    close[top[0]], close[top[1]] = ours[top[0]] + 0.03, ours[top[1]] - 0.03  # flipped by 0.05
    facts = bench.logits_facts(ours, close)
    assert not facts["same_argmax"] and facts["our_top2_gap"] == pytest.approx(0.01, abs=1e-5)
    assert bench.near_tie(facts)
    wide = ours.copy()
    wide[top[1]] += 1.0  # a clear winner (gap 1.01) that the other engine still flips by 0.05
    flipped = wide + rng.standard_normal(4096).astype(np.float32) * 0.02
    flipped[top[0]] = wide[top[1]] + 0.05
    assert not bench.near_tie(bench.logits_facts(wide, flipped))  # gap 1.01 >> 2 x p99 of the noise
    other = rng.standard_normal(4096).astype(np.float32)  # another model: uncorrelated logits
    assert not bench.near_tie(bench.logits_facts(ours, other))
    assert not bench.near_tie(bench.logits_facts(ours, ours + 0.001))  # same argmax: nothing to excuse
    assert not bench.near_tie(None)


# ---------------------------------------------------------------- the MoE model (--model moe)
MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96, vocab_size=1024)


@pytest.fixture(scope="module")
def moe_dir(bench, tmp_path_factory):
    return bench.write_moe_target(tmp_path_factory.mktemp("moe") / "m", seed=2, num_shards=2, **MOE)


def test_moe_checkpoint_loads_as_qwen3_moe(bench, moe_dir):
    """The written checkpoint is a Qwen3MoeForCausalLM by the family's own inventory (per-expert names)."""
    from dflash2_numba import load_target

    t = load_target(moe_dir)
    c = t.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (8, 2, 48, True)
    assert c.moe_layers == [0, 1]
    ck = open_checkpoint(moe_dir)
    assert ck.info("model.layers.1.mlp.experts.7.down_proj.weight").shape == (64, 48)
    assert ck.info("model.layers.0.mlp.gate.weight").shape == (8, 64)


def test_moe_gguf_round_trip(bench, moe_dir, tmp_path):
    out = bench.write_gguf(moe_dir, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(out)
    got = {t.name: t for t in reader.tensors}
    ck = open_checkpoint(moe_dir)
    L, H, E, I, V = (MOE[k] for k in ("num_hidden_layers", "hidden_size", "num_experts", "moe_intermediate_size",
                                      "vocab_size"))
    nq, nkv = MOE["num_attention_heads"] * MOE["head_dim"], MOE["num_key_value_heads"] * MOE["head_dim"]
    ne = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
    for i in range(L):
        ne.update({f"blk.{i}.attn_q.weight": (H, nq), f"blk.{i}.attn_k.weight": (H, nkv),
                   f"blk.{i}.attn_v.weight": (H, nkv), f"blk.{i}.attn_output.weight": (nq, H),
                   f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                   f"blk.{i}.attn_q_norm.weight": (MOE["head_dim"],), f"blk.{i}.attn_k_norm.weight": (MOE["head_dim"],),
                   f"blk.{i}.ffn_gate_inp.weight": (H, E),  # llama.cpp: {n_embd, n_expert}
                   f"blk.{i}.ffn_gate_exps.weight": (H, I, E), f"blk.{i}.ffn_up_exps.weight": (H, I, E),
                   f"blk.{i}.ffn_down_exps.weight": (I, H, E)})
    assert set(got) == set(ne)
    for name, shape in ne.items():
        assert tuple(int(x) for x in got[name].shape) == shape, name
    for i in range(L):
        router = got[f"blk.{i}.ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32  # as llama.cpp's converter keeps it
        w = ck.get(f"model.layers.{i}.mlp.gate.weight")
        np.testing.assert_array_equal(np.asarray(router.data).reshape(E, H), (w.astype(np.uint32) << 16).view(np.float32))
        for proj, gg in bench.EXPERT_GGUF.items():
            t = got[f"blk.{i}.{gg}.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16
            stacked = np.stack([ck.get(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(E)])
            assert np.asarray(t.data).tobytes() == stacked.tobytes(), (i, proj)  # expert e = slice e
    meta = _fields(reader)
    expect = {"general.architecture": "qwen3moe", "qwen3moe.expert_count": E,
              "qwen3moe.expert_used_count": MOE["num_experts_per_tok"], "qwen3moe.expert_feed_forward_length": I,
              "qwen3moe.block_count": L, "qwen3moe.embedding_length": H, "qwen3moe.vocab_size": V,
              "qwen3moe.attention.head_count": MOE["num_attention_heads"],
              "qwen3moe.attention.head_count_kv": MOE["num_key_value_heads"],
              "qwen3moe.attention.key_length": MOE["head_dim"], "tokenizer.ggml.model": "none"}
    for k, v in expect.items():
        assert meta.get(k) == v, (k, meta.get(k))


def test_moe_gguf_refuses_what_llama_cpp_would_compute_differently(bench, tmp_path):
    """llama.cpp's qwen3moe always renormalises the top k and has no dense layers."""
    import json

    for key, value in (("norm_topk_prob", False), ("mlp_only_layers", [1])):
        src = bench.write_moe_target(tmp_path / key, seed=0, num_shards=1, **MOE)
        cfg = json.loads((src / "config.json").read_text())
        cfg[key] = value
        (src / "config.json").write_text(json.dumps(cfg))
        if key == "mlp_only_layers":  # layer 1 then holds a dense MLP, as the inventory expects
            with pytest.raises(ValueError, match="norm_topk_prob must be true and mlp_only_layers empty"):
                bench.write_gguf(src, tmp_path / f"{key}.gguf")
            continue
        with pytest.raises(ValueError, match="norm_topk_prob must be true"):
            bench.write_gguf(src, tmp_path / f"{key}.gguf")


def test_moe_weight_bytes_per_token_counts_active_experts(bench, moe_dir):
    L, H, E, k, I, V = (MOE[x] for x in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok",
                                         "moe_intermediate_size", "vocab_size"))
    nq, nkv = MOE["num_attention_heads"] * MOE["head_dim"], MOE["num_key_value_heads"] * MOE["head_dim"]
    dense = L * (2 * H * nq + 2 * H * nkv + k * 3 * H * I) + V * H  # attention + k experts + head
    router = L * E * H
    assert bench.weight_bytes_per_token(moe_dir, "bf16") == 2 * dense + 2 * router
    assert bench.weight_bytes_per_token(moe_dir, "q8_0") == int(34 / 32 * dense + 2 * router)
