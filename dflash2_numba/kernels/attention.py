"""Scaled dot-product attention of a block of queries over a key set (DESIGN §2.1, §3).

    attention(q [nq, nh, hd], k [nkv, T, hd], v [nkv, T, hd],
              q_pos [nq] int64, k_pos [T] int64, causal: bool, window: int,
              bf16_probs: bool = False) -> [nq, nh, hd] f32

Visibility of key s (position k_pos[s]) from query i (position q_pos[i]):
    causal:     k_pos[s] <= q_pos[i]
    window > 0: |q_pos[i] - k_pos[s]| <= window - 1      (symmetric sliding window)
    both flags combine with AND; causal=False, window=0 is full attention.
GQA: query head h reads KV head h // (nh // nkv). Scale hd^-0.5, softmax in f32 with the max
subtracted. A query that sees no key gets a zero output row (cannot happen for the target's
causal use: every query sees itself).

bf16_probs (run mode "bf16"): the unnormalised probabilities exp(s - max) are rounded to bf16
before they weight V, while their sum stays f32 — what torch's CPU flash SDPA (and GPU
flash attention) do with bf16 inputs. Measured on bf16 inputs vs torch SDPA bf16: 97% of
output elements bit-equal with it, 72% without.

Callers:
- target: k/v = the layer's cache slice [nkv, 0:start+n, hd] with the block already written
  in, k_pos = arange(start+n), q_pos = start..start+n-1, causal=True, window=0.
- DFlash draft (§3): k/v = [context K/V at positions < p] ++ [block K/V at p..p+Q-1] — e.g.
  write the block into the context buffer just past its length (without bumping the length, so
  nothing persists) and pass that view; k_pos lists each key's position; causal / window per
  layer. k and v may be strided views (numba takes any layout); q is made contiguous.
"""

import numpy as np
from .linear import use_parallel  # same threading policy as the GEMV
from numba import njit, prange

from ..numerics import round_bf16, round_bf16_array



def _check(q, k, v, q_pos, k_pos):
    nq, nh, hd = q.shape
    nkv, T, hdk = k.shape
    if v.shape != k.shape or hdk != hd:
        raise ValueError(f"attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} disagree")
    if nh % nkv:
        raise ValueError(f"attention: {nh} query heads is not a multiple of {nkv} KV heads")
    if q_pos.shape != (nq,) or k_pos.shape != (T,):
        raise ValueError(f"attention: q_pos {q_pos.shape} / k_pos {k_pos.shape}, expected ({nq},) / ({T},)")


def visibility(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, window: int) -> np.ndarray:
    """[nq, T] bool: may query i see key s."""
    d = q_pos[:, None] - k_pos[None, :]  # [nq, T] query position minus key position
    vis = np.ones(d.shape, dtype=bool)
    if causal:
        vis &= d >= 0
    if window > 0:
        vis &= np.abs(d) <= window - 1
    return vis


def attention_reference(q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False):
    """Plain numpy (picoGPT style). Shapes as in the module docstring."""
    q, k, v = (np.asarray(a, dtype=np.float32) for a in (q, k, v))
    q_pos, k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
    _check(q, k, v, q_pos, k_pos)
    nq, nh, hd = q.shape
    g = nh // k.shape[0]
    kh = np.repeat(k, g, axis=0)  # [nh, T, hd]  query head h -> kv head h // g
    vh = np.repeat(v, g, axis=0)  # [nh, T, hd]
    scores = np.einsum("qhd,htd->hqt", q, kh) * np.float32(hd**-0.5)  # [nh, nq, T]
    vis = visibility(q_pos, k_pos, causal, window)  # [nq, T]
    scores = np.where(vis[None], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)  # [nh, nq, 1]
    m = np.where(np.isfinite(m), m, 0)  # rows with no visible key: all weights 0
    p = np.exp(scores - m)  # [nh, nq, T]
    s = p.sum(axis=-1, keepdims=True)  # [nh, nq, 1] from the unrounded p
    if bf16_probs:
        p = round_bf16_array(p)
    o = np.einsum("hqt,htd->qhd", p, vh)  # [nq, nh, hd]
    return (o * (1 / np.where(s > 0, s, 1)).transpose(1, 0, 2)).astype(np.float32)


@njit(inline="always")
def _attention_item(q, k, v, q_pos, k_pos, causal, window, bf16_probs, out, item):
    """Query item // nh, head item % nh: one (query, head) pair. out [nq, nh, hd] written."""
    nq, nh, hd = q.shape
    T = k.shape[1]
    g = nh // k.shape[0]
    scale = np.float32(1.0) / np.sqrt(np.float32(hd))
    i = item // nh
    h = item % nh
    kvh = h // g
    qp = q_pos[i]
    s = np.empty(T, dtype=np.float32)  # [T] scores, -inf where not visible
    mx = np.float32(-np.inf)
    for t in range(T):
        d = qp - k_pos[t]
        if (causal and d < 0) or (window > 0 and (d > window - 1 or d < 1 - window)):
            s[t] = -np.inf
            continue
        acc = np.float32(0.0)
        for j in range(hd):
            acc += q[i, h, j] * k[kvh, t, j]
        acc *= scale
        s[t] = acc
        if acc > mx:
            mx = acc
    o = out[i, h]  # [hd] view
    o[:] = np.float32(0.0)
    if mx == -np.inf:
        return  # nothing visible: zero row
    total = np.float32(0.0)
    for t in range(T):
        if s[t] == -np.inf:
            continue
        p = np.exp(s[t] - mx)
        total += p
        if bf16_probs:
            p = round_bf16(p)
        for j in range(hd):
            o[j] += p * v[kvh, t, j]
    inv = np.float32(1.0) / total
    for j in range(hd):
        o[j] *= inv


# A parallel driver and a serial twin for small work (fork/join would dominate); the item
# function is inlined at numba-IR level, so the drivers' fastmath applies to it.
@njit(parallel=True, fastmath={"reassoc"}, cache=True)
def _attention_par(q, k, v, q_pos, k_pos, causal, window, bf16_probs, out):
    for item in prange(q.shape[0] * q.shape[1]):
        _attention_item(q, k, v, q_pos, k_pos, causal, window, bf16_probs, out, item)


@njit(fastmath={"reassoc"}, cache=True)
def _attention_ser(q, k, v, q_pos, k_pos, causal, window, bf16_probs, out):
    for item in range(q.shape[0] * q.shape[1]):
        _attention_item(q, k, v, q_pos, k_pos, causal, window, bf16_probs, out, item)


def attention(q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False, out=None):
    """numba kernel; same contract as `attention_reference`."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    if k.dtype != np.float32 or v.dtype != np.float32:
        k, v = k.astype(np.float32), v.astype(np.float32)
    _check(q, k, v, q_pos, k_pos)
    if out is None:
        out = np.empty(q.shape, dtype=np.float32)
    kernel = _attention_par if use_parallel(q.size * k.shape[1]) else _attention_ser
    kernel(q, k, v, q_pos, k_pos, bool(causal), int(window), bool(bf16_probs), out)
    return out
