"""DFlash v1 block-diffusion draft (spec §2.2, §3); DFlash2 builds on it (models/dflash2.py).

    draft = load_draft(draft_dir, target)           # DFlashDraft or DFlash2Draft, by config.json
    state = draft.new_state(max_len)                # the context K/V cache (a target KVCache)
    draft.extend_context(state, taps, start, ids)   # committed tokens start.. -> context K/V
    prop  = draft.propose(state, anchor, p, Q, sampling, rng)   # Q-1 draft tokens (decode/drafter.py)
    h     = draft.block_forward([state], [anchor], [p], Q)      # final-normed block states [Q, H]

Context (once per committed token t, cached): c_t = RMSNorm_hidden_norm(fc(taps_t)); per layer
K_t = RoPE_t(k_norm(W_k c_t)), V_t = W_v c_t. No input_layernorm; every layer reads the same c_t.

Block: rows [anchor, mask * (Q-1)] at positions p..p+Q-1, embedded with the TARGET embedding.
Each layer is a pre-norm Qwen3 layer whose keys/values are [context K/V at positions < p] ++
[block K/V]; a key at s is visible from a query at q in full layers or when |q-s| <= W-1
(symmetric sliding window), and in causal layers only if also s <= q. Output: RMSNorm_norm(h);
the target's lm_head on the mask rows 1..Q-1 only. Block K/V never persist. A draft window N
(`draft_window`, per request) hides context keys older than p - N as well.

`block_forward` takes several requests at once (rows laid end to end, Q per request: the layout
of spec §4.2) so that weights are read once per batch; `propose` uses one request.

Run modes follow the target: dtype "f32" computes in f32 from bf16 weights; "bf16" rounds every
op boundary as eager PyTorch does (models/layers.py). Kernels come from the target's `ops`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checkpoint import Checkpoint, open_checkpoint
from ..config import DraftConfig, check_pairing, load_draft_config
from ..inventory import expected_draft_tensors
from ..decode.drafter import LazyInfo, Proposal, valid_vocab
from ..decode.sampling import SamplingParams, mask_padded, sample_token, target_probs
from ..errors import GenerationArgumentError
from ..kernels import fused
from ..numerics import KV_DTYPES, as_f32
from .layers import RopeTables, in_row_chunks, mlp, rnd_if
from .selector import _top_k_rows
from .base import KVCache

N_SLOT_CANDIDATES = 8  # candidates per mask slot listed in Proposal.info["slots"] (v1)


def first_key(state, p: int) -> int:
    """The first context row a block at p attends to: p - N under a draft window N (the state's
    `draft_window`, set per request by decode/step.py; keys older than the last N context
    positions are masked), else 0. The block's own rows are always visible."""
    n = getattr(state, "draft_window", 0)
    return max(0, p - n) if n else 0


