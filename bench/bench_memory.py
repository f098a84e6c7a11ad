"""Peak resident memory of a target run per weight format, each in a fresh process.

    python bench/bench_memory.py [--target DIR] [--formats bf16,q8_0,q4_0] [--tokens 32]
        [--out bench/results/memory.json]

Each format runs in its own Python process: load the target (default: bench_target.py's ~120M
Qwen3), decode --tokens greedy tokens, then report getrusage's ru_maxrss (the process's PEAK
resident set, load-time quantization included) and the bytes the loaded weights hold. The
ratio to bf16's run is the figure of issue 16 (q8_0 <= 0.6x). Interpreter + numba + LLVM are in
every process alike (the `baseline` row: the same imports and a compile, no model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CHILD = r"""
import json, sys, numpy as np
from dflash2_numba.decode.stats import peak_rss_mb
fmt, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {"format": fmt}
if fmt != "baseline":
    from dflash2_numba import generate, load_target
    t = load_target(path, quantize=fmt)
    ws = [t.lm_head_w] + [L[k] for L in t.layers for k in ("q", "k", "v", "o", "gate", "up", "down")]
    def held(w):  # QuantizedWeight.nbytes is its panels; a PackedBF16 holds its panel copy
        p = getattr(w, "panels", None)
        return w.nbytes if p is None or isinstance(p, tuple) else p.nbytes
    out["weight_bytes"] = int(sum(held(w) for w in ws))
    out["tokens"] = generate(t, None, prompt_ids=list(range(1, 17)), max_new_tokens=n).output_ids[:8]
else:
    from dflash2_numba.kernels import linear
    linear.linear(np.ones((1, 32), np.float32), np.ones((32, 32), np.float32))
out["peak_rss_mb"] = peak_rss_mb()
print(json.dumps(out))
"""


def main(argv=None) -> int:
    from bench_target import model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--formats", default="bf16,q8_0,q4_0")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash2_numba")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "memory.json")
    args = ap.parse_args(argv)
    path = args.target or model_dir(args.cache_dir)
    from dflash2_numba.kernels import isa

    rows = []
    for fmt in ["baseline"] + [f for f in args.formats.split(",") if f]:
        r = subprocess.run([sys.executable, "-c", CHILD, fmt, str(path), str(args.tokens)], capture_output=True,
                           text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    bf16 = next((r["peak_rss_mb"] for r in rows if r["format"] == "bf16"), None)
    print(f"target {path}; isa {isa.describe()}")
    print(f"  {'format':9s} {'peak RSS MB':>11s} {'x bf16':>7s} {'weights MB':>10s}")
    for r in rows:
        ratio = r["peak_rss_mb"] / bf16 if bf16 else float("nan")
        r["x_bf16"] = ratio
        print(f"  {r['format']:9s} {r['peak_rss_mb']:11.0f} {ratio:7.2f} {r.get('weight_bytes', 0) / 1e6:10.0f}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"target": str(path), "cpu": cpu, "isa": isa.describe(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
