"""Q4_K (quant/q4_k.py, quant/kernels_q4k.py): the block bytes against llama.cpp's own quantizer,
the integer kernels against numpy (int64 and an exact integer case), and the row-count / thread /
instruction-set invariance the lossless verify needs.

References we did not write: llama.cpp's ggml_quantize_chunk (tests/llama_refs.py; the bench
extra), bytes it produced once for a fixed input (tests/data/q4_k_golden.npz: checked here on
every run, and re-checked against llama.cpp where it is installed), and gguf-py's Q4_K reader.

Mutations tried (docs/quantization.md lists them with the tests that turned red):
- a six-bit scale / min packing error (the high bits of sub-blocks 4..7 from the wrong byte);
- the quantizer's nearest_int rounding half away from zero instead of ggml's ties-to-even trick;
- one sub-block's min ignored in the kernel (msum without sub-block 7);
- q8_K activations rounded half away from zero for M > 1 only (row-count dependent);
- the avx2 path's vpmaddwd multiplier 2 in one lane (caught only by the path test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dflash2_numba.errors import QuantizeError
from dflash2_numba.kernels import isa
from dflash2_numba.kernels.cache_check import check_kernel_cache
from dflash2_numba.kernels.linear import linear
from dflash2_numba.quant import kernels_q4k as KQ
from dflash2_numba.quant import q4_k
from dflash2_numba.quant.weights import quantize_weight

sys.path.insert(0, str(Path(__file__).parent))
import llama_refs  # noqa: E402
from test_quant import sweep_rows_and_threads  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "q4_k_golden.npz"

# kernels_q4k inlines q4_k.nearest_int: numba's cache keys a kernel on its own file only, so a
# changed q4_k.py would leave stale kernels without the package-wide fingerprint check
check_kernel_cache()


def golden_input() -> np.ndarray:
    """[12, 512] f32 covering the quantizer's branches: normal rows at several scales, bf16
    values, all-positive and all-negative super-blocks, an all-zero super-block and sub-block, a
    constant sub-block, outliers, and values tiny enough for subnormal fp16 d / dmin."""
    rng = np.random.default_rng(24)
    x = rng.standard_normal((12, 512)).astype(np.float32)
    x[1] *= np.float32(0.02)
    x[2] = (x[2].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # bf16 values
    x[3, :256] = np.abs(x[3, :256])  # min 0: no offset
    x[3, 256:] = -np.abs(x[3, 256:])
    x[4, :256] = 0.0  # d = dmin = 0
    x[4, 256:288] = 0.0
    x[5, :32] = np.float32(0.75)  # max == min in a sub-block
    x[5, 300] = np.float32(40.0)  # one dominant sub-block scale
    x[6] *= np.float32(1e-6)  # d, dmin below fp16's smallest normal
    x[7] = rng.uniform(-1, 1, 512).astype(np.float32) + np.float32(3.0)  # all positive, large offset
    x[8] = np.round(x[8] * 4) / 4  # values on a grid: exact ties
    x[9] *= np.float32(300.0)
    x[10, ::17] *= np.float32(25.0)
    x[11] = rng.laplace(size=512).astype(np.float32)
    return x


# ---------------------------------------------------------------- the bytes: llama.cpp's
def test_bytes_equal_llamacpp_golden():
    """quantize_q4_k == the bytes llama.cpp's quantizer wrote for golden_input() (stored file)."""
    want = np.load(GOLDEN)["blocks"]
    assert want.shape == (12, 2, 144)
    assert np.array_equal(q4_k.quantize_q4_k(golden_input()), want)


