"""Muse-Glimmer text target: config resolution, tensor inventory, inspect facts, pairing.

Field names follow the Hugging Face keys of `MuseGlimmerTextConfig`. Two spellings are read:
`model_type` "muse_glimmer" (the released composite `MuseGlimmerForConditionalGeneration`: the
text keys nested under `text_config`, weights under `model.language_model.`, `lm_head.weight` at
top level, a vision tower beside it) and "muse_glimmer_text" (flat keys, `MuseGlimmerTextModel`
weights with no prefix and no head). The model is in models/muse_glimmer.py; docs/targets/
muse_glimmer.md explains the math.

Refused by name, never guessed: the legacy export whose `post_attention_layernorm` is the pre-FFN
norm (`post_attn_norm` / `post_ffn_norm` tensors), a query scale that looks like the native
unfolded value (qk_scale_factor >= sqrt(head_dim), e.g. 43.78 = 3.87 * sqrt(128)), `layer_types`
and `layer_rope_theta` lists that disagree (sliding <=> RoPE), a per-layer theta that differs
from the global one, a missing RoPE theta (the class default 10000 is not the release's 5e5),
attention biases, non-SiLU MLPs, RoPE scaling. Ignored by name: the vision tower tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import _refuse_rope_scaling
from .inventory import ExpectedTensors
from .config_checks import (MAX_LAYERS, architecture_of, bos_token_id, check_float, get_bool, get_float, get_int,
                            get_object, get_str, head_geometry, token_ids)
from .errors import ConfigError, PairingError, UnsupportedConfigError

MUSE_MODEL_TYPES = ("muse_glimmer", "muse_glimmer_text")
MUSE_ARCHITECTURES = ("MuseGlimmerForConditionalGeneration", "MuseGlimmerForCausalLM", "MuseGlimmerTextModel")
COMPOSITE_PREFIX = "model.language_model."  # text weights inside MuseGlimmerForConditionalGeneration
VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
LEGACY_NORMS = ("post_attn_norm", "post_ffn_norm")  # vLLM-reported legacy export: not this layout
SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class MuseGlimmerConfig:
    architecture: str
    model_type: str  # the top-level model_type ("muse_glimmer" | "muse_glimmer_text")
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # NOT hidden_size / heads at the release (128 vs 208)
    vocab_size: int
    rms_norm_eps: float  # embedding, q/k, the two pre norms, the final norm
    post_norm_eps: float  # the two post (branch) norms only
    rope_theta: float  # one table for every RoPE layer
    layer_types: list[str]  # per layer: "sliding_attention" | "full_attention" (the mask)
    layer_rope: list[bool]  # per layer: RoPE applied (layer_rope_theta != 0)
    sliding_window: int  # W: a sliding layer's query at t sees keys s with t - W < s <= t
    qk_scale_factor: float  # multiplies q after its weightless norm (1/sqrt(hd) still applies)
    output_multiplier: float  # logits * this, then the softcap
    final_logit_softcapping: float | None  # cap * tanh(z / cap); None = off
    tie_word_embeddings: bool  # composite: the TOP-LEVEL key decides; flat: the text key
    max_position_embeddings: int
    weight_prefix: str  # "model.language_model." (composite) or "" (MuseGlimmerTextModel)
    head_in_file: bool  # composite: lm_head.weight shipped (untied); flat text model: no head
    image_token_id: int | None = None  # composite only: embedded as id 0 (as HF does)
    video_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    source: str = "config.json"

    @property
    def num_global_layers(self) -> int:
        return sum(t == GLOBAL for t in self.layer_types)


def _default_schedule(L: int, theta: float) -> tuple[list[str], list[float]]:
    """HF's derivation when the lists are absent: counted BACKWARD from the last layer, every
    4th layer (the last included) is global and RoPE-free, the others slide with RoPE."""
    types = [GLOBAL if (L - 1 - i) % 4 == 0 else SLIDING for i in range(L)]
    return types, [0.0 if t == GLOBAL else theta for t in types]


def _schedule(text: dict, L: int, theta: float | None, source: str) -> tuple[list[str], list[bool]]:
    types, thetas = _default_schedule(L, theta or 1.0)
    if text.get("layer_types") is not None:
        types = text["layer_types"]
        if not isinstance(types, list) or len(types) != L or any(t not in (SLIDING, GLOBAL) for t in types):
            raise ConfigError(f"{source}: layer_types must be {L} entries of {SLIDING!r}/{GLOBAL!r}, got {types!r}")
    if text.get("layer_rope_theta") is not None:
        thetas = text["layer_rope_theta"]
        if not isinstance(thetas, list) or len(thetas) != L:
            raise ConfigError(f"{source}: layer_rope_theta must be a list of {L} numbers, got {thetas!r}")
    rope = [float(t) != 0.0 for t in thetas]
    for i, (t, r, th) in enumerate(zip(types, rope, thetas)):
        # HF reads the two lists independently; the release keeps them in lockstep (vLLM even
        # derives both from one flag). A config where they disagree is refused, not guessed.
        if (t == SLIDING) != r:
            raise UnsupportedConfigError(
                f"{source}: layer {i}: layer_types[{i}] = {t!r} but layer_rope_theta[{i}] = {th!r}; "
                "expected sliding layers with RoPE and global layers without (the lists disagree)")
        if r and theta is not None and float(th) != theta and text.get("layer_rope_theta") is not None:
            raise UnsupportedConfigError(
                f"{source}: layer_rope_theta[{i}] = {th!r} differs from rope_parameters.rope_theta = {theta!r}; "
                "HF uses one RoPE table for every layer (per-layer values are only flags)")
    return list(types), rope


def resolve_muse_config(raw: dict, source: str = "config.json") -> MuseGlimmerConfig:
    model_type = get_str(raw, "model_type", source, default=None)
    arch = architecture_of(raw, source) or ("MuseGlimmerForConditionalGeneration" if model_type == "muse_glimmer"
                                            else "MuseGlimmerTextModel")
    if model_type not in MUSE_MODEL_TYPES:
        raise ConfigError(f"{source}: model_type = {model_type!r}, expected one of {MUSE_MODEL_TYPES}")
    composite = model_type == "muse_glimmer"
    if composite:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type 'muse_glimmer' needs a text_config object, got {text!r}")
        where = f"{source} (text_config)"
    else:
        text, where = raw, source
    tie = get_bool(raw, "tie_word_embeddings", source, default=False)  # the composite class ignores the text key
    for key in ("attention_bias", "mlp_bias"):
        if get_bool(text, key, where, default=False):
            raise UnsupportedConfigError(f"{where}: {key} = true is not supported (no bias path)")
    for key in ("use_qk_norm", "use_attn_output_gate"):  # vLLM-only switches; HF hard-wires True
        if get_bool(text, key, where, default=True) is False:
            raise UnsupportedConfigError(f"{where}: {key} = false is not supported (always on in Muse-Glimmer)")
    act = get_str(text, "hidden_activation", where, default=None) or get_str(text, "hidden_act", where, default="silu")
    if act != "silu":
        raise UnsupportedConfigError(f"{where}: hidden_activation = {act!r}; only 'silu'")
    _refuse_rope_scaling(text, where)
    nested = get_object(text, "rope_parameters", where)
    theta = text.get("rope_theta", nested.get("rope_theta"))
    theta = None if theta is None else check_float(theta, "rope_parameters.rope_theta", where, positive=True)

    L = get_int(text, "num_hidden_layers", where, minimum=1, maximum=MAX_LAYERS)
    H = get_int(text, "hidden_size", where, minimum=1)
    nh, nkv, hd = head_geometry(text, where, H)
    types, rope = _schedule(text, L, theta, where)
    if any(rope) and theta is None:
        raise ConfigError(f"{where}: rope_parameters.rope_theta is missing; refusing to assume the class "
                          "default 10000 (the release uses 500000)")
    qk = get_float(text, "qk_scale_factor", where, default=3.87)
    if not 0 < qk < math.sqrt(hd):
        raise UnsupportedConfigError(
            f"{where}: qk_scale_factor = {qk}; expected 0 < value < sqrt(head_dim) = {math.sqrt(hd):.2f}. "
            f"A value near {3.87 * math.sqrt(hd):.2f} is the native unfolded scale (3.87 * sqrt(head_dim)); "
            "HF multiplies by the config value as is, so this checkpoint would attend wrongly")
    window = get_int(text, "sliding_window", where, default=2048, minimum=1 if SLIDING in types else None)
    cap = get_float(text, "final_logit_softcapping", where, default=20.0)
    return MuseGlimmerConfig(
        architecture=arch, model_type=model_type, hidden_size=H,
        intermediate_size=get_int(text, "intermediate_size", where, minimum=1), num_hidden_layers=L,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
        vocab_size=get_int(text, "vocab_size", where, minimum=1),
        rms_norm_eps=get_float(text, "rms_norm_eps", where, default=1e-5, positive=True),
        post_norm_eps=get_float(text, "post_norm_eps", where, default=1e-8, positive=True),
        rope_theta=theta if theta is not None else 0.0, layer_types=types, layer_rope=rope,
        sliding_window=int(window), qk_scale_factor=qk,
        output_multiplier=get_float(text, "output_multiplier", where, default=1.0),
        final_logit_softcapping=cap if cap > 0 else None,
        tie_word_embeddings=tie,
        max_position_embeddings=get_int(text, "max_position_embeddings", where, default=131072, minimum=1),
        weight_prefix=COMPOSITE_PREFIX if composite else "", head_in_file=composite,
        image_token_id=get_int(raw, "image_token_id", source, default=None, minimum=0) if composite else None,
        video_token_id=get_int(raw, "video_token_id", source, default=None, minimum=0) if composite else None,
        eos_token_id=token_ids(text.get("eos_token_id", raw.get("eos_token_id")), "eos_token_id", where),
        bos_token_id=bos_token_id(text, raw, where, source), source=source,
    )


# ---------------------------------------------------------------- tensors
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


def expected_muse_tensors(c: MuseGlimmerConfig) -> ExpectedTensors:
    """Every text tensor with its shape. No q/k/embedding norm tensors exist (weightless)."""
    H, I, V, hd, p0 = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim, c.weight_prefix
    q_rows, kv_rows = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes = {p0 + "embed_tokens.weight": (V, H), p0 + "norm.weight": (H,)}
    for i in range(c.num_hidden_layers):
        p = f"{p0}layers.{i}."
        shapes |= {p + n + ".weight": (H,) for n in LAYER_NORMS}
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, H),
            p + "self_attn.k_proj.weight": (kv_rows, H),
            p + "self_attn.v_proj.weight": (kv_rows, H),
            p + "self_attn.gate_proj.weight": (q_rows, H),  # the attention OUTPUT gate
            p + "self_attn.o_proj.weight": (H, q_rows),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
    optional: tuple = ()
    if c.head_in_file and not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    else:  # tied, or the bare text model (no head): the embedding matrix is the head
        optional = ("lm_head.weight",)
    notes = {p0 + "embed_tokens.weight": f"[vocab_size, hidden_size] from {c.source}",
             **{p0 + f"layers.{i}.self_attn.q_proj.weight": f"[num_attention_heads * head_dim, hidden_size] "
                f"= [{c.num_attention_heads} * {hd}, {H}]" for i in range(c.num_hidden_layers)}}
    return ExpectedTensors(shapes, optional, notes, ignored_prefixes=dict.fromkeys(
        VISION_PREFIXES, "vision tower (text-only decoder: no image or video inputs)"))


def refuse_legacy_export(c: MuseGlimmerConfig, names, where: str) -> None:
    """The legacy layout (true post-attention norm named post_attn_norm, post_attention_layernorm
    being the PRE-FFN norm) would load with its norms swapped: refuse it by name."""
    legacy = sorted(n for n in names if any(f".{k}." in n for k in LEGACY_NORMS))
    if legacy:
        raise UnsupportedConfigError(
            f"{where}: tensor {legacy[0]!r} belongs to the legacy Muse-Glimmer export (post_attn_norm / "
            "post_ffn_norm, where post_attention_layernorm is the pre-FFN norm); expected the Hugging Face "
            f"layout ({c.weight_prefix or ''}layers.N.post_attention_layernorm = the post-attention norm)")


# ---------------------------------------------------------------- inspect facts
def kv_bytes_per_request(c: MuseGlimmerConfig, context: int, block_rows: int = 16, itemsize: int = 4) -> dict:
    """KV bytes of one request at `context` positions: what this cache keeps (every position of
    every layer) and the minimum a verifier needs (a sliding layer only W-1 older positions plus
    the block_rows rows of a verify forward)."""
    per_pos = 2 * c.num_key_value_heads * c.head_dim * itemsize  # K and V of one position, one layer
    n_glob = c.num_global_layers
    n_slide = c.num_hidden_layers - n_glob
    kept = c.num_hidden_layers * context * per_pos
    minimum = n_glob * context * per_pos + n_slide * min(context, c.sliding_window - 1 + block_rows) * per_pos
    return {"context": context, "block_rows": block_rows, "bytes_per_position_per_layer": per_pos,
            "kept_bytes": kept, "minimum_bytes": minimum}


def describe_muse(c: MuseGlimmerConfig) -> dict:
    """Layer schedule and per-request state bytes for `dflash2-decode inspect`."""
    schedule = [("sliding" if t == SLIDING else "global") + ("+rope" if r else "+nope")
                for t, r in zip(c.layer_types, c.layer_rope)]
    facts = {
        "family": "muse-glimmer",
        "layer_schedule": schedule,
        "sliding_window": c.sliding_window,
        "state_bytes": kv_bytes_per_request(c, c.max_position_embeddings),
        "state_note": ("K/V kept as f32 for every position of every layer (this cache); a sliding layer "
                       "needs only its last W-1 positions plus the Q rows of a verify block"),
    }
    facts["summary_lines"] = format_muse_facts(facts)
    return facts


def format_muse_facts(report: dict) -> list[str]:
    """Inspect text lines: the schedule as runs of equal layers, the state bytes."""
    sched, runs = report["layer_schedule"], []
    for i, kind in enumerate(sched):
        if runs and runs[-1][2] == kind:
            runs[-1][1] = i
        else:
            runs.append([i, i, kind])
    st = report["state_bytes"]
    return [
        "layer schedule: " + ", ".join(f"{a}-{b} {k}" if a != b else f"{a} {k}" for a, b, k in runs),
        f"state per request at {st['context']} positions (Q={st['block_rows']}): "
        f"kept {st['kept_bytes']:,} B; minimum {st['minimum_bytes']:,} B "
        f"(sliding layers keep W-1+Q = {report['sliding_window'] - 1 + st['block_rows']} positions)",
    ]


# ---------------------------------------------------------------- pairing
def check_muse_pairing(draft, target: MuseGlimmerConfig) -> None:
    """What a draft made for this target must agree on beyond config.check_pairing: the layer
    count it was trained against, and (DFlash2) the logit transform the selector applies to
    candidate values, so that its unary term is the target's real logit."""
    where = f"{draft.source} vs {target.source}"
    if draft.num_target_layers != target.num_hidden_layers:
        raise PairingError(f"{where}: draft num_target_layers {draft.num_target_layers} != target "
                           f"num_hidden_layers {target.num_hidden_layers}")
    if draft.kind == "dflash2":
        for key, d, t in (("output_multiplier", draft.output_multiplier, target.output_multiplier),
                          ("final_logit_softcapping", draft.final_logit_softcapping,
                           target.final_logit_softcapping)):
            if d != t:
                raise PairingError(f"{where}: draft dflash_config.{key} = {d} != target {key} = {t}")
