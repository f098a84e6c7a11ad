"""y = x @ w.T with bf16 (uint16) weights converted on the fly (spec §6).

    linear(x [M, K] f32, w [N, K] uint16|float32|float16|PackedBF16|QuantizedWeight) -> y [M, N] f32

Quantized weights (quant/weights.py, q8_0 / q4_0) take the integer kernels at every row count;
weights of a pre-quantized checkpoint (quant/stored.StoredWeight: FP8, int4, W8A8) their own
kernels, at every row count too.
Otherwise three regimes:
- a PackedBF16 weight (what ops.prepare_weight gives the models on the CPU): the panel
  micro-kernels of kernels/panels.py at EVERY row count, decode and prefill alike. Row r of an
  M-row product then has the bits of the one-row product (one fma chain per output), a prompt's
  K/V and taps those of one-row steps. Above 32 rows they used to go to BLAS on an f32 copy made
  chunk by chunk: on a 2-core Zen 5, 512-token bf16 prefill of the ~120M bench model went from
  650 to 1088 tok/s (AVX2 path, 2 threads) and 600 to 1012 (512-bit path, 1 thread) with the
  panels, and the checkpoint's bf16 pages are no longer read a second time (docs/amd_epyc_zen5.md).
- decode size, a plain uint16 / float32 array (M <= GEMV_MAX_ROWS): a numba kernel, parallel over blocks of output rows.
  Each weight element is converted bf16 -> f32 inside the K loop and shared by up to 8 input
  rows (8 accumulators), so the weight matrix is read once per 8 inputs and never copied.
  `fastmath={"reassoc", "contract"}` lets LLVM vectorise the K reduction (about 8x without it)
  and use FMAs.
- prefill size (M > GEMV_MAX_ROWS): weights converted in chunks of rows, numpy matmul (BLAS).
  The chunk is a bounded scratch ([CHUNK_ROWS, K] f32), again no whole-matrix f32 copy.
  BLAS runs on as many threads as numba (`blas_threads`): left alone, OpenBLAS starts one per
  core, so a "--threads 1" prefill used every core, and at 2 threads its pool and numba's
  competed for the same cores.

float16 weights (rare) always take the chunked numpy path: numba's CPU float16 support is thin.
`linear_reference` is the plain-numpy definition the kernels are tested against.
"""

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..numerics import as_f32, bf16_to_f32
from ..quant.kernels_int8 import _gemv_quant_par, _gemv_quant_ser, quantize_rows_entry
from ..quant.kernels_q4k import quantize_rows_k_entry
from ..quant.stored import StoredWeight
from ..quant.weights import QuantizedWeight
from .panels import _gemv_panels_par, _gemv_panels_ser

GEMV_MAX_ROWS = 32  # rows of x up to which the numba kernel is used
ROW_BLOCK = 16  # output rows per parallel work item (amortises scratch allocation)
CHUNK_BYTES = 8 << 20  # f32 scratch per chunk on the BLAS path
PARALLEL_MIN_MACS = 1 << 18  # smaller products run on one thread


def _thread_count_reader():
    """numba.get_num_threads() costs ~1 us (it re-checks the thread pool under a lock); a decode
    step asks ~60 times. After one public call has started the pool, numba's own raw reader
    (the same value, ~0.2 us) is used when this numba has it."""
    numba.get_num_threads()
    raw = getattr(getattr(numba.np.ufunc, "parallel", None), "_get_num_threads", None)
    return raw if callable(raw) else numba.get_num_threads


_num_threads = None  # set on first use: importing must not start the thread pool


def threads_now() -> int:
    """numba's current thread count, read the cheap way (see _thread_count_reader)."""
    global _num_threads
    if _num_threads is None:
        _num_threads = _thread_count_reader()
    return _num_threads()


_blas = {"libs": None, "n": 0}  # numpy's BLAS libraries (threadpoolctl) and the count last set


def blas_threads() -> int:
    """Give every loaded BLAS library numba's current thread count (set only when it changed;
    the libraries are looked up once, at the first BLAS product) -> that count. What --threads
    says then holds for the BLAS products too (prefill, the selector's projection)."""
    n = threads_now()
    if n != _blas["n"]:
        if _blas["libs"] is None:
            from threadpoolctl import ThreadpoolController

            _blas["libs"] = [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]
        for lib in _blas["libs"]:
            lib.set_num_threads(n)
        _blas["n"] = n
    return n


def use_parallel(macs: int) -> bool:
    """The prange driver only pays when there is work AND more than one numba thread: with one
    thread its fork/join overhead (tens of us per call) is pure loss on decode-size products."""
    return macs >= PARALLEL_MIN_MACS and threads_now() > 1


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
def _rows8(x, w, y, m0, n0, n1):
    """y[m0:m0+8, n0:n1] = x[m0:m0+8] @ w[n0:n1].T. Rows past M are clamped to row M-1 (computed,
    not stored), so a group of 5..7 inputs runs the same loop. Eight accumulators share each
    weight element, converted once from bf16 inside the K loop: no scratch pass over w."""
    M, K = x.shape
    r1, r2, r3 = min(m0 + 1, M - 1), min(m0 + 2, M - 1), min(m0 + 3, M - 1)
    r4, r5, r6, r7 = min(m0 + 4, M - 1), min(m0 + 5, M - 1), min(m0 + 6, M - 1), min(m0 + 7, M - 1)
    for n in range(n0, n1):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for k in range(K):
            wk = _load(w[n, k])
            a0 += x[m0, k] * wk
            a1 += x[r1, k] * wk
            a2 += x[r2, k] * wk
            a3 += x[r3, k] * wk
            a4 += x[r4, k] * wk
            a5 += x[r5, k] * wk
            a6 += x[r6, k] * wk
            a7 += x[r7, k] * wk
        y[m0, n] = a0
        y[r1, n] = a1  # a clamped row rewrites row M-1 with the value it already holds
        y[r2, n] = a2
        y[r3, n] = a3
        y[r4, n] = a4
        y[r5, n] = a5
        y[r6, n] = a6
        y[r7, n] = a7


