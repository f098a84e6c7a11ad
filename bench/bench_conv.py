"""Grouped dynamic depthwise conv: @njit kernel vs the vectorised numpy version, side by side.

    python bench/bench_conv.py [--rows 64] [--repeat 7]

Shapes: DFlash2 drafts of H=5120 (Q=8) and H=6656 (Q=16), taps 2, group size 16, f32 and bf16.
GB/s counts bytes read (x, delta, base) + written (out) once each; absolute numbers only hold on
this machine, the numba/numpy ratio is the portable figure.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from dflash2_numba.kernels.conv import grouped_conv, grouped_conv_numpy  # noqa: E402
from dflash2_numba.numerics import f32_to_bf16_array  # noqa: E402

SHAPES = [(5120, 8), (6656, 16)]  # (H, Q)
TAPS, GROUP_SIZE = 2, 16


def best_of(fn, args, repeat):
    """Best wall time of `repeat` calls, after one warm-up call (compiles the @njit kernel)."""
    fn(*args)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def make_inputs(rng, dtype, n_rows, hidden):
    groups = hidden // GROUP_SIZE
    x = rng.standard_normal((n_rows, hidden)).astype(np.float32)  # [N, H]
    proj = (0.5 * rng.standard_normal((n_rows, 2 * TAPS * groups))).astype(np.float32)
    base = rng.standard_normal((TAPS, hidden)).astype(np.float32)  # [taps, H] (one side)
    if dtype == "bf16":
        x, proj, base = f32_to_bf16_array(x), f32_to_bf16_array(proj), f32_to_bf16_array(base)
    delta = proj.reshape(n_rows, 2, TAPS, groups)[:, 0]  # [N, taps, G] strided view, as the model
    return x, delta, base


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64, help="rows N (a few request blocks)")
    ap.add_argument("--repeat", type=int, default=7, help="best-of-k timing")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    print(f"rows N={args.rows}, taps={TAPS}, group_size={GROUP_SIZE}, best of {args.repeat}")
    header = f"{'H':>6} {'Q':>3} {'dtype':>5} | {'numba us':>9} {'GB/s':>6} | {'numpy us':>9} {'GB/s':>6} | {'numba/numpy speedup':>19}"
    print(header)
    print("-" * len(header))
    for hidden, block_len in SHAPES:
        for dtype in ("f32", "bf16"):
            x, delta, base = make_inputs(rng, dtype, args.rows, hidden)
            call = (x, delta, base, GROUP_SIZE, block_len)
            # Same answer before timing: the numpy version is a baseline, not a different op.
            assert np.array_equal(grouped_conv(*call), grouped_conv_numpy(*call))
            moved = 2 * x.nbytes + delta.nbytes + base.nbytes  # read x, delta, base; write out
            t_nb = best_of(grouped_conv, call, args.repeat)
            t_np = best_of(grouped_conv_numpy, call, args.repeat)
            print(f"{hidden:>6} {block_len:>3} {dtype:>5} | {t_nb * 1e6:>9.1f} {moved / t_nb / 1e9:>6.2f} | "
                  f"{t_np * 1e6:>9.1f} {moved / t_np / 1e9:>6.2f} | {t_np / t_nb:>18.1f}x")


if __name__ == "__main__":
    main()
