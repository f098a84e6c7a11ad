"""A/B of the `auto` width rule (decode/width.py + decode/costs.py) against another checkout's,
in ONE process, on the same loaded pair and the same starting cost table.

    python bench/width_rule_ab.py --other /path/to/other/checkout [--target DIR --draft DIR]
        [--prompts readme|heldout] [--n-prompts 8] [--rounds 12] [--max-new-tokens 128] [--threads 1]

The other checkout's package is copied under another name (`dflash2_ab_other`, as
bench/attention_ab.py does) and only its `decode.width` / `decode.costs` are used: its rule
object runs inside this tree's decode loop (the rule's interface is the same). Every run gets
a fresh rule on a fresh copy of the same table (this tree's cached or swept one, rebuilt in
the other tree's CostTable class), so the rules differ and nothing else. Configurations rotate
per round and prompt (target-only, this rule, the other rule); the table reports pooled decode
tok/s over target-only's after each round. Greedy outputs must equal target-only's.
`--prompts readme`: the README's prompt ("def fibonacci(n):", raw); `heldout`: the held-out
prompts of bench/adaptive_width.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from acceptance import DEFAULT_PROMPTS, read_prompts  # noqa: E402
from attention_ab import import_other  # noqa: E402  (copies a checkout's package as dflash2_ab_other)

from dflash2_numba import generate, load_draft, load_target  # noqa: E402

ASSETS = ROOT / "dflash2_numba" / "assets" / "default"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, type=Path)
    ap.add_argument("--target", default=str(ASSETS / "target"))
    ap.add_argument("--draft", default=str(ASSETS / "dflash2"))
    ap.add_argument("--prompts", choices=("readme", "heldout"), default="readme")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import numba

    from dflash2_numba.decode import width as this
    from dflash2_numba.decode.warmup import warm_up
    from dflash2_numba.kernels.isa import selected

    import_other(args.other.resolve())  # the kernels module it returns is not used here
    from dflash2_ab_other.decode import costs as other_costs, width as other

    numba.set_num_threads(args.threads)
    target = load_target(args.target)
    draft = load_draft(args.draft, target)
    B = int(draft.block_size)
    if args.prompts == "readme":
        prompts = [target.tokenizer.encode_prompt("def fibonacci(n):", chat=False)]
    else:
        prompts = [target.tokenizer.encode_prompt(p["text"], chat=False)
                   for p in read_prompts(DEFAULT_PROMPTS, args.n_prompts)]
    warm_up(target, draft, baseline=True, block_size="auto", prompt_ids=prompts[0], max_new_tokens=args.max_new_tokens)
    table = this.costs_for(target, draft, B)
    start = (table.sweep_verify_s.copy(), table.sweep_draft_s, table.feed_s)
    print(f"path {selected()}, {args.threads} thread(s); starting table: verify ms "
          + " ".join(f"{1e3 * x:.3f}" for x in start[0]) + f", draft {1e3 * start[1]:.3f} ms", flush=True)

    def rule(kind):
        if kind == "this":
            return this.AdaptiveWidth(this.CostTable(start[0].copy(), start[1], "injected", feed_s=start[2]), B)
        return other.AdaptiveWidth(other_costs.CostTable(start[0].copy(), start[1], "injected", feed_s=start[2]), B)

    configs = ["target-only", "this", "other"]
    seconds, tokens = dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0)
    for rnd in range(args.rounds):
        for i, ids in enumerate(prompts):
            r0 = (rnd + i) % len(configs)
            outs = {}
            for name in configs[r0:] + configs[:r0]:
                r = generate(target, None if name == "target-only" else draft, prompt_ids=ids,
                             max_new_tokens=args.max_new_tokens, block_size="auto",
                             width=None if name == "target-only" else rule(name))
                seconds[name] += r.stats.decode_s
                tokens[name] += r.stats.new_tokens - 1
                outs[name] = r.output_ids
            if any(o != outs["target-only"] for o in outs.values()):
                print(f"MISMATCH round {rnd} prompt {i}", file=sys.stderr)
                return 1
        base = tokens["target-only"] / seconds["target-only"]
        print(f"round {rnd + 1}: " + "  ".join(f"{n} {tokens[n] / seconds[n] / base:.3f}x" for n in configs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