def test_bytes_equal_llamacpp_quantizer():
    """quantize_q4_k == llama.cpp's ggml_quantize_chunk(Q4_K), byte for byte, on the golden input
    (so the stored file is llama.cpp's) and on 4096 random rows at scales from 1e-4 to 10, from
    f32, f16 and bf16 sources (skipped without llama-cpp-python)."""
    assert np.array_equal(llama_refs.quantize(golden_input()), np.load(GOLDEN)["blocks"])
    rng = np.random.default_rng(7)
    for scale in (1e-4, 0.02, 1.0, 10.0):
        x = (rng.standard_normal((1024, 512)) * scale).astype(np.float32)
        x[::7] += np.float32(scale)  # offsets: non-zero mins
        mine, theirs = q4_k.quantize_q4_k(x), llama_refs.quantize(x)
        bad = np.argwhere(np.any(mine != theirs, axis=2))
        assert not len(bad), f"scale {scale}: {len(bad)} blocks differ, first (row, block) {bad[:3].tolist()}"
    bits = (rng.standard_normal((64, 768)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(q4_k.quantize_q4_k(bits), llama_refs.quantize(as_f32))
    h = rng.standard_normal((16, 256)).astype(np.float16)
    assert np.array_equal(q4_k.quantize_q4_k(h), llama_refs.quantize(h.astype(np.float32)))


def test_parallel_quantizer_same_bytes(monkeypatch):
    """Big tensors take the parallel quantizer (rows over threads): the same bytes."""
    monkeypatch.setattr(q4_k, "PARALLEL_MIN_ELEMS", 0)
    assert np.array_equal(q4_k.quantize_q4_k(golden_input()), np.load(GOLDEN)["blocks"])


def test_dequantize_matches_gguf_py():
    """Our reading of the block (scales / mins unpacking, nibble order) == gguf-py's Q4_K reader."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    blocks = np.load(GOLDEN)["blocks"]
    theirs = gq.dequantize(blocks.reshape(12, -1), GGMLQuantizationType.Q4_K)
    assert np.array_equal(q4_k.dequantize_q4_k(blocks), theirs.astype(np.float32))


def test_quantize_refusals():
    with pytest.raises(QuantizeError, match=r"layer\.w: q4_k.*multiple of 256.*\[4, 384\]"):
        quantize_weight(np.zeros((4, 384), np.float32), "q4_k", "layer.w")
    with pytest.raises(QuantizeError, match="int32"):
        quantize_weight(np.zeros((4, 256), np.int32), "q4_k", "layer.w")


def test_load_refuses_a_target_too_narrow(tmp_path):
    """A whole target whose input features are not multiples of 256: a named refusal at load."""
    from dflash2_numba import tiny
    from dflash2_numba.api import load_target

    tiny.write_target(tmp_path / "t", seed=0)  # hidden 64
    with pytest.raises(QuantizeError, match=r"q4_k needs input features .* multiple of 256.*, 64\]"):
        load_target(tmp_path / "t", quantize="q4_k")


# ---------------------------------------------------------------- activations (q8_K)
def test_activation_quantizer_matches_numpy():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    x[0, :256] = np.arange(256, dtype=np.float32) % 200 - np.float32(99.5)  # iscale = 1: q = x on .5 ties
    x[0, 0] = -127.0
    x[1, 256:] = 0.0
    x[2, :256] *= np.float32(1e-30)
    got = KQ.quantize_rows_k_entry(x, 512)
    ref = KQ.quantize_rows_k_reference(x)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    for r in range(9):
        one = KQ.quantize_rows_k_entry(x[r:r + 1], 512)
        assert all(np.array_equal(a[0], b[r]) for a, b in zip(one, got))


# ---------------------------------------------------------------- kernels
def _blocks_from_parts(q, sc, m, d, dmin):
    """Hand-made block bytes (q [N, K] 0..15, sc / m [N, nsb, 8] 0..63, d / dmin [N, nsb] f16)."""
    N, K = q.shape
    nsb = K // 256
    out = np.zeros((N, nsb, 144), np.uint8)
    out[:, :, 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 2:4] = dmin.astype(np.float16)[..., None].view(np.uint8)
    s = out[:, :, 4:16]
    s[:, :, 0:4] = sc[:, :, :4] | ((sc[:, :, 4:] >> 4) << 6)
    s[:, :, 4:8] = m[:, :, :4] | ((m[:, :, 4:] >> 4) << 6)
    s[:, :, 8:12] = (sc[:, :, 4:] & 15) | ((m[:, :, 4:] & 15) << 4)
    qq = q.reshape(N, nsb, 4, 2, 32)
    out[:, :, 16:] = (qq[:, :, :, 0] | (qq[:, :, :, 1] << 4)).reshape(N, nsb, 128)
    return out


def test_integer_core_is_exact():
    """d = dmin = 1 and activations whose 256-blocks have max -127 (q8_K then keeps x as is,
    d = 1): y is the exact integer product with w = sc_j * q - m_j, compared with numpy int64,
    over widths with a partial last work item (every six-bit scale and min counts)."""
    rng = np.random.default_rng(5)
    for N, K in ((200, 256), (33, 512), (130, 768)):
        nsb = K // 256
        q = rng.integers(0, 16, (N, K)).astype(np.uint8)
        sc = rng.integers(0, 64, (N, nsb, 8)).astype(np.uint8)
        m = rng.integers(0, 64, (N, nsb, 8)).astype(np.uint8)
        ones = np.ones((N, nsb), np.float16)
        blocks = _blocks_from_parts(q, sc, m, ones, ones)
        w_int = (np.repeat(sc, 32, axis=2).reshape(N, K).astype(np.int64) * q
                 - np.repeat(m, 32, axis=2).reshape(N, K))
        assert np.array_equal(q4_k.dequantize_q4_k(blocks), w_int.astype(np.float32))
        xi = rng.integers(-40, 41, (7, K)).astype(np.float32)
        xi[:, ::256] = -127.0
        from dflash2_numba.quant.weights import QuantizedWeight

        y = linear(xi, QuantizedWeight("q4_k", (N, K), q4_k.pack(blocks)))
        assert np.array_equal(y, (xi.astype(np.int64) @ w_int.T).astype(np.float32)), (N, K)


@pytest.mark.parametrize("N,K", [(1, 256), (31, 512), (129, 768), (300, 1024)])
def test_kernel_matches_reference(N, K):
    """Bit for bit the numpy reference (int64 sub-block dots + the one epilogue), every row count
    1..17, 32 and a prefill-size 40, at one and two threads with the parallel threshold 0."""
    rng = np.random.default_rng(N * 7 + K)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[:, :K // 2] += np.float32(0.5)
    blocks = q4_k.quantize_q4_k(w)
    sweep_rows_and_threads(quantize_weight(w, "q4_k"), lambda x: KQ.gemv_q4k_reference(x, blocks), rng)


def test_close_to_the_dequantized_float_product():
    """A sanity bound, not the contract: within 2% of x @ dequant(w).T (q8_K activations)."""
    rng = np.random.default_rng(10)
    w = rng.standard_normal((256, 1024)).astype(np.float32)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    exact = x @ q4_k.dequantize_q4_k(q4_k.quantize_q4_k(w)).T
    err = np.abs(linear(x, quantize_weight(w, "q4_k")) - exact).max() / np.abs(exact).max()
    assert err < 0.02, err


# ---------------------------------------------------------------- every path, the same bits
_PATH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    import dflash2_numba
    from dflash2_numba.kernels import isa
    from dflash2_numba.kernels.linear import linear
    from dflash2_numba.quant.weights import quantize_weight
    rng = np.random.default_rng(11)
    w = rng.standard_normal((300, 512)).astype(np.float32)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    qw = quantize_weight(w, "q4_k")
    if sys.argv[2] == "compile":  # another machine's instruction set: compile, never run
        from dflash2_numba.quant.kernels_int8 import _gemv_quant_ser
        from dflash2_numba.quant.kernels_q4k import quantize_rows_k_entry
        args = quantize_rows_k_entry(x, 512) + qw.panels + (np.zeros((9, 300), np.float32),)
        sig = tuple(__import__("numba").typeof(a) for a in args)
        _gemv_quant_ser.compile(sig)
        asm = _gemv_quant_ser.inspect_asm(sig)
        print(isa.selected(), "vpdpbusd" in asm, "ymm" in asm, "zmm" in asm)
        sys.exit(0)
    y = linear(x, qw)
    for r in range(9):  # row-count invariance on this path
        assert np.array_equal(linear(x[r:r + 1], qw)[0], y[r]), r
    for m in (2, 3, 5, 8):
        assert np.array_equal(linear(x[:m], qw), y[:m]), m
    np.save(sys.argv[1], y)
    print(isa.selected())
""")

HASWELL = "+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+fsgsbase,+lzcnt,+movbe,+pclmul,+popcnt,+rdrnd,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave"


def _run(tmp_path, env_extra, mode="run"):
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH2_ISA", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env.update(env_extra)
    dest = tmp_path / "y.npy"
    r = subprocess.run([sys.executable, "-c", _PATH_SCRIPT, str(dest), mode], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip().splitlines()[-1]
    return out, (np.load(dest) if mode == "run" else None)


def test_every_path_gives_the_same_bits(tmp_path):
    """The q4_k kernels on this host's path, on each lower path (DFLASH2_ISA) and compiled for a
    Haswell target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES: AVX2 + FMA) give the same bits, and on
    every path each row of a 9-row product equals that row alone. The numpy reference is the
    anchor: the host's result equals it."""
    have = isa.selected()
    rng = np.random.default_rng(11)
    w = rng.standard_normal((300, 512)).astype(np.float32)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    ref = KQ.gemv_q4k_reference(x, q4_k.quantize_q4_k(w))
    native_isa, native = _run(tmp_path, {})
    assert native_isa == have and np.array_equal(native, ref)
    lower = [p for p in isa.PATHS[:isa.PATHS.index(have)] if p != "avx_vnni" or isa.target_features().get("avxvnni")]
    runs = [({"DFLASH2_ISA": p}, p) for p in lower]
    if isa.target_features().get("avx2") and isa.target_features().get("fma"):
        runs.append(({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": HASWELL}, "avx2"))
    for env, path in runs:
        got_isa, got = _run(tmp_path, env)
        assert got_isa == path, (env, got_isa)
        assert np.array_equal(got, native), env


def test_compiles_for_other_instruction_sets(tmp_path):
    """Compile-only (never run) for targets this host may lack: AVX-VNNI without AVX-512
    (Alder Lake: the ymm vpdpbusd) and AVX-512 VNNI (Ice Lake server: zmm). Each compiles into
    an empty NUMBA_CACHE_DIR: numba returns no assembly for a kernel it loaded from its cache, so
    a cache warmed by an earlier run (this test's own, with the same sources) would read as
    "no vpdpbusd"."""
    alder = HASWELL + ",+avxvnni,-avx512f,-avx512bw,-avx512vl,-avx512vnni"
    out, _ = _run(tmp_path, {"NUMBA_CPU_NAME": "alderlake", "NUMBA_CPU_FEATURES": alder,
                             "NUMBA_CACHE_DIR": str(tmp_path / "cache_alder")}, "compile")
    assert out.split() == ["avx_vnni", "True", "True", "False"], out
    ice = HASWELL + ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd,+avx512vnni"
    out, _ = _run(tmp_path, {"NUMBA_CPU_NAME": "icelake-server", "NUMBA_CPU_FEATURES": ice,
                             "NUMBA_CACHE_DIR": str(tmp_path / "cache_ice")}, "compile")
    assert out.split()[:2] == ["avx512_vnni", "True"] and out.split()[3] == "True", out
