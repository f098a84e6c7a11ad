"""bf16 GEMV y = x @ w.T (x [M, K] f32, w [N, K] bf16): row-layout kernel vs panel kernel.

    python bench/bench_gemv.py [--repeat 9] [--threads 1] [--shapes 2048x768,32000x768]

row   = kernels/linear.py's numba kernel on the checkpoint layout [N, K] (dot products along K;
        what the CPU device ran before the panels; still the path of float32 weights);
panel = kernels/panels.py on the weight repacked at load into 32-column panels (what the CPU
        device runs now).
Each (shape, rows) cell times the two ALTERNATELY `repeat` times and reports medians, so both
see the same machine state; "x1" is the cost relative to the same kernel's 1-row product, the
figure that decides what a Q-row verify costs. GB/s counts the bf16 weight bytes (N*K*2) read
once per call; GMAC/s = M*N*K / time. The reference read bandwidth is bench/bandwidth.py's
four-stream sum over 1 GiB, measured in the same process with the same threads. Shapes: the ~100M Qwen3 of
bench_target.py (hidden 768, MLP 2048, head 32000), the embedded target (hidden 256, MLP 768,
head 4096) and the 8x widened pair of bench/scaled_pair.py (hidden 2048, MLP 6144).
A matrix that fits the caches is read from them: the widened shapes are the streaming regime.
"""

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--shapes", default="768x768,2048x768,768x2048,32000x768,256x256,768x256,4096x256,"
                                        "2048x2048,6144x2048,2048x6144,4096x2048")
    return ap.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["NUMBA_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash2_numba.kernels import linear as L  # noqa: E402
from dflash2_numba.kernels import panels as P  # noqa: E402
from dflash2_numba.numerics import f32_to_bf16_array  # noqa: E402
from bandwidth import read_bandwidth  # noqa: E402  (bench/bandwidth.py)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs; {' '.join(have)})"
    except OSError:
        pass
    return "unknown CPU"


def main(args) -> None:
    import numba

    par = args.threads > 1
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"CPU: {cpu_name()}; numba threads {numba.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")
    bw = read_bandwidth([args.threads])[str(args.threads)]["best_gbs"]
    print(f"read bandwidth (bench/bandwidth.py, 1 GiB, {args.threads} thread(s)): {bw:.1f} GB/s")
    print(f"medians of {args.repeat} alternating runs; x1 = cost relative to the kernel's own 1-row product")
    head = f"{'N':>6s} {'K':>5s} {'M':>3s} | {'row ms':>8s} {'x1':>5s} {'GB/s':>6s} {'GMAC/s':>6s} | " \
           f"{'panel ms':>8s} {'x1':>5s} {'GB/s':>6s} {'GMAC/s':>6s} | {'row/panel':>9s}"
    print(head)
    print("-" * len(head))
    rng = np.random.default_rng(0)
    row_kernel = L._gemv_par if par else L._gemv_ser
    panel_kernel = P._gemv_panels_par if par else P._gemv_panels_ser
    for N, K in shapes:
        w = f32_to_bf16_array(rng.standard_normal((N, K)).astype(np.float32) * 0.05)  # [N, K]
        panels = P.pack_panels(w)
        one = {}
        for M in rows:
            x = rng.standard_normal((M, K)).astype(np.float32)
            y_row, y_panel = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
            row_kernel(x, w, y_row)
            panel_kernel(x, panels, y_panel)
            np.testing.assert_allclose(y_panel, y_row, rtol=1e-4, atol=1e-4 * np.abs(y_row).max())
            t_row, t_panel = [], []
            for _ in range(args.repeat):
                t_row.append(_timed(lambda: row_kernel(x, w, y_row)))
                t_panel.append(_timed(lambda: panel_kernel(x, panels, y_panel)))
            t_row, t_panel = float(np.median(t_row)), float(np.median(t_panel))
            if M == rows[0]:
                one = {"row": t_row, "panel": t_panel}
            cells = []
            for name, t in (("row", t_row), ("panel", t_panel)):
                cells.append(f"{t * 1e3:8.3f} {t / one[name]:5.2f} {N * K * 2 / t / 1e9:6.1f} {M * N * K / t / 1e9:6.1f}")
            print(f"{N:6d} {K:5d} {M:3d} | {cells[0]} | {cells[1]} | {t_row / t_panel:9.2f}", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(ARGS)
