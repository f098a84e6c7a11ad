"""The gpt-oss family (`GptOssForCausalLM`, model_type `gpt_oss`: openai/gpt-oss-20b, -120b),
transformers 5.x semantics (models/gpt_oss/modeling_gpt_oss.py; docs/gpt_oss.md).

    cfg    = resolve_gpt_oss_config(raw, source)      # GptOssConfig, HF key names
    target = GptOssModel.load(model_dir)              # MXFP4 experts kept as stored

Layer (pre-norm, RMSNorm weights f32):
    attention: q/k/v/o with biases (attention_bias), no q/k norm, RoPE (YaRN from rope_parameters
      / rope_scaling; GptOssConfig's YaRN when config.json has neither), scale hd^-0.5, and a
      learned SINK logit per query head in the softmax denominator only (kernels/attention.py).
      layer_types: "sliding_attention" (key s visible from q iff 0 <= q - s < sliding_window)
      or "full_attention"; the default alternates, sliding first.
    MoE: logits = x W_r^T + b_r; the top k logits (ties: lowest id), softmax over those k only;
      per picked expert, in ascending id:  gu = x W_gu^T + b_gu  [2I], INTERLEAVED:
        gate = min(gu[0::2], limit)          (upper clamp only)
        up   = clip(gu[1::2], -limit, limit)
        y    = ((up + 1) * gate * sigmoid(alpha * gate)) W_d^T + b_d
      out += w_e * y_e. limit = swiglu_limit (7.0), alpha = swiglu_alpha (1.702).

Experts, two spellings (tensor names decide; shapes then checked):
    MXFP4 (the Hub's): mlp.experts.{gate_up,down}_proj_{blocks,scales} (quant/mxfp4.py, kept at
      4.25 bits, computed on directly), biases bf16 (out-major: gate_up [E, 2I, H] as dense)
    bf16 (transformers' save_pretrained, re-uploads): mlp.experts.gate_up_proj [E, H, 2I],
      down_proj [E, I, H] (in-major, transposed once at load; --quantize applies to them)
Runs op by op on the CPU in f32 (the fused engine has no bias / sink path); every kernel it calls
is row-invariant, so a Q-row verify gives the bits of Q one-row steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import DEFAULT_ROPE_THETA, decoder_dims, rope_theta_of
from ..config_checks import architecture_of, get_bool, get_float, get_int, get_str, token_ids
from ..errors import ConfigValueError, GenerationArgumentError, UnknownArchitectureError
from ..inventory import ExpectedTensors
from ..kernels.attention import attention
from ..kernels.panels import pack_bf16
from ..kernels.routing import route_topk_softmax
from ..models.moe import moe_facts, moe_summary_lines, sigmoid
from ..models.rope import GPT_OSS_YARN, RopeScaling, resolve_rope_scaling
from ..numerics import as_f32
from ..quant.weights import release_pages
from .qwen3 import TargetConfig, TargetModel, _layer_types
from .qwen3_moe import num_experts

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
MXFP4_BYTES_PER_WEIGHT = 17 / 32  # 16 bytes of nibbles + one E8M0 scale per block of 32


# ---------------------------------------------------------------- config
@dataclass(frozen=True)
class GptOssConfig(TargetConfig):
    num_local_experts: int = 0  # E
    num_experts_per_tok: int = 1  # k
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    layer_types: tuple[str, ...] = ()


def is_gpt_oss(raw: dict) -> bool:
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    return arch == ARCHITECTURE or (arch is None and raw.get("model_type") == MODEL_TYPE)


def resolve_gpt_oss_config(raw: dict, source: str = "config.json") -> GptOssConfig:
    arch = architecture_of(raw, source)
    if arch != ARCHITECTURE:
        raise UnknownArchitectureError(f"{source}: architectures[0] = {arch!r}; expected {ARCHITECTURE!r}")
    dims = decoder_dims(raw, source, eps_default=1e-5)
    L = dims["num_hidden_layers"]
    types = _layer_types(raw, L, source) or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    window = get_int(raw, "sliding_window", source, default=128, minimum=1)
    if window is None and "sliding_attention" in types:
        raise ConfigValueError(f"{source}: layer_types has sliding_attention layers but sliding_window = null")
    E = num_experts(raw, source)
    max_pos = get_int(raw, "max_position_embeddings", source, default=131072, minimum=1)
    theta = rope_theta_of(raw, source)
    if theta == DEFAULT_ROPE_THETA and raw.get("rope_theta") is None and not (raw.get("rope_parameters") or {}).get("rope_theta"):
        theta = DEFAULT_THETA  # neither key given: the config class's default
    return GptOssConfig(
        architecture=arch, model_type=get_str(raw, "model_type", source, default=MODEL_TYPE), **dims,
        vocab_size=get_int(raw, "vocab_size", source, minimum=1),
        rope_theta=theta,
        tie_word_embeddings=get_bool(raw, "tie_word_embeddings", source, default=False),
        max_position_embeddings=max_pos,
        eos_token_id=token_ids(raw.get("eos_token_id"), "eos_token_id", source),
        bos_token_id=get_int(raw, "bos_token_id", source, default=None, minimum=0),
        source=source,
        layer_window=tuple(window if t == "sliding_attention" else None for t in types),
        sliding_window=window,
        num_local_experts=E,
        num_experts_per_tok=get_int(raw, "num_experts_per_tok", source, minimum=1, maximum=max(E, 1)),
        swiglu_limit=get_float(raw, "swiglu_limit", source, default=7.0, positive=True),
        swiglu_alpha=get_float(raw, "swiglu_alpha", source, default=1.702, positive=True),
        attention_bias=get_bool(raw, "attention_bias", source, default=True),
        rope_scaling=resolve_rope_scaling(raw, source, max_pos, default=GPT_OSS_YARN),
        layer_types=tuple(types),
    )


# ---------------------------------------------------------------- tensors
def expert_layouts(p: str, E: int, H: int, I: int) -> list[dict]:
    """One layer's expert matrices under p = '...mlp.experts.': [MXFP4 as the Hub stores it, bf16]
    (the biases are the same in both: in the main inventory)."""
    mxfp4 = {p + "gate_up_proj_blocks": (E, 2 * I, H), p + "down_proj_blocks": (E, H, I)}
    dense = {p + "gate_up_proj": (E, H, 2 * I), p + "down_proj": (E, I, H)}
    return [mxfp4, dense]


def expected_gpt_oss_tensors(c: GptOssConfig) -> ExpectedTensors:
    H, I, E, V, hd = c.hidden_size, c.intermediate_size, c.num_local_experts, c.vocab_size, c.head_dim
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    notes, layouts = {"model.embed_tokens.weight": f"[vocab_size, hidden_size] from {c.source}"}, []
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   a + "q_proj.weight": (nh * hd, H), a + "k_proj.weight": (nkv * hd, H),
                   a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd), a + "sinks": (nh,),
                   p + "mlp.router.weight": (E, H), p + "mlp.router.bias": (E,),
                   p + "mlp.experts.gate_up_proj_bias": (E, 2 * I), p + "mlp.experts.down_proj_bias": (E, H)}
        if c.attention_bias:
            shapes |= {a + "q_proj.bias": (nh * hd,), a + "k_proj.bias": (nkv * hd,), a + "v_proj.bias": (nkv * hd,),
                       a + "o_proj.bias": (H,)}
        notes[a + "sinks"] = f"one sink logit per query head: [num_attention_heads] = [{nh}]"
        notes[p + "mlp.experts.gate_up_proj"] = ("bf16 layout [num_local_experts, hidden_size, 2 * intermediate_size] "
                                                "(in-major, gate / up interleaved)")
        notes[p + "mlp.experts.gate_up_proj_blocks"] = ("MXFP4 as dense [E, 2 * intermediate_size, hidden_size]: "
                                                       "blocks [E, 2I, H/32, 16] with scales [E, 2I, H/32]")
        layouts.append((f"layer {i} experts", expert_layouts(p + "mlp.experts.", E, H, I)))
    optional = {"lm_head.weight"} if c.tie_word_embeddings else set()
    return ExpectedTensors(shapes, optional, notes, layouts=layouts)


def describe_gpt_oss(c: GptOssConfig) -> dict:
    """inspect's family facts: total / active parameters and the bytes one decoded token reads,
    per --quantize format (models/moe.moe_facts) and as stored (MXFP4 experts at 4.25 bits per
    weight, 17 bytes a block of 32; the rest as the bf16 path holds it)."""
    inv = expected_gpt_oss_tensors(c)
    dense = ExpectedTensors(dict(inv), inv.optional)  # the experts under their dense names, out-major
    for _, (mx, _bf16) in inv.layouts:
        dense.update({n.replace("_blocks", ""): s for n, s in mx.items()})
    facts = moe_facts(dense, c.num_local_experts, c.num_experts_per_tok, c.tie_word_embeddings)
    active_expert_weights = sum(np.prod(s) for n, s in dense.items() if ".experts." in n and n.endswith("_proj")
                                ) * c.num_experts_per_tok / c.num_local_experts  # [E, out, in] matrices, k of E
    read = facts["bytes_read_per_token"]
    read["mxfp4 (as stored)"] = int(read["bf16"] - active_expert_weights * (2 - MXFP4_BYTES_PER_WEIGHT))
    return {**facts, "summary_lines": moe_summary_lines(facts)}


# ---------------------------------------------------------------- the expert block
def glu(gu: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's gated activation on interleaved gu [m, 2I] -> [m, I]."""
    gate = np.minimum(gu[:, 0::2], np.float32(limit))  # upper clamp only
    up = np.clip(gu[:, 1::2], np.float32(-limit), np.float32(limit))
    return ((up + np.float32(1.0)) * (gate * sigmoid(np.float32(alpha) * gate))).astype(np.float32)


