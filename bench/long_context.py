"""Speculation at long context on the widened x8 pair (docs/long_context.md).

    python bench/scaled_pair.py 8 --out PAIR          # then raise max_position_embeddings in
                                                      # PAIR/*/config.json (a copy: the assets stay)
    python bench/long_context.py --pair PAIR [--contexts 256,8192] [--max-new-tokens 64]
        [--threads 2] [--window-context 2048] [--windows 0,256,1024] [--out PATH]

Prompt: held-out Python standard-library source (email/, json/, http/ ... concatenated, the
tokenizer's ids), cut to each context length. At each context the configurations run back to
back in ONE process, in a rotating order per round (target-only, fixed Q=4, block_size "auto"),
so load on a shared machine hits them alike; every greedy output must equal target-only's
(exit 1 otherwise). From `generate`'s own statistics:
  - verify step in target-only tokens: (Q=4 verify s / step) / (target-only verify s / step);
  - draft step: Q=4 draft s / drafted step (context extension + block forward + proposal), and
    the same without the step that fed the prompt's context to the draft (its one-time catch-up:
    statistics' draft_s_per_step);
  - decode tok/s of each configuration and auto / target-only;
  - the KV cache bytes at the run's context (statistics' kv_cache_bytes).
--windows: Q=4 runs at --window-context with those draft windows (0 = whole context): the
acceptance (tau) against the window, and the draft step's cost.
The load average is recorded before every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from acceptance import machine_info  # noqa: E402

from dflash2_numba import generate, load_draft, load_target  # noqa: E402

STDLIB_DIRS = ("email", "json", "http", "urllib", "xml/dom", "logging", "concurrent/futures", "asyncio")


def long_text(min_chars: int) -> str:
    """Standard-library sources, sorted, concatenated with a file header, up to min_chars."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for d in STDLIB_DIRS:
        for f in sorted((lib / d).glob("*.py")):
            text = f"# file: {f.relative_to(lib)}\n" + f.read_text(errors="replace")
            parts.append(text)
            n += len(text)
            if n >= min_chars:
                return "".join(parts)
    return "".join(parts)


def run(target, draft, ids, new, **kw) -> dict:
    load = os.getloadavg()[0]
    r = generate(target, draft, prompt_ids=ids, max_new_tokens=new, **kw)
    s = r.stats
    drafted = max(1, s.drafted_steps)
    return {"output_ids": r.output_ids, "tau": s.tau, "steps": s.steps, "drafted_steps": s.drafted_steps,
            "decode_tok_s": (len(r.output_ids) - 1) / s.decode_s, "verify_s_per_step": s.verify_s / max(1, s.steps),
            "draft_s_per_drafted_step": s.draft_s / drafted if s.drafted_steps else None,
            "draft_s_per_step": s.draft_s_per_step, "catch_up_steps": s.catch_up_steps,
            "catch_up_draft_s": s.catch_up_draft_s,
            "prefill_s": s.prefill_s, "kv_cache_bytes": s.kv_cache_bytes, "block_rows": s.block_rows,
            "loadavg_before": load}


CONFIGS = {"target_only": dict(draft=False), "q4": dict(block_size=4), "auto": dict(block_size="auto")}


def at_context(target, draft, ids, new, rounds, configs) -> dict:
    runs = {name: [] for name in configs}
    for r in range(rounds):
        order = list(configs)[r % len(configs):] + list(configs)[:r % len(configs)]
        for name in order:
            kw = dict(configs[name])
            d = None if kw.pop("draft", True) is False else draft
            runs[name].append(run(target, d, ids, new, **kw))
            print(f"  {len(ids):>6} {name:>12}: {runs[name][-1]['decode_tok_s']:.2f} tok/s, tau "
                  f"{runs[name][-1]['tau']:.2f}, load {runs[name][-1]['loadavg_before']:.1f}", flush=True)
    ref = runs["target_only"][0]["output_ids"] if "target_only" in runs else None
    same = all(x["output_ids"] == ref for rs in runs.values() for x in rs) if ref is not None else None
    best = {name: max(rs, key=lambda x: x["decode_tok_s"]) for name, rs in runs.items()}
    out = {"context": len(ids), "identical_outputs": same, "runs": runs}
    if "target_only" in best:
        t = best["target_only"]
        out["kv_cache_bytes"] = t["kv_cache_bytes"]
        out["target_only_ms_per_token"] = 1e3 / t["decode_tok_s"]
        for name in best:
            if name != "target_only":
                out[f"{name}_vs_target_only"] = best[name]["decode_tok_s"] / t["decode_tok_s"]
        if "q4" in best:
            out["q4_verify_in_target_tokens"] = best["q4"]["verify_s_per_step"] / t["verify_s_per_step"]
    if "q4" in best:
        out["q4_draft_ms_per_step"] = 1e3 * min(x["draft_s_per_drafted_step"] for x in runs["q4"])
        typical = [x["draft_s_per_step"] for x in runs["q4"] if x["draft_s_per_step"] is not None]
        out["q4_draft_ms_per_step_without_catch_up"] = 1e3 * min(typical) if typical else None
    for rs in runs.values():
        for x in rs:
            x.pop("output_ids")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="directory with target/ and dflash2/")
    ap.add_argument("--contexts", default="256,8192")
    ap.add_argument("--configs", default="target_only,q4,auto")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window-context", type=int, default=0, help="context of the draft-window runs (0: none)")
    ap.add_argument("--windows", default="0,256,1024")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from dflash2_numba.kernels.backend import set_threads

    set_threads(args.threads)
    target = load_target(args.pair / "target")
    draft = load_draft(args.pair / "dflash2", target)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    need = max(contexts + [args.window_context])
    ids = []
    chars = 4 * need
    while len(ids) < need:
        ids = target.tokenizer.encode(long_text(chars))
        chars *= 2
    from dflash2_numba.kernels import isa

    result = {"machine": machine_info(args.threads), "isa": isa.describe(), "pair": str(args.pair),
              "max_new_tokens": args.max_new_tokens, "contexts": []}
    generate(target, draft, prompt_ids=ids[:300], max_new_tokens=8, block_size=4)  # compile (a long prefill too)
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    for C in contexts:
        t0 = time.perf_counter()
        result["contexts"].append(at_context(target, draft, ids[:C], args.max_new_tokens, args.rounds, configs))
        c = result["contexts"][-1]
        print(f"context {C}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in c.items() if k != "runs") + f" ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    if args.window_context:
        wins = {}
        for w in (int(x) for x in args.windows.split(",")):
            x = run(target, draft, ids[:args.window_context], args.max_new_tokens, block_size=4, draft_window=w)
            x.pop("output_ids")
            wins[str(w)] = x
            print(f"draft window {w} at {args.window_context}: tau {x['tau']:.3f}, draft "
                  f"{1e3 * x['draft_s_per_drafted_step']:.1f} ms/step, "
                  f"{1e3 * (x['draft_s_per_step'] or float('nan')):.1f} without the catch-up", flush=True)
        result["draft_window"] = {"context": args.window_context, "block_size": 4, "runs": wins}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    same = [c["identical_outputs"] for c in result["contexts"]]
    return 0 if all(s is not False for s in same) else 1


if __name__ == "__main__":
    sys.exit(main())
