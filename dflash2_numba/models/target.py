"""Qwen3 / Llama target model over a croppable KV cache, with hidden taps (spec §2.1, §5).

    target = TargetModel.load(model_dir, device="cpu", dtype="f32")
    cache  = target.new_cache(max_len)
    logits, taps = target.forward(ids, cache, tap_layers=(1, 3))   # prefill / verify / decode
    cache.commit(n)                                                # keep positions 0..n-1

`forward` runs `ids` at positions cache.length .. cache.length+n-1, appends their K/V and
returns logits for every row (row i predicts position cache.length+i+1) and, if asked, the
residual stream after each layer in `tap_layers` (HF `hidden_states[l+1]`), concatenated.

Layer (pre-norm): h += o_proj(attn(rms(h))); h += down(silu(gate(m)) * up(m)), m = rms(h).
Qwen3 applies q_norm / k_norm per head before RoPE; Llama has neither.

Sliding-window layers (Qwen3 `use_sliding_window` / `layer_types`, resolved in config.py as
transformers does): query t sees key s iff 0 <= t - s < W, i.e. the attention kernel's
`causal=True, window=W`. The cache keeps every position (commit stays a length change); the
window only masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..config import TargetConfig, load_target_config
from ..inventory import expected_target_tensors
from ..errors import GenerationArgumentError
from ..kernels import fused
from ..kernels.backend import Ops, get_ops
from ..numerics import DTYPE_MODES, as_f32
from .layers import RopeTables, embedding, mlp, rnd_if


class KVCache:
    """Per-layer keys/values of positions 0..length-1: k, v [L, nkv, max_len, hd] f32.

    Positions >= length are scratch: `forward` writes there, then bumps `length`; `commit(n)`
    just lowers `length` (rejected drafts are overwritten by the next forward). The buffer
    doubles when a forward would run past max_len.

    `zeros` allocates the buffers: `np.zeros` on the CPU, `ops.zeros` (a device-resident
    DeviceBuffer) on CUDA, so the cache stays on the GPU across steps without a model fork."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int = 256,
                 zeros=np.zeros):
        shape = (num_layers, num_kv_heads, max(1, int(max_len)), head_dim)
        self.zeros = zeros
        self.k = zeros(shape, dtype=np.float32)
        self.v = zeros(shape, dtype=np.float32)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for n more positions (copies into a bigger buffer if needed)."""
        need = self.length + n
        if need <= self.max_len:
            return
        new_len = max(need, 2 * self.max_len)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self.zeros(old.shape[:2] + (new_len,) + old.shape[3:], dtype=np.float32)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def commit(self, n: int) -> None:
        """Keep positions 0..n-1 (n <= length): after a verify forward, n = the anchor's position
        + accepted rows + 1. The one call the decode loop makes on a target cache of any layer
        kind; a KV cache just lowers `length` (rejected rows are overwritten next time)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"{type(self).__name__}.commit({n}): cache holds {self.length} positions")
        self.length = int(n)


