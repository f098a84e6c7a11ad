"""q8_0 / q4_0 (dflash2_numba/quant/): quantizers against independent references, the integer
kernels against a numpy int64 reference on every instruction-set path this host runs, and the
row-count / thread / path invariance the lossless verify needs.

Paths: this process runs the path numba's target has (kernels/isa.py); `_run_path` runs the
lower ones in a subprocess with DFLASH2_ISA (numba then compiles for that instruction set).

Mutations tried on quant/, each turning this file red (recorded in docs/quantization.md):
- quantize_rows rounding ties away from zero for M > 1 only (a row-count-dependent rounding):
  test_activation_quantizer_matches_numpy, test_rows_are_independent_bit_for_bit;
- the epilogue's scale as (ws * isum) * xs instead of (ws * xs) * isum: test_kernel_matches_reference;
- the block loop stopping one block early (nb - 1: a dropped remainder block):
  test_integer_core_is_exact, test_kernel_matches_reference;
- the VNNI correction xc = 127 * sum(q) instead of 128 * (wrong signedness correction):
  test_integer_core_is_exact, test_kernel_matches_reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from dflash2_numba.decode.warmup import parallel_threshold
from dflash2_numba.errors import QuantizeError
from dflash2_numba.kernels import isa
from dflash2_numba.kernels.linear import linear
from dflash2_numba.quant import formats as F
from dflash2_numba.quant import kernels_int8 as Q
from dflash2_numba.quant.weights import QuantizedWeight, quantize_weight

FORMATS = ("q8_0", "q4_0")


# ---------------------------------------------------------------- quantizers
def _q8_0_loop(w):
    """ggml-quants.c quantize_row_q8_0_ref, one block at a time in Python floats rounded to f32."""
    N, K = w.shape
    q, d = np.zeros((N, K), np.int8), np.zeros((N, K // 32), np.float16)
    for n in range(N):
        for b in range(K // 32):
            x = w[n, 32 * b:32 * b + 32].astype(np.float32)
            amax = np.float32(max(abs(float(v)) for v in x))
            dd = np.float32(amax / np.float32(127))
            inv = np.float32(1) / dd if dd else np.float32(0)
            d[n, b] = np.float16(dd)
            for j, v in enumerate(x):
                t = float(np.float32(v * inv))
                q[n, 32 * b + j] = int(np.floor(abs(t) + 0.5)) * (1 if t >= 0 else -1)
    return q, d


def _q4_0_loop(w):
    """quantize_row_q4_0_ref: d = max / -8 (signed max by magnitude), min(15, (int)(x/d + 8.5))."""
    N, K = w.shape
    q, d = np.zeros((N, K), np.int8), np.zeros((N, K // 32), np.float16)
    for n in range(N):
        for b in range(K // 32):
            x = w[n, 32 * b:32 * b + 32].astype(np.float32)
            amax, mx = 0.0, 0.0
            for v in x:
                if amax < abs(float(v)):
                    amax, mx = abs(float(v)), float(v)
            dd = np.float32(np.float32(mx) / np.float32(-8))
            inv = np.float32(1) / dd if dd else np.float32(0)
            d[n, b] = np.float16(dd)
            for j, v in enumerate(x):
                q[n, 32 * b + j] = min(15, int(float(np.float32(np.float32(v * inv) + np.float32(8.5))))) - 8
    return q, d


def _weights(rng, N, K):
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    w[1, :32] = np.arange(32, dtype=np.float32) - np.float32(15.5)  # x*id on .5 ties (d = 1 below)
    w[1, 0] = 127.0
    w[2, 5] = -40.0  # a dominant negative element (q4_0's signed max)
    return w


@pytest.mark.parametrize("fmt,loop", [("q8_0", _q8_0_loop), ("q4_0", _q4_0_loop)])
def test_quantizer_matches_block_loop(fmt, loop):
    w = _weights(np.random.default_rng(1), 6, 96)
    q, d = F.QUANTIZERS[fmt](w)
    rq, rd = loop(w)
    assert np.array_equal(q, rq) and np.array_equal(d.view(np.uint16), rd.view(np.uint16))
    lo, hi = (-127, 127) if fmt == "q8_0" else (-8, 7)
    assert q.min() >= lo and q.max() <= hi


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_matches_gguf_py(fmt):
    """gguf-py's numpy quantizers (llama.cpp's own converter) give the same bytes."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = _weights(np.random.default_rng(2), 8, 128)
    q, d = F.QUANTIZERS[fmt](w)
    kind = GGMLQuantizationType.Q8_0 if fmt == "q8_0" else GGMLQuantizationType.Q4_0
    raw = gq.quantize(w, kind).reshape(8, 4, -1)  # [N, blocks, bytes]
    assert np.array_equal(raw[:, :, :2].copy().view(np.float16)[:, :, 0], d)
    if fmt == "q8_0":
        assert np.array_equal(raw[:, :, 2:].view(np.int8).reshape(8, 128), q)
    else:  # byte j: low nibble element j, high nibble element j + 16
        nib = raw[:, :, 2:]
        both = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int8) - 8
        assert np.array_equal(both.reshape(8, 128), q)


