"""Gated DeltaNet kernels (docs/targets/qwen3_5.md §2): the causal depthwise short conv and the
gated delta-rule recurrence, each as an `@njit` kernel beside its plain numpy reference.

    short_conv(window [K-1+n, C], w [C, K], bf16) -> [n, C]
        out[t, c] = silu( sum_j w[c, j] * window[t + j, c] )        (w[:, K-1] hits the newest row)
        bf16: the sum is rounded to bf16 before the silu and the silu after it (torch's bf16
        conv1d accumulates in f32 and rounds once; silu then runs on that bf16 value)
        `window` = the K-1 cached raw rows ++ the n new raw rows; the caller keeps the right
        K-1 rows of it as the next conv state.

    gated_delta_rule(q [n, Hk, dk], k [n, Hk, dk], v [n, Hv, dv], g [n, Hv], beta [n, Hv],
                     state_in [Hv, dk, dv], state_out [Hv, dk, dv]) -> o [n, Hv, dv]
        q, k are L2-normalised here (eps 1e-6, in f32) and q is scaled by dk^-1/2; value head h
        reads key head h // (Hv / Hk). Per row t and value head h, with S = state (f32):
            S <- exp(g_t) * S;  m = S^T k_t;  S <- S + k_t (beta_t (v_t - m))^T;  o_t = S^T q_t
        state_in is read, never written (unless it IS state_out): the hybrid cache keeps the
        pre-block state there and replays accepted rows from it (models/hybrid_cache.py).

All f32. The kernels and the references agree to f32 rounding (the kernels sum in loop order,
numpy in its own order); the kernel is deterministic, so replaying rows 0..m-1 from the same
state_in reproduces the forward's state after row m-1 bit for bit.
"""

import numpy as np
from numba import njit

from ..errors import KernelArgumentError
from ..numerics import round_bf16, round_bf16_array

L2_EPS = 1e-6  # fixed in HF's kernel call (use_qk_l2norm_in_kernel=True), not rms_norm_eps


# ------------------------------------------------------------------ argument checks
def check_short_conv_args(who, window, w):
    if window.ndim != 2 or w.ndim != 2 or window.shape[1] != w.shape[0]:
        raise KernelArgumentError(f"{who}: window [K-1+n, C] and w [C, K] expected, got "
                                  f"{tuple(window.shape)} and {tuple(w.shape)}")
    if window.shape[0] < w.shape[1] - 1:
        raise KernelArgumentError(f"{who}: window has {window.shape[0]} rows, fewer than K-1 = {w.shape[1] - 1}")


def check_delta_args(who, q, k, v, g, beta, state_in, state_out):
    n, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    ok = (k.shape == q.shape and v.shape[0] == n and g.shape == (n, Hv) and beta.shape == (n, Hv)
          and tuple(state_in.shape) == (Hv, dk, dv) and tuple(state_out.shape) == (Hv, dk, dv)
          and Hk > 0 and Hv % Hk == 0)
    if not ok:
        raise KernelArgumentError(
            f"{who}: expected q, k [n, Hk, dk], v [n, Hv, dv], g, beta [n, Hv], states [Hv, dk, dv] with "
            f"Hv % Hk == 0; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, state_in {tuple(state_in.shape)}, state_out {tuple(state_out.shape)}")


def _f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


# ------------------------------------------------------------------ short conv
def short_conv_reference(window: np.ndarray, w: np.ndarray, bf16: bool = False) -> np.ndarray:
    """numpy: [K-1+n, C], [C, K] -> [n, C] (silu applied)."""
    K = w.shape[1]
    n = window.shape[0] - (K - 1)
    acc = np.zeros((n, w.shape[0]), np.float32)  # [n, C]
    for j in range(K):
        acc += window[j : j + n] * w[:, j][None, :]  # tap j: rows t+j of the window
    acc = round_bf16_array(acc) if bf16 else acc
    with np.errstate(over="ignore"):
        out = acc / (np.float32(1.0) + np.exp(-acc))  # silu
    return round_bf16_array(out) if bf16 else out


@njit(cache=True, nogil=True)
def _short_conv_kernel(window, w, bf16, out):
    n, C = out.shape
    K = w.shape[1]
    for t in range(n):
        for c in range(C):
            acc = np.float32(0.0)
            for j in range(K):
                acc += w[c, j] * window[t + j, c]
            if bf16:
                acc = round_bf16(acc)
            y = acc / (np.float32(1.0) + np.exp(-acc))
            out[t, c] = round_bf16(y) if bf16 else y


