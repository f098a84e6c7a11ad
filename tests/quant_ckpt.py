"""Pre-quantized tiny checkpoints for tests/test_stored_*.py, written by each format's own
packing rules from a bf16 tiny target (dflash2_numba.tiny), and the dense references.

    fp8_checkpoint(src, dst, block)          Qwen's FP8 layout (transformers' Fp8Quantize rule)
    awq_checkpoint(src, dst, group)          AutoAWQ's GEMM packing (WQLinear_GEMM.from_linear)
    gptq_checkpoint(src, dst, group, ...)    GPTQ's packing (v1 zeros stored minus one), desc_act
    hf_logits(dst, dense, ids)               transformers' Qwen3ForCausalLM in f32 on dense weights

Every quantizer here is the test's own (deliberately simple: round to nearest); what matters is
that the packed bits follow the format, and that the dense reference comes from a dequantizer
we did not write (transformers' Fp8Dequantize, compressed-tensors, AutoAWQ's dequantize_gemm and
AutoGPTQ's torch dequantization, ported in quant_refs.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.numerics import as_f32
from dflash2_numba.tiny import save_safetensors

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES + ("fc",)


def read_dense(src: Path) -> dict[str, np.ndarray]:
    """Every tensor of a bf16 tiny checkpoint: uint16 (bf16 bits) arrays as stored."""
    ck = open_checkpoint(src)
    return {n: np.array(ck.get(n)) for n in ck.names()}


def _copy_side(src: Path, dst: Path, qcfg: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


# ------------------------------------------------------------------ FP8 (quant_method fp8)
def fp8_quantize(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """f32 [N, K] -> (e4m3 bytes uint8 [N, K], scale_inv f32 [ceil(N/bn), ceil(K/bk)]), per block:
    scale = 448 / amax, q = fp8(w * scale), stored scale_inv = 1 / scale (transformers' Fp8Quantize)."""
    bn, bk = block
    N, K = w.shape
    t = torch.from_numpy(w)
    q = torch.empty((N, K), dtype=torch.float8_e4m3fn)
    inv = torch.empty((-(-N // bn), -(-K // bk)), dtype=torch.float32)
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            blk = t[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale = 448.0 / blk.abs().max().clamp(min=1e-12)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            inv[i, j] = 1.0 / scale
    return q.view(torch.uint8).numpy(), inv.numpy()


def fp8_checkpoint(src: Path, dst: Path, block=(128, 128), skip=("lm_head",)) -> dict[str, np.ndarray]:
    """Write `dst` in Qwen's FP8 layout; returns the dense f32 weights transformers' own
    Fp8Dequantize gives back (the reference), keyed by tensor name."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors, dtypes, dense = {}, {}, {}
    for name, a in read_dense(src).items():
        if is_linear(name) and not any(s in name for s in skip):
            q, inv = fp8_quantize(as_f32(a), block)
            tensors[name], dtypes[name] = q, "F8_E4M3"
            tensors[name[:-len("weight")] + "weight_scale_inv"] = inv
            deq = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(q).view(torch.float8_e4m3fn),
                                                      torch.from_numpy(inv), output_dtype=torch.float32)
            dense[name] = deq.numpy()
        else:
            tensors[name] = a
            dense[name] = as_f32(a)
    _copy_side(src, dst, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": list(block), "modules_to_not_convert": list(skip)})
    save_safetensors(dst / "model.safetensors", tensors, dtypes)
    return dense


# ------------------------------------------------------------------ int4 (AWQ / GPTQ)
def int4_quantize(w: np.ndarray, group: int, g_idx=None, rng=None):
    """Asymmetric 4-bit per (output, group) round to nearest: (codes uint8 [N, K], zeros int [N, G],
    scales f16 [N, G]) with W ~ (codes - zeros) * scales, group of column k = g_idx[k]."""
    N, K = w.shape
    g_idx = np.arange(K) // group if g_idx is None else g_idx
    G = int(g_idx.max()) + 1
    codes = np.empty((N, K), np.uint8)
    zeros = np.empty((N, G), np.int64)
    scales = np.empty((N, G), np.float16)
    for g in range(G):
        cols = np.flatnonzero(g_idx == g)
        blk = w[:, cols]
        lo, hi = np.minimum(blk.min(1), 0), np.maximum(blk.max(1), 0)
        s = np.maximum((hi - lo) / 15, 1e-6).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float32)), 0, 15).astype(np.int64)
        if rng is not None:  # spread the zeros over 0..15 (a v1 zero of 0 is stored as -1 -> 15 after masking)
            z = np.where(rng.random(N) < 0.2, rng.integers(0, 16, N), z)
        codes[:, cols] = np.clip(np.round(blk / s[:, None].astype(np.float32)) + z[:, None], 0, 15)
        zeros[:, g], scales[:, g] = z, s
    return codes, zeros, scales


def pack_along_cols(vals: np.ndarray, order=None) -> np.ndarray:
    """[R, 8C] 4-bit values -> int32 [R, C]: nibble i of word c holds column 8c + order[i]."""
    order = np.arange(8) if order is None else np.asarray(order)
    R, C8 = vals.shape
    v = vals.reshape(R, C8 // 8, 8).astype(np.uint32)[:, :, order]
    out = np.zeros((R, C8 // 8), np.uint32)
    for i in range(8):
        out |= (v[:, :, i] & np.uint32(15)) << np.uint32(4 * i)
    return out.view(np.int32)


def awq_checkpoint(src: Path, dst: Path, group: int = 64, skip=("lm_head",), rng=None) -> None:
    """AutoAWQ's GEMM layout (awq/modules/linear/gemm.py WQLinear_GEMM.from_linear): intweight
    [in, out] packed 8 per int32 along out with order_map [0, 2, 4, 6, 1, 3, 5, 7]; qzeros the same."""
    tensors = {}
    for name, a in read_dense(src).items():
        if is_linear(name) and not any(s in name for s in skip):
            codes, zeros, scales = int4_quantize(as_f32(a), group, rng=rng)
            X = name[:-len(".weight")]
            tensors[X + ".qweight"] = pack_along_cols(codes.T, [0, 2, 4, 6, 1, 3, 5, 7])
            tensors[X + ".qzeros"] = pack_along_cols(zeros.T, [0, 2, 4, 6, 1, 3, 5, 7])
            tensors[X + ".scales"] = np.ascontiguousarray(scales.T)
        else:
            tensors[name] = a
    _copy_side(src, dst, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                          "version": "gemm", "modules_to_not_convert": list(skip)})
    save_safetensors(dst / "model.safetensors", tensors)


def gptq_checkpoint(src: Path, dst: Path, group: int = 32, desc_act: bool = False, v2: bool = False,
                    skip=("lm_head",), seed: int = 0) -> None:
    """GPTQ's layout: qweight [in/8, out] packed along in (least significant nibble first),
    qzeros [G, out/8] packed along out holding zero - 1 (v1; v2 stores the zero), scales [G, out],
    g_idx [in]; desc_act: a random column order quantized group by group (g_idx[k] = position of
    k in that order // group), as GPTQ's act-order writes it."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, a in read_dense(src).items():
        if is_linear(name) and not any(s in name for s in skip):
            w = as_f32(a)
            N, K = w.shape
            if desc_act:
                order = rng.permutation(K)
                g_idx = np.empty(K, np.int64)
                g_idx[order] = np.arange(K) // group
            else:
                g_idx = np.arange(K) // group
            codes, zeros, scales = int4_quantize(w, group, g_idx, rng=rng)
            X = name[:-len(".weight")]
            tensors[X + ".qweight"] = np.ascontiguousarray(pack_along_cols(codes).T)  # [K/8, N]
            stored = zeros if v2 else (zeros - 1) & 15
            tensors[X + ".qzeros"] = pack_along_cols(np.ascontiguousarray(stored.T))
            tensors[X + ".scales"] = np.ascontiguousarray(scales.T)
            tensors[X + ".g_idx"] = g_idx.astype(np.int32)
        else:
            tensors[name] = a
    _copy_side(src, dst, {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                          "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq",
                          "modules_to_not_convert": list(skip)})
    save_safetensors(dst / "model.safetensors", tensors)


# ------------------------------------------------------------------ the transformers reference
def hf_model(directory: Path, dense: dict[str, np.ndarray]):
    """Qwen3ForCausalLM in float32 from `directory`'s config (quantization_config dropped) with
    the given dense weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = json.loads((Path(directory) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    config = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = Qwen3ForCausalLM(config).float().eval()
    sd = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in dense.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(m == "lm_head.weight" and config.tie_word_embeddings for m in missing), (missing, unexpected)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def hf_greedy(model, ids, n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]
