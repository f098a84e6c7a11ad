"""Scaled dot-product attention of a block of queries over a key set (spec §2.1, §3).

    attention(q [nq, nh, hd], k [nkv, >=T, hd], v [nkv, >=T, hd],
              q_pos [nq] int64, k_pos [T] int64, causal: bool, window: int,
              bf16_probs: bool = False, sinks=None) -> [nq, nh, hd] f32

The keys are rows 0..T-1 of k / v, T = len(k_pos); later rows are ignored. So a caller hands
over a whole cache buffer `cache.k[layer]` ([nkv, max_len, hd], C-contiguous: the layout the
kernel vectorises) rather than a strided prefix slice of it.

Visibility of key s (position k_pos[s]) from query i (position q_pos[i]):
    causal:     k_pos[s] <= q_pos[i]
    window > 0: |q_pos[i] - k_pos[s]| <= window - 1      (symmetric sliding window)
    both flags combine with AND; causal=False, window=0 is full attention.
GQA: query head h reads KV head h // (nh // nkv). Scale hd^-0.5, softmax in f32 with the max
subtracted. A query that sees no key gets a zero output row (cannot happen for the target's
causal use: every query sees itself).

sinks (gpt-oss, families/gpt_oss.py): one learned logit per query head [nh] f32 that joins the
softmax as an extra column and is dropped after it: it raises the max and the denominator
(exp(sink - max)) and carries no value. None / an empty array: no sink.

bf16_probs (run mode "bf16"): the unnormalised probabilities exp(s - max) are rounded to bf16
before they weight V, while their sum stays f32 — what torch's CPU flash SDPA (and GPU
flash attention) do with bf16 inputs. Measured on bf16 inputs vs torch SDPA bf16: 97% of
output elements bit-equal with it, 72% without.

Callers:
- target: k/v = the layer's cache buffer [nkv, max_len, hd] with the block already written
  in at start.., k_pos = arange(start+n), q_pos = start..start+n-1, causal=True, window=0.
- DFlash draft (§3): k/v = [context K/V at positions < p] ++ [block K/V at p..p+Q-1] — e.g.
  write the block into the context buffer just past its length (without bumping the length, so
  nothing persists) and pass that buffer; k_pos lists each key's position; causal / window per
  layer. Strided k / v are accepted (copied to C layout first); q is made contiguous.
"""

import numpy as np
from .linear import use_parallel  # same threading policy as the GEMV
from numba import njit, prange

from ..numerics import _u32_as_f32, round_bf16, round_bf16_array



def _check(q, k, v, q_pos, k_pos):
    """Shape rules shared by every attention implementation (CPU, numpy, CUDA)."""
    nq, nh, hd = q.shape
    nkv, rows, hdk = k.shape
    if tuple(v.shape) != tuple(k.shape) or hdk != hd:
        raise ValueError(f"attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} disagree")
    if nh % nkv:
        raise ValueError(f"attention: {nh} query heads is not a multiple of {nkv} KV heads")
    if q_pos.shape != (nq,) or k_pos.ndim != 1 or k_pos.shape[0] > rows:
        raise ValueError(f"attention: q_pos {q_pos.shape} / k_pos {k_pos.shape}, expected ({nq},) / "
                         f"(T,) with T <= {rows} key rows")


def visibility(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, window: int) -> np.ndarray:
    """[nq, T] bool: may query i see key s."""
    d = q_pos[:, None] - k_pos[None, :]  # [nq, T] query position minus key position
    vis = np.ones(d.shape, dtype=bool)
    if causal:
        vis &= d >= 0
    if window > 0:
        vis &= np.abs(d) <= window - 1
    return vis


