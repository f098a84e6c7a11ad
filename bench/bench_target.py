"""Autoregressive decode speed of the target: numba bf16 path vs plain numpy f32 path.

    python bench/bench_target.py [--steps 32] [--prefill 16] [--rounds 3] [--threads N] [--cache-dir DIR]

Writes (once) a ~120M-parameter random Qwen3 in bf16 into the cache dir, then, in ONE run,
times 1-token decode steps against a KV cache after a short prefill for
  (a) device="cpu":   numba kernels, weights stay bf16 (uint16 memmap), converted on the fly
  (b) device="numpy": weights converted to f32 once at load, numpy matmul (BLAS)
and prints tokens/s and achieved GB/s of weight traffic (bytes of weights read per token /
seconds per token; (a) reads 2 bytes per parameter, (b) 4). Absolute numbers only hold on the
same machine; the ratio is measured side by side, alternating the paths for `--rounds` rounds
and keeping each path's best round (other processes on the machine add noise). The two paths'
greedy tokens are compared.

--threads sets numba's and OpenBLAS's thread counts alike (default: all cores). On a machine
whose cores are busy with other work, OpenMP spin-waiting makes multi-threaded kernels collapse
(measured here on 2 shared cores: 1.5 tokens/s with 2 threads vs 46 with 1); use --threads 1.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_args import decode_bench_args  # noqa: E402  (bench/decode_args.py; before numpy)

ARGS = decode_bench_args(__doc__) if __name__ == "__main__" else None

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2_numba.families.qwen3 import TargetModel  # noqa: E402
from dflash2_numba.tiny import write_target  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False)


def model_dir(cache_dir: Path) -> Path:
    d = cache_dir / "bench_target_qwen3_120m_bf16"
    done = d / ".complete"
    if not done.exists():
        print(f"writing the benchmark model to {d} (once) ...", file=sys.stderr)
        write_target(d, architecture="qwen3", dtype="bf16", seed=0, init_std=0.05, **SHAPE)
        done.write_text("ok\n")
    return d


def weight_params(target: TargetModel) -> int:
    """Parameters whose bytes are read per decoded token: every matrix of every layer and the
    head (the embedding contributes one row: negligible)."""
    n = target.lm_head_w.size
    for layer in target.layers:
        n += sum(layer[k].size for k in ("q", "k", "v", "o", "gate", "up", "down"))
    return n


def decode(target: TargetModel, prompt: np.ndarray, steps: int) -> tuple[list[int], float]:
    """Prefill, then `steps` single-token greedy steps; returns (tokens, seconds of the steps)."""
    cache = target.new_cache(len(prompt) + steps + 1)
    logits, _ = target.forward(prompt, cache, last_only=True)
    tokens = []
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(logits[-1]))
        tokens.append(tok)
        logits, _ = target.forward(np.array([tok]), cache)
    return tokens, time.perf_counter() - t0


def main(args) -> None:
    import numba

    d = model_dir(args.cache_dir)
    prompt = np.random.default_rng(0).integers(0, 1000, args.prefill)
    load_avg = os.getloadavg()[0]
    paths = {}
    for device in ("cpu", "numpy"):
        t_load = time.perf_counter()
        target = TargetModel.load(d, device=device)
        paths[device] = (target, time.perf_counter() - t_load)
        decode(target, prompt, 2)  # warm-up: numba compilation, page faults of the memmap
    best = {device: (None, float("inf")) for device in paths}
    for _ in range(args.rounds):  # alternate the paths; keep each one's best round
        for device, (target, _) in paths.items():
            tokens, secs = decode(target, prompt, args.steps)
            if secs < best[device][1]:
                best[device] = (tokens, secs)
    rows = []
    for device, bytes_per_param in (("cpu", 2), ("numpy", 4)):
        target, t_load = paths[device]
        tokens, secs = best[device]
        n = weight_params(target)
        rows.append((device, tokens, args.steps / secs, n * bytes_per_param / (secs / args.steps) / 1e9, n, t_load))

    print(f"model: Qwen3 {SHAPE}, bf16 checkpoint; prefill {args.prefill}, {args.steps} decode steps, "
          f"best of {args.rounds} alternating rounds; threads: numba {numba.get_num_threads()}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')}; "
          f"load average {load_avg:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'path':34s} {'tokens/s':>9s} {'ms/token':>9s} {'weight GB/s':>12s} {'params read':>12s} {'load s':>7s}")
    names = {"cpu": "numba (device=cpu, bf16 weights)", "numpy": "numpy (device=numpy, f32 weights)"}
    for device, _, tps, gbs, n, t_load in rows:
        print(f"{names[device]:34s} {tps:9.2f} {1e3 / tps:9.2f} {gbs:12.2f} {n / 1e6:11.1f}M {t_load:7.2f}")
    print(f"speed ratio numba / numpy: {rows[0][2] / rows[1][2]:.2f}x")
    same = rows[0][1] == rows[1][1]
    print(f"greedy tokens identical across the two paths: {same}"
          + ("" if same else f" (first difference at step {next(i for i, (a, b) in enumerate(zip(rows[0][1], rows[1][1])) if a != b)})"))


if __name__ == "__main__":
    main(ARGS)
