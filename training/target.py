"""The target: a small `transformers.Qwen3ForCausalLM` trained from scratch on the train split.

    target_config(vocab_size, eos_id)      -> Qwen3Config
    pack_documents(docs, eos_id)           -> 1-D int64 tensor (documents joined by <|endoftext|>)
    train_target(model, stream, ...)       AdamW, warmup + cosine, fixed step count
    round_to_bf16_(model)                  weights -> bf16 -> f32 in place (what the decoder will read)
    save_target(model, dir, eos_id)        bf16 safetensors, config.json, generation_config.json
    greedy_logits_mask(V, n_real)          -inf on padded vocab ids (never emitted)

Everything after training (distillation data, evaluation, cross-check files) uses the
bf16-rounded weights in float32, which is what the project's decoder computes with.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32)
ROPE_THETA = 10000.0
MAX_POSITIONS = 2048


def target_config(vocab_size: int, eos_id: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size, **TARGET_SHAPE,
        max_position_embeddings=MAX_POSITIONS, max_window_layers=TARGET_SHAPE["num_hidden_layers"],
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_theta": ROPE_THETA, "rope_type": "default"},
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=None,
        attention_bias=False, use_sliding_window=False, sliding_window=None,
    )


def pack_documents(docs: list[list[int]], eos_id: int) -> torch.Tensor:
    """[d0 ..., eos, d1 ..., eos, ...] as one int64 stream."""
    flat: list[int] = []
    for ids in docs:
        flat.extend(ids)
        flat.append(eos_id)
    return torch.tensor(flat, dtype=torch.int64)


def padded_vocab_mask(vocab_size: int, n_real: int) -> torch.Tensor:
    """[V] additive mask: 0 for ids the tokenizer knows, -inf for the padding ids."""
    mask = torch.zeros(vocab_size)
    mask[n_real:] = float("-inf")
    return mask


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine to 10% of peak


def train_target(model: Qwen3ForCausalLM, stream: torch.Tensor, *, steps: int, batch: int,
                 seq_len: int, lr: float, seed: int, log=print) -> list[float]:
    """Next-token CE on random windows of the packed stream. Returns the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    model.train()
    losses, t0 = [], time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])  # [b, T+1]
        logits = model(input_ids=x[:, :-1]).logits  # [b, T, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            avg = sum(losses[-25:]) / len(losses[-25:])
            log(f"target step {step}/{steps} loss {avg:.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    return losses


@torch.no_grad()
def round_to_bf16_(model: torch.nn.Module) -> None:
    """Round every parameter to bf16 and back, in place: the f32 model now computes with
    exactly the weights the saved bf16 checkpoint holds."""
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))


@torch.no_grad()
def eval_loss(model: Qwen3ForCausalLM, stream: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean next-token CE over consecutive windows of a held-out stream (nats/token)."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    total = 0.0
    for i in range(n):
        x = stream[i * seq_len:(i + 1) * seq_len + 1][None]
        logits = model(input_ids=x[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits[0], x[0, 1:]).item()
    return total / max(1, n)


def save_target(model: Qwen3ForCausalLM, out_dir: Path, eos_id: int) -> None:
    """bf16 safetensors + a standard Qwen3 config.json + generation_config.json (eos as a list)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = Qwen3ForCausalLM(model.config)
    bf16.load_state_dict(model.state_dict())
    bf16.to(torch.bfloat16)
    bf16.config.use_cache = True
    bf16.save_pretrained(out_dir, safe_serialization=True)
    # rewrite generation_config.json ourselves: eos as a LIST, greedy, no transformers extras
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos_id], "pad_token_id": eos_id, "do_sample": False}, indent=2) + "\n")
    cfg = json.loads((out_dir / "config.json").read_text())
    allowed = {
        "architectures", "attention_bias", "attention_dropout", "bos_token_id", "dtype", "eos_token_id",
        "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "layer_types",
        "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads",
        "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps", "rope_parameters",
        "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
        "use_sliding_window", "vocab_size",
    }
    extra = sorted(set(cfg) - allowed)
    if extra:
        raise RuntimeError(f"{out_dir / 'config.json'}: unexpected non-standard keys {extra}")
    if cfg.get("architectures") != ["Qwen3ForCausalLM"] or cfg.get("model_type") != "qwen3":
        raise RuntimeError(f"{out_dir / 'config.json'}: not a Qwen3ForCausalLM config: {cfg}")
