"""bf16 run mode on --device cuda over a prompt longer than one attention tile (256 keys):
speculative == target-only on each device, and how far cpu and cuda target-only agree (bf16
rounding order differs between the devices' kernels, docs/gpu.md). Run by bench/gpu_device_run.sh;
DEVS=cpu runs it without a GPU.

    python bench/gpu_bf16_decode.py
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import dflash2_numba as dn  # noqa: E402
from dflash2_numba.default import default_pair  # noqa: E402

t, d = map(str, default_pair(notice=False))
prompt = "".join(f"def f{i}(x):\n    return x * {i} + {i * 7 % 11}\n\n" for i in range(24))
out = {}
for device in os.environ.get("DEVS", "cpu,cuda").split(","):
    target = dn.load_target(t, device=device, dtype="bf16")
    draft = dn.load_draft(d, target)
    ids = target.tokenizer.encode(prompt)
    for label, dr in (("target-only", None), ("speculative Q=8", draft)):
        t0 = time.perf_counter()
        r = dn.generate(target, dr, prompt_ids=ids, max_new_tokens=48, block_size=8)
        out[(device, label)] = r.output_ids
        print(f"bf16 run mode, {len(ids)}-token prompt, {device:4s} {label:16s} {len(r.output_ids)} tokens "
              f"{time.perf_counter() - t0:6.1f} s, tokens a step {r.stats.new_tokens / max(r.stats.steps, 1):.2f}")
for dev in {k[0] for k in out}:
    print(dev, "speculative == target-only:", out[(dev, "target-only")] == out[(dev, "speculative Q=8")])
if len({k[0] for k in out}) == 2:
    a, b = out[("cpu", "target-only")], out[("cuda", "target-only")]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    print(f"cpu vs cuda target-only (bf16): first {same} of {len(a)} tokens identical")
