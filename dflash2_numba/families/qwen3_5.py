"""Qwen3.5-family hybrid target (Qwen3.5 / Qwen3.8 dense): Gated DeltaNet layers interleaved
with gated full attention (docs/targets/qwen3_5.md). Same interface as families/qwen3.TargetModel:

    target = Qwen3_5Model.load(model_dir, device="cpu", dtype="f32")
    cache  = target.new_cache(max_len)                       # a HybridCache
    logits, taps = target.forward(ids, cache, tap_layers=(1, 3))
    cache.commit(n)                                          # exact state after position n-1

Layer i (pre-norm, every norm zero-centred: x * rsqrt(mean x^2 + eps) * (1 + w)):
    h += mixer_i(norm(h))    mixer = gdn (linear_attention) | gated attention (full_attention)
    h += mlp_i(norm(h))      the dense SwiGLU MLP (Qwen3.5-MoE: experts, families/qwen3_5_moe.py)
Taps are the residual stream after layer l whatever its kind (HF hidden_states[l+1]).

Config resolution and tensor inventory:
tensor inventory and the facts `inspect` reports (docs/targets/qwen3_5.md).

Two config.json spellings of one text stack:

    model_type "qwen3_5"       Qwen3_5ForConditionalGeneration: the text keys under `text_config`,
                               weights under `model.language_model.`, a vision tower under
                               `model.visual.` (not built: ignored by name), lm_head tied by the
                               TOP-LEVEL `tie_word_embeddings` (what transformers 5.24 does)
    model_type "qwen3_5_text"  Qwen3_5ForCausalLM: flat keys, weights under `model.`

`mtp.*` (the built-in multi-token-prediction head of the published checkpoints) is ignored by
name in both layouts. Qwen3.5-MoE and Qwen3-Next are refused by name: their MLP is a mixture of
experts (and Qwen3-Next packs its projections differently), which this decoder does not build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..config import DecoderDims, decoder_dims, human_bytes, read_config_json, rope_theta_of
from ..config_checks import bos_token_id as _bos_token_id, check_float, get_bool, get_int, get_object, get_str, token_ids
from ..errors import ConfigError, GenerationArgumentError, UnknownArchitectureError, UnsupportedConfigError
from ..inventory import ExpectedTensors
from ..kernels.backend import Ops, get_ops
from ..models.base import LoadProgress, forward_ids, tap_columns
from ..models.hybrid_cache import HybridCache
from ..models.layers import RopeTables, embedding, mlp, rnd_if, silu
from ..numerics import DTYPE_MODES, KV_DTYPES, as_f32, round_bf16_array

MULTIMODAL, TEXT = "qwen3_5", "qwen3_5_text"
ARCHITECTURES = {MULTIMODAL: "Qwen3_5ForConditionalGeneration", TEXT: "Qwen3_5ForCausalLM"}
# where the text stack's weights live, per model_type (the MoE family's two spellings too)
PREFIXES = {MULTIMODAL: "model.language_model.", TEXT: "model.",
            "qwen3_5_moe": "model.language_model.", "qwen3_5_moe_text": "model."}
# what the family carries but this decoder does not build: refused by name
REFUSED_MODEL_TYPES = {
    "qwen3_next": "Qwen3-Next (mixture-of-experts MLP, fused in_proj_qkvz / in_proj_ba)",
}
IGNORED_PREFIXES = {
    "mtp.": "built-in multi-token-prediction head (not used: the DFlash draft proposes)",
    "model.visual.": "vision tower (text-only decoder: no image or video inputs)",
}
LAYER_KINDS = ("linear_attention", "full_attention")


def is_qwen3_5(raw: dict) -> bool:
    """config.json of this family (including the refused MoE / Next variants, so that they get
    a refusal naming them rather than 'unknown architecture')."""
    archs = raw.get("architectures") or [None]
    arch = archs[0] if isinstance(archs, list) and archs else None
    mt = raw.get("model_type")
    if not isinstance(mt, str):  # a list is not hashable; the resolver names the wrong type
        mt = None
    return mt in ARCHITECTURES or mt in REFUSED_MODEL_TYPES or (
        isinstance(arch, str) and arch.startswith(("Qwen3_5", "Qwen3Next")))


@dataclass(frozen=True)
class Qwen3_5Config(DecoderDims):
    architecture: str
    model_type: str  # "qwen3_5" (multimodal layout) | "qwen3_5_text"
    vocab_size: int
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int  # K
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    source: str = "config.json"

    @property
    def prefix(self) -> str:  # where the text stack's weights live
        return PREFIXES[self.model_type]

    @property
    def rotary_dim(self) -> int:  # partial RoPE: only the first rotary_dim dims of a head turn
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:  # Hk * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # Hv * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the short conv: [q | k | v]
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


def _layer_types(text: dict, n_layers: int, source: str) -> tuple[str, ...]:
    """`layer_types`, else HF's rule: layer i is full attention iff (i+1) % interval == 0."""
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        if interval < 1:
            raise ConfigError(f"{source}: full_attention_interval = {interval}, expected >= 1")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"{source}: layer_types must be a list of {n_layers} entries (num_hidden_layers), "
                          f"got {types!r}")
    for i, t in enumerate(types):
        if t not in LAYER_KINDS:
            raise UnsupportedConfigError(f"{source}: layer_types[{i}] = {t!r}; expected one of {LAYER_KINDS}")
    return tuple(types)