class DFlashDraft:
    """DFlash v1. Attributes: config (DraftConfig), checkpoint, target, ops, dtype, bf16, layers.

    Drafter protocol (decode/drafter.py): kind, block_size, target_layer_ids, mask_token_id,
    new_state, extend_context, propose."""

    kind = "dflash"

    def __init__(self, config: DraftConfig, checkpoint: Checkpoint, target, ops=None):
        self.config, self.checkpoint, self.target = config, checkpoint, target
        self.ops = ops or target.ops  # one device switch for the pair (ops: another weight format)
        self.dtype, self.bf16 = target.dtype, target.dtype == "bf16"
        self.rope = RopeTables(config.head_dim, config.rope_theta, self.bf16, config.rope_scaling)  # cos/sin by position
        self.block_size = config.block_size
        self.target_layer_ids = list(config.target_layer_ids)
        self.mask_token_id = config.mask_token_id
        check_pairing(config, target.config)
        if hasattr(target, "check_draft_pairing"):  # family-specific agreement (e.g. Muse-Glimmer)
            target.check_draft_pairing(config)
        self._validate_inventory()
        self.mask_embedding = target.embed(np.array([config.mask_token_id]))[0]  # [H] f32
        get, w = checkpoint.get, self.ops.prepare_weight
        fc_name, ctx_norm_name = config.context_tensor_names  # fc / hidden_norm (Muse: encoder.*)
        self.fc = w(get(fc_name))  # [H, n_taps*H]
        self.hidden_norm = as_f32(get(ctx_norm_name))  # [H]
        self.norm = as_f32(get("norm.weight"))  # [H]
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}."
            self.layers.append({
                "ln1": as_f32(get(p + "input_layernorm.weight")),  # [H]
                "ln2": as_f32(get(p + "post_attention_layernorm.weight")),  # [H]
                "q_norm": as_f32(get(p + "self_attn.q_norm.weight")),  # [hd]
                "k_norm": as_f32(get(p + "self_attn.k_norm.weight")),  # [hd]
                **{n: w(get(p + f"self_attn.{n}_proj.weight")) for n in ("q", "k", "v", "o")},
                **{n: w(get(p + f"mlp.{n}_proj.weight")) for n in ("gate", "up", "down")},
                **({n + "_b": as_f32(get(p + f"self_attn.{n}_proj.bias")) for n in ("q", "k", "v", "o")}
                   if config.attention_bias else {}),  # [out] each
                "causal": config.layer_causal[i],
                "window": config.layer_window[i] or 0,  # 0 = full attention
            })

    def _validate_inventory(self) -> None:
        """Every tensor present with its shape, nothing unknown (names them otherwise)."""
        self.checkpoint.require(expected_draft_tensors(self.config, self.target.config.vocab_size))

    # ------------------------------------------------------------------ context
    def new_state(self, max_len: int) -> KVCache:
        """Context K/V of positions 0..length-1 per draft layer, with room for a block past them."""
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len + c.block_size,
                       zeros=getattr(self.ops, "zeros", np.zeros), dtype=KV_DTYPES[self.target.kv_dtype])

    def extend_context(self, state: KVCache, taps, start_pos: int, token_ids) -> None:
        """Append context K/V of committed tokens start_pos..start_pos+n-1 from their target taps
        [n, n_taps*H] (token ids are not needed: the draft reads only taps)."""
        self.extend_contexts([state], [taps], [start_pos], [token_ids])

    def extend_contexts(self, states, taps_list, starts, ids_list) -> None:
        """extend_context of several requests at once. Updates of at most 32 rows (a step's
        accepted tokens) are stacked: every product runs over all their rows in chunks of <= 32
        (layers.in_row_chunks), so each gets the bits of its own fused update. A longer one (a
        prompt's taps) runs on its own, exactly as alone."""
        c = self.config
        items = []  # (state, taps [n, n_taps*H] f32, start_pos, n)
        for state, taps, start_pos, token_ids in zip(states, taps_list, starts, ids_list):
            n = len(token_ids)
            if start_pos != state.length:
                raise GenerationArgumentError(
                    f"extend_context: start_pos {start_pos}, but the draft context holds 0..{state.length - 1}")
            if n == 0:
                continue
            if taps is None or taps.shape != (n, c.n_taps * c.hidden_size):
                got = None if taps is None else list(taps.shape)
                raise GenerationArgumentError(
                    f"extend_context: taps {got}, expected [{n}, {c.n_taps} * {c.hidden_size}] "
                    f"for target_layer_ids {c.target_layer_ids}")
            state.reserve(n + c.block_size)
            items.append((state, np.ascontiguousarray(taps, dtype=np.float32), int(start_pos), n))
        stackable = self._fusable() and len(items) > 1
        fits = [stackable and fused.can_fuse(it[3], (self.fc,)) for it in items]
        for it, fit in zip(items, fits):
            if not fit:
                self._context_update([it], self.ops.linear)
        stacked = [it for it, fit in zip(items, fits) if fit]
        if stacked:
            self._context_update(stacked, self._row_linear)

    def _context_update(self, items, linear) -> None:
        """Context K/V of items [(state, taps [n, T*H], start_pos, n)]: one item through the fused
        kernel when it applies, else op by op with `linear` over the stacked rows."""
        c, bf16, ops = self.config, self.bf16, self.ops
        eps, nkv, hd = c.rms_norm_eps, c.num_key_value_heads, c.head_dim
        if len(items) == 1:
            state, x, start_pos, n = items[0]
            cos, sin = self.rope.span(start_pos, n)  # [n, hd]
            if self._fusable() and fused.can_fuse(n, (self.fc,)):  # one numba call, the same bits
                fused.context_update(x, self.fc.panels, self.hidden_norm, self._ctx_weights["k"],
                                     self._ctx_weights["v"], self._ctx_weights["k_norm"], state.k, state.v,
                                     start_pos, cos, sin, nkv, hd, np.float32(eps), bf16, fused.parallel_min_macs())
                state.length = start_pos + n
                return
        else:
            x = np.concatenate([it[1] for it in items])  # [N, n_taps*H]
            cos, sin = self.rope(np.concatenate([np.arange(s, s + n) for _, _, s, n in items]))  # [N, hd]
        N = x.shape[0]
        bounds = np.cumsum([0] + [it[3] for it in items])
        ctx = ops.rms_norm(rnd_if(linear(x, self.fc), bf16), self.hidden_norm, eps, bf16)  # [N, H] c_t
        for i, L in enumerate(self.layers):
            k = self._proj(L, "k", ctx, linear).reshape(N, nkv, hd)  # [N, nkv, hd]
            k = ops.apply_rope(ops.rms_norm(k, L["k_norm"], eps, bf16), cos, sin, bf16)
            v = self._proj(L, "v", ctx, linear).reshape(N, nkv, hd)  # [N, nkv, hd]
            for (state, _, s, n), r0 in zip(items, bounds):
                state.write(i, s, k[r0:r0 + n], v[r0:r0 + n])  # [nkv, n, hd] at s..s+n-1
        for state, _, s, n in items:
            state.length = s + n

    supports_draft_window = True  # decode/step.check_draft_window: the state's draft_window is honoured

    # ------------------------------------------------------------------ block forward
    def embed_block(self, anchor_ids, n_rows) -> np.ndarray:
        """[anchor, mask*(Q_r-1)] per request through the TARGET embedding -> [sum Q_r, H] f32.
        n_rows: Q (every request) or a list of Q_r (one per request)."""
        anchors = self.target.embed(np.asarray(anchor_ids, np.int64))  # [R, H] (checks the ids)
        rows = block_rows(n_rows, anchors.shape[0])  # [R]
        h = np.empty((sum(rows), anchors.shape[1]), np.float32)  # [sum Q_r, H]
        h[:] = self.mask_embedding  # [H], the same row every step: looked up once
        h[np.cumsum([0] + rows[:-1])] = anchors  # each block's first row
        return h

    # conv call sites of DFlash2 (spec §4.1); DFlash v1 has no conv: identity
    def conv_prepare(self, layer: dict, name: str, x: np.ndarray, n_rows: int):
        return x, None

    def conv_finish(self, layer: dict, name: str, y: np.ndarray, coef, n_rows: int) -> np.ndarray:
        return y

    def block_forward(self, states, anchor_ids, anchor_positions, n_rows) -> np.ndarray:
        """R requests, one block each -> final-normed states [sum Q_r, H]. n_rows: Q for every
        request, or a list of Q_r. Request r's rows (laid end to end) sit at positions
        anchor_positions[r]..+Q_r-1 and attend to its context (states[r], holding exactly
        0..anchor_positions[r]-1) ++ its own block. Several requests run op by op with every
        product over the stacked rows in chunks of <= 32 rows (layers.in_row_chunks), so each
        request's rows get the bits of its own one-request forward."""
        c, bf16, ops = self.config, self.bf16, self.ops
        R = len(states)
        rows = block_rows(n_rows, R)  # [R]
        for Q in rows:
            if not 1 <= Q <= self.block_size:
                raise GenerationArgumentError(f"draft block of {Q} rows; expected 1..{self.block_size} (block_size)")
        for st, p, Q in zip(states, anchor_positions, rows):
            if st.length != p:
                raise GenerationArgumentError(
                    f"draft block at position {p}, but the draft context holds 0..{st.length - 1}")
            st.reserve(Q)  # scratch room for the block K/V past the context (length unchanged)
        nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        pos = np.concatenate([np.arange(p, p + Q) for p, Q in zip(anchor_positions, rows)]).astype(np.int64)
        cos, sin = self.rope.span(pos[0], rows[0]) if R == 1 else self.rope(pos)  # [sum Q_r, hd]
        N, bounds = pos.shape[0], np.cumsum([0] + rows)  # request r: rows bounds[r]..bounds[r+1]-1

        h = self.embed_block(anchor_ids, rows)  # [N, H]
        if R == 1 and self._fusable():  # one numba call per layer (kernels/fused.py): same bits
            st, p, Q = states[0], int(anchor_positions[0]), rows[0]
            shape, k_pos, pmm = self._fused_shape(Q), np.arange(p + Q), fused.parallel_min_macs()
            first = first_key(st, p)
            for i, L in enumerate(self.layers):
                fused.decoder_layer(h, L["fused_weights"], L["fused_norms"], self._fused_conv(L), st.k[i], st.v[i],
                                    p, pos, k_pos, cos, sin, shape, L["causal"], L["window"],
                                    np.float32(eps), bf16, pmm, first)
            return ops.rms_norm(h, self.norm, eps, bf16)  # [Q, H]
        linear = self._row_linear
        conv_rows = rows[0] if R == 1 else rows
        for i, L in enumerate(self.layers):
            a = ops.rms_norm(h, L["ln1"], eps, bf16)  # [N, H]
            a, k_att = self.conv_prepare(L, "attention_conv", a, conv_rows)
            q = self._proj(L, "q", a, linear).reshape(N, nh, hd)  # [N, nh, hd]
            k = self._proj(L, "k", a, linear).reshape(N, nkv, hd)  # [N, nkv, hd]
            v = self._proj(L, "v", a, linear).reshape(N, nkv, hd)
            q = ops.apply_rope(ops.rms_norm(q, L["q_norm"], eps, bf16), cos, sin, bf16)
            k = ops.apply_rope(ops.rms_norm(k, L["k_norm"], eps, bf16), cos, sin, bf16)
            o = np.empty((N, nh, hd), np.float32)  # [N, nh, hd]
            for r, st in enumerate(states):
                blk, p, Q = slice(bounds[r], bounds[r + 1]), st.length, rows[r]
                # block K/V written just past the context, length NOT bumped: nothing persists
                st.write(i, p, k[blk], v[blk])  # [nkv, Q, hd] at p..p+Q-1
                o[blk] = self.ops.attention(q[blk], st.k[i], st.v[i], pos[blk], np.arange(p + Q), L["causal"],
                                            L["window"], bf16, first=first_key(st, p))  # keys: rows first..p+Q-1
            o = self._proj(L, "o", rnd_if(o, bf16).reshape(N, nh * hd), linear)  # [N, H]
            h = rnd_if(h + self.conv_finish(L, "attention_conv", o, k_att, conv_rows), bf16)

            m = ops.rms_norm(h, L["ln2"], eps, bf16)  # [N, H]
            m, k_mlp = self.conv_prepare(L, "mlp_conv", m, conv_rows)
            y = mlp(m, L["gate"], L["up"], L["down"], linear, bf16, ops.swiglu)  # [N, H]
            h = rnd_if(h + self.conv_finish(L, "mlp_conv", y, k_mlp, conv_rows), bf16)
        return ops.rms_norm(h, self.norm, eps, bf16)  # [N, H]

    def _proj(self, L: dict, name: str, x: np.ndarray, linear) -> np.ndarray:
        """Projection `name` of layer L on x [N, in] -> [N, out], plus its bias when the config
        has attention_bias (rounded once, as torch's addmm)."""
        y = linear(x, L[name])
        if name + "_b" in L:
            y = y + L[name + "_b"]
        return rnd_if(y, self.bf16)

    def _row_linear(self, x: np.ndarray, w) -> np.ndarray:
        """ops.linear over chunks of <= 32 rows: each row's bits whatever is stacked with it."""
        return in_row_chunks(lambda rows: self.ops.linear(rows, w), x)

    # ------------------------------------------------------------------ the fused engine
    fused = True  # False: op by op (the reference the fused engine is tested against)

    def _fusable(self) -> bool:
        """The fused layer applies on the numba CPU device when every layer's weights are ones
        the GEMV reads (checked once; fused.can_fuse)."""
        if not self.fused or self.ops.device != "cpu" or self.config.attention_bias:
            return False  # the fused layer has no bias path
        if not hasattr(self, "_fused_ok"):
            self._fused_ok = True
            for L in self.layers:
                weights = tuple(L[n] for n in ("q", "k", "v", "o", "gate", "up", "down"))
                self._fused_ok &= fused.can_fuse(1, weights + self._conv_weights(L))
            for L in self.layers if self._fused_ok else ():
                L["fused_weights"], self._fused_offsets = fused.fuse_weights(L)  # same offsets per layer
                L["fused_norms"] = (L["ln1"], L["ln2"], L["q_norm"], L["k_norm"])
            self._ctx_weights = {"k": tuple(L["k"].panels for L in self.layers) if self._fused_ok else (),
                                 "v": tuple(L["v"].panels for L in self.layers) if self._fused_ok else (),
                                 "k_norm": tuple(L["k_norm"] for L in self.layers)}
        return self._fused_ok

    def _conv_weights(self, layer: dict) -> tuple:
        """The conv projections a fused layer reads (DFlash v1: none)."""
        return ()

    def _fused_conv(self, layer: dict) -> tuple:
        """The conv tuple of fused.decoder_layer: DFlash v1 has none."""
        return fused.NO_CONV

    def _fused_shape(self, n_rows: int) -> tuple:
        c = self.config
        return fused.layer_args(c.num_attention_heads, c.num_key_value_heads, c.head_dim, self._fused_offsets)

    # ------------------------------------------------------------------ proposing
    def _check_propose(self, n_rows: int) -> None:
        if not 2 <= n_rows <= self.block_size:
            raise GenerationArgumentError(
                f"propose: n_rows {n_rows}; expected 2..{self.block_size} (anchor + at least one mask row)")

    def propose(self, state: KVCache, anchor_id: int, anchor_pos: int, n_rows: int,
                sampling: SamplingParams, rng: np.random.Generator) -> Proposal:
        """Block forward, the target's lm_head on the mask rows, then `proposal_from`."""
        self._check_propose(n_rows)
        h = self.block_forward([state], [anchor_id], [anchor_pos], n_rows)[1:]  # [Q-1, H] mask rows
        return self.proposal_from(h, self.target.lm_head(h), anchor_id, anchor_pos, sampling, rng)

    def proposal_from(self, h: np.ndarray, z: np.ndarray, anchor_id: int, anchor_pos: int,
                      sampling: SamplingParams, rng: np.random.Generator) -> Proposal:
        """The drafts of one block from its mask rows' final-normed states h [Q-1, H] and their
        raw lm_head logits z [Q-1, V] (the batched proposal computes those for many blocks at once).
        v1: per mask slot the argmax of z (ties -> lowest id) when greedy, else a draw from
        q = target_probs(z, sampling) (the same temperature / top-k / top-p as the verifier),
        and q is returned so that verification stays lossless."""
        z = mask_padded(z, valid_vocab(self.target))  # [Q-1, V], padding -inf
        if sampling.greedy:
            draft_ids, q = np.argmax(z, axis=-1).astype(np.int64), None  # first max = lowest id
            m = z.max(axis=-1, keepdims=True)  # [Q-1, 1]
            conf = 1.0 / np.exp(z - m).sum(axis=-1)  # softmax(z) at the argmax
        else:
            q = np.stack([target_probs(row, sampling) for row in z]).astype(np.float32)  # [Q-1, V]
            draft_ids = np.array([sample_token(row, rng) for row in q], np.int64)  # drawn from q itself
            conf = q.max(axis=-1)  # of the distribution, not of the drawn token
        return Proposal(draft_ids, q, LazyInfo(lambda: {"slots": top_candidates(z, N_SLOT_CANDIDATES)}), conf)


