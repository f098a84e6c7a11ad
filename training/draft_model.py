"""DFlash v1 and DFlash2 drafts in torch, written literally from spec §3 and §4.

The project's numpy decoder must reproduce this forward, so it follows the spec line by line
rather than any upstream implementation:

    context   c_t = RMSNorm_hidden_norm(fc(taps_t));  per layer Kc = RoPE_t(k_norm(W_k c_t)),
              Vc = W_v c_t  (no input_layernorm on the context; every layer reads the same c_t)
    block     rows j = 0..Q-1 at positions p+j, ids [anchor, mask * (Q-1)], embedded with the
              TARGET's embedding times input_embedding_scale
    layer     a = rms_in(h); (DFlash2: a, k_att = attention_conv.prepare(a))
              q/k/v of the block from a, q_norm/k_norm, RoPE at the row position
              attend over [context K/V at positions < p] ++ [the block's own K/V], non-causal
              h += o_proj(attn)          (DFlash2: finish(o_proj(attn), k_att))
              m = rms_post(h); (DFlash2: m, k_mlp = mlp_conv.prepare(m))
              h += down(silu(gate m) * up m)   (DFlash2: finish(mlp(m), k_mlp))
    output    RMSNorm_norm(h); the target lm_head on mask rows 1..Q-1

Batched layout: `B` sequences, each with `m` blocks of `Q` rows. The conv sees the block rows
flattened to [B*m*Q, H] — blocks of length Q laid end to end, exactly the §4.2 row layout.
Parameter names equal the spec §2.2 tensor names (no `model.` prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dflash2_numba.config import DecoderDims


@dataclass(frozen=True)
class DraftSpec(DecoderDims):
    """The draft to train: the package's DecoderDims (hidden_size .. rms_norm_eps) and then the
    draft's own keys, named as in its config.json."""
    kind: str  # "dflash" | "dflash2"
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    vocab_size: int
    n_real_vocab: int  # ids >= this are padding: -inf logits, never candidates
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 16
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)


# ---------------------------------------------------------------- primitives
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm in f32: w * (x * rsqrt(mean(x^2) + eps))."""
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """NeoX rotate-half tables: inv_freq_i = theta^(-2i/hd); -> cos, sin [..., hd]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def dynamic_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, Q: int, S: int) -> torch.Tensor:
    """spec §4.2. x [N, H] (blocks of Q rows end to end), delta [N, taps, G], base [taps, H].

    out[n,c] = coef[n,0,c]*x[n,c] + sum_{t>=1} [pos(n) >= t] * coef[n,t,c]*x[n-t,c],
    coef[n,t,c] = base[t,c] + delta[n,t,c//S], pos(n) = n mod Q: taps never cross a block."""
    N, H = x.shape
    taps = base.shape[0]
    coef = base[None] + delta.repeat_interleave(S, dim=-1)  # [N, taps, H]
    pos = torch.arange(N, device=x.device) % Q  # [N]
    out = coef[:, 0] * x
    for t in range(1, taps):
        shifted = F.pad(x, (0, 0, t, 0))[:N]  # shifted[n] = x[n-t] (zeros for n < t)
        visible = (pos >= t).to(x.dtype)[:, None]  # [N, 1]
        out = out + visible * (coef[:, t] * shifted)
    return out


class DynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv`: base_kernel [2, taps, H] (dim 0 = side: 0 prepare,
    1 finish), kernel_projection [2*taps*G, H]. Starts as the identity (tap 0 = 1)."""

    def __init__(self, H: int, taps: int, S: int):
        super().__init__()
        self.taps, self.S, self.G = taps, S, H // S
        base = torch.zeros(2, taps, H)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(H, 2 * taps * self.G, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor, Q: int):
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.G)  # [N, 2, taps, G]
        return dynamic_conv(x, delta[:, 0], self.base_kernel[0], Q, self.S), delta[:, 1]

    def finish(self, x: torch.Tensor, delta_finish: torch.Tensor, Q: int):
        return dynamic_conv(x, delta_finish, self.base_kernel[1], Q, self.S)


class Attention(nn.Module):
    def __init__(self, s: DraftSpec):
        super().__init__()
        H, nh, nkv, hd = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.nh, self.nkv, self.hd, self.eps = nh, nkv, hd, s.rms_norm_eps
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, s.rms_norm_eps)
        self.k_norm = RMSNorm(hd, s.rms_norm_eps)

    def context_kv(self, c: torch.Tensor, cos, sin):
        """c [B, T, H] -> K, V [B, nkv, T, hd]: k_norm then RoPE at the context positions."""
        B, T, _ = c.shape
        k = self.k_norm(self.k_proj(c).view(B, T, self.nkv, self.hd))
        v = self.v_proj(c).view(B, T, self.nkv, self.hd)
        k = apply_rope(k, cos[:, :, None], sin[:, :, None])
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, a: torch.Tensor, ctx_k, ctx_v, cos, sin, visible: torch.Tensor):
        """a [B, R, H] block rows (R = m*Q); ctx_k/v [B, nkv, T, hd]; cos/sin [B, R, hd];
        visible [B, 1, R, T+R] bool. -> [B, R, nh*hd] before o_proj."""
        B, R, _ = a.shape
        q = self.q_norm(self.q_proj(a).view(B, R, self.nh, self.hd))
        k = self.k_norm(self.k_proj(a).view(B, R, self.nkv, self.hd))
        v = self.v_proj(a).view(B, R, self.nkv, self.hd)
        q = apply_rope(q, cos[:, :, None], sin[:, :, None]).transpose(1, 2)  # [B, nh, R, hd]
        k = apply_rope(k, cos[:, :, None], sin[:, :, None]).transpose(1, 2)  # [B, nkv, R, hd]
        v = v.transpose(1, 2)
        keys = torch.cat([ctx_k, k], dim=2)  # [B, nkv, T+R, hd]
        vals = torch.cat([ctx_v, v], dim=2)
        g = self.nh // self.nkv  # GQA: query head h reads KV head h // g
        keys = keys.repeat_interleave(g, dim=1)
        vals = vals.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible, is_causal=False,
                                           scale=self.hd ** -0.5)  # [B, nh, R, hd]
        return o.transpose(1, 2).reshape(B, R, self.nh * self.hd)


class MLP(nn.Module):
    def __init__(self, H: int, I: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, s: DraftSpec):
        super().__init__()
        H = s.hidden_size
        self.input_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.mlp = MLP(H, s.intermediate_size)
        self.v2 = s.kind == "dflash2"
        if self.v2:
            self.attention_conv = DynamicConv(H, s.conv_kernel_size, s.conv_group_size)
            self.mlp_conv = DynamicConv(H, s.conv_kernel_size, s.conv_group_size)

    def forward(self, h, ctx_k, ctx_v, cos, sin, visible, Q: int):
        """h [B, R, H] (R = m*Q rows, blocks of Q end to end)."""
        B, R, H = h.shape
        a = self.input_layernorm(h)
        if self.v2:
            a2, k_att = self.attention_conv.prepare(a.reshape(B * R, H), Q)
            a = a2.view(B, R, H)
        o = self.self_attn.o_proj(self.self_attn(a, ctx_k, ctx_v, cos, sin, visible))
        if self.v2:
            o = self.attention_conv.finish(o.reshape(B * R, H), k_att, Q).view(B, R, H)
        h = h + o
        m = self.post_attention_layernorm(h)
        if self.v2:
            m2, k_mlp = self.mlp_conv.prepare(m.reshape(B * R, H), Q)
            m = m2.view(B, R, H)
        f = self.mlp(m)
        if self.v2:
            f = self.mlp_conv.finish(f.reshape(B * R, H), k_mlp, Q).view(B, R, H)
        return h + f


class CandidateSelector(nn.Module):
    """spec §4.4 tensors: hidden_projection [r, H], predecessor_codebook A [V, r] and
    successor_codebook Bc [V, r] (plain parameters: no `.weight` suffix)."""

    def __init__(self, s: DraftSpec):
        super().__init__()
        r, V = s.selector_rank, s.vocab_size
        self.hidden_projection = nn.Linear(s.hidden_size, r, bias=False)
        # r^-1/2 entries: the bilinear term starts small next to the candidate values but its
        # gradient does not vanish (a product of three near-zero factors would never move)
        self.predecessor_codebook = nn.Parameter(torch.randn(V, r) * r ** -0.5)
        self.successor_codebook = nn.Parameter(torch.randn(V, r) * r ** -0.5)


class DFlashDraft(nn.Module):
    """`fc`, `hidden_norm`, `layers.i.*`, `norm` (+ `candidate_selector.*` for DFlash2).
    The target's embedding / lm_head are passed in (frozen, tied in our target)."""

    def __init__(self, s: DraftSpec):
        super().__init__()
        self.spec = s
        H = s.hidden_size
        self.fc = nn.Linear(s.n_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, s.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(H, s.rms_norm_eps)
        if s.kind == "dflash2":
            self.candidate_selector = CandidateSelector(s)
        for name, p in self.named_parameters():  # Qwen3-style init for the matrices
            if name == "fc.weight" or name.endswith(("_proj.weight")):
                nn.init.normal_(p, std=0.02)

    def forward(self, taps: torch.Tensor, anchors: torch.Tensor, anchor_ids: torch.Tensor,
                embed: torch.Tensor, Q: int) -> torch.Tensor:
        """taps [B, T, n_taps*H] target taps at positions 0..T-1; anchors [B, m] anchor
        positions p (context = positions < p); anchor_ids [B, m]; embed [V, H] the target
        embedding. -> final-normed block states [B, m, Q, H] (row 0 = anchor row)."""
        s = self.spec
        B, T, _ = taps.shape
        m = anchors.shape[1]
        R = m * Q
        c = self.hidden_norm(self.fc(taps))  # [B, T, H]
        ctx_cos, ctx_sin = rope_cos_sin(torch.arange(T).expand(B, T), s.head_dim, s.rope_theta)
        row_pos = anchors[:, :, None] + torch.arange(Q)  # [B, m, Q] positions p..p+Q-1
        cos, sin = rope_cos_sin(row_pos.reshape(B, R), s.head_dim, s.rope_theta)  # [B, R, hd]

        # visibility: a row of block i sees context positions < p_i and every row of block i
        block_of = torch.arange(R) // Q  # [R]
        see_ctx = torch.arange(T)[None, None, :] < anchors.repeat_interleave(Q, dim=1)[:, :, None]  # [B, R, T]
        see_blk = (block_of[:, None] == block_of[None, :]).expand(B, R, R)  # [B, R, R]
        visible = torch.cat([see_ctx, see_blk], dim=2)[:, None]  # [B, 1, R, T+R]

        ids = torch.full((B, m, Q), s.mask_token_id, dtype=torch.long)
        ids[:, :, 0] = anchor_ids
        h = embed[ids.reshape(B, R)] * s.input_embedding_scale  # [B, R, H]
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(c, ctx_cos, ctx_sin)
            h = layer(h, ctx_k, ctx_v, cos, sin, visible, Q)
        return self.norm(h).view(B, m, Q, -1)


# ---------------------------------------------------------------- heads, selector math
def mask_logits(states: torch.Tensor, embed: torch.Tensor, n_real: int) -> torch.Tensor:
    """Target lm_head (tied: the embedding) on mask rows 1..Q-1; padded ids -> -inf.
    states [..., Q, H] -> [..., Q-1, V]."""
    x = states[..., 1:, :]
    z = (x.reshape(-1, x.shape[-1]) @ embed.T).view(*x.shape[:-1], embed.shape[0])  # one 2-D GEMM
    if n_real < embed.shape[0]:
        z[..., n_real:] = float("-inf")
    return z


def candidate_values(v: torch.Tensor, spec: DraftSpec) -> torch.Tensor:
    """§4.3, in this order: u = v * output_multiplier, then cap * tanh(u / cap) if enabled."""
    u = v * spec.output_multiplier
    cap = spec.final_logit_softcapping
    if cap is not None and cap > 0:
        u = cap * torch.tanh(u / cap)
    return u


def top_k_stable(z: torch.Tensor, K: int):
    """top-K by descending value, ties by ascending id (a stable descending sort)."""
    vals, ids = torch.sort(z, dim=-1, descending=True, stable=True)
    return vals[..., :K], ids[..., :K]


def selector_scores(sel: CandidateSelector, h_mask: torch.Tensor, ids: torch.Tensor,
                    u: torch.Tensor, pred_ids: torch.Tensor) -> torch.Tensor:
    """S[..., l, a, c] = u[..., l, c] + sum_r (A[pred[..., l, a], r] * pi[..., l, r]) * Bc[ids[..., l, c], r].

    h_mask [..., k, H] final-normed mask-row states; ids/u [..., k, K]; pred_ids [..., k, P]
    (P predecessors per row: K for the walk, 1 for teacher forcing). -> [..., k, P, K] f32."""
    pi = sel.hidden_projection(h_mask)  # [..., k, r]
    left = sel.predecessor_codebook[pred_ids] * pi[..., None, :]  # [..., k, P, r]
    right = sel.successor_codebook[ids]  # [..., k, K, r]
    return u[..., None, :] + left @ right.transpose(-1, -2)  # [..., k, P, K]


def walk_predecessors(anchor_ids: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """pred(0, a) = anchor, pred(l, a) = ids_{l-1}[a]. anchor_ids [...], ids [..., k, K] -> [..., k, K]."""
    first = anchor_ids[..., None, None].expand(*ids.shape[:-2], 1, ids.shape[-1])
    return torch.cat([first, ids[..., :-1, :]], dim=-2)


def greedy_walk(S: torch.Tensor, ids: torch.Tensor):
    """S [k, K, K] (row l, predecessor slot a, candidate slot c), ids [k, K].
    prev = 0; c* = argmax_c S[l, prev, c] (ties -> lowest slot; NaN never wins).
    -> (draft ids [k], chosen slots [k])."""
    k = S.shape[0]
    prev, slots = 0, []
    for l in range(k):
        row = torch.nan_to_num(S[l, prev], nan=float("-inf"))
        prev = int(torch.argmax(row))  # first maximum = lowest slot
        slots.append(prev)
    slots_t = torch.tensor(slots)
    return ids[torch.arange(k), slots_t], slots_t


def draft_tokens(model: DFlashDraft, states: torch.Tensor, anchor_ids: torch.Tensor,
                 embed: torch.Tensor) -> torch.Tensor:
    """Greedy proposals for every block. states [B, m, Q, H] -> [B, m, Q-1] token ids
    (DFlash: argmax, ties lowest id; DFlash2: the selector's greedy walk)."""
    s = model.spec
    z = mask_logits(states, embed, s.n_real_vocab)  # [B, m, k, V]
    if s.kind == "dflash":
        return torch.argmax(z, dim=-1)
    v, ids = top_k_stable(z, s.selector_top_k)  # [B, m, k, K]
    u = candidate_values(v, s)
    pred = walk_predecessors(anchor_ids, ids)  # [B, m, k, K]
    S = selector_scores(model.candidate_selector, states[:, :, 1:], ids, u, pred)  # [B, m, k, K, K]
    B, m = anchor_ids.shape
    out = torch.empty(B, m, ids.shape[2], dtype=torch.long)
    for b in range(B):
        for i in range(m):
            out[b, i] = greedy_walk(S[b, i], ids[b, i])[0]
    return out


def position_weights(k: int, gamma: float) -> torch.Tensor:
    """exp(-(j-1)/gamma) for mask rows j = 1..k: early slots matter most for acceptance."""
    return torch.exp(-torch.arange(k, dtype=torch.float32) / gamma)

