"""Tiny random Muse-Glimmer checkpoints written BY transformers (save_pretrained), for
tests/test_muse_target.py and tests/test_muse_spec.py, plus the HF oracles that read them.

Every parameter is redrawn from a seeded normal: the library init makes the centred (1+w) norm
weights exactly 0 and the final norm exactly 1, which would hide a (1+w) vs w mix-up.

    write_muse_target(dir, case)     case in CASES: "f32", "bf16", "stress", "tied"
    write_assistant(dir, taps)       MuseGlimmerAssistantModel (Meta's DFlash v1 head)
    hf_target(dir, dtype)            MuseGlimmerForConditionalGeneration, eager attention
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")
from transformers import (MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, MuseGlimmerConfig,
                          MuseGlimmerForConditionalGeneration)

torch.set_num_threads(1)

V, H, MASK_ID = 300, 64, 297  # the mask token is a row of the target's embedding
IMAGE_ID, VIDEO_ID = V - 1, V - 2


def text_config(**over) -> dict:
    cfg = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24,  # nh*hd = 96 != H: q/o not square, as at 30B
               sliding_window=4, rms_norm_eps=1e-5, post_norm_eps=1e-8, qk_scale_factor=3.87,
               output_multiplier=0.19611613513818404, final_logit_softcapping=20.0,
               rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=None, pad_token_id=0, max_position_embeddings=512)
    cfg.update(over)
    return cfg


VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=2,
              patch_temporal=2, merge_size=2, pos_emb_height=2, pos_emb_width=2, max_position_embeddings=4,
              layer_types=["window_attention", "full_attention"])

# case: (text_config overrides, top-level overrides, seed, torch dtype)
CASES = {
    "f32": ({}, {}, 0, torch.float32),  # L 4 -> [s, s, s, F], W 4, release scalars
    "bf16": ({}, {}, 0, torch.bfloat16),  # the same weights as bf16
    # eps / post_eps / qk scale / multiplier / softcap exaggerated so that their mistakes show
    # (at release scalars they sit under a 1e-4 tolerance); L 6 -> [s, F, s, s, s, F]: a
    # sliding layer after a global one; W 3
    "stress": (dict(num_hidden_layers=6, rms_norm_eps=0.3, post_norm_eps=0.05, qk_scale_factor=1.7,
                    output_multiplier=3.0, final_logit_softcapping=1.5, sliding_window=3), {}, 3, torch.float32),
    # tying is decided by the TOP-LEVEL key of the composite config (the file then has no lm_head)
    "tied": (dict(tie_word_embeddings=True), dict(tie_word_embeddings=True), 5, torch.float32),
}


def build_muse(text_over=None, seed=0, **top) -> MuseGlimmerForConditionalGeneration:
    config = MuseGlimmerConfig(**top, text_config=text_config(**(text_over or {})), vision_config=VISION,
                               out_hidden_size=64, projector_hidden_size=32, image_token_id=IMAGE_ID,
                               video_token_id=VIDEO_ID)
    torch.manual_seed(seed)
    model = MuseGlimmerForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):  # the four centred (1+w) norms per layer
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name == "model.language_model.norm.weight":  # plain w
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.5 if "embed_tokens" in name else 0.15) * torch.randn(p.shape, generator=g))
    return model


def write_muse_target(directory, case: str) -> Path:
    text_over, top, seed, dtype = CASES[case]
    build_muse(text_over, seed, **top).to(dtype).save_pretrained(directory)
    return Path(directory)


def hf_target(directory, dtype=torch.float32, attn="eager"):
    return MuseGlimmerForConditionalGeneration.from_pretrained(directory, dtype=dtype,
                                                               attn_implementation=attn).eval()


def hf_logits_and_taps(model, ids):
    """Text-only HF forward: (logits [T, V] f32, hidden_states list of [T, H] f32). Entry l+1 is
    the residual after layer l for l < L-1 (the last entry is post-final-norm)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float().numpy(), [h[0].float().numpy() for h in out.hidden_states]


def hf_greedy(model, ids, n_new):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                             min_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def write_assistant(directory, target_layer_ids, seed=7, block_size=16, window=4) -> Path:
    config = MuseGlimmerAssistantConfig(
        hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        max_position_embeddings=512, sliding_window=window, block_size=block_size, mask_token_id=MASK_ID,
        target_layer_ids=list(target_layer_ids), bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_enc.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(directory)
    return Path(directory)


def hf_assistant(directory):
    return MuseGlimmerAssistantModel.from_pretrained(directory, attn_implementation="eager").eval()


def read_config(directory) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def prompt(n, seed=0) -> list[int]:
    """n ids below the image/video/mask ids."""
    return np.random.default_rng(seed).integers(3, MASK_ID, n).tolist()