@njit(inline="always")
def _rows4(x, w, y, m0, n0, n1):
    """As `_rows8` for a group of 2..4 inputs."""
    M, K = x.shape
    r1, r2, r3 = min(m0 + 1, M - 1), min(m0 + 2, M - 1), min(m0 + 3, M - 1)
    for n in range(n0, n1):
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for k in range(K):
            wk = _load(w[n, k])
            a0 += x[m0, k] * wk
            a1 += x[r1, k] * wk
            a2 += x[r2, k] * wk
            a3 += x[r3, k] * wk
        y[m0, n] = a0
        y[r1, n] = a1
        y[r2, n] = a2
        y[r3, n] = a3


@njit(inline="always")
def _rows1(x, w, y, m0, n0, n1):
    """One input row: a plain dot product per weight row."""
    K = x.shape[1]
    for n in range(n0, n1):
        acc = np.float32(0.0)
        for k in range(K):
            acc += x[m0, k] * _load(w[n, k])
        y[m0, n] = acc


@njit(inline="always")
def _gemv_block(x, w, y, b):
    """Output columns b*ROW_BLOCK .. (b+1)*ROW_BLOCK-1 of y = x @ w.T for every input row, in
    groups of 8 (5..8 left), 4 (2..4 left) or 1. x [M, K] f32, w [N, K], y [M, N] written.
    Measured on the decode shapes (K 256..768, N 256..4096, one AVX2 core): 8 rows cost ~3x one
    row and 2..4 rows ~1.5x; the former 4x2 tile with a converted-row scratch took ~4x / ~2.5x."""
    M = x.shape[0]
    n0, n1 = b * ROW_BLOCK, min(w.shape[0], (b + 1) * ROW_BLOCK)
    m0 = 0
    while m0 < M:
        left = M - m0
        if left >= 5:
            _rows8(x, w, y, m0, n0, n1)
            m0 += 8
        elif left >= 2:
            _rows4(x, w, y, m0, n0, n1)
            m0 += 4
        else:
            _rows1(x, w, y, m0, n0, n1)
            m0 += 1


# Drivers: parallel over blocks of output columns, and a serial twin for small products, where
# a fork/join costs more than it saves (and, on busy cores, OpenMP barriers stall). The block
# functions are inlined at numba-IR level, so the drivers' fastmath applies: "reassoc" lets
# LLVM vectorise the K reductions, "contract" fuses their multiply-adds into FMAs.
@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _gemv_par(x, w, y):
    for b in prange((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv_block(x, w, y, b)


@njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _gemv_ser(x, w, y):
    for b in range((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv_block(x, w, y, b)


def _linear_chunked(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> np.ndarray:
    """BLAS path: convert `chunk` rows of w at a time into ONE reused f32 scratch.
    x [M, K], w [N, K], y [M, N]."""
    N, K = w.shape
    blas_threads()
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


def linear_quantized(x: np.ndarray, w: QuantizedWeight, y: np.ndarray) -> np.ndarray:
    """y [M, N] = x [M, K] @ w.T on the integer kernels (quant/kernels_int8.py, kernels_q4k.py), any M."""
    qw, ws = w.panels
    if w.format == "q4_k":  # q8_K activations per 256 (quant/kernels_q4k.py)
        xq, xs, xc = quantize_rows_k_entry(x, ws.shape[1] * 256)
    else:
        xq, xs, xc = quantize_rows_entry(x, ws.shape[1] * 32)
    (_gemv_quant_par if use_parallel(x.shape[0] * w.shape[0] * x.shape[1]) else _gemv_quant_ser)(xq, xs, xc, qw, ws, y)
    return y


def linear(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ w.T. x [M, K] float32, w [N, K] uint16 (bf16) / float32 / float16 -> [M, N] f32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    M, K = x.shape
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"linear: x has {K} features, weight has {Kw} columns (shape {list(w.shape)})")
    y = np.empty((M, N), dtype=np.float32) if out is None else out
    if isinstance(w, QuantizedWeight):  # q8_0 / q4_0 / q4_k panels: every row count, prefill included
        return linear_quantized(x, w, y)
    if isinstance(w, StoredWeight):  # a pre-quantized checkpoint's weight (quant/stored.py), any M
        return w.linear(x, y, M > 0 and use_parallel(M * N * K))
    panels = getattr(w, "panels", None)  # a PackedBF16 weight (kernels/panels.py)
    w = np.asarray(w)  # the plain array for the other paths
    if panels is not None and M > 0:
        # the driver picked here, not inside numba: a Python call of panels.gemv_panels would
        # compile it with both drivers, the parallel one even at one thread (docs/cold_start.md)
        (_gemv_panels_par if use_parallel(M * N * K) else _gemv_panels_ser)(x, panels, y)
        return y
    if M > GEMV_MAX_ROWS or w.dtype not in (np.uint16, np.float32) or M == 0:
        return _linear_chunked(x, w, y)
    if not w.flags.c_contiguous:  # memmap views are contiguous; anything else is copied once
        w = np.ascontiguousarray(w)
    (_gemv_par if use_parallel(M * N * K) else _gemv_ser)(x, w, y)
    return y
