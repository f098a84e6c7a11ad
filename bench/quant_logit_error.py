"""Logit error of each --quantize format against the bf16 weights, on the embedded target.

    python bench/quant_logit_error.py [--target DIR] [--prompts PATH] [--n-prompts 32]
        [--continue-tokens 64] [--formats q8_0,q4_0,q4_k] [--out bench/results/quant_logit_error.json]

For each held-out prompt (bench/data/heldout_prompts.json, as bench/acceptance.py reads them) the
bf16 target (weights as stored, f32 compute) extends the prompt greedily by --continue-tokens;
then every format's target runs ONE teacher-forced forward over the same ids (prompt +
continuation) and its logits at every position are compared with the bf16 logits:

- KL(bf16 || fmt) in nats per position (softmax in f64 over the valid vocabulary), mean and max;
- top-1 agreement: the share of positions whose argmax equals bf16's;
- max |logit difference| relative to bf16's max |logit| per position (mean over positions).

Pooled over all positions of all prompts. Every format quantizes every linear weight, the (tied)
head included, as `--quantize` does. The JSON records the instruction-set path (the integer
kernels give the same bits on every path, so it does not move these numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from acceptance import DEFAULT_PROMPTS, machine_info, read_prompts, shown  # noqa: E402

from dflash2_numba import load_target  # noqa: E402

ASSETS = ROOT / "dflash2_numba" / "assets" / "default"


def logits_of(target, ids: np.ndarray) -> np.ndarray:
    """Teacher-forced logits [n, V] of ids [n] (one forward, a fresh cache)."""
    logits, _ = target.forward(ids, target.new_cache(len(ids) + 8))
    return target.mask_padded(np.array(logits, np.float64))


def greedy(target, ids: list[int], n: int) -> list[int]:
    cache = target.new_cache(len(ids) + n + 8)
    logits, _ = target.forward(np.asarray(ids, np.int64), cache, last_only=True)
    out = []
    for _ in range(n):
        tok = int(np.argmax(target.mask_padded(logits)[-1]))
        out.append(tok)
        logits, _ = target.forward(np.asarray([tok], np.int64), cache)
    return out


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """Per-position statistics of got [n, V] against ref [n, V] (padded columns -inf in both)."""
    valid = np.isfinite(ref[0])
    lp, lq = log_softmax(ref[:, valid]), log_softmax(got[:, valid])
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)  # [n]
    top1 = ref[:, valid].argmax(axis=1) == got[:, valid].argmax(axis=1)
    rel = np.abs(got[:, valid] - ref[:, valid]).max(axis=1) / np.abs(ref[:, valid]).max(axis=1)
    return {"kl": kl, "top1": top1, "rel": rel}


def run(args) -> dict:
    prompts = read_prompts(args.prompts, args.n_prompts)
    ref_model = load_target(args.target)
    models = {fmt: load_target(args.target, quantize=fmt) for fmt in args.formats}
    from dflash2_numba.kernels import isa

    pooled = {fmt: {"kl": [], "top1": [], "rel": []} for fmt in args.formats}
    for i, p in enumerate(prompts):
        ids = ref_model.tokenizer.encode_prompt(p["text"], chat=False)
        seq = np.asarray(ids + greedy(ref_model, ids, args.continue_tokens), np.int64)
        ref = logits_of(ref_model, seq)
        for fmt, model in models.items():
            for k, v in compare(ref, logits_of(model, seq)).items():
                pooled[fmt][k].append(v)
        print(f"prompt {i + 1}/{len(prompts)}: {len(seq)} positions", file=sys.stderr, flush=True)
    table = {}
    for fmt, s in pooled.items():
        kl, top1, rel = (np.concatenate(s[k]) for k in ("kl", "top1", "rel"))
        table[fmt] = {"positions": int(kl.size), "kl_mean_nats": float(kl.mean()), "kl_median_nats": float(np.median(kl)),
                      "kl_max_nats": float(kl.max()), "top1_agreement": float(top1.mean()),
                      "max_abs_logit_err_rel_mean": float(rel.mean())}
    return {"machine": machine_info(1), "isa": isa.describe(),
            "settings": {"target": shown(args.target), "prompts": shown(args.prompts), "n_prompts": len(prompts),
                         "continue_tokens": args.continue_tokens, "formats": args.formats,
                         "reference": "bf16 weights as stored, f32 compute"},
            "results": table}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=ASSETS / "target")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--continue-tokens", type=int, default=64)
    ap.add_argument("--formats", default="q8_0,q4_0,q4_k")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quant_logit_error.json")
    args = ap.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'format':8s} {'KL mean (nats)':>15s} {'KL max':>10s} {'top-1 agree':>12s} {'max|dz|/max|z|':>15s}")
    for fmt, r in result["results"].items():
        print(f"{fmt:8s} {r['kl_mean_nats']:15.5f} {r['kl_max_nats']:10.4f} {r['top1_agreement']:12.4f} "
              f"{r['max_abs_logit_err_rel_mean']:15.4f}")
    print(f"({result['results'][args.formats[0]]['positions']} positions, {result['settings']['n_prompts']} prompts; "
          f"wrote {shown(args.out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
