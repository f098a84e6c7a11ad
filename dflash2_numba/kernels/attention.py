"""Scaled dot-product attention of a block of queries over a key set (spec §2.1, §3).

    attention(q [nq, nh, hd], k [nkv, >=T, hd], v [nkv, >=T, hd],
              q_pos [nq] int64, k_pos [T] int64, causal: bool, window: int,
              bf16_probs: bool = False, first: int = 0, sinks=None) -> [nq, nh, hd] f32

The keys are rows 0..T-1 of k / v, T = len(k_pos); later rows are ignored. k and v are f32, or
both uint16 bf16 bits (a `--kv-dtype bf16` cache: the kernel widens each element as it reads it). So a caller hands
over a whole cache buffer `cache.k[layer]` ([nkv, max_len, hd], C-contiguous: the layout the
kernel vectorises) rather than a strided prefix slice of it.

Visibility of key s (position k_pos[s]) from query i (position q_pos[i]):
    causal:     k_pos[s] <= q_pos[i]
    window > 0: |q_pos[i] - k_pos[s]| <= window - 1      (symmetric sliding window)
    both flags combine with AND; causal=False, window=0 is full attention.
    first (default 0): key ROWS before it are not visible either (the draft window: the draft
    attends to the last N context positions, first = p - N).
GQA: query head h reads KV head h // (nh // nkv). Scale hd^-0.5, softmax in f32 with the max
subtracted. A query that sees no key gets a zero output row (cannot happen for the target's
causal use: every query sees itself).

sinks (gpt-oss, families/gpt_oss.py): one learned logit per query head [nh] f32 that joins the
softmax as an extra column and is dropped after it: it raises the max and the denominator
(exp(sink - max)) and carries no value. None / an empty array: no sink. The kernel adds it after
the tiles are merged (one more rescale of the running max and sum).

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
from . import attention_ir, isa
from .linear import use_parallel  # same threading policy as the GEMV
from numba import njit, prange

from ..numerics import as_f32, expf_poly, kv_f32, round_bf16, round_bf16_array



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


def _check_first(first, T) -> int:
    first = int(first)
    if not 0 <= first <= T:
        raise ValueError(f"attention: first key row {first} outside 0..{T}")
    return first


def attention_reference(q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False, first=0, sinks=None):
    """Plain numpy (picoGPT style). Shapes as in the module docstring."""
    q, k, v = np.asarray(q, dtype=np.float32), as_f32(np.asarray(k)), as_f32(np.asarray(v))
    q_pos, k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
    _check(q, k, v, q_pos, k_pos)
    k, v = k[:, : len(k_pos)], v[:, : len(k_pos)]  # [nkv, T, hd] the listed keys
    nq, nh, hd = q.shape
    g = nh // k.shape[0]
    kh = np.repeat(k, g, axis=0)  # [nh, T, hd]  query head h -> kv head h // g
    vh = np.repeat(v, g, axis=0)  # [nh, T, hd]
    scores = np.einsum("qhd,htd->hqt", q, kh) * np.float32(hd**-0.5)  # [nh, nq, T]
    vis = visibility(q_pos, k_pos, causal, window)  # [nq, T]
    vis[:, : _check_first(first, len(k_pos))] = False  # key rows before `first` (the draft window)
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
# Block attention that streams K/V once (flash-decoding style). The keys are cut into TILEs of
# TILE consecutive key ROWS (tile b = rows b*TILE .. b*TILE+TILE-1, fixed whatever T, the number
# of query rows or threads). One work item = (tile, KV head): it reads that tile of K and V once
# (from memory into L2) and computes, for EVERY query row and every query head of the KV head's
# GQA group, the tile's partial softmax: m = max of the visible scores, l = sum exp(s - m),
# acc = sum exp(s - m) v. Items are independent, so a long context splits over threads (prange
# over tiles x KV heads) however few the rows. A second pass merges each (row, head)'s partials
# over tiles 0, 1, 2, ... in that FIXED order (m' = max, rescale both sides by exp(m - m')).
#
# Row invariance (a Q-row verify gives the bits of Q one-row steps): a row's partial over a tile
# loops exactly over its visible keys of that tile [lo, hi) (for a causal query at position p
# the tile's keys up to p), so its trip counts, hence LLVM's vector groupings, and its tile
# boundaries are those of the one-row step at p, and the merge visits the same tiles in the
# same order. Nothing a row computes reads another row.
TILE = 256  # keys per tile: 2 * 256 * hd * 4 B of K/V (128 KiB at hd 64) stays in L2
CHUNK = 16  # keys per inner pass: 16 K (or V) rows stay in L1 while every row and head reads them
# Software prefetch: each chunk of steps 1 and 3 asks for the K (V) rows PREFETCH keys ahead.
# A cache read from DRAM streams at 12-27 GB/s per core without it (the hardware prefetcher
# alone, docs/long_context.md); a 1-row attention over 8192 keys ran 1.1-1.5x faster with it,
# 4 and 8 rows 1.0-1.14x (bench/attention_ab.py). 32 measured best of 16 / 32 / 64 / 128. Below
# PREFETCH_MIN keys a layer's cache sits in L2 anyway: no prefetch is issued there. On Zen 4
# (isa.software_prefetch() false) the hardware prefetcher alone is faster, on both paths: 1 row
# over 8192 keys ~0.9x the time native, ~0.78x on AVX2, 4 rows over 2048 ~0.95x (A/B against an
# unchanged copy as control; docs/long_context.md, session 21): none there
PREFETCH = 32
PREFETCH_MIN = 1024 if isa.software_prefetch() else np.iinfo(np.int64).max


@njit(inline="always")
def _prefetch_chunk(a, kvh, row, T):
    """Rows row .. row + CHUNK - 1 of a[kvh] (those below T) into L1, ahead of their use."""
    attention_ir.prefetch_rows_ir(a, kvh, row, min(row + CHUNK, T))


@njit(inline="always")
def _exp_f32(x):
    """Cephes expf for x <= 0 (scores minus their max): Cody-Waite reduction x = n ln2 + r,
    degree-6 polynomial in r, times 2^n built from the exponent bits. Branch-free, so a loop of
    it vectorises; within 2 ulp of libm expf. Below -87 it returns ~1e-38 instead of 0: a weight
    that small cannot move an f32 sum that already holds the max's weight 1."""
    return expf_poly(max(x, np.float32(-87.0)))


