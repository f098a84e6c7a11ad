"""One-row GEMV streaming from memory: GB/s of q4_0 / q8_0 / MXFP4 weights against a plain read.

    python bench/quant_stream.py [--threads 1] [--mb 512] [--rounds 5] [--out bench/results/quant_stream.json]
    DFLASH2_ISA=avx2 python bench/quant_stream.py ...          # a lower instruction-set path

A decode step reads every weight once for one activation row, so its speed is this figure. One
weight of ~--mb MB per format (a random [8192, 2048] bf16 matrix quantized and repeated along the
outputs, larger than any cache; MXFP4: random codes and scales in the Hub's [N, K/32, 16] layout),
y = x @ W.T once per round through the numba kernel (no Python per call), best of --rounds; beside it a numpy `a.sum()` over --mb MB (one stream, the same
thread count as numpy's). The formats and the read are timed alternately, round by round.
Records the CPU, the numba host name, the integer kernels' path (kernels/isa.py) and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import cpu_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import numba
    from numba import njit

    numba.set_num_threads(args.threads)
    from dflash2_numba.kernels import isa
    from dflash2_numba.kernels.backend import get_ops
    from dflash2_numba.numerics import f32_to_bf16_array
    from dflash2_numba.quant.kernels_int8 import gemv_quant
    from dflash2_numba.quant.mxfp4_gemv import POW2
    from dflash2_numba.quant.mxfp4_gemv import _gemv_par as mx_par
    from dflash2_numba.quant.mxfp4_gemv import _gemv_ser as mx_ser

    @njit(nogil=True)
    def one(x, w, y, parallel):
        gemv_quant(x, w, y, parallel)

    rng = np.random.default_rng(0)
    K, N0 = 2048, 8192
    base = f32_to_bf16_array(rng.standard_normal((N0, K), dtype=np.float32) * np.float32(0.05))
    x = rng.standard_normal((1, K), dtype=np.float32)
    weights = {}
    for fmt, bpw in (("q4_0", 18 / 32), ("q8_0", 34 / 32)):
        qw, ws = get_ops("cpu", fmt, False).prepare_weight(base).panels
        reps = max(1, round(args.mb * 2**20 / (N0 * K * bpw)))
        weights[fmt] = (np.concatenate([qw] * reps), np.concatenate([ws] * reps))  # [reps * N0 / 32 panels]
    probe = np.ones(args.mb * 2**20 // 8)
    parallel = args.threads > 1
    ys = {fmt: np.zeros((1, w[0].shape[0] * 32), np.float32) for fmt, w in weights.items()}
    mx_rows = args.mb * 2**20 // (K // 32 * 17)  # [N, K/32] blocks of 16 code bytes + 1 scale byte
    mx = (rng.integers(0, 256, (mx_rows, K // 32, 16), dtype=np.uint8),
          rng.integers(118, 128, (mx_rows, K // 32), dtype=np.uint8))
    mx_y = np.zeros((1, mx_rows), np.float32)
    mx_gemv = mx_par if parallel else mx_ser
    for fmt, w in weights.items():
        one(x, w, ys[fmt], parallel)  # compile
    mx_gemv(x, *mx, POW2, mx_y)
    times = {name: [] for name in (*weights, "mxfp4", "numpy_read")}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for fmt, w in weights.items():
            t0 = time.perf_counter()
            one(x, w, ys[fmt], parallel)
            times[fmt].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx_gemv(x, *mx, POW2, mx_y)
        times["mxfp4"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        probe.sum()
        times["numpy_read"].append(time.perf_counter() - t0)
    nbytes = {fmt: w[0].nbytes + w[1].nbytes for fmt, w in weights.items()}
    nbytes["mxfp4"] = mx[0].nbytes + mx[1].nbytes
    nbytes["numpy_read"] = probe.nbytes
    gbs = {name: nbytes[name] / min(t) / 1e9 for name, t in times.items()}
    result = {
        "cpu": cpu_model(), "host_cpu_name": numba.config.CPU_NAME or __import__("llvmlite.binding").binding.get_host_cpu_name(),
        "isa_path": isa.selected(), "threads": args.threads, "mb": args.mb, "rounds": args.rounds,
        "load_avg": [load0, os.getloadavg()[0]], "gb_per_s": gbs,
        "fraction_of_read": {fmt: gbs[fmt] / gbs["numpy_read"] for fmt in (*weights, "mxfp4")},
        "seconds": times,
    }
    print(f"{result['cpu']} | path {result['isa_path']} | {args.threads} thread(s) | load {load0:.2f}")
    for name, v in gbs.items():
        frac = f"  ({v / gbs['numpy_read']:.2f} of the read)" if name != "numpy_read" else ""
        print(f"  {name:10s} {v:6.2f} GB/s{frac}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
