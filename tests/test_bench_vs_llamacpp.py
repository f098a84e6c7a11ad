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
    with pytest.raises(ValueError, match="Qwen3ForCausalLM only"):
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