def test_quantize_weight_refusals():
    with pytest.raises(QuantizeError, match=r"layer\.w.*multiple of 32.*\[4, 40\]"):
        quantize_weight(np.zeros((4, 40), np.float32), "q8_0", "layer.w")
    with pytest.raises(QuantizeError, match="int32"):
        quantize_weight(np.zeros((4, 64), np.int32), "q8_0", "layer.w")
    with pytest.raises(QuantizeError, match="q5_0"):
        quantize_weight(np.zeros((4, 64), np.float32), "q5_0", "layer.w")


def test_bf16_source_equals_its_f32_values():
    rng = np.random.default_rng(3)
    bits = (rng.standard_normal((5, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    for fmt in FORMATS:
        a, b = quantize_weight(bits, fmt), quantize_weight(f32, fmt)
        assert all(np.array_equal(x, y) for x, y in zip(a.panels, b.panels))



# ---------------------------------------------------------------- the load-time packer (pack_nb.py)
def test_fp16_bits_match_numpy_on_every_kind_of_f32():
    """pack_nb.f16_bits (the scales' rounding) == numpy's astype(float16) on random bit patterns
    (normals, subnormals, overflow, inf, NaN) and on the values next to each rounding boundary."""
    from dflash2_numba.quant.pack_nb import f16_bits

    @numba.njit
    def convert(a):
        out = np.empty(a.size, np.uint16)
        for i in range(a.size):
            out[i] = f16_bits(a[i])
        return out

    rng = np.random.default_rng(11)
    v = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.float32(2.0) ** np.arange(-27, 17, dtype=np.float32)  # exponents across the range
    ulp = np.float32(2.0) ** np.float32(-11)  # half an fp16 ulp of 1.0: ties and their neighbours
    near = np.concatenate([edges * m for m in (1 + ulp, 1 + 3 * ulp, np.nextafter(1 + ulp, 2, dtype=np.float32),
                                               np.nextafter(1 + ulp, 0, dtype=np.float32), -1.5)]).astype(np.float32)
    v = np.concatenate([v, near, np.float32([65504, 65519.99, 65520, 0.0, -0.0, 5.96e-8, 2.98e-8, 2.99e-8])])
    with np.errstate(all="ignore"):
        want = v.astype(np.float16).view(np.uint16)
    got = convert(v)
    nan = np.isnan(v)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(np.float16)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("unsigned", [False, True])
def test_numba_packer_equals_numpy_quantizer_and_pack(fmt, unsigned):
    """quantize_pack (the load path) == formats.pack(formats.QUANTIZERS[fmt](w)) byte for byte:
    bf16 bits and f32, rows not a multiple of a work item, zero blocks, magnitude ties, .5 ties,
    scales that are fp16 subnormals or overflow."""
    from dflash2_numba.quant.pack_nb import quantize_pack

    rng = np.random.default_rng(12)
    for N, K, scale in ((1, 32, 1.0), (6, 96, 1.0), (130, 64, 1e-6), (200, 128, 1e-9), (40, 256, 3e4)):
        w = _weights(rng, max(N, 3), K)[:N] * np.float32(scale) if N >= 3 else \
            rng.standard_normal((N, K)).astype(np.float32)
        if N >= 3:
            w[2, 7] = w[2, 5]  # two elements of the same largest magnitude: the first one counts
            w[2, 9] = -w[2, 5]
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        for src in (w, bits):
            want = F.pack(*F.QUANTIZERS[fmt](src), fmt, unsigned)
            got = quantize_pack(src, fmt, unsigned)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert np.array_equal(a, b), (N, K, scale, src.dtype)


def test_quantize_weight_keeps_the_float16_path():
    """f16 sources still go through the numpy quantizers; the panels equal the f32 route's."""
    w = _weights(np.random.default_rng(13), 8, 64).astype(np.float16)
    for fmt in FORMATS:
        a, b = quantize_weight(w, fmt), quantize_weight(w.astype(np.float32), fmt)
        assert all(np.array_equal(x, y) for x, y in zip(a.panels, b.panels))


# ---------------------------------------------------------------- activations
def test_activation_quantizer_matches_numpy():
    """The one numba activation quantizer == the numpy version, ties and fp16 subnormal scales
    included, the same for every row whatever the row count."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 80)).astype(np.float32)
    x[0, :32] = np.arange(32, dtype=np.float32) - np.float32(15.5)  # amax 127: x * 1 on .5 ties
    x[0, 0] = 127.0
    x[1, :32] *= np.float32(1e-6)  # d below fp16's smallest normal
    x[2, 32:64] = 0.0
    got = Q.quantize_rows_entry(x, 96)
    ref = Q.quantize_rows_reference(x, 96)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    for r in range(9):
        one = Q.quantize_rows_entry(x[r:r + 1], 96)
        assert all(np.array_equal(a[0], b[r]) for a, b in zip(one, got))
    # whole blocks of contiguous rows take the vector halves (quant/quantize_ir.py), a strided
    # row and the partial last block the scalar loop: the same bits
    wide = np.zeros((9, 160), np.float32)
    wide[:, ::2] = x
    assert not wide[:, ::2].flags.c_contiguous
    assert all(np.array_equal(a, b) for a, b in zip(Q.quantize_rows_entry(wide[:, ::2], 96), got))


# ---------------------------------------------------------------- kernels
def _packed(fmt, q, d):
    return QuantizedWeight(fmt, q.shape, F.pack(q, d, fmt, unsigned=Q.VNNI))


@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_core_is_exact(fmt):
    """Scales 1 and activations with amax 127 (so xs = 1): y is the exact integer sum of every
    block dot, compared with numpy int64, over widths with a partial last work item."""
    rng = np.random.default_rng(5)
    lo, hi = (-127, 128) if fmt == "q8_0" else (-8, 8)
    for N, K in ((200, 96), (33, 32), (130, 160)):
        q = rng.integers(lo, hi, (N, K)).astype(np.int8)
        q[:, 0] = hi - 1 if fmt == "q8_0" else -8
        d = np.ones((N, K // 32), np.float16)
        xi = rng.integers(-127, 128, (7, K)).astype(np.float32)
        xi[:, ::32] = 127.0  # amax 127 in every block: d_x = 1, q_x = x
        y = linear(xi, _packed(fmt, q, d))
        ref = xi.astype(np.int64) @ q.astype(np.int64).T
        assert np.array_equal(y, ref.astype(np.float32)), (N, K)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K", [(1, 32), (31, 64), (129, 96), (300, 256)])
def test_kernel_matches_reference(fmt, N, K):
    """Bit for bit the numpy reference (int64 block dots + the one epilogue), every row count
    1..17, 32 and a prefill-size 40, at one and two threads with the parallel threshold 0."""
    rng = np.random.default_rng(N * 7 + K)
    w = rng.standard_normal((N, K)).astype(np.float32)
    q, d = F.QUANTIZERS[fmt](w)
    sweep_rows_and_threads(quantize_weight(w, fmt), lambda x: Q.gemv_quant_reference(x, q, d), rng)


def sweep_rows_and_threads(packed, reference, rng):
    """linear(x, packed) == reference(x) bit for bit for 1..17, 32 and 40 random rows, at one and
    two threads with the parallel threshold 0 (also used by test_q4_k.py)."""
    N, K = packed.shape
    saved = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            with parallel_threshold(0):
                for M in list(range(1, 18)) + [32, 40]:
                    x = rng.standard_normal((M, K)).astype(np.float32)
                    y = np.full((M, N), np.nan, np.float32)
                    linear(x, packed, out=y)
                    assert np.array_equal(y, reference(x)), (threads, M)
    finally:
        numba.set_num_threads(saved)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_independent_bit_for_bit(fmt):
    """Row r of an M-row product == the 1-row product of x[r] for every tile (4, 2, 1 rows)."""
    rng = np.random.default_rng(9)
    w = quantize_weight(rng.standard_normal((260, 128)).astype(np.float32), fmt)
    x = rng.standard_normal((13, 128)).astype(np.float32)
    whole = linear(x, w)
    for r in range(13):
        assert np.array_equal(linear(x[r:r + 1], w)[0], whole[r])
    for M in (2, 3, 5, 8):
        assert np.array_equal(linear(x[:M], w), whole[:M])


def test_quantized_is_close_to_the_float_product():
    """A sanity bound, not the contract: q8_0 within ~1% and q4_0 within ~15% of f32."""
    rng = np.random.default_rng(10)
    w = rng.standard_normal((256, 512)).astype(np.float32)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    exact = x @ w.T
    for fmt, tol in (("q8_0", 0.02), ("q4_0", 0.2)):
        err = np.abs(linear(x, quantize_weight(w, fmt)) - exact).max() / np.abs(exact).max()
        assert err < tol, (fmt, err)


# ---------------------------------------------------------------- every path, the same bits
_PATH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    import dflash2_numba
    from dflash2_numba.kernels import isa
    from dflash2_numba.kernels.linear import linear
    from dflash2_numba.kernels.panels import pack_bf16
    from dflash2_numba.quant.weights import quantize_weight
    rng = np.random.default_rng(11)
    w = rng.standard_normal((300, 96)).astype(np.float32)
    bf = (w.view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((9, 96)).astype(np.float32)
    out = {"isa": isa.selected()}
    weights = {"bf16": pack_bf16(bf), "q8_0": quantize_weight(w, "q8_0"), "q4_0": quantize_weight(w, "q4_0")}
    arrays = {k: linear(x, v) for k, v in weights.items()}
    for k, v in weights.items():  # row-count invariance on this path: every row alone, and 2..8 rows
        for r in range(9):
            assert np.array_equal(linear(x[r:r + 1], v)[0], arrays[k][r]), (k, r)
        for m in (2, 3, 5, 8):
            assert np.array_equal(linear(x[:m], v), arrays[k][:m]), (k, m)
    from dflash2_numba.quant.mxfp4_gemv import gemv_mxfp4  # MXFP4 as stored, f32 activations
    blocks = rng.integers(0, 256, (70, 3, 16), dtype=np.uint8)
    scales = rng.integers(115, 135, (70, 3), dtype=np.uint8)
    mx = lambda xx: gemv_mxfp4(xx, blocks, scales, np.zeros((len(xx), 70), np.float32), False)
    arrays["mxfp4"] = mx(x)
    for m in (1, 2, 3, 5, 8):
        assert np.array_equal(mx(x[:m]), arrays["mxfp4"][:m]), ("mxfp4", m)
    assert np.array_equal(mx(x[4:5])[0], arrays["mxfp4"][4])
    np.savez(sys.argv[1], **arrays)
    print(out["isa"])
""")


def _run_path(path, tmp_path):
    env = dict(os.environ, DFLASH2_ISA=path) if path else dict(os.environ)
    dest = tmp_path / f"{path or 'native'}.npz"
    r = subprocess.run([sys.executable, "-c", _PATH_SCRIPT, str(dest)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1], dict(np.load(dest))


def test_every_path_gives_the_same_bits(tmp_path):
    """bf16 panels, q8_0, q4_0 and MXFP4 (quant/mxfp4_gemv.py) on each lower path (compiled for that instruction set) equal
    this host's path bit for bit, and on every path each row of a 9-row product equals that row
    alone (and 2, 3, 5, 8-row products their rows): the row-count invariance per path."""
    have = isa.selected()
    native_isa, native = _run_path(None, tmp_path)
    assert native_isa == have
    lower = isa.PATHS[:isa.PATHS.index(have)]
    if have == "avx512_vnni" and not isa.target_features().get("avxvnni", False):
        lower = tuple(p for p in lower if p != "avx_vnni")
    for path in lower:
        got_isa, got = _run_path(path, tmp_path)
        assert got_isa == path
        for key in native:
            assert np.array_equal(got[key], native[key]), (path, key)


def test_override_refuses_a_higher_path(tmp_path):
    code = "import dflash2_numba"
    env = dict(os.environ, DFLASH2_ISA="generic")
    env_hi = dict(env, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="", DFLASH2_ISA="avx2")
    r = subprocess.run([sys.executable, "-c", code], env=env_hi, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "IsaUnavailableError" in r.stderr and "at most 'generic'" in r.stderr
    r = subprocess.run([sys.executable, "-c", code], env=dict(env, DFLASH2_ISA="sse9"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "expected one of generic, avx2, avx_vnni, avx512_vnni" in r.stderr


def test_classify_feature_sets():
    f = isa.parse_features
    assert isa.classify(f("+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512vnni")) == "avx512_vnni"
    assert isa.classify(f("+avx2,+fma,+avxvnni,-avx512f")) == "avx_vnni"
    assert isa.classify(f("+avx2,+fma,+avx512f,+avx512bw,+avx512vl")) == "avx2"  # AVX-512 without VNNI
    assert isa.classify(f("+avx2,-fma")) == "generic" and isa.classify({}) == "generic"
    assert json.dumps(isa.describe())
