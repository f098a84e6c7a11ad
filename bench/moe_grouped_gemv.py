"""Expert products of one decode token, as many small calls vs one call over the same bytes
(scratch evidence for docs/moe_bench.md's kernel suggestion 1; q8_0 panels, 1 thread).

    python bench/moe_grouped_gemv.py

The --model moe shapes of bench_vs_llamacpp.py: 12 layers x 8 experts of gate_up [768 x 1024] and
down [1024 x 384], each a distinct weight (streamed from memory), timed as 96 calls per projection,
as 12 calls of the 8 experts stacked along the outputs, and (down) along K. Best of 5.
"""
import sys, time, os, numpy as np, numba, json
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
numba.set_num_threads(1)
from dflash2_numba.kernels.backend import get_ops
from dflash2_numba.numerics import f32_to_bf16_array
ops = get_ops("cpu", "q8_0", False)
rng = np.random.default_rng(0)
def mk(shape, n):
    return [ops.prepare_weight(f32_to_bf16_array(rng.standard_normal(shape, dtype=np.float32) * 0.05)) for _ in range(n)]
N = 96  # 8 experts x 12 layers, as one token's
cases = {
  "gate_up: 8 calls of [768 x 1024]": (mk((768, 1024), N), 8, 1024),
  "gate_up grouped: 1 call of [6144 x 1024]": (mk((6144, 1024), N // 8), 1, 1024),
  "down: 8 calls of [1024 x 384]": (mk((1024, 384), N), 8, 384),
  "down grouped (same K): 1 call of [8192 x 384]": (mk((8192, 384), N // 8), 1, 384),
  "down along K (k*I): 1 call of [1024 x 3072]": (mk((1024, 3072), N // 8), 1, 3072),
}
print("load", os.getloadavg()[0])
res = {k: [] for k in cases}
for rep in range(5):
    for k, (ws, per, K) in cases.items():
        x = rng.standard_normal((1, K), dtype=np.float32)
        ops.linear(x, ws[0])
        nbytes = sum(w.shape[0] * w.shape[1] for w in ws) * 34 / 32 if hasattr(ws[0], "shape") else None
        t0 = time.perf_counter()
        for w in ws:
            ops.linear(x, w)
        dt = time.perf_counter() - t0
        res[k].append(dt)
for k, (ws, per, K) in cases.items():
    dt = min(res[k])
    rows = {"gate_up": 768 * 8 * 12, "down": 1024 * 8 * 12}[k.split(":")[0].split(" ")[0]]
    nbytes = rows * (1024 if "gate_up" in k else 384) * 34 / 32
    print(f"{k:48s} {dt*1e3:7.2f} ms per token's worth (12 layers)  {nbytes/dt/1e9:6.2f} GB/s")
print("load", os.getloadavg()[0])
