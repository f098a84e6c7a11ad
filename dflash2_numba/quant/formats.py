"""llama.cpp's q8_0 / q4_0 block quantizers in vectorised numpy (load time), and their panel layout.

    q, d = quantize_q8_0(w [N, K] f32)   # q [N, Kp] int8 in [-127, 127], d [N, Kp/32] float16
    q, d = quantize_q4_0(w [N, K] f32)   # q [N, Kp] int8 in [-8, 7],     d [N, Kp/32] float16
    qw, ws = pack(q, d, fmt, unsigned)     # the panels the integer kernels read

Blocks of 32 along k (K padded with zeros to Kp, a multiple of 32: a zero block quantizes to
d = 0, q = 0 and adds nothing). The math is ggml-quants.c's reference quantizers (and gguf-py's
`quants.py`, which says it is bit-exact with them), so a checkpoint quantized here equals
llama.cpp's GGUF of the same bf16 weights:
    q8_0: d = amax / 127 (f32), id = 1/d (0 if d = 0), q = roundf(x * id) (ties away from zero);
          d is stored as fp16, id is computed from the f32 d.
    q4_0: m = the element of largest magnitude (the first, signed), d = m / -8, id = 1/d,
          q = min(15, trunc(x * id + 8.5)) - 8; d stored as fp16.
The dot products use the fp16 d widened to f32 (exact).

Panel layout (kernels_int8.py reads it; N padded with zero columns to whole work items of
ITEM_COLS like the bf16 panels):
    q8: qw [NP, Kp, 32] int8, bytes of panel p ordered [k-quad kq][column c][byte j]
        = w[32p + c, 4kq + j]: one 64-byte load is 16 columns x 4 k, the operand of one
        vpdpbusd (the 4 products of a column land in that column's int32 lane). unsigned=True
        (the VNNI paths) stores q + 128 as the byte (q ^ 0x80): vpdpbusd's unsigned operand.
    q4: qw [NP, Kp/2, 32] uint8, per 32-block [pair h < 4][column c][byte j]: low nibble =
        q + 8 of k-quad h, high nibble = of k-quad h + 4 (one load + and/shift gives two
        k-quads' int8 operands in registers).
    ws [NP, Kp/32, 32] uint16: the block scales d per (panel, block, column), as fp16 BITS (llama.cpp's
        d is fp16: the kernels widen it to f32 in registers, exactly; 2 bytes a block, not 4).
(q4 nibbles stay q + 8 on every path: the kernels add -8, or +120 on the VNNI paths, in registers.)
"""

from __future__ import annotations

import numpy as np

from ..errors import QuantizeError

BLOCK = 32
FORMATS = ("q8_0", "q4_0", "q4_k")  # q4_k: quant/q4_k.py (256-weight super-blocks)
PANEL_COLS = 32
ITEM_PANELS = 4
ITEM_COLS = PANEL_COLS * ITEM_PANELS
BYTES_PER_WEIGHT = {"bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k": 144 / 256}  # llama.cpp's block sizes


