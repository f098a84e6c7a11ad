"""Muse-Glimmer text target: config, inventory and model (docs/targets/muse_glimmer.md explains it).

    target = MuseGlimmerTarget.load(model_dir, device="cpu", dtype="f32")
    cache  = target.new_cache(max_len)                         # a KVCache, as TargetModel's
    logits, taps = target.forward(ids, cache, tap_layers=(1, 3))
    cache.commit(n)

The interface of families/qwen3.TargetModel, so the decode loop and the drafts need no branch:
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

Config resolution:

Field names follow the Hugging Face keys of `MuseGlimmerTextConfig`. Two spellings are read:
`model_type` "muse_glimmer" (the released composite `MuseGlimmerForConditionalGeneration`: the
text keys nested under `text_config`, weights under `model.language_model.`, `lm_head.weight` at
top level, a vision tower beside it) and "muse_glimmer_text" (flat keys, `MuseGlimmerTextModel`
weights with no prefix and no head). The model is below; docs/targets/
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
from pathlib import Path

import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..config import DecoderDims, decoder_dims, read_config_json, refuse_rope_scaling
from ..config_checks import (architecture_of, bos_token_id, check_float, get_bool, get_float, get_int, get_object,
                             get_str, token_ids)
from ..errors import ConfigError, GenerationArgumentError, PairingError, UnsupportedConfigError
from ..inventory import ExpectedTensors
from ..kernels.backend import Ops, get_ops
from ..models.layers import RopeTables, embedding, mlp, rnd_if
from ..numerics import DTYPE_MODES, as_f32
from .qwen3 import TargetModel

MUSE_MODEL_TYPES = ("muse_glimmer", "muse_glimmer_text")
MUSE_ARCHITECTURES = ("MuseGlimmerForConditionalGeneration", "MuseGlimmerForCausalLM", "MuseGlimmerTextModel")
COMPOSITE_PREFIX = "model.language_model."  # text weights inside MuseGlimmerForConditionalGeneration
VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
LEGACY_NORMS = ("post_attn_norm", "post_ffn_norm")  # vLLM-reported legacy export: not this layout
SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class MuseGlimmerConfig(DecoderDims):
    """DecoderDims, then: head_dim is NOT hidden_size / heads at the release (128 vs 208);
    rms_norm_eps (default 1e-5 here) serves the embedding, q/k, the two pre norms, the final norm."""
    architecture: str
    model_type: str  # the top-level model_type ("muse_glimmer" | "muse_glimmer_text")
    vocab_size: int
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
    refuse_rope_scaling(text, where)
    nested = get_object(text, "rope_parameters", where)
    theta = text.get("rope_theta", nested.get("rope_theta"))
    theta = None if theta is None else check_float(theta, "rope_parameters.rope_theta", where, positive=True)

    dims = decoder_dims(text, where, eps_default=1e-5)
    L, hd = dims["num_hidden_layers"], dims["head_dim"]
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
        architecture=arch, model_type=model_type, **dims,
        vocab_size=get_int(text, "vocab_size", where, minimum=1),
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


# ---------------------------------------------------------------- model
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

        self.embed_table = checkpoint.rows_table(p0 + "embed_tokens.weight")  # [V, H] stays uint16: rows on demand
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

    quantizable = False  # --quantize: not wired for this family yet (refused by name in api.load_target)

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
        """Called by the draft loader after config.check_pairing (check_muse_pairing above)."""
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
        cache.write(i, start, k, v)  # [nkv, n, hd] at start..end-1
        # causal=True with window W: key s visible from query t iff t-W < s <= t (sliding layers)
        o = ops.attention(q, cache.k[i], cache.v[i], q_pos, k_pos, True, layer["window"], bf16)  # [n, nh, hd]
        o = rnd_if(o, bf16).reshape(n, nh * hd)  # [n, nh*hd] head-major
        gate = rnd_if(sigmoid(rnd_if(linear(x, layer["out_gate"]), bf16)), bf16)  # [n, nh*hd] from x
        a = rnd_if(linear(rnd_if(o * gate, bf16), layer["o"]), bf16)  # [n, H]
        h = rnd_if(h + self._norm(a, layer["post_attention_layernorm"], post_eps), bf16)  # branch norm

        y = self._norm(h, layer["pre_feedforward_layernorm"], eps)  # [n, H]
        m = mlp(y, layer["gate"], layer["up"], layer["down"], linear, bf16, self.ops.swiglu)  # [n, H]
        return rnd_if(h + self._norm(m, layer["post_feedforward_layernorm"], post_eps), bf16)