def short_conv(window: np.ndarray, w: np.ndarray, bf16: bool = False) -> np.ndarray:
    """@njit: [K-1+n, C], [C, K] -> [n, C] f32."""
    check_short_conv_args("short_conv", window, w)
    window, w = _f32(window), _f32(w)
    out = np.empty((window.shape[0] - (w.shape[1] - 1), w.shape[0]), np.float32)  # [n, C]
    _short_conv_kernel(window, w, bool(bf16), out)
    return out


# ------------------------------------------------------------------ gated delta rule
def l2_normalise(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum x^2 + 1e-6) over the last axis, f32."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2_EPS))


def gated_delta_rule_reference(q, k, v, g, beta, state_in, state_out=None) -> np.ndarray:
    """numpy, vectorised over heads, one row at a time. Writes the final state to state_out
    (if given); returns o [n, Hv, dv]."""
    n, Hk, dk = q.shape
    Hv = v.shape[1]
    r = Hv // Hk
    qn = np.repeat(l2_normalise(_f32(q)), r, axis=1) * np.float32(dk ** -0.5)  # [n, Hv, dk]
    kn = np.repeat(l2_normalise(_f32(k)), r, axis=1)  # [n, Hv, dk]
    S = np.array(state_in, dtype=np.float32)  # [Hv, dk, dv]
    o = np.empty(v.shape, np.float32)  # [n, Hv, dv]
    for t in range(n):
        S *= np.exp(g[t].astype(np.float32))[:, None, None]  # decay
        mem = np.einsum("hij,hi->hj", S, kn[t])  # [Hv, dv] what S predicts for k_t
        delta = (v[t] - mem) * beta[t][:, None]  # [Hv, dv]
        S += kn[t][:, :, None] * delta[:, None, :]  # rank-1 write
        o[t] = np.einsum("hij,hi->hj", S, qn[t])  # read after the write
    if state_out is not None:
        state_out[...] = S
    return o


@njit(cache=True, nogil=True)
def _delta_kernel(q, k, v, g, beta, state_in, state_out, o):
    n, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    r = Hv // Hk
    scale = np.float32(1.0) / np.sqrt(np.float32(dk))
    qn = np.empty(dk, np.float32)
    kn = np.empty(dk, np.float32)
    mem = np.empty(dv, np.float32)
    for h in range(Hv):
        kh = h // r
        S = state_out[h]  # [dk, dv]
        for i in range(dk):
            for j in range(dv):
                S[i, j] = state_in[h, i, j]
        for t in range(n):
            sq = np.float32(0.0)
            sk = np.float32(0.0)
            for i in range(dk):
                sq += q[t, kh, i] * q[t, kh, i]
                sk += k[t, kh, i] * k[t, kh, i]
            inv_q = np.float32(1.0) / np.sqrt(sq + np.float32(L2_EPS))
            inv_k = np.float32(1.0) / np.sqrt(sk + np.float32(L2_EPS))
            for i in range(dk):
                qn[i] = q[t, kh, i] * inv_q * scale
                kn[i] = k[t, kh, i] * inv_k
            decay = np.exp(g[t, h])
            b = beta[t, h]
            for j in range(dv):
                mem[j] = np.float32(0.0)
            for i in range(dk):
                for j in range(dv):
                    S[i, j] *= decay
                    mem[j] += S[i, j] * kn[i]
            for j in range(dv):
                mem[j] = (v[t, h, j] - mem[j]) * b  # delta
            for j in range(dv):
                o[t, h, j] = np.float32(0.0)
            for i in range(dk):
                for j in range(dv):
                    S[i, j] += kn[i] * mem[j]
                    o[t, h, j] += S[i, j] * qn[i]


def gated_delta_rule(q, k, v, g, beta, state_in, state_out) -> np.ndarray:
    """@njit: see the module docstring. state_out is written in place (may be state_in)."""
    check_delta_args("gated_delta_rule", q, k, v, g, beta, state_in, state_out)
    if state_out.dtype != np.float32 or not state_out.flags.c_contiguous:
        raise KernelArgumentError("gated_delta_rule: state_out must be a C-contiguous float32 array "
                                  f"(got {state_out.dtype}, contiguous={state_out.flags.c_contiguous})")
    o = np.empty(v.shape, np.float32)  # [n, Hv, dv]
    _delta_kernel(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), _f32(state_in), state_out, o)
    return o
