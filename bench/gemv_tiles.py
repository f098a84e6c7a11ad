"""One-row integer GEMV tile variants side by side: panels read at once (P = 1, 2, 4) x weight
format, from L2 and from memory, each checked bit for bit against the numpy int64 reference.

    python bench/gemv_tiles.py [--rounds 9]
    DFLASH2_ISA=avx2 python bench/gemv_tiles.py          # a lower instruction-set path

The variants are built in one process from quant/kernels_int8.py's own tile factory (`_tile`,
`_make_item`) and timed alternately round by round (best of --rounds), so load moves them alike.
"from memory" streams 64 distinct copies of a [1536, 2048] weight (a Qwen3-30B-A3B expert's
gate_up) and of a [2048, 768] one (its down); "L2" repeats one [512, 2048] weight. kernels_int8
picks P = 4 on the AVX-512 path and P = 1 on the 256-bit ones from this table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from numba import njit  # noqa: E402

from acceptance import cpu_model  # noqa: E402
from dflash2_numba.kernels import isa  # noqa: E402
from dflash2_numba.quant import kernels_int8 as k  # noqa: E402
from dflash2_numba.quant.formats import ITEM_PANELS, pack, quantize_q4_0, quantize_q8_0  # noqa: E402

PANELS = (1, 2, 4)
CASES = (((1536, 2048), 64, "memory gate_up"), ((2048, 768), 64, "memory down"), ((512, 2048), 1, "L2"))


def driver(fmt: str, P: int):
    """The serial GEMV with a one-row tile over P panels (the 4- and 2-row tiles as shipped)."""
    item = k._make_item(k._tile(4, k._G, fmt), k._tile(2, k._G, fmt), k._tile(1, P * k._G, fmt, P), t1_panels=P)

    @njit(nogil=True)
    def gemv(xq, xs, xc, qw, ws, y):
        for b in range(qw.shape[0] // ITEM_PANELS):
            item(xq, xs, xc, qw, ws, y, b)
    return gemv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"{cpu_model()} | path {isa.selected()} | 1 thread | GB/s of weight bytes, best of {args.rounds}")
    for fmt, quantize in (("q4_0", quantize_q4_0), ("q8_0", quantize_q8_0)):
        drivers = {P: driver(fmt, P) for P in PANELS}
        for (N, K), copies, label in CASES:
            q, d = quantize(rng.standard_normal((N, K)).astype(np.float32))
            qw, ws = pack(q, d, fmt, unsigned=k.VNNI)
            weights = [(qw.copy(), ws.copy()) for _ in range(copies)]
            x = rng.standard_normal((1, K)).astype(np.float32)
            xq, xs, xc = k.quantize_rows_entry(x, K)
            want = k.gemv_quant_reference(x, q, d)
            y = np.zeros((1, N), np.float32)
            for P, f in drivers.items():
                f(xq, xs, xc, qw, ws, y)
                assert np.array_equal(y, want), f"{fmt} P={P}: not the reference's bits"
            nbytes = sum(a.nbytes + b.nbytes for a, b in weights)
            reps = 200 if copies == 1 else 1
            best = dict.fromkeys(PANELS, np.inf)
            for _ in range(args.rounds):
                for P, f in drivers.items():
                    t = time.perf_counter()
                    for _ in range(reps):
                        for a, b in weights:
                            f(xq, xs, xc, a, b, y)
                    best[P] = min(best[P], (time.perf_counter() - t) / reps)
            print(f"  {fmt} {label:15s} " + "  ".join(f"P={P}: {nbytes / best[P] / 1e9:5.1f}" for P in PANELS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
