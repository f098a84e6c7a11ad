"""quant_method "fp8" (transformers' FineGrainedFP8 layout: Qwen3-*-FP8, DeepSeek-V3 style).

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

Each quantized linear X stores `X.weight` F8_E4M3 [out, in] and `X.weight_scale_inv`
[ceil(out/bo), ceil(in/bi)] (F32, or BF16 / F16 in some releases); the weight is
W[i, j] = e4m3(X.weight[i, j]) * X.weight_scale_inv[i // bo, j // bi] (the name says "inverse":
it is the factor that multiplies the stored value back). Everything else (embeddings, norms,
usually the lm_head) is stored in bf16. Activations stay f32: "dynamic" in the config is the
per-token FP8 activation quantization of GPU kernels; on the CPU the weight-only numerics agree
with transformers' dequantized model (docs/quantization.md).

Refused (StoredFormatError): fmt other than e4m3, no weight_block_size (per-tensor FP8),
activation_scheme "static" (activation_scale tensors), scale_fmt "ue8m0", a module listed in
modules_to_not_convert that is stored quantized, an F8 weight without its scale.
"""

from __future__ import annotations

import numpy as np

from ..errors import StoredFormatError
from . import bytes_kernel
from .stored import (Entry, StoredWeight, cdiv, cfg_value, check_shape, matches_substring, name_list, need,
                     refuse, scales_f32)


def build_bytes(entry: Entry, raw: dict) -> StoredWeight:
    """A one-byte-per-weight entry: params {"lut": "e4m3" | "int8", "block": (bn, bk)}; parts
    {"weight", "scale"}. The weight stays the memory-mapped bytes; the scale grid becomes f32."""
    N, K = entry.shape
    bn, bk = entry.params["block"]
    w = raw["weight"]
    w = w.view(np.uint8) if w.dtype != np.uint8 else w
    scale = scales_f32(raw["scale"]).reshape(cdiv(N, bn), cdiv(K, bk))
    lut = bytes_kernel.E4M3 if entry.params["lut"] == "e4m3" else bytes_kernel.INT8
    arrays = {"w": w, "lut": lut, "scale": scale, "block": np.array([bn, bk], np.int64)}
    matmul = bytes_kernel.matmul_bytes
    if entry.params.get("act") == "fp8_token":  # compressed-tensors FP8_DYNAMIC: activations through e4m3
        from .fp8_act import matmul_fp8_dynamic as matmul
    return StoredWeight("bytes", entry.format, entry.shape, arrays, matmul, bytes_kernel.dequantize_bytes)


def bytes_resident(N: int, K: int, bn: int, bk: int) -> int:
    return N * K + 4 * cdiv(N, bn) * cdiv(K, bk) + 16


def plan(qcfg: dict, infos: dict, raw_get, where) -> list[Entry]:
    fmt = cfg_value(qcfg, "fmt", where, (str,), default="e4m3")
    if fmt != "e4m3":
        raise refuse(where, "quantization_config.fmt", '"e4m3"', fmt)
    act = cfg_value(qcfg, "activation_scheme", where, (str,), default="dynamic")
    if act != "dynamic":
        raise refuse(where, "quantization_config.activation_scheme", '"dynamic" (static activation scales are '
                     "not implemented)", act)
    scale_fmt = qcfg.get("scale_fmt")
    if scale_fmt not in (None, "float32", "fp32"):
        raise refuse(where, "quantization_config.scale_fmt", "absent (f32 / bf16 scales)", scale_fmt)
    block = cfg_value(qcfg, "weight_block_size", where, (list,), required=True)
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise refuse(where, "quantization_config.weight_block_size", "[rows, columns] positive integers", block)
    bn, bk = block
    skip = name_list(qcfg, "modules_to_not_convert", where)
    entries = []
    for name, t in infos.items():
        if name.endswith(".activation_scale") or name.endswith(".input_scale"):
            raise StoredFormatError(f"{t.file}: tensor '{name}': static activation scales are not implemented "
                                    f"(expected activation_scheme \"dynamic\" without them)")
        if not name.endswith(".weight_scale_inv"):
            continue
        module = name[: -len(".weight_scale_inv")]
        if matches_substring(module, skip):
            raise StoredFormatError(f"{t.file}: tensor '{name}': module '{module}' is in "
                                    f"quantization_config.modules_to_not_convert but is stored quantized")
        w = need(infos, module + ".weight", ("F8_E4M3",), 2, where)
        need(infos, name, ("F32", "BF16", "F16"), 2, where)
        N, K = w.shape
        check_shape(t, (cdiv(N, bn), cdiv(K, bk)), f" (weight {list(w.shape)}, weight_block_size {block})")
        entries.append(Entry(module + ".weight", f"fp8-e4m3 block {bn}x{bk}", (N, K),
                             {"weight": module + ".weight", "scale": name}, build_bytes,
                             bytes_resident(N, K, bn, bk), w.file, {"lut": "e4m3", "block": (bn, bk)}))
    return entries
