"""Held-out prompts, a torch simulation of greedy speculative decoding, and the cross-check file.

    heldout_prompts(files, tok, n, seed)        -> [{"file", "text"}]   line-aligned code snippets
    simulate_decode(target, draft, embed, ...)   -> acceptance lengths of one greedy run (§5)
    write_crosscheck(path, ...)                  -> the .npz the numpy decoder is checked against

Every prompt string starts with a comment naming its source file (`# file: json/tool.py`), so
`bench/data/heldout_prompts.json` stays a plain list of strings and still says where each
prompt came from.
"""

from __future__ import annotations

import numpy as np
import torch

from .distill import greedy_continue, target_taps
from .draft_model import (DFlashDraft, candidate_values, greedy_walk, mask_logits, selector_scores,
                          top_k_stable, walk_predecessors)


def heldout_prompts(files: list[tuple[str, str]], tok, n: int, seed: int,
                    min_tokens: int = 48, max_tokens: int = 128, per_file: int = 3) -> list[dict]:
    """Up to `per_file` snippets per held-out file: whole lines from a random start line, grown
    until the prompt (header included) has min_tokens..max_tokens tokens."""
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    order = rng.permutation(len(files))
    for round_ in range(per_file):
        for fi in order:
            rel, text = files[fi]
            lines = text.splitlines(keepends=True)
            header = f"# file: {rel}\n"
            for _ in range(10):  # a few tries for a start line that yields a long enough snippet
                start = int(rng.integers(0, max(1, len(lines) - 4)))
                body, n_tok = "", 0
                for line in lines[start:]:
                    cand = body + line
                    n_tok = len(tok.encode(header + cand).ids)
                    if n_tok > max_tokens:
                        break
                    body = cand
                n_tok = len(tok.encode(header + body).ids)
                if min_tokens <= n_tok <= max_tokens and body.strip():
                    out.append({"file": rel, "text": header + body})
                    break
            if len(out) >= n:
                return out
    return out


@torch.no_grad()
def propose(draft: DFlashDraft, taps: torch.Tensor, anchor_pos: int, anchor_id: int,
            embed: torch.Tensor, Q: int) -> dict:
    """One block at anchor position p with context = taps[:p]; Q rows (conv block = Q).
    -> states [Q, H], logits [Q-1, V] (padded -inf), draft ids [Q-1] and for DFlash2 the
    selector's candidates, values, scores [Q-1, K, K] and walk slots."""
    s = draft.spec
    states = draft(taps[None, :anchor_pos], torch.tensor([[anchor_pos]]), torch.tensor([[anchor_id]]),
                   embed, Q)[0, 0]  # [Q, H]
    z = mask_logits(states, embed, s.n_real_vocab)  # [Q-1, V]
    out = {"states": states, "logits": z}
    if s.kind == "dflash":
        out["draft_ids"] = torch.argmax(z, dim=-1)
        return out
    v, ids = top_k_stable(z, s.selector_top_k)  # [k, K]
    u = candidate_values(v, s)
    pred = walk_predecessors(torch.tensor(anchor_id), ids)  # [k, K]
    S = selector_scores(draft.candidate_selector, states[1:], ids, u, pred)  # [k, K, K]
    d, slots = greedy_walk(S, ids)
    out.update(cand_ids=ids, cand_values=u, scores=S, draft_ids=d, slots=slots)
    return out


@torch.no_grad()
def greedy_reference(target, prompt_ids: list[int], max_new: int, stop_ids: set[int],
                     layer_ids: list[int], vocab_mask: torch.Tensor):
    """The target's greedy output for a prompt (what greedy speculative decoding must emit),
    truncated at the first stop token (inclusive), and the taps of prompt + output.
    -> full ids [n + n_gen], taps [n + n_gen, n_taps * H]."""
    n = len(prompt_ids)
    full = greedy_continue(target, torch.tensor([prompt_ids]), max_new, vocab_mask)[0]  # [n + max_new]
    gen = full[n:].tolist()
    for i, t in enumerate(gen):
        if t in stop_ids:
            full = full[:n + i + 1]
            break
    return full, target_taps(target, full[None], layer_ids)[0]


@torch.no_grad()
def simulate_decode(draft: DFlashDraft, embed: torch.Tensor, full: torch.Tensor, taps: torch.Tensor,
                    n: int, max_new: int, Q: int) -> dict:
    """Greedy speculative decoding of one prompt (spec §5), replayed against the known output.

    full = prompt (n ids) + the target's greedy output (see greedy_reference). From start = n
    (the first generated token is the first anchor): rows Bv = min(Q, n + max_new - start); the
    draft proposes Bv-1 tokens with conv block length Bv over context taps[:start]; a = leading
    matches with the greedy tokens, capped so nothing past the last output token is counted;
    acceptance length a+1; start += a+1; until the output is complete."""
    T = len(full)
    lengths, start = [], n
    while start < T - 1:  # tokens up to `start` are committed; more remain
        Bv = min(Q, n + max_new - start)
        d = propose(draft, taps, start, int(full[start]), embed, Bv)["draft_ids"].tolist()
        a = 0
        while a < len(d) and start + 1 + a < T and d[a] == int(full[start + 1 + a]):
            a += 1
        a = min(a, T - 1 - start - 1)  # the last committed token is always the target's own
        lengths.append(a + 1)
        start += a + 1
    return {"n_prompt": n, "n_generated": T - n, "acceptance_lengths": lengths,
            "tau": float(np.mean(lengths)) if lengths else float("nan")}


@torch.no_grad()
def write_crosscheck(path, target, drafts: dict[str, DFlashDraft], embed: torch.Tensor,
                     prompt_ids: list[int], max_new: int, anchors_after: list[int], Qs: list[int],
                     vocab_mask: torch.Tensor) -> None:
    """One held-out sequence: target logits and taps for every position, and for each anchor
    and runtime Q each draft's block outputs. Layout documented in training/README.md."""
    n = len(prompt_ids)
    full = greedy_continue(target, torch.tensor([prompt_ids]), max_new, vocab_mask)[0]
    out = target(input_ids=full[None], output_hidden_states=True)
    spec = next(iter(drafts.values())).spec
    taps = torch.cat([out.hidden_states[l + 1] for l in sorted(spec.target_layer_ids)], dim=-1)[0]
    arrays = {
        "input_ids": full.numpy().astype(np.int64),
        "prompt_len": np.int64(n),
        "target_logits": out.logits[0].float().numpy(),
        "taps": taps.float().numpy(),
        "target_layer_ids": np.array(spec.target_layer_ids, dtype=np.int64),
        "anchors": np.array([n + a for a in anchors_after], dtype=np.int64),
        "Qs": np.array(Qs, dtype=np.int64),
    }
    for kind, draft in drafts.items():
        for Q in Qs:
            rows = [propose(draft, taps, int(p), int(full[p]), embed, Q) for p in arrays["anchors"]]
            for key in rows[0]:
                arrays[f"{kind}_q{Q}_{key}"] = np.stack([r[key].numpy() for r in rows])
    np.savez_compressed(path, **arrays)
