"""A/B of the attention kernel against another checkout, in ONE process, runs interleaved.

    python bench/attention_ab.py --other /path/to/other/checkout [--threads 1,2]
        [--cases 8192x1,8192x8,2048x4,256x1] [--layers 12] [--rounds 12] [--shape 12,4,64]

On a shared VM consecutive runs of the same code move 5-10 %, so two processes timed one after
the other cannot show a 10 % change. Here the other checkout's package is copied under another
name (`dflash2_ab_other`) and imported beside this one; each round times this tree's
`attention`, then the other's, on the same arrays, and the table reports the median over rounds
of (other / this): > 1 means this tree is faster. `--layers N` cycles through N layers' worth
of K/V (12 x 16.8 MB at 8192 keys), so a long cache is read from DRAM as in a forward, not from
L3. The outputs are compared bit for bit first. Shapes: 12 query / 4 KV heads, hd 64 (the
100M bench target's). Set DFLASH2_ISA in the environment to A/B a lower path (both copies run
on it).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def import_other(checkout: Path):
    """The package of `checkout` imported as `dflash2_ab_other` (a copy in a temp dir)."""
    dst = Path(tempfile.mkdtemp(prefix="attention_ab_"))
    shutil.copytree(checkout / "dflash2_numba", dst / "dflash2_ab_other",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = dst / "dflash2_ab_other" / "__init__.py"  # this tree already applied DFLASH2_ISA
    init.write_text(re.sub(r"\n_apply_isa_override\(\)", "\n", init.read_text()))
    sys.path.insert(0, str(dst))
    from dflash2_ab_other.kernels import attention as other  # noqa: E402
    return other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, type=Path, help="the other checkout (holds dflash2_numba/)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--cases", default="8192x1,8192x8,2048x4,256x1", help="KEYSxROWS, comma-separated")
    ap.add_argument("--layers", type=int, default=12, help="layers of K/V cycled through (long caches)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--shape", default="12,4,64", help="query heads, KV heads, head size")
    args = ap.parse_args()

    import numba

    from dflash2_numba.kernels import attention as this
    from dflash2_numba.kernels.cache_check import check_kernel_cache
    from dflash2_numba.kernels.isa import selected

    check_kernel_cache()
    other = import_other(args.other.resolve())
    nh, nkv, hd = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(0)
    print(f"path {selected()}; other / this time, median of {args.rounds} interleaved rounds (> 1: this tree is faster)")
    print("| threads | keys | rows | layers | this ms / layer | other ms / layer | other / this (range) | bits |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        numba.set_num_threads(threads)
        for case in args.cases.split(","):
            T, rows = (int(x) for x in case.split("x"))
            L = args.layers if T >= 2048 else 1  # short caches stay in cache anyway
            ks = [rng.standard_normal((nkv, T + 64, hd), dtype=np.float32) for _ in range(L)]
            vs = [rng.standard_normal((nkv, T + 64, hd), dtype=np.float32) for _ in range(L)]
            q = rng.standard_normal((rows, nh, hd), dtype=np.float32)
            qp, kp = np.arange(T - rows, T, dtype=np.int64), np.arange(T, dtype=np.int64)
            same = np.array_equal(this.attention(q, ks[0], vs[0], qp, kp).view(np.uint32),
                                  other.attention(q, ks[0], vs[0], qp, kp).view(np.uint32))
            reps = max(1, int(2e6 // (T * rows * nh)))

            def timed(mod):
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        for layer in range(L):
                            mod.attention(q, ks[layer], vs[layer], qp, kp)
                    best = min(best, (time.perf_counter() - t0) / (reps * L))
                return best
            a, b = [], []
            for _ in range(args.rounds):
                a.append(timed(this))
                b.append(timed(other))
            ratio = np.array(b) / np.array(a)
            print(f"| {threads} | {T} | {rows} | {L} | {np.median(a) * 1e3:.3f} | {np.median(b) * 1e3:.3f} | "
                  f"{np.median(ratio):.3f} ({ratio.min():.2f}-{ratio.max():.2f}) | {'same' if same else 'DIFFER'} |",
                  flush=True)


if __name__ == "__main__":
    main()
