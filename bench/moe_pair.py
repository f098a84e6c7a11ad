"""The embedded pair on a MIXTURE-OF-EXPERTS target: the widened (scaled_pair.py) target with every
MLP replaced by E identical expert copies behind a random top-k router, plus the verify cost and
expert union of a Q-row verify on it.

    python bench/moe_pair.py build 8 [--deepen D] [--experts 16] [--top-k 2] --out OUT
        # writes OUT/{target,dflash2,dflash} (+ OUT/dense_target, the widened dense target it came
        # from) and checks: greedy outputs of OUT/target == OUT/dense_target on --check-prompts
        # held-out prompts (exit 1 if not)
    python bench/acceptance.py --target OUT/target --dflash2 OUT/dflash2 --dflash OUT/dflash \
        --quantize q8_0 --block-sizes 2,4,8 --threads 1 --out bench/results/acceptance_moe_x8_e16k2_q8_0.json
    python bench/moe_pair.py verify-cost OUT/target [--quantize q8_0] [--qs 1,2,4,8,16] \
        [--out bench/results/moe_verify_cost_x8_e16k2_q8_0.json]

Why: speculation on a MoE target pays a cost a dense target does not: the Q rows of a verify pick
their experts independently, so the block reads the UNION of its rows' experts (up to Q x k of
them), where one decode step reads k. With identical copies and renormalised top-k weights
(norm_topk_prob = true), the MoE layer's output is sum_j w_j * mlp(x) with sum_j w_j = 1, i.e.
the dense MLP's output up to float rounding: every token, tau and acceptance length stays the
trained pair's, while the verify reads what a real MoE reads (each copy is a separate array,
quantized and streamed on its own).

Conversion of the widened target (bf16 bits unchanged):
    model.layers.N.mlp.{gate,up,down}_proj.weight -> model.layers.N.mlp.experts.{0..E-1}.{...}.weight
    + model.layers.N.mlp.gate.weight [E, H]  N(0, router_std) (default 4 / sqrt(H): logits of std ~4
      on a normed row, the routing of a trained router's spread; seed per layer)
    config: Qwen3MoeForCausalLM / qwen3_moe, num_experts E, num_experts_per_tok k,
      moe_intermediate_size = intermediate_size, norm_topk_prob true, decoder_sparse_step 1,
      mlp_only_layers []
The drafts are the widened drafts unchanged (they read the target's taps, embedding and head,
which the conversion does not touch).

verify-cost: prefill a held-out prompt, decode its greedy continuation, then for each Q run
Q-row forwards of that continuation (the tokens a perfect draft would propose) at --positions
offsets, cropping the cache back after each:
  union   op-by-op forward (target.fused = False, target.routing_counts = {}): moe_mlp counts the
          experts it touched; union per layer = touched / MoE layers (mean over positions), beside
          E (1 - (1 - k/E)^Q), the union of independent uniform routing;
  cost    the fused forward (target.fused = True), median over --repeat of each position, as ms
          and as x a 1-row step; `bytes` = attention + head + union x one expert's bytes, as x one
          token's: the cost a purely bandwidth-bound verify would have.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(HERE))

from dflash2_numba.checkpoint import open_checkpoint  # noqa: E402
from dflash2_numba.numerics import f32_to_bf16_array  # noqa: E402
from dflash2_numba import tiny  # noqa: E402

DEFAULT_PROMPTS = HERE / "data" / "heldout_prompts.json"
MLP = ("gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- conversion
def convert_to_moe(src: Path, dst: Path, E: int, k: int, seed: int = 0, router_std: float | None = None,
                   num_shards: int | None = None) -> Path:
    """A dense Qwen3 target directory -> a Qwen3-MoE one with E identical experts per layer (module doc).
    Copies share one array per tensor until written, so memory holds the dense weights once."""
    import shutil

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures", [None])[0] != "Qwen3ForCausalLM":
        raise ValueError(f"{src}: expected a Qwen3ForCausalLM target, got {config.get('architectures')}")
    H, L = config["hidden_size"], config["num_hidden_layers"]
    std = 4.0 / np.sqrt(H) if router_std is None else router_std
    ckpt = open_checkpoint(src)
    tensors = {}
    for name in ckpt.names():
        w = np.asarray(ckpt.get(name))
        head, _, rest = name.rpartition(".mlp.")
        if head and rest.split(".")[0] in MLP:
            for e in range(E):
                tensors[f"{head}.mlp.experts.{e}.{rest}"] = w  # the same bits, written E times
        else:
            tensors[name] = w
    for i in range(L):
        rng = np.random.default_rng([seed, i])
        tensors[f"model.layers.{i}.mlp.gate.weight"] = f32_to_bf16_array(
            rng.standard_normal((E, H), dtype=np.float32) * np.float32(std))
    dst.mkdir(parents=True, exist_ok=True)
    total = sum(t.nbytes for t in tensors.values())
    shards = num_shards or max(1, int(np.ceil(total / (1 << 30))))  # ~1 GiB shards: bounded write buffers
    tiny._write_weights(dst, dict(sorted(tensors.items(), key=lambda kv: _layer_order(kv[0]))), shards)
    for key in ("layer_types", "max_window_layers"):  # Qwen3-MoE has no per-layer attention types
        config.pop(key, None)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=E,
                  num_experts_per_tok=k, moe_intermediate_size=config["intermediate_size"], norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                  router_aux_loss_coef=0.001, use_sliding_window=False, sliding_window=None)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dst


def _layer_order(name: str):
    """Model order for the shards: embedding, layers in index order, then the rest."""
    if name.startswith("model.layers."):
        return (1, int(name.split(".")[2]), name)
    return (0 if "embed" in name else 2, 0, name)


def build(args) -> int:
    import shutil

    import scaled_pair

    out = args.out
    K, D = args.K, args.deepen
    tmp = out / "dense_target"
    scaled_pair.widen_dir(args.src / "target", tmp, K, untie=True)
    for kind in ("dflash2", "dflash"):
        scaled_pair.widen_dir(args.src / kind, out / kind, K)
    if D > 1:
        scaled_pair.deepen_target(tmp, D)
        for kind in ("dflash2", "dflash"):
            scaled_pair.repoint_draft(out / kind, D)
    if (out / "target").exists():
        shutil.rmtree(out / "target")
    convert_to_moe(tmp, out / "target", args.experts, args.top_k, args.seed)
    size = sum(f.stat().st_size for f in (out / "target").glob("*.safetensors"))
    print(f"wrote {out}/target: Qwen3-MoE, {args.experts} identical experts top-{args.top_k} per layer, "
          f"{size / 2**30:.2f} GiB of bf16 (widened {K}x, {D}x deeper); drafts {out}/dflash2, {out}/dflash",
          file=sys.stderr)
    report = check(out, args.check_prompts, args.check_tokens, args.check_quantize)
    (out / "moe_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "prompts"}))
    return 0 if report["all_equal"] else 1


def check(out: Path, n_prompts: int, n_tokens: int, quantize: str) -> dict:
    """Greedy outputs of the MoE target == those of the dense target it came from."""
    from dflash2_numba import generate, load_target

    import acceptance

    prompts = acceptance.read_prompts(DEFAULT_PROMPTS, n_prompts)
    runs = {}
    for name in ("dense_target", "target"):
        t = load_target(out / name, quantize=quantize)
        ids = [t.tokenizer.encode_prompt(p["text"], chat=False) for p in prompts]
        runs[name] = [generate(t, None, prompt_ids=i, max_new_tokens=n_tokens, temperature=0.0).output_ids for i in ids]
        del t
    per = [{"prompt": i, "equal": a == b, "first_difference": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                                                   None)}
           for i, (a, b) in enumerate(zip(runs["dense_target"], runs["target"]))]
    return {"quantize": quantize, "prompts_checked": len(per), "tokens": n_tokens,
            "all_equal": all(p["equal"] for p in per), "prompts": per}


# ---------------------------------------------------------------- verify cost and union
def expected_union(E: int, k: int, Q: int) -> float:
    """Experts touched by Q rows routed independently and uniformly (each row k distinct of E)."""
    return E * (1 - (1 - k / E) ** Q)


def verify_cost(args) -> int:
    import numba

    from dflash2_numba import generate, load_target
    from dflash2_numba.kernels import isa
    from dflash2_numba.quant.formats import BYTES_PER_WEIGHT

    import acceptance

    numba.set_num_threads(args.threads)
    qs = [int(q) for q in args.qs.split(",")]
    t = load_target(args.target, quantize=args.quantize)
    c = t.config
    E, k, L_moe = c.num_experts, c.num_experts_per_tok, len(c.moe_layers)
    prompt = acceptance.read_prompts(DEFAULT_PROMPTS, 1)[0]["text"]
    ids = t.tokenizer.encode_prompt(prompt, chat=False)
    need = args.positions * args.stride + max(qs)
    cont = generate(t, None, prompt_ids=ids, max_new_tokens=need, temperature=0.0).output_ids
    seq = np.asarray(list(ids) + list(cont), np.int64)
    n0 = len(ids)
    cache = t.new_cache(len(seq) + max(qs) + 2)
    t.forward(seq[:n0], cache, last_only=True)

    # bytes per token / per verify (weights only)
    bpw = BYTES_PER_WEIGHT[args.quantize]
    H, hd = c.hidden_size, c.head_dim
    attn = c.num_hidden_layers * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * hd * H
    expert = 3 * H * c.moe_intermediate_size
    head = c.vocab_size * H
    router_b = 2 * E * H * L_moe

    def step(rows, start):
        block = seq[start:start + rows]
        t0 = time.perf_counter()
        t.forward(block, cache)
        dt = time.perf_counter() - t0
        cache.commit(start)
        return dt

    table = []
    starts = [n0 + j * args.stride for j in range(args.positions)]
    # warm-up: every Q compiles / loads its kernels once (fused and op by op)
    for Q in qs:
        for fused_flag in (True, False):
            t.fused = fused_flag
            step(Q, n0)
    t.fused = True
    load_before = os.getloadavg()
    results = {Q: {"union": [], "seconds": []} for Q in qs}
    for p in starts:
        cache.commit(n0)
        if p > n0:
            t.forward(seq[n0:p], cache)  # extend the context to p
        for Q in qs:
            t.fused, t.routing_counts = False, {}
            step(Q, p)
            results[Q]["union"].append(t.routing_counts["experts"] / L_moe)
            t.fused, t.routing_counts = True, None
        for _ in range(args.repeat):  # timings interleaved over Q: load hits every Q alike
            for Q in qs:
                results[Q]["seconds"].append(step(Q, p))
    load_after = os.getloadavg()
    one = statistics.median(results[1]["seconds"]) if 1 in results else None
    tok_bytes = bpw * (attn + L_moe * k * expert + head) + router_b
    for Q in qs:
        u = statistics.mean(results[Q]["union"])
        sec = statistics.median(results[Q]["seconds"])
        vb = bpw * (attn + L_moe * u * expert + head) + router_b
        table.append({"Q": Q, "union_per_layer": u, "union_min": min(results[Q]["union"]),
                      "union_max": max(results[Q]["union"]), "union_if_uniform": expected_union(E, k, Q),
                      "ms": 1e3 * sec, "x_one_row": sec / one if one else None,
                      "verify_weight_bytes": vb, "bytes_x_one_token": vb / tok_bytes,
                      "tokens_per_s_if_all_accepted": Q / sec, "weight_gbs": vb / sec / 1e9})
    doc = {"target": acceptance.shown(args.target), "quantize": args.quantize, "threads": numba.get_num_threads(),
           "isa": isa.describe(), "cpu": acceptance.cpu_model(), "experts": E, "top_k": k, "moe_layers": L_moe,
           "positions": starts, "context_tokens_at_first_position": n0, "repeat": args.repeat,
           "one_token_weight_bytes": tok_bytes, "one_expert_bytes": bpw * expert,
           "load_average": {"before": list(load_before), "after": list(load_after)}, "table": table}
    print(f"{doc['target']} at {args.quantize}, {doc['threads']} thread(s), isa {doc['isa']['isa']}, {doc['cpu']}; "
          f"E={E} top-{k}, {L_moe} MoE layers; {args.positions} positions x {args.repeat} repeats; "
          f"load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"{'Q':>3} {'union/layer':>11} {'(uniform)':>9} {'ms':>8} {'x 1 row':>8} {'bytes x1':>8} "
          f"{'Q/cost':>7} {'GB/s':>6}")
    for r in table:
        print(f"{r['Q']:>3} {r['union_per_layer']:11.2f} {r['union_if_uniform']:9.2f} {r['ms']:8.2f} "
              f"{r['x_one_row']:8.2f} {r['bytes_x_one_token']:8.2f} {r['Q'] / r['x_one_row']:7.2f} "
              f"{r['weight_gbs']:6.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write OUT/{target,dflash2,dflash} and check the MoE target")
    b.add_argument("K", type=int, help="widening factor (scaled_pair.py)")
    b.add_argument("--deepen", type=int, default=1, metavar="D")
    b.add_argument("--experts", type=int, default=16, metavar="E")
    b.add_argument("--top-k", type=int, default=2)
    b.add_argument("--seed", type=int, default=0, help="router seed")
    b.add_argument("--src", type=Path, default=ROOT / "dflash2_numba" / "assets" / "default")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--check-prompts", type=int, default=4)
    b.add_argument("--check-tokens", type=int, default=64)
    b.add_argument("--check-quantize", default="q8_0", choices=["bf16", "q8_0", "q4_0"])
    v = sub.add_parser("verify-cost", help="expert union and verify cost against Q")
    v.add_argument("target", type=Path)
    v.add_argument("--quantize", default="q8_0", choices=["bf16", "q8_0", "q4_0"])
    v.add_argument("--qs", default="1,2,4,8,16")
    v.add_argument("--positions", type=int, default=8, help="verify positions along the continuation")
    v.add_argument("--stride", type=int, default=8, help="tokens between positions")
    v.add_argument("--repeat", type=int, default=5)
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        if args.K < 1 or args.deepen < 1 or not 1 <= args.top_k <= args.experts:
            ap.error("K >= 1, --deepen >= 1, 1 <= --top-k <= --experts")
        return build(args)
    if 1 not in [int(q) for q in args.qs.split(",")]:
        ap.error("--qs must include 1 (the one-row step the costs are relative to)")
    return verify_cost(args)


if __name__ == "__main__":
    sys.exit(main())
