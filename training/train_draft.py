"""Draft training (DFlash v1 and DFlash2) and teacher-forced acceptance evaluation.

Objective, per block (anchor position p in the continuation region, k = Q-1 mask rows):

  L_lm  = sum_j w_j * CE(lm_head(h_j), y_{p+j}) / sum_j w_j        j = 1..k,  w_j = exp(-(j-1)/gamma)
          y = the target's greedy tokens (the distillation labels).
  L_sel = sum_j w_j * [y_{p+j} in top-K] * CE_c(S_tf[j, :], slot of y_{p+j}) / sum (same weights)
          S_tf[j, c] = u_j[c] + sum_r A[y_{p+j-1}, r] * pi_j[r] * Bc[ids_j[c], r]
          i.e. the §4.4 score with the TRUE previous token as predecessor (teacher forcing:
          acceptance only ever counts a walk whose prefix is right, so the true predecessor is
          exactly the one that matters). Rows whose true token is not among the top-K give the
          selector nothing to choose and are skipped.
  DFlash2 loss = L_lm + sel_weight * L_sel.  Gradients of L_sel reach the codebooks, the
  hidden projection, AND the candidate values u (through top-K's values, not its indices):
  u is part of the score the walk maximises, so it is trained for that use; L_lm keeps the
  draft's distribution honest for the top-K itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .distill import Group
from .draft_model import (DFlashDraft, candidate_values, draft_tokens, mask_logits, position_weights,
                          selector_scores)


@dataclass
class DraftTrainConfig:
    steps: int
    batch: int = 16  # sequences per step
    anchors: int = 16  # blocks per sequence
    lr: float = 1e-3
    gamma: float = 4.0
    sel_weight: float = 1.0
    seed: int = 0


def sample_batch(groups: list[Group], batch: int, m: int, Q: int, gen: torch.Generator):
    """One prompt-length group (weighted by size), `batch` sequences, `m` distinct anchors
    each in [P, T-Q] (so every label p+1..p+Q-1 exists and the anchor is a generated token)."""
    sizes = torch.tensor([len(g.tokens) for g in groups], dtype=torch.float64)
    g = groups[int(torch.multinomial(sizes, 1, generator=gen))]
    rows = torch.randint(0, len(g.tokens), (batch,), generator=gen)
    T = g.tokens.shape[1]
    n_choices = T - Q - g.prompt_len + 1
    anchors = torch.stack([torch.randperm(n_choices, generator=gen)[:m] for _ in range(batch)]) + g.prompt_len
    return g.tokens[rows], g.taps[rows], anchors  # [b, T], [b, T, D], [b, m]


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, Q: int) -> torch.Tensor:
    """tokens [b, T], anchors [b, m] -> tokens at p + 0..Q-1: [b, m, Q] (column 0 = anchor)."""
    idx = anchors[:, :, None] + torch.arange(Q)  # [b, m, Q]
    return torch.gather(tokens[:, None, :].expand(-1, anchors.shape[1], -1), 2, idx)


def draft_loss(model: DFlashDraft, tokens, taps, anchors, embed, Q: int, cfg: DraftTrainConfig):
    s = model.spec
    y = block_labels(tokens, anchors, Q)  # [b, m, Q]
    states = model(taps, anchors, y[:, :, 0], embed, Q)  # [b, m, Q, H]
    # padded ids would get -inf anyway: leave them out of the GEMM (same CE, same top-K)
    z = mask_logits(states, embed[:s.n_real_vocab], s.n_real_vocab)  # [b, m, k, V_real]
    labels = y[:, :, 1:]  # [b, m, k]
    w = position_weights(Q - 1, cfg.gamma)  # [k]
    ce = F.cross_entropy(z.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    loss_lm = (ce * w).sum() / (w.sum() * labels.shape[0] * labels.shape[1])
    stats = {"lm": loss_lm.item(), "acc1": (z[:, :, 0].argmax(-1) == labels[:, :, 0]).float().mean().item()}
    loss = loss_lm
    if s.kind == "dflash2":
        v, ids = torch.topk(z, s.selector_top_k, dim=-1)  # [b, m, k, K]
        u = candidate_values(v, s)
        prev = y[:, :, :-1, None]  # true predecessor of each mask row: [b, m, k, 1]
        S = selector_scores(model.candidate_selector, states[:, :, 1:], ids, u, prev)[..., 0, :]  # [b, m, k, K]
        hit = ids == labels[..., None]  # [b, m, k, K]
        has = hit.any(-1).float()  # [b, m, k]
        slot = hit.float().argmax(-1)  # [b, m, k]
        ce_sel = F.cross_entropy(S.flatten(0, 2), slot.flatten(), reduction="none").view(labels.shape)
        ws = w * has
        loss_sel = (ce_sel * ws).sum() / ws.sum().clamp_min(1.0)
        loss = loss + cfg.sel_weight * loss_sel
        stats["sel"] = loss_sel.item()
        stats["topk_cover"] = has.mean().item()
    return loss, stats


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return peak * (0.05 + 0.95 * 0.5 * (1 + torch.cos(torch.tensor(frac * torch.pi)).item()))


def train_draft(model: DFlashDraft, groups: list[Group], embed: torch.Tensor, Q: int,
                cfg: DraftTrainConfig, log=print) -> None:
    gen = torch.Generator().manual_seed(cfg.seed)
    no_decay = ("norm", "base_kernel", "codebook")
    params = list(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in params if not any(t in n for t in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in params if any(t in n for t in no_decay)], "weight_decay": 0.0},
    ], lr=cfg.lr, betas=(0.9, 0.95))
    model.train()
    t0, hist = time.time(), []
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.steps, cfg.lr)
        tokens, taps, anchors = sample_batch(groups, cfg.batch, cfg.anchors, Q, gen)
        loss, stats = draft_loss(model, tokens, taps, anchors, embed, Q, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        hist.append(stats)
        if step % 25 == 0 or step == cfg.steps - 1:
            recent = hist[-25:]
            avg = {k: sum(h[k] for h in recent) / len(recent) for k in recent[0]}
            log(f"{model.spec.kind} step {step}/{cfg.steps} " +
                " ".join(f"{k} {v:.3f}" for k, v in avg.items()) + f" ({time.time() - t0:.0f}s)")
    model.eval()


# ---------------------------------------------------------------- evaluation
def accepted(drafts: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Leading matches: drafts, truth [..., k] -> [...] in 0..k."""
    ok = (drafts == truth).long()
    return torch.cumprod(ok, dim=-1).sum(-1)


