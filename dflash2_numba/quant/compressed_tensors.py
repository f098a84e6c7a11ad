"""quant_method "compressed-tensors" (llm-compressor / RedHatAI checkpoints).

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": ..., "weights": {"num_bits": 4,
            "type": "int", "symmetric": true, "strategy": "group", "group_size": 128, ...},
            "input_activations": null, "output_activations": null}}}

A linear module is quantized iff a config group targets it ("Linear", "re:<regex>" from the
start of the name, or the exact name) and `ignore` does not list it; its stored tensors must
agree (an ignored module stored quantized, or a targeted one stored dense, is refused).

Implemented (weights: `X.weight_scale` [N, 1] channel / [N, ceil(K/g)] group / [1] tensor /
block grid):
- pack-quantized, int 4-bit, symmetric or asymmetric, channel / group / tensor strategy:
  `X.weight_packed` I32 [N, ceil(K/8)] (codes + 8, least significant nibble first: int4.py's
  layout as stored), `X.weight_shape` [2], asymmetric `X.weight_zero_point` I32 [ceil(N/8), G]
  (signed zero + 8, packed along the output dimension): W = (q - zero) * scale. A
  `X.weight_g_idx` (activation-ordered groups) is refused: compressed-tensors 0.20 itself no
  longer reads it, so there is no reference to follow.
- int-quantized / naive-quantized 8-bit symmetric: `X.weight` I8; weight-only (f32
  activations) or W8A8 with dynamic per-token int8 activations (w8a8.py).
- float-quantized FP8 e4m3: `X.weight` F8_E4M3, any scale strategy; weight-only, or with FP8
  dynamic per-token activations ("FP8_DYNAMIC", fp8_act.py).
Refused: every other format (nvfp4-pack-quantized, mxfp4, sparse-24, marlin-24,
sparse-bitmask), a sparsity / transform config, a KV-cache scheme, activation schemes other
than none and int8 / FP8 dynamic per-token symmetric, static
activation scales, output activations, asymmetric 8-bit weights.
"""

from __future__ import annotations

import numpy as np

from ..errors import StoredFormatError
from . import int4, w8a8
from .awq_gptq import seq_unpack_cols
from .fp8 import build_bytes, bytes_resident
from .stored import (Entry, StoredWeight, cdiv, cfg_value, linear_modules, matches_ct, name_list, need, refuse,
                     scales_f32)

AUX = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
       "input_scale", "input_zero_point", "weight_global_scale", "input_global_scale")
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def _args(d, where, key) -> dict:
    if not isinstance(d, dict):
        raise refuse(where, key, "a JSON object of quantization args", d)
    return d


def _scale_block(strategy: str, args: dict, N: int, K: int, where, key) -> tuple[int, int]:
    """(bn, bk) of one scale for a weight [N, K] under `strategy`."""
    if strategy == "tensor":
        return N, K
    if strategy == "channel":
        return 1, K
    if strategy == "group":
        g = cfg_value(args, "group_size", where, (int,), required=True, prefix=key)
        if g <= 0:
            raise refuse(where, f"{key}.group_size", "a positive integer", g)
        return 1, g
    if strategy == "block":
        b = args.get("block_structure")
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(v, int) and v > 0 for v in b)):
            raise refuse(where, f"{key}.block_structure", "[rows, columns]", b)
        return b[0], b[1]
    raise refuse(where, f"{key}.strategy", "tensor, channel, group or block", strategy)


def _build_int4(entry: Entry, raw: dict) -> StoredWeight:
    N, K = entry.shape
    bk = entry.params["block"][1]
    G = cdiv(K, bk)
    packed = np.asarray(raw["weight_packed"]).view(np.uint32)  # the stored words, memory-mapped
    scale = scales_f32(raw["weight_scale"]).reshape(-1)
    scale = np.broadcast_to(scale.reshape(1, -1) if scale.size == 1 else scale.reshape(N, G), (N, G)).copy()
    if "weight_zero_point" in raw:  # packed along dim 0: [ceil(N/8), G] -> [N, G]; code = signed zero + 8
        zero = np.ascontiguousarray(seq_unpack_cols(np.ascontiguousarray(np.asarray(raw["weight_zero_point"]).T))[:, :N].T)
    else:
        zero = np.full((N, G), 8, np.uint8)
    seg, sg = int4.group_segments(K, bk)
    arrays = int4.make_arrays(packed, zero, scale, seg, sg)
    return StoredWeight("int4", entry.format, (N, K), arrays, int4.matmul_int4, int4.dequantize_int4)


