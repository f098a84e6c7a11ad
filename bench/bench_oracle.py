"""What a perfect draft buys: the speculative loop with the OracleDrafter on a ~100M-param random
Qwen3 target, Q in {2, 4, 8, 16}, against autoregressive decoding, measured in one run.

    python bench/bench_oracle.py [--new-tokens 64] [--context 128] [--repeat 5] [--device cpu]
                                 [--target DIR] [--threads N] [--quantize bf16|q8_0|q4_0]
                                 [--verify-only] [--contexts 100,2048,8192,32768]
                                 [--out bench/results/verify_cost.json]

--quantize loads the target in that weight format (quant/); the instruction-set path the kernels
compiled for (kernels/isa.py; DFLASH2_ISA=avx2 / generic forces a lower one) is printed and,
with --out, written to the JSON beside the verify-cost table. --verify-only skips table 2.

--target measures another target (e.g. the embedded default, dflash2_numba/assets/default/target)
instead of the random ~100M one: the ceiling any draft can reach on that target and machine.

Two tables:
1. verify cost: one target forward of Q rows (then crop) at a context of --context tokens,
   relative to a 1-row forward (best of --repeat). This is the ceiling on the speedup:
   with every draft accepted, a step emits Q tokens for cost(Q). --contexts measures it at
   several contexts in one run: the cache is filled once, growing from context to context, and
   at each one the row counts are interleaved (1, 2, 4, 8, 16, 1, 2, ...) so that load on a
   shared machine hits them alike; the load average is recorded per context.
2. decode: autoregressive tokens/s vs speculative tokens/s with the oracle. The oracle runs the
   target itself to draft (Q-1 single-row forwards per step), so its time is EXCLUDED: the
   speculative rate is (new_tokens - 1) / (decode_s - draft_s), i.e. verify forwards + the
   loop's own bookkeeping (sampling, crop, stop scan, detokenisation). The autoregressive rate
   is (new_tokens - 1) / decode_s through the same loop (draft=None). The prefill is excluded
   from both. Greedy outputs are checked equal.

Absolute numbers hold only on this machine; the ratios are the portable figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from dflash2_numba import OracleDrafter, generate, load_target, tiny  # noqa: E402
from dflash2_numba.default import cache_root  # noqa: E402

QS = (2, 4, 8, 16)
# ~100M parameters: 12 layers x 6.3M + untied embedding and lm_head of 16384 x 768 (12.6M each);
# ids above the tiny tokenizer's ~1000 are padding (masked, never emitted), as in Qwen3.
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=16384)
NAME = "bench-qwen3-100m-v1"


def build_target() -> Path:
    """Reuse bench/bench_target.py's cached model when that helper exists, else write one."""
    try:
        import bench_target  # noqa: F401  (written by another benchmark, if present)

        for fn in ("build_target", "ensure_target", "target_dir"):
            if hasattr(bench_target, fn):
                return Path(getattr(bench_target, fn)())
    except ImportError:
        pass
    path = cache_root() / NAME
    if not (path / "config.json").is_file():
        print(f"writing a random ~100M-param Qwen3 target to {path} ...", file=sys.stderr)
        tiny.write_target(path, seed=0, dtype="bf16", init_std=0.05, **SHAPE)
    return path


