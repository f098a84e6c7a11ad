"""MODEL_CARD.md for the embedded default pair, rendered from training/out/results.json."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

DECODER_SECTION = """\
## Results measured by this project's decoder

<!-- DECODER-RESULTS: filled in by the decoder side (numpy / numba), not by the training recipe.
     Keep this marker; replace the table below. -->

| draft | mode | prompts | block size | tau | tokens/s | speedup | matches torch tau? |
|---|---|---|---|---|---|---|---|
| dflash2 | _pending_ | | | | | | |
| dflash | _pending_ | | | | | | |
"""


def main() -> None:
    """Re-render the card from a results.json: python -m training.model_card [results] [card]."""
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "out" / "results.json"
    card = (Path(sys.argv[2]) if len(sys.argv) > 2
            else Path(__file__).resolve().parent.parent / "dflash2_numba" / "assets" / "default" / "MODEL_CARD.md")
    write(card, json.loads(results.read_text()))


def _samples(samples: list[dict]) -> list[str]:
    """The target's greedy output for a few held-out prompts (prompt tail shown)."""
    if not samples:
        return []
    fence = "`" * 3
    lines = ["## What the target writes", "",
             "Greedy continuations of held-out prompts (last lines of the prompt, then `# >>> output`).",
             "A 4-layer model trained for minutes on a few million tokens: syntax-shaped, repetitive,",
             "often wrong.", ""]
    for smp in samples:
        tail = "".join(smp["prompt"].splitlines(keepends=True)[-6:])
        lines += [f"`{smp['file']}`:", "", fence + "python", tail.rstrip("\n"), "# >>> output",
                  smp["output"].rstrip("\n").replace(fence, "'" * 3), fence, ""]
    return lines


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(out: Path) -> list[tuple[str, int, str]]:
    rows = []
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != "MODEL_CARD.md":
            rows.append((p.relative_to(out).as_posix(), p.stat().st_size, _sha256(p)))
    return rows


