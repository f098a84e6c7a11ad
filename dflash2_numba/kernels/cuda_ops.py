"""The CUDA Ops object: what `get_ops("cuda")` returns (kernels/backend.py is the one switch).

Same methods and contracts as the CPU Ops, so the model code is not forked per device:

    linear(x [M, K], w [N, K]) -> [M, N] f32          cuda_linear.py (bf16 converted on the fly)
    attention(q, k, v, q_pos, k_pos, causal, window, bf16_probs=False) -> [nq, nh, hd] f32
                                                       cuda_attention.py
    grouped_conv(x, delta, base, group_size, block_len) -> [N, H]   cuda_conv.py (bit-identical
                                                       to the CPU kernel, f32 and bf16)
    prepare_weight(w) -> w                             uploads w ONCE; later `linear(x, w)` calls
                                                       with that same host array use the device copy
    short_conv(window, w, bf16) -> [n, C] f32          cuda_gdn.py (Gated DeltaNet short conv)
    gated_delta(q, k, v, g, beta, state_in, state_out) cuda_gdn.py (delta rule; device states stay
                                                       on the device)
    zeros(shape, dtype=float32) -> DeviceBuffer        device-resident buffer (KV / context caches,
                                                       recurrent states)
    rms_norm, apply_rope                               the CPU's numba kernels (rowwise.py): they
                                                       act on the host activations

Residency: weights live on the device for the lifetime of the Ops object (keyed by the host
array's identity; the cache holds a reference to the host array, so an id cannot be reused by
another object while its entry exists). Activations are numpy arrays in the model graph, so each
call uploads its (small) inputs and returns a host result. K/V caches stay host numpy arrays
unless the model allocates them with `ops.zeros` (a DeviceBuffer: slice writes from host arrays,
slices handed to `attention` stay on the device) — see `DeviceBuffer`.

Without a usable CUDA device `CudaOps()` raises DeviceUnavailableError; under
NUMBA_ENABLE_CUDASIM=1 everything runs on numba's CUDA simulator (slow, for tests).
"""

from __future__ import annotations

import importlib

import numpy as np
from numba import cuda

from ..errors import DeviceUnavailableError
from . import rowwise
from .cuda_attention import attention_cuda
from .cuda_common import SIMULATOR, is_device_array, to_device
from .cuda_conv import grouped_conv_cuda
from .cuda_gdn import gated_delta_cuda, short_conv_cuda
from .cuda_linear import linear_cuda


def cuda_available() -> bool:
    """True with a usable GPU, or under the simulator (which numba reports as available)."""
    try:
        return bool(cuda.is_available())
    except Exception:  # broken driver / runtime wheel: same answer for the user
        return False


def _check_kernel_compiler() -> None:
    """Refuse by name when numba-cuda's kernel compiler cannot load with this numpy. Its target
    registry is imported at the first kernel compile, not at `import numba.cuda`: numba-cuda
    0.30.4 with numpy 2.5 (np.row_stack removed) passed is_available() and then failed inside the
    first launch (seen on an H200, docs/gpu.md). The simulator has no compiler to check."""
    if SIMULATOR:
        return
    try:
        importlib.import_module("numba.cuda.cudaimpl")  # the registry the first compile loads
    except ModuleNotFoundError as e:
        if e.name == "numba.cuda.cudaimpl":  # a numba-cuda laid out otherwise: nothing to probe here
            return
        raise DeviceUnavailableError(f"device 'cuda': numba-cuda's kernel compiler cannot load ({e})") from e
    except Exception as e:
        try:
            from importlib.metadata import version
            nc = version("numba-cuda")
        except Exception:
            nc = "(version unknown)"
        raise DeviceUnavailableError(
            f"device 'cuda': numba-cuda {nc} cannot compile kernels with numpy {np.__version__} "
            f"({type(e).__name__}: {e}); install a numpy release this numba-cuda supports "
            "(numba-cuda 0.30.4 needs numpy < 2.5), or use --device cpu") from e


class DeviceBuffer:
    """A device array with numpy-style slicing, for caches written from host arrays.

        buf[i, :, a:b] = host_array      # any layout: made contiguous, then copied in
        buf[i, :, :n]                    # -> a device view (what attention_cuda takes)
        buf.copy_to_host()               # -> numpy

    numba's own `devarray[key] = host` refuses non-contiguous host values (the models write
    `k.transpose(1, 0, 2)`), hence this thin wrapper."""

    def __init__(self, shape, dtype=np.float32):
        self.array = cuda.to_device(np.zeros(shape, dtype=dtype))

    shape = property(lambda self: tuple(self.array.shape))
    dtype = property(lambda self: self.array.dtype)
    ndim = property(lambda self: self.array.ndim)

    def __getitem__(self, key):
        return self.array[key]

    def __setitem__(self, key, value):
        if isinstance(value, DeviceBuffer):
            value = value.array
        if not is_device_array(value):
            value = np.ascontiguousarray(value, dtype=self.dtype)
        self.array[key] = value

    def copy_to_host(self) -> np.ndarray:
        return self.array.copy_to_host()


class CudaOps:
    """Ops for device "cuda" (attributes as kernels/backend.Ops, plus zeros / weight cache)."""

    device = "cuda"
    rms_norm = staticmethod(rowwise.rms_norm)
    apply_rope = staticmethod(rowwise.apply_rope)
    swiglu = staticmethod(rowwise.swiglu)

    def __init__(self):
        _check_kernel_compiler()
        if not cuda_available():
            raise DeviceUnavailableError(
                "device 'cuda': no CUDA device is available (numba.cuda.is_available() is False); "
                "use --device cpu")
        self.simulator = SIMULATOR
        self._weights: dict[int, tuple[np.ndarray, object]] = {}  # id(host) -> (host, device)

    # ------------------------------------------------------------------ weights
    def prepare_weight(self, w: np.ndarray) -> np.ndarray:
        """Upload w once (bf16 / f32 as is; other float dtypes as f32); returns w itself."""
        if id(w) not in self._weights:
            dtype = w.dtype if w.dtype in (np.uint16, np.float32) else np.float32
            self._weights[id(w)] = (w, to_device(w, dtype))
        return w

    def device_weight(self, w):
        """The cached device copy of a prepared weight, else w itself (uploaded per call)."""
        entry = self._weights.get(id(w))
        return entry[1] if entry is not None and entry[0] is w else w

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights resident on the device."""
        return sum(int(d.size) * d.dtype.itemsize for _, d in self._weights.values())

    # ------------------------------------------------------------------ kernels
    def linear(self, x, w, out=None):
        y = linear_cuda(x, self.device_weight(w))
        return _into(out, y)

    def attention(self, q, k, v, q_pos, k_pos, causal=True, window=0, bf16_probs=False, out=None, first=0):
        y = attention_cuda(q, k, v, q_pos, k_pos, causal, window, bf16_probs, first=first)
        return _into(out, y)

    def grouped_conv(self, x, delta, base, group_size, block_len):
        return grouped_conv_cuda(x, delta, base, group_size, block_len)

    short_conv = staticmethod(short_conv_cuda)
    gated_delta = staticmethod(gated_delta_cuda)

    # ------------------------------------------------------------------ buffers
    def zeros(self, shape, dtype=np.float32) -> DeviceBuffer:
        return DeviceBuffer(shape, dtype)


def _into(out, y):
    """Honour the CPU kernels' optional `out=` (host) argument."""
    if out is None:
        return y
    out[...] = y
    return out