@njit(cache=True, nogil=True)  # deliberately NOT fastmath: reassociation would undo the Cody-Waite split
def _exp_shifted(s, n, mx):
    """s[:n] = exp(s[:n] - mx) in place. s [>=n] f32."""
    for t in range(n):
        s[t] = _exp_f32(s[t] - mx)


@njit(nogil=True)  # not fastmath, as _exp_shifted: called from the merge
def _exp_scalar(x):
    return _exp_f32(x)


@njit(inline="always")
def _visible(qp, kp, causal, window):
    d = qp - kp  # query position minus key position (bitwise &, |: no branches)
    return ~((causal & (d < 0)) | ((window > 0) & ((d > window - 1) | (d < 1 - window))))


@njit(fastmath={"reassoc"}, nogil=True)  # its own flags: called, not inlined (see the drivers)
def _tile_partial(q, k, v, q_pos, k_pos, first, T, causal, window, bf16_probs, pm, pl, pacc, b, kvh):
    """Work item (tile b, KV head kvh): for every query i and
    head h of kvh's group, the partial softmax over the tile's visible keys (rows first..T-1):
        pm[b, i, h] = max score (-inf: none visible), pl[b, i, h] = sum of the UNROUNDED weights,
        pacc[b, i, h] = sum of the weights (bf16-rounded in bf16_probs mode) times V rows.
    q [nq, nh, hd], k/v [nkv, >=T, hd] C-contiguous; pm, pl [nb, nq, nh], pacc [nb, nq, nh, hd]."""
    nq, nh, hd = q.shape
    nkv = k.shape[0]
    g = nh // nkv
    t0 = b * TILE
    n = min(T, t0 + TILE) - t0  # keys in this tile
    scale = np.float32(1.0) / np.sqrt(np.float32(hd))
    npad = (n + CHUNK - 1) // CHUNK * CHUNK  # whole chunks: the 16-key score kernel stores 16 lanes
    vis = np.zeros((nq, npad), dtype=np.bool_)  # [nq, npad] may query i see key t0 + t
    lo = np.full(nq, n, dtype=np.int64)  # [nq] row i's visible keys of the tile lie in [lo, hi)
    hi = np.zeros(nq, dtype=np.int64)  # [nq] (hi = 0: none)
    for i in range(nq):  # branch-free, so the loop vectorises
        a, z = n, 0
        for t in range(n):
            seen = (t0 + t >= first) & _visible(q_pos[i], k_pos[t0 + t], causal, window)
            vis[i, t] = seen
            a = min(a, t if seen else n)
            z = max(z, t + 1 if seen else 0)
        lo[i], hi[i] = a, z
    s = np.empty((nq, g, npad), dtype=np.float32)  # [nq, g, npad] scores, then weights
    ir_path = hd % attention_ir.LANES == 0  # the LLVM IR inner loops (attention_ir.py); else numba's
    smax = np.full((nq, g, CHUNK), -np.inf, dtype=np.float32)  # [nq, g, 16] running max per lane (IR path)
    # 1. scores, K chunk by chunk (a chunk stays in L1 while every row and head reads it)
    far = T >= PREFETCH_MIN  # a cache long enough to come from DRAM: prefetch K and V ahead
    for c0 in range(0, n, CHUNK):
        if far:
            _prefetch_chunk(k, kvh, t0 + c0 + PREFETCH, T)
        for i in range(nq):
            a0, a1 = max(c0, lo[i]), min(c0 + CHUNK, hi[i])
            for hh in range(g):
                if ir_path:
                    if a1 > a0 and t0 + c0 + CHUNK <= k.shape[1]:  # 16 keys at once (the same bits per key)
                        attention_ir.scores16_ir(q, i, kvh * g + hh, k, kvh, t0, scale, s, i, hh, c0, a0, a1, vis, smax)
                    elif a1 > a0:
                        attention_ir.scores_ir(q, i, kvh * g + hh, k, kvh, t0, scale, s, i, hh, a0, a1, vis, smax)
                else:
                    _scores(q, i, kvh * g + hh, k, kvh, t0, scale, s[i, hh], a0, a1)
    # 2. per (row, head): the max; pacc zeroed
    for i in range(nq):
        for hh in range(g):
            h = kvh * g + hh
            pm[b, i, h] = np.float32(-np.inf)
            pl[b, i, h] = np.float32(0.0)
            for j in range(hd):
                pacc[b, i, h, j] = np.float32(0.0)
            if hi[i] == 0:
                continue
            mx = np.float32(-np.inf)
            for j in range(CHUNK):  # the lanes' maxima (exact in any order)
                mx = max(mx, smax[i, hh, j])
            if not ir_path:
                for t in range(lo[i], hi[i]):
                    if vis[i, t] and s[i, hh, t] > mx:
                        mx = s[i, hh, t]
                _exp_shifted(s[i, hh, lo[i]:hi[i]], hi[i] - lo[i], mx)
            pm[b, i, h] = mx
            smax[i, hh, 0] = mx
    # 3. weights times V, chunk by chunk (a V chunk in L1 for every row and head); each (row, head)
    # sums its keys in key order
    if ir_path:  # exp, mask, the weights' sum and the products in one pass (attention_ir.pv_chunk_ir)
        lacc = np.zeros((nq, g, CHUNK), dtype=np.float32)  # [nq, g, 16] the weights' sum, lane j = key j of a chunk
        for c0 in range(0, n, CHUNK):
            if far:
                _prefetch_chunk(v, kvh, t0 + c0 + PREFETCH, T)
            for i in range(nq):
                a0, a1 = max(c0, lo[i]), min(c0 + CHUNK, hi[i])
                if a1 > a0:
                    for hh in range(g):
                        attention_ir.pv_chunk_ir(s, i, hh, vis, v, kvh, t0, c0, a0, a1, smax[i, hh, 0], lacc, pacc,
                                                 b, i, kvh * g + hh, bf16_probs)
        for i in range(nq):
            for hh in range(g):
                l = np.float32(0.0)  # the 16 lanes in order (the same 16 additions for every row)
                for j in range(CHUNK):
                    l += lacc[i, hh, j]
                pl[b, i, kvh * g + hh] = l
        return
    for c0 in range(0, n, CHUNK):  # numba: chunk by chunk, a V chunk in L1 for every row and head
        if far:
            _prefetch_chunk(v, kvh, t0 + c0 + PREFETCH, T)
        for i in range(nq):
            for hh in range(g):
                h = kvh * g + hh
                for t in range(max(c0, lo[i]), min(c0 + CHUNK, hi[i])):
                    if vis[i, t]:  # skipped, not weighted by 0: an inf/NaN in an unseen row never leaks
                        w = s[i, hh, t]
                        pl[b, i, h] += w
                        if bf16_probs:
                            w = round_bf16(w)
                        for j in range(hd):
                            pacc[b, i, h, j] += w * kv_f32(v[kvh, t0 + t, j])


