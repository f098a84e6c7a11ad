"""The fused CPU layer of a mixture-of-experts target: ONE numba call per MoE decoder layer, the
attention half of kernels/fused.py followed by the expert-major MoE block of models/moe.py.

    moe_layer(h [n, H] f32 (in place), attn, moe, kbuf, vbuf, start, q_pos, k_pos, cos, sin, shape,
              causal, window, eps, bf16, par_min_macs)

    h += attention(...)                                   kernels/fused.attention_half
    m  = rms(h, ln2)
    ids, w = route_rows(m W_r^T)                          kernels/routing.route_rows (the same kernel)
    for each expert e picked by some row, ascending:      its weights read ONCE for its rows
        y_e = down_e(silu(gate_e m_rows) * up_e m_rows)   (all picked experts' gate_up as one
        out[rows] += w * y_e                              grouped product, then all downs)
                                                          ascending expert id per row
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
from numba import njit, prange, types
from numba.extending import overload

from ..numerics import round_bf16
from ..quant.formats import ITEM_PANELS
from ..quant.kernels_int8 import _item as _item_quant, quantize_activations
from .fused import NEVER, _linear, _rms, _rnd, _runtime_bool, attention_half
from .panels import _item as _item_bf16
from .routing import route_rows
from .rowwise import _swiglu_rows


# ------------------------------------------------------------------ grouped expert product
# The k experts of a decode row (or the union of a block's rows) as ONE product: work items
# (slot s, 128 output columns b) over every picked expert, so the threads start once per
# projection instead of once per expert (at one row on 2 threads, 16 parallel regions per
# layer became 2). Slot s = expert eids[s] applied to rows offs[s] .. offs[s+1]-1 of x; each
# item is the plain GEMV's item on exactly those rows, so every output has the bits of a
# per-expert `_linear` call (and of a one-row call: the panel GEMV is row-invariant).
@njit(parallel=True, cache=True, nogil=True)
def _grouped_quant_par(xq, xs, xc, qw, ws, eids, offs, y, nitems):
    for i in prange(eids.shape[0] * nitems):
        s = i // nitems
        o0, o1, e = offs[s], offs[s + 1], eids[s]
        _item_quant(xq[o0:o1], xs[o0:o1], xc[o0:o1], qw[e], ws[e], y[o0:o1], i - s * nitems)


@njit(cache=True, nogil=True)
def _grouped_quant_ser(xq, xs, xc, qw, ws, eids, offs, y, nitems):
    for i in range(eids.shape[0] * nitems):
        s = i // nitems
        o0, o1, e = offs[s], offs[s + 1], eids[s]
        _item_quant(xq[o0:o1], xs[o0:o1], xc[o0:o1], qw[e], ws[e], y[o0:o1], i - s * nitems)


@njit(parallel=True, cache=True, nogil=True)
def _grouped_bf16_par(x, panels, eids, offs, y, nitems):
    for i in prange(eids.shape[0] * nitems):
        s = i // nitems
        o0, o1, e = offs[s], offs[s + 1], eids[s]
        _item_bf16(x[o0:o1], panels[e], y[o0:o1], i - s * nitems)


@njit(cache=True, nogil=True)
def _grouped_bf16_ser(x, panels, eids, offs, y, nitems):
    for i in range(eids.shape[0] * nitems):
        s = i // nitems
        o0, o1, e = offs[s], offs[s + 1], eids[s]
        _item_bf16(x[o0:o1], panels[e], y[o0:o1], i - s * nitems)


def _grouped(x, stack, eids, offs, y, parallel):  # pragma: no cover - typing stub, see the overload
    raise NotImplementedError


@overload(_grouped, inline="always")
def _grouped_impl(x, stack, eids, offs, y, parallel):
    """y [T, N] = for each slot s: x[rows of s] @ W_eids[s].T; x [T, K] f32, stack = the
    experts' bf16 panels [E, NP, K, 32] or quantized (qw, ws) [E, ...] pair."""
    if isinstance(stack, types.BaseTuple):
        def quant(x, stack, eids, offs, y, parallel):
            qw, ws = stack
            xq, xs, xc = quantize_activations(x, ws[0])  # per row: the bits of each expert's own call
            nitems = qw.shape[1] // ITEM_PANELS
            if parallel:
                _grouped_quant_par(xq, xs, xc, qw, ws, eids, offs, y, nitems)
            else:
                _grouped_quant_ser(xq, xs, xc, qw, ws, eids, offs, y, nitems)
        return quant

    def bf16_panels(x, stack, eids, offs, y, parallel):
        nitems = stack.shape[1] // ITEM_PANELS
        if parallel:
            _grouped_bf16_par(x, stack, eids, offs, y, nitems)
        else:
            _grouped_bf16_ser(x, stack, eids, offs, y, nitems)
    return bf16_panels


@njit(inline="always")
def _grouped_linear(x, stack, eids, offs, N, par_min_macs, parallel, bf16):
    """rnd?(the grouped product) -> [T, N] f32, as `fused._linear` for one weight."""
    y = np.empty((x.shape[0], N), np.float32)  # [T, N]
    if parallel:
        _grouped(x, stack, eids, offs, y, x.shape[0] * N * x.shape[1] >= par_min_macs)
    else:
        _grouped(x, stack, eids, offs, y, False)
    _rnd(y, bf16)
    return y


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

        # (row, expert) pairs grouped by expert, ascending: slot s = expert eids[s] on the
        # pairs offs[s] .. offs[s+1]-1 (row rows[t], routing weight w[rows[t], slots[t]])
        T = n * top_k
        rows = np.empty(T, np.int64)
        slots = np.empty(T, np.int64)
        eids = np.empty(T, np.int64)
        offs = np.zeros(T + 1, np.int64)
        S = 0
        c = 0
        for e in range(E):  # ascending expert id
            c0 = c
            for r in range(n):
                for j in range(top_k):
                    if ids[r, j] == e:
                        rows[c] = r
                        slots[c] = j
                        c += 1
            if c > c0:
                eids[S] = e
                offs[S + 1] = c
                S += 1
        x = np.empty((T, H), np.float32)  # [T, H] each slot's rows of m
        for t in range(T):
            x[t] = m[rows[t]]
        g = _grouped_linear(x, gu_stack, eids[:S], offs[:S + 1], 2 * inter, par_min_macs, parallel, bf16)  # [T, 2I]
        a = np.empty((T, inter), np.float32)  # [T, I]
        _swiglu_rows(np.ascontiguousarray(g[:, :inter]), np.ascontiguousarray(g[:, inter:]), _runtime_bool(bf16), a)
        y = _grouped_linear(a, down_stack, eids[:S], offs[:S + 1], H, par_min_macs, parallel, bf16)  # [T, H]
        out = np.zeros((n, H), np.float32)  # [n, H]
        for t in range(T):  # ascending expert id per row, as the slots are ordered
            r, wt = rows[t], w[rows[t], slots[t]]
            for j in range(H):
                if bf16:
                    out[r, j] = round_bf16(out[r, j] + round_bf16(y[t, j] * wt))
                else:
                    out[r, j] = out[r, j] + y[t, j] * wt

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