def expert_block(x: np.ndarray, L: dict, c: GptOssConfig, linear) -> np.ndarray:
    """The MoE block on normed x [n, H] -> [n, H], expert-major (models/moe.py's schedule): each
    picked expert's weights are read once for all rows that picked it; rows add their experts'
    outputs in ascending expert id, from zero."""
    logits = linear(x, L["router"]) + L["router_b"]  # [n, E]
    ids, w = route_topk_softmax(logits, c.num_experts_per_tok)  # [n, k] each
    out = np.zeros(x.shape, np.float32)  # [n, H]
    for e in np.unique(ids):  # ascending expert id
        rows, slots = np.nonzero(ids == e)
        gu = linear(np.ascontiguousarray(x[rows]), L["gate_up"][e]) + L["gate_up_b"][e]  # [m, 2I]
        y = linear(glu(gu, c.swiglu_limit, c.swiglu_alpha), L["down"][e]) + L["down_b"][e]  # [m, H]
        out[rows] = out[rows] + y * w[rows, slots][:, None]
    return out


# ---------------------------------------------------------------- model
class GptOssModel(TargetModel):
    """TargetModel with gpt-oss layers: `layer` holds q/k/v/o (+ biases), sinks, router (+ bias)
    and the experts (MXFP4 StoredWeights or prepared bf16 / q8_0 / q4_0 weights)."""

    resolve_config = staticmethod(resolve_gpt_oss_config)
    expected_tensors = staticmethod(expected_gpt_oss_tensors)

    def __init__(self, config, checkpoint, ops, dtype="f32"):
        if dtype != "f32":
            raise GenerationArgumentError(f"gpt-oss runs in dtype 'f32' only (got {dtype!r}): its bf16 "
                                          "rounding points are not implemented")
        if ops.device != "cpu":
            raise GenerationArgumentError(f"gpt-oss runs on the CPU device only (got {ops.device!r}): "
                                          "the attention sinks have no kernel elsewhere")
        super().__init__(config, checkpoint, ops, dtype)
        for name in checkpoint.tensors:  # copied at load (panels, f32, quantized): the file's pages go back;
            if name not in checkpoint.stored:  # the MXFP4 experts are computed on in place and stay mapped
                release_pages(checkpoint.get(name))

    def _load_mlp(self, i: int, p: str) -> dict:
        """Layer i's gpt-oss tensors besides q/k/v/o and the norms (p = 'model.layers.{i}.mlp.'):
        attention biases and sinks, router, experts."""
        c, get, prepare = self.config, self.checkpoint.get, self.ops.prepare_weight
        a, x = p[: -len("mlp.")] + "self_attn.", p + "experts."
        E, I = c.num_local_experts, c.intermediate_size
        L = {"sinks": as_f32(get(a + "sinks")),  # [nh]
             "router": pack_bf16(get(p + "router.weight")),  # [E, H] as stored (never quantized)
             "router_b": as_f32(get(p + "router.bias")),  # [E]
             "gate_up_b": as_f32(get(x + "gate_up_proj_bias")),  # [E, 2I] interleaved
             "down_b": as_f32(get(x + "down_proj_bias"))}  # [E, H]
        if c.attention_bias:
            L |= {n + "_b": as_f32(get(a + f"{n}_proj.bias")) for n in ("q", "k", "v", "o")}
        if x + "gate_up_proj_blocks" in self.checkpoint:  # MXFP4: per-expert views of the stored bits
            gu, dn = get(x + "gate_up_proj_blocks"), get(x + "down_proj_blocks")
            L["gate_up"], L["down"] = [gu.expert(e) for e in range(E)], [dn.expert(e) for e in range(E)]
        else:  # bf16 [E, H, 2I] / [E, I, H], in-major: one transpose per expert to [out, in]
            gu, dn = get(x + "gate_up_proj"), get(x + "down_proj")
            L["gate_up"] = [prepare(np.ascontiguousarray(gu[e].T)) for e in range(E)]  # [2I, H] each
            L["down"] = [prepare(np.ascontiguousarray(dn[e].T)) for e in range(E)]  # [H, I] each
        return L

    def _fuse_layer(self, i, L):
        return None  # no bias / sink path in the fused engine: op by op

    def _layer_ops(self, i, layer, h, cos, sin, spans, linear):
        """One gpt-oss decoder layer on h [n, H]; spans as TargetModel._layer_ops."""
        c, ops = self.config, self.ops
        n, nh, nkv, hd, eps = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps

        def proj(x, name):
            y = linear(x, layer[name])
            return y + layer[name + "_b"] if c.attention_bias else y

        a = ops.rms_norm(h, layer["ln1"], eps, False)  # [n, H]
        q = ops.apply_rope(proj(a, "q").reshape(n, nh, hd), cos, sin, False)  # [n, nh, hd]
        k = ops.apply_rope(proj(a, "k").reshape(n, nkv, hd), cos, sin, False)  # [n, nkv, hd]
        v = proj(a, "v").reshape(n, nkv, hd)  # [n, nkv, hd]
        o = np.empty((n, nh, hd), np.float32)  # [n, nh, hd]
        for sp in spans:
            cache, start, rows = sp.cache, sp.start, sp.rows
            end = start + (rows.stop - rows.start)
            cache.write(i, start, k[rows], v[rows])  # [nkv, n_r, hd] at start..end-1
            o[rows] = attention(q[rows], cache.k[i], cache.v[i], sp.q_pos, sp.k_pos, True, self.layer_windows[i],
                                False, sinks=layer["sinks"])
        h = h + proj(o.reshape(n, nh * hd), "o")  # [n, H]
        m = ops.rms_norm(h, layer["ln2"], eps, False)  # [n, H]
        return h + expert_block(m, layer, c, linear)