@torch.no_grad()
def teacher_forced_tau(model: DFlashDraft, groups: list[Group], embed: torch.Tensor, Q: int,
                       chunk: int = 4) -> dict:
    """Every anchor p in [P, T-Q] of every held-out sequence, context = the true taps < p:
    acceptance length = leading drafts equal to the target's greedy tokens + 1 (the bonus).
    Returns tau (mean), the histogram over 1..Q and the per-position acceptance rate."""
    lengths = []
    for g in groups:
        T = g.tokens.shape[1]
        anchors_row = torch.arange(g.prompt_len, T - Q + 1)
        for i in range(0, len(g.tokens), chunk):
            tok = g.tokens[i:i + chunk]
            anchors = anchors_row.expand(len(tok), -1)
            y = block_labels(tok, anchors, Q)
            states = model(g.taps[i:i + chunk], anchors, y[:, :, 0], embed, Q)
            d = draft_tokens(model, states, y[:, :, 0], embed)
            lengths.append((accepted(d, y[:, :, 1:]) + 1).flatten())
    lengths = torch.cat(lengths)
    hist = torch.bincount(lengths, minlength=Q + 1)[1:]
    per_pos = [(lengths > j).float().mean().item() for j in range(1, Q)]
    return {"tau": lengths.float().mean().item(), "blocks": len(lengths),
            "histogram": hist.tolist(), "per_position_acceptance": per_pos}
