"""`--block-size auto` against target-only and fixed widths, side by side in ONE run
(docs/adaptive_width.md).

    python bench/adaptive_width.py [--target DIR --draft DIR] [--fixed 2,3,4,6,8] [--rounds 3]
        [--n-prompts 8] [--max-new-tokens 128] [--threads 1] [--readme-runs 0] [--out PATH]

In-process part: one loaded pair; for every round and prompt the configurations run back to
back in a rotating order (target-only, auto, each fixed Q), so load on the shared machine hits
them alike. Every output must equal target-only's (greedy); the script exits 1 otherwise.
tok/s = tokens after the first / decode seconds, pooled over prompts and rounds; the ratio is
over target-only's of the same run. Each round's ratios and the load average before it are
recorded too.

--readme-runs N (embedded pair): the README's own command, `dflash2-decode generate --prompt
"def fibonacci(n):" --baseline` (as `python -m dflash2_numba.cli`), N times with `--block-size
auto` alternating with `--block-size 8`; each run's `speedup` (its own target-only run, same
process) is recorded, with the load average before it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from acceptance import DEFAULT_PROMPTS, machine_info, read_prompts, shown  # noqa: E402

from dflash2_numba import generate, load_draft, load_target  # noqa: E402

ASSETS = ROOT / "dflash2_numba" / "assets" / "default"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def readme_runs(n: int) -> dict:
    out = {"command": 'dflash2-decode generate --prompt "def fibonacci(n):" --baseline --block-size {auto|8}',
           "auto": [], "fixed_8": [], "loadavg": []}
    for i in range(n):
        for name, bs in (("auto", "auto"), ("fixed_8", "8")) if i % 2 == 0 else (("fixed_8", "8"), ("auto", "auto")):
            out["loadavg"].append(loadavg())
            r = subprocess.run([sys.executable, "-m", "dflash2_numba.cli", "generate", "--prompt", "def fibonacci(n):",
                                "--baseline", "--block-size", bs, "--json", "-"], cwd=ROOT, capture_output=True,
                               text=True, timeout=600)
            if r.returncode != 0:
                raise SystemExit(r.stderr)
            obj = json.loads(r.stdout)
            st = obj["stats"]
            out[name].append({"speedup": st["speedup"], "tokens_per_s": st["tokens_per_s"],
                              "baseline_tokens_per_s": st["baseline_tokens_per_s"],
                              "width_histogram": st["width_histogram"], "drafted_steps": st["drafted_steps"],
                              "steps": st["steps"], "warning": "differs" in r.stderr})
    for name in ("auto", "fixed_8"):
        s = sorted(x["speedup"] for x in out[name])
        out[name + "_median_speedup"] = s[len(s) // 2] if s else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(ASSETS / "target"))
    ap.add_argument("--draft", default=str(ASSETS / "dflash2"))
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--fixed", default="2,3,4,6,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantize", default="bf16")
    ap.add_argument("--draft-quantize", default="auto", help="the draft's format (CLI --draft-quantize): auto | same | bf16 | q8_0 | ...")
    ap.add_argument("--readme-runs", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "adaptive_width.json")
    args = ap.parse_args(argv)

    import numba

    from dflash2_numba.decode.warmup import warm_up
    from dflash2_numba.decode.width import cost_cache_dir, costs_for
    from dflash2_numba.kernels import isa

    numba.set_num_threads(args.threads)
    target = load_target(args.target, quantize=args.quantize)
    draft = load_draft(args.draft, target, quantize=args.draft_quantize)
    B = int(draft.block_size)
    fixed = [int(q) for q in args.fixed.split(",") if q and int(q) <= B]
    prompts = read_prompts(args.prompts, args.n_prompts)
    ids = [target.tokenizer.encode_prompt(p["text"], chat=False) for p in prompts]
    n_new = args.max_new_tokens

    t0 = time.perf_counter()
    for Q in fixed:
        warm_up(target, draft, block_size=Q, prompt_ids=ids[0], max_new_tokens=n_new)
    warm_up(target, draft, baseline=True, block_size="auto", prompt_ids=ids[0], max_new_tokens=n_new)
    warm_s = time.perf_counter() - t0
    costs = costs_for(target, draft, B)
    sweep = {"source": costs.source, "sweep_s": costs.sweep_s, "verify_ms": [1e3 * x for x in costs.sweep_verify_s],
             "draft_ms": 1e3 * costs.sweep_draft_s, "cache_dir": "beside the kernel cache" if
             str(cost_cache_dir()).startswith(str(ROOT)) else shown(cost_cache_dir())}
    print(f"costs ({costs.source}, sweep {costs.sweep_s:.3f}s): verify ms by rows "
          + " ".join(f"{x:.3f}" for x in sweep["verify_ms"]) + f", draft {sweep['draft_ms']:.3f} ms", flush=True)

    configs = [("target-only", None, None), ("auto", draft, "auto")] + [(f"Q={Q}", draft, Q) for Q in fixed]
    agg = {name: {"decode_s": 0.0, "tokens": 0, "rows": [], "lengths": [], "drafted": 0, "steps": 0}
           for name, _, _ in configs}
    rounds, mismatches = [], 0
    for rnd in range(args.rounds):
        la = loadavg()
        per = {name: [0.0, 0] for name, _, _ in configs}
        for i, pid in enumerate(ids):
            order = configs[(i + rnd) % len(configs):] + configs[:(i + rnd) % len(configs)]
            outs = {}
            for name, d, bs in order:
                r = generate(target, d, prompt_ids=pid, max_new_tokens=n_new, block_size=bs)
                s = r.stats
                outs[name] = r.output_ids
                a = agg[name]
                a["decode_s"] += s.decode_s
                a["tokens"] += s.new_tokens - 1
                a["rows"] += s.block_rows
                a["lengths"] += s.acceptance_lengths
                a["drafted"] += s.drafted_steps
                a["steps"] += s.steps
                per[name][0] += s.decode_s
                per[name][1] += s.new_tokens - 1
            for name in outs:
                if outs[name] != outs["target-only"]:
                    mismatches += 1
                    print(f"MISMATCH {name} prompt {i}", file=sys.stderr)
        base = per["target-only"][1] / per["target-only"][0]
        rounds.append({"loadavg_before": la,
                       "ratio": {n: round(v[1] / v[0] / base, 4) for n, v in per.items()}})
        print(f"round {rnd + 1} load {la}: " + "  ".join(f"{n} {v:.3f}x" for n, v in rounds[-1]["ratio"].items()),
              flush=True)

    base_tps = agg["target-only"]["tokens"] / agg["target-only"]["decode_s"]
    results = {}
    for name, a in agg.items():
        tps = a["tokens"] / a["decode_s"]
        hist = [a["rows"].count(r) for r in range(1, B + 1)]
        results[name] = {"tokens_per_s": round(tps, 1), "vs_target_only": round(tps / base_tps, 4),
                         "tau": round(sum(a["lengths"]) / max(1, a["steps"]), 3),
                         "steps": a["steps"], "drafted_steps": a["drafted"], "width_histogram": hist}
    best_fixed = max((n for n in results if n.startswith("Q=")), key=lambda n: results[n]["tokens_per_s"], default=None)
    summary = {"auto_vs_target_only": results["auto"]["vs_target_only"],
               "best_fixed": best_fixed,
               "best_fixed_vs_target_only": results[best_fixed]["vs_target_only"] if best_fixed else None,
               "auto_vs_best_fixed": round(results["auto"]["tokens_per_s"] / results[best_fixed]["tokens_per_s"], 4)
               if best_fixed else None,
               "outputs_identical": mismatches == 0}
    print("pooled: " + "  ".join(f"{n} {r['tokens_per_s']:.1f} tok/s {r['vs_target_only']:.3f}x"
                                 for n, r in results.items()))
    print("summary:", json.dumps(summary))
    out = {"settings": {"target": shown(args.target), "draft": shown(args.draft), "prompts": shown(args.prompts),
                        "n_prompts": len(ids), "max_new_tokens": n_new, "rounds": args.rounds, "threads": args.threads,
                        "quantize": args.quantize, "draft_quantize": args.draft_quantize,
                        "draft_format": draft.weight_format, "draft_format_reason": draft.format_reason, "B": B, "isa": isa.describe()},
           "machine": machine_info(args.threads), "warm_up_s": round(warm_s, 2), "cost_table": sweep,
           "results": results, "rounds": rounds, "summary": summary, "loadavg_after": loadavg()}
    if args.readme_runs:
        out["readme_command"] = readme_runs(args.readme_runs)
        print("README command:", json.dumps({k: v for k, v in out["readme_command"].items() if "median" in k}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
