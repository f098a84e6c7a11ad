"""Row-wise activation kernels: RMSNorm and RoPE, BIT-IDENTICAL to the numpy definitions in
models/layers.py (`rms_norm`, `apply_rope`), which stay the reference and the "numpy" device's
path. On decode-size inputs ([1..16, 256]) numpy's per-call overhead (~30 us for an RMSNorm of
seven ufunc calls) costs more than the arithmetic; these are one call each.

    rms_norm(x [..., D] f32, w [D] f32, eps, bf16) -> [..., D] f32
    apply_rope(x [n, heads, hd] f32, cos [n, hd], sin [n, hd], bf16) -> [n, heads, hd] f32

Bit identity, and why it holds:
- no fastmath anywhere here, so LLVM neither reassociates nor contracts a*b+c into an FMA:
  every product, sum and rounding is the IEEE f32 operation numpy performs;
- the mean of x^2 is summed in exactly numpy's order: `np.add.reduce` over a contiguous row is
  numpy's pairwise sum (`_pairwise_sum` below: 8 interleaved accumulators up to 128 elements,
  halves at multiples of 8 above), started from 0, then divided by D in f32.
  (numpy >= 2 on x86-64 and arm64; a numpy that summed differently fails tests/test_rowwise.py.)
tests/test_rowwise.py asserts array_equal against layers.py over shapes that take every branch.
"""

import numpy as np
from numba import njit

from ..numerics import expf_poly, round_bf16

PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE


@njit(inline="always")
def _pairwise_leaf(a, lo, n):
    """numpy's pairwise_sum for n <= PAIRWISE_BLOCK: sequential below 8, else 8 interleaved
    accumulators combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the n % 8 tail."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True, nogil=True)
def _pairwise_sum(a, n):
    """sum(a[:n]) in f32 in numpy's pairwise order (numpy/_core/src/umath/loops_utils.h.src):
    above PAIRWISE_BLOCK, pairwise(lo, n) = pairwise(lo, n2) + pairwise(lo + n2, n - n2) with
    n2 = n // 2 rounded down to a multiple of 8. Evaluated with an explicit stack (numba cannot
    cache recursive functions): tasks are (lo, n) to expand or (-1, 0) to add the top two sums.
    A row of at most PAIRWISE_BLOCK (a head's hd, a small hidden size) is one leaf: no stack to
    allocate (three arrays a call cost ~0.1 us a row: 9 us for the 64 head rows of an 8-row
    verify's qk-norm on the embedded target)."""
    if n <= PAIRWISE_BLOCK:
        return _pairwise_leaf(a, 0, n)
    task_lo = np.empty(128, np.int64)
    task_n = np.empty(128, np.int64)
    sums = np.empty(128, np.float32)
    sp, vp = 1, 0
    task_lo[0], task_n[0] = 0, n
    while sp > 0:
        sp -= 1
        lo, m = task_lo[sp], task_n[sp]
        if lo < 0:  # combine: left + right, in that order
            sums[vp - 2] = sums[vp - 2] + sums[vp - 1]
            vp -= 1
        elif m <= PAIRWISE_BLOCK:
            sums[vp] = _pairwise_leaf(a, lo, m)
            vp += 1
        else:
            m2 = m // 2
            m2 -= m2 % 8
            task_lo[sp], task_n[sp] = -1, 0  # runs last
            task_lo[sp + 1], task_n[sp + 1] = lo + m2, m - m2  # right half second
            task_lo[sp + 2], task_n[sp + 2] = lo, m2  # left half first
            sp += 3
    return sums[0]


@njit(cache=True, nogil=True)
def _rms_norm_rows(x, w, eps, bf16, out):
    """x [rows, D] f32 C-contiguous, w [D] f32 -> out [rows, D]:
    out = rnd?(w * rnd?(x * (1 / sqrt(mean(x^2) + eps))))."""
    rows, D = x.shape
    sq = np.empty(D, dtype=np.float32)  # [D] x^2 of one row
    for r in range(rows):
        for j in range(D):
            sq[j] = x[r, j] * x[r, j]
        var = _pairwise_sum(sq, D) / np.float32(D)
        inv = np.float32(1.0) / np.sqrt(var + eps)
        for j in range(D):
            normed = x[r, j] * inv
            if bf16:
                normed = round_bf16(normed)
            y = w[j] * normed
            out[r, j] = round_bf16(y) if bf16 else y


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, bf16: bool = False) -> np.ndarray:
    """Same contract and bits as models.layers.rms_norm; x [..., D], w [D] f32 (the models
    keep norm weights as f32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    D = x.shape[-1]
    if w.shape != (D,):
        raise ValueError(f"rms_norm: weight {list(w.shape)} for rows of {D} features")
    out = np.empty(x.shape, dtype=np.float32)
    _rms_norm_rows(x.reshape(-1, D), np.ascontiguousarray(w, dtype=np.float32), np.float32(eps),
                   bool(bf16), out.reshape(-1, D))
    return out


@njit(cache=True, nogil=True)
def _rope_rows(x, cos, sin, bf16, out):
    """x [n, heads, hd], cos/sin [n, hd] -> out = rnd?(rnd?(x*cos) + rnd?(rotate_half(x)*sin)),
    rotate_half(x) = [-x2, x1] (NeoX halves)."""
    n, heads, hd = x.shape
    half = hd // 2
    for i in range(n):
        for h in range(heads):
            for j in range(hd):
                rot = -x[i, h, j + half] if j < half else x[i, h, j - half]
                a = x[i, h, j] * cos[i, j]
                b = rot * sin[i, j]
                if bf16:
                    a = round_bf16(a)
                    b = round_bf16(b)
                y = a + b
                out[i, h, j] = round_bf16(y) if bf16 else y


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, bf16: bool = False) -> np.ndarray:
    """Same contract and bits as models.layers.apply_rope: x [n, heads, hd], cos/sin [n, hd]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, _, hd = x.shape
    if cos.shape != (n, hd) or sin.shape != (n, hd) or hd % 2:
        raise ValueError(f"apply_rope: x {list(x.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}")
    out = np.empty(x.shape, dtype=np.float32)
    _rope_rows(x, np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32),
               bool(bf16), out)
    return out


