"""Stream a speculative generation with the public API (spec §9).

    python examples/stream.py                               # the embedded default pair
    python examples/stream.py --target T --draft D --prompt "def add(a, b):"

Text goes to stdout as it is committed; per-step acceptance and the final statistics to stderr.
"""

import argparse
import sys

import dflash2_numba as dn
from dflash2_numba.default import default_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=None, help="runtime Q (default: the draft's B)")
    args = ap.parse_args()

    target_dir, draft_dir = (args.target, args.draft) if args.target else default_pair()
    target = dn.load_target(target_dir)
    draft = dn.load_draft(draft_dir, target) if draft_dir else None

    accepted = []
    for step in dn.stream_generate(target, draft, args.prompt, max_new_tokens=args.max_new_tokens,
                                   block_size=args.block_size):
        print(step.text, end="", flush=True)  # UTF-8-safe text delta of this step
        accepted.append(step.accepted)  # drafts accepted in this step
        if step.finish_reason is not None:
            print(f"\n[finish: {step.finish_reason}] accepted per step: {accepted}", file=sys.stderr)
            print(step.stats.format(), file=sys.stderr)


if __name__ == "__main__":
    main()
