"""Self-distillation data: the target's own greedy continuations and its hidden taps.

    sample_prompts(docs, n, lengths, seed)        -> {P: int64 [n_P, P]} random spans of train files
    greedy_continue(model, prompts, n_new, mask)  -> int64 [n, P + n_new] (KV-cached greedy)
    target_taps(model, tokens, layer_ids)         -> f32 [n, T, n_taps * H]
    build_groups(...)                             -> list of Group (one per prompt length)

A draft trained on these learns to predict exactly what it will be asked to predict at
decode time: the target's greedy tokens, from the target's residual stream.
Taps are "the residual stream after target layer l" = HF `hidden_states[l + 1]`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Group:
    """Sequences sharing one prompt length P: tokens [n, T], taps [n, T, n_taps*H], T = P + n_new."""
    prompt_len: int
    tokens: torch.Tensor
    taps: torch.Tensor


def sample_prompts(docs: list[list[int]], n: int, lengths: list[int], seed: int) -> dict[int, torch.Tensor]:
    """n random spans (n/len(lengths) per prompt length) from documents long enough, each
    document picked with probability proportional to its length."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for P in lengths:
        pool = [d for d in docs if len(d) > P]
        weights = torch.tensor([len(d) - P for d in pool], dtype=torch.float64)
        picks = torch.multinomial(weights, n // len(lengths), replacement=True, generator=gen)
        rows = []
        for i in picks.tolist():
            start = int(torch.randint(0, len(pool[i]) - P, (1,), generator=gen))
            rows.append(pool[i][start:start + P])
        out[P] = torch.tensor(rows, dtype=torch.int64)
    return out


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n_new: int, vocab_mask: torch.Tensor) -> torch.Tensor:
    """Greedy decoding with a KV cache; ties -> lowest id (torch.argmax takes the first max);
    padded ids masked to -inf so they are never emitted. prompts [n, P] -> [n, P + n_new]."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prompts, cache=cache, use_cache=True).logits[:, -1]  # [n, V]
    seq = [prompts]
    for _ in range(n_new):
        nxt = torch.argmax(logits + vocab_mask, dim=-1, keepdim=True)  # [n, 1]
        seq.append(nxt)
        logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(seq, dim=1)


@torch.no_grad()
def target_taps(model, tokens: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """tokens [n, T] -> concat(hidden_states[l + 1] for l in ascending layer_ids) [n, T, n_taps*H]."""
    hs = model(input_ids=tokens, output_hidden_states=True).hidden_states
    return torch.cat([hs[l + 1] for l in sorted(layer_ids)], dim=-1)


def build_groups(model, docs: list[list[int]], *, n: int, lengths: list[int], n_new: int,
                 layer_ids: list[int], vocab_mask: torch.Tensor, seed: int, batch: int = 64,
                 log=print) -> list[Group]:
    prompts = sample_prompts(docs, n, lengths, seed)
    groups, t0 = [], time.time()
    for P, rows in prompts.items():
        toks, taps = [], []
        for i in range(0, len(rows), batch):
            seq = greedy_continue(model, rows[i:i + batch], n_new, vocab_mask)
            toks.append(seq)
            taps.append(target_taps(model, seq, layer_ids))
        groups.append(Group(P, torch.cat(toks), torch.cat(taps)))
        log(f"distill: prompt length {P}: {len(rows)} sequences ({time.time() - t0:.0f}s)")
    return groups