def _rope(text: dict, source: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor). Only default RoPE; the multimodal `mrope_section` is
    accepted because text tokens carry equal T/H/W positions, which makes MRoPE 1-D RoPE."""
    params = get_object(text, "rope_parameters", source) or get_object(text, "rope_scaling", source)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise UnsupportedConfigError(f"{source}: rope_parameters.rope_type = {kind!r} is not supported "
                                     "(only 'default' RoPE)")
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))  # HF default 0.25
    return rope_theta_of({**text, "rope_parameters": params}, source), check_float(
        factor, "rope_parameters.partial_rotary_factor", source, positive=True)


def text_config(raw: dict, source: str, model_types: dict, multimodal: str) -> tuple[str, dict, bool, str]:
    """-> (model_type, the text keys, tie_word_embeddings, where to point messages) for a config
    of one of `model_types` (model_type -> architecture); `multimodal` nests under text_config."""
    mt = get_str(raw, "model_type", source, default=None)
    if mt not in model_types:
        if mt in REFUSED_MODEL_TYPES:
            raise UnsupportedConfigError(f"{source}: model_type = {mt!r} is {REFUSED_MODEL_TYPES[mt]}, not built "
                                         f"here; supported: {', '.join(model_types.values())}")
        raise UnknownArchitectureError(f"{source}: model_type = {mt!r}, architectures = {raw.get('architectures')!r}"
                                       f"; expected model_type one of {', '.join(model_types)}")
    if mt == multimodal:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type {mt!r} needs a text_config object, got {text!r}")
        tied = get_bool(raw, "tie_word_embeddings", source, default=False)  # the top-level flag decides (HF 5.24)
        return mt, text, tied, f"{source} (text_config)"
    return mt, raw, get_bool(raw, "tie_word_embeddings", source, default=False), source


def hybrid_fields(raw: dict, text: dict, mt: str, tied: bool, where: str, source: str, architecture: str,
                  intermediate_key: str = "intermediate_size") -> dict:
    """The Qwen3_5Config fields of the hybrid stack (the MoE family reads the same, then its own)."""
    if get_bool(text, "attention_bias", where, default=False):
        raise UnsupportedConfigError(f"{where}: attention_bias = true is not supported (no bias path)")
    if get_str(text, "hidden_act", where, default="silu") != "silu":
        raise UnsupportedConfigError(f"{where}: hidden_act = {text['hidden_act']!r}; only 'silu'")
    dims = decoder_dims(text, where, intermediate_key)
    theta, factor = _rope(text, where)
    fields = dict(
        architecture=architecture, model_type=mt, **dims,
        vocab_size=get_int(text, "vocab_size", where, minimum=1),
        rope_theta=theta, partial_rotary_factor=factor, tie_word_embeddings=tied,
        max_position_embeddings=get_int(text, "max_position_embeddings", where, default=32768, minimum=1),
        layer_types=_layer_types(text, dims["num_hidden_layers"], where),
        linear_conv_kernel_dim=get_int(text, "linear_conv_kernel_dim", where, default=4, minimum=1),
        linear_key_head_dim=get_int(text, "linear_key_head_dim", where, default=128, minimum=1),
        linear_value_head_dim=get_int(text, "linear_value_head_dim", where, default=128, minimum=1),
        linear_num_key_heads=get_int(text, "linear_num_key_heads", where, default=16, minimum=1),
        linear_num_value_heads=get_int(text, "linear_num_value_heads", where, default=32, minimum=1),
        eos_token_id=token_ids(text.get("eos_token_id", raw.get("eos_token_id")), "eos_token_id", where),
        bos_token_id=_bos_token_id(text, raw, where, source), source=source,
    )
    nh, nkv, hd = fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise ConfigError(f"{where}: linear_num_value_heads {fields['linear_num_value_heads']} is not a multiple "
                          f"of linear_num_key_heads {fields['linear_num_key_heads']}")
    if nh % nkv:
        raise ConfigError(f"{where}: num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
    rotary = int(hd * factor)
    if rotary % 2 or not 0 < rotary <= hd:
        raise ConfigError(f"{where}: head_dim {hd} * partial_rotary_factor {factor} = "
                          f"{hd * factor}; expected an even rotary size in 2..head_dim")
    return fields


def resolve_qwen3_5_config(raw: dict, source: str = "config.json") -> Qwen3_5Config:
    mt, text, tied, where = text_config(raw, source, ARCHITECTURES, MULTIMODAL)
    for key, name in (("num_experts", "a mixture-of-experts MLP"), ("moe_intermediate_size", "a MoE MLP")):
        if text.get(key):
            raise UnsupportedConfigError(f"{where}: {key} = {text[key]!r} ({name}) is not built by the dense "
                                         f"{mt!r} family; a MoE checkpoint has model_type 'qwen3_5_moe'")
    return Qwen3_5Config(**hybrid_fields(raw, text, mt, tied, where, source, ARCHITECTURES[mt]))


def expected_qwen3_5_tensors(c: Qwen3_5Config) -> ExpectedTensors:
    """Every tensor of the text stack with its shape (the MLP entries come from `mlp_tensors`,
    the seam where a MoE MLP would plug in)."""
    P, H, V, hd = c.prefix, c.hidden_size, c.vocab_size, c.head_dim
    Hv, K = c.linear_num_value_heads, c.linear_conv_kernel_dim
    shapes = {P + "embed_tokens.weight": (V, H), P + "norm.weight": (H,)}
    for i, kind in enumerate(c.layer_types):
        p = f"{P}layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
        shapes |= mlp_tensors(c, p + "mlp.")
        if kind == "full_attention":
            a = p + "self_attn."
            shapes |= {a + "q_proj.weight": (2 * c.num_attention_heads * hd, H),  # query | gate per head
                       a + "k_proj.weight": (c.num_key_value_heads * hd, H),
                       a + "v_proj.weight": (c.num_key_value_heads * hd, H),
                       a + "o_proj.weight": (H, c.num_attention_heads * hd),
                       a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        else:
            g = p + "linear_attn."
            shapes |= {g + "in_proj_qkv.weight": (c.conv_dim, H), g + "in_proj_z.weight": (c.value_dim, H),
                       g + "in_proj_b.weight": (Hv, H), g + "in_proj_a.weight": (Hv, H),
                       g + "conv1d.weight": (c.conv_dim, 1, K), g + "dt_bias": (Hv,), g + "A_log": (Hv,),
                       g + "norm.weight": (c.linear_value_head_dim,), g + "out_proj.weight": (H, c.value_dim)}
    optional: tuple = ()
    if c.tie_word_embeddings:
        optional = ("lm_head.weight",)
    else:
        shapes["lm_head.weight"] = (V, H)
    notes = {P + "embed_tokens.weight": f"[vocab_size, hidden_size] from {c.source}"}
    return ExpectedTensors(shapes, optional, notes, IGNORED_PREFIXES)


def mlp_tensors(c: Qwen3_5Config, p: str) -> dict:
    """The dense SwiGLU MLP of one layer (names under `p` = '...layers.{i}.mlp.')."""
    H, I = c.hidden_size, c.intermediate_size
    return {p + "gate_proj.weight": (I, H), p + "up_proj.weight": (I, H), p + "down_proj.weight": (H, I)}


# ---------------------------------------------------------------- sizes (inspect, README)
def state_bytes(c: Qwen3_5Config, block_rows: int = 16) -> dict:
    """Bytes per request of the recurrent state and of the rollback scheme (all f32):

    recurrent_state  S [Hv, dk, dv] per GDN layer (the delta-rule memory)
    conv_state       the last K-1 raw qkv rows per GDN layer
    rollback         the pre-block copy of S (double buffer) + per verified row the recurrence
                     inputs q, k [Hk*dk], v [Hv*dv], g, beta [Hv] and the raw qkv row, for a
                     block of `block_rows` rows
    kv_per_token     K and V of the full-attention layers, per position"""
    n_gdn, n_attn = len(c.gdn_layers), len(c.attention_layers)
    S = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.conv_dim * (c.linear_conv_kernel_dim - 1) * 4
    per_row = (2 * c.key_dim + c.value_dim + 2 * c.linear_num_value_heads + c.conv_dim) * 4
    return {
        "recurrent_state": n_gdn * S,
        "conv_state": n_gdn * conv,
        "rollback": n_gdn * (S + block_rows * per_row),
        "rollback_block_rows": block_rows,
        "kv_per_token": n_attn * 2 * c.num_key_value_heads * c.head_dim * 4,
    }


def describe_qwen3_5(c: Qwen3_5Config) -> dict:
    """Family facts for `inspect`: the layer schedule and the per-request state sizes, with the
    text lines `format_inspect` prints (`summary_lines`)."""
    sizes = state_bytes(c)
    schedule = "".join("A" if t == "full_attention" else "G" for t in c.layer_types)
    legend = "G = Gated DeltaNet (linear attention), A = gated full attention"
    recurrent = sizes["recurrent_state"] + sizes["conv_state"]
    return {
        "layer_schedule": schedule,
        "layer_schedule_legend": legend,
        "recurrent_state_bytes": recurrent,
        "state_sizes": sizes,
        "summary_lines": [
            f"layers:     {schedule}  ({legend})",
            f"recurrent state per request: {recurrent:,} B ({human_bytes(recurrent)}: delta-rule state "
            f"{human_bytes(sizes['recurrent_state'])} + conv state {human_bytes(sizes['conv_state'])})",
            f"rollback buffers ({sizes['rollback_block_rows']}-row block): {human_bytes(sizes['rollback'])}; "
            f"KV per position: {human_bytes(sizes['kv_per_token'])}",
        ],
    }


# ---------------------------------------------------------------- model
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

    kv_dtype = "f32"  # the attention layers' KV cache element type, as TargetModel.kv_dtype

    def __init__(self, config: Qwen3_5Config, checkpoint: Checkpoint, ops: Ops, dtype: str = "f32"):
        if dtype not in DTYPE_MODES:
            raise GenerationArgumentError(f"dtype {dtype!r}; expected one of: {', '.join(DTYPE_MODES)}")
        self.config, self.checkpoint, self.ops, self.dtype = config, checkpoint, ops, dtype
        self.bf16 = dtype == "bf16"
        self.rope = RopeTables(config.rotary_dim, config.rope_theta, self.bf16)  # partial RoPE tables
        self.valid_vocab = config.vocab_size
        checkpoint.require(self.expected_tensors(config))
        c, get, w, P = config, checkpoint.get, ops.prepare_weight, config.prefix

        def plus_one(name):  # zero-centred norm weights are stored as w, used as 1 + w
            return np.float32(1.0) + as_f32(get(name))

        self.embed_table = checkpoint.rows_table(P + "embed_tokens.weight")  # [V, H] rows on demand
        self.norm_w1 = plus_one(P + "norm.weight")  # [H]
        head = getattr(ops, "prepare_head", None) or w  # quantized like the rest unless kept as stored (CPU)
        self.lm_head_w = head(self.embed_table if c.tie_word_embeddings else get("lm_head.weight"))  # [V, H]
        self.layers, progress = [], LoadProgress(checkpoint, c.num_hidden_layers)
        for i, kind in enumerate(c.layer_types):
            p = f"{P}layers.{i}."
            layer = {"kind": kind, "ln1": plus_one(p + "input_layernorm.weight"),
                     "ln2": plus_one(p + "post_attention_layernorm.weight"),
                     "mlp": self._load_mlp(i, p + "mlp.")}
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
            progress.layer_done(i)

    def _load_mlp(self, i: int, p: str) -> dict:
        """Layer i's MLP weights under p = '...layers.{i}.mlp.' (the MoE family returns experts)."""
        get, w = self.checkpoint.get, self.ops.prepare_weight
        return {n: w(get(p + f"{n}_proj.weight")) for n in ("gate", "up", "down")}

    quantizable = True  # --quantize q8_0 / q4_0: every linear weight goes through ops.prepare_weight
    resolve_config = staticmethod(resolve_qwen3_5_config)
    expected_tensors = staticmethod(expected_qwen3_5_tensors)

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: str = "f32", quantize: str | None = None,
             keep_head: bool = False) -> "Qwen3_5Model":
        path, raw = read_config_json(model_dir)
        return cls(cls.resolve_config(raw, str(path)), open_checkpoint(model_dir), get_ops(device, quantize, keep_head),
                   dtype)

    # ------------------------------------------------------------------ pieces (also used by drafts)
    def new_cache(self, max_len: int = 256) -> HybridCache:
        return HybridCache(self.config, self.ops, max_len, KV_DTYPES[self.kv_dtype])

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
        at = tap_columns(tap_layers, H)  # {layer: its columns of taps}
        for i, layer in enumerate(self.layers):
            x = zero_centred_rms_norm(self.ops, h, layer["ln1"], c.rms_norm_eps, self.bf16)  # [n, H]
            if layer["kind"] == "full_attention":
                mixed = self._attention(i, layer, x, cache, start)
            else:
                mixed = self._gdn(i, layer, x, cache)
            h = rnd_if(h + mixed, self.bf16)  # [n, H]
            m = zero_centred_rms_norm(self.ops, h, layer["ln2"], c.rms_norm_eps, self.bf16)
            h = rnd_if(h + self._mlp(layer["mlp"], m), self.bf16)  # [n, H] (dense or MoE)
            for cols in at.get(i, ()):
                taps[:, cols] = h
        cache.end_block()
        if last_only:
            h = h[-1:]
        return self.lm_head(self.final_norm(h)), taps

    def _mlp(self, p, x):
        """The dense SwiGLU MLP [n, H] -> [n, H] (families/qwen3_5_moe.py overrides it)."""
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
        cache.kv.write(slot, start, k, v)  # [nkv, n, hd] at start..end-1
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
