"""Every config.json value through the loader's typed reads: a sweep, not a list of instances.

For each family's tiny checkpoint (Qwen3, Llama, DFlash, DFlash2, Qwen3.5 text and multimodal,
Muse-Glimmer, Qwen3-MoE, Qwen3.5-MoE), every key of config.json (and of its nested objects: text_config, dflash_config,
rope_parameters, ...) is replaced in turn by values of other JSON types. `inspect_model` (which
resolves the config exactly as the loaders do) must then either

- raise a DFlashError (a named refusal; the CLI prints it as one line, exit 2), or
- return a report, and where the value has another JSON type than the original (a bool given
  as "false" or 0, an int as "5" or 1.5, an object as a list, ...), resolve to the SAME config
  as the original: the key is not read. A different config means the value was coerced
  (`bool("false")` is True) — silently wrong, which is worse than a traceback.

Anything else (KeyError, TypeError, AttributeError, ValueError ...) is a traceback for a user
and fails the sweep; all failures are listed at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from dflash2_numba import tiny
from dflash2_numba.errors import DFlashError
from dflash2_numba.inspect_model import inspect_model
from dflash2_numba.tiny_hybrid import write_qwen3_5_target

# values of the wrong JSON type for a key whose original value is of the key's type
WRONG = {
    bool: ["false", "true", 0, 1, {}, [], 2.5],
    int: ["5", 1.5, True, {}, [True], "x"],
    float: ["1e-6", True, {}, [], "x"],
    str: [5, True, {}, ["x"], 1.5],
    dict: [[], "x", 5, True, [{}]],
    list: [{}, "x", 5, True],
}
# any key: a named error or a report. No huge numbers: a resolver without its bound would
# allocate until the machine dies, so `num_hidden_layers = 10**30` is a bad-input case run in a
# memory-limited subprocess (tests/test_bad_inputs.py::inspect-layers-huge)
EVERYWHERE = [None, -1, 0, {"a": {"b": 1}}, [[]], ""]


def _json_type(v):
    return {bool: bool, int: float, float: float, str: str, dict: dict, list: list}.get(type(v))


def _paths(cfg: dict, prefix=()):
    """Every (key path) of cfg, nested objects included (one level of lists is not entered)."""
    for k, v in cfg.items():
        yield prefix + (k,), v
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


def _set(cfg: dict, path, value) -> dict:
    out = json.loads(json.dumps(cfg))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _resolved(report: dict) -> str:
    return json.dumps(report["config"], sort_keys=True, default=str)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, tokenizer_vocab_size=300, max_position_embeddings=64)
    qwen3 = tiny.write_target(root / "qwen3", seed=1, **small)
    out = {
        "qwen3": qwen3,
        "qwen3-sliding": tiny.write_target(root / "qwen3-sliding", seed=1, **small,
                                           extra_config={"use_sliding_window": True, "sliding_window": 4,
                                                         "max_window_layers": 1}),
        "llama": tiny.write_target(root / "llama", architecture="llama", seed=2, **small),
        "dflash": tiny.write_draft(root / "dflash", qwen3, kind="dflash", num_hidden_layers=1, block_size=4, seed=3),
        "dflash2": tiny.write_draft(root / "dflash2", qwen3, kind="dflash2", num_hidden_layers=1, block_size=4,
                                    conv_group_size=16, selector_rank=8, selector_top_k=4, seed=4),
        "qwen3_5-text": write_qwen3_5_target(root / "q35t", layout="text", seed=5),
        "qwen3_5-multimodal": write_qwen3_5_target(root / "q35m", layout="multimodal", seed=6),
    }
    try:  # the MoE families, written by transformers (the test extra)
        from moe_fixtures import build_qwen3_5_moe, build_qwen3_moe
    except Exception:  # pytest's Skipped without torch: the other families still run
        pass
    else:
        out["qwen3_moe"] = build_qwen3_moe(root / "qwen3_moe", seed=7)
        out["qwen3_5_moe"] = build_qwen3_5_moe(root / "qwen3_5_moe", seed=8)
    try:
        from muse_fixtures import write_muse_target
    except ImportError:  # transformers without Muse-Glimmer: the other families still run
        return out
    out["muse"] = write_muse_target(root / "muse", "f32")
    return out


def _mutations(cfg: dict):
    for path, original in _paths(cfg):
        typed = _json_type(original)
        for value in WRONG.get(type(original), []):
            yield path, value, typed is not None and _json_type(value) != typed
        for value in EVERYWHERE:
            yield path, value, False


def _sweep(base: Path, scratch: Path) -> list[str]:
    cfg = json.loads((base / "config.json").read_text())
    scratch.mkdir()
    for f in base.iterdir():  # the same weights and tokenizer, a config.json of our own
        if f.name != "config.json":
            os.symlink(f, scratch / f.name)
    (scratch / "config.json").write_text(json.dumps(cfg))
    reference = _resolved(inspect_model(scratch, hash_files=False))  # same path: same `source`
    failures = []
    for path, value, must_not_coerce in _mutations(cfg):
        (scratch / "config.json").write_text(json.dumps(_set(cfg, path, value)))
        where = f"{'.'.join(path)} = {value!r}"
        try:
            report = inspect_model(scratch, hash_files=False)
        except DFlashError:
            continue
        except Exception as e:  # a traceback for the user
            failures.append(f"{where}: {type(e).__name__}: {e}")
            continue
        if must_not_coerce and _resolved(report) != reference:
            failures.append(f"{where}: accepted and resolved to another config (coerced)")
    return failures


FAMILIES = ["qwen3", "qwen3-sliding", "llama", "dflash", "dflash2", "qwen3_5-text", "qwen3_5-multimodal", "muse",
            "qwen3_moe", "qwen3_5_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_config_value_is_read_typed(checkpoints, tmp_path, family):
    if family not in checkpoints:
        pytest.skip(f"no {family} checkpoint: transformers (the test extra) lacks the classes to write it")
    failures = _sweep(checkpoints[family], tmp_path / "m")
    assert not failures, f"{len(failures)} config values not read through the typed checks:\n" + "\n".join(failures)
