"""Writing the drafts as spec §2.2 checkpoints (bf16 safetensors + config.json).

    draft_config_json(spec, kind, eos_id)  -> dict   (published DFlash / DFlash2 layouts)
    save_draft(model, out_dir, eos_id)               config.json + model.safetensors (bf16)
    round_draft_to_bf16_(model)                      the f32 model then computes with the saved values

The DFlash2 config follows `reference/muse-glimmer-30b-dflash2.config.json` (everything in
`dflash_config`, nested `rope_parameters` only). The DFlash v1 config follows the older
published v1 layout (flat `block_size` and `rope_theta`, `dflash_config` holding only
`mask_token_id` / `target_layer_ids`), so the embedded pair exercises both spellings of §2.2.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from .draft_model import DFlashDraft, DraftSpec


def _common(spec: DraftSpec, eos_id: int) -> dict:
    n = spec.num_hidden_layers
    return {
        "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None,
        "dtype": "bfloat16",
        "head_dim": spec.head_dim, "hidden_act": "silu", "hidden_size": spec.hidden_size,
        "initializer_range": 0.02, "intermediate_size": spec.intermediate_size,
        "is_causal": False,
        "layer_types": ["full_attention"] * n,
        "max_position_embeddings": 2048, "max_window_layers": n, "model_type": "qwen3",
        "num_attention_heads": spec.num_attention_heads, "num_hidden_layers": n,
        "num_key_value_heads": spec.num_key_value_heads, "num_target_layers": spec.num_target_layers,
        "rms_norm_eps": spec.rms_norm_eps, "sliding_window": None, "tie_word_embeddings": False,
        "transformers_version": transformers.__version__, "use_cache": False,
        "use_sliding_window": False, "vocab_size": spec.vocab_size,
    }


def draft_config_json(spec: DraftSpec, eos_id: int) -> dict:
    cfg = _common(spec, eos_id)
    if spec.kind == "dflash2":
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"] = {
            "block_size": spec.block_size,
            "conv_group_size": spec.conv_group_size,
            "conv_kernel_size": spec.conv_kernel_size,
            "final_logit_softcapping": spec.final_logit_softcapping,
            "input_embedding_scale": spec.input_embedding_scale,
            "mask_token_id": spec.mask_token_id,
            "output_multiplier": spec.output_multiplier,
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
            "target_layer_ids": list(spec.target_layer_ids),
        }
        cfg["rope_parameters"] = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    else:
        cfg["architectures"] = ["DFlashDraftModel"]
        cfg["block_size"] = spec.block_size
        cfg["dflash_config"] = {"mask_token_id": spec.mask_token_id,
                                "target_layer_ids": list(spec.target_layer_ids)}
        cfg["rope_theta"] = spec.rope_theta
        cfg["rope_scaling"] = None
    return dict(sorted(cfg.items()))


@torch.no_grad()
def round_draft_to_bf16_(model: DFlashDraft) -> None:
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))


def draft_tensors(model: DFlashDraft) -> dict[str, torch.Tensor]:
    """Parameter name == spec §2.2 tensor name; bf16, contiguous."""
    return {name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.named_parameters()}


def save_draft(model: DFlashDraft, out_dir: Path, eos_id: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(draft_config_json(model.spec, eos_id), indent=2) + "\n")
    save_file(draft_tensors(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
