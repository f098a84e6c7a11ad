"""A ~100M random Qwen3.5 hybrid target (Gated DeltaNet + gated attention): autoregressive
speed, and the share of a speculative step spent restoring the recurrent state.

    python bench/bench_hybrid.py [--steps 32] [--prefill 16] [--Q 8] [--threads N] [--cache-dir DIR]

Writes (once) a random bf16 hybrid (tiny_hybrid.write_qwen3_5_target, 12 layers = 9 GDN + 3
attention) into the cache dir, then prints:
  1. autoregressive decode (device="cpu", bf16 weights): tokens/s and GB/s of weight traffic
     (matrix bytes read per token / seconds per token);
  2. verify blocks of Q rows with exactly `a` rows accepted, for several a: ms of the verify
     forward and of `cache.commit` (the rollback: conv window + replay of a+1 rows of the
     recurrence from the pre-block state), and commit's share of forward + commit;
  3. a real speculative decode (a random DFlash2 draft: almost every draft rejected, so nearly
     every step rolls back) with `commit` timed inside the loop: its share of decode time.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_args import decode_bench_args  # noqa: E402  (bench/decode_args.py; before numpy)

ARGS = decode_bench_args(__doc__, with_q=True) if __name__ == "__main__" else None

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dflash2_numba as dn  # noqa: E402
from dflash2_numba import tiny  # noqa: E402
from dflash2_numba.families.qwen3_5 import state_bytes  # noqa: E402
from dflash2_numba.tiny_hybrid import write_qwen3_5_target  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, full_attention_interval=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000)


def model_dirs(cache_dir: Path) -> tuple[Path, Path]:
    d, dd = cache_dir / "bench_hybrid_qwen3_5_100m_bf16", cache_dir / "bench_hybrid_qwen3_5_100m_dflash2"
    done = d / ".complete"
    if not done.exists():
        print(f"writing the benchmark model to {d} (once) ...", file=sys.stderr)
        write_qwen3_5_target(d, dtype="bf16", seed=0, init_std=0.05, **SHAPE)
        tiny.write_draft(dd, d, kind="dflash2", num_hidden_layers=1, block_size=16, target_layer_ids=[1, 5, 9],
                         seed=1, init_std=0.05)
        done.write_text("ok\n")
    return d, dd


def matrix_params(target) -> int:
    """Matrix parameters read per decoded token (every layer's projections and the head)."""
    n = target.lm_head_w.size
    for layer in target.layers:
        n += sum(v.size for k, v in layer.items() if k in ("q", "k", "v", "o", "qkv", "z", "a", "b", "out"))
        n += sum(v.size for v in layer["mlp"].values())
    return n


def autoregressive(target, prompt, steps):
    cache = target.new_cache(len(prompt) + steps + 1)
    logits, _ = target.forward(prompt, cache, last_only=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, _ = target.forward(np.array([int(np.argmax(logits[-1]))]), cache)
    return time.perf_counter() - t0


def verify_with_rollback(target, prompt, Q, a, reps):
    """Mean (forward s, commit s) of Q-row verify blocks that keep a + 1 rows."""
    rng = np.random.default_rng(a)
    cache = target.new_cache(len(prompt) + reps * Q + 1)
    target.forward(prompt, cache, last_only=True)
    t_fwd = t_commit = 0.0
    for _ in range(reps):
        start = cache.length
        t0 = time.perf_counter()
        target.forward(rng.integers(0, 1000, Q), cache)
        t1 = time.perf_counter()
        cache.commit(start + a + 1)
        t_fwd, t_commit = t_fwd + t1 - t0, t_commit + time.perf_counter() - t1
    return t_fwd / reps, t_commit / reps


def timed_commits(target):
    """Wrap target.new_cache so that every cache's commit time is summed in the returned list."""
    spent, new_cache = [0.0], target.new_cache

    def make(*args, **kw):
        cache = new_cache(*args, **kw)
        commit = cache.commit

        def timed(n):
            t0 = time.perf_counter()
            commit(n)
            spent[0] += time.perf_counter() - t0
        cache.commit = timed
        return cache
    target.new_cache = make
    return spent


def main(args) -> None:
    import numba

    d, dd = model_dirs(args.cache_dir)
    target = dn.load_target(d)
    c = target.config
    prompt = np.random.default_rng(0).integers(0, 1000, args.prefill)
    autoregressive(target, prompt, 2)  # warm-up: compilation, page faults
    secs = min(autoregressive(target, prompt, args.steps) for _ in range(args.rounds))
    n = matrix_params(target)
    sizes = state_bytes(c, args.Q)
    print(f"model: random Qwen3.5 hybrid {SHAPE}, bf16; layers {''.join('A' if t == 'full_attention' else 'G' for t in c.layer_types)}; "
          f"{n / 1e6:.1f}M matrix params; recurrent state {sizes['recurrent_state'] / 2**20:.2f} MiB + conv "
          f"{sizes['conv_state'] / 2**10:.1f} KiB per request; numba threads {numba.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"autoregressive: {args.steps / secs:.2f} tok/s, {1e3 * secs / args.steps:.2f} ms/token, "
          f"{n * 2 / (secs / args.steps) / 1e9:.2f} GB/s of bf16 weights")
    for a in sorted({0, args.Q // 2 - 1, args.Q - 2, args.Q - 1}):
        verify_with_rollback(target, prompt, args.Q, a, 1)  # warm-up
        fwd, com = verify_with_rollback(target, prompt, args.Q, a, 8)
        print(f"verify Q={args.Q}, accept {a} drafts (keep {a + 1} rows): forward {1e3 * fwd:.2f} ms, "
              f"commit {1e3 * com:.3f} ms = {100 * com / (fwd + com):.2f}% of forward + commit")
    spent = timed_commits(target)
    draft = dn.load_draft(dd, target)
    r = dn.generate(target, draft, prompt_ids=prompt.tolist(), max_new_tokens=64, block_size=args.Q)
    print(f"speculative decode (random DFlash2 draft, Q={args.Q}, tau {r.stats.tau:.2f}, {r.stats.steps} steps): "
          f"commit {1e3 * spent[0] / r.stats.steps:.3f} ms/step = {100 * spent[0] / r.stats.decode_s:.2f}% of "
          f"decode time ({1e3 * r.stats.decode_s / r.stats.steps:.1f} ms/step)")


if __name__ == "__main__":
    main(ARGS)
