"""y = x @ w.T with bf16 (uint16) weights converted on the fly (DESIGN §6).

    linear(x [M, K] f32, w [N, K] uint16|float32|float16) -> y [M, N] f32

Two regimes:
- decode size (M <= GEMV_MAX_ROWS): a numba kernel, parallel over blocks of output rows.
  Weight rows are converted bf16 -> f32 two at a time into a per-item scratch ([2, K], stays
  in L1) and dotted with all M inputs, so the weight matrix is read once and never copied whole.
  `fastmath={"reassoc"}` lets LLVM vectorise the K reduction (about 8x without it).
- prefill size (M > GEMV_MAX_ROWS): weights converted in chunks of rows, numpy matmul (BLAS).
  The chunk is a bounded scratch ([CHUNK_ROWS, K] f32), again no whole-matrix f32 copy.

float16 weights (rare) always take the chunked numpy path: numba's CPU float16 support is thin.
`linear_reference` is the plain-numpy definition the kernels are tested against.
"""

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..numerics import as_f32, bf16_to_f32

GEMV_MAX_ROWS = 32  # rows of x up to which the numba kernel is used
ROW_BLOCK = 16  # output rows per parallel work item (amortises scratch allocation)
CHUNK_BYTES = 8 << 20  # f32 scratch per chunk on the BLAS path
PARALLEL_MIN_MACS = 1 << 18  # smaller products run on one thread


def use_parallel(macs: int) -> bool:
    """The prange driver only pays when there is work AND more than one numba thread: with one
    thread its fork/join overhead (tens of us per call) is pure loss on decode-size products."""
    return macs >= PARALLEL_MIN_MACS and numba.get_num_threads() > 1


