"""AWQ (GEMM packing) and GPTQ int4 checkpoints, repacked once at load into int4.py's layout
(4 bits a weight stay 4 bits; the stored arrays are never widened to a dense float copy).

AWQ (`quant_method "awq"`, `version "gemm"`, `bits 4`, `zero_point true`): per linear X
    X.qweight I32 [in, out/8]    eight 4-bit codes per int32 along `out`; nibble i (bits 4i..4i+3)
                                 of word c is output column 8c + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
                                 (AutoAWQ's packing order; its reader undoes it with [0, 4, 1, 5, 2, 6, 3, 7])
    X.qzeros  I32 [in/g, out/8]  the zero codes, packed the same way
    X.scales  F16 [in/g, out]
    W[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]

GPTQ (`quant_method "gptq"`, `bits 4`, `group_size` g (-1: one group), `desc_act`,
`checkpoint_format` "gptq" (v1) or "gptq_v2"): per linear X
    X.qweight I32 [in/8, out]    eight codes per int32 along `in`, least significant nibble first
    X.qzeros  I32 [G, out/8]     zero codes along `out`, least significant nibble first;
                                 v1 stores zero - 1, so the zero is the stored code + 1 (v2: as stored)
    X.scales  F16 [G, out]
    X.g_idx   I32 [in]           group of each input column (absent: i // g); desc_act checkpoints
                                 hold a permuted, non-monotone g_idx
    W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]

Refused (StoredFormatError): bits other than 4, AWQ versions other than gemm (gemv, marlin,
exllama packings), AWQ without zero points, other checkpoint_formats (marlin, ...), biases are
left to the family's inventory (unexpected tensors).
"""

from __future__ import annotations

import numpy as np

from ..errors import StoredFormatError
from . import int4
from .weights import release_pages
from .stored import (Entry, StoredWeight, cdiv, cfg_value, check_shape, matches_substring, name_list, need,
                     refuse, scales_f32)

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i of a word holds column 8c + AWQ_ORDER[i]
ROWS = 512  # output rows repacked per numpy pass (bounded scratch at load)


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i = bits 4i..4i+3."""
    w = np.ascontiguousarray(words).view(np.uint32)
    return ((w[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & np.uint32(15)).astype(np.uint8)


def awq_unpack_cols(words: np.ndarray) -> np.ndarray:
    """AWQ words [R, C] packed along columns -> codes [R, 8C] in the model's column order."""
    nib = _nibbles(words)  # [R, C, 8]
    out = np.empty_like(nib)
    out[:, :, AWQ_ORDER] = nib
    return out.reshape(words.shape[0], -1)


def seq_unpack_cols(words: np.ndarray) -> np.ndarray:
    """Words [R, C] packed along columns least significant nibble first -> codes [R, 8C]."""
    return _nibbles(words).reshape(words.shape[0], -1)


