"""The tiny-checkpoint writer: safetensors bytes, determinism, tensor names/shapes (spec §2.1,
§2.2), config layouts, and an independent loader (transformers on CPU) for the targets."""

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
from safetensors import safe_open

from dflash2_numba import tiny
from dflash2_numba.tokenizer import Tokenizer

PUBLISHED_V2 = Path(__file__).parent / "data" / "muse-glimmer-30b-dflash2.config.json"


# ---------------------------------------------------------------- helpers
def read_header(path: Path) -> dict:
    """safetensors header parsed by hand (numpy's safe_open cannot read BF16)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header


def all_headers(model_dir: Path) -> dict:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, entry in read_header(f).items():
            assert name not in out, f"{name} in two files"
            out[name] = entry
    return out


def read_tensors_f32(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor as float32, read by safetensors' own torch reader (handles BF16)."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                out[name] = st.get_tensor(name).float().numpy()
    return out


def dir_digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def expected_target_shapes(cfg: dict, qk_norm: bool) -> dict[str, list[int]]:
    """spec §2.1 tensor list, from the written config."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    s = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = [H]
        s[p + "post_attention_layernorm.weight"] = [H]
        s[p + "self_attn.q_proj.weight"] = [nh * hd, H]
        s[p + "self_attn.k_proj.weight"] = [nkv * hd, H]
        s[p + "self_attn.v_proj.weight"] = [nkv * hd, H]
        s[p + "self_attn.o_proj.weight"] = [H, nh * hd]
        if qk_norm:
            s[p + "self_attn.q_norm.weight"] = [hd]
            s[p + "self_attn.k_norm.weight"] = [hd]
        s[p + "mlp.gate_proj.weight"] = [I, H]
        s[p + "mlp.up_proj.weight"] = [I, H]
        s[p + "mlp.down_proj.weight"] = [H, I]
    if not cfg["tie_word_embeddings"]:
        s["lm_head.weight"] = [V, H]
    return s


