"""Bad config VALUES of the hybrid (Qwen3.5) and Muse-Glimmer families are named errors, as for
Qwen3 / Llama (tests/test_bad_inputs.py): wrong JSON type or out of range -> ConfigValueError
naming the file, the key and the value; never a traceback, never a silently odd model.

Both resolvers read through config_checks; red on a plain `int(...)` / `float(...)` read (a
string "abc" raises ValueError, a 0 or negative passes)."""

import json
from pathlib import Path

import pytest

from dflash2_numba.errors import ConfigValueError, DFlashError
from dflash2_numba.families import target_family
from dflash2_numba.tiny_hybrid import write_qwen3_5_target

MUSE_30B = Path(__file__).resolve().parent / "data" / "muse-glimmer-30b.config.json"
BAD_VALUES = [  # (key, value, what the message must show)
    ("hidden_size", "abc", "hidden_size = 'abc'"),
    ("hidden_size", 0, "hidden_size = 0"),
    ("num_attention_heads", 0, "num_attention_heads = 0"),
    ("num_key_value_heads", 3, "num_key_value_heads = 3"),
    ("num_hidden_layers", -1, "num_hidden_layers = -1"),
    ("intermediate_size", 12.5, "intermediate_size = 12.5"),
    ("vocab_size", None, "vocab_size"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps = -1e-06"),
    ("rms_norm_eps", "tiny", "rms_norm_eps = 'tiny'"),
    ("eos_token_id", "x", "eos_token_id"),
    ("max_position_embeddings", 0, "max_position_embeddings = 0"),
]


@pytest.fixture(scope="module")
def qwen3_5_raw(tmp_path_factory):
    d = write_qwen3_5_target(tmp_path_factory.mktemp("q") / "t")
    return json.loads((d / "config.json").read_text())


def _resolve(raw):
    family = target_family(raw, "config.json")
    return family.resolve(raw, "config.json")


@pytest.mark.parametrize("family", ["qwen3_5", "muse"])
@pytest.mark.parametrize("key,value,shown", BAD_VALUES)
def test_bad_text_config_value_is_named(qwen3_5_raw, family, key, value, shown):
    raw = json.loads(json.dumps(qwen3_5_raw)) if family == "qwen3_5" else json.loads(MUSE_30B.read_text())
    _resolve(raw)  # the unmodified config resolves
    raw["text_config"][key] = value
    with pytest.raises(DFlashError) as e:
        _resolve(raw)
    assert "config.json" in str(e.value) and shown in str(e.value)
    if value is not None:
        assert isinstance(e.value, ConfigValueError)


@pytest.mark.parametrize("family,key,value", [
    ("qwen3_5", "rope_parameters", {"rope_type": "default", "rope_theta": 0}),
    ("qwen3_5", "rope_parameters", {"rope_type": "default", "rope_theta": "1e7"}),
    ("muse", "rope_parameters", {"rope_type": "default", "rope_theta": -5.0}),
    ("muse", "post_norm_eps", 0),
    ("muse", "qk_scale_factor", "3.87"),
])
def test_bad_family_specific_value_is_named(qwen3_5_raw, family, key, value):
    raw = json.loads(json.dumps(qwen3_5_raw)) if family == "qwen3_5" else json.loads(MUSE_30B.read_text())
    if family == "qwen3_5":  # keep the partial rotary factor, change only the theta
        value = {**raw["text_config"]["rope_parameters"], **value}
    raw["text_config"][key] = value
    with pytest.raises(ConfigValueError, match=key.split("_")[0]):
        _resolve(raw)
