"""bench/roofline.py's pieces: the peak probes really run their loop (time grows with the steps,
so LLVM removed nothing), and the streamed weights are distinct copies of the stated size."""

import time

import numpy as np
import pytest

from dflash2_numba.kernels import isa

from bench_scripts import load_bench


def test_probe_time_grows_with_the_steps():
    rl = load_bench("roofline.py", "roofline")
    for kind in sorted(set(rl.peak_kinds().values())):
        probe, _, macs = rl._probe(kind)
        probe(10)  # compile
        times = {}
        for n in (1 << 18, 1 << 21):
            best = np.inf
            for _ in range(3):
                t = time.perf_counter()
                probe(n)
                best = min(best, time.perf_counter() - t)
            times[n] = best
        assert times[1 << 21] > 4 * times[1 << 18], (kind, times)  # 8x the steps: well over 4x the time
        assert macs in (4, 8, 16, 32, 64)


def test_peak_kinds_follow_the_path():
    rl = load_bench("roofline.py", "roofline")
    kinds = rl.peak_kinds()
    assert kinds["bf16"] == "fma"
    want = {"avx512_vnni": "vnni512", "avx_vnni": "vnni256", "avx2": "int8_avx2"}.get(isa.selected())
    # AVX2: q8_0's signed weights take the sign trick (a vpsignb more), q4_0's nibbles do not
    want_q8 = "int8_avx2_sign" if isa.selected() == "avx2" else want
    assert kinds.get("q8_0") == want_q8 and kinds.get("q4_0") == want


def test_sign_trick_probe_runs_its_loop_and_is_not_faster_than_the_plain_one():
    """The q8_0 AVX2 roof: vpsignb + vpmaddubsw + vpmaddwd + vpaddd. Its loop runs (time grows
    with the steps) and, being the plain probe plus an instruction, is not the faster one."""
    if not isa.target_features().get("avx2"):
        pytest.skip("no AVX2 on this host")
    rl = load_bench("roofline.py", "roofline")
    probe, _, macs = rl._probe("int8_avx2_sign")
    probe(10)
    t = {}
    for n in (1 << 18, 1 << 21):
        t[n] = min(_timed(probe, n) for _ in range(3))
    assert t[1 << 21] > 4 * t[1 << 18] and macs == 32
    assert rl.peak_gmacs("int8_avx2_sign", 1, seconds=0.05, rounds=3) <= 1.05 * rl.peak_gmacs("int8_avx2", 1, seconds=0.05, rounds=3)


def _timed(f, n) -> float:
    t = time.perf_counter()
    f(n)
    return time.perf_counter() - t


def test_weights_are_distinct_copies(monkeypatch):
    rl = load_bench("roofline.py", "roofline")
    monkeypatch.setattr(rl, "SHAPE", (64, 64))
    monkeypatch.setattr(rl, "STREAM_BYTES", 1 << 18)
    for fmt in ("bf16", "q8_0", "q4_0"):
        copies, nbytes = rl.weights(fmt, np.random.default_rng(0))
        first = copies[0] if fmt == "bf16" else copies[0][0]
        assert len(copies) == max(1, rl.STREAM_BYTES // nbytes) >= 2
        second = copies[1] if fmt == "bf16" else copies[1][0]
        assert np.array_equal(first, second) and not np.shares_memory(first, second)


def test_pipe_probes_run_their_loops():
    """--pipes: every instruction's probe runs its loop (time grows with the steps; red: a step
    that returns its chain unchanged, a loop LLVM removes) and counts one instruction a chain
    and step."""
    if not isa.target_features().get("avx2") or isa.selected() == "generic":
        pytest.skip("no AVX2 path")
    rl = load_bench("roofline.py", "roofline")
    for kind in rl.PIPES:
        probe, _, count = rl._probe("pipe_" + kind)
        probe(10)
        t = {n: min(_timed(probe, n) for _ in range(3)) for n in (1 << 16, 1 << 19)}
        assert t[1 << 19] > 4 * t[1 << 16] and count == 1, (kind, t)
