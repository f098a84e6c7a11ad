"""Where a MoE target's decode step goes: the fused step against its parts, one run.

    python bench/moe_profile.py [DIR] [--quantize q8_0] [--steps 48] [--threads 1] [--out JSON]

DIR defaults to bench_vs_llamacpp.py's --model moe checkpoint (written there). The greedy decode is
timed three ways, alternately step block by step block:
  fused     target.fused = True: one numba call per layer (kernels/fused_moe.py), what is benchmarked
  op by op  target.fused = False with every `linear` call timed and put in a bucket by its weight:
            attention (q, k, v, o), router, experts (gate_up, down), head; the rest of the op-by-op
            step (RMSNorm, RoPE, attention over the cache, routing, SwiGLU, the scatter, Python) is
            `other`
  head      the head GEMV alone on the step's final row
Each kind's BEST round is reported (the buckets from the best op-by-op round). The GEMV buckets are the same panel kernels the fused layer calls, so fused - (sum of GEMVs) is
an upper bound on what the fused layer spends outside its products (attention over the cache,
norms, routing, the per-expert gather / scatter, the call itself). Bytes per bucket (at the
format's bytes per weight) / its seconds give each product's achieved weight bandwidth, to set
against bench/bandwidth.py's read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", type=Path, default=None)
    ap.add_argument("--quantize", default="q8_0", choices=["bf16", "q8_0", "q4_0"])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bw-gib", type=float, default=1.0)
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash2_numba")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import numba

    from bandwidth import read_bandwidth
    from dflash2_numba.families.qwen3_moe import Qwen3MoeModel
    from dflash2_numba.kernels import isa
    from dflash2_numba.quant.formats import BYTES_PER_WEIGHT

    import bench_vs_llamacpp as bvl

    src = args.dir or bvl.moe_model_dir(args.cache_dir)
    t = Qwen3MoeModel.load(src, device="cpu", quantize=None if args.quantize == "bf16" else args.quantize)
    numba.set_num_threads(args.threads)
    c = t.config
    bucket_of = {id(t.lm_head_w): "head"}
    for L in t.layers:
        for k in ("q", "k", "v", "o"):
            bucket_of[id(L[k])] = "attention GEMVs"
        if "moe" in L:
            bucket_of[id(L["moe"].router)] = "router GEMV"
            for w in L["moe"].gate_up:
                bucket_of[id(w)] = "expert gate_up GEMVs"
            for w in L["moe"].down:
                bucket_of[id(w)] = "expert down GEMVs"
    ops = t.ops
    plain_linear = ops.linear
    secs: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed_linear(x, w):
        t0 = time.perf_counter()
        y = plain_linear(x, w)
        b = bucket_of.get(id(w), "other GEMVs")
        secs[b] = secs.get(b, 0.0) + time.perf_counter() - t0
        calls[b] = calls.get(b, 0) + 1
        return y

    import dataclasses

    timing_ops = dataclasses.replace(ops, linear=timed_linear)
    prompt = np.random.default_rng(0).integers(0, 1000, 16).astype(np.int64)

    def decode(fused: bool, n: int):
        t.fused = fused
        t.ops = ops if fused else timing_ops  # ops is a frozen dataclass: a copy with the timed linear
        cache = t.new_cache(len(prompt) + n + 1)
        logits, _ = t.forward(prompt, cache, last_only=True)
        secs.clear()  # the prefill's products are not the steps'
        calls.clear()
        toks = []
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(logits[-1]))
            toks.append(tok)
            logits, _ = t.forward(np.array([tok]), cache)
        dt = time.perf_counter() - t0
        t.ops = ops
        return toks, dt, dict(secs), dict(calls)

    decode(True, 4)
    decode(False, 4)
    load_before = os.getloadavg()
    fused_s, ops_s, op_rounds = [], [], []
    rounds = args.rounds
    for _ in range(rounds):  # alternately; each kind's best round is reported (load from other work)
        tf, s1, _, _ = decode(True, args.steps)
        fused_s.append(s1)
        to, s2, sec_r, calls_r = decode(False, args.steps)
        ops_s.append(s2)
        op_rounds.append((s2, sec_r, calls_r))
    load_after = os.getloadavg()
    _, best_secs, best_calls = min(op_rounds, key=lambda r: r[0])
    secs.clear()
    secs.update(best_secs)
    calls.clear()
    calls.update(best_calls)
    n_steps = args.steps
    bpw = BYTES_PER_WEIGHT[args.quantize]
    H, I, E, k = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok
    Lm = len(c.moe_layers)
    q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    bytes_per_step = {
        "attention GEMVs": bpw * c.num_hidden_layers * (2 * q_rows * H + 2 * kv_rows * H),
        "router GEMV": 2 * Lm * E * H,
        "expert gate_up GEMVs": bpw * Lm * k * 2 * I * H,
        "expert down GEMVs": bpw * Lm * k * H * I,
        "head": bpw * c.vocab_size * H,
    }
    bw = read_bandwidth([args.threads], args.bw_gib)[str(args.threads)]["best_gbs"]
    fused_ms = 1e3 * min(fused_s) / args.steps
    ops_ms = 1e3 * min(ops_s) / args.steps
    rows = []
    gemv_ms = 0.0
    for b in ("attention GEMVs", "router GEMV", "expert gate_up GEMVs", "expert down GEMVs", "head"):
        ms = 1e3 * secs.get(b, 0.0) / n_steps
        gemv_ms += ms
        rows.append({"part": b, "ms_per_step": ms, "calls_per_step": calls.get(b, 0) / n_steps,
                     "mb_per_step": bytes_per_step[b] / 1e6,
                     "gbs": bytes_per_step[b] / 1e9 / (ms / 1e3) if ms else None})
    doc = {"model": src.name, "quantize": args.quantize, "threads": args.threads, "isa": isa.describe(),
           "cpu": bvl.machine_facts().get("cpu_model"), "steps_per_round": args.steps, "rounds": rounds,
           "read_bandwidth_gbs": bw, "load_average": {"before": list(load_before), "after": list(load_after)},
           "fused_ms_per_step_best": fused_ms, "fused_ms_rounds": [1e3 * s / args.steps for s in fused_s],
           "op_by_op_ms_per_step_best": ops_ms, "gemv_ms_per_step_best_op_round": gemv_ms,
           "op_by_op_ms_rounds": [1e3 * s / args.steps for s in ops_s],
           "fused_minus_gemvs_ms": fused_ms - gemv_ms, "same_tokens": tf == to,
           "active_mb_per_step": sum(bytes_per_step.values()) / 1e6, "parts": rows}
    print(f"{src.name} {args.quantize}, {args.threads} thread(s), isa {doc['isa']['isa']}, {doc['cpu']}; "
          f"read bandwidth {bw:.2f} GB/s; load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"fused step {fused_ms:.2f} ms (best round; rounds {', '.join(f'{x:.2f}' for x in doc['fused_ms_rounds'])}); "
          f"op-by-op step {ops_ms:.2f} ms; active weights {doc['active_mb_per_step']:.1f} MB/step "
          f"= {doc['active_mb_per_step'] / 1e3 / (fused_ms / 1e3):.2f} GB/s fused")
    print(f"{'part':22s} {'ms/step':>8s} {'calls':>6s} {'MB':>7s} {'GB/s':>6s} {'% of fused':>10s}")
    for r in rows:
        print(f"{r['part']:22s} {r['ms_per_step']:8.2f} {r['calls_per_step']:6.1f} {r['mb_per_step']:7.1f} "
              f"{(r['gbs'] or 0):6.2f} {100 * r['ms_per_step'] / fused_ms:9.1f}%")
    print(f"{'fused - GEMVs':22s} {fused_ms - gemv_ms:8.2f} (attention over the cache, norms, routing, gather/scatter, "
          "call overhead)")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
