"""The ONE device switch (spec §7): model code calls `ops.linear`, `ops.attention`,
`ops.grouped_conv` and never imports a kernel module itself.

    get_ops("cpu")    numba @njit kernels; bf16 weights stay bf16, repacked once into column
                      panels for the decode GEMV (kernels/panels.py) (default)
    get_ops("numpy")  plain numpy references in f32; `prepare_weight` converts each weight
                      matrix to f32 ONCE at load (the benchmark's "plain numpy f32 path")
    get_ops("cuda")   @cuda.jit kernels (kernels/cuda_ops.CudaOps: same methods, weights cached on
                      the device); DeviceUnavailableError without a GPU (runs on numba's CUDA
                      simulator under NUMBA_ENABLE_CUDASIM=1)

Contracts (all float32 activations):
    linear(x [M, K], w [N, K]) -> [M, N]                                    (kernels/linear.py)
    attention(q [nq, nh, hd], k [nkv, T, hd], v, q_pos [nq], k_pos [T],
              causal: bool, window: int, bf16_probs=False) -> [nq, nh, hd]  (kernels/attention.py)
    grouped_conv(x, delta, base, group_size, block_len)                    (kernels/conv.py, §4.2)
    rms_norm(x [..., D], w [D], eps, bf16) -> [..., D]       (kernels/rowwise.py; models/layers.py)
    apply_rope(x [n, heads, hd], cos [n, hd], sin [n, hd], bf16) -> [n, heads, hd]   (the same)
    swiglu(gate [n, I], up [n, I], bf16) -> [n, I]                                  (the same)
    prepare_weight(w) -> the array to hand to linear (CPU: bf16 weights repacked into panels,
                         kernels/panels.PackedBF16, or with quantize="q8_0" / "q4_0" a
                         quant/weights.QuantizedWeight that replaces the source; numpy: an f32 copy)
    prepare_head(w)   -> the lm_head's preparation (None: prepare_weight; keep_head: packed bf16)
    short_conv(window [K-1+n, C], w [C, K], bf16) -> [n, C]                (kernels/gdn.py)
    gated_delta(q, k, v, g, beta, state_in, state_out) -> o [n, Hv, dv]    (kernels/gdn.py)
"""

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import DeviceUnavailableError, GenerationArgumentError
from ..numerics import as_f32
from ..models import layers
from . import gdn, rowwise
from .attention import attention, attention_reference
from .cache_check import check_kernel_cache
from .linear import linear, linear_reference
from .panels import pack_bf16

DEVICES = ("cpu", "numpy", "cuda")


