"""Pre-quantized checkpoints computed on as stored: the registry and the weight object
(docs/quantization.md, "Checkpoints quantized by others").

    entries = plan_stored(directory, raw_infos, raw_get)   # checkpoint.open_checkpoint's hook
    w = entries["model.layers.0.mlp.down_proj.weight"].load(raw_get)   # StoredWeight [N, K]
    y = w.linear(x, y, parallel)                                       # kernels/linear.py's hook

`config.json`'s `quantization_config.quant_method` picks the format family, each in its own
module: `fp8.py` (quant_method "fp8": FP8 e4m3 with block scales), `compressed_tensors.py`
(pack-quantized int4, int-quantized int8 weight-only or W8A8, float-quantized FP8), `awq_gptq.py`
(AWQ GEMM and GPTQ int4). A planner turns the raw tensor inventory into one `Entry` per quantized
linear: the logical name `X.weight`, its [out, in] shape and the raw tensors it consumes
(scales, zeros, g_idx, shapes), so the families' inventory checks see the dense model's names and
shapes and never the auxiliary tensors. Anything a planner does not implement is a
`StoredFormatError` naming the file, the key, the expected and the actual value.

A `StoredWeight` keeps the weight at its stored bits (a memory-mapped view where the stored
layout is the kernel's layout, else one repack to the same bit width) plus small f32 scale
grids; its kernels (`bytes_kernel.py`: one byte per weight through a 256-entry table;
`int4.py`: packed nibbles; `w8a8.py`: integer products with per-token int8 activations)
dequantize a block / group on the fly inside the GEMV. `dequantize()` is the numpy definition
the kernels are tested against (and what the numpy device computes with).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import DFlashError, StoredFormatError

# safetensors dtypes only a quantized checkpoint may hold (numpy dtype handed out: raw bits)
STORED_DTYPES = {"F8_E4M3": np.uint8, "I8": np.int8, "U8": np.uint8, "I32": np.int32, "I64": np.int64}
FLOAT_DTYPES = ("BF16", "F16", "F32")
SHARED = ("lut",)  # arrays one table serves every weight with (not counted per weight)


class StoredWeight:
    """A linear weight [N, K] held as stored. `kind` names the kernel ("bytes", "int4", "w8a8"),
    `format` the stored format (inspect's label), `arrays` what is resident."""

    ndim = 2

    def __init__(self, kind: str, fmt: str, shape, arrays: dict, matmul: Callable, dequant: Callable):
        self.kind, self.format, self.shape, self.arrays = kind, fmt, tuple(int(s) for s in shape), arrays
        self._matmul, self._dequant = matmul, dequant

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for k, a in self.arrays.items() if isinstance(a, np.ndarray) and k not in SHARED)

    def linear(self, x: np.ndarray, y: np.ndarray, parallel: bool) -> np.ndarray:
        """y [M, N] = x [M, K] f32 @ W.T, W dequantized block by block inside the kernel."""
        return self._matmul(self.arrays, x, y, parallel)

    def dequantize(self) -> np.ndarray:
        """The dense f32 [N, K] the stored bits stand for (numpy; tests and the numpy device)."""
        return self._dequant(self.arrays, self.shape)

    name = "weight"  # the logical tensor name, set by Entry.load
    dtype = np.dtype("V1")  # no numeric dtype: as_f32 / np.asarray reach __array__'s refusal

    def __array__(self, dtype=None, copy=None):
        """Code that reads this weight as a plain array (a family whose loader bypasses
        ops.prepare_weight / linear for it) gets a named refusal, never a silent dense copy."""
        raise StoredFormatError(
            f"tensor '{self.name}' is stored quantized ({self.format}); this model reads it as a plain array "
            "(expected a linear weight used through ops.linear): not supported for this tensor")

    def __repr__(self) -> str:
        return f"StoredWeight({self.format}, shape={list(self.shape)}, {self.nbytes} bytes)"


@dataclass
class Entry:
    """One quantized linear as a planner found it (nothing read yet but small shape tensors)."""

    name: str  # logical tensor name, "X.weight"
    format: str  # inspect's label, e.g. "fp8-e4m3 block 128x128"
    shape: tuple[int, int]  # [out, in]
    parts: dict[str, str]  # role -> raw tensor name
    build: Callable[["Entry", dict], StoredWeight]
    resident: int  # bytes the loaded StoredWeight holds
    file: Path
    params: dict = field(default_factory=dict)

    def load(self, raw_get: Callable[[str], np.ndarray]) -> StoredWeight:
        w = self.build(self, {role: raw_get(n) for role, n in self.parts.items()})
        w.name = self.name
        return w


# ------------------------------------------------------------------ helpers for the planners
def refuse(where, key: str, expected: str, actual) -> StoredFormatError:
    return StoredFormatError(f"{where}: {key}: expected {expected}, got {actual!r:.200}")


def cfg_value(qcfg: dict, key: str, where, kinds: tuple, default=None, required: bool = False, prefix="quantization_config"):
    """qcfg[key] type-checked (bool is never an int here)."""
    if key not in qcfg or qcfg[key] is None:
        if required:
            raise refuse(where, f"{prefix}.{key}", f"a value of type {'/'.join(k.__name__ for k in kinds)}", "absent")
        return default
    v = qcfg[key]
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise refuse(where, f"{prefix}.{key}", f"a value of type {'/'.join(k.__name__ for k in kinds)}", v)
    return v


