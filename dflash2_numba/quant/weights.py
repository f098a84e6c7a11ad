"""Quantized weights as the models hold them, and the one GEMV dispatch the fused engine calls.

    w = quantize_weight(bf16 [N, K], "q8_0", name)   # QuantizedWeight: .shape, .panels, .nbytes
    gemv_weights(x, w.panels, y, parallel)             # numba: bf16 panels or (qw, ws)

A QuantizedWeight REPLACES its source: it keeps no reference to the bf16 / f32 array, and the
source's pages of a memory-mapped checkpoint are handed back to the kernel once quantized
(madvise DONTNEED: a file-backed page is re-read from the page cache only if touched again), so
resident memory is the quantized panels, not panels + checkpoint. Rows are quantized in chunks
(bounded f32 scratch) and a line on stderr reports progress for big tensors.
"""

from __future__ import annotations

import mmap
import sys
import time

import numpy as np
from numba import types
from numba.extending import overload

from ..errors import QuantizeError
from ..kernels.panels import PANEL_COLS, _gemv_panels_ser, gemv_panels
from . import formats, pack_nb, q4_k
from .kernels_int8 import VNNI, _gemv_quant_ser, gemv_quant, quantize_activations

CHUNK_ELEMS = 1 << 20  # weights quantized per pass (f16 inputs: ~30 MB of numpy scratch; between passes
# the source's quantized rows go back to the OS and the progress line moves)
PROGRESS_MIN_ELEMS = 1 << 26  # tensors from this size on get a progress line


class QuantizedWeight:
    """A [N, K] weight in a llama.cpp block format, held only as integer panels (formats.py)."""

    def __init__(self, fmt: str, shape: tuple[int, int], panels: tuple[np.ndarray, np.ndarray]):
        self.format, self.shape, self.panels = fmt, tuple(shape), panels

    ndim = 2

    @property
    def size(self) -> int:  # elements of the [N, K] matrix it stands for
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.panels)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.format}, shape={list(self.shape)}, {self.nbytes} bytes)"


