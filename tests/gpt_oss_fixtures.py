"""Tiny gpt-oss targets for tests/test_gpt_oss.py: a GptOssForCausalLM written by transformers 5.x
itself (f32: 8 experts top-2, hidden 64, expert width 32, 4 layers sliding / full with a window of
8 < the prompts, YaRN with original_max_position_embeddings 16 < the prompts, truncate false,
sinks, every bias drawn, expert gate_up scaled x8 so the clamp fires), and the same model in the
Hub's MXFP4 layout (experts quantized here with quant/mxfp4.quantize_mxfp4, everything else bf16,
quantization_config.quant_method "mxfp4"), whose reference is transformers' own MXFP4
dequantization (Mxfp4Config(dequantize=True)) in f32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")
from dflash2_numba import tiny  # noqa: E402

V = 256
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
              rope_parameters=dict(YARN), rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    return GptOssConfig(**kw)


def _randomise(model, seed: int):
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                val = 1.0 + 0.2 * rng.standard_normal(shape)
            elif name.endswith("sinks"):
                val = rng.standard_normal(shape)
            elif name.endswith("router.weight"):
                val = rng.standard_normal(shape) * (2.0 / np.sqrt(shape[-1]))
            elif name.endswith(("bias", "_bias")):
                val = 0.3 * rng.standard_normal(shape)
            elif name.endswith("experts.gate_up_proj"):  # [E, H, 2I]: x8 so |gate| > swiglu_limit happens
                val = 8.0 * rng.standard_normal(shape) / np.sqrt(shape[1])
            elif name.endswith("experts.down_proj"):  # [E, I, H]
                val = rng.standard_normal(shape) / np.sqrt(shape[1])
            elif name.endswith("embed_tokens.weight"):
                val = rng.standard_normal(shape)
            else:  # q / k / v / o / lm_head [out, in]
                val = rng.standard_normal(shape) / np.sqrt(shape[-1])
            p.copy_(torch.from_numpy(val.astype(np.float32)))
    return model


def build_gpt_oss(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny GptOssForCausalLM saved by transformers in f32 (its own tensor names and layout),
    plus the project's tiny tokenizer."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = _randomise(GptOssForCausalLM(gpt_oss_config(**overrides)), seed)
    model.save_pretrained(directory, safe_serialization=True)
    tiny.write_tokenizer_files(Path(directory), tiny.train_tiny_tokenizer(V), "qwen3", 512, chat_template=False)
    return Path(directory)


def to_mxfp4_layout(src: Path, dst: Path) -> Path:
    """The Hub layout of a transformers-written gpt-oss: experts as MXFP4 `*_blocks` / `*_scales`
    (out-major: gate_up [E, 2I, H/32, 16], down [E, H, I/32, 16]), every other tensor bf16,
    quantization_config.quant_method "mxfp4". The MXFP4 values are the model from then on."""
    from dflash2_numba.checkpoint import open_checkpoint
    from dflash2_numba.numerics import f32_to_bf16_array
    from dflash2_numba.quant.mxfp4 import quantize_mxfp4

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    ck = open_checkpoint(src)
    out = {}
    for name in ck.names():
        t = np.array(ck.get(name), np.float32)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> [E, out, in]
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(0, 2, 1))
        else:
            out[name] = f32_to_bf16_array(t)
    tiny.save_safetensors(dst / "model.safetensors", out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def load_hf(directory: Path):
    """transformers in f32 with the eager experts and attention; an MXFP4 directory is
    dequantized by transformers itself (Mxfp4Config(dequantize=True))."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    kw = {}
    if "quantization_config" in json.loads((Path(directory) / "config.json").read_text()):
        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    model = GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32, experts_implementation="eager",
                                              attn_implementation="eager", **kw)
    return model.eval()
