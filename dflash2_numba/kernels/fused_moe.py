"""The fused CPU layer of a mixture-of-experts target: ONE numba call per MoE decoder layer, the
attention half of kernels/fused.py followed by the expert-major MoE block of models/moe.py.

    moe_layer(h [n, H] f32 (in place), attn, moe, kbuf, vbuf, start, q_pos, k_pos, cos, sin, shape,
              causal, window, eps, bf16, par_min_macs)

    h += attention(...)                                   kernels/fused.attention_half
    m  = rms(h, ln2)
    ids, w = route_rows(m W_r^T)                          kernels/routing.route_rows (the same kernel)
    for each expert e picked by some row, ascending:      its weights read ONCE for its rows
        y_e = down_e(silu(gate_e m_rows) * up_e m_rows)
        out[rows] += w * y_e                             ascending expert id per row
    out += sigmoid(m W_g^T) * shared(m)                   when the layer has a shared expert
    h += out

It calls the same kernels in the same order as the op-by-op path (models/moe.moe_mlp with the
CPU ops), so the two are bit-identical (tests/test_moe.py), and every product is the panel GEMV
(bf16, q8_0 or q4_0 panels, stacked [E, ...] per projection), so a Q-row call gives each row
the bits of a one-row call. Compile-time variants (bf16 run mode, may-go-parallel) as in
kernels/fused.py: a one-thread f32 run compiles no parfor and no bf16 loop.
"""

import functools

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..numerics import round_bf16
from .fused import NEVER, _linear, _rms, _runtime_bool, attention_half
from .routing import route_rows
from .rowwise import _swiglu_rows


def _expert(stack, e):  # pragma: no cover - typing stub, see the overload
    raise NotImplementedError


@overload(_expert, inline="always")
def _expert_impl(stack, e):
    """Expert e's panels from a stack: [E, NP, K, 32] bf16, or the quantized pair (qw, ws) of
    [E, ...] arrays -> the same kind of panels the GEMV takes for one weight."""
    if isinstance(stack, types.BaseTuple):
        return lambda stack, e: (stack[0][e], stack[1][e])
    return lambda stack, e: stack[e]


def _make_moe_layer(bf16: bool, parallel: bool):
    """The MoE layer kernel for one run mode and thread policy (closure constants)."""

    @njit(cache=True, nogil=True)
    def moe_layer_kernel(h, attn, moe, kbuf, vbuf, start, q_pos, k_pos, cos, sin, shape, causal, window, eps,
                         par_min_macs):
        """One pre-norm MoE decoder layer on h [n, H] (in place); arguments as `moe_layer`."""
        wqkv, wo, ln1, ln2, q_norm, k_norm, no_proj, no_base = attn
        router, gu_stack, down_stack, sh_gu, sh_down, sh_gate = moe
        nh, nkv, hd, k_at, v_at, E, top_k, renorm, inter, sh_inter = shape
        n, H = h.shape
        attention_half(h, wqkv, wo, ln1, q_norm, k_norm, no_proj, no_base, kbuf, vbuf, start, q_pos,
                       k_pos, cos, sin, nh, nkv, hd, (0, 0, 0, 0), k_at, v_at, causal, window, eps, par_min_macs,
                       parallel, bf16, 0)

        m = _rms(h, ln2, eps, bf16)  # [n, H]
        logits = _linear(m, router, E, par_min_macs, parallel, bf16)  # [n, E]
        ids = np.empty((n, top_k), np.int64)
        w = np.empty((n, top_k), np.float32)
        route_rows(logits, top_k, renorm != 0, _runtime_bool(bf16), ids, w)

        out = np.zeros((n, H), np.float32)  # [n, H]
        rows = np.empty(n, np.int64)
        slots = np.empty(n, np.int64)
        for e in range(E):  # ascending expert id
            c = 0
            for r in range(n):
                for j in range(top_k):
                    if ids[r, j] == e:
                        rows[c] = r
                        slots[c] = j
                        c += 1
            if c == 0:
                continue
            x = np.empty((c, H), np.float32)  # [c, H] the rows that picked e
            for i in range(c):
                x[i] = m[rows[i]]
            g = _linear(x, _expert(gu_stack, e), 2 * inter, par_min_macs, parallel, bf16)  # [c, 2I]
            a = np.empty((c, inter), np.float32)  # [c, I]
            _swiglu_rows(np.ascontiguousarray(g[:, :inter]), np.ascontiguousarray(g[:, inter:]), _runtime_bool(bf16), a)
            y = _linear(a, _expert(down_stack, e), H, par_min_macs, parallel, bf16)  # [c, H]
            for i in range(c):
                r, wt = rows[i], w[rows[i], slots[i]]
                for j in range(H):
                    if bf16:
                        out[r, j] = round_bf16(out[r, j] + round_bf16(y[i, j] * wt))
                    else:
                        out[r, j] = out[r, j] + y[i, j] * wt

        if sh_inter > 0:  # the shared expert, gated per row
            g = _linear(m, sh_gu, 2 * sh_inter, par_min_macs, parallel, bf16)  # [n, 2Is]
            a = np.empty((n, sh_inter), np.float32)
            _swiglu_rows(np.ascontiguousarray(g[:, :sh_inter]), np.ascontiguousarray(g[:, sh_inter:]),
                         _runtime_bool(bf16), a)
            s = _linear(a, sh_down, H, par_min_macs, parallel, bf16)  # [n, H]
            z = _linear(m, sh_gate, 1, par_min_macs, parallel, bf16)  # [n, 1]
            for r in range(n):
                gate = np.float32(1.0) / (np.float32(1.0) + np.exp(-z[r, 0]))
                if bf16:
                    gate = round_bf16(gate)
                for j in range(H):
                    if bf16:
                        out[r, j] = round_bf16(out[r, j] + round_bf16(gate * s[r, j]))
                    else:
                        out[r, j] = out[r, j] + gate * s[r, j]
        for r in range(n):
            for j in range(H):
                h[r, j] = round_bf16(h[r, j] + out[r, j]) if bf16 else h[r, j] + out[r, j]

    return moe_layer_kernel


_moe_kernel = functools.cache(_make_moe_layer)


def kernel_variants() -> list:
    """Every variant's dispatcher (made, not compiled): for kernels/cache_check.py."""
    return [_moe_kernel(bf16, par) for bf16 in (False, True) for par in (False, True)]


def moe_layer(h, attn, moe, kbuf, vbuf, start, q_pos, k_pos, cos, sin, shape, causal, window, eps, bf16,
              par_min_macs):
    """One MoE decoder layer on h [n, H] (in place).

    attn   (wqkv panels (q, k, v grouped), wo panels, ln1 [H], ln2 [H], q_norm [hd], k_norm [hd],
            fused.NO_CONV[0], fused.NO_CONV[2]: a target layer has no conv)
    moe    (router panels [E, H], gate_up stack [E, ...] of [2I, H], down stack [E, ...] of [H, I],
            shared gate_up panels [2Is, H], shared down panels [H, Is], shared gate panels [1, H]);
            Is = 0 (and any panels of the right kind) when there is no shared expert
    shape  (nh, nkv, hd, k_at, v_at, E, top_k, renormalize 0/1, I, Is) ints"""
    _moe_kernel(bool(bf16), par_min_macs < NEVER)(h, attn, moe, kbuf, vbuf, start, q_pos, k_pos, cos, sin, shape,
                                                  causal, window, eps, par_min_macs)
