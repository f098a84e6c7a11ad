"""Qwen3.5-family hybrid target (Qwen3.5 / Qwen3.8 dense): Gated DeltaNet layers interleaved
with gated full attention (docs/targets/qwen3_5.md). Same interface as models/target.TargetModel:

    target = Qwen3_5Model.load(model_dir, device="cpu", dtype="f32")
    cache  = target.new_cache(max_len)                       # a HybridCache
    logits, taps = target.forward(ids, cache, tap_layers=(1, 3))
    cache.commit(n)                                          # exact state after position n-1

Layer i (pre-norm, every norm zero-centred: x * rsqrt(mean x^2 + eps) * (1 + w)):
    h += mixer_i(norm(h))    mixer = gdn (linear_attention) | gated attention (full_attention)
    h += mlp_i(norm(h))      the dense SwiGLU MLP; a MoE would be another `mlp` callable
Taps are the residual stream after layer l whatever its kind (HF hidden_states[l+1]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..config import read_config_json
from ..errors import GenerationArgumentError
from ..kernels.backend import Ops, get_ops
from ..numerics import DTYPE_MODES, as_f32, round_bf16_array
from .hybrid_cache import HybridCache
from .layers import RopeTables, embedding, mlp, rnd_if, silu
from .qwen3_5_config import Qwen3_5Config, expected_qwen3_5_tensors, resolve_qwen3_5_config
from .target import forward_ids


def zero_centred_rms_norm(ops, x, w_plus_one, eps, bf16):
    """HF Qwen3_5RMSNorm: cast(x * rsqrt(mean x^2 + eps) * (1 + w)), all in f32, ONE rounding at
    the end (unlike Llama's norm, which rounds before the weight). w_plus_one = 1 + w in f32."""
    if not bf16:
        return ops.rms_norm(x, w_plus_one, eps, False)  # same f32 arithmetic, the fast kernel
    var = np.mean(x * x, axis=-1, keepdims=True)  # [..., 1]
    return round_bf16_array(x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))) * w_plus_one)


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)); f32."""
    with np.errstate(over="ignore"):
        return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


class Qwen3_5Model:
    """Attributes as TargetModel: config (Qwen3_5Config), checkpoint, ops, dtype, valid_vocab."""

    def __init__(self, config: Qwen3_5Config, checkpoint: Checkpoint, ops: Ops, dtype: str = "f32"):
        if dtype not in DTYPE_MODES:
            raise GenerationArgumentError(f"dtype {dtype!r}; expected one of: {', '.join(DTYPE_MODES)}")
        self.config, self.checkpoint, self.ops, self.dtype = config, checkpoint, ops, dtype
        self.bf16 = dtype == "bf16"
        self.rope = RopeTables(config.rotary_dim, config.rope_theta, self.bf16)  # partial RoPE tables
        self.valid_vocab = config.vocab_size
        checkpoint.require(expected_qwen3_5_tensors(config))
        c, get, w, P = config, checkpoint.get, ops.prepare_weight, config.prefix

        def plus_one(name):  # zero-centred norm weights are stored as w, used as 1 + w
            return np.float32(1.0) + as_f32(get(name))

        self.embed_table = get(P + "embed_tokens.weight")  # [V, H] rows on demand
        self.norm_w1 = plus_one(P + "norm.weight")  # [H]
        self.lm_head_w = w(self.embed_table if c.tie_word_embeddings else get("lm_head.weight"))  # [V, H]
        self.layers = []
        for i, kind in enumerate(c.layer_types):
            p = f"{P}layers.{i}."
            layer = {"kind": kind, "ln1": plus_one(p + "input_layernorm.weight"),
                     "ln2": plus_one(p + "post_attention_layernorm.weight"),
                     "mlp": {n: w(get(p + f"mlp.{n}_proj.weight")) for n in ("gate", "up", "down")}}
            if kind == "full_attention":
                a = p + "self_attn."
                layer |= {n: w(get(a + f"{n}_proj.weight")) for n in ("q", "k", "v", "o")}
                layer |= {"q_norm": plus_one(a + "q_norm.weight"), "k_norm": plus_one(a + "k_norm.weight")}
            else:
                g = p + "linear_attn."
                layer |= {n: w(get(g + f"in_proj_{n}.weight")) for n in ("qkv", "z", "a", "b")}
                layer |= {"out": w(get(g + "out_proj.weight")),
                          "conv_w": as_f32(get(g + "conv1d.weight"))[:, 0, :].copy(),  # [C, K]
                          "neg_A": -np.exp(as_f32(get(g + "A_log"))),  # [Hv] -exp(A_log), f32
                          "dt_bias": as_f32(get(g + "dt_bias")),  # [Hv]
                          "norm": as_f32(get(g + "norm.weight"))}  # [dv] plain weight (init 1)
            self.layers.append(layer)

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: str = "f32") -> "Qwen3_5Model":
        path, raw = read_config_json(model_dir)
        return cls(resolve_qwen3_5_config(raw, str(path)), open_checkpoint(model_dir), get_ops(device), dtype)

    # ------------------------------------------------------------------ pieces (also used by drafts)
    def new_cache(self, max_len: int = 256) -> HybridCache:
        return HybridCache(self.config, self.ops, max_len)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids [n] -> [n, H] f32."""
        return embedding(self.embed_table, ids)

    def final_norm(self, h: np.ndarray) -> np.ndarray:
        return zero_centred_rms_norm(self.ops, h, self.norm_w1, self.config.rms_norm_eps, self.bf16)

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """ALREADY-NORMED states [n, H] -> logits [n, V] f32."""
        return rnd_if(self.ops.linear(h, self.lm_head_w), self.bf16)

    def mask_padded(self, logits: np.ndarray) -> np.ndarray:
        if self.valid_vocab < logits.shape[-1]:
            logits[..., self.valid_vocab :] = -np.inf
        return logits

    # ------------------------------------------------------------------ forward
    def forward(self, ids, cache: HybridCache, tap_layers: Sequence[int] = (), last_only: bool = False):
        """ids [n] at positions cache.length.. -> (logits [n, V] ([1, V] with last_only),
        taps [n, len(tap_layers)*H] or None). Advances every layer's state by the n rows."""
        c = self.config
        ids = forward_ids(ids, tap_layers, c.num_hidden_layers, type(self).__name__)  # [n]
        n, H = ids.shape[0], c.hidden_size
        start = cache.length
        cache.begin_block(n)
        h = self.embed(ids)  # [n, H]
        taps = np.empty((n, len(tap_layers) * H), dtype=np.float32) if len(tap_layers) else None
        for i, layer in enumerate(self.layers):
            x = zero_centred_rms_norm(self.ops, h, layer["ln1"], c.rms_norm_eps, self.bf16)  # [n, H]
            if layer["kind"] == "full_attention":
                mixed = self._attention(i, layer, x, cache, start)
            else:
                mixed = self._gdn(i, layer, x, cache)
            h = rnd_if(h + mixed, self.bf16)  # [n, H]
            m = zero_centred_rms_norm(self.ops, h, layer["ln2"], c.rms_norm_eps, self.bf16)
            h = rnd_if(h + self._mlp(layer["mlp"], m), self.bf16)  # [n, H]
            for j, l in enumerate(tap_layers):
                if l == i:
                    taps[:, j * H : (j + 1) * H] = h
        cache.end_block()
        if last_only:
            h = h[-1:]
        return self.lm_head(self.final_norm(h)), taps

    def _mlp(self, p, x):
        """The dense SwiGLU MLP [n, H] -> [n, H] (the seam for a MoE MLP)."""
        return mlp(x, p["gate"], p["up"], p["down"], self.ops.linear, self.bf16, self.ops.swiglu)

    def _attention(self, i, layer, x, cache, start):
        """Gated full attention: q_proj emits [query | gate] per head; zero-centred q/k norms;
        partial rotate-half RoPE on the first rotary_dim dims; out = o_proj(attn * sigmoid(gate))."""
        c, bf16, ops, linear = self.config, self.bf16, self.ops, self.ops.linear
        n, nh, nkv, hd, rd, eps = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, \
            c.rotary_dim, c.rms_norm_eps
        qg = rnd_if(linear(x, layer["q"]), bf16).reshape(n, nh, 2 * hd)  # [n, nh, 2hd]
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, nh * hd)  # [n, nh, hd], [n, nh*hd]
        k = rnd_if(linear(x, layer["k"]), bf16).reshape(n, nkv, hd)  # [n, nkv, hd]
        v = rnd_if(linear(x, layer["v"]), bf16).reshape(n, nkv, hd)  # [n, nkv, hd]
        q = zero_centred_rms_norm(ops, np.ascontiguousarray(q), layer["q_norm"], eps, bf16)
        k = zero_centred_rms_norm(ops, k, layer["k_norm"], eps, bf16)
        cos, sin = self.rope.span(start, n)  # [n, rd]
        q = np.concatenate([ops.apply_rope(np.ascontiguousarray(q[..., :rd]), cos, sin, bf16), q[..., rd:]], -1)
        k = np.concatenate([ops.apply_rope(np.ascontiguousarray(k[..., :rd]), cos, sin, bf16), k[..., rd:]], -1)

        slot, end = cache.attention_slot[i], start + n
        cache.kv.k[slot, :, start:end] = k.transpose(1, 0, 2)  # [nkv, n, hd]
        cache.kv.v[slot, :, start:end] = v.transpose(1, 0, 2)
        q_pos = np.arange(start, end, dtype=np.int64)  # [n]
        k_pos = np.arange(end, dtype=np.int64)  # [T]
        o = rnd_if(ops.attention(q, cache.kv.k[slot], cache.kv.v[slot], q_pos, k_pos, True, 0, bf16), bf16)
        o = rnd_if(o.reshape(n, nh * hd) * rnd_if(sigmoid(gate), bf16), bf16)  # [n, nh*hd] gated
        return rnd_if(linear(o, layer["o"]), bf16)  # [n, H]

    def _gdn(self, i, layer, x, cache):
        """Gated DeltaNet: short conv over raw qkv (state = the last K-1 raw rows), gates
        beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the delta rule (kernels/gdn.py,
        state f32), a per-head RMSNorm gated by silu(z), out_proj."""
        c, bf16, ops, linear = self.config, self.bf16, self.ops, self.ops.linear
        n, Hk, dk, Hv, dv = x.shape[0], c.linear_num_key_heads, c.linear_key_head_dim, \
            c.linear_num_value_heads, c.linear_value_head_dim
        raw = rnd_if(linear(x, layer["qkv"]), bf16)  # [n, C] pre-conv q|k|v
        z = rnd_if(linear(x, layer["z"]), bf16).reshape(n, Hv, dv)  # [n, Hv, dv]
        b = rnd_if(linear(x, layer["b"]), bf16)  # [n, Hv]
        a = rnd_if(linear(x, layer["a"]), bf16)  # [n, Hv]
        window = cache.conv_window(i, raw)  # [K-1+n, C]
        mixed = ops.short_conv(window, layer["conv_w"], bf16)  # [n, C] silu(conv)
        kd = c.key_dim
        q = mixed[:, :kd].reshape(n, Hk, dk)  # [n, Hk, dk]
        k = mixed[:, kd : 2 * kd].reshape(n, Hk, dk)  # [n, Hk, dk]
        v = mixed[:, 2 * kd :].reshape(n, Hv, dv)  # [n, Hv, dv]
        beta = rnd_if(sigmoid(b), bf16)  # [n, Hv] in the model dtype, as HF
        g = (layer["neg_A"] * softplus(a + layer["dt_bias"])).astype(np.float32)  # [n, Hv] f32 log-decay
        o = rnd_if(cache.recurrence(i, raw, q, k, v, g, beta), bf16)  # [n, Hv, dv]
        y = ops.rms_norm(o, layer["norm"], c.rms_norm_eps, bf16)  # [n, Hv, dv] plain-weight norm
        y = rnd_if(y * silu(z), bf16).reshape(n, Hv * dv)  # gate after the norm, in f32
        return rnd_if(linear(y, layer["out"]), bf16)  # [n, H]
