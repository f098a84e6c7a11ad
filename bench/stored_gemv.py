"""Speed of the stored-format GEMVs (quant/bytes_kernel.py, quant/int4.py) against the bf16
panels on one 4096 x 4096 matrix, one numba thread (docs/quantization.md: correct, not yet fast).

    python bench/stored_gemv.py [--rows 1,8] [--n 4096] [--k 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import numba

    from dflash2_numba.kernels.linear import linear
    from dflash2_numba.kernels.panels import pack_bf16
    from dflash2_numba.quant import bytes_kernel, int4
    from dflash2_numba.quant.stored import StoredWeight

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args(argv)
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    N, K = args.n, args.k
    bf16 = pack_bf16((rng.standard_normal((N, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    fp8 = StoredWeight("bytes", "fp8 block 128", (N, K),
                       {"w": rng.integers(0, 120, (N, K)).astype(np.uint8), "lut": bytes_kernel.E4M3,
                        "scale": np.ones((-(-N // 128), -(-K // 128)), np.float32), "block": np.array([128, 128])},
                       bytes_kernel.matmul_bytes, bytes_kernel.dequantize_bytes)
    seg, sg = int4.group_segments(K, 128)
    G = sg.shape[0]
    i4 = StoredWeight("int4", "int4 g128", (N, K),
                      int4.make_arrays(int4.pack_codes(rng.integers(0, 16, (N, K)).astype(np.uint8)),
                                       np.full((N, G), 8, np.uint8), np.ones((N, G), np.float32), seg, sg),
                      int4.matmul_int4, int4.dequantize_int4)
    for name, w in (("bf16 panels", bf16), ("fp8 block 128", fp8), ("int4 g128", i4)):
        for M in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((M, K)).astype(np.float32)
            linear(x, w)  # compile / warm
            t0, n = time.perf_counter(), 5
            for _ in range(n):
                linear(x, w)
            dt = (time.perf_counter() - t0) / n
            print(f"{name:14s} rows {M:2d}: {dt * 1e3:8.2f} ms  {2 * M * N * K / dt / 1e9:6.2f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
