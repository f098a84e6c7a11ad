"""Target families: which config resolver, tensor inventory and model class a target
directory gets, decided from its config.json (`architectures[0]` / `model_type`).

    family = target_family(raw, source)      # raises UnknownArchitectureError
    cfg    = family.resolve(raw, source)      # a frozen config dataclass (HF key names)
    family.expected_tensors(cfg)              # ExpectedTensors for Checkpoint.require / inspect
    family.model_class()                      # imported lazily: .load(dir, device, dtype)

A new architecture is one module here (config dataclass named after the HF keys, tensor
inventory, model) and one more `TargetFamily` in FAMILIES; the decode loop never branches on
the family (every target offers new_cache / forward / embed / lm_head / final_norm, and its
cache offers length and commit(n)).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..config_checks import architecture_of
from ..errors import UnknownArchitectureError
from .gpt_oss import (ARCHITECTURE as GPT_OSS_ARCHITECTURE, describe_gpt_oss, expected_gpt_oss_tensors, is_gpt_oss,
                      resolve_gpt_oss_config)
from .muse_glimmer import (MUSE_ARCHITECTURES, MUSE_MODEL_TYPES, describe_muse, expected_muse_tensors,
                           resolve_muse_config)
from .qwen3 import TARGET_ARCHITECTURES, expected_target_tensors, resolve_target_config
from .qwen3_moe import (ARCHITECTURE as QWEN3_MOE_ARCHITECTURE, describe_qwen3_moe, expected_qwen3_moe_tensors,
                        is_qwen3_moe, resolve_qwen3_moe_config)
from .qwen3_5_moe import (ARCHITECTURES as QWEN3_5_MOE_ARCHITECTURES, describe_qwen3_5_moe,
                          expected_qwen3_5_moe_tensors, is_qwen3_5_moe, resolve_qwen3_5_moe_config)
from .qwen3_5 import (ARCHITECTURES as QWEN3_5_ARCHITECTURES, describe_qwen3_5, expected_qwen3_5_tensors,
                      is_qwen3_5, resolve_qwen3_5_config)


@dataclass(frozen=True)
class TargetFamily:
    name: str
    matches: Callable[[dict], bool]  # raw config.json -> is it this family?
    resolve: Callable[[dict, str], object]  # (raw, source) -> config dataclass
    expected_tensors: Callable[[object], object]  # config -> ExpectedTensors
    model: str  # "module:Class", relative to the package, imported on first use
    describe: Callable[[object], dict] | None = None  # config -> extra inspect facts

    def model_class(self):
        module, cls = self.model.split(":")
        return getattr(importlib.import_module(module, __package__), cls)


def _arch(raw: dict):
    archs = raw.get("architectures")
    return archs[0] if isinstance(archs, list) and archs else None


FAMILIES: list[TargetFamily] = [
    TargetFamily(
        name="qwen3/llama",
        matches=lambda raw: _arch(raw) in TARGET_ARCHITECTURES,
        resolve=lambda raw, source: resolve_target_config(raw, source=source),
        expected_tensors=expected_target_tensors,
        model=".qwen3:TargetModel",
    ),
    TargetFamily(  # Qwen3-30B-A3B, Qwen3-Coder-30B-A3B
        name="qwen3_moe",
        matches=is_qwen3_moe,
        resolve=lambda raw, source: resolve_qwen3_moe_config(raw, source=source),
        expected_tensors=expected_qwen3_moe_tensors,
        model=".qwen3_moe:Qwen3MoeModel",
        describe=describe_qwen3_moe,
    ),
    TargetFamily(  # gpt-oss-20b / -120b (MXFP4 experts as stored, or a bf16 re-upload)
        name="gpt_oss",
        matches=is_gpt_oss,
        resolve=lambda raw, source: resolve_gpt_oss_config(raw, source=source),
        expected_tensors=expected_gpt_oss_tensors,
        model=".gpt_oss:GptOssModel",
        describe=describe_gpt_oss,
    ),
    TargetFamily(
        name="muse-glimmer",
        matches=lambda raw: raw.get("model_type") in MUSE_MODEL_TYPES or _arch(raw) in MUSE_ARCHITECTURES,
        resolve=lambda raw, source: resolve_muse_config(raw, source=source),
        expected_tensors=expected_muse_tensors,
        model=".muse_glimmer:MuseGlimmerTarget",
        describe=describe_muse,
    ),
    TargetFamily(  # the hybrid with experts (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B); before qwen3_5, which claims the rest
        name="qwen3_5_moe",
        matches=is_qwen3_5_moe,
        resolve=lambda raw, source: resolve_qwen3_5_moe_config(raw, source),
        expected_tensors=expected_qwen3_5_moe_tensors,
        model=".qwen3_5_moe:Qwen3_5MoeModel",
        describe=describe_qwen3_5_moe,
    ),
    TargetFamily(  # hybrid Gated DeltaNet + gated attention (Qwen3.5 / Qwen3.8 dense)
        name="qwen3_5",
        matches=is_qwen3_5,  # also claims Qwen3.5-MoE / Qwen3-Next, to refuse them by name
        resolve=lambda raw, source: resolve_qwen3_5_config(raw, source),
        expected_tensors=expected_qwen3_5_tensors,
        model=".qwen3_5:Qwen3_5Model",
        describe=describe_qwen3_5,
    ),
]


def target_family(raw: dict, source: str = "config.json") -> TargetFamily:
    architecture_of(raw, source)  # ConfigValueError for an `architectures` that is not a list of strings
    for family in FAMILIES:
        if family.matches(raw):
            return family
    supported = sorted({*TARGET_ARCHITECTURES, QWEN3_MOE_ARCHITECTURE, GPT_OSS_ARCHITECTURE, *MUSE_ARCHITECTURES,
                        *QWEN3_5_ARCHITECTURES.values(), *QWEN3_5_MOE_ARCHITECTURES.values()})
    raise UnknownArchitectureError(
        f"{source}: architectures[0] = {_arch(raw)!r}, model_type = {raw.get('model_type')!r}; "
        f"supported targets: {', '.join(supported)}")