def _blocks(w: np.ndarray) -> np.ndarray:
    """w [N, K] -> f32 blocks [N, Kp/32, 32], zero-padded along k."""
    N, K = w.shape
    Kp = -(-K // BLOCK) * BLOCK
    if Kp == K and w.dtype == np.float32:
        return np.ascontiguousarray(w).reshape(N, Kp // BLOCK, BLOCK)
    out = np.zeros((N, Kp), np.float32)
    out[:, :K] = w
    return out.reshape(N, Kp // BLOCK, BLOCK)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero) of f32 values: exact in f64 (|v| + 0.5 needs < 53 bits)."""
    v64 = v.astype(np.float64)
    return np.trunc(v64 + np.copysign(0.5, v64))


def quantize_q8_0(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] f32 -> (q [N, Kp] int8, d [N, Kp/32] float16), ggml's quantize_row_q8_0_ref."""
    b = _blocks(_check(w, name, "q8_0"))  # [N, nb, 32]
    d = np.abs(b).max(axis=2) / np.float32(127)  # [N, nb] f32
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = _roundf(b * inv[:, :, None]).astype(np.int8)
    return q.reshape(b.shape[0], -1), d.astype(np.float16)


def quantize_q4_0(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] f32 -> (q [N, Kp] int8 in [-8, 7], d [N, Kp/32] float16), quantize_row_q4_0_ref."""
    b = _blocks(_check(w, name, "q4_0"))  # [N, nb, 32]
    at = np.abs(b).argmax(axis=2)  # the first element of largest magnitude
    m = np.take_along_axis(b, at[:, :, None], axis=2)[:, :, 0]  # [N, nb] signed
    d = m / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = b * inv[:, :, None] + np.float32(8.5)  # f32, as the C code computes it
    q = np.minimum(15, np.trunc(v)).astype(np.int8) - np.int8(8)
    return q.reshape(b.shape[0], -1), d.astype(np.float16)


QUANTIZERS = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}


def _check(w: np.ndarray, name: str, fmt: str) -> np.ndarray:
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.size == 0:
        raise QuantizeError(f"{name}: {fmt} needs a non-empty 2-D weight, got "
                            f"{getattr(w, 'shape', type(w).__name__)}")
    if w.dtype == np.uint16:  # bf16 bits -> f32 (exact)
        return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if w.dtype not in (np.float32, np.float16):
        raise QuantizeError(f"{name}: {fmt} quantizes bf16 / f16 / f32 weights, got dtype {w.dtype}")
    return w.astype(np.float32, copy=False)


def dequantize(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(q [N, Kp], d [N, nb]) -> w [N, Kp] f32 = q * d (what the dot products compute with)."""
    N, Kp = q.shape
    return (q.reshape(N, -1, BLOCK).astype(np.float32) * d.astype(np.float32)[:, :, None]).reshape(N, Kp)


# ------------------------------------------------------------------ panel layout
def pack(q: np.ndarray, d: np.ndarray, fmt: str, unsigned: bool) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, Kp] int8, d [N, nb] f16) -> (qw, ws) in the layout of the module docstring."""
    N, Kp = q.shape
    nb = Kp // BLOCK
    NP = -(-N // ITEM_COLS) * ITEM_PANELS
    qp = np.zeros((NP * PANEL_COLS, Kp), np.int8)
    qp[:N] = q
    dp = np.zeros((NP * PANEL_COLS, nb), np.float16)
    dp[:N] = d
    ws = np.ascontiguousarray(dp.reshape(NP, PANEL_COLS, nb).transpose(0, 2, 1)).view(np.uint16)  # [NP, nb, 32] fp16 bits
    # [NP, c, kq, j] -> [NP, kq, c, j]
    quads = qp.reshape(NP, PANEL_COLS, Kp // 4, 4).transpose(0, 2, 1, 3)
    if fmt == "q8_0":
        qw = np.ascontiguousarray(quads).reshape(NP, Kp, PANEL_COLS)
        if unsigned:  # the byte q + 128 (mod 256 the same bits as q ^ 0x80)
            qw ^= np.int8(-128)
    else:  # [NP, nb, 8 kq, c, j]: nibble pair (kq h, kq h + 4)
        u = (quads.reshape(NP, nb, 8, PANEL_COLS, 4) + 8).astype(np.uint8)
        qw = np.ascontiguousarray(u[:, :, :4] | (u[:, :, 4:] << np.uint8(4))).reshape(NP, Kp // 2, PANEL_COLS)
    return qw, ws


# ------------------------------------------------------------------ memory estimates (inspect)
def resident_bytes_per_weight(fmt: str) -> float:
    """Bytes a loaded matrix weight holds per parameter in this project's layouts: bf16 panels
    2; q8_0 1 + an fp16 scale per 32 (llama.cpp's 34 bytes a block); q4_0 1/2 + the same (18);
    q4_k 1/2 + 20 bytes per 256 (six-bit scales and mins kept a byte each, fp16 d and dmin)."""
    if fmt == "bf16":
        return 2.0
    if fmt == "q4_k":
        return 0.5 + 20 / 256
    return (1.0 if fmt == "q8_0" else 0.5) + 2 / BLOCK


def is_router(name: str) -> bool:
    """A MoE router or shared-expert gate: kept as stored (bf16 panels) whatever --quantize says,
    as llama.cpp keeps ffn_gate_inp unquantized (a quantized router moves the top-k choice)."""
    return name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight"))  # router: gpt-oss


def matrix_bytes_per_weight(name: str, shape, fmt: str) -> float | None:
    """Bytes per parameter a loaded tensor holds in `fmt` (None: not a matrix: norms and other
    1-D tensors stay f32). Matrices are 2-D, and MoE experts 3-D ([E, out, in])."""
    if len(shape) == 2 or (len(shape) == 3 and ".experts." in name):
        return 2.0 if is_router(name) else resident_bytes_per_weight(fmt)
    return None


def resident_bytes(tensors: list[dict], ignored, tied: bool, embed: str = "embed_tokens.weight") -> dict:
    """{format: bytes} a target's weights keep resident once loaded, from inspect's tensor list
    ([{name, dtype, shape}]): every matrix in the format (the lm_head and MoE experts included;
    routers as stored), the untied embedding (any name ending in `embed`) not at all (rows are
    read from the memory-mapped file on demand), the rest (norms, 1-D) as f32."""
    out = {}
    for fmt in ("bf16",) + FORMATS:
        total = 0.0
        for t in tensors:
            if t["name"] in ignored:
                continue
            n = int(np.prod(t["shape"], dtype=np.int64))
            per = matrix_bytes_per_weight(t["name"], t["shape"], fmt)
            if per is None:
                total += 4 * n
            elif not t["name"].endswith(embed) or tied:
                total += per * n
        out[fmt] = int(total)
    return out
