"""Tiny random mixture-of-experts targets written by transformers itself (save_pretrained), for
the MoE tests: Qwen3-MoE (per-expert names, as transformers saves them) and Qwen3.5-MoE (inside
the multimodal wrapper; rewritten into the Hub's fused expert layout). Weights are drawn from
numpy seeds and rounded to bf16 values, stored as bf16, and run by transformers in float32 with
the eager experts and attention: the same numbers on both sides, so the CPU fused engine (bf16
panels) is what gets compared."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")
from dflash2_numba import tiny  # noqa: E402

V = 256


def _randomise(model, seed: int, router_std: float = 0.5):
    """Every parameter redrawn (qwen3_5_fixtures.draw), with routers wide enough that routing
    differs token to token and experts scaled by their own fan-in; then rounded to bf16 values,
    stored exactly as bf16 and run exactly in f32."""
    from qwen3_5_fixtures import draw

    rng = np.random.default_rng(seed)
    norm_base = 0.0 if "qwen3_5" in type(model).__module__ else 1.0  # Qwen3 norms multiply by w, Qwen3.5 by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # routers and the shared gate
                val = router_std * rng.standard_normal(shape) * (8.0 / np.sqrt(shape[-1]))
            elif len(shape) == 3:  # fused experts [E, out, in]
                val = rng.standard_normal(shape) * (1.5 / np.sqrt(shape[-1]))
            else:
                val = draw(name, shape, rng, norm_base)
            p.copy_(torch.from_numpy(val.astype(np.float32)).to(torch.bfloat16).to(torch.float32))
    return model


def qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, rope_theta=1e7,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def build_qwen3_moe(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Qwen3MoeForCausalLM saved by transformers (per-expert tensor names), plus the
    project's tiny tokenizer (for load_target and the drafts' mask token)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = _randomise(Qwen3MoeForCausalLM(qwen3_moe_config(**overrides)), seed)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    tiny.write_tokenizer_files(Path(directory), tiny.train_tiny_tokenizer(V), "qwen3", 512, chat_template=False)
    return Path(directory)


def load_hf(directory: Path, cls=None):
    """transformers' model in float32, eager experts (index_add_ per expert in ascending id) and
    eager attention: the oracle configuration (grouped_mm sums the k slots in one reduction)."""
    from transformers import AutoModelForCausalLM

    cls = cls or AutoModelForCausalLM
    model = cls.from_pretrained(directory, dtype=torch.float32, experts_implementation="eager",
                                attn_implementation="eager")
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0].float().numpy()


def hf_greedy(model, prompt, n) -> list[int]:
    """HF greedy by full recomputation (no cache involved)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


QWEN3_5_TEXT = dict(
    vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=2, num_position_embeddings=16)


def build_qwen3_5_moe(directory: Path, seed: int = 0, fused: bool = True) -> Path:
    """A tiny Qwen3_5MoeForConditionalGeneration (vision tower included, ignored by the decoder)
    saved by transformers (per-expert names); fused=True rewrites the experts into the Hub's
    fused layout under model.language_model."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3_5MoeConfig(text_config=QWEN3_5_TEXT, vision_config=QWEN3_5_VISION, tie_word_embeddings=False)
    model = _randomise(Qwen3_5MoeForConditionalGeneration(cfg), seed)
    src = Path(directory) / ("per-expert" if fused else "")
    model.to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
    tiny.write_tokenizer_files(src, tiny.train_tiny_tokenizer(V), "qwen3", 512, chat_template=False)
    if not fused:
        return src
    return fuse_expert_layout(src, Path(directory) / "fused", prefix="model.language_model.layers.")


def fuse_expert_layout(src: Path, dst: Path, prefix: str = "model.layers.") -> Path:
    """Rewrite a per-expert checkpoint into the fused layout (`experts.gate_up_proj [E, 2I, H]`,
    gate rows first; `experts.down_proj [E, H, I]`), every other file copied."""
    import re
    import shutil

    from dflash2_numba.checkpoint import open_checkpoint

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    ckpt = open_checkpoint(src)
    tensors = {n: np.array(ckpt.get(n)) for n in ckpt.names()}  # uint16 = bf16 bits
    out, experts = {}, {}
    pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    for name, t in tensors.items():
        m = pat.match(name)
        if m and name.startswith(prefix):
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for base, per in experts.items():
        E = len(per)
        out[base + ".gate_up_proj"] = np.stack([np.concatenate([per[e]["gate"], per[e]["up"]]) for e in range(E)])
        out[base + ".down_proj"] = np.stack([per[e]["down"] for e in range(E)])
    tiny.save_safetensors(dst / "model.safetensors", out)
    return dst


def config_json(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())
