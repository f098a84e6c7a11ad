"""Acceptance of the embedded default pair on held-out prompts: target-only vs DFlash2 vs DFlash,
greedy, every configuration in ONE run on one loaded target.

    python bench/acceptance.py [--target DIR] [--dflash2 DIR] [--dflash DIR] [--prompts PATH]
        [--n-prompts 32] [--max-new-tokens 128] [--block-sizes 4,8] [--threads 1]
        [--quantize bf16|q8_0|q4_0|q4_k] [--out bench/results/acceptance.json]

--quantize loads the pair in that weight format (both drafts follow the target's); the default
--out then gets the format's suffix (acceptance_q8_0.json) and the settings name the
instruction-set path of the integer kernels.

Defaults: the pair shipped in dflash2_numba/assets/default/{target,dflash2,dflash} and the
held-out prompts in bench/data/heldout_prompts.json (a list of strings, or of objects with
"text" and optionally "file"). A draft directory without config.json is skipped with a notice.

For every prompt the configurations run back to back (target-only, DFlash2 at each Q, DFlash at
each Q), so load on the shared machine hits them alike. Every speculative output must equal the
target-only ids (greedy is exact); the script exits 1 when any differs.

Figures (definitions of decode/stats.py, pooled over all prompts):
- tau: total acceptance length / total verify steps (bonus token included);
- histogram[i]: steps whose acceptance length is i+1, for 1..Q;
- per position j: of the steps that offered draft slot j, the fraction that accepted it;
- tok/s: generated tokens after the first / decode seconds (the prefill, which differs only in
  the taps it keeps, is excluded); speedup = tok/s over target-only tok/s of this run;
- draft%: the drafter's share of decode seconds (context extension + proposals).

numba runs single-threaded by default: the bench machine has 2 shared cores, and a parallel
kernel that loses a core to another process waits on it at every barrier.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from dflash2_numba import generate, load_draft, load_target  # noqa: E402

ASSETS = ROOT / "dflash2_numba" / "assets" / "default"
DEFAULT_PROMPTS = ROOT / "bench" / "data" / "heldout_prompts.json"
DEFAULT_OUT = ROOT / "bench" / "results" / "acceptance.json"


def shown(path) -> str:
    """A path as recorded in the results: relative to the checkout when inside it, so the
    committed JSON names no machine's directories."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------- inputs
