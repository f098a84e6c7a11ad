"""Qwen3.5-family hybrid targets (Gated DeltaNet + gated full attention): config resolution,
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

from ..config import _rope_theta, human_bytes
from ..inventory import ExpectedTensors
from ..config_checks import (MAX_LAYERS, bos_token_id as _bos_token_id, check_float, get_bool, get_float, get_int,
                             get_object, get_str, head_geometry, token_ids)
from ..errors import ConfigError, UnknownArchitectureError, UnsupportedConfigError

MULTIMODAL, TEXT = "qwen3_5", "qwen3_5_text"
ARCHITECTURES = {MULTIMODAL: "Qwen3_5ForConditionalGeneration", TEXT: "Qwen3_5ForCausalLM"}
PREFIXES = {MULTIMODAL: "model.language_model.", TEXT: "model."}
# what the family carries but this decoder does not build: refused by name
REFUSED_MODEL_TYPES = {
    "qwen3_5_moe": "Qwen3.5-MoE (mixture-of-experts MLP)",
    "qwen3_5_moe_text": "Qwen3.5-MoE (mixture-of-experts MLP)",
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
class Qwen3_5Config:
    architecture: str
    model_type: str  # "qwen3_5" (multimodal layout) | "qwen3_5_text"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
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
    return _rope_theta({**text, "rope_parameters": params}, source), check_float(
        factor, "rope_parameters.partial_rotary_factor", source, positive=True)


def resolve_qwen3_5_config(raw: dict, source: str = "config.json") -> Qwen3_5Config:
    mt = get_str(raw, "model_type", source, default=None)
    if mt in REFUSED_MODEL_TYPES:
        raise UnsupportedConfigError(f"{source}: model_type = {mt!r} is {REFUSED_MODEL_TYPES[mt]}, not built "
                                     f"here; supported: {', '.join(ARCHITECTURES.values())}")
    if mt not in ARCHITECTURES:
        raise UnknownArchitectureError(f"{source}: model_type = {mt!r}, architectures = {raw.get('architectures')!r}"
                                       f"; a Qwen3.5 hybrid target has model_type 'qwen3_5' or 'qwen3_5_text'")
    if mt == MULTIMODAL:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type 'qwen3_5' needs a text_config object, got {text!r}")
        tied = get_bool(raw, "tie_word_embeddings", source, default=False)  # the top-level flag decides (HF 5.24)
        where = f"{source} (text_config)"
    else:
        text, tied, where = raw, get_bool(raw, "tie_word_embeddings", source, default=False), source
    for key, name in (("num_experts", "a mixture-of-experts MLP"), ("moe_intermediate_size", "a MoE MLP")):
        if text.get(key):
            raise UnsupportedConfigError(f"{where}: {key} = {text[key]!r} ({name}) is not built here")
    if get_bool(text, "attention_bias", where, default=False):
        raise UnsupportedConfigError(f"{where}: attention_bias = true is not supported (no bias path)")
    if get_str(text, "hidden_act", where, default="silu") != "silu":
        raise UnsupportedConfigError(f"{where}: hidden_act = {text['hidden_act']!r}; only 'silu'")
    H = get_int(text, "hidden_size", where, minimum=1)
    nh, nkv, hd = head_geometry(text, where, H)
    L = get_int(text, "num_hidden_layers", where, minimum=1, maximum=MAX_LAYERS)
    theta, factor = _rope(text, where)
    cfg = Qwen3_5Config(
        architecture=ARCHITECTURES[mt], model_type=mt, hidden_size=H,
        intermediate_size=get_int(text, "intermediate_size", where, minimum=1), num_hidden_layers=L,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
        vocab_size=get_int(text, "vocab_size", where, minimum=1),
        rms_norm_eps=get_float(text, "rms_norm_eps", where, default=1e-6, positive=True),
        rope_theta=theta, partial_rotary_factor=factor, tie_word_embeddings=tied,
        max_position_embeddings=get_int(text, "max_position_embeddings", where, default=32768, minimum=1),
        layer_types=_layer_types(text, L, where),
        linear_conv_kernel_dim=get_int(text, "linear_conv_kernel_dim", where, default=4, minimum=1),
        linear_key_head_dim=get_int(text, "linear_key_head_dim", where, default=128, minimum=1),
        linear_value_head_dim=get_int(text, "linear_value_head_dim", where, default=128, minimum=1),
        linear_num_key_heads=get_int(text, "linear_num_key_heads", where, default=16, minimum=1),
        linear_num_value_heads=get_int(text, "linear_num_value_heads", where, default=32, minimum=1),
        eos_token_id=token_ids(text.get("eos_token_id", raw.get("eos_token_id")), "eos_token_id", where),
        bos_token_id=_bos_token_id(text, raw, where, source), source=source,
    )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(f"{where}: linear_num_value_heads {cfg.linear_num_value_heads} is not a multiple of "
                          f"linear_num_key_heads {cfg.linear_num_key_heads}")
    if nh % cfg.num_key_value_heads:
        raise ConfigError(f"{where}: num_attention_heads {nh} is not a multiple of num_key_value_heads "
                          f"{cfg.num_key_value_heads}")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        raise ConfigError(f"{where}: head_dim {cfg.head_dim} * partial_rotary_factor {factor} = "
                          f"{cfg.head_dim * factor}; expected an even rotary size in 2..head_dim")
    return cfg


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

