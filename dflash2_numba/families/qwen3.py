"""The Qwen3 / Llama family (`Qwen3ForCausalLM`, `LlamaForCausalLM`): config, tensor inventory
and the target model over a croppable KV cache, with hidden taps (spec §2.1, §5). Its model is
also the base the other families build on (their `_layer`, `embed_input`, `logits` differ).

    cfg    = resolve_target_config(raw, source)                 # TargetConfig, HF key names
    target = TargetModel.load(model_dir, device="cpu", dtype="f32")
    cache  = target.new_cache(max_len)
    logits, taps = target.forward(ids, cache, tap_layers=(1, 3))   # prefill / verify / decode
    cache.commit(n)                                                # keep positions 0..n-1

`forward` runs `ids` at positions cache.length .. cache.length+n-1, appends their K/V and
returns logits for every row (row i predicts position cache.length+i+1) and, if asked, the
residual stream after each layer in `tap_layers` (HF `hidden_states[l+1]`), concatenated.

Layer (pre-norm): h += o_proj(attn(rms(h))); h += mlp_i(m), m = rms(h); the dense MLP is
down(silu(gate(m)) * up(m)); a family with experts overrides `_mlp_block` (families/qwen3_moe.py).
Qwen3 applies q_norm / k_norm per head before RoPE; Llama has neither.

Sliding-window layers (Qwen3 `use_sliding_window` / `layer_types`, resolved below as
transformers does): query t sees key s iff 0 <= t - s < W, i.e. the attention kernel's
`causal=True, window=W`. The cache keeps every position (commit stays a length change); the
window only masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..config import (LAYER_TYPES, DecoderDims, decoder_dims, read_config_json, refuse_rope_scaling,
                      rope_theta_of)
from ..config_checks import get_bool, get_float, get_int, get_str, token_ids
from ..config_checks import architecture_of
from ..errors import ConfigValueError, GenerationArgumentError, UnknownArchitectureError, UnsupportedConfigError
from ..inventory import ExpectedTensors
from ..kernels import fused
from ..kernels.backend import Ops, get_ops
from ..models.base import KVCache, LoadProgress, Span, forward_ids, tap_columns
from ..models.layers import RopeTables, embedding, mlp, rnd_if
from ..numerics import DTYPE_MODES, KV_DTYPES, as_f32

TARGET_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")


# ---------------------------------------------------------------- config
@dataclass(frozen=True)
class TargetConfig(DecoderDims):
    architecture: str  # architectures[0]
    model_type: str
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    source: str = "config.json"
    # per layer: None = full causal attention, W = causal sliding window (key s visible from
    # query t iff 0 <= t - s < W, as HF's sliding_window_overlay); all None unless configured
    layer_window: tuple[int | None, ...] = ()
    sliding_window: int | None = None  # resolved (None unless use_sliding_window)

    @property
    def has_qk_norm(self) -> bool:  # Qwen3 (dense and MoE) normalises per head before RoPE; Llama does not
        return self.architecture.startswith("Qwen3")


def resolve_target_config(raw: dict, source: str = "config.json") -> TargetConfig:
    arch = architecture_of(raw, source)
    if arch not in TARGET_ARCHITECTURES:
        raise UnknownArchitectureError(
            f"{source}: architectures[0] = {arch!r}; supported targets: {', '.join(TARGET_ARCHITECTURES)}"
        )
    return TargetConfig(**attention_stack_fields(raw, arch, source))


def attention_stack_fields(raw: dict, arch: str, source: str) -> dict:
    """The TargetConfig fields of a Qwen3 / Llama-style attention stack (the MoE family reads the
    same keys, then its own): refusals for what has no path here (biases, other activations,
    RoPE scaling), geometry, RoPE, windows, token ids."""
    for key in ("attention_bias", "mlp_bias"):
        if get_bool(raw, key, source, default=False):
            raise UnsupportedConfigError(f"{source}: {key} = true is not supported (no bias path)")
    if get_str(raw, "hidden_act", source, default="silu") != "silu":
        raise UnsupportedConfigError(f"{source}: hidden_act = {raw['hidden_act']!r}; only 'silu'")
    refuse_rope_scaling(raw, source)
    dims = decoder_dims(raw, source)
    windows, sliding_window = _target_windows(raw, arch, dims["num_hidden_layers"], source)
    return dict(
        architecture=arch,
        model_type=get_str(raw, "model_type", source, default=""),
        **dims,
        vocab_size=get_int(raw, "vocab_size", source, minimum=1),
        rope_theta=rope_theta_of(raw, source),
        tie_word_embeddings=get_bool(raw, "tie_word_embeddings", source, default=False),
        max_position_embeddings=get_int(raw, "max_position_embeddings", source, default=32768, minimum=1),
        eos_token_id=token_ids(raw.get("eos_token_id"), "eos_token_id", source),
        bos_token_id=get_int(raw, "bos_token_id", source, default=None, minimum=0),
        source=source,
        layer_window=windows,
        sliding_window=sliding_window,
    )



def _layer_types(raw: dict, n_layers: int, source: str) -> list[str] | None:
    """`layer_types` as given (None when absent): a list of n_layers known names."""
    types = raw.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list):
        raise ConfigValueError(f"{source}: layer_types = {types!r:.200}, expected a JSON list")
    if len(types) != n_layers:
        raise ConfigValueError(f"{source}: layer_types has {len(types)} entries, expected "
                               f"num_hidden_layers = {n_layers}")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ConfigValueError(f"{source}: layer_types[{i}] = {t!r}, expected one of {', '.join(LAYER_TYPES)}")
    return types


def _target_windows(raw: dict, arch: str, n_layers: int, source: str):
    """Per-layer sliding windows of a Qwen3 target, resolved as transformers' Qwen3Config does:
    sliding_window counts only with use_sliding_window (default 4096 when the key is absent);
    without layer_types, layers i >= max_window_layers slide. Llama has no sliding path in HF
    (the keys are ignored there, and here). -> (layer_window tuple, resolved sliding_window)."""
    if not arch.startswith("Qwen3"):  # Llama: no sliding path
        return (None,) * n_layers, None
    use = get_bool(raw, "use_sliding_window", source, default=False)
    window = get_int(raw, "sliding_window", source, default=None, minimum=1) if "sliding_window" in raw else 4096
    if use and window is None:
        raise ConfigValueError(f"{source}: use_sliding_window = true but sliding_window = null: "
                               "no window to slide (give sliding_window >= 1, or set use_sliding_window false)")
    window = window if use else None
    max_window_layers = get_int(raw, "max_window_layers", source, default=28, minimum=0)
    types = _layer_types(raw, n_layers, source)
    if types is None:
        types = ["sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
                 for i in range(n_layers)]
    if "sliding_attention" in types and window is None:
        raise ConfigValueError(
            f"{source}: layer_types has sliding_attention layers but use_sliding_window = {use} and "
            f"sliding_window = {raw.get('sliding_window')!r} give no window; transformers would run them "
            "with full attention, which is not what layer_types says")
    return tuple(window if t == "sliding_attention" else None for t in types), window


def load_target_config(model_dir: str | Path) -> TargetConfig:
    path, raw = read_config_json(model_dir)
    return resolve_target_config(raw, source=str(path))



# ---------------------------------------------------------------- tensors
def expected_target_tensors(cfg: TargetConfig) -> ExpectedTensors:
    """Every tensor of a Qwen3 / Llama target with its shape. `lm_head.weight` only when untied."""
    H, I, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q_rows, H),
            p + "self_attn.k_proj.weight": (kv_rows, H),
            p + "self_attn.v_proj.weight": (kv_rows, H),
            p + "self_attn.o_proj.weight": (H, q_rows),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
        if cfg.has_qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        # old Llama exports carry the RoPE buffer: shape-checked when present, recomputed, never read
        shapes[p + "self_attn.rotary_emb.inv_freq"] = (hd // 2,)
    optional = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(cfg.num_hidden_layers)}
    shapes["lm_head.weight"] = (V, H)
    if cfg.tie_word_embeddings:
        optional.add("lm_head.weight")  # tied: the embedding is the head; a saved copy is harmless
    notes = {"model.embed_tokens.weight": f"[vocab_size, hidden_size] from {cfg.source}"}
    return ExpectedTensors(shapes, optional, notes)


# ---------------------------------------------------------------- model
class TargetModel:
    """Attributes: config (TargetConfig), checkpoint (Checkpoint), ops (Ops), dtype ("f32" |
    "bf16"), valid_vocab (int).

    `valid_vocab` is the hook for padded vocabularies: config.vocab_size may exceed the
    tokenizer's size (Qwen3: 151936 vs 151669). The model never masks by itself — logits keep
    all vocab_size columns. The decode layer, which knows the tokenizer, sets
    `target.valid_vocab = len(tokenizer)` and calls `target.mask_padded(logits)` (also for
    draft logits computed with `target.lm_head`) so that padded ids are never emitted."""

    kv_dtype = "f32"  # the KV cache's element type, "f32" | "bf16" (numerics.KV_DTYPES); api.load_target sets it

    def __init__(self, config: TargetConfig, checkpoint: Checkpoint, ops: Ops, dtype: str = "f32"):
        if dtype not in DTYPE_MODES:
            raise GenerationArgumentError(f"dtype {dtype!r}; expected one of: {', '.join(DTYPE_MODES)}")
        self.config, self.checkpoint, self.ops, self.dtype = config, checkpoint, ops, dtype
        self.bf16 = dtype == "bf16"
        self.rope = RopeTables(config.head_dim, config.rope_theta, self.bf16,
                               getattr(config, "rope_scaling", None))  # cos/sin by position (YaRN where a family has it)
        self.valid_vocab = config.vocab_size
        checkpoint.require(self.expected_tensors(config))
        c, get, w = config, checkpoint.get, ops.prepare_weight

        self.embed_table = checkpoint.rows_table("model.embed_tokens.weight")  # [V, H] stays uint16: rows on demand
        self.norm_w = as_f32(get("model.norm.weight"))  # [H]
        head = getattr(ops, "prepare_head", None) or w  # quantized like the rest unless kept as stored (CPU)
        if c.tie_word_embeddings:  # HF ties lm_head to the embedding even if a copy is stored
            self.lm_head_w = head(self.embed_table)  # [V, H]
        else:
            self.lm_head_w = head(get("lm_head.weight"))  # [V, H]
        # per layer: 0 = full causal attention, W = causal sliding window of W positions
        self.layer_windows = [int(w or 0) for w in (c.layer_window or (None,) * c.num_hidden_layers)]
        self.layers, progress = [], LoadProgress(checkpoint, c.num_hidden_layers)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = {
                "ln1": as_f32(get(p + "input_layernorm.weight")),  # [H]
                "ln2": as_f32(get(p + "post_attention_layernorm.weight")),  # [H]
                **{n: w(get(p + f"self_attn.{n}_proj.weight")) for n in ("q", "k", "v", "o")},
                **self._load_mlp(i, p + "mlp."),
            }
            if c.has_qk_norm:
                layer["q_norm"] = as_f32(get(p + "self_attn.q_norm.weight"))  # [hd]
                layer["k_norm"] = as_f32(get(p + "self_attn.k_norm.weight"))  # [hd]
            self.layers.append(layer)
            progress.layer_done(i)
        self._fused_layers = self._fuse_layers()

    def _load_mlp(self, i: int, p: str) -> dict:
        """Layer i's MLP weights (names under p = 'model.layers.{i}.mlp.'): the dense SwiGLU here;
        the MoE families return their experts instead (families/qwen3_moe.py)."""
        get, w = self.checkpoint.get, self.ops.prepare_weight
        return {n: w(get(p + f"{n}_proj.weight")) for n in ("gate", "up", "down")}

    def _mlp_block(self, i: int, layer: dict, m: np.ndarray, linear) -> np.ndarray:
        """Layer i's MLP on the normed m [n, H] -> [n, H], op by op with `linear`."""
        return mlp(m, layer["gate"], layer["up"], layer["down"], linear, self.bf16, self.ops.swiglu)

    # ------------------------------------------------------------------ the fused engine
    fused = True  # False: every layer runs op by op (the reference the fused engine is tested against)

    def _fuse_layers(self) -> list | None:
        """Per layer, the argument tuples of kernels/fused.decoder_layer (weights, norms, conv),
        or None where the fused engine does not apply: not the numba CPU device, or weights the
        GEMV does not read (fused.can_fuse). Subclasses with their own layers (Muse-Glimmer)
        override `_layer` and never reach it."""
        if self.ops.device != "cpu":
            return None
        out = [self._fuse_layer(i, L) for i, L in enumerate(self.layers)]
        return None if any(args is None for args in out) else out

    def _fuse_layer(self, i: int, L: dict):
        """(weights, norms, conv) of fused.decoder_layer for layer i, or None if it cannot fuse;
        sets `_fused_shape` (the same in every layer)."""
        if not fused.can_fuse(1, tuple(L[n] for n in ("q", "k", "v", "o", "gate", "up", "down"))):
            return None
        c, no_norm = self.config, np.empty(0, np.float32)
        weights, offsets = fused.fuse_weights(L)
        norms = (L["ln1"], L["ln2"], L.get("q_norm", no_norm), L.get("k_norm", no_norm))
        self._fused_shape = fused.layer_args(c.num_attention_heads, c.num_key_value_heads, c.head_dim, offsets)
        return weights, norms, fused.NO_CONV

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: str = "f32", quantize: str | None = None,
             keep_head: bool = False) -> "TargetModel":
        """Read config.json + safetensors (single or sharded), validate the tensor inventory
        (MissingTensorsError / UnexpectedTensorsError / TensorShapeError), pick the kernels."""
        path, raw = read_config_json(model_dir)
        config = cls.resolve_config(raw, str(path))
        return cls(config, open_checkpoint(model_dir), get_ops(device, quantize, keep_head), dtype)

    quantizable = True  # --quantize q8_0 / q4_0 applies (every linear weight goes through ops.prepare_weight)

    # the family's config resolver and tensor inventory (a family built on this model overrides both)
    resolve_config = staticmethod(resolve_target_config)
    expected_tensors = staticmethod(expected_target_tensors)

    # ------------------------------------------------------------------ pieces (also used by drafts)
    def new_cache(self, max_len: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len,
                       zeros=getattr(self.ops, "zeros", np.zeros), dtype=KV_DTYPES[self.kv_dtype])

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids [n] -> [n, H] f32 (bf16 embeddings are exact in f32)."""
        return embedding(self.embed_table, ids)

    def final_norm(self, h: np.ndarray) -> np.ndarray:
        """[n, H] -> [n, H] through model.norm."""
        return self.ops.rms_norm(h, self.norm_w, self.config.rms_norm_eps, self.bf16)

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """ALREADY-NORMED states [n, H] -> logits [n, V] f32 (all vocab_size columns)."""
        return rnd_if(self.ops.linear(h, self.lm_head_w), self.bf16)

    # the two steps a family may change without touching what drafts see (embed / lm_head)
    def embed_input(self, ids: np.ndarray) -> np.ndarray:
        """The target's own input embedding, ids [n] -> [n, H] (Qwen3 / Llama: the raw rows)."""
        return self.embed(ids)

    def logits(self, h_normed: np.ndarray) -> np.ndarray:
        """Final-normed states [n, H] -> the target's own logits [n, V] (Qwen3 / Llama: lm_head)."""
        return self.lm_head(h_normed)

    def mask_padded(self, logits: np.ndarray) -> np.ndarray:
        """Set columns >= valid_vocab to -inf, in place; returns logits [n, V]."""
        if self.valid_vocab < logits.shape[-1]:
            logits[..., self.valid_vocab :] = -np.inf
        return logits

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        ids: np.ndarray,
        cache: KVCache,
        tap_layers: Sequence[int] = (),
        last_only: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [n] int64 at positions cache.length.. -> (logits [n, V] f32 ([1, V] with
        last_only: only the last row goes through the head), taps [n, len(tap_layers)*H] f32
        or None). Appends K/V of the n positions to the cache."""
        c = self.config
        ids = forward_ids(ids, tap_layers, c.num_hidden_layers, type(self).__name__)  # [n]
        n, H = ids.shape[0], c.hidden_size
        start = cache.length
        cache.reserve(n)
        q_pos = np.arange(start, start + n, dtype=np.int64)  # [n]
        k_pos = np.arange(start + n, dtype=np.int64)  # [T] keys: cache ++ this block
        cos, sin = self.rope.span(start, n)  # [n, hd] each

        h = self.embed_input(ids)  # [n, H]
        taps = np.empty((n, len(tap_layers) * H), dtype=np.float32) if len(tap_layers) else None
        at = tap_columns(tap_layers, H)  # {layer: its columns of taps}
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, cache, start, q_pos, k_pos, cos, sin)
            for cols in at.get(i, ()):  # residual stream AFTER layer i = HF hidden_states[i+1]
                taps[:, cols] = h
        cache.length = start + n
        if last_only:
            h = h[-1:]
        return self.logits(self.final_norm(h)), taps

    def _layer(self, i, layer, h, cache, start, q_pos, k_pos, cos, sin):
        """One decoder layer on h [n, H] at positions q_pos; writes K/V i of the cache."""
        c, bf16 = self.config, self.bf16
        if self.fused and self._fused_layers is not None and fused.can_fuse(h.shape[0]):
            h = np.ascontiguousarray(h, dtype=np.float32)  # updated in place by the fused layer
            fused.decoder_layer(h, *self._fused_layers[i], cache.k[i], cache.v[i], start, q_pos, k_pos,
                                cos, sin, self._fused_shape, True, self.layer_windows[i],
                                np.float32(c.rms_norm_eps), bf16, fused.parallel_min_macs())
            return h
        return self._layer_ops(i, layer, h, cos, sin, [Span(cache, start, q_pos, k_pos, slice(0, h.shape[0]))],
                               self.ops.linear)

    def _layer_ops(self, i, layer, h, cos, sin, spans, linear):
        """One decoder layer op by op on h [n, H] (cos / sin [n, hd] of its rows): products over
        all n rows with `linear`, attention per span (a request's rows against its own cache;
        writes K/V i there). The solo forward passes one span; models/batched.py several."""
        c, bf16, ops = self.config, self.bf16, self.ops
        n, nh, nkv, hd, eps = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps

        a = ops.rms_norm(h, layer["ln1"], eps, bf16)  # [n, H]
        q = rnd_if(linear(a, layer["q"]), bf16).reshape(n, nh, hd)  # [n, nh, hd]
        k = rnd_if(linear(a, layer["k"]), bf16).reshape(n, nkv, hd)  # [n, nkv, hd]
        v = rnd_if(linear(a, layer["v"]), bf16).reshape(n, nkv, hd)  # [n, nkv, hd]
        if c.has_qk_norm:  # Qwen3: RMSNorm over each head's hd features, before RoPE
            q = ops.rms_norm(q, layer["q_norm"], eps, bf16)
            k = ops.rms_norm(k, layer["k_norm"], eps, bf16)
        q = ops.apply_rope(q, cos, sin, bf16)
        k = ops.apply_rope(k, cos, sin, bf16)

        o = np.empty((n, nh, hd), np.float32) if len(spans) > 1 else None  # [n, nh, hd]
        for sp in spans:
            cache, start, rows = sp.cache, sp.start, sp.rows
            end = start + (rows.stop - rows.start)
            cache.write(i, start, k[rows], v[rows])  # [nkv, n_r, hd] at start..end-1
            # keys = rows 0..end-1 (= k_pos) of the layer's whole [nkv, max_len, hd] buffer
            o_r = self.ops.attention(q[rows], cache.k[i], cache.v[i], sp.q_pos, sp.k_pos, True,
                                     self.layer_windows[i], bf16)  # [n_r, nh, hd]
            if o is None:
                o = o_r
            else:
                o[rows] = o_r
        o = rnd_if(o, bf16).reshape(n, nh * hd)  # [n, nh*hd]
        h = rnd_if(h + rnd_if(linear(o, layer["o"]), bf16), bf16)  # [n, H]

        m = ops.rms_norm(h, layer["ln2"], eps, bf16)  # [n, H]
        return rnd_if(h + self._mlp_block(i, layer, m, linear), bf16)