@njit(inline="always")
def _scores(q, i, h, k, kvh, t0, scale, s, lo, hi):
    """s[t] = (q[i, h] . k[kvh, t0 + t]) * scale for t in [lo, hi): one dot product per key (a
    vector loop over hd), so a key's score has the same bits whatever rows share the tile."""
    hd = q.shape[2]
    for t in range(lo, hi):
        a = np.float32(0.0)
        for j in range(hd):
            a += q[i, h, j] * kv_f32(k[kvh, t0 + t, j])
        s[t] = a * scale


@njit(fastmath={"reassoc"}, nogil=True)
def _merge_tiles(pm, pl, pacc, b0, sinks, out, item):
    """out[i, h] for item = i * nh + h: the partials of tiles b0, b0 + 1, ... merged in that order, then
    head h's sink logit (sinks [nh], or empty: none) joined to the max and the sum, then normalised;
    a zero row when no tile saw a key. Shapes as `_tile_partial`."""
    nb, nq, nh, hd = pacc.shape
    i, h = item // nh, item % nh
    m, l = np.float32(-np.inf), np.float32(0.0)
    acc = np.zeros(hd, dtype=np.float32)  # [hd]
    for b in range(b0, nb):
        mb = pm[b, i, h]
        if mb == -np.inf:
            continue
        if m == -np.inf:  # the first tile with a visible key
            m, l = mb, pl[b, i, h]
            for j in range(hd):  # a loop: a slice assignment pulls in numba's error formatting (compile time)
                acc[j] = pacc[b, i, h, j]
            continue
        mn = max(m, mb)
        a, c = _exp_scalar(m - mn), _exp_scalar(mb - mn)  # rescale the running and the tile's side
        l = l * a + pl[b, i, h] * c
        for j in range(hd):
            acc[j] = acc[j] * a + pacc[b, i, h, j] * c
        m = mn
    if sinks.shape[0] > 0 and m != -np.inf:  # the sink: one more column, in the denominator only
        mn = max(m, sinks[h])
        a = _exp_scalar(m - mn)
        l = l * a + _exp_scalar(sinks[h] - mn)
        for j in range(hd):
            acc[j] = acc[j] * a
        m = mn
    inv = np.float32(1.0) / l if m != -np.inf else np.float32(0.0)
    for j in range(hd):
        out[i, h, j] = acc[j] * inv