def block_rows(n_rows, n_requests: int) -> list[int]:
    """Rows per request's block: one Q for all, or a list of Q_r (checked against R)."""
    if isinstance(n_rows, (int, np.integer)):
        return [int(n_rows)] * n_requests
    rows = [int(q) for q in n_rows]
    if len(rows) != n_requests:
        raise GenerationArgumentError(f"draft blocks: {len(rows)} row counts for {n_requests} requests")
    return rows


def top_candidates(z: np.ndarray, n: int) -> list[dict]:
    """Per row of z [k, V]: the n best ids by logit (descending, ties by ascending id; NaN last)."""
    z = np.ascontiguousarray(z, dtype=np.float32)
    n = min(n, z.shape[-1])
    ids = np.empty((z.shape[0], n), np.int64)  # [k, n]
    vals = np.empty((z.shape[0], n), np.float32)  # [k, n]
    _top_k_rows(z, z.shape[-1], ids, vals)
    return [{"candidate_ids": i.tolist(), "candidate_scores": z[l, i].tolist()} for l, i in enumerate(ids)]


def load_draft(draft_dir, target, kind: str | None = None, ops=None):
    """A DFlash (v1) or DFlash2 draft directory paired with a loaded TargetModel. `kind` is
    decided by config.json architectures[0] (api.draft_kind); given here only to cross-check."""
    draft_dir = Path(draft_dir)
    config = load_draft_config(draft_dir, target.config)
    if kind is not None and kind != config.kind:
        raise GenerationArgumentError(f"{config.source}: draft kind {config.kind!r}, caller expected {kind!r}")
    checkpoint = open_checkpoint(draft_dir)
    if config.kind == "dflash2":
        from .dflash2 import DFlash2Draft  # the subclass imports this module

        return DFlash2Draft(config, checkpoint, target, ops)
    return DFlashDraft(config, checkpoint, target, ops)