def _build_w8a8(entry: Entry, raw: dict) -> StoredWeight:
    N, _ = entry.shape
    arrays = {"w": raw["weight"], "scale": np.ascontiguousarray(scales_f32(raw["scale"]).reshape(N))}
    return StoredWeight("w8a8", entry.format, entry.shape, arrays, w8a8.matmul_w8a8, w8a8.dequantize_w8a8)


def plan(qcfg: dict, infos: dict, raw_get, where) -> list[Entry]:
    status = qcfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(where, "quantization_config.quantization_status", '"compressed"', status)
    for key in ("transform_config", "kv_cache_scheme"):
        if qcfg.get(key):
            raise refuse(where, f"quantization_config.{key}", "null (not implemented)", qcfg[key])
    sp = qcfg.get("sparsity_config")
    if sp and (not isinstance(sp, dict) or sp.get("format", "dense") != "dense"):
        raise refuse(where, "quantization_config.sparsity_config", "null or format dense (2:4 / bitmask sparsity "
                     "is not implemented)", sp)
    groups = cfg_value(qcfg, "config_groups", where, (dict,), required=True)
    ignore = name_list(qcfg, "ignore", where)
    global_fmt = qcfg.get("format")
    entries = []
    for X in linear_modules(infos, AUX):
        stored_q = [X + "." + s for s in AUX if X + "." + s in infos]
        if matches_ct(X, ignore):
            if stored_q:
                raise StoredFormatError(f"{infos[stored_q[0]].file}: tensor '{stored_q[0]}': module '{X}' is in "
                                        "quantization_config.ignore but is stored quantized")
            continue
        hit = [name for name, grp in groups.items()
               if isinstance(grp, dict) and matches_ct(X, name_list(grp, "targets", where, f"config_groups.{name}"))]
        if not hit:
            if stored_q:
                raise StoredFormatError(f"{infos[stored_q[0]].file}: tensor '{stored_q[0]}': no config group of "
                                        f"quantization_config targets module '{X}'")
            continue
        key = f"quantization_config.config_groups.{hit[0]}"
        grp = groups[hit[0]]
        entries.append(_plan_module(X, grp, grp.get("format") or global_fmt, infos, raw_get, where, key))
    return entries