@njit(inline="always")
def _partials(nb, q):
    """Scratch of the per-tile partials: pm, pl [nb, nq, nh], pacc [nb, nq, nh, hd]."""
    nq, nh, hd = q.shape
    return (np.empty((nb, nq, nh), np.float32), np.empty((nb, nq, nh), np.float32),
            np.empty((nb, nq, nh, hd), np.float32))


# Drivers: parallel over items and a serial twin for small work (fork/join would dominate). The
# item functions are CALLED, compiled once with the drivers' fastmath ("reassoc", which lets LLVM
# vectorise the reductions) as their own flags, so both drivers run the same machine code for a
# (tile, row, head): the same bits (tests/test_block_attention.py checks serial == parallel bitwise).
# Keys are rows first..T-1 (first > 0: the draft window); tiles before first // TILE are skipped.
# (Twins, not one inlined body: a prange inside an inline="always" helper is NOT turned into a
# parallel loop; numba's parallel diagnostics then list no loop.)
@njit(parallel=True, fastmath={"reassoc"}, cache=True, nogil=True)
def _attention_par(q, k, v, q_pos, k_pos, first, T, causal, window, bf16_probs, sinks, out):
    nb, b0, nkv = (T + TILE - 1) // TILE, first // TILE, k.shape[0]
    pm, pl, pacc = _partials(nb, q)
    for item in prange((nb - b0) * nkv):  # KV head by KV head: a thread's items are consecutive tiles
        _tile_partial(q, k, v, q_pos, k_pos, first, T, causal, window, bf16_probs, pm, pl, pacc,
                      b0 + item % (nb - b0), item // (nb - b0))
    for item in prange(q.shape[0] * q.shape[1]):
        _merge_tiles(pm, pl, pacc, b0, sinks, out, item)


@njit(fastmath={"reassoc"}, cache=True, nogil=True)
def _attention_ser(q, k, v, q_pos, k_pos, first, T, causal, window, bf16_probs, sinks, out):
    nb, b0, nkv = (T + TILE - 1) // TILE, first // TILE, k.shape[0]
    pm, pl, pacc = _partials(nb, q)
    for item in range((nb - b0) * nkv):  # KV head by KV head: a thread's items are consecutive tiles
        _tile_partial(q, k, v, q_pos, k_pos, first, T, causal, window, bf16_probs, pm, pl, pacc,
                      b0 + item % (nb - b0), item // (nb - b0))
    for item in range(q.shape[0] * q.shape[1]):
        _merge_tiles(pm, pl, pacc, b0, sinks, out, item)


NO_SINKS = np.empty(0, np.float32)
NO_SINKS.flags.writeable = False  # read-only, as numba types the global inside the fused layer: one signature


def attention(q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False, out=None, first=0, sinks=None):
    """numba kernel; same contract as `attention_reference`."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    if k.dtype != v.dtype or k.dtype not in (np.float32, np.uint16):  # uint16: a bf16 cache (--kv-dtype bf16)
        k, v = as_f32(np.asarray(k)), as_f32(np.asarray(v))
    _check(q, k, v, q_pos, k_pos)
    if out is None:
        out = np.empty(q.shape, dtype=np.float32)
    T = k_pos.shape[0]
    if not (k.flags.c_contiguous and v.flags.c_contiguous):  # C layout is what vectorises
        k, v = np.ascontiguousarray(k[:, :T]), np.ascontiguousarray(v[:, :T])
    kernel = _attention_par if use_parallel(q.size * T) else _attention_ser
    first = _check_first(first, T)
    sinks = NO_SINKS if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    if sinks.shape[0] not in (0, q.shape[1]):
        raise ValueError(f"attention: sinks {list(sinks.shape)}, expected [{q.shape[1]}] (one per query head)")
    kernel(q, k, v, q_pos, k_pos, first, T, bool(causal), int(window), bool(bf16_probs), sinks, out)
    return out