@njit(inline="always")
def _silu(x):
    """x / (1 + exp(-x)) in f32, exp by numerics.expf_poly (the attention's Cephes expf, within
    2 ulp of libm's) on the argument clamped to [-87, 88], and +inf past 88.72 (f32's range).
    Branch-free, so a row of it vectorises: with libm's expf, a call per element, an 8 x 768
    SwiGLU took 17 us; now ~2 us (Zen 5, 512-bit path).
    x < -88.72 gives -0 (x / inf) as libm and torch do; -88.72 <= x < -88 a number below 1e-36
    instead of a denormal; NaN stays NaN."""
    e = expf_poly(min(max(-x, np.float32(-87.0)), np.float32(88.0)))
    e = np.float32(np.inf) if -x > np.float32(88.72283) else e
    return x / (np.float32(1.0) + e)


# not fastmath (reassociation would undo the Cody-Waite split); error_model "numpy": a float
# division is then a plain IEEE division, without the ZeroDivisionError check that kept the row
# loop scalar (1 + exp(-x) is never 0)
@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_rows(g, u, bf16, out):
    """g, u [rows, I] f32 -> out = rnd?(rnd?(silu(g)) * u), silu of `_silu`. One definition for
    the op-by-op CPU path and the fused layers (kernels/fused.py, fused_moe.py), so they agree bit
    for bit; against numpy's exp (models/layers.swiglu, the "numpy" device) a few ulp apart."""
    rows, I = g.shape
    for r in range(rows):
        for j in range(I):
            x = g[r, j]
            s = _silu(x)
            if bf16:
                s = round_bf16(s)
            y = s * u[r, j]
            out[r, j] = round_bf16(y) if bf16 else y


def swiglu(gate: np.ndarray, up: np.ndarray, bf16: bool = False) -> np.ndarray:
    """Same contract as models.layers.swiglu: silu(gate) * up, [n, I] -> [n, I] f32."""
    g = np.ascontiguousarray(gate, dtype=np.float32)
    u = np.ascontiguousarray(up, dtype=np.float32)
    if g.shape != u.shape or g.ndim != 2:
        raise ValueError(f"swiglu: gate {list(g.shape)}, up {list(u.shape)}")
    out = np.empty(g.shape, dtype=np.float32)
    _swiglu_rows(g, u, bool(bf16), out)
    return out