# ------------------------------------------------------------------ AWQ
def build_awq(entry: Entry, raw: dict) -> StoredWeight:
    N, K = entry.shape
    g = entry.params["group"]
    qw, qz = raw["qweight"], raw["qzeros"]
    packed = np.empty((N, cdiv(K, 8)), np.uint32)
    for c0 in range(0, N // 8, ROWS // 8):  # output columns 8*c0 .. in chunks
        c1 = min(N // 8, c0 + ROWS // 8)
        codes = awq_unpack_cols(qw[:, c0:c1])  # [K, 8(c1-c0)]
        packed[8 * c0:8 * c1] = int4.pack_codes(np.ascontiguousarray(codes.T))
    release_pages(qw)  # repacked: the stored words' file pages go back to the page cache
    zero = np.ascontiguousarray(awq_unpack_cols(qz).T)  # [N, G]
    scale = np.ascontiguousarray(scales_f32(raw["scales"]).T)  # [N, G]
    seg, sg = int4.group_segments(K, g)
    arrays = int4.make_arrays(packed, zero, scale, seg, sg)
    return StoredWeight("int4", entry.format, (N, K), arrays, int4.matmul_int4, int4.dequantize_int4)


def plan_awq(qcfg: dict, infos: dict, raw_get, where) -> list[Entry]:
    bits = cfg_value(qcfg, "bits", where, (int,), default=cfg_value(qcfg, "w_bit", where, (int,), default=4))
    if bits != 4:
        raise refuse(where, "quantization_config.bits", "4", bits)
    version = cfg_value(qcfg, "version", where, (str,), default="gemm")
    if version.lower() != "gemm":
        raise refuse(where, "quantization_config.version", '"gemm" (AWQ\'s GEMM packing)', version)
    if cfg_value(qcfg, "zero_point", where, (bool,), default=True) is not True:
        raise refuse(where, "quantization_config.zero_point", "true", qcfg.get("zero_point"))
    g = cfg_value(qcfg, "group_size", where, (int,), default=cfg_value(qcfg, "q_group_size", where, (int,), default=128))
    skip = name_list(qcfg, "modules_to_not_convert", where)
    entries = []
    for name, X in qweight_modules(infos, skip):
        qw = need(infos, name, ("I32",), 2, where)
        K, N = qw.shape[0], qw.shape[1] * 8
        if g <= 0 or K % g:
            raise refuse(where, "quantization_config.group_size", f"a positive divisor of {X}'s {K} input features", g)
        qz = need(infos, X + ".qzeros", ("I32",), 2, where)
        sc = need(infos, X + ".scales", ("F16", "BF16", "F32"), 2, where)
        check_shape(qz, (K // g, N // 8), f" (qweight {list(qw.shape)}, group_size {g})")
        check_shape(sc, (K // g, N), f" (qweight {list(qw.shape)}, group_size {g})")
        entries.append(Entry(X + ".weight", f"awq-int4 g{g}", (N, K),
                             {"qweight": name, "qzeros": X + ".qzeros", "scales": X + ".scales"}, build_awq,
                             int4.resident(N, K, K // g, False), qw.file, {"group": g}))
    return entries


# ------------------------------------------------------------------ GPTQ
def build_gptq(entry: Entry, raw: dict) -> StoredWeight:
    N, K = entry.shape
    g, v1 = entry.params["group"], entry.params["v1"]
    qw = np.ascontiguousarray(raw["qweight"]).view(np.uint32)  # [K/8, N]
    zero = seq_unpack_cols(raw["qzeros"])[:, :N].T.astype(np.int32)  # [N, G]
    if v1:
        zero = zero + 1  # v1 stores zero - 1 (a stored 15 is a zero of 16)
    zero = np.ascontiguousarray(zero, np.uint8)
    scale = np.ascontiguousarray(scales_f32(raw["scales"]).T)  # [N, G]
    G = scale.shape[1]
    g_idx = np.asarray(raw["g_idx"], np.int64) if "g_idx" in raw else np.arange(K) // g
    if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= G:
        raise StoredFormatError(f"{entry.file}: tensor '{entry.parts.get('g_idx')}': group indices expected in "
                                f"0..{G - 1}, got {int(g_idx.min())}..{int(g_idx.max())}")
    perm, seg, sg = int4.index_segments(g_idx)
    if perm is None:  # stored along `in`, least significant first: the layout, transposed
        packed = np.ascontiguousarray(qw.T)
    else:  # desc_act: columns regrouped by group, the activation gathered the same way
        packed = np.empty((N, cdiv(K, 8)), np.uint32)
        for n0 in range(0, N, ROWS):
            n1 = min(N, n0 + ROWS)
            codes = _nibbles(np.ascontiguousarray(qw[:, n0:n1].T)).reshape(n1 - n0, -1)[:, :K]  # [n, K]
            packed[n0:n1] = int4.pack_codes(codes[:, perm])
    release_pages(raw["qweight"])  # repacked (transposed or regrouped): hand the file pages back
    arrays = int4.make_arrays(packed, zero, scale, seg, sg, perm)
    return StoredWeight("int4", entry.format, (N, K), arrays, int4.matmul_int4, int4.dequantize_int4)


def qweight_modules(infos: dict, skip):
    """(tensor name, module name X) of every `X.qweight` in the file (AWQ and GPTQ alike); a
    module listed in modules_to_not_convert but stored quantized is refused by name."""
    for name, t in infos.items():
        if not name.endswith(".qweight"):
            continue
        X = name[: -len(".qweight")]
        if matches_substring(X, skip):
            raise StoredFormatError(f"{t.file}: tensor '{name}': module '{X}' is in "
                                    "quantization_config.modules_to_not_convert but is stored quantized")
        yield name, X


def plan_gptq(qcfg: dict, infos: dict, raw_get, where) -> list[Entry]:
    bits = cfg_value(qcfg, "bits", where, (int,), required=True)
    if bits != 4:
        raise refuse(where, "quantization_config.bits", "4", bits)
    fmt = cfg_value(qcfg, "checkpoint_format", where, (str,), default="gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(where, "quantization_config.checkpoint_format", '"gptq" (v1) or "gptq_v2"', fmt)
    g = cfg_value(qcfg, "group_size", where, (int,), default=128)
    skip = name_list(qcfg, "modules_to_not_convert", where)
    entries = []
    for name, X in qweight_modules(infos, skip):
        qw = need(infos, name, ("I32",), 2, where)
        K, N = qw.shape[0] * 8, qw.shape[1]
        gs = K if g == -1 else g
        if gs <= 0 or K % gs or N % 8:
            raise refuse(where, "quantization_config.group_size", f"-1 or a positive divisor of {X}'s {K} inputs "
                         f"(and out features {N} a multiple of 8)", g)
        G = K // gs
        qz = need(infos, X + ".qzeros", ("I32",), 2, where)
        sc = need(infos, X + ".scales", ("F16", "BF16", "F32"), 2, where)
        check_shape(qz, (G, N // 8), f" (qweight {list(qw.shape)}, group_size {g})")
        check_shape(sc, (G, N), f" (qweight {list(qw.shape)}, group_size {g})")
        parts = {"qweight": name, "qzeros": X + ".qzeros", "scales": X + ".scales"}
        if X + ".g_idx" in infos:
            check_shape(need(infos, X + ".g_idx", ("I32", "I64"), 1, where), (K,))
            parts["g_idx"] = X + ".g_idx"
        desc = bool(qcfg.get("desc_act"))
        label = f"gptq{'' if fmt == 'gptq' else '_v2'}-int4 g{g}{' desc_act' if desc else ''}"
        entries.append(Entry(X + ".weight", label, (N, K), parts, build_gptq,
                             int4.resident(N, K, G, desc), qw.file, {"group": gs, "v1": fmt == "gptq"}))
    return entries
