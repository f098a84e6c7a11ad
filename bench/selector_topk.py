"""The DFlash2 selector's top-K (models/selector.py `_top_k_rows`) against the one-by-one pass
it replaced, side by side in one run: same ids asserted first, then the median time per call.

    python bench/selector_topk.py [--rows 15] [--K 16] [--vocabs 4096,32000,151936] [--out PATH]

Logits are numpy-RNG normals (scale 3, like a draft's head); one call = every mask row of a
draft block (B - 1 rows: 15 for a B = 16 draft).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from acceptance import machine_info  # noqa: E402

from dflash2_numba.kernels import isa  # noqa: E402
from dflash2_numba.models.selector import TOPK_CHUNK, _top_k_rows, _topk_insert  # noqa: E402


@njit(cache=True, nogil=True)
def one_by_one(z, valid_vocab, ids, vals):
    """The previous kernel: every id offered to the sorted list of K (the same insert step)."""
    k, V = z.shape
    K = ids.shape[1]
    for l in range(k):
        n = 0
        for t in range(V):
            n = _topk_insert(z, l, t, valid_vocab, ids, vals, n, K)


def median_us(fn, z, valid, K, reps=200) -> float:
    ids, vals = np.empty((z.shape[0], K), np.int64), np.empty((z.shape[0], K), np.float32)
    fn(z, valid, ids, vals)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(z, valid, ids, vals)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--K", type=int, default=16)
    ap.add_argument("--vocabs", default="4096,32000,151936")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for V in (int(v) for v in args.vocabs.split(",")):
        z = (rng.standard_normal((args.rows, V)) * 3).astype(np.float32)
        got = [np.empty((args.rows, args.K), np.int64) for _ in range(2)]
        for fn, ids in ((_top_k_rows, got[0]), (one_by_one, got[1])):
            fn(z, V, ids, np.empty((args.rows, args.K), np.float32))
        if not np.array_equal(got[0], got[1]):
            raise SystemExit(f"V={V}: the screened kernel picks other ids than the one-by-one pass")
        t_new, t_old = median_us(_top_k_rows, z, V, args.K), median_us(one_by_one, z, V, args.K)
        results.append({"vocab": V, "rows": args.rows, "K": args.K, "screened_us": round(t_new, 1),
                        "one_by_one_us": round(t_old, 1), "speedup": round(t_old / t_new, 2)})
        print(f"V={V:>6} rows={args.rows} K={args.K}: screened {t_new:8.1f} us  one-by-one {t_old:8.1f} us  "
              f"{t_old / t_new:5.2f}x  (same ids)")
    out = {"machine": machine_info(1), "isa": isa.describe(), "chunk": TOPK_CHUNK, "results": results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