def _plan_module(X, grp, fmt, infos, raw_get, where, key) -> Entry:
    if fmt not in FORMATS:
        raise refuse(where, f"{key}.format", f"one of {', '.join(FORMATS)}", fmt)
    args = _args(grp.get("weights"), where, f"{key}.weights")
    if grp.get("output_activations"):
        raise refuse(where, f"{key}.output_activations", "null", grp["output_activations"])
    bits = cfg_value(args, "num_bits", where, (int,), required=True, prefix=f"{key}.weights")
    qtype = cfg_value(args, "type", where, (str,), default="int", prefix=f"{key}.weights")
    sym = cfg_value(args, "symmetric", where, (bool,), default=True, prefix=f"{key}.weights")
    strategy = cfg_value(args, "strategy", where, (str,), default="tensor", prefix=f"{key}.weights")
    if args.get("dynamic"):
        raise refuse(where, f"{key}.weights.dynamic", "false", args["dynamic"])
    inp = grp.get("input_activations")
    act = None
    if inp:
        inp = _args(inp, where, f"{key}.input_activations")
        act = (inp.get("num_bits"), inp.get("type"), inp.get("strategy"), inp.get("dynamic"), inp.get("symmetric", True))
        ok = {"int-quantized": (8, "int", "token", True, True), "naive-quantized": (8, "int", "token", True, True),
              "float-quantized": (8, "float", "token", True, True)}.get(fmt)
        if act != ok:
            raise refuse(where, f"{key}.input_activations", "null, or int8 (int-quantized) / FP8 (float-quantized) "
                         "dynamic per-token symmetric", inp)
    if fmt == "pack-quantized":
        if (qtype, bits) != ("int", 4):
            raise refuse(where, f"{key}.weights", "int 4-bit for pack-quantized", {"type": qtype, "num_bits": bits})
        shape_t = need(infos, X + ".weight_shape", ("I64", "I32"), 1, where)
        N, K = (int(v) for v in np.asarray(raw_get(shape_t.name)))
        packed = need(infos, X + ".weight_packed", ("I32",), 2, where)
        if tuple(packed.shape) != (N, cdiv(K, 8)):
            raise StoredFormatError(f"{packed.file}: tensor '{packed.name}': shape expected {[N, cdiv(K, 8)]} "
                                    f"(weight_shape {[N, K]}), got {list(packed.shape)}")
        if strategy == "block":
            raise refuse(where, f"{key}.weights.strategy", "channel, group or tensor for pack-quantized", strategy)
        bn, bk = _scale_block(strategy, args, N, K, where, f"{key}.weights")
        G = cdiv(K, bk)
        sc = need(infos, X + ".weight_scale", ("F32", "BF16", "F16"), len(infos[X + ".weight_scale"].shape)
                  if X + ".weight_scale" in infos else 2, where)
        if int(np.prod(sc.shape)) not in ((1,) if strategy == "tensor" else (N * G,)):
            raise StoredFormatError(f"{sc.file}: tensor '{sc.name}': expected {N}x{G} scales ({strategy}), got "
                                    f"shape {list(sc.shape)}")
        parts = {"weight_packed": packed.name, "weight_scale": sc.name, "weight_shape": shape_t.name}
        if not sym:
            if strategy == "tensor":
                raise refuse(where, f"{key}.weights", "symmetric for the tensor strategy", args)
            zp = need(infos, X + ".weight_zero_point", ("I32",), 2, where)
            if tuple(zp.shape) != (cdiv(N, 8), G):
                raise StoredFormatError(f"{zp.file}: tensor '{zp.name}': shape expected {[cdiv(N, 8), G]}, got "
                                        f"{list(zp.shape)}")
            parts["weight_zero_point"] = zp.name
        elif X + ".weight_zero_point" in infos:
            raise StoredFormatError(f"{where}: tensor '{X}.weight_zero_point' present but {key}.weights is symmetric")
        if X + ".weight_g_idx" in infos:  # the library (0.20) itself no longer reads it: no reference to follow
            raise StoredFormatError(f"{infos[X + '.weight_g_idx'].file}: tensor '{X}.weight_g_idx': activation-ordered "
                                    "groups (g_idx) are not implemented for compressed-tensors; expected no weight_g_idx")
        label = f"ct-int4 {'sym' if sym else 'asym'} {strategy}{bk if strategy == 'group' else ''}"
        return Entry(X + ".weight", label, (N, K), parts, _build_int4, int4.resident(N, K, G, False), packed.file,
                     {"block": (bn, bk)})
    # one byte per weight: int8 (int / naive) or FP8 e4m3 (float)
    want = ("int", 8, "I8") if fmt in ("int-quantized", "naive-quantized") else ("float", 8, "F8_E4M3")
    if (qtype, bits) != want[:2]:
        raise refuse(where, f"{key}.weights", f"{want[0]} {want[1]}-bit for {fmt}", {"type": qtype, "num_bits": bits})
    if not sym or X + ".weight_zero_point" in infos:
        raise refuse(where, f"{key}.weights.symmetric", "true (asymmetric 8-bit weights are not implemented)", sym)
    if X + ".input_scale" in infos:
        raise StoredFormatError(f"{infos[X + '.input_scale'].file}: tensor '{X}.input_scale': static activation "
                                "scales are not implemented")
    w = need(infos, X + ".weight", (want[2],), 2, where)
    N, K = w.shape
    bn, bk = _scale_block(strategy, args, N, K, where, f"{key}.weights")
    sc = infos.get(X + ".weight_scale")
    if sc is None:
        raise StoredFormatError(f"{where}: tensor '{X}.weight_scale' missing (expected by {key})")
    need(infos, sc.name, ("F32", "BF16", "F16"), len(sc.shape), where)
    if int(np.prod(sc.shape)) != cdiv(N, bn) * cdiv(K, bk):
        raise StoredFormatError(f"{sc.file}: tensor '{sc.name}': expected {cdiv(N, bn)}x{cdiv(K, bk)} scales "
                                f"({strategy}), got shape {list(sc.shape)}")
    parts = {"weight": w.name, "scale": sc.name}
    if act is not None and want[0] == "float":  # FP8_DYNAMIC: e4m3 activations per token (fp8_act.py)
        return Entry(X + ".weight", f"ct-fp8-e4m3 {strategy}, fp8 per-token activations", (N, K), parts, build_bytes,
                     bytes_resident(N, K, bn, bk), w.file, {"lut": "e4m3", "block": (bn, bk), "act": "fp8_token"})
    if act is not None:
        if strategy != "channel":
            raise refuse(where, f"{key}.weights.strategy", "channel for W8A8", strategy)
        return Entry(X + ".weight", "ct-w8a8 int8 channel, int8 per-token activations", (N, K), parts,
                     _build_w8a8, N * K + 4 * N, w.file)
    lut = "int8" if want[0] == "int" else "e4m3"
    label = f"ct-{'int8' if lut == 'int8' else 'fp8-e4m3'} {strategy}"
    return Entry(X + ".weight", label, (N, K), parts, build_bytes, bytes_resident(N, K, bn, bk), w.file,
                 {"lut": lut, "block": (bn, bk)})
