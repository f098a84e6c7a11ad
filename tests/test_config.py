"""Config resolution (spec §2.2) and tensor inventories (§2.1, §2.2).

The published Muse-Glimmer-30B DFlash2 config and safetensors header are the ground truth for
the DFlash2 layout; transformers writes the targets (an independent writer of both
config.json and the tensor names)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import struct
from pathlib import Path

import pytest

from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.config import build_target_layer_ids, check_pairing, load_draft_config, resolve_draft_config
from dflash2_numba.families.qwen3 import expected_target_tensors, load_target_config, resolve_target_config
from dflash2_numba.inventory import expected_draft_tensors
from dflash2_numba.errors import (
    AttentionSinkBiasError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptHeaderError,
    IsCausalTypeError,
    PairingError,
    TensorShapeError,
    UnknownArchitectureError,
    UnsupportedConfigError,
)

CONFIG_NAME = "muse-glimmer-30b-dflash2.config.json"
HEADER_NAME = "muse-glimmer-30b-dflash2.safetensors-header.json"
CONFIG_SHA256 = "cb684d6f688a22619a63ea1debe7d30c139c195bf3141fd86a763763ab34b5d9"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "reference"
DATA = Path(__file__).resolve().parent / "data"
PUBLISHED_TARGET_VOCAB = 202048  # Muse-Glimmer-30B's vocab_size (the draft config repeats it)


def reference_file(name: str) -> Path:
    """The shared reference when present (then the shipped copy must be identical), else the copy."""
    copy_ = DATA / name
    shared = SHARED / name
    if shared.is_file():
        assert shared.read_bytes() == copy_.read_bytes(), f"tests/data/{name} differs from {shared}"
        return shared
    return copy_


def test_shipped_config_copy_is_the_published_file():
    assert hashlib.sha256((DATA / CONFIG_NAME).read_bytes()).hexdigest() == CONFIG_SHA256
    reference_file(CONFIG_NAME)
    reference_file(HEADER_NAME)


# ---------------------------------------------------------------- the published DFlash2 config
@pytest.fixture(scope="module")
def published():
    raw = json.loads(reference_file(CONFIG_NAME).read_text())
    return raw, resolve_draft_config(raw, source=CONFIG_NAME)


def test_published_dflash2_config_resolves(published):
    _, cfg = published
    assert (cfg.architecture, cfg.kind) == ("DFlash2DraftModel", "dflash2")
    assert cfg.block_size == 16
    assert cfg.rope_theta == 5e5  # only nested rope_parameters in this file
    assert cfg.num_hidden_layers == 5
    assert cfg.layer_window == [2048] * 5  # five sliding layers...
    assert cfg.layer_causal == [False] * 5  # ...non-causal: is_causal false beats the legacy rule
    assert cfg.target_layer_ids == [1, 13, 25, 37, 49] == build_target_layer_ids(52, 5)
    assert cfg.output_multiplier == 0.19611613513818404
    assert cfg.final_logit_softcapping == 20.0
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    assert cfg.input_embedding_scale == 1.0
    assert (cfg.mask_token_id, cfg.num_target_layers, cfg.hidden_size, cfg.head_dim) == (201818, 52, 6656, 128)
    assert cfg.conv_groups == 6656 // 16


def test_published_config_without_is_causal_uses_legacy_rule(published):
    raw, _ = published
    raw = copy.deepcopy(raw)
    del raw["is_causal"]
    assert resolve_draft_config(raw).layer_causal == [True] * 5  # every layer slides -> causal


def published_header() -> dict:
    header = json.loads(reference_file(HEADER_NAME).read_text())
    header.pop("__metadata__", None)
    return header


def test_expected_draft_tensors_match_published_header(published):
    _, cfg = published
    header = published_header()
    assert len(header) == 81
    assert {e["dtype"] for e in header.values()} == {"BF16"}
    expected = expected_draft_tensors(cfg, PUBLISHED_TARGET_VOCAB)
    assert {n: tuple(e["shape"]) for n, e in header.items()} == dict(expected)
    without_selector = expected_draft_tensors(cfg, PUBLISHED_TARGET_VOCAB, include_selector=False)
    assert set(expected) - set(without_selector) == {n for n in header if n.startswith("candidate_selector.")}


@pytest.fixture(scope="module")
def published_sparse_checkpoint(tmp_path_factory, published):
    """The published header over a sparse (all-zero, unallocated) 5.5 GB payload."""
    d = tmp_path_factory.mktemp("muse_glimmer")
    (d / "config.json").write_bytes(reference_file(CONFIG_NAME).read_bytes())
    blob = reference_file(HEADER_NAME).read_bytes()
    payload = max(e["data_offsets"][1] for e in published_header().values())
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + payload)
    return d


def test_published_header_loads_through_production_reader(published_sparse_checkpoint):
    d = published_sparse_checkpoint
    cfg = load_draft_config(d)
    ckpt = open_checkpoint(d)
    ckpt.require(expected_draft_tensors(cfg, PUBLISHED_TARGET_VOCAB))
    norm = ckpt.get("layers.4.self_attn.k_norm.weight")
    assert norm.shape == (128,) and norm.dtype.name == "uint16" and not norm.any()


def test_codebook_rows_from_another_vocab_named_clearly(published_sparse_checkpoint):
    d = published_sparse_checkpoint
    cfg = load_draft_config(d)
    with pytest.raises(TensorShapeError) as e:
        open_checkpoint(d).require(expected_draft_tensors(cfg, 151936))  # a Qwen3 target's vocab
    msg = str(e.value)
    assert "candidate_selector." in msg and "_codebook" in msg
    assert "[202048, 256]" in msg and "expected [151936, 256]" in msg and "TARGET" in msg


def test_fc_width_mismatch_named(tmp_path, published):
    raw, _ = published
    raw = copy.deepcopy(raw)
    raw["dflash_config"]["target_layer_ids"] = [1, 13, 25, 37]  # four taps; the file has five
    cfg = resolve_draft_config(raw)
    d = tmp_path / "d"
    d.mkdir()
    blob = reference_file(HEADER_NAME).read_bytes()
    payload = max(e["data_offsets"][1] for e in published_header().values())
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + payload)
    with pytest.raises(TensorShapeError) as e:
        open_checkpoint(d).require(expected_draft_tensors(cfg, PUBLISHED_TARGET_VOCAB))
    msg = str(e.value)
    assert "'fc.weight'" in msg and "[6656, 33280]" in msg and "expected [6656, 26624]" in msg and "4 taps" in msg


# ---------------------------------------------------------------- DFlash v1: flat == nested
V1_BASE = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "vocab_size": 1000,
}
V1_KEYS = {"block_size": 16, "mask_token_id": 999, "target_layer_ids": [1, 9, 17, 25, 33]}


def v1_flat(**extra):
    return {**V1_BASE, **V1_KEYS, "num_target_layers": 36, "rope_theta": 2e6, **extra}


def v1_nested(**extra):
    return {**V1_BASE, "dflash_config": {**V1_KEYS, "num_target_layers": 36},
            "rope_parameters": {"rope_theta": 2e6, "rope_type": "default"}, **extra}


def test_v1_flat_and_nested_resolve_identically():
    flat = resolve_draft_config(v1_flat(), source="flat/config.json")
    nested = resolve_draft_config(v1_nested(), source="nested/config.json")
    assert flat.source != nested.source
    assert dataclasses.replace(flat, source="") == dataclasses.replace(nested, source="")
    assert (flat.kind, flat.block_size, flat.mask_token_id, flat.rope_theta) == ("dflash", 16, 999, 2e6)
    assert flat.conv_kernel_size is None and flat.selector_top_k is None


def test_nested_wins_over_flat_for_dflash_keys_and_flat_wins_for_rope():
    raw = v1_flat(dflash_config={"block_size": 8, "mask_token_id": 5, "target_layer_ids": [2, 4, 6, 8, 10]},
                  rope_parameters={"rope_theta": 7.0})
    cfg = resolve_draft_config(raw)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 5, [2, 4, 6, 8, 10])
    assert cfg.rope_theta == 2e6  # flat rope_theta wins over nested


def test_rope_theta_default_and_nested():
    raw = v1_flat()
    del raw["rope_theta"]
    assert resolve_draft_config(raw).rope_theta == 1e6
    assert resolve_draft_config({**raw, "rope_parameters": {"rope_theta": 3.0}}).rope_theta == 3.0


def test_rope_scaling_refused_unless_yarn():
    """Drafts implement plain RoPE and YaRN (models/rope.py); every other rope_type is refused."""
    raw = v1_flat(rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(UnsupportedConfigError, match=r"rope_scaling.rope_type = 'longrope'"):
        resolve_draft_config(raw)
    yarn = resolve_draft_config(v1_flat(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 1024}))
    assert yarn.rope_scaling.factor == 4.0 and yarn.rope_scaling.truncate is True
    assert resolve_draft_config(v1_flat()).rope_scaling is None


@pytest.mark.parametrize(
    "L,n,expected",
    [(36, 5, [1, 9, 17, 25, 33]), (52, 5, [1, 13, 25, 37, 49]), (40, 8, [1, 6, 11, 16, 22, 27, 32, 37]),
     # exact halves: 1 + 3/2 = 2.5 and 1 + 7/2 = 4.5 round to even (Python round), not up
     (7, 3, [1, 2, 4]), (11, 3, [1, 4, 8])],
)
def test_build_target_layer_ids(L, n, expected):
    assert build_target_layer_ids(L, n) == expected


@pytest.mark.parametrize("L", [1, 7, 36, 52])
def test_build_target_layer_ids_single_layer(L):
    assert build_target_layer_ids(L, 1) == [L // 2]


def test_target_layer_ids_built_when_absent():
    raw = v1_flat()
    del raw["target_layer_ids"]
    raw["num_target_layers"] = 40
    raw["num_hidden_layers"] = 8
    assert resolve_draft_config(raw).target_layer_ids == build_target_layer_ids(40, 8)


def test_num_target_layers_from_target_when_absent():
    raw = v1_flat()
    del raw["target_layer_ids"], raw["num_target_layers"]
    target = resolve_target_config(qwen3_target_raw(num_hidden_layers=52))
    cfg = resolve_draft_config(raw, target)
    assert cfg.num_target_layers == 52 and cfg.target_layer_ids == [1, 13, 25, 37, 49]
    with pytest.raises(ConfigError, match="num_target_layers"):
        resolve_draft_config(raw)


# ---------------------------------------------------------------- attention layout
def test_absent_layer_types_is_full_non_causal():
    cfg = resolve_draft_config(v1_flat())
    assert cfg.layer_types is None
    assert cfg.layer_window == [None] * 5 and cfg.layer_causal == [False] * 5


def test_use_swa_without_layer_types_slides_every_layer():
    cfg = resolve_draft_config(v1_flat(dflash_config={"use_swa": True, "swa_window_size": 512}))
    assert cfg.layer_window == [512] * 5 and cfg.layer_causal == [False] * 5


def test_swa_window_nested_wins_over_sliding_window():
    cfg = resolve_draft_config(v1_flat(dflash_config={"use_swa": True, "swa_window_size": 512}, sliding_window=64))
    assert cfg.sliding_window == 512


def test_layer_types_legacy_causality():
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "full_attention"]
    cfg = resolve_draft_config(v1_flat(layer_types=types, sliding_window=128))
    assert cfg.layer_causal == [True, False, True, False, False]
    assert cfg.layer_window == [128, None, 128, None, None]


@pytest.mark.parametrize("is_causal", [True, False])
def test_is_causal_precedence(is_causal):
    types = ["sliding_attention", "full_attention"] * 2 + ["full_attention"]
    # is_causal beats dflash_config.causal and the layer_types rule
    raw = v1_flat(layer_types=types, sliding_window=8, is_causal=is_causal,
                  dflash_config={"causal": not is_causal})
    assert resolve_draft_config(raw).layer_causal == [is_causal] * 5
    # without is_causal, dflash_config.causal beats the layer_types rule
    raw = v1_flat(layer_types=types, sliding_window=8, dflash_config={"causal": is_causal})
    assert resolve_draft_config(raw).layer_causal == [is_causal] * 5


@pytest.mark.parametrize(
    "where,value",
    [("is_causal", "false"), ("is_causal", "true"), ("is_causal", 0), ("is_causal", [False] * 5),
     ("dflash_config.causal", "false")],
)
def test_non_bool_is_causal_refused(where, value):
    raw = v1_flat(dflash_config={"causal": value}) if where.startswith("dflash") else v1_flat(is_causal=value)
    with pytest.raises(IsCausalTypeError) as e:
        resolve_draft_config(raw, source="d/config.json")
    msg = str(e.value)
    assert "d/config.json" in msg and where in msg and repr(value) in msg and "JSON bool" in msg


@pytest.mark.parametrize("nested", [True, False])
def test_attention_sink_bias_refused_by_name(nested):
    raw = v1_flat(dflash_config={"attention_sink_bias": True}) if nested else v1_flat(attention_sink_bias=True)
    with pytest.raises(AttentionSinkBiasError) as e:
        resolve_draft_config(raw, source="d/config.json")
    assert "attention_sink_bias = True" in str(e.value) and "d/config.json" in str(e.value)
    raw = v1_flat(dflash_config={"attention_sink_bias": False})
    assert resolve_draft_config(raw).block_size == 16  # false is fine


def test_sliding_layer_without_window():
    raw = v1_flat(layer_types=["sliding_attention"] + ["full_attention"] * 4)
    with pytest.raises(ConfigError, match="slides but no window") as e:
        resolve_draft_config(raw, source="d/config.json")
    assert "swa_window_size" in str(e.value) and "sliding_window" in str(e.value)


def test_layer_types_wrong_length_or_value():
    with pytest.raises(ConfigError, match="3 entries, expected 5"):
        resolve_draft_config(v1_flat(layer_types=["full_attention"] * 3))
    with pytest.raises(ConfigError, match="'chunked_attention'"):
        resolve_draft_config(v1_flat(layer_types=["chunked_attention"] * 5))


# ---------------------------------------------------------------- required keys
@pytest.mark.parametrize("key", ["block_size", "mask_token_id"])
def test_missing_block_size_or_mask_token(key):
    raw = v1_flat()
    del raw[key]
    with pytest.raises(ConfigError) as e:
        resolve_draft_config(raw, source="d/config.json")
    assert f"{key} missing" in str(e.value) and f"dflash_config.{key}" in str(e.value)
    assert "d/config.json" in str(e.value)


@pytest.mark.parametrize("key", ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"])
def test_dflash2_missing_conv_or_selector_key(published, key):
    raw, _ = published
    raw = copy.deepcopy(raw)
    del raw["dflash_config"][key]
    with pytest.raises(ConfigError) as e:
        resolve_draft_config(raw, source="d/config.json")
    assert f"dflash_config.{key}" in str(e.value) and "DFlash2DraftModel" in str(e.value)


def test_conv_group_size_must_divide_hidden(published):
    raw = copy.deepcopy(published[0])
    raw["dflash_config"]["conv_group_size"] = 15
    with pytest.raises(ConfigError, match="conv_group_size 15 does not divide hidden_size 6656"):
        resolve_draft_config(raw)


@pytest.mark.parametrize("cap", [None, 0, 0.0, -5.0])
def test_softcap_disabled(published, cap):
    raw = copy.deepcopy(published[0])
    raw["dflash_config"]["final_logit_softcapping"] = cap
    assert resolve_draft_config(raw).final_logit_softcapping is None


def test_output_scalars_default_to_one(published):
    raw = copy.deepcopy(published[0])
    del raw["dflash_config"]["output_multiplier"]
    raw["dflash_config"]["input_embedding_scale"] = None
    cfg = resolve_draft_config(raw)
    assert cfg.output_multiplier == 1.0 and cfg.input_embedding_scale == 1.0


@pytest.mark.parametrize("archs", [["Qwen3ForCausalLM"], ["DFlash3DraftModel"], [], None])
def test_unknown_draft_architecture(archs):
    raw = v1_flat(architectures=archs)
    with pytest.raises(UnknownArchitectureError) as e:
        resolve_draft_config(raw, source="d/config.json")
    assert repr((archs or [None])[0]) in str(e.value) and "DFlash2DraftModel" in str(e.value)


def test_unknown_target_architecture():
    with pytest.raises(UnknownArchitectureError) as e:
        resolve_target_config(qwen3_target_raw(architectures=["MistralForCausalLM"]), source="t/config.json")
    assert "'MistralForCausalLM'" in str(e.value) and "Qwen3ForCausalLM" in str(e.value) and "t/config.json" in str(e.value)


def test_load_config_missing_things(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_draft_config(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="config.json not found"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptHeaderError, match="config.json: not valid JSON"):
        load_target_config(tmp_path)


# ---------------------------------------------------------------- pairing
def qwen3_target_raw(**over):
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 36, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 1000, "rope_theta": 1e6, "tie_word_embeddings": False, "eos_token_id": [7, 8]}
    return {**raw, **over}


def test_pairing_accepts_matching_pair():
    target = resolve_target_config(qwen3_target_raw())
    check_pairing(resolve_draft_config(v1_flat()), target)
    assert target.eos_token_id == [7, 8] and target.has_qk_norm


@pytest.mark.parametrize(
    "target_over,draft_over,needles",
    [
        ({"hidden_size": 128, "head_dim": 32}, {}, ["draft hidden_size 64", "target hidden_size 128"]),
        ({"num_hidden_layers": 33}, {}, ["[33]", "33 layers"]),
        ({"vocab_size": 999}, {}, ["mask_token_id 999", "vocab_size 999"]),
        ({}, {"mask_token_id": 1000}, ["mask_token_id 1000", "vocab_size 1000"]),  # -1: ConfigValueError at resolve
    ],
)
def test_pairing_refusals_name_both_values(target_over, draft_over, needles):
    target = resolve_target_config(qwen3_target_raw(**target_over), source="t/config.json")
    draft = resolve_draft_config(v1_flat(**draft_over), source="d/config.json")
    with pytest.raises(PairingError) as e:
        check_pairing(draft, target)
    msg = str(e.value)
    assert "d/config.json" in msg and "t/config.json" in msg
    for needle in needles:
        assert needle in msg


# ---------------------------------------------------------------- targets written by transformers
@pytest.fixture(scope="module")
def hf_targets(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: transformers' models need it")

    torch.manual_seed(0)
    small = dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=123456.0)
    out = {}
    for arch, tie in [("Qwen3", True), ("Qwen3", False), ("Llama", False)]:
        conf_cls = getattr(transformers, f"{arch}Config")
        model_cls = getattr(transformers, f"{arch}ForCausalLM")
        hf_cfg = conf_cls(**small, tie_word_embeddings=tie)
        d = tmp_path_factory.mktemp(f"{arch}_{tie}")
        model_cls(hf_cfg).save_pretrained(d)
        out[(arch, tie)] = d
    return out


@pytest.mark.parametrize("key", [("Qwen3", True), ("Qwen3", False), ("Llama", False)])
def test_expected_target_tensors_match_transformers(hf_targets, key):
    d = hf_targets[key]
    cfg = load_target_config(d)
    assert cfg.architecture == f"{key[0]}ForCausalLM" and cfg.tie_word_embeddings is key[1]
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (32, 8, 2, 48)
    assert cfg.rope_theta == 123456.0  # transformers 5 writes it nested only
    ckpt = open_checkpoint(d)
    expected = expected_target_tensors(cfg)
    ckpt.require(expected)  # exact inventory: nothing missing, nothing extra, shapes right
    required = set(expected) - expected.optional  # optional names are shape-checked when present
    assert set(ckpt.names()) - expected.optional == required
    assert ("lm_head.weight" in required) is (not key[1])


def test_target_redundant_lm_head_tolerated_when_tied(hf_targets, tmp_path):
    cfg = load_target_config(hf_targets[("Qwen3", True)])
    untied = open_checkpoint(hf_targets[("Qwen3", False)])  # holds lm_head.weight
    expected = expected_target_tensors(cfg)
    assert "lm_head.weight" in expected.optional
    untied.require(expected)  # a saved copy of a tied head is not an unexpected tensor


def test_target_shape_mismatch_names_tensor(hf_targets):
    cfg = dataclasses.replace(load_target_config(hf_targets[("Llama", False)]), intermediate_size=64)
    with pytest.raises(TensorShapeError) as e:
        open_checkpoint(hf_targets[("Llama", False)]).require(expected_target_tensors(cfg))
    msg = str(e.value)
    assert "mlp." in msg and "expected [" in msg and "64" in msg and "40" in msg
