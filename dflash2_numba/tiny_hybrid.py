"""Deterministic tiny Qwen3.5 hybrid targets (Gated DeltaNet + gated attention), written without
torch in the published layouts (tests check the names and shapes against transformers' own):

    write_qwen3_5_target(path, layout="multimodal")  Qwen3_5ForConditionalGeneration layout:
        config.json with `text_config`, weights under `model.language_model.`
    write_qwen3_5_target(path, layout="text")        Qwen3_5ForCausalLM: flat config, `model.`

Values follow tiny.py's rule (one RNG per tensor name), with every path alive: zero-centred norm
weights (used as 1 + w) around 0, the GDN output norm around 1, A_log = log(U(1, 8)), dt_bias
around 0. `mtp=True` adds a few `mtp.*` tensors (the published checkpoints carry an MTP head that
the loader ignores by name). Used by the CUDA tests and bench/bench_hybrid.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .tiny import (ENDOFTEXT, IM_END, SPECIAL_TOKENS, _HF_DTYPE, _cast, _merge, _normal, _norm_weight, _rng,
                   _target_tokenizer, _write_json, _write_weights, write_tokenizer_files)


def write_qwen3_5_target(path, *, layout: str = "multimodal", hidden_size: int = 64, intermediate_size: int = 128,
                         num_hidden_layers: int = 4, layer_types: list[str] | None = None,
                         full_attention_interval: int = 4, num_attention_heads: int = 4,
                         num_key_value_heads: int = 2, head_dim: int = 32, linear_num_key_heads: int = 2,
                         linear_num_value_heads: int = 4, linear_key_head_dim: int = 16,
                         linear_value_head_dim: int = 16, linear_conv_kernel_dim: int = 4,
                         partial_rotary_factor: float = 0.25, rope_theta: float = 1e7,
                         vocab_size: int | None = None, tie_word_embeddings: bool = False, dtype: str = "bf16",
                         seed: int = 0, init_std: float = 0.02, rms_norm_eps: float = 1e-6,
                         max_position_embeddings: int = 4096, tokenizer_vocab_size: int = 1000,
                         mtp: bool = False, extra_config: dict | None = None) -> Path:
    if layout not in ("multimodal", "text"):
        raise ValueError(f"layout must be 'multimodal' or 'text', got {layout!r}")
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = _target_tokenizer("qwen3", tokenizer_vocab_size)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    V = (n_tok // 64 + 1) * 64 if vocab_size is None else vocab_size
    H, I, L = hidden_size, intermediate_size, num_hidden_layers
    if layer_types is None:
        layer_types = ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                       for i in range(L)]
    nh, nkv, hd = num_attention_heads, num_key_value_heads, head_dim
    Hk, Hv, dk, dv, K = (linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
                         linear_value_head_dim, linear_conv_kernel_dim)
    C = 2 * Hk * dk + Hv * dv
    P = "model.language_model." if layout == "multimodal" else "model."

    w: dict[str, np.ndarray] = {}

    def mat(name, shape):
        w[name] = _normal(seed, name, shape, init_std)

    def zero_centred(name, n):  # stored w, used as 1 + w
        w[name] = _normal(seed, name, (n,), 0.1)

    mat(P + "embed_tokens.weight", (V, H))
    for i, kind in enumerate(layer_types):
        p = f"{P}layers.{i}."
        zero_centred(p + "input_layernorm.weight", H)
        if kind == "full_attention":
            a = p + "self_attn."
            mat(a + "q_proj.weight", (2 * nh * hd, H))  # query | gate per head
            mat(a + "k_proj.weight", (nkv * hd, H))
            mat(a + "v_proj.weight", (nkv * hd, H))
            mat(a + "o_proj.weight", (H, nh * hd))
            zero_centred(a + "q_norm.weight", hd)
            zero_centred(a + "k_norm.weight", hd)
        else:
            g = p + "linear_attn."
            mat(g + "in_proj_qkv.weight", (C, H))
            mat(g + "in_proj_z.weight", (Hv * dv, H))
            mat(g + "in_proj_b.weight", (Hv, H))
            mat(g + "in_proj_a.weight", (Hv, H))
            w[g + "conv1d.weight"] = _normal(seed, g + "conv1d.weight", (C, 1, K), 0.3)
            w[g + "dt_bias"] = _normal(seed, g + "dt_bias", (Hv,), 0.5)
            w[g + "A_log"] = np.log(_rng(seed, g + "A_log").uniform(1.0, 8.0, Hv)).astype(np.float32)
            w[g + "norm.weight"] = _norm_weight(seed, g + "norm.weight", dv)
            mat(g + "out_proj.weight", (H, Hv * dv))
        zero_centred(p + "post_attention_layernorm.weight", H)
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            mat(p + f"mlp.{proj}.weight", shape)
    zero_centred(P + "norm.weight", H)
    if not tie_word_embeddings:
        mat("lm_head.weight", (V, H))
    if mtp:  # names of the published MTP head; never read
        mat("mtp.fc.weight", (H, 2 * H))
        zero_centred("mtp.norm.weight", H)
        zero_centred("mtp.pre_fc_norm_embedding.weight", H)
        zero_centred("mtp.pre_fc_norm_hidden.weight", H)
    _write_weights(model_dir, _cast(w, dtype), 1)

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    text = {
        "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": None, "eos_token_id": ids[IM_END], "pad_token_id": None,
        "head_dim": hd, "hidden_act": "silu", "hidden_size": H, "initializer_range": init_std,
        "intermediate_size": I, "layer_types": list(layer_types), "linear_conv_kernel_dim": K,
        "linear_key_head_dim": dk, "linear_num_key_heads": Hk, "linear_num_value_heads": Hv,
        "linear_value_head_dim": dv, "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": nh, "num_hidden_layers": L, "num_key_value_heads": nkv,
        "rms_norm_eps": rms_norm_eps, "tie_word_embeddings": tie_word_embeddings, "use_cache": True,
        "vocab_size": V, "rope_parameters": {
            "rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial_rotary_factor,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }
    if layout == "multimodal":
        config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                  "text_config": text, "tie_word_embeddings": tie_word_embeddings, "dtype": _HF_DTYPE[dtype],
                  "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32}}
    else:
        config = {"architectures": ["Qwen3_5ForCausalLM"], **text, "dtype": _HF_DTYPE[dtype]}
    _write_json(model_dir / "config.json", _merge(config, extra_config))
    _write_json(model_dir / "generation_config.json", {
        "eos_token_id": [ids[ENDOFTEXT], ids[IM_END]], "pad_token_id": ids[ENDOFTEXT], "do_sample": False})
    write_tokenizer_files(model_dir, tok, "qwen3", max_position_embeddings)
    return model_dir
