"""The same prompt decoded on --device cpu and --device cuda, target-only and speculative (Q 8):
tok/s of each, speculative == target-only on each device, and how far cpu and cuda agree.
Run by bench/gpu_device_run.sh (docs/gpu.md); DEVS=cpu runs it without a GPU.

    python bench/gpu_decode.py [--pair readme|x8] [--dtype f32|bf16] [--long-prompt] [--new-tokens 64]

--pair x8: the widened x8 pair in /tmp/x8 (written there by bench/scaled_pair.py when missing).
--long-prompt: a 374-token prompt, past one attention tile (256 keys), where the devices' bf16
weight rounding had parted before session 15. Timed runs follow one untimed warm-up (the
compile), except with --long-prompt, whose seconds include it.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import dflash2_numba as dn  # noqa: E402
from dflash2_numba.default import default_pair  # noqa: E402


def pair_dirs(name: str) -> tuple[str, str]:
    if name == "readme":
        return tuple(map(str, default_pair(notice=False)))
    if not os.path.isdir("/tmp/x8/target"):
        subprocess.run([sys.executable, str(ROOT / "bench" / "scaled_pair.py"), "8", "--out", "/tmp/x8"], check=True,
                       stdout=subprocess.DEVNULL)
    return "/tmp/x8/target", "/tmp/x8/dflash2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("readme", "x8"), default="readme")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--long-prompt", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    t, d = pair_dirs(args.pair)
    prompt = ("".join(f"def f{i}(x):\n    return x * {i} + {i * 7 % 11}\n\n" for i in range(24))
              if args.long_prompt else "def fibonacci(n):")
    out = {}
    for device in os.environ.get("DEVS", "cpu,cuda").split(","):
        target = dn.load_target(t, device=device, dtype=args.dtype)
        draft = dn.load_draft(d, target)
        ids = target.tokenizer.encode(prompt)
        for label, dr in (("target-only", None), ("speculative Q=8", draft)):
            if not args.long_prompt:
                dn.generate(target, dr, prompt_ids=ids, max_new_tokens=8, block_size=8)  # warm-up (JIT)
            t0 = time.perf_counter()
            r = dn.generate(target, dr, prompt_ids=ids, max_new_tokens=args.new_tokens, block_size=8)
            s = time.perf_counter() - t0
            out[(device, label)] = r.output_ids
            print(f"{args.pair} {args.dtype} {len(ids)}-token prompt {device:4s} {label:16s} {len(r.output_ids)} "
                  f"tokens ({r.finish_reason}) {len(r.output_ids) / s:7.1f} tok/s, {s:6.1f} s")
    for dev in sorted({k[0] for k in out}):
        print(dev, "speculative == target-only:", out[(dev, "target-only")] == out[(dev, "speculative Q=8")])
    if len({k[0] for k in out}) == 2:
        a, b = out[("cpu", "target-only")], out[("cuda", "target-only")]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"cpu vs cuda target-only: first {same} of {len(a)} tokens identical")
    return 0 if all(out[(dev, "target-only")] == out[(dev, "speculative Q=8")] for dev, _ in out) else 1


if __name__ == "__main__":
    sys.exit(main())