def quantize_weight(w: np.ndarray, fmt: str, name: str = "weight") -> QuantizedWeight:
    """A 2-D bf16 / f16 / f32 weight [N, K] -> QuantizedWeight in `fmt` (q8_0 | q4_0 | q4_k)."""
    if fmt not in formats.FORMATS:
        raise QuantizeError(f"{name}: format {fmt!r}; expected one of {', '.join(formats.FORMATS)}")
    if fmt == "q4_k":
        return _quantize_q4_k(w, name)
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.size == 0:
        raise QuantizeError(f"{name}: {fmt} needs a non-empty 2-D weight, got {getattr(w, 'shape', type(w).__name__)}")
    N, K = w.shape
    if K % formats.BLOCK:
        raise QuantizeError(f"{name}: {fmt} needs input features (shape[1]) a multiple of "
                            f"{formats.BLOCK}, got shape {list(w.shape)}")
    if w.dtype not in (np.uint16, np.float32, np.float16):
        raise QuantizeError(f"{name}: {fmt} quantizes bf16 / f16 / f32 weights, got dtype {w.dtype}")
    t0, loud = time.perf_counter(), w.size >= PROGRESS_MIN_ELEMS
    if w.dtype == np.float16:  # numpy's reference quantizers (formats.py), in row chunks
        rows = max(1, CHUNK_ELEMS // K)
        q = np.empty((N, K), np.int8)
        d = np.empty((N, K // formats.BLOCK), np.float16)
        for n0 in range(0, N, rows):
            q[n0:n0 + rows], d[n0:n0 + rows] = formats.QUANTIZERS[fmt](w[n0:n0 + rows], name)
        panels = formats.pack(q, d, fmt, unsigned=VNNI)
    else:  # bf16 bits / f32: straight into the panels (pack_nb.py), a chunk of panels at a time
        panels = pack_nb.empty_panels(N, K, fmt)
        NP = panels[0].shape[0]
        step = max(1, CHUNK_ELEMS // (formats.PANEL_COLS * K))
        for p0 in range(0, NP, step):
            p1 = min(NP, p0 + step)
            pack_nb.quantize_pack_range(w, fmt, VNNI, panels, p0, p1)
            release_pages(w[p0 * formats.PANEL_COLS:p1 * formats.PANEL_COLS])  # a row range of the source
            if loud:
                print(f"\rquantizing {name} to {fmt}: {p1 * 100 // NP}%", end="", file=sys.stderr)
    if loud:
        print(f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    release_pages(w)
    return QuantizedWeight(fmt, (N, K), panels)


def _quantize_q4_k(w: np.ndarray, name: str) -> QuantizedWeight:
    """Q4_K: llama.cpp's block bytes (quant/q4_k.py), in chunks of rows, then the panels."""
    q4_k.check(w, name)
    N, K = w.shape
    rows = max(1, 8 * CHUNK_ELEMS // K)  # f32 + block bytes: ~36 MB; big enough for the parallel quantizer
    blocks = np.empty((N, K // q4_k.QK_K, q4_k.BLOCK_BYTES), np.uint8)
    t0, loud = time.perf_counter(), w.size >= PROGRESS_MIN_ELEMS
    for n0 in range(0, N, rows):
        blocks[n0:n0 + rows] = q4_k.quantize_q4_k(w[n0:n0 + rows], name)
        if loud:
            print(f"\rquantizing {name} to q4_k: {min(N, n0 + rows) * 100 // N}%", end="", file=sys.stderr)
    if loud:
        print(f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    panels = q4_k.pack(blocks)
    release_pages(w)
    return QuantizedWeight("q4_k", (N, K), panels)


def release_pages(a: np.ndarray) -> None:
    """Hand the whole pages of a memory-mapped array back to the OS (no-op for other arrays)."""
    base = a
    while isinstance(getattr(base, "base", None), np.ndarray):
        base = base.base
    mm = getattr(base, "_mmap", None)
    if not isinstance(mm, mmap.mmap) or not hasattr(mm, "madvise"):
        return
    start = a.ctypes.data - base.ctypes.data
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


# ------------------------------------------------------------------ numba-side dispatch
def _is_quant(w) -> bool:
    return isinstance(w, types.BaseTuple) and len(w) == 2


def _is_q4k(w) -> bool:
    """Q4_K panels (qw, meta): both uint8 (q4_0's scales are uint16, q8_0's weights int8)."""
    return _is_quant(w) and w.types[1].dtype == types.uint8


def gemv_weights(x, w, y, parallel):  # pragma: no cover - typing stub, see the overload
    raise NotImplementedError


@overload(gemv_weights, inline="never", prefer_literal=True)  # a call, not inlined: numba's inliner loses scope on nested inline lambdas
def _gemv_weights(x, w, y, parallel):
    """y = x @ w.T for either kind of panels: bf16 [NP, K, 32] uint16 or quantized (qw, ws).
    A literal False `parallel` (kernels/fused.py's one-thread variants) types the serial driver
    only, so a one-thread run never compiles a parfor (prefer_literal: without it numba types
    the call with a plain bool first, and the parallel driver compiled at one thread too)."""
    serial = isinstance(parallel, types.BooleanLiteral) and not parallel.literal_value
    if _is_quant(w):  # q8_0 / q4_0 / Q4_K panels (qw, ws)
        if serial:
            def quant_serial(x, w, y, parallel):
                qw, ws = w
                xq, xs, xc = quantize_activations(x, ws)
                _gemv_quant_ser(xq, xs, xc, qw, ws, y)
            return quant_serial
        return lambda x, w, y, parallel: gemv_quant(x, w, y, parallel)
    if serial:
        return lambda x, w, y, parallel: _gemv_panels_ser(x, w, y)
    return lambda x, w, y, parallel: gemv_panels(x, w, y, parallel)


def panel_columns(w):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(panel_columns, inline="always")
def _panel_columns(w):
    """Output columns of a panel set, padding included."""
    if _is_quant(w):
        return lambda w: w[0].shape[0] * PANEL_COLS
    return lambda w: w.shape[0] * PANEL_COLS


def in_features(w):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(in_features, inline="always")
def _in_features(w):
    """K of a panel set (quantized: K % 32 == 0, quantize_weight checks it; q4_k: K % 256 == 0)."""
    if _is_q4k(w):
        return lambda w: w[1].shape[1] * q4_k.QK_K
    if _is_quant(w):
        return lambda w: w[1].shape[1] * formats.BLOCK
    return lambda w: w.shape[1]


def weight_size(w):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(weight_size, inline="always")
def _weight_size(w):
    """Elements of the panels (0: no weight, e.g. fused.NO_CONV)."""
    if _is_quant(w):
        return lambda w: w[0].size
    return lambda w: w.size
