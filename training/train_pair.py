"""One command, end to end: tokenizer -> target -> self-distillation data -> DFlash2 + DFlash drafts.

    python -m training.train_pair --out dflash2_numba/assets/default

Writes `{out}/target`, `{out}/dflash2`, `{out}/dflash`, `{out}/MODEL_CARD.md`,
`bench/data/heldout_prompts.json`, and under `training/out/`: `results.json`,
`crosscheck.npz`, the distillation cache `distill.pt`, and the log. Deterministic from
`--seed` for a fixed torch version and thread count (`--threads`, default 1: on a shared
2-core machine one thread is both faster and reproducible).

`--reuse` skips stages whose outputs exist (trained target, distillation cache), for
iterating on the drafts. `--smoke` runs every stage with tiny step counts (a minute or two).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import Qwen3ForCausalLM

from . import corpus, distill, evaluate, export, model_card, target as target_mod
from .draft_model import DFlashDraft, DraftSpec
from .train_draft import DraftTrainConfig, teacher_forced_tau, train_draft

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "training" / "out"

# ---------------------------------------------------------------- the recipe's knobs
N_MERGED = 4000  # BPE entries; + <|endoftext|> 4000, <|mask|> 4001; config vocab padded to 4096
VOCAB_SIZE = 4096
TAP_LAYERS = [0, 2, 3]  # residual stream after target layers 0, 2, 3 (hidden_states[1, 3, 4])
BLOCK = 8
TARGET_LR = 5e-3
DRAFT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32)
V2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=16,
          input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=10.0)
FULL = dict(target_steps=1200, target_batch=8, seq_len=256, distill_n=1536, distill_new=96,
            prompt_lengths=[32, 48, 64, 96], heldout_n=96, draft_steps=1000, draft_batch=16,
            draft_anchors=16, bench_prompts=64, bench_new=128)
SMOKE = dict(target_steps=6, target_batch=4, seq_len=128, distill_n=32, distill_new=24,
             prompt_lengths=[32, 48], heldout_n=4, draft_steps=4, draft_batch=4,
             draft_anchors=4, bench_prompts=48, bench_new=24)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def draft_spec(kind: str, n_real: int, mask_id: int) -> DraftSpec:
    extra = V2 if kind == "dflash2" else {}
    return DraftSpec(kind=kind, **DRAFT_SHAPE, rms_norm_eps=1e-6, rope_theta=target_mod.ROPE_THETA,
                     block_size=BLOCK, mask_token_id=mask_id, target_layer_ids=TAP_LAYERS,
                     num_target_layers=target_mod.TARGET_SHAPE["num_hidden_layers"],
                     vocab_size=VOCAB_SIZE, n_real_vocab=n_real, **extra)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="checkpoint root (default dflash2_numba/assets/default; --smoke: training/out/smoke)")
    ap.add_argument("--prompts-out", type=Path, default=None,
                    help="default bench/data/heldout_prompts.json (--smoke: under training/out/smoke)")
    ap.add_argument("--work", type=Path, default=None, help="caches, results.json, crosscheck.npz "
                    "(default training/out; --smoke: training/out/smoke)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="reuse a trained target / distillation cache")
    ap.add_argument("--smoke", action="store_true", help="tiny step counts, to check the pipeline")
    ap.add_argument("--draft-steps", type=int, default=None, help="override the draft step count")
    args = ap.parse_args(argv)
    smoke_dir = OUT / "smoke"  # a smoke run never overwrites the shipped assets by default
    args.out = args.out or (smoke_dir / "assets" if args.smoke else REPO / "dflash2_numba" / "assets" / "default")
    args.prompts_out = args.prompts_out or (smoke_dir / "heldout_prompts.json" if args.smoke
                                            else REPO / "bench" / "data" / "heldout_prompts.json")
    args.work = args.work or (smoke_dir if args.smoke else OUT)
    knobs = dict(SMOKE if args.smoke else FULL)
    if args.draft_steps is not None:
        knobs["draft_steps"] = args.draft_steps
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    timings: dict[str, float] = {}

    # ---- corpus and tokenizer
    t0 = time.time()
    split = corpus.read_split()
    tok = corpus.train_tokenizer([text for _, text in split["train"]], N_MERGED)
    eos_id, mask_id = tok.token_to_id(corpus.ENDOFTEXT), tok.token_to_id(corpus.MASK)
    n_real = tok.get_vocab_size()
    encode = lambda texts: [e.ids for e in tok.encode_batch(texts)]  # noqa: E731
    train_docs = encode([t for _, t in split["train"]])
    held_docs = encode([t for _, t in split["heldout"]])
    train_stream = target_mod.pack_documents(train_docs, eos_id)
    held_stream = target_mod.pack_documents(held_docs, eos_id)
    log(f"corpus: {len(split['train'])} train files ({len(train_stream)} tokens), "
        f"{len(split['heldout'])} held-out files ({len(held_stream)} tokens); vocab {n_real} -> padded {VOCAB_SIZE}")
    timings["corpus_tokenizer_s"] = time.time() - t0
    vocab_mask = target_mod.padded_vocab_mask(VOCAB_SIZE, n_real)

    # ---- target
    t0 = time.time()
    target_dir = args.out / "target"
    if args.reuse and (target_dir / "model.safetensors").exists():
        target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        log(f"target: reused {target_dir}")
        target_losses = None
    else:
        torch.manual_seed(args.seed)
        target = Qwen3ForCausalLM(target_mod.target_config(VOCAB_SIZE, eos_id))
        target_losses = target_mod.train_target(
            target, train_stream, steps=knobs["target_steps"], batch=knobs["target_batch"],
            seq_len=knobs["seq_len"], lr=TARGET_LR, seed=args.seed + 1, log=log)
        target_mod.round_to_bf16_(target)
        target_mod.save_target(target, target_dir, eos_id)
        corpus.write_tokenizer_files(target_dir, tok, target_mod.MAX_POSITIONS)
    target.eval()
    target.config.use_cache = True
    held_loss = target_mod.eval_loss(target, held_stream, 256, 64 if not args.smoke else 2)
    log(f"target: held-out loss {held_loss:.3f} nats/token ({time.time() - t0:.0f}s)")
    timings["target_s"] = time.time() - t0
    embed = target.model.embed_tokens.weight.detach()  # [V, H] frozen; tied = lm_head

    # ---- self-distillation data (cached)
    t0 = time.time()
    cache = args.work / "distill.pt"
    meta = {"seed": args.seed, "knobs": knobs, "taps": TAP_LAYERS,
            "target_param_sum": str(float(sum(p.detach().double().sum() for p in target.parameters())))}
    if args.reuse and cache.exists() and torch.load(cache, weights_only=False)["meta"] == meta:
        data = torch.load(cache, weights_only=False)
        log(f"distill: reused {cache}")
    else:
        train_groups = distill.build_groups(
            target, train_docs, n=knobs["distill_n"], lengths=knobs["prompt_lengths"],
            n_new=knobs["distill_new"], layer_ids=TAP_LAYERS, vocab_mask=vocab_mask,
            seed=args.seed + 2, log=log)
        held_groups = distill.build_groups(
            target, held_docs, n=knobs["heldout_n"], lengths=[64], n_new=knobs["distill_new"],
            layer_ids=TAP_LAYERS, vocab_mask=vocab_mask, seed=args.seed + 3, log=log)
        data = {"meta": meta, "train": train_groups, "heldout": held_groups}
        torch.save(data, cache)
    timings["distill_s"] = time.time() - t0

    # ---- drafts
    results: dict = {"config": {"knobs": knobs, "tap_layers": TAP_LAYERS, "block_size": BLOCK,
                                "draft_shape": DRAFT_SHAPE, "dflash2": V2, "seed": args.seed,
                                "threads": args.threads, "vocab_size": VOCAB_SIZE,
                                "target_lr": TARGET_LR},
                     "target": {"heldout_loss": held_loss,
                                "final_train_loss": (sum(target_losses[-25:]) / len(target_losses[-25:])
                                                     if target_losses else None)},
                     "corpus": {"train_files": len(split["train"]), "heldout_files": len(split["heldout"]),
                                "train_tokens": len(train_stream), "heldout_tokens": len(held_stream)},
                     "tokens": {"eos_id": eos_id, "mask_id": mask_id, "n_real": n_real},
                     "drafts": {}}
    drafts = {}
    for i, kind in enumerate(("dflash2", "dflash")):
        t0 = time.time()
        torch.manual_seed(args.seed + 10 + i)
        model = DFlashDraft(draft_spec(kind, n_real, mask_id))
        cfg = DraftTrainConfig(steps=knobs["draft_steps"], batch=knobs["draft_batch"],
                               anchors=knobs["draft_anchors"], seed=args.seed + 20 + i)
        train_draft(model, data["train"], embed, BLOCK, cfg, log=log)
        timings[f"{kind}_train_s"] = time.time() - t0
        tau_f32 = teacher_forced_tau(model, data["heldout"], embed, BLOCK)
        export.round_draft_to_bf16_(model)
        tau = teacher_forced_tau(model, data["heldout"], embed, BLOCK)
        export.save_draft(model, args.out / kind, eos_id)
        results["drafts"][kind] = {"train": asdict(cfg), "tau_f32_weights": tau_f32["tau"],
                                   "heldout_teacher_forced": tau,
                                   "params": sum(p.numel() for p in model.parameters())}
        log(f"{kind}: held-out teacher-forced tau @Q={BLOCK}: {tau['tau']:.3f} (bf16 weights), "
            f"{tau_f32['tau']:.3f} (f32 weights); histogram {tau['histogram']}")
        drafts[kind] = model

    # ---- held-out prompts, simulated decoding, cross-check file
    t0 = time.time()
    prompts = evaluate.heldout_prompts(split["heldout"], tok, knobs["bench_prompts"], seed=args.seed + 4)
    args.prompts_out.parent.mkdir(parents=True, exist_ok=True)
    args.prompts_out.write_text(json.dumps([p["text"] for p in prompts], indent=1) + "\n")
    sim = {kind: [] for kind in drafts}
    samples = []
    for i, p in enumerate(prompts):
        ids = tok.encode(p["text"]).ids
        full, taps = evaluate.greedy_reference(target, ids, knobs["bench_new"], {eos_id},
                                               TAP_LAYERS, vocab_mask)
        if i < 3:  # what the target writes, for the model card
            samples.append({"file": p["file"], "prompt": p["text"], "output": tok.decode(full[len(ids):].tolist())})
        for kind, model in drafts.items():
            r = evaluate.simulate_decode(model, embed, full, taps, len(ids), knobs["bench_new"], BLOCK)
            sim[kind].append({"file": p["file"], **r})
    for kind in drafts:
        steps = [x for r in sim[kind] for x in r["acceptance_lengths"]]
        results["drafts"][kind]["simulated_decode"] = {
            "prompts": len(prompts), "max_new_tokens": knobs["bench_new"], "block_size": BLOCK,
            "tau_over_steps": sum(steps) / len(steps), "steps": len(steps)}
        log(f"{kind}: simulated greedy decode of {len(prompts)} held-out prompts: tau "
            f"{sum(steps) / len(steps):.3f} over {len(steps)} steps")
    results["simulated_per_prompt"] = sim
    results["samples"] = samples
    evaluate.write_crosscheck(args.work / "crosscheck.npz", target, drafts, embed,
                              tok.encode(prompts[0]["text"]).ids, knobs["bench_new"],
                              anchors_after=[0, 17], Qs=[BLOCK, 5], vocab_mask=vocab_mask)
    timings["eval_s"] = time.time() - t0
    timings["total_s"] = time.time() - t_start
    results["timings"] = timings
    results["prompt_files"] = [p["file"] for p in prompts]
    (args.work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    model_card.write(args.out / "MODEL_CARD.md", results)
    log(f"done in {timings['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