def expected_draft_shapes(cfg: dict, V: int, v2: bool, selector: bool = True) -> dict[str, list[int]]:
    """spec §2.2 tensor list, from the written draft config."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dc = cfg["dflash_config"]
    taps_ids = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
    s = {"fc.weight": [H, len(taps_ids) * H], "hidden_norm.weight": [H], "norm.weight": [H]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        s[p + "input_layernorm.weight"] = [H]
        s[p + "post_attention_layernorm.weight"] = [H]
        s[p + "self_attn.q_proj.weight"] = [nh * hd, H]
        s[p + "self_attn.k_proj.weight"] = [nkv * hd, H]
        s[p + "self_attn.v_proj.weight"] = [nkv * hd, H]
        s[p + "self_attn.o_proj.weight"] = [H, nh * hd]
        s[p + "self_attn.q_norm.weight"] = [hd]
        s[p + "self_attn.k_norm.weight"] = [hd]
        s[p + "mlp.gate_proj.weight"] = [I, H]
        s[p + "mlp.up_proj.weight"] = [I, H]
        s[p + "mlp.down_proj.weight"] = [H, I]
        if v2:
            T, G = dc["conv_kernel_size"], H // dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                s[p + f"{conv}.base_kernel"] = [2, T, H]
                s[p + f"{conv}.kernel_projection.weight"] = [2 * T * G, H]
    if v2 and selector:
        r = dc["selector_rank"]
        s["candidate_selector.hidden_projection.weight"] = [r, H]
        s["candidate_selector.predecessor_codebook"] = [V, r]
        s["candidate_selector.successor_codebook"] = [V, r]
    return s


def shapes(headers: dict) -> dict[str, list[int]]:
    return {n: e["shape"] for n, e in headers.items()}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny.write_target(tmp_path_factory.mktemp("t") / "target")


# ---------------------------------------------------------------- safetensors writer
def test_save_safetensors_is_byte_identical_to_the_reference_writer(tmp_path):
    rng = np.random.default_rng(0)
    f32 = {"b.weight": rng.standard_normal((3, 5)).astype(np.float32),
           "a": rng.standard_normal(7).astype(np.float32), "empty": np.zeros((2, 0), np.float32)}
    u16 = {"x": rng.integers(0, 65535, (4, 3)).astype(np.uint16), "y": np.arange(5, dtype=np.uint16)}
    for name, tensors, dtypes in (("f32", f32, None), ("u16", u16, {"x": "U16", "y": "U16"})):
        safetensors.numpy.save_file(tensors, str(tmp_path / f"ref_{name}"), metadata={"format": "pt"})
        tiny.save_safetensors(tmp_path / f"ours_{name}", tensors, dtypes)
        assert (tmp_path / f"ours_{name}").read_bytes() == (tmp_path / f"ref_{name}").read_bytes()


def test_save_safetensors_writes_uint16_as_bf16(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    tiny.save_safetensors(tmp_path / "m.safetensors", {"w": bits, "v": x[0]})
    assert read_header(tmp_path / "m.safetensors")["w"]["dtype"] == "BF16"
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as st:
        w = st.get_tensor("w")
        assert w.dtype == torch.bfloat16
        np.testing.assert_array_equal(w.view(torch.int16).numpy().view(np.uint16), bits)
        np.testing.assert_array_equal(st.get_tensor("v").numpy(), x[0])


def test_save_safetensors_refuses_a_dtype_of_the_wrong_size(tmp_path):
    with pytest.raises(ValueError, match="'w'.*F32"):
        tiny.save_safetensors(tmp_path / "m", {"w": np.zeros(3, np.uint16)}, {"w": "F32"})


# ---------------------------------------------------------------- determinism
def test_same_arguments_give_byte_identical_directories(tmp_path, target_dir):
    again = tiny.write_target(tmp_path / "again")
    assert dir_digest(again) == dir_digest(target_dir)
    d1 = tiny.write_draft(tmp_path / "d1", target_dir, seed=3)
    d2 = tiny.write_draft(tmp_path / "d2", target_dir, seed=3)
    assert dir_digest(d1) == dir_digest(d2)
    other = tiny.write_target(tmp_path / "other", seed=1)
    assert dir_digest(other)["model.safetensors"] != dir_digest(target_dir)["model.safetensors"]
    assert dir_digest(other)["tokenizer.json"] == dir_digest(target_dir)["tokenizer.json"]
    d3 = tiny.write_draft(tmp_path / "d3", target_dir, seed=4)
    assert dir_digest(d3)["model.safetensors"] != dir_digest(d1)["model.safetensors"]


def test_a_fresh_process_writes_the_same_bytes(tmp_path, target_dir):
    """Tokenizer training and the RNG must not depend on process state (hash seeds, caches)."""
    code = ("import sys; from dflash2_numba import tiny; "
            "t = tiny.write_target(sys.argv[1] + '/t'); tiny.write_draft(sys.argv[1] + '/d', t)")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env,
                   cwd=Path(__file__).parents[1])
    assert dir_digest(tmp_path / "t") == dir_digest(target_dir)
    here = tiny.write_draft(tmp_path / "d_here", target_dir)
    assert dir_digest(tmp_path / "d") == dir_digest(here)


def test_f32_and_bf16_writes_hold_the_same_values_up_to_rounding(tmp_path):
    f32 = read_tensors_f32(tiny.write_target(tmp_path / "f32", dtype="f32"))
    bf16_dir = tiny.write_target(tmp_path / "bf16", dtype="bf16")
    assert {e["dtype"] for e in all_headers(bf16_dir).values()} == {"BF16"}
    bf16 = read_tensors_f32(bf16_dir)
    assert f32.keys() == bf16.keys()
    for name in f32:  # torch's own f32 -> bf16 rounding as the reference
        expect = torch.from_numpy(f32[name]).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(bf16[name], expect, err_msg=name)


# ---------------------------------------------------------------- target layout
@pytest.mark.parametrize("architecture,tied", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_target_tensor_names_and_shapes(tmp_path, architecture, tied):
    d = tiny.write_target(tmp_path / "t", architecture=architecture, tie_word_embeddings=tied,
                          num_hidden_layers=3, hidden_size=48, intermediate_size=80,
                          num_attention_heads=6, num_key_value_heads=3, head_dim=12, dtype="f32")  # nh*hd != H
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[architecture]]
    assert cfg["model_type"] == architecture and cfg["tie_word_embeddings"] == tied
    assert shapes(all_headers(d)) == expected_target_shapes(cfg, qk_norm=architecture == "qwen3")
    # numpy reader agrees for f32 files
    with safe_open(str(d / "model.safetensors"), framework="numpy") as st:
        assert list(st.get_tensor("model.embed_tokens.weight").shape) == [cfg["vocab_size"], 48]
    # norms start near 1, matrices near 0
    t = read_tensors_f32(d)
    assert abs(t["model.norm.weight"].mean() - 1) < 0.1 and abs(t["model.embed_tokens.weight"].mean()) < 0.01


def test_target_vocab_is_padded_beyond_the_tokenizer(target_dir):
    cfg = json.loads((target_dir / "config.json").read_text())
    n_tok = Tokenizer.from_dir(target_dir).vocab_size
    assert cfg["vocab_size"] > n_tok and cfg["vocab_size"] % 64 == 0
    gen = json.loads((target_dir / "generation_config.json").read_text())
    assert isinstance(gen["eos_token_id"], list) and len(gen["eos_token_id"]) == 2
    assert all(i < n_tok for i in gen["eos_token_id"] + [cfg["eos_token_id"]])


@pytest.mark.parametrize("num_shards", [2, 3, 39])  # 39: one tensor per shard (llama, 4 layers)
def test_sharded_target_splits_the_same_tensors(tmp_path, num_shards):
    one = tiny.write_target(tmp_path / "one", dtype="f32", architecture="llama")
    three = tiny.write_target(tmp_path / "three", dtype="f32", architecture="llama", num_shards=num_shards)
    files = sorted(p.name for p in three.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]
    index = json.loads((three / "model.safetensors.index.json").read_text())
    for fname in files:  # the index names exactly the tensors each file holds
        in_file = set(read_header(three / fname))
        assert in_file and in_file == {n for n, f in index["weight_map"].items() if f == fname}
    a, b = read_tensors_f32(one), read_tensors_f32(three)
    assert a.keys() == b.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in a.values())
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    # rewriting the directory unsharded leaves no stale shards behind
    tiny.write_target(tmp_path / "three", dtype="f32")
    assert sorted(p.name for p in three.glob("model*")) == ["model.safetensors"]


@pytest.mark.parametrize("architecture,dtype,tied,shards,head_dim", [
    ("qwen3", "bf16", False, 1, 16), ("qwen3", "f32", True, 1, 24), ("llama", "bf16", False, 2, 16),
    ("llama", "f32", True, 1, 8)])
def test_transformers_loads_the_target(tmp_path, architecture, dtype, tied, shards, head_dim):
    """An independent implementation reads every tensor, with no missing/unexpected keys, and
    holds exactly the values we wrote."""
    transformers = pytest.importorskip("transformers")
    d = tiny.write_target(tmp_path / "t", architecture=architecture, dtype=dtype,
                          tie_word_embeddings=tied, num_shards=shards, head_dim=head_dim)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[architecture]
    assert model.dtype == {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    ours = read_tensors_f32(d)
    state = model.state_dict()
    for name, value in ours.items():
        np.testing.assert_array_equal(state[name].float().numpy(), value, err_msg=name)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, json.loads((d / "config.json").read_text())["vocab_size"])
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------- draft layout
@pytest.mark.parametrize("kind,nested", [("dflash", True), ("dflash", False), ("dflash2", True),
                                         ("dflash2", False)])
def test_draft_tensor_names_shapes_and_config(tmp_path, target_dir, kind, nested):
    tcfg = json.loads((target_dir / "config.json").read_text())
    d = tiny.write_draft(tmp_path / "d", target_dir, kind=kind, nested=nested, block_size=6,
                         conv_kernel_size=3, conv_group_size=8, selector_rank=12)
    cfg = json.loads((d / "config.json").read_text())
    v2 = kind == "dflash2"
    assert cfg["architectures"] == ["DFlash2DraftModel" if v2 else "DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    headers = all_headers(d)
    assert {e["dtype"] for e in headers.values()} == {"BF16"}
    assert shapes(headers) == expected_draft_shapes(cfg, tcfg["vocab_size"], v2)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    where, other = (cfg["dflash_config"], cfg) if nested else (cfg, cfg["dflash_config"])
    mask_id = Tokenizer.from_dir(target_dir).token_to_id("<|mask|>")
    assert (where["block_size"], where["mask_token_id"]) == (6, mask_id)
    assert not {"block_size", "mask_token_id", "target_layer_ids"} & other.keys()
    taps = where["target_layer_ids"]
    assert len(set(taps)) == len(taps) == cfg["num_hidden_layers"]
    assert all(0 <= t < tcfg["num_hidden_layers"] - 1 for t in taps) and taps == sorted(taps)
    assert cfg["num_target_layers"] == tcfg["num_hidden_layers"]
    if v2:
        assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == tcfg["rope_theta"]
    else:
        assert cfg["rope_theta"] == tcfg["rope_theta"]


def test_draft_v2_config_follows_the_published_layout(tmp_path, target_dir):
    published = json.loads(PUBLISHED_V2.read_text())
    d = tiny.write_draft(tmp_path / "d", target_dir, kind="dflash2", num_hidden_layers=2,
                         layer_types=["sliding_attention"] * 2, sliding_window=64,
                         output_multiplier=0.25, final_logit_softcapping=20.0)
    cfg = json.loads((d / "config.json").read_text())
    # everything the published file has, we have (bookkeeping keys aside)
    assert published.keys() - cfg.keys() <= {"pad_token_id", "transformers_version"}
    assert published["dflash_config"].keys() <= cfg["dflash_config"].keys()
    assert cfg["rope_parameters"].keys() == published["rope_parameters"].keys()
    for key in ("is_causal", "layer_types", "sliding_window", "use_sliding_window"):
        assert type(cfg[key]) is type(published[key]), key
    assert cfg["dflash_config"]["output_multiplier"] == 0.25
    assert cfg["dflash_config"]["final_logit_softcapping"] == 20.0
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["use_sliding_window"] is True


def test_published_target_layer_ids_formula(tmp_path):
    """A 36-layer target and a 5-layer draft get the spec formula's [1, 9, 17, 25, 33]."""
    t = tiny.write_target(tmp_path / "t36", num_hidden_layers=36, hidden_size=16,
                          intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8)
    d = tiny.write_draft(tmp_path / "d", t, kind="dflash", num_hidden_layers=5)
    assert json.loads((d / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert tiny.build_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]
    assert tiny.build_target_layer_ids(40, 8) == [1, 6, 11, 16, 22, 27, 32, 37]


def test_draft_options_identity_conv_zero_selector_and_no_selector(tmp_path, target_dir):
    d = tiny.write_draft(tmp_path / "id", target_dir, identity_conv=True, zero_selector=True,
                         conv_kernel_size=3, dtype="f32")
    V = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    assert shapes(all_headers(d)) == expected_draft_shapes(json.loads((d / "config.json").read_text()), V, True)
    t = read_tensors_f32(d)
    base = t["layers.0.attention_conv.base_kernel"]  # [side, tap, H]
    assert (base[:, 0] == 1).all() and (base[:, 1:] == 0).all()
    assert not t["layers.1.mlp_conv.kernel_projection.weight"].any()
    assert not t["candidate_selector.successor_codebook"].any()
    assert t["candidate_selector.hidden_projection.weight"].any()
    # the default conv is a perturbed identity, not the identity
    base = read_tensors_f32(tiny.write_draft(tmp_path / "rand", target_dir))["layers.0.mlp_conv.base_kernel"]
    assert 0.5 < base[:, 0].mean() < 1.5 and (base[:, 1:] != 0).any() and (base[0] != base[1]).any()
    no_sel = tiny.write_draft(tmp_path / "nosel", target_dir, include_selector=False)
    cfg = json.loads((no_sel / "config.json").read_text())
    assert shapes(all_headers(no_sel)) == expected_draft_shapes(cfg, V, True, selector=False)


def test_extra_config_merges_last_and_can_delete(tmp_path, target_dir):
    d = tiny.write_draft(tmp_path / "d", target_dir, extra_config={
        "is_causal": "yes", "dflash_config": {"block_size": tiny.DELETE, "attention_sink_bias": True}})
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["is_causal"] == "yes" and cfg["dflash_config"]["attention_sink_bias"] is True
    assert "block_size" not in cfg["dflash_config"] and "mask_token_id" in cfg["dflash_config"]
    t = tiny.write_target(tmp_path / "t", extra_config={"architectures": ["MistralForCausalLM"]})
    assert json.loads((t / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]


def test_writer_refuses_inconsistent_arguments(tmp_path, target_dir):
    with pytest.raises(ValueError, match="conv_group_size 7"):
        tiny.write_draft(tmp_path / "a", target_dir, conv_group_size=7)
    with pytest.raises(ValueError, match="sliding_window"):
        tiny.write_draft(tmp_path / "b", target_dir, layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="distinct tap layers"):
        tiny.write_draft(tmp_path / "c", target_dir, num_hidden_layers=4)
    with pytest.raises(ValueError, match="num_shards"):
        tiny.write_target(tmp_path / "e", architecture="llama", num_shards=40)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        tiny.write_target(tmp_path / "d", vocab_size=64)
