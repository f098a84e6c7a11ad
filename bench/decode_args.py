"""Command line shared by the decode benchmarks (bench_target.py, bench_hybrid.py).

Imports nothing heavy: `--threads` must reach the environment (NUMBA_NUM_THREADS,
OPENBLAS_NUM_THREADS, OMP_NUM_THREADS) before numpy or numba is imported, so the scripts
call this first and import numpy after it.
"""

import argparse
import os
from pathlib import Path


def decode_bench_args(doc: str, with_q: bool = False) -> argparse.Namespace:
    """--steps, --prefill, --rounds, --threads, --cache-dir (and --Q with `with_q`), parsed;
    with --threads N the thread environment variables are set to N."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=16)
    if with_q:
        ap.add_argument("--Q", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash2_numba")
    args = ap.parse_args()
    if args.threads:
        for var in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    return args