def linear_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Plain numpy: x [M, K] f32, w [N, K] -> [M, N] f32."""
    return np.asarray(x, dtype=np.float32) @ as_f32(w).T  # [M, K] @ [K, N]


# ------------------------------------------------------------------ numba kernel
def _load(v):  # pragma: no cover - typing stub, replaced by the overload below
    raise NotImplementedError


@overload(_load, inline="always")
def _load_impl(v):
    """One weight element as float32: uint16 is bf16 bits, float32 passes through."""
    if v == types.uint16:
        return lambda v: bf16_to_f32(v)
    if v == types.float32:
        return lambda v: v
    return None


@njit(inline="always")
def _gemv_block(x, w, y, b):
    """Output rows b*ROW_BLOCK .. (b+1)*ROW_BLOCK-1 of y = x @ w.T.
    x [M, K] f32, w [N, K] uint16|f32, y [M, N] f32 (written).

    Register tile of 4 inputs x 2 weight rows: eight independent accumulators share each
    load, so the vectorised K reduction is not bound by one FMA dependency chain
    (measured ~1.5x over 4x1 and ~3x over 1x1 at M=16)."""
    M, K = x.shape
    N = w.shape[0]
    rows = np.zeros((2, K), dtype=np.float32)  # [2, K] scratch: two weight rows in f32
    n1 = min(N, (b + 1) * ROW_BLOCK)
    for n in range(b * ROW_BLOCK, n1, 2):
        two = n + 1 < n1  # odd tail: rows[1] keeps zeros / stale values, never stored
        for k in range(K):
            rows[0, k] = _load(w[n, k])
        if two:
            for k in range(K):
                rows[1, k] = _load(w[n + 1, k])
        m = 0
        while m + 4 <= M:
            a00 = np.float32(0.0)
            a01 = np.float32(0.0)
            a10 = np.float32(0.0)
            a11 = np.float32(0.0)
            a20 = np.float32(0.0)
            a21 = np.float32(0.0)
            a30 = np.float32(0.0)
            a31 = np.float32(0.0)
            for k in range(K):
                r0 = rows[0, k]
                r1 = rows[1, k]
                x0 = x[m, k]
                x1 = x[m + 1, k]
                x2 = x[m + 2, k]
                x3 = x[m + 3, k]
                a00 += x0 * r0
                a01 += x0 * r1
                a10 += x1 * r0
                a11 += x1 * r1
                a20 += x2 * r0
                a21 += x2 * r1
                a30 += x3 * r0
                a31 += x3 * r1
            y[m, n] = a00
            y[m + 1, n] = a10
            y[m + 2, n] = a20
            y[m + 3, n] = a30
            if two:
                y[m, n + 1] = a01
                y[m + 1, n + 1] = a11
                y[m + 2, n + 1] = a21
                y[m + 3, n + 1] = a31
            m += 4
        while m < M:  # M % 4 leftover inputs
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            for k in range(K):
                a0 += x[m, k] * rows[0, k]
                a1 += x[m, k] * rows[1, k]
            y[m, n] = a0
            if two:
                y[m, n + 1] = a1
            m += 1


@njit(inline="always")
def _gemv1_block(x, w, y, b):
    """M == 1: convert inside the dot product, no scratch pass. x [1, K], w [N, K], y [1, N]."""
    K = x.shape[1]
    for n in range(b * ROW_BLOCK, min(w.shape[0], (b + 1) * ROW_BLOCK)):
        acc = np.float32(0.0)
        for k in range(K):
            acc += x[0, k] * _load(w[n, k])
        y[0, n] = acc


# Drivers: parallel over blocks of output rows, and a serial twin for small products, where
# a fork/join costs more than it saves (and, on busy cores, OpenMP barriers stall).
# The block functions are inlined at numba-IR level, so the drivers' fastmath applies.
@njit(parallel=True, fastmath={"reassoc"}, cache=True)
def _gemv_par(x, w, y):
    for b in prange((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv_block(x, w, y, b)


@njit(fastmath={"reassoc"}, cache=True)
def _gemv_ser(x, w, y):
    for b in range((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv_block(x, w, y, b)


@njit(parallel=True, fastmath={"reassoc"}, cache=True)
def _gemv1_par(x, w, y):
    for b in prange((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv1_block(x, w, y, b)


@njit(fastmath={"reassoc"}, cache=True)
def _gemv1_ser(x, w, y):
    for b in range((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv1_block(x, w, y, b)


def _linear_chunked(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> np.ndarray:
    """BLAS path: convert `chunk` rows of w at a time into ONE reused f32 scratch.
    x [M, K], w [N, K], y [M, N]."""
    N, K = w.shape
    if w.dtype == np.float32:  # nothing to convert
        y[:] = x @ w.T  # [M, K] @ [K, N]
        return y
    chunk = max(1, min(N, CHUNK_BYTES // (4 * K)))
    scratch = np.empty((chunk, K), dtype=np.uint32)  # [chunk, K]; viewed as f32 below
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        buf = scratch[: n1 - n0]
        if w.dtype == np.uint16:
            buf[:] = w[n0:n1]  # widen the bf16 bits in place: f32 bits = bf16 bits << 16
            buf <<= np.uint32(16)
            wf = buf.view(np.float32)
        else:
            wf = buf.view(np.float32)
            wf[:] = w[n0:n1]  # float16 (or other float) -> f32
        y[:, n0:n1] = x @ wf.T  # [M, K] @ [K, chunk]
    return y


def linear(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ w.T. x [M, K] float32, w [N, K] uint16 (bf16) / float32 / float16 -> [M, N] f32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    M, K = x.shape
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"linear: x has {K} features, weight has {Kw} columns (shape {list(w.shape)})")
    y = np.empty((M, N), dtype=np.float32) if out is None else out
    if M > GEMV_MAX_ROWS or w.dtype not in (np.uint16, np.float32) or M == 0:
        return _linear_chunked(x, w, y)
    if not w.flags.c_contiguous:  # memmap views are contiguous; anything else is copied once
        w = np.ascontiguousarray(w)
    parallel = use_parallel(M * N * K)
    if M == 1:
        (_gemv1_par if parallel else _gemv1_ser)(x, w, y)
    else:
        (_gemv_par if parallel else _gemv_ser)(x, w, y)
    return y