def attention_reference(q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False, sinks=None):
    """Plain numpy (picoGPT style). Shapes as in the module docstring."""
    q, k, v = (np.asarray(a, dtype=np.float32) for a in (q, k, v))
    q_pos, k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
    _check(q, k, v, q_pos, k_pos)
    k, v = k[:, : len(k_pos)], v[:, : len(k_pos)]  # [nkv, T, hd] the listed keys
    nq, nh, hd = q.shape
    g = nh // k.shape[0]
    kh = np.repeat(k, g, axis=0)  # [nh, T, hd]  query head h -> kv head h // g
    vh = np.repeat(v, g, axis=0)  # [nh, T, hd]
    scores = np.einsum("qhd,htd->hqt", q, kh) * np.float32(hd**-0.5)  # [nh, nq, T]
    vis = visibility(q_pos, k_pos, causal, window)  # [nq, T]
    scores = np.where(vis[None], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)  # [nh, nq, 1]
    if sinks is not None and len(sinks):
        m = np.maximum(m, np.asarray(sinks, np.float32)[:, None, None])
    m = np.where(np.isfinite(m), m, 0)  # rows with no visible key: all weights 0
    p = np.exp(scores - m)  # [nh, nq, T]
    s = p.sum(axis=-1, keepdims=True)  # [nh, nq, 1] from the unrounded p
    if sinks is not None and len(sinks):  # the sink column: in the denominator only
        s = s + np.exp(np.asarray(sinks, np.float32)[:, None, None] - m)
    if bf16_probs:
        p = round_bf16_array(p)
    o = np.einsum("hqt,htd->qhd", p, vh)  # [nq, nh, hd]
    return (o * (1 / np.where(s > 0, s, 1)).transpose(1, 0, 2)).astype(np.float32)


# ------------------------------------------------------------------ numba kernels
# Two loop orders over the same math, picked per call by the number of query rows that share a
# KV head (R = nq * nh / nkv):
#   rows (R < TRANSPOSE_MIN_ROWS, e.g. one decode token): one item per (query, KV head); scores
#     are dot products over hd on C-contiguous k rows, V is accumulated row by row;
#   transposed (verify / draft blocks): one item per KV head; its K and V are copied once to
#     [hd, T] scratch, so scores (q_j * K^T[j, :]) and outputs (p . V^T[j, :]) run over T in
#     long vector loops without per-key horizontal sums. The copy costs 2*T*hd moves per KV
#     head, which only R >= TRANSPOSE_MIN_ROWS query rows pay back (measured ~2x at R = 16).
# Both take exp from `_exp_shifted`, a branch-free expf that LLVM vectorises.
TRANSPOSE_MIN_ROWS = 8


@njit(inline="always")
def use_transposed(nq, nh, nkv, causal):
    """The transposed order for blocks of >= TRANSPOSE_MIN_ROWS rows per KV head, but never for
    causal attention (the target's verify): its reductions run over a different grouping than a
    one-row step's, and a Q-row verify must give the bits of Q one-row steps (lossless greedy
    at every weight format: an int8 activation rounding turns a 1-ulp difference into a logit
    change)."""
    return (not causal) and nq * nh // nkv >= TRANSPOSE_MIN_ROWS


