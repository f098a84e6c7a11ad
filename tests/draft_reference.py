"""Independent float64 numpy forward of DFlash v1 / DFlash2 drafts, written from spec §3, §4.1
and §4.2 for tests/test_draft.py and tests/test_dflash2_draft.py.

Shares nothing with the package: tensors are read with safetensors' torch loader (bf16 -> f32 by
torch), the attention is ONE full recomputation over [context ++ block] with an explicit
visibility mask, and the conv is the §4.2 formula again, loop by loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the draft reference reads weights with it")

import dflash2_numba as dn  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def read_weights(model_dir) -> dict[str, np.ndarray]:
    """Every tensor of a model directory (single model.safetensors) as float64."""
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    return {n: t.float().numpy().astype(np.float64) for n, t in tensors.items()}


def read_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(x, pos, theta, yarn=None):
    """x [n, heads, hd] rotated (NeoX rotate-half) to positions pos [n]; yarn = (inv_freq [hd/2],
    attention factor) from transformers' own YaRN code (`hf_yarn`), else plain RoPE."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd) if yarn is None else yarn[0]  # [hd/2]
    ang = np.asarray(pos, np.float64)[:, None] * inv_freq[None]  # [n, hd/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    if yarn is not None:
        cos, sin = cos * yarn[1], sin * yarn[1]
    half = hd // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def conv_reference(x, delta, base, S, Q):
    """spec §4.2 literally: x [N, H], delta [N, taps, G], base [taps, H]; blocks of Q rows."""
    N, H = x.shape
    taps = base.shape[0]
    out = np.zeros((N, H))
    for n in range(N):
        pos = n & (Q - 1) if Q & (Q - 1) == 0 else n % Q
        for c in range(H):
            coef = [base[t, c] + delta[n, t, c // S] for t in range(taps)]
            acc = coef[0] * x[n, c]
            for t in range(1, taps):
                if pos >= t:
                    acc += coef[t] * x[n - t, c]
            out[n, c] = acc
    return out


def hf_yarn(config: dict):
    """(inv_freq [hd/2] f64, attention factor) of a draft config with YaRN, by transformers'
    `_compute_yarn_parameters` on the config class AutoConfig would build (GptOssConfig for
    model_type gpt_oss, whose defaults supply YaRN); None for plain RoPE."""
    from transformers import GptOssConfig, Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls = GptOssConfig if config.get("model_type") == "gpt_oss" else Qwen3Config
    cfg = cls.from_dict({k: v for k, v in config.items() if k != "architectures"})
    if cfg.rope_parameters.get("rope_type", "default") == "default":
        return None
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    return inv_freq.double().numpy(), float(factor)


class DraftReference:
    """forward(taps [p, n_taps*H], anchor, Q) -> (final-normed block states [Q, H], mask-row
    logits [Q-1, V]) for a request whose context is positions 0..p-1 and anchor at p."""

    def __init__(self, target_dir, draft_dir):
        self.T, self.W = read_weights(target_dir), read_weights(draft_dir)
        tc, dc = read_config(target_dir), read_config(draft_dir)
        self.tc, self.dc = tc, dc
        nested = dc.get("dflash_config") or {}
        self.v2 = dc["architectures"][0] == "DFlash2DraftModel"
        self.H, self.nh, self.nkv = dc["hidden_size"], dc["num_attention_heads"], dc["num_key_value_heads"]
        self.hd = dc["head_dim"]
        self.eps = dc["rms_norm_eps"]
        self.theta = dc.get("rope_theta") or dc["rope_parameters"]["rope_theta"]
        self.mask_id = nested.get("mask_token_id", dc.get("mask_token_id"))
        self.L = dc["num_hidden_layers"]
        types = dc.get("layer_types") or ["full_attention"] * self.L
        self.window = [dc["sliding_window"] if t == "sliding_attention" else None for t in types]
        self.causal = [bool(dc["is_causal"])] * self.L
        self.scale = nested.get("input_embedding_scale", 1.0) if self.v2 else 1.0
        self.S = nested.get("conv_group_size")
        self.taps = nested.get("conv_kernel_size")
        self.embed = self.T["model.embed_tokens.weight"]  # [V, H]
        self.head = self.T.get("lm_head.weight", self.embed)  # [V, H]
        self.yarn = hf_yarn(dc)

    def proj(self, x, i, name):
        """x @ W.T (+ the bias when the draft has attention_bias)."""
        P = f"layers.{i}.self_attn.{name}_proj."
        return x @ self.W[P + "weight"].T + self.W.get(P + "bias", 0.0)

    def visible(self, q_pos, k_pos, layer):
        d = q_pos[:, None] - k_pos[None, :]  # [Q, T]
        vis = np.ones(d.shape, bool)
        if self.window[layer] is not None:
            vis &= np.abs(d) <= self.window[layer] - 1
        if self.causal[layer]:
            vis &= d >= 0
        return vis

    def prepare(self, i, conv, x, Q):
        W, taps, G = self.W, self.taps, self.H // self.S
        delta = (x @ W[f"layers.{i}.{conv}.kernel_projection.weight"].T).reshape(len(x), 2, taps, G)
        return conv_reference(x, delta[:, 0], W[f"layers.{i}.{conv}.base_kernel"][0], self.S, Q), delta[:, 1]

    def finish(self, i, conv, y, delta1, Q):
        return conv_reference(y, delta1, self.W[f"layers.{i}.{conv}.base_kernel"][1], self.S, Q)

    def forward(self, taps, anchor, Q, draft_window=0):
        """draft_window N > 0: context keys at positions < p - N are masked (the draft window)."""
        W, H, nh, nkv, hd = self.W, self.H, self.nh, self.nkv, self.hd
        p = taps.shape[0]
        ctx = rms(np.asarray(taps, np.float64) @ W["fc.weight"].T, W["hidden_norm.weight"], self.eps)  # [p, H]
        h = self.embed[[anchor] + [self.mask_id] * (Q - 1)] * self.scale  # [Q, H]
        q_pos, k_pos = p + np.arange(Q), np.arange(p + Q)
        for i in range(self.L):
            P = f"layers.{i}."
            a = rms(h, W[P + "input_layernorm.weight"], self.eps)
            if self.v2:
                a, d_att = self.prepare(i, "attention_conv", a, Q)
            kv_in = np.concatenate([ctx, a])  # [p+Q, H]: context rows skip input_layernorm
            q = rms(self.proj(a, i, "q").reshape(Q, nh, hd), W[P + "self_attn.q_norm.weight"], self.eps)
            k = rms(self.proj(kv_in, i, "k").reshape(p + Q, nkv, hd), W[P + "self_attn.k_norm.weight"], self.eps)
            v = self.proj(kv_in, i, "v").reshape(p + Q, nkv, hd)
            q, k = rope(q, q_pos, self.theta, self.yarn), rope(k, k_pos, self.theta, self.yarn)
            vis = self.visible(q_pos, k_pos, i)  # [Q, p+Q]
            if draft_window:
                vis &= (k_pos >= p - draft_window)[None, :]
            o = np.zeros((Q, nh, hd))
            for head in range(nh):
                kvh = head // (nh // nkv)
                s = q[:, head] @ k[:, kvh].T / np.sqrt(hd)  # [Q, p+Q]
                s = np.where(vis, s, -np.inf)
                e = np.exp(s - s.max(-1, keepdims=True))
                o[:, head] = (e / e.sum(-1, keepdims=True)) @ v[:, kvh]
            o = self.proj(o.reshape(Q, nh * hd), i, "o")  # [Q, H]
            if self.v2:
                o = self.finish(i, "attention_conv", o, d_att, Q)
            h = h + o
            m = rms(h, W[P + "post_attention_layernorm.weight"], self.eps)
            if self.v2:
                m, d_mlp = self.prepare(i, "mlp_conv", m, Q)
            g, u = m @ W[P + "mlp.gate_proj.weight"].T, m @ W[P + "mlp.up_proj.weight"].T
            y = (g / (1 + np.exp(-g)) * u) @ W[P + "mlp.down_proj.weight"].T
            if self.v2:
                y = self.finish(i, "mlp_conv", y, d_mlp, Q)
            h = h + y
        hn = rms(h, W["norm.weight"], self.eps)  # [Q, H]
        return hn, hn[1:] @ self.head.T  # [Q, H], [Q-1, V]


# ---------------------------------------------------------------- end-to-end checks shared by v1 and v2
def check_greedy_equals_target_only(target, draft, block_sizes=(2, 3, 5, 8), n_new=40):
    """Greedy speculative output == target-only output for every runtime Q (and Q is used)."""
    prompt = np.random.default_rng(4).integers(0, target.valid_vocab, 9).tolist()
    ref = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=n_new)
    assert ref.finish_reason == "length"  # no early stop: every Q runs many steps
    for Q in block_sizes:
        out = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=n_new, block_size=Q)
        assert out.output_ids == ref.output_ids and out.finish_reason == ref.finish_reason, Q
        assert max(out.stats.block_rows) == Q


def check_seeded_sampling(target, draft):
    """Sampling goes through the draft's q (losslessness itself is tested in test_sampling)."""
    runs = [dn.generate(target, draft, prompt_ids=[5, 6, 7], max_new_tokens=20, block_size=4,
                        temperature=0.8, top_k=20, seed=11).output_ids for _ in range(2)]
    assert runs[0] == runs[1]  # seeded: reproducible
    assert len(runs[0]) == 20 or runs[0][-1] in target.tokenizer.stop_ids(())
    assert all(0 <= t < target.valid_vocab for t in runs[0])