def name_list(qcfg: dict, key: str, where, prefix="quantization_config") -> list[str]:
    v = qcfg.get(key) or []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise refuse(where, f"{prefix}.{key}", "a list of module names", v)
    return v


def matches_substring(module: str, names: list[str]) -> bool:
    """transformers' `modules_to_not_convert` rule (FP8, AWQ, GPTQ): a listed key anywhere in the
    module's dotted name."""
    return any(n and n in module for n in names)


def matches_ct(module: str, patterns: list[str], linear: bool = True) -> bool:
    """compressed-tensors' target / ignore rule: "re:<regex>" matched from the start of the
    module name, a class name ("Linear": every linear module), or the exact module name."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p == module or (linear and p == "Linear"):
            return True
    return False


def linear_modules(infos: dict, suffixes: tuple[str, ...]) -> list[str]:
    """Module names X of every 2-D `X.weight` (not an embedding) and every X owning a tensor
    ending in one of `suffixes` ("." + suffix)."""
    out = set()
    for name, t in infos.items():
        if name.endswith(".weight") and len(t.shape) == 2 and "embed" not in name.rsplit(".", 2)[-2]:
            out.add(name[: -len(".weight")])
        for s in suffixes:
            if name.endswith("." + s):
                out.add(name[: -len(s) - 1])
    return sorted(out)


def need(infos: dict, name: str, dtypes: tuple[str, ...], ndim: int, where) -> object:
    """The raw tensor `name`, of one of `dtypes` and `ndim` dimensions, or a refusal."""
    if name not in infos:
        raise StoredFormatError(f"{where}: tensor '{name}' missing (expected by quantization_config)")
    t = infos[name]
    if t.dtype not in dtypes:
        raise StoredFormatError(f"{t.file}: tensor '{name}': dtype expected {' / '.join(dtypes)}, got {t.dtype}")
    if len(t.shape) != ndim:
        raise StoredFormatError(f"{t.file}: tensor '{name}': expected {ndim} dimensions, got shape {list(t.shape)}")
    return t


def check_shape(t, expected: tuple, why: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        raise StoredFormatError(f"{t.file}: tensor '{t.name}': shape expected {list(expected)}{why}, "
                                f"got {list(t.shape)}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scales_f32(a: np.ndarray) -> np.ndarray:
    """A scale tensor (f32, f16, or bf16 bits) as a fresh C-contiguous f32 array."""
    from ..numerics import as_f32

    return np.ascontiguousarray(as_f32(np.asarray(a)), dtype=np.float32)


# ------------------------------------------------------------------ registry
def _planners() -> dict:
    from . import awq_gptq, compressed_tensors, fp8, mxfp4

    return {"fp8": fp8.plan, "compressed-tensors": compressed_tensors.plan, "awq": awq_gptq.plan_awq,
            "gptq": awq_gptq.plan_gptq, "mxfp4": mxfp4.plan}


def read_quantization_config(directory: Path) -> dict | None:
    """config.json's `quantization_config` (None when absent or when there is no config.json)."""
    from ..input_files import MAX_CONFIG_BYTES, read_json_object
    from ..errors import CorruptHeaderError

    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        raw = read_json_object(path, MAX_CONFIG_BYTES, CorruptHeaderError)
    except DFlashError:  # a broken config.json is the config loader's refusal to make, by its own rules
        return None
    q = raw.get("quantization_config")
    if q is None and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise refuse(path, "quantization_config", "a JSON object", q)
    return q


def plan_stored(directory: Path, infos: dict, raw_get: Callable, qcfg: dict | None) -> dict[str, Entry]:
    """{logical name: Entry} for a checkpoint with a quantization_config; tensors of a dtype only
    quantized checkpoints hold that no entry consumed are refused by the caller."""
    where = Path(directory) / "config.json"
    method = cfg_value(qcfg, "quant_method", where, (str,), required=True)
    planners = _planners()
    if method not in planners:
        raise refuse(where, "quantization_config.quant_method", f"one of {', '.join(planners)} "
                     "(bitsandbytes, NVFP4, HQQ, ... are not implemented)", method)
    entries = planners[method](qcfg, infos, raw_get, where)
    out = {}
    for e in entries:
        if e.name in out:
            raise StoredFormatError(f"{e.file}: tensor '{e.name}' claimed twice by the quantization plan")
        out[e.name] = e
    return out


def consumed(entries: dict[str, Entry]) -> set[str]:
    return {n for e in entries.values() for n in e.parts.values()}


def weight_dtype_rule(infos: dict, entries: dict[str, Entry], where) -> None:
    """Every raw tensor of a stored-only dtype must belong to an entry."""
    used = consumed(entries)
    for name, t in infos.items():
        if t.dtype in STORED_DTYPES and name not in used:
            raise StoredFormatError(
                f"{t.file}: tensor '{name}' has dtype {t.dtype} but quantization_config ({where}) does not "
                f"describe it as part of a quantized linear: expected {', '.join(FLOAT_DTYPES)} for an unquantized tensor")


def resident_total(entries: dict[str, Entry]) -> int:
    return sum(e.resident for e in entries.values())


def n_groups(K: int, group: int) -> int:
    return math.ceil(K / group)
