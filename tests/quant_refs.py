"""Dequantizers we did not design: torch ports of the format libraries' own reference readers,
read side by side with their source (neither library installs on this CPU-only torch: AutoAWQ
needs its CUDA / triton extensions, auto-gptq's sdist does not build).

- `awq_dequantize_gemm`: AutoAWQ 0.2.9, awq/utils/packing_utils.py `unpack_awq`,
  `reverse_awq_order`, `dequantize_gemm` (AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]; weights
  and zeros shifted by 0, 4, ..., 28, masked with 15; scales and zeros repeated group_size times
  along the input dimension; (iweight - izeros) * scales). Returns [in, out], like the original.
- `gptq_dequantize`: AutoGPTQ, auto_gptq/nn_modules/qlinear/qlinear_cuda.py `QuantLinear.forward`,
  the torch branch for bits in (2, 4, 8): zeros shifted by wf = [0, 4, ..., 28] along out, masked,
  `zeros + 1` (the v1 convention; `v1=False` is the gptq_v2 reading), weight shifted along in,
  `scales[g_idx] * (weight - zeros[g_idx])`. Returns [in, out].

Both run in float32 (the originals multiply in the f16 of their scales: the rounding of the
reference's own compute dtype, not part of the stored model).
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _unpack_awq(qweight, qzeros, bits):
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    return iweights, izeros


def _reverse_awq_order(iweights, izeros, bits):
    order = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 32 // bits)
    order = order[:, AWQ_REVERSE_ORDER].view(-1)
    return iweights[:, order], izeros[:, order]


def awq_dequantize_gemm(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, bits: int = 4,
                        group_size: int = 128) -> np.ndarray:
    qweight, qzeros = torch.from_numpy(np.ascontiguousarray(qweight)), torch.from_numpy(np.ascontiguousarray(qzeros))
    iweight, izeros = _unpack_awq(qweight, qzeros, bits)
    iweight, izeros = _reverse_awq_order(iweight, izeros, bits)
    iweight = torch.bitwise_and(iweight, (2 ** bits) - 1)
    izeros = torch.bitwise_and(izeros, (2 ** bits) - 1)
    s = torch.from_numpy(np.asarray(scales, np.float32)).repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return ((iweight - izeros) * s).numpy()  # [in, out]


def gptq_dequantize(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray,
                    bits: int = 4, v1: bool = True) -> np.ndarray:
    qweight, qzeros = torch.from_numpy(np.ascontiguousarray(qweight)), torch.from_numpy(np.ascontiguousarray(qzeros))
    scales = torch.from_numpy(np.asarray(scales, np.float32))
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)).to(torch.int8)
    zeros = torch.bitwise_and(zeros, (2 ** bits) - 1)
    if v1:
        zeros = zeros + 1
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)).to(torch.int8)
    weight = torch.bitwise_and(weight, (2 ** bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = torch.from_numpy(np.asarray(g_idx)).long()
    return (scales[g] * (weight - zeros[g])).numpy()  # [in, out]
