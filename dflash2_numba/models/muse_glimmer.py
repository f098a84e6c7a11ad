"""Muse-Glimmer text target (config_muse.py resolves it; docs/targets/muse_glimmer.md explains it).

    target = MuseGlimmerTarget.load(model_dir, device="cpu", dtype="f32")
    cache  = target.new_cache(max_len)                         # a KVCache, as TargetModel's
    logits, taps = target.forward(ids, cache, tap_layers=(1, 3))
    cache.commit(n)

The interface of models/target.TargetModel, so the decode loop and the drafts need no branch:
- `embed(ids)`   RAW embedding rows, the draft-facing embedding (DFlash drafts embed the anchor
                 and the mask token with the target's raw rows; the target itself normalises them);
- `lm_head(h)`   the RAW projection (a DFlash2 selector applies its own multiplier/softcap to the
                 candidate values; HF's v1 assistant candidate logits are raw);
- `forward`      the target's own logits: cap * tanh(lm_head(final_norm(h)) * multiplier / cap).

Layer (sandwich norms; the post norms act on the branch, before the residual add):
    x = rms(h, eps) * (1 + w_in)
    q = rope?(rms(Wq x) * qk_scale), k = rope?(rms(Wk x)), v = Wv x      # weightless q/k norms
    o = attention(q, k, v; causal, window W on sliding layers) * sigmoid(Wgate x)
    h = h + rms(Wo o, post_eps) * (1 + w_post_attn)
    h = h + rms(mlp(rms(h, eps) * (1 + w_pre_ffn)), post_eps) * (1 + w_post_ffn)
A sliding layer's query at t sees keys t-W+1..t: the attention kernel's causal=True, window=W.
The cache keeps every position of every layer (simple; inspect reports the minimum a sliding
layer needs). bf16 run mode: every Muse norm multiplies its weight in f32 and rounds once
(Gemma style), unlike layers.rms_norm's Llama-style rounding before the weight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..config import read_config_json
from ..config_muse import (LAYER_NORMS, SLIDING, MuseGlimmerConfig, check_muse_pairing, expected_muse_tensors,
                           refuse_legacy_export, resolve_muse_config)
from ..errors import GenerationArgumentError
from ..kernels.backend import Ops, get_ops
from ..numerics import DTYPE_MODES, as_f32
from .layers import RopeTables, embedding, mlp, rnd_if
from .target import TargetModel


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in f32 (exp overflow for very negative x gives 0, as torch)."""
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def softcap_logits(z: np.ndarray, multiplier: float, cap: float | None, bf16: bool) -> np.ndarray:
    """HF's four ops, in order: z * multiplier, / cap, tanh, * cap (each rounded in bf16 mode).
    z [n, V] f32 -> [n, V] f32."""
    z = rnd_if(z * np.float32(multiplier), bf16)  # [n, V]
    if cap is None:
        return z
    z = rnd_if(z / np.float32(cap), bf16)
    return rnd_if(rnd_if(np.tanh(z), bf16) * np.float32(cap), bf16)