@njit(inline="always")
def _exp_f32(x):
    """Cephes expf for x <= 0 (scores minus their max): Cody-Waite reduction x = n ln2 + r,
    degree-6 polynomial in r, times 2^n built from the exponent bits. Branch-free, so a loop of
    it vectorises; within 2 ulp of libm expf. Below -87 it returns ~1e-38 instead of 0: a weight
    that small cannot move an f32 sum that already holds the max's weight 1."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _u32_as_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))


@njit(cache=True, nogil=True)  # deliberately NOT fastmath: reassociation would undo the Cody-Waite split
def _exp_shifted(s, n, mx):
    """s[:n] = exp(s[:n] - mx) in place. s [>=n] f32."""
    for t in range(n):
        s[t] = _exp_f32(s[t] - mx)


@njit(inline="always")
def _visible(qp, kp, causal, window):
    d = qp - kp  # query position minus key position
    return not ((causal and d < 0) or (window > 0 and (d > window - 1 or d < 1 - window)))


@njit(inline="always")
def _softmax_weights(s, vis, T, bf16_probs, sinks, h):
    """s [>=T] scaled scores -> unnormalised weights exp(s - max) in place (0 where not
    visible; bf16-rounded in bf16_probs mode). Returns 1 / sum of the UNROUNDED weights, or 0
    when no key is visible (the caller writes zeros). sinks [nh] or empty: head h's sink logit
    joins the max and the sum, never the weights."""
    mx = np.float32(-np.inf)
    for t in range(T):
        if vis[t] and s[t] > mx:
            mx = s[t]
    if mx == -np.inf:
        return np.float32(0.0)
    has_sink = sinks.shape[0] > 0
    if has_sink and sinks[h] > mx:
        mx = sinks[h]
    _exp_shifted(s, T, mx)
    total = _exp_f32(sinks[h] - mx) if has_sink else np.float32(0.0)
    for t in range(T):
        w = s[t] if vis[t] else np.float32(0.0)
        total += w
        s[t] = round_bf16(w) if bf16_probs else w
    return np.float32(1.0) / total


@njit(fastmath={"reassoc"}, nogil=True)  # its own flags: called, not inlined (see the drivers)
def _attend_rows(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, item):
    """Query i = item // nkv with its g = nh // nkv heads sharing KV head kvh = item % nkv.
    q [nq, nh, hd], k/v [nkv, >=T, hd] C-contiguous, out [nq, nh, hd] written."""
    nq, nh, hd = q.shape
    nkv = k.shape[0]
    g = nh // nkv
    i, kvh = item // nkv, item % nkv
    scale = np.float32(1.0) / np.sqrt(np.float32(hd))
    vis = np.empty(T, dtype=np.bool_)  # [T] may query i see key t
    s = np.empty(T, dtype=np.float32)  # [T] scores of one head, then its weights
    acc = np.empty(hd, dtype=np.float32)  # [hd]
    Te = 0  # keys up to the last visible one: the loops stop there, so a query of a causal block
    for t in range(T):  # runs exactly the loops (trip counts, hence vector groupings) of the
        vis[t] = _visible(q_pos[i], k_pos[t], causal, window)  # one-row step at its position:
        if vis[t]:  # a Q-row verify gives the bits of Q single steps
            Te = t + 1
    for h in range(kvh * g, (kvh + 1) * g):
        for t in range(Te):
            a = np.float32(0.0)
            for j in range(hd):
                a += q[i, h, j] * k[kvh, t, j]
            s[t] = a * scale
        inv = _softmax_weights(s, vis, Te, bf16_probs, sinks, h)
        acc[:] = np.float32(0.0)
        for t in range(Te):
            if vis[t]:  # skipped, not weighted by 0: an inf/NaN in an unseen row never leaks
                w = s[t]
                for j in range(hd):
                    acc[j] += w * v[kvh, t, j]
        for j in range(hd):
            out[i, h, j] = acc[j] * inv


@njit(fastmath={"reassoc"}, nogil=True)
def _attend_head_transposed(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, kvh):
    """Every query row of KV head kvh (nq queries x its g heads). Shapes as `_attend_rows`."""
    nq, nh, hd = q.shape
    g = nh // k.shape[0]
    scale = np.float32(1.0) / np.sqrt(np.float32(hd))
    kT = np.empty((hd, T), dtype=np.float32)  # [hd, T] K of this head, transposed
    vT = np.empty((hd, T), dtype=np.float32)  # [hd, T]
    for t in range(T):
        for j in range(hd):
            kT[j, t] = k[kvh, t, j]
            vT[j, t] = v[kvh, t, j]
    vis = np.empty(T, dtype=np.bool_)
    s = np.empty(T, dtype=np.float32)
    for i in range(nq):
        for t in range(T):
            vis[t] = _visible(q_pos[i], k_pos[t], causal, window)
        for h in range(kvh * g, (kvh + 1) * g):
            s[:T] = np.float32(0.0)
            for j in range(0, hd, 4):  # s += q_j * K^T[j, :], vector loops over T, 4 j per pass
                j1 = min(j + 1, hd - 1)  # hd % 4 tail: clamped rows get a zero coefficient
                j2 = min(j + 2, hd - 1)
                j3 = min(j + 3, hd - 1)
                q0 = q[i, h, j] * scale
                q1 = q[i, h, j1] * scale if j + 1 < hd else np.float32(0.0)
                q2 = q[i, h, j2] * scale if j + 2 < hd else np.float32(0.0)
                q3 = q[i, h, j3] * scale if j + 3 < hd else np.float32(0.0)
                for t in range(T):
                    s[t] += q0 * kT[j, t] + q1 * kT[j1, t] + q2 * kT[j2, t] + q3 * kT[j3, t]
            inv = _softmax_weights(s, vis, T, bf16_probs, sinks, h)
            # out_j = sum_t w_t V^T[j, t]; an unseen key has weight exactly 0 (a select here
            # would halve the speed; V rows are cache rows the model wrote, so finite)
            for j in range(hd):
                a = np.float32(0.0)
                for t in range(T):
                    a += s[t] * vT[j, t]
                out[i, h, j] = a * inv


@njit(inline="always")
def _attend_item(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, transposed, item):
    """Work item `item` of the chosen loop order (see `_n_items`)."""
    if transposed:
        _attend_head_transposed(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, item)
    else:
        _attend_rows(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, item)


@njit(inline="always")
def _n_items(q, k, transposed):
    """KV heads (transposed order) or (query, KV head) pairs (row order)."""
    return k.shape[0] if transposed else q.shape[0] * k.shape[0]


# Drivers: parallel over items and a serial twin for small work (fork/join would dominate). The
# two item functions are CALLED, compiled once with the drivers' fastmath ("reassoc", which lets
# LLVM vectorise the reductions) as their own flags: inlined at numba-IR level they cost ~1 s more
# of a cold compile (numba's inliner is slow on loops this size), and the bits are the same
# (checked against the inlined build on 1600 random shapes, both orders and drivers: docs/cold_start.md).
@njit(parallel=True, fastmath={"reassoc"}, cache=True, nogil=True)
def _attention_par(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, transposed):
    for item in prange(_n_items(q, k, transposed)):
        _attend_item(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, transposed, item)


@njit(fastmath={"reassoc"}, cache=True, nogil=True)
def _attention_ser(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, transposed):
    for item in range(_n_items(q, k, transposed)):
        _attend_item(q, k, v, q_pos, k_pos, T, causal, window, bf16_probs, sinks, out, transposed, item)


NO_SINKS = np.empty(0, np.float32)


def attention(q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False, out=None, sinks=None):
    """numba kernel; same contract as `attention_reference`."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    if k.dtype != np.float32 or v.dtype != np.float32:
        k, v = k.astype(np.float32), v.astype(np.float32)
    _check(q, k, v, q_pos, k_pos)
    if out is None:
        out = np.empty(q.shape, dtype=np.float32)
    T = k_pos.shape[0]
    if not (k.flags.c_contiguous and v.flags.c_contiguous):  # C layout is what vectorises
        k, v = np.ascontiguousarray(k[:, :T]), np.ascontiguousarray(v[:, :T])
    kernel = _attention_par if use_parallel(q.size * T) else _attention_ser
    # use_transposed's rule, read here from the module global (tests force either order)
    transposed = (not causal) and q.shape[0] * q.shape[1] // k.shape[0] >= TRANSPOSE_MIN_ROWS
    sinks = NO_SINKS if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    if sinks.shape[0] not in (0, q.shape[1]):
        raise ValueError(f"attention: sinks {list(sinks.shape)}, expected [{q.shape[1]}] (one per query head)")
    kernel(q, k, v, q_pos, k_pos, T, bool(causal), int(window), bool(bf16_probs), sinks, out, transposed)
    return out
