"""linear(x, w) = x @ w.T against an independent float64 product, over a sweep of shapes that
crosses every branch: input-row groups of 8 (5..8 rows left, clamped), 4 (2..4 left) and 1, in
every sequence (9 = 8+1, 12 = 8+4, 13 = 8+5, 31 = 8+8+8+7), output-column blocks with a ragged
tail, the BLAS path above GEMV_MAX_ROWS, every weight dtype, and both drivers."""

import tracemalloc

import numba
import numpy as np
import pytest

from dflash2_numba.kernels import linear as linear_module
from dflash2_numba.kernels.linear import GEMV_MAX_ROWS, ROW_BLOCK, linear, linear_reference
from dflash2_numba.numerics import f32_to_bf16_array



@pytest.fixture(params=["serial", "parallel"], autouse=True)
def driver(request, monkeypatch):
    """Run every case through both numba drivers (the size threshold is forced)."""
    monkeypatch.setattr(linear_module, "use_parallel", lambda macs: request.param == "parallel")
    return request.param


SHAPES = [(1, 7, 5), (1, 300, 64), (2, 33, 17), (3, 16, 40), (4, 31, 64), (5, ROW_BLOCK + 1, 96),
          (7, 129, 33), (8, 20, 8), (9, 40, 24), (12, 33, 20), (13, 17, 9), (16, 64, 128), (31, 10, 70),
          (32, 257, 64), (33, 40, 48), (70, 300, 64)]


def bf16_exact_weights(rng, N, K):
    """Weights whose f32 values are exactly bf16 -> (uint16 bits, the same values in f64).
    The f64 copy is made from the f32 values, not by decoding the bits, so a wrong decode in
    the kernel cannot hide behind a wrong decode in the oracle."""
    w32 = rng.standard_normal((N, K)).astype(np.float32)
    w32 = (w32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # truncate to bf16
    return f32_to_bf16_array(w32), w32.astype(np.float64)


def check(y, x, w64):
    ref = x.astype(np.float64) @ w64.T  # [M, N]
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w64).T) + 1e-30  # f32 summation error scale
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= bound), np.abs(y - ref).max()


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bf16_weights(M, N, K):
    rng = np.random.default_rng(M * 1000 + N)
    w, w64 = bf16_exact_weights(rng, N, K)
    w.flags.writeable = False  # checkpoint weights are read-only memmap views
    x = rng.standard_normal((M, K)).astype(np.float32)
    check(linear(x, w), x, w64)
    check(linear_reference(x, w), x, w64)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_weights(M, N, K, dtype):
    rng = np.random.default_rng(M * 1000 + N + 7)
    w = rng.standard_normal((N, K)).astype(dtype)
    x = rng.standard_normal((M, K)).astype(np.float32)
    check(linear(x, w), x, w.astype(np.float64))


def test_noncontiguous_weight_and_out():
    rng = np.random.default_rng(1)
    w, w64 = bf16_exact_weights(rng, 40, 64)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    out = np.full((3, 40), np.nan, dtype=np.float32)
    y = linear(x, w[:, ::2], out=out)
    assert y is out
    check(y, x, w64[:, ::2])


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="64 columns"):
        linear(np.zeros((1, 32), np.float32), np.zeros((8, 64), np.uint16))


def test_prefill_path_converts_in_chunks():
    """M > GEMV_MAX_ROWS must not materialise the whole f32 weight matrix (16 MiB here)."""
    rng = np.random.default_rng(2)
    N, K = 4096, 1024
    w = f32_to_bf16_array(rng.standard_normal((N, K), dtype=np.float32))
    x = rng.standard_normal((GEMV_MAX_ROWS + 8, K)).astype(np.float32)
    tracemalloc.start()
    linear(x, w)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 0.75 * N * K * 4, peak


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs a numba pool of 2 threads")
def test_blas_runs_on_the_numba_thread_count():
    """A BLAS product (an unpacked weight above GEMV_MAX_ROWS rows) runs on as many threads as
    numba: OpenBLAS alone starts one per core, so `--threads 1` would use every core."""
    from threadpoolctl import threadpool_info

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    x = rng.standard_normal((GEMV_MAX_ROWS + 1, 48)).astype(np.float32)
    saved = numba.get_num_threads()
    try:
        for n in (1, 2, 1):
            numba.set_num_threads(n)
            check(linear(x, w), x, w.astype(np.float64))
            blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
            assert blas and set(blas) == {n}, (n, blas)
    finally:
        numba.set_num_threads(saved)


# N: every remainder mod 2 and mod 4, inside one output block and past ROW_BLOCK; K: below one
# vector, every remainder mod 8 and mod 16 (LLVM's vector loop and its scalar epilogue).
TILE_NK = [(1, 1), (3, 7), (5, 8), (ROW_BLOCK + 2, 17), (ROW_BLOCK + 3, 31), (2 * ROW_BLOCK + 5, 45),
           (2 * ROW_BLOCK + 6, 70), (4, 16), (7, 100)]


@pytest.mark.parametrize("M", range(1, 18))
def test_tile_remainders(M):
    """Rows 1..17 cross every row-group sequence (1, 4, 8, 8+1, 8+4, 8+8, 8+8+1); each is
    tried against every (N, K) above. `out` starts as NaN, so an output never stored fails."""
    rng = np.random.default_rng(100 + M)
    for N, K in TILE_NK:
        w, w64 = bf16_exact_weights(rng, N, K)
        x = rng.standard_normal((M, K)).astype(np.float32)
        out = np.full((M, N), np.nan, dtype=np.float32)
        check(linear(x, w, out=out), x, w64)
        w32 = w64.astype(np.float32)  # the same values as float32 weights: the f32 _load arm
        out[:] = np.nan
        check(linear(x, w32, out=out), x, w64)