class MuseGlimmerTarget(TargetModel):
    """Attributes as TargetModel (config is a MuseGlimmerConfig), plus ignored_tensors (the
    vision tower names present in the checkpoint and deliberately not read)."""

    def __init__(self, config: MuseGlimmerConfig, checkpoint: Checkpoint, ops: Ops, dtype: str = "f32"):
        if dtype not in DTYPE_MODES:
            raise GenerationArgumentError(f"dtype {dtype!r}; expected one of: {', '.join(DTYPE_MODES)}")
        self.config, self.checkpoint, self.ops, self.dtype = config, checkpoint, ops, dtype
        self.bf16 = dtype == "bf16"
        self.rope = RopeTables(config.head_dim, config.rope_theta or 1.0, self.bf16)  # cos/sin by position
        self.valid_vocab = config.vocab_size
        c, get, w, p0 = config, checkpoint.get, ops.prepare_weight, config.weight_prefix
        names = checkpoint.names()
        refuse_legacy_export(c, names, str(checkpoint.directory))
        expected = expected_muse_tensors(c)  # the vision tower is ignored BY NAME, never read
        self.ignored_tensors = sorted(expected.ignored(names))
        checkpoint.require(expected)

        self.embed_table = get(p0 + "embed_tokens.weight")  # [V, H] stays uint16: rows on demand
        self.norm_w = as_f32(get(p0 + "norm.weight"))  # [H] plain w
        self.ones_h = np.ones(c.hidden_size, np.float32)  # [H] the weightless embedding norm
        self.ones_hd = np.ones(c.head_dim, np.float32)  # [hd] the weightless q / k norm
        tied = c.tie_word_embeddings or "lm_head.weight" not in checkpoint
        self.lm_head_w = w(self.embed_table if tied else get("lm_head.weight"))  # [V, H]
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"{p0}layers.{i}."
            self.layers.append({
                # centred norms: (1 + w), formed once in f32
                **{n: np.float32(1.0) + as_f32(get(p + n + ".weight")) for n in LAYER_NORMS},  # [H]
                **{n: w(get(p + f"self_attn.{n}_proj.weight")) for n in ("q", "k", "v", "o")},
                "out_gate": w(get(p + "self_attn.gate_proj.weight")),  # [nh*hd, H]
                **{n: w(get(p + f"mlp.{n}_proj.weight")) for n in ("gate", "up", "down")},
                "window": c.sliding_window if c.layer_types[i] == SLIDING else 0,  # 0 = full causal
                "rope": c.layer_rope[i],
            })

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: str = "f32") -> "MuseGlimmerTarget":
        path, raw = read_config_json(model_dir)
        return cls(resolve_muse_config(raw, source=str(path)), open_checkpoint(model_dir), get_ops(device), dtype)

    # ------------------------------------------------------------------ pieces
    def _norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """rms(x, eps) * w in f32, rounded once in bf16 mode (every Muse-target norm)."""
        return rnd_if(self.ops.rms_norm(x, w, eps, False), self.bf16)

    def final_norm(self, h: np.ndarray) -> np.ndarray:
        """[n, H] -> [n, H]: rms(h) * w (plain w, rms_norm_eps)."""
        return self._norm(h, self.norm_w, self.config.rms_norm_eps)

    def embed_input(self, ids: np.ndarray) -> np.ndarray:
        """The target's own embedding step: image/video token ids -> 0 (composite model), raw
        row, weightless RMSNorm (no sqrt(H) scale). ids [n] -> [n, H]."""
        c = self.config
        ids = np.asarray(ids, np.int64).reshape(-1)  # [n]
        special = [t for t in (c.image_token_id, c.video_token_id) if t is not None]
        if special:
            ids = np.where(np.isin(ids, special), 0, ids)
        return self._norm(embedding(self.embed_table, ids), self.ones_h, c.rms_norm_eps)  # [n, H]

    def logits(self, h_normed: np.ndarray) -> np.ndarray:
        """Final-normed states [n, H] -> the target's logits [n, V]: multiplier, then softcap."""
        c = self.config
        return softcap_logits(self.lm_head(h_normed), c.output_multiplier, c.final_logit_softcapping, self.bf16)

    def check_draft_pairing(self, draft_config) -> None:
        """Called by the draft loader after config.check_pairing (config_muse.check_muse_pairing)."""
        check_muse_pairing(draft_config, self.config)

    # ------------------------------------------------------------------ forward (TargetModel's, through
    # embed_input / logits above; only the layer differs)
    def _layer(self, i, layer, h, cache, start, q_pos, k_pos, cos, sin):
        """One sandwich-norm decoder layer on h [n, H]; writes K/V i of the cache."""
        c, bf16, ops, linear = self.config, self.bf16, self.ops, self.ops.linear
        n, nh, nkv, hd = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps, post_eps = c.rms_norm_eps, c.post_norm_eps

        x = self._norm(h, layer["input_layernorm"], eps)  # [n, H]
        q = rnd_if(linear(x, layer["q"]), bf16).reshape(n, nh, hd)  # [n, nh, hd]
        k = rnd_if(linear(x, layer["k"]), bf16).reshape(n, nkv, hd)  # [n, nkv, hd]
        v = rnd_if(linear(x, layer["v"]), bf16).reshape(n, nkv, hd)  # [n, nkv, hd] (no norm)
        q = rnd_if(self._norm(q, self.ones_hd, eps) * np.float32(c.qk_scale_factor), bf16)  # scale AFTER the norm
        k = self._norm(k, self.ones_hd, eps)  # weightless, unscaled
        if layer["rope"]:  # NoPE global layers pass q, k unrotated
            q = ops.apply_rope(q, cos, sin, bf16)
            k = ops.apply_rope(k, cos, sin, bf16)

        end = start + n
        cache.k[i, :, start:end] = k.transpose(1, 0, 2)  # [nkv, n, hd]
        cache.v[i, :, start:end] = v.transpose(1, 0, 2)
        # causal=True with window W: key s visible from query t iff t-W < s <= t (sliding layers)
        o = ops.attention(q, cache.k[i], cache.v[i], q_pos, k_pos, True, layer["window"], bf16)  # [n, nh, hd]
        o = rnd_if(o, bf16).reshape(n, nh * hd)  # [n, nh*hd] head-major
        gate = rnd_if(sigmoid(rnd_if(linear(x, layer["out_gate"]), bf16)), bf16)  # [n, nh*hd] from x
        a = rnd_if(linear(rnd_if(o * gate, bf16), layer["o"]), bf16)  # [n, H]
        h = rnd_if(h + self._norm(a, layer["post_attention_layernorm"], post_eps), bf16)  # branch norm

        y = self._norm(h, layer["pre_feedforward_layernorm"], eps)  # [n, H]
        m = mlp(y, layer["gate"], layer["up"], layer["down"], linear, bf16, self.ops.swiglu)  # [n, H]
        return rnd_if(h + self._norm(m, layer["post_feedforward_layernorm"], post_eps), bf16)