def n_params(target) -> int:
    c = target.config
    per_layer = (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * per_layer + (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size


def verify_costs(target, prompt, contexts, repeat) -> dict:
    """{context: {rows: best seconds}} for rows in (1,) + QS, interleaved per round, the cache
    grown from one context to the next (prefill chunks of 512)."""
    import os

    cache = target.new_cache(max(contexts) + max(QS) + 1)
    done, out = 0, {}
    for C in sorted(contexts):
        while done < C:
            n = min(512, C - done)
            target.forward(np.asarray(prompt[done:done + n], np.int64), cache, last_only=True)
            done += n
        block = np.asarray(prompt[:max(QS)], np.int64)
        best = {r: float("inf") for r in (1,) + QS}
        load = os.getloadavg()[0]
        for _ in range(repeat + 1):  # +1: the first call of a shape may compile
            for r in best:
                t0 = time.perf_counter()
                target.forward(block[:r], cache)
                best[r] = min(best[r], time.perf_counter() - t0)
                cache.commit(C)
        out[C] = dict(best, load=(load, os.getloadavg()[0]))
    return out


def forward_time(target, context_ids, rows, repeat) -> float:
    """Best time of one `rows`-row forward after a prefill of context_ids (cache cropped back)."""
    cache = target.new_cache(len(context_ids) + max(QS) + 1)
    target.forward(context_ids, cache, last_only=True)
    block = np.asarray(context_ids[:rows], np.int64)  # [rows]
    best = float("inf")
    for _ in range(repeat + 1):  # +1: the first call of a shape may compile
        t0 = time.perf_counter()
        target.forward(block, cache)
        best = min(best, time.perf_counter() - t0)
        cache.commit(len(context_ids))
    return best


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor()


def record(path: Path, row: dict) -> None:
    """Append one run to a JSON list (bench/results/*.json)."""
    import json

    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=128, help="prompt length (random ids)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "numpy", "cuda"])
    ap.add_argument("--target", type=Path, default=None, help="target directory (default: the "
                    "random ~100M Qwen3, written once)")
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: numba's own)")
    ap.add_argument("--quantize", default="bf16", choices=["bf16", "q8_0", "q4_0"])
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "bf16"], help="the KV cache's element type")
    ap.add_argument("--verify-only", action="store_true", help="only the verify-cost table")
    ap.add_argument("--out", type=Path, default=None, help="append the verify-cost row to this JSON list")
    ap.add_argument("--contexts", default=None, help="comma-separated contexts: the verify-cost table at each "
                    "(one growing cache, rows interleaved), then exit")
    args = ap.parse_args(argv)
    if args.threads is not None:
        from dflash2_numba.kernels.backend import set_threads

        set_threads(args.threads)

    path = args.target if args.target is not None else build_target()
    if args.device == "numpy":  # the plain-numpy reference path (ops switch), for comparison
        from dflash2_numba.families.qwen3 import TargetModel
        from dflash2_numba.tokenizer import Tokenizer
        target = TargetModel.load(path, device="numpy")
        target.tokenizer = Tokenizer.from_dir(path)
        target.valid_vocab = min(target.tokenizer.vocab_size, target.config.vocab_size)
    else:
        target = load_target(path, device=args.device, quantize=args.quantize, kv_dtype=args.kv_dtype)
    prompt = np.random.default_rng(0).integers(0, target.valid_vocab, args.context).tolist()
    import numba

    from dflash2_numba.kernels import isa

    print(f"target {path}: {n_params(target) / 1e6:.0f}M params, device {args.device}, "
          f"context {args.context}, {args.new_tokens} new tokens, numba threads {numba.get_num_threads()}, "
          f"weights {args.quantize}, isa {isa.describe()}")

    # ---- warm-up: compile every kernel shape the runs below use
    generate(target, None, prompt_ids=prompt[:8], max_new_tokens=3)
    for Q in QS:
        generate(target, OracleDrafter(target, block_size=Q), prompt_ids=prompt[:8], max_new_tokens=Q + 2, block_size=Q)

    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
        prompt = np.random.default_rng(0).integers(0, target.valid_vocab, max(contexts)).tolist()
        print(f"\nverify cost x one row (best of {args.repeat}, rows interleaved)")
        print(f"  {'context':>8}  {'1-row ms':>9}  " + "  ".join(f"{q:>6}" for q in QS) + "  load")
        for C, best in verify_costs(target, prompt, contexts, args.repeat).items():
            cost = {q: best[q] / best[1] for q in QS}
            print(f"  {C:>8}  {best[1] * 1e3:9.2f}  " + "  ".join(f"{cost[q]:6.2f}" for q in QS)
                  + f"  {best['load'][0]:.1f}-{best['load'][1]:.1f}", flush=True)
            if args.out is not None:
                record(args.out, {"quantize": args.quantize, "kv_dtype": args.kv_dtype, "isa": isa.describe(),
                                  "cpu": cpu_model(),
                                  "threads": numba.get_num_threads(), "context": C, "one_row_ms": best[1] * 1e3,
                                  "cost_x_one_row": {str(q): c for q, c in cost.items()},
                                  "loadavg_1min": best["load"], "rows_interleaved": True})
        return

    # ---- 1. verify cost of a Q-row block vs a 1-row step
    t1 = forward_time(target, prompt, 1, args.repeat)
    print(f"\nverify cost at context {args.context} (best of {args.repeat})")
    print(f"  {'rows':>4}  {'ms':>8}  {'x 1-row':>8}  {'ceiling Q/cost':>14}")
    print(f"  {1:>4}  {t1 * 1e3:8.2f}  {1.0:8.2f}  {1.0:14.2f}")
    cost = {}
    for Q in QS:
        tq = forward_time(target, prompt, Q, args.repeat)
        cost[Q] = tq / t1
        print(f"  {Q:>4}  {tq * 1e3:8.2f}  {cost[Q]:8.2f}  {Q / cost[Q]:14.2f}")
    if args.out is not None:
        record(args.out, {"quantize": args.quantize, "kv_dtype": args.kv_dtype, "isa": isa.describe(),
                          "cpu": cpu_model(), "threads": numba.get_num_threads(), "context": args.context,
                          "one_row_ms": t1 * 1e3,
                          "cost_x_one_row": {str(q): c for q, c in cost.items()}})
    if args.verify_only:
        return

    # ---- 2. decode throughput, oracle time excluded
    ar = generate(target, None, prompt_ids=prompt, max_new_tokens=args.new_tokens)
    ar_tps = (args.new_tokens - 1) / ar.stats.decode_s
    print(f"\ndecode ({args.new_tokens} tokens, prefill excluded; oracle drafting time excluded)")
    print(f"  {'mode':>10}  {'tau':>6}  {'tok/s':>8}  {'speedup':>7}  {'verify ms/step':>14}  same output")
    print(f"  {'AR':>10}  {1.0:6.2f}  {ar_tps:8.1f}  {1.0:7.2f}  "
          f"{ar.stats.verify_s / ar.stats.steps * 1e3:14.2f}  -")
    for Q in QS:
        r = generate(target, OracleDrafter(target, block_size=Q), prompt_ids=prompt,
                     max_new_tokens=args.new_tokens, block_size=Q)
        s = r.stats
        tps = (args.new_tokens - 1) / (s.decode_s - s.draft_s)
        print(f"  {'oracle Q=' + str(Q):>10}  {s.tau:6.2f}  {tps:8.1f}  {tps / ar_tps:7.2f}  "
              f"{s.verify_s / s.steps * 1e3:14.2f}  {r.output_ids == ar.output_ids}")


if __name__ == "__main__":
    main()
