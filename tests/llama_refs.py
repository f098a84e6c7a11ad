"""llama.cpp's own quantizer, called through ctypes: ggml_quantize_chunk in the libggml-base that
llama-cpp-python ships (the function llama_model_quantize runs per tensor; without an importance
matrix it is quantize_row_<type>_ref). The bench extra installs it; `quantize` skips the calling
test with a reason where it is absent."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

GGML_TYPE_Q4_K = 12
QK_K_BYTES = {GGML_TYPE_Q4_K: (256, 144)}  # weights and bytes per block


def _ggml():
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the install
        pytest.skip(f"llama-cpp-python is not installed (the bench extra): {e}")
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    lib = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
    f = lib.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]
    return f


def quantize(x: np.ndarray, ggml_type: int = GGML_TYPE_Q4_K) -> np.ndarray:
    """f32 [N, K] -> llama.cpp's blocks uint8 [N, K / block, bytes per block]."""
    quantize_chunk = _ggml()
    x = np.ascontiguousarray(x, np.float32)
    N, K = x.shape
    per, size = QK_K_BYTES[ggml_type]
    out = np.zeros((N, K // per, size), np.uint8)
    written = quantize_chunk(ggml_type, x.ctypes.data, out.ctypes.data, 0, N, K, None)
    assert written == out.nbytes, (written, out.nbytes)
    return out