def write(path: Path, results: dict) -> None:
    out = path.parent
    ids = results["tokens"]
    eos_id, mask_id, n_real = ids["eos_id"], ids["mask_id"], ids["n_real"]
    c = results["corpus"]
    k = results["config"]["knobs"]
    d2, d1 = results["drafts"]["dflash2"], results["drafts"]["dflash"]
    files = _files(out)
    total = sum(size for _, size, _ in files)
    cfg2 = json.loads((out / "dflash2" / "config.json").read_text())["dflash_config"]
    tf = lambda d: d["heldout_teacher_forced"]  # noqa: E731
    pos = lambda d: ", ".join(f"{x:.2f}" for x in tf(d)["per_position_acceptance"])  # noqa: E731
    sim = lambda d: d["simulated_decode"]  # noqa: E731
    t = results["timings"]
    lines = [
        "# Embedded default: a small code target with DFlash2 and DFlash drafts",
        "",
        "A real (trained, not random) speculative-decoding pair small enough to ship inside the",
        "package: a 4-layer Qwen3 target trained from scratch on the Python standard library, and",
        "two block-diffusion drafts trained by self-distillation on the target's own greedy",
        "continuations. It is a test and demo asset: it writes plausible-looking Python, nothing more.",
        "",
        "## Contents",
        "",
        "| path | bytes | sha256 |",
        "|---|---|---|",
        *[f"| `{name}` | {size:,} | `{digest[:16]}…` |" for name, size, digest in files],
        f"| **total** | **{total:,}** | |",
        "",
        "- `target/`: `Qwen3ForCausalLM`, 4 layers, hidden 256, 8 query / 4 KV heads, head_dim 32,",
        "  intermediate 768, tied embeddings, RoPE theta 10000, bf16 safetensors.",
        f"  Tokenizer: byte-level BPE, {n_real} tokens ({n_real - 2} learned + `<|endoftext|>` = {eos_id},",
        f"  `<|mask|>` = {mask_id}); `vocab_size` is padded to {results['config']['vocab_size']} (ids >= {n_real}",
        "  are padding and must never be emitted). No chat template (a base code model).",
        f"  `generation_config.json` `eos_token_id` is a list: [{eos_id}].",
        "- `dflash2/`: `DFlash2DraftModel`, 2 layers (hidden 256, 8 / 4 heads, head_dim 32,",
        "  intermediate 512 — narrower than the target's 768), block size 8, full non-causal",
        f"  attention. dflash_config: `{json.dumps(cfg2, sort_keys=True)}`.",
        "- `dflash/`: `DFlashDraftModel`, the same shape without conv and selector; its config uses",
        "  the older published v1 spelling (flat `block_size`, flat `rope_theta`).",
        "",
        "Both drafts read taps `target_layer_ids = "
        f"{results['config']['tap_layers']}` (the residual stream after those target layers,",
        "HF `hidden_states[l + 1]`), borrow the target's embedding and (tied) lm_head, and use",
        f"`mask_token_id = {mask_id}`.",
        "",
        "## Data",
        "",
        "The running interpreter's standard library (`sysconfig.get_paths()['stdlib']`, "
        f"Python {platform.python_version()}), `**/*.py` without tests (`test/`, `tests/`,",
        "`idlelib/idle_test/`, `test_*.py`) and without `site-packages`. Split by sha256 of the relative",
        f"path: 5% held out — {c['train_files']} train files ({c['train_tokens']:,} tokens), "
        f"{c['heldout_files']} held-out files ({c['heldout_tokens']:,} tokens).",
        "The held-out files are never seen by the tokenizer, the target or the drafts; the",
        f"{len(results['prompt_files'])} prompts in `bench/data/heldout_prompts.json` come from them (each",
        "starts with a `# file: <path>` comment naming its source; 48-128 tokens each).",
        "",
        "## Recipe",
        "",
        "```",
        "python -m training.train_pair --out dflash2_numba/assets/default",
        "```",
        "",
        f"Seed {results['config']['seed']}, {results['config']['threads']} torch thread(s), torch "
        f"{torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}.",
        "Everything is trained and evaluated in float32; weights are then rounded to bf16 and saved,",
        "and every number below is measured with the rounded (shipped) weights.",
        "",
        f"1. Target: {k['target_steps']} AdamW steps of {k['target_batch']} x {k['seq_len']} tokens "
        f"(peak lr {results['config']['target_lr']:g}, warmup + cosine), next-token CE on the packed train split.",
        f"2. Distillation data: {k['distill_n']} random spans of train files (prompt lengths "
        f"{k['prompt_lengths']}), each continued by {k['distill_new']} greedy target tokens; target",
        "   taps for every position.",
        f"3. Drafts: {k['draft_steps']} AdamW steps each, {k['draft_batch']} sequences x "
        f"{k['draft_anchors']} random anchors per step in the generated region; labels are the",
        "   target's greedy tokens at p+1..p+7; CE weighted exp(-(j-1)/4) per mask row. DFlash2 adds a",
        "   teacher-forced selector CE over the top-16 candidate slots (training/README.md).",
        "",
        "## Results measured in torch (training side)",
        "",
        f"Target held-out loss: {results['target']['heldout_loss']:.3f} nats/token.",
        "",
        "Teacher-forced held-out acceptance length at Q = 8: every anchor in the generated region of",
        f"{k['heldout_n']} held-out sequences ({tf(d2)['blocks']} blocks), context = the target's taps,",
        "acceptance length = leading draft tokens equal to the target's greedy tokens + 1.",
        "DFlash2 drafts with the selector's greedy walk, DFlash with argmax.",
        "",
        "| draft | params | tau (bf16 weights) | tau (f32 weights) | histogram 1..8 | per-position acceptance |",
        "|---|---|---|---|---|---|",
        f"| dflash2 | {d2['params']:,} | **{tf(d2)['tau']:.3f}** | {d2['tau_f32_weights']:.3f} | "
        f"{tf(d2)['histogram']} | {pos(d2)} |",
        f"| dflash | {d1['params']:,} | **{tf(d1)['tau']:.3f}** | {d1['tau_f32_weights']:.3f} | "
        f"{tf(d1)['histogram']} | {pos(d1)} |",
        "",
        f"Simulated greedy speculative decoding (torch, spec §5) of the {sim(d2)['prompts']} held-out",
        f"prompts, max {sim(d2)['max_new_tokens']} new tokens, Q = 8, stop at `<|endoftext|>`:",
        f"DFlash2 tau = {sim(d2)['tau_over_steps']:.3f} over {sim(d2)['steps']} steps; "
        f"DFlash tau = {sim(d1)['tau_over_steps']:.3f} over {sim(d1)['steps']} steps",
        "(per-prompt acceptance lengths in `training/out/results.json` after a run). The replay averages over",
        "steps, which land more often in hard regions than the per-position teacher-forced average.",
        "",
        *_samples(results.get("samples", [])),
        "Wall time on the 2-core development machine (shared): "
        + ", ".join(f"{name[:-2]} {sec / 60:.1f} min" for name, sec in t.items()) + ".",
        "",
        DECODER_SECTION,
    ]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