# ------------------------------------------------------------------ threads
def physical_cores() -> int:
    """Physical cores this process may run on: SMT siblings count once (sysfs topology); the
    logical count where that is unreadable. A second hyper-thread adds little to bandwidth-bound
    GEMVs and costs fork/join wake-ups."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            return len(cpus) or 1
    return max(1, len(cores))


# Parameters below which the default is ONE thread, however many cores there are. Measured on
# the 2-core dev VM (bench/results/speed_run.txt; decode tok/s, 2 threads vs 1): the embedded
# target (5M parameters, ~0.7 ms a token) decodes at ~600 tok/s on two threads against ~1150 on
# one, speculation on it ~480 against ~1190: its products are a few microseconds each, and
# waking the second thread for them (the pool sleeps between the Python steps) costs more than
# it saves. The ~120M target gains ~1.8x from the second thread (57 -> 103 tok/s).
SMALL_MODEL_PARAMS = 32_000_000


def default_threads(model_params: int | None = None) -> int:
    """The thread count a run gets without --threads: the physical cores (at most numba's pool),
    or 1 for a model of fewer than SMALL_MODEL_PARAMS parameters."""
    import numba

    if model_params is not None and model_params < SMALL_MODEL_PARAMS:
        return 1
    return min(physical_cores(), numba.config.NUMBA_NUM_THREADS)


def set_threads(n: int | None = None) -> int:
    """numba threads the kernels run with: n, or `default_threads()`. Products below each
    kernel's measured threshold stay serial whatever this says."""
    import numba

    pool = numba.config.NUMBA_NUM_THREADS
    if n is None:
        n = default_threads()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= pool:
        raise GenerationArgumentError(
            f"--threads {n!r}: expected an integer in 1..{pool} (numba's thread pool; NUMBA_NUM_THREADS)")
    numba.set_num_threads(n)
    return n


@dataclass(frozen=True)
class Ops:
    device: str
    linear: Callable
    attention: Callable
    grouped_conv: Callable  # DFlash2 drafts only
    prepare_weight: Callable[[np.ndarray], np.ndarray]
    rms_norm: Callable = layers.rms_norm  # numpy reference unless a device brings a kernel
    apply_rope: Callable = layers.apply_rope
    swiglu: Callable = layers.swiglu
    short_conv: Callable = gdn.short_conv  # Gated DeltaNet targets (families/qwen3_5.py)
    gated_delta: Callable = gdn.gated_delta_rule
    quantize: str | None = None  # "q8_0" / "q4_0" / "q4_k": the linear weights' format (None: as stored)
    prepare_head: Callable | None = None  # None: the head is prepared like every other weight


QUANTIZE = (None, "q8_0", "q4_0", "q4_k")


def _keep_stored(prepare: Callable) -> Callable:
    """A pre-quantized checkpoint's weight (quant/stored.StoredWeight) is kept as stored; every
    other weight goes through `prepare`."""
    from ..quant.stored import StoredWeight

    def prepare_or_keep(w):
        return w if isinstance(w, StoredWeight) else prepare(w)

    return prepare_or_keep


def _numpy_prepare(w):
    """The numpy device's f32 copy; a stored weight is dequantized (the reference path)."""
    from ..quant.stored import StoredWeight

    return w.dequantize() if isinstance(w, StoredWeight) else as_f32(w)


def _prepare_quantized(fmt: str, w):
    """A 2-D float weight -> QuantizedWeight in fmt; anything else as the bf16 path packs it."""
    from ..quant.stored import StoredWeight
    from ..quant.weights import quantize_weight

    if isinstance(w, StoredWeight):  # re-quantizing stored FP8 / int4 would be another model
        raise GenerationArgumentError(
            f"--quantize {fmt}: the checkpoint is stored pre-quantized ({w.format}, weight {list(w.shape)}); "
            "expected no --quantize (it runs as stored)")
    if isinstance(w, np.ndarray) and w.ndim == 2 and w.size and w.dtype in (np.uint16, np.float32, np.float16):
        return quantize_weight(w, fmt, f"weight {list(w.shape)}")
    return pack_bf16(w)


def _conv_kernels():
    """(cpu kernel, numpy version) from kernels/conv.py, written separately."""
    from .conv import grouped_conv, grouped_conv_numpy

    return grouped_conv, grouped_conv_numpy


def get_ops(device: str = "cpu", quantize: str | None = None, keep_head: bool = False) -> Ops:
    """quantize: None (weights as stored) | "q8_0" | "q4_0" | "q4_k" (CPU only); keep_head: the lm_head
    stays as stored (packed bf16) when the rest is quantized."""
    if quantize not in QUANTIZE:
        raise GenerationArgumentError(f"quantize {quantize!r}: expected one of none, q8_0, q4_0, q4_k")
    if quantize is not None and device != "cpu":
        raise GenerationArgumentError(f"--quantize {quantize} runs on the cpu device, not {device!r}")
    if device == "cpu":
        check_kernel_cache()  # a corrupt numba cache file: a named error, not a traceback mid-run
        conv, _ = _conv_kernels()
        prepare = functools.partial(_prepare_quantized, quantize) if quantize else _keep_stored(pack_bf16)
        return Ops("cpu", linear, attention, conv, prepare, rowwise.rms_norm, rowwise.apply_rope,
                   rowwise.swiglu, quantize=quantize,
                   prepare_head=_keep_stored(pack_bf16) if quantize and keep_head else None)
    if device == "numpy":
        _, conv = _conv_kernels()
        return Ops("numpy", linear_reference, attention_reference, conv, _numpy_prepare,
                   short_conv=gdn.short_conv_reference, gated_delta=gdn.gated_delta_rule_reference)
    if device == "cuda":  # @cuda.jit kernels (kernels/cuda_ops.py); DeviceUnavailableError without a GPU
        try:
            from .cuda_ops import CudaOps
        except ImportError as e:  # numba-cuda (the `cuda` extra) not installed
            raise DeviceUnavailableError(
                f"device 'cuda': numba's CUDA target cannot be imported ({e}); install the `cuda` extra") from e
        return CudaOps()
    raise DeviceUnavailableError(f"unknown device {device!r}; expected one of: {', '.join(DEVICES)}")
