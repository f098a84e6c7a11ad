"""MXFP4 (quant_method "mxfp4": the format openai/gpt-oss-20b / -120b ship their experts in),
computed on as stored: 4.25 bits per weight, no dense copy (docs/gpt_oss.md).

    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [...]}

Only 3-D expert tensors are MXFP4. For each `X` (e.g. `model.layers.0.mlp.experts.gate_up_proj`):

    X_blocks  U8 [E, N, K/32, 16]   two e2m1 codes a byte: LOW nibble = element 2j, HIGH = 2j+1
    X_scales  U8 [E, N, K/32]       E8M0: block b of output row n is scaled by 2^(s - 127)

    W[e, n, 32b + i] = e2m1(code_i) * 2^(scales[e, n, b] - 127),   e2m1 in {0, .5, 1, 1.5, 2, 3, 4, 6} with a sign bit

N is the output dimension (out-major, one scale per 32 inputs of one output row: what a GEMV
wants); transformers transposes the dequantized tensor to its in-major [E, K, N] parameter.
The planner turns each pair into ONE logical tensor `X_blocks` of the dense shape [E, N, K]
(dtype label "mxfp4"), so the family's inventory sees shapes, never the auxiliary scales;
loaded, it is an `Mxfp4Experts` whose `expert(e)` is a StoredWeight [N, K] over memory-mapped
views (zero-copy).

Kernel: quant/mxfp4_gemv.py computes on these bytes in place with f32 activations (the codes
become e2m1 values in registers by a table permute, the block scale joins in the epilogue), rows,
threads and instruction-set paths bit-identical, so a Q-row product equals Q one-row products bit
for bit. `dequantize_mxfp4` (numpy) is the definition the kernel is tested against, and
transformers' `convert_moe_packed_tensors` the oracle of that (tests/test_gpt_oss.py).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import numpy as np

from ..errors import StoredFormatError
from .mxfp4_gemv import E2M1, gemv_mxfp4
from .stored import Entry, StoredWeight, name_list, refuse

BLOCK = 32


# ------------------------------------------------------------------ numpy reference
def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8 [..., N, K/32, 16], scales u8 [..., N, K/32] -> dense f32 [..., N, K]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1)  # [..., N, K/32, 16, 2]: low nibble first
    vals = E2M1[codes].reshape(blocks.shape[:-1] + (BLOCK,))  # [..., N, K/32, 32]
    vals = vals * np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)[..., None]
    return vals.reshape(blocks.shape[:-2] + (-1,)).astype(np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense [..., N, K] (K % 32 == 0) -> (blocks, scales) by the OCP MX rule: per block the
    shared exponent floor(log2 amax) - 2 (e2m1's largest exponent), each element rounded to the
    nearest e2m1 value. For test fixtures: the format's definition is `dequantize_mxfp4`."""
    w = np.asarray(w, np.float32)
    *lead, N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"quantize_mxfp4: K = {K} is not a multiple of {BLOCK}")
    x = w.reshape(*lead, N, K // BLOCK, BLOCK)
    amax = np.abs(x).max(axis=-1)  # [..., N, K/32]
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).astype(np.int32)
    e = np.clip(e, -127, 127)
    y = x / np.ldexp(np.float32(1.0), e)[..., None]  # in units of the block scale
    codes = np.abs(np.abs(y)[..., None] - E2M1[None, :8]).argmin(axis=-1).astype(np.uint8)  # nearest magnitude
    codes |= np.where(y < 0, 8, 0).astype(np.uint8)
    pairs = codes.reshape(*lead, N, K // BLOCK, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)


# ------------------------------------------------------------------ the product
def matmul_mxfp4(arrays: dict, x: np.ndarray, y: np.ndarray, parallel: bool) -> np.ndarray:
    """y [M, N] = x [M, K] f32 @ W.T with W = dequantize_mxfp4(blocks, scales) [N, K]."""
    return gemv_mxfp4(x, arrays["blocks"], arrays["scales"], y, parallel)


def _dequant(arrays: dict, shape) -> np.ndarray:
    return dequantize_mxfp4(arrays["blocks"], arrays["scales"])


# ------------------------------------------------------------------ the loaded tensor
class Mxfp4Experts:
    """One MXFP4 expert tensor [E, N, K] as stored: blocks [E, N, K/32, 16], scales [E, N, K/32]
    (memory-mapped views). `expert(e)` -> StoredWeight [N, K] (kind "mxfp4") for ops.linear."""

    format = "mxfp4"

    def __init__(self, blocks: np.ndarray, scales: np.ndarray, name: str = "experts"):
        self.blocks, self.scales, self.name = blocks, scales, name
        E, N, nb, _ = blocks.shape
        self.shape = (E, N, nb * BLOCK)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def expert(self, e: int) -> StoredWeight:
        arrays = {"blocks": self.blocks[e], "scales": self.scales[e]}  # views: no copy
        w = StoredWeight("mxfp4", "mxfp4", self.shape[1:], arrays, matmul_mxfp4, _dequant)
        w.name = f"{self.name}[{e}]"
        return w

    def dequantize(self) -> np.ndarray:
        return dequantize_mxfp4(self.blocks, self.scales)


def _build(entry: Entry, raw: dict) -> Mxfp4Experts:
    return Mxfp4Experts(raw["blocks"], raw["scales"], entry.name)


def plan(qcfg: dict, infos: dict, raw_get, where) -> list[Entry]:
    """Every `X_blocks` / `X_scales` pair -> an Entry `X_blocks` of dense shape [E, N, K]."""
    skip = name_list(qcfg, "modules_to_not_convert", where)
    entries = []
    for name, t in infos.items():
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in infos:
            raise StoredFormatError(f"{t.file}: tensor '{name}' has no '{name[:-len('_scales')]}_blocks' beside it "
                                    "(MXFP4 stores each tensor as a _blocks / _scales pair)")
        if not name.endswith("_blocks"):
            continue
        base = name[: -len("_blocks")]
        module = base.rsplit(".", 1)[0]
        if any(fnmatchcase(module, pat) or fnmatchcase(module, pat + ".*") for pat in skip):
            raise StoredFormatError(f"{t.file}: tensor '{name}': module '{module}' is in "
                                    "quantization_config.modules_to_not_convert but is stored as MXFP4")
        s = infos.get(base + "_scales")
        if s is None:
            raise StoredFormatError(f"{t.file}: tensor '{name}' has no '{base}_scales' beside it "
                                    "(MXFP4 stores each tensor as a _blocks / _scales pair)")
        if t.dtype != "U8" or s.dtype != "U8":
            raise StoredFormatError(f"{t.file}: tensor '{name}' / '{base}_scales': dtype expected U8 / U8, "
                                    f"got {t.dtype} / {s.dtype}")
        if len(t.shape) != 4 or t.shape[-1] != 16:
            raise refuse(t.file, f"tensor '{name}' shape", "[E, N, K/32, 16]", list(t.shape))
        if tuple(s.shape) != tuple(t.shape[:-1]):
            raise refuse(s.file, f"tensor '{base}_scales' shape", f"{list(t.shape[:-1])} (the blocks' "
                         f"{list(t.shape)} without the last axis)", list(s.shape))
        E, N, nb, _ = t.shape
        entries.append(Entry(name, "mxfp4", (E, N, nb * BLOCK), {"blocks": name, "scales": base + "_scales"},
                             _build, t.end - t.begin + s.end - s.begin, t.file))
    return entries