def read_prompts(path: Path, n: int) -> list[dict]:
    """The first n prompts as {"text", "file"} (file None for plain strings)."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(raw, dict) and "prompts" in raw:
        raw = raw["prompts"]
    if not isinstance(raw, list) or not raw:
        raise SystemExit(f"{path}: expected a non-empty JSON list of prompts, got {type(raw).__name__}")
    prompts = []
    for i, p in enumerate(raw[:n]):
        if isinstance(p, str):
            prompts.append({"text": p, "file": None})
        elif isinstance(p, dict) and isinstance(p.get("text"), str):
            prompts.append({"text": p["text"], "file": p.get("file")})
        else:
            raise SystemExit(f"{path}: prompt {i} is neither a string nor an object with a 'text' string")
    if len(prompts) < n:
        print(f"notice: {path} holds {len(prompts)} prompts, fewer than --n-prompts {n}", file=sys.stderr)
    return prompts


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo) and its widest vector extension: results move with it."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    simd = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no avx")
    return f"{name} ({simd})"


def machine_info(threads: int) -> dict:
    import numba
    import numpy

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(),
            "python": platform.python_version(), "numpy": numpy.__version__,
            "numba": numba.__version__, "cpu_count": os.cpu_count(), "numba_threads": threads,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit}


# ---------------------------------------------------------------- aggregation
class Agg:
    """Pooled statistics of one configuration over all prompts."""

    def __init__(self, name: str, kind: str, Q: int):
        self.name, self.kind, self.Q = name, kind, Q
        self.lengths: list[int] = []  # acceptance length per step, all prompts
        self.rows: list[int] = []  # rows verified per step (Bv)
        self.new_tokens = self.decode_tokens = 0
        self.decode_s = self.prefill_s = self.draft_s = self.verify_s = 0.0
        self.per_prompt: list[dict] = []
        self.mismatches = 0

    def add(self, i: int, result, matched: bool) -> None:
        s = result.stats
        self.lengths += s.acceptance_lengths
        self.rows += s.block_rows
        self.new_tokens += s.new_tokens
        self.decode_tokens += s.new_tokens - 1  # the first token comes from the prefill
        self.decode_s += s.decode_s
        self.prefill_s += s.prefill_s
        self.draft_s += s.draft_s  # drafter share of decode_s (context extension + proposals)
        self.verify_s += s.verify_s  # target verify forwards + acceptance
        self.mismatches += not matched
        self.per_prompt.append({"prompt": i, "tau": s.tau, "matched": matched, "steps": s.steps,
                                "new_tokens": s.new_tokens, "decode_s": s.decode_s,
                                "finish_reason": result.finish_reason, "loadavg_1min": os.getloadavg()[0]})

    @property
    def tau(self) -> float:
        return sum(self.lengths) / len(self.lengths) if self.lengths else 0.0

    @property
    def histogram(self) -> list[int]:
        hist = [0] * self.Q
        for a in self.lengths:
            hist[a - 1] += 1
        return hist

    @property
    def per_position(self) -> list[float | None]:
        rates = []
        for j in range(self.Q - 1):  # draft slot j exists in a block of more than j+1 rows
            offered = [a for a, r in zip(self.lengths, self.rows) if r > j + 1]
            rates.append(sum(a > j + 1 for a in offered) / len(offered) if offered else None)
        return rates

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self, base_tps: float) -> dict:
        return {"name": self.name, "kind": self.kind, "block_size": self.Q, "tau": self.tau,
                "acceptance_histogram": self.histogram, "per_position_acceptance": self.per_position,
                "steps": len(self.lengths), "new_tokens": self.new_tokens,
                "decode_tokens": self.decode_tokens, "decode_s": self.decode_s,
                "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "tokens_per_s": self.tokens_per_s,
                "speedup": self.tokens_per_s / base_tps if base_tps > 0 else None,
                "mismatches": self.mismatches, "per_prompt": self.per_prompt}


# ---------------------------------------------------------------- the run
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=ASSETS / "target")
    ap.add_argument("--dflash2", type=Path, default=ASSETS / "dflash2")
    ap.add_argument("--dflash", type=Path, default=ASSETS / "dflash")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", default="4,8", help="comma-separated runtime Q values")
    ap.add_argument("--threads", type=int, default=1, help="numba threads (default 1)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--quantize", default="bf16", choices=["bf16", "q8_0", "q4_0", "q4_k"])
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def load_configs(args, target) -> list[tuple[str, str, int, object]]:
    """[(name, kind, Q, draft or None)], target-only first."""
    qs = [int(q) for q in args.block_sizes.split(",") if q.strip()]
    configs = [("target-only", "target", 1, None)]
    for kind, path in (("dflash2", args.dflash2), ("dflash", args.dflash)):
        if not (path / "config.json").is_file():
            print(f"notice: no {kind} draft at {path}; skipped", file=sys.stderr)
            continue
        draft = load_draft(path, target, quantize="same")  # the target's format, not `auto`'s choice
        for Q in qs:
            if not 2 <= Q <= draft.block_size:
                raise SystemExit(f"--block-sizes: Q={Q} outside 2..{draft.block_size} for {path}")
            configs.append((f"{kind} Q={Q}", kind, Q, draft))
    return configs


def run(args) -> dict:
    import numba

    from dflash2_numba.kernels import isa

    numba.set_num_threads(args.threads)
    threads = numba.get_num_threads()
    prompts = read_prompts(args.prompts, args.n_prompts)
    target = load_target(args.target, device=args.device, dtype=args.dtype, quantize=args.quantize)
    configs = load_configs(args, target)
    prompt_ids = [target.tokenizer.encode_prompt(p["text"], chat=False) for p in prompts]
    print(f"target {args.target} | {len(prompts)} prompts from {args.prompts} | "
          f"{args.max_new_tokens} new tokens | greedy | numba threads {threads} | device {args.device}",
          file=sys.stderr)

    def decode(draft, Q, ids, n):
        kw = {} if draft is None else {"block_size": Q}
        return generate(target, draft, prompt_ids=ids, max_new_tokens=n, temperature=0.0, **kw)

    t0 = time.perf_counter()
    for _, _, Q, draft in configs:  # warm-up: numba compiles (or loads) every kernel it uses
        decode(draft, Q, prompt_ids[0], min(args.max_new_tokens, 3 * Q + 1))
    print(f"warm-up {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    aggs = [Agg(name, kind, Q) for name, kind, Q, _ in configs]
    load_before = os.getloadavg()
    for i, ids in enumerate(prompt_ids):
        ref = None
        for agg, (_, _, Q, draft) in zip(aggs, configs):
            r = decode(draft, Q, ids, args.max_new_tokens)
            if ref is None:
                ref = r.output_ids  # target-only runs first
            agg.add(i, r, r.output_ids == ref)
        print(f"  prompt {i + 1}/{len(prompt_ids)}: " + "  ".join(
            f"{a.name} tau {a.per_prompt[-1]['tau']:.2f}" for a in aggs[1:]), file=sys.stderr)

    base = aggs[0].tokens_per_s
    result = {"machine": machine_info(threads),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "settings": {"target": shown(args.target), "dflash2": shown(args.dflash2),
                           "dflash": shown(args.dflash), "prompts": shown(args.prompts),
                           "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                           "block_sizes": args.block_sizes, "greedy": True,
                           "device": args.device, "dtype": args.dtype, "quantize": args.quantize,
                           "isa": isa.describe()},
              "prompts": [{"file": p["file"], "prompt_tokens": len(ids)}
                          for p, ids in zip(prompts, prompt_ids)],
              "configs": [a.to_dict(base) for a in aggs]}
    by = {(a.kind, a.Q): a for a in aggs}
    result["dflash2_minus_dflash_tau"] = {
        str(Q): by[("dflash2", Q)].tau - by[("dflash", Q)].tau
        for (kind, Q) in by if kind == "dflash2" and ("dflash", Q) in by}
    result["mismatches"] = sum(a.mismatches for a in aggs)
    return result


def format_table(result: dict) -> str:
    lines = [f"{'config':<14} {'tau':>6} {'tok/s':>8} {'speedup':>7} {'draft%':>6} {'match':>7}  "
             "histogram 1..Q | per-position acceptance"]
    n = result["settings"]["n_prompts"]
    for c in result["configs"]:
        pos = " ".join("-" if r is None else f"{r:.2f}" for r in c["per_position_acceptance"])
        hist = " ".join(map(str, c["acceptance_histogram"]))
        lines.append(f"{c['name']:<14} {c['tau']:6.3f} {c['tokens_per_s']:8.1f} "
                     f"{c['speedup']:6.2f}x {100 * c['draft_s'] / c['decode_s']:5.0f}% {n - c['mismatches']:>3}/{n:<3}  "
                     + (f"{hist} | {pos}" if c["block_size"] > 1 else "-"))
    for Q, d in result["dflash2_minus_dflash_tau"].items():
        lines.append(f"tau(DFlash2) - tau(DFlash) at Q={Q}: {d:+.3f}")
    m = result["machine"]
    lines.append(f"{m.get('cpu_model', '?')}, {m['cpu_count']} cpus, numba threads {m['numba_threads']}, {m['platform']}, {m['date']}")
    if "load_average" in result:
        la = result["load_average"]
        lines.append(f"load average (1 min) {la['before'][0]:.2f} -> {la['after'][0]:.2f}; isa "
                     f"{result['settings'].get('isa', {}).get('isa')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_OUT if args.quantize == "bf16" else DEFAULT_OUT.with_name(f"acceptance_{args.quantize}.json")
    result = run(args)
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    if result["mismatches"]:
        print(f"FAIL: {result['mismatches']} speculative outputs differ from target-only", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
