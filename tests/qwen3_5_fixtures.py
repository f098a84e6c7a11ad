"""Tiny random Qwen3.5 hybrid targets written by transformers itself (save_pretrained), shared by
the Qwen3.5 tests. Every parameter is redrawn from numpy seeds so that no path is a no-op:
zero-centred norm weights away from 0, GDN norm weights away from 1, A_log / dt_bias spread."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")

V, H, LAYERS = 256, 64, 5
# G G A G A: attention in the middle and at the end, GDN first (taps cross both kinds)
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
TEXT = dict(
    vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # rotary 8 of 32 dims
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, layer_types=LAYER_TYPES,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=4,
              temporal_patch_size=2, num_position_embeddings=16)


def draw(name: str, shape: tuple, rng, norm_base: float = 0.0) -> np.ndarray:
    """A parameter's random value, by what it is: A_log / dt_bias spread, the GDN norm weight
    around 1, other 1-D weights around norm_base (0: Qwen3.5's zero-centred norms, used as 1 + w),
    conv taps, embeddings, projections at 1.5 / sqrt(fan_in). The MoE fixtures draw through it too."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.5, 4.0, shape))
    if name.endswith("dt_bias"):
        return rng.standard_normal(shape)
    if name.endswith("linear_attn.norm.weight"):  # plain weight, init 1
        return 1.0 + 0.3 * rng.standard_normal(shape)
    if len(shape) == 1:  # norms and vision biases
        return norm_base + 0.3 * rng.standard_normal(shape)
    if "conv1d" in name:
        return 0.5 * rng.standard_normal(shape)
    if "embed_tokens" in name:
        return rng.standard_normal(shape)
    return rng.standard_normal(shape) * (1.5 / np.sqrt(int(np.prod(shape[1:]))))


def _randomise(model, seed):
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(draw(name, tuple(p.shape), rng).astype(np.float32)))
    return model


def build_hf_qwen3_5(directory, *, multimodal: bool, tied: bool, dtype=torch.float32, seed: int = 0,
                     text_overrides: dict | None = None):
    """Write a tiny Qwen3_5ForCausalLM (multimodal=False) or Qwen3_5ForConditionalGeneration."""
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig)

    text = dict(TEXT, tie_word_embeddings=tied, **(text_overrides or {}))
    torch.manual_seed(seed)
    if multimodal:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION,
                                                               tie_word_embeddings=tied))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    _randomise(model, seed)
    if tied:
        model.tie_weights()
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    return directory


def load_hf(directory, dtype=torch.float32):
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    cfg = json.loads((directory / "config.json").read_text())
    cls = Qwen3_5ForConditionalGeneration if cfg["model_type"] == "qwen3_5" else Qwen3_5ForCausalLM
    model = cls.from_pretrained(directory, dtype=dtype, config=AutoConfig.from_pretrained(directory))
    return model.eval()


def hf_layers(model):
    inner = model.model
    return (inner.language_model if hasattr(inner, "language_model") else inner).layers


def hf_forward(model, ids, taps=()):
    """Full-sequence HF forward -> (logits [T, V] f32, {l: residual after layer l [T, H]}) (forward
    hooks on the decoder layers: independent of how hidden_states is indexed)."""
    seen, hooks = {}, []
    for l in taps:
        hooks.append(hf_layers(model)[l].register_forward_hook(
            lambda mod, inp, out, l=l: seen.__setitem__(l, (out[0] if isinstance(out, tuple) else out))))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)])).logits
    for h in hooks:
        h.remove()
    return logits[0].float().numpy(), {l: seen[l][0].float().numpy() for l in taps}


def hf_greedy(model, prompt, n):
    """HF greedy by full recomputation (no cache involved)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