class TargetModel:
    """Attributes: config (TargetConfig), checkpoint (Checkpoint), ops (Ops), dtype ("f32" |
    "bf16"), valid_vocab (int).

    `valid_vocab` is the hook for padded vocabularies: config.vocab_size may exceed the
    tokenizer's size (Qwen3: 151936 vs 151669). The model never masks by itself — logits keep
    all vocab_size columns. The decode layer, which knows the tokenizer, sets
    `target.valid_vocab = len(tokenizer)` and calls `target.mask_padded(logits)` (also for
    draft logits computed with `target.lm_head`) so that padded ids are never emitted."""

    def __init__(self, config: TargetConfig, checkpoint: Checkpoint, ops: Ops, dtype: str = "f32"):
        if dtype not in DTYPE_MODES:
            raise GenerationArgumentError(f"dtype {dtype!r}; expected one of: {', '.join(DTYPE_MODES)}")
        self.config, self.checkpoint, self.ops, self.dtype = config, checkpoint, ops, dtype
        self.bf16 = dtype == "bf16"
        self.rope = RopeTables(config.head_dim, config.rope_theta, self.bf16)  # cos/sin by position
        self.valid_vocab = config.vocab_size
        checkpoint.require(expected_target_tensors(config))
        c, get, w = config, checkpoint.get, ops.prepare_weight

        self.embed_table = get("model.embed_tokens.weight")  # [V, H] stays uint16: rows on demand
        self.norm_w = as_f32(get("model.norm.weight"))  # [H]
        head = getattr(ops, "prepare_head", None) or w  # quantized like the rest unless kept as stored (CPU)
        if c.tie_word_embeddings:  # HF ties lm_head to the embedding even if a copy is stored
            self.lm_head_w = head(self.embed_table)  # [V, H]
        else:
            self.lm_head_w = head(get("lm_head.weight"))  # [V, H]
        # per layer: 0 = full causal attention, W = causal sliding window of W positions
        self.layer_windows = [int(w or 0) for w in (c.layer_window or (None,) * c.num_hidden_layers)]
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = {
                "ln1": as_f32(get(p + "input_layernorm.weight")),  # [H]
                "ln2": as_f32(get(p + "post_attention_layernorm.weight")),  # [H]
                **{n: w(get(p + f"self_attn.{n}_proj.weight")) for n in ("q", "k", "v", "o")},
                **{n: w(get(p + f"mlp.{n}_proj.weight")) for n in ("gate", "up", "down")},
            }
            if c.has_qk_norm:
                layer["q_norm"] = as_f32(get(p + "self_attn.q_norm.weight"))  # [hd]
                layer["k_norm"] = as_f32(get(p + "self_attn.k_norm.weight"))  # [hd]
            self.layers.append(layer)
        self._fused_layers = self._fuse_layers()

    # ------------------------------------------------------------------ the fused engine
    fused = True  # False: every layer runs op by op (the reference the fused engine is tested against)

    def _fuse_layers(self) -> list | None:
        """Per layer, the argument tuples of kernels/fused.decoder_layer (weights, norms, conv),
        or None where the fused engine does not apply: not the numba CPU device, or weights the
        GEMV does not read (fused.can_fuse). Subclasses with their own layers (Muse-Glimmer)
        override `_layer` and never reach it."""
        if self.ops.device != "cpu":
            return None
        c, out = self.config, []
        no_norm = np.empty(0, np.float32)
        if not all(fused.can_fuse(1, tuple(L[n] for n in ("q", "k", "v", "o", "gate", "up", "down")))
                   for L in self.layers):
            return None
        for L in self.layers:
            weights, offsets = fused.fuse_weights(L)  # the same offsets in every layer
            norms = (L["ln1"], L["ln2"], L.get("q_norm", no_norm), L.get("k_norm", no_norm))
            out.append((weights, norms, fused.NO_CONV))
        self._fused_shape = fused.layer_args(c.num_attention_heads, c.num_key_value_heads, c.head_dim, offsets)
        return out

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: str = "f32", quantize: str | None = None,
             keep_head: bool = False) -> "TargetModel":
        """Read config.json + safetensors (single or sharded), validate the tensor inventory
        (MissingTensorsError / UnexpectedTensorsError / TensorShapeError), pick the kernels."""
        config = load_target_config(model_dir)
        return cls(config, open_checkpoint(model_dir), get_ops(device, quantize, keep_head), dtype)

    # ------------------------------------------------------------------ pieces (also used by drafts)
    def new_cache(self, max_len: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len,
                       zeros=getattr(self.ops, "zeros", np.zeros))

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
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, cache, start, q_pos, k_pos, cos, sin)
            for j, l in enumerate(tap_layers):
                if l == i:  # residual stream AFTER layer i = HF hidden_states[i+1]
                    taps[:, j * H : (j + 1) * H] = h
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
            cache.k[i, :, start:end] = k[rows].transpose(1, 0, 2)  # [nkv, n_r, hd]
            cache.v[i, :, start:end] = v[rows].transpose(1, 0, 2)
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
        return rnd_if(h + mlp(m, layer["gate"], layer["up"], layer["down"], linear, bf16, ops.swiglu), bf16)


@dataclass(frozen=True)
class Span:
    """One request's rows of a forward: rows `rows` of h sit at positions q_pos [n_r]
    (cache.length = start ..) and attend to keys k_pos [start + n_r] of its own cache."""
    cache: object
    start: int
    q_pos: np.ndarray
    k_pos: np.ndarray
    rows: slice


def forward_ids(ids, tap_layers: Sequence[int], num_layers: int, who: str) -> np.ndarray:
    """The checks every target's forward makes: ids -> int64 [n] (n >= 1), tap layers in range."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [n]
    if ids.shape[0] == 0:
        raise GenerationArgumentError(f"{who}.forward: no token ids given")
    for l in tap_layers:
        if not 0 <= l < num_layers:
            raise GenerationArgumentError(f"tap layer {l} outside 0..{num_layers - 1}")
    return ids

