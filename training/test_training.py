"""Checks of the torch draft against docs/spec.md (§2.2, §3, §4). Needs the `train` extra.

    python -m pytest -q training        (~10 s; collected by the README's test command too)

The numpy decoder is cross-checked against this forward (training/out/crosscheck.npz), so the
forward itself is checked here against independent, deliberately naive code: per-row loops for
the conv, one block at a time for the batched attention layout, explicit sums for the selector.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [train] / [test] extra) is not installed")
pytest.importorskip("transformers", reason="transformers (the [train] / [test] extra) is not installed")

from training import corpus  # noqa: E402
from training.draft_model import (DFlashDraft, DraftSpec, candidate_values, dynamic_conv,  # noqa: E402
                                  greedy_walk, mask_logits, rms_norm, selector_scores, top_k_stable,
                                  walk_predecessors)
from training.export import draft_config_json, draft_tensors  # noqa: E402

# the published z-lab Muse-Glimmer DFlash2 config + safetensors header, shipped as test data
REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data"


def spec(kind="dflash2", **kw) -> DraftSpec:
    base = dict(kind=kind, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                rope_theta=10000.0, block_size=4, mask_token_id=60, target_layer_ids=[0, 2],
                num_target_layers=3, vocab_size=64, n_real_vocab=62, conv_kernel_size=2,
                conv_group_size=8, selector_rank=6, selector_top_k=5, input_embedding_scale=2.0,
                output_multiplier=0.5, final_logit_softcapping=3.0)
    base.update(kw)
    return DraftSpec(**base)


def random_draft(s: DraftSpec, seed=0) -> DFlashDraft:
    torch.manual_seed(seed)
    model = DFlashDraft(s)
    with torch.no_grad():  # the identity-conv init would hide conv bugs: randomise everything
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "conv" in name or "norm" in name else 0.05))
    return model.eval()


# ---------------------------------------------------------------- §4.2 conv
def test_conv_hand_cases():
    # block 2, taps 2, base 1, delta 0, x = [10, 20, 30, 40] -> [10, 30, 30, 70]
    x = torch.tensor([[10.0], [20.0], [30.0], [40.0]])
    out = dynamic_conv(x, torch.zeros(4, 2, 1), torch.ones(2, 1), Q=2, S=1)
    assert out[:, 0].tolist() == [10.0, 30.0, 30.0, 70.0]
    # G = 2, S = 2, one tap, base = [1, 2, 3, 4], delta = [10, 100] -> [11, 12, 103, 104]
    out = dynamic_conv(torch.ones(1, 4), torch.tensor([[[10.0, 100.0]]]), torch.tensor([[1.0, 2, 3, 4]]), Q=1, S=2)
    assert out[0].tolist() == [11.0, 12.0, 103.0, 104.0]


@pytest.mark.parametrize("Q,taps", [(4, 2), (3, 3), (5, 2)])
def test_conv_matches_row_loop(Q, taps):
    rng = np.random.default_rng(1)
    N, H, S = 3 * Q, 8, 4
    x, delta = rng.standard_normal((N, H)), rng.standard_normal((N, taps, H // S))
    base = rng.standard_normal((taps, H))
    want = np.zeros((N, H))
    for n in range(N):
        for c in range(H):
            for t in range(taps):
                if n % Q >= t:  # taps never reach into the previous block
                    want[n, c] += (base[t, c] + delta[n, t, c // S]) * x[n - t, c]
    got = dynamic_conv(torch.tensor(x), torch.tensor(delta), torch.tensor(base), Q, S)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- §3 block layout
def test_batched_blocks_equal_one_block_at_a_time():
    """m blocks in one forward (the training layout) == each block alone (the decode layout):
    catches a visibility mask that leaks across blocks and a conv crossing block boundaries."""
    s = spec()
    model = random_draft(s)
    T, Q = 12, 4
    taps = torch.randn(1, T, s.n_taps * s.hidden_size)
    embed = torch.randn(s.vocab_size, s.hidden_size) * 0.5
    anchors = torch.tensor([[3, 7, 8]])
    ids = torch.tensor([[5, 9, 11]])
    with torch.no_grad():
        together = model(taps, anchors, ids, embed, Q)[0]  # [3, Q, H]
        for i in range(3):
            alone = model(taps[:, :anchors[0, i]], anchors[:, i:i + 1], ids[:, i:i + 1], embed, Q)[0, 0]
            torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-5)


def test_context_is_strictly_before_the_anchor():
    s = spec()
    model = random_draft(s)
    T, Q, p = 10, 4, 6
    taps = torch.randn(1, T, s.n_taps * s.hidden_size)
    embed = torch.randn(s.vocab_size, s.hidden_size) * 0.5
    run = lambda t: model(t, torch.tensor([[p]]), torch.tensor([[3]]), embed, Q)  # noqa: E731
    with torch.no_grad():
        ref = run(taps)
        later = taps.clone()
        later[:, p:] += 5.0  # positions >= p (the anchor has no hidden state yet): invisible
        torch.testing.assert_close(run(later), ref)
        earlier = taps.clone()
        earlier[:, p - 1] += 5.0  # the newest committed token is visible
        assert (run(earlier) - ref).abs().max() > 1e-3


def test_single_block_matches_naive_forward():
    """An independent, loop-by-layer rewrite of §3/§4.1 for one block (no batching, explicit
    per-head attention with GQA) gives the module's states."""
    s = spec()
    model = random_draft(s)
    T, Q, p, anchor = 9, 4, 9, 7
    H, nh, nkv, hd = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
    taps = torch.randn(1, T, s.n_taps * H)
    embed = torch.randn(s.vocab_size, H) * 0.5
    with torch.no_grad():
        got = model(taps, torch.tensor([[p]]), torch.tensor([[anchor]]), embed, Q)[0, 0]
        W = dict(model.named_parameters())
        eps = s.rms_norm_eps

        def rope(x, pos):  # x [hd]
            inv = 1.0 / (s.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
            ang = torch.cat([pos * inv, pos * inv])
            rot = torch.cat([-x[hd // 2:], x[:hd // 2]])
            return x * ang.cos() + rot * ang.sin()

        def conv(x, delta, base):  # x [Q, H], delta [Q, 2, G] for taps 2
            out = torch.zeros_like(x)
            for n in range(Q):
                for t in range(2):
                    if n >= t:
                        out[n] += (base[t] + delta[n, t].repeat_interleave(s.conv_group_size)) * x[n - t]
            return out

        d = {k: v.double() for k, v in W.items()}
        c = rms_norm(taps[0].double() @ d["fc.weight"].T, d["hidden_norm.weight"], eps)  # [T, H]
        ids = [anchor] + [s.mask_token_id] * (Q - 1)
        h = embed.double()[ids] * s.input_embedding_scale
        for i in range(s.num_hidden_layers):
            P = f"layers.{i}."
            a = rms_norm(h, d[P + "input_layernorm.weight"], eps)
            dl = (a @ d[P + "attention_conv.kernel_projection.weight"].T).view(Q, 2, 2, -1)
            a = conv(a, dl[:, 0], d[P + "attention_conv.base_kernel"][0])
            kn = lambda x: rms_norm(x, d[P + "self_attn.k_norm.weight"], eps)  # noqa: E731
            qn = lambda x: rms_norm(x, d[P + "self_attn.q_norm.weight"], eps)  # noqa: E731
            ck = (c @ d[P + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
            cv = (c @ d[P + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
            bq = (a @ d[P + "self_attn.q_proj.weight"].T).view(Q, nh, hd)
            bk = (a @ d[P + "self_attn.k_proj.weight"].T).view(Q, nkv, hd)
            bv = (a @ d[P + "self_attn.v_proj.weight"].T).view(Q, nkv, hd)
            o = torch.zeros(Q, nh, hd, dtype=torch.float64)
            for j in range(Q):
                for head in range(nh):
                    kv = head // (nh // nkv)
                    q = rope(qn(bq[j, head]), p + j)
                    keys = [rope(kn(ck[t, kv]), t) for t in range(p)] + [rope(kn(bk[r, kv]), p + r) for r in range(Q)]
                    vals = [cv[t, kv] for t in range(p)] + [bv[r, kv] for r in range(Q)]
                    w = torch.softmax(torch.stack([q @ k for k in keys]) * hd ** -0.5, 0)
                    o[j, head] = sum(wi * vi for wi, vi in zip(w, vals))
            o = o.view(Q, nh * hd) @ d[P + "self_attn.o_proj.weight"].T
            h = h + conv(o, dl[:, 1], d[P + "attention_conv.base_kernel"][1])
            m = rms_norm(h, d[P + "post_attention_layernorm.weight"], eps)
            dm = (m @ d[P + "mlp_conv.kernel_projection.weight"].T).view(Q, 2, 2, -1)
            m = conv(m, dm[:, 0], d[P + "mlp_conv.base_kernel"][0])
            f = (torch.nn.functional.silu(m @ d[P + "mlp.gate_proj.weight"].T) * (m @ d[P + "mlp.up_proj.weight"].T)
                 ) @ d[P + "mlp.down_proj.weight"].T
            h = h + conv(f, dm[:, 1], d[P + "mlp_conv.base_kernel"][1])
        want = rms_norm(h, d["norm.weight"], eps)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- §4.3 / §4.4 selector
def test_selector_scores_and_walk_match_explicit_sums():
    s = spec()
    model = random_draft(s)
    k, K, r = 3, s.selector_top_k, s.selector_rank
    h = torch.randn(k, s.hidden_size)
    z = torch.randn(k, s.vocab_size) * 3
    z[:, s.n_real_vocab:] = float("-inf")
    v, ids = top_k_stable(z, K)
    u = candidate_values(v, s)
    torch.testing.assert_close(u, 3.0 * torch.tanh(v * 0.5 / 3.0))  # multiplier first, then cap
    anchor = 17
    with torch.no_grad():
        S = selector_scores(model.candidate_selector, h, ids, u, walk_predecessors(torch.tensor(anchor), ids))
        A = model.candidate_selector.predecessor_codebook
        B = model.candidate_selector.successor_codebook
        pi = h @ model.candidate_selector.hidden_projection.weight.T
        for l in range(k):
            for a in range(K):
                pred = anchor if l == 0 else int(ids[l - 1, a])
                for c in range(K):
                    want = u[l, c] + sum(A[pred, i] * pi[l, i] * B[ids[l, c], i] for i in range(r))
                    assert abs(float(S[l, a, c] - want)) < 1e-4
    drafts, slots = greedy_walk(S, ids)
    prev = 0
    for l in range(k):  # the walk: argmax along the chain starting from slot 0
        prev = int(np.argmax(S[l, prev].numpy()))
        assert slots[l] == prev and drafts[l] == ids[l, prev]


def test_top_k_ties_lowest_id_and_padding_never_a_candidate():
    s = spec(selector_top_k=4)
    states = torch.zeros(2, s.hidden_size)  # anchor row + one mask row; zero state: all logits tie at 0
    z = mask_logits(states, torch.randn(s.vocab_size, s.hidden_size), s.n_real_vocab)[0]  # [V]
    _, ids = top_k_stable(z, 4)
    assert ids.tolist() == [0, 1, 2, 3]
    assert torch.isinf(z[s.n_real_vocab:]).all()


# ---------------------------------------------------------------- §2 checkpoint layout
def test_tensor_names_follow_the_published_header():
    s = spec(num_hidden_layers=5, target_layer_ids=[0, 1, 2, 3, 4], num_target_layers=8)
    names = set(draft_tensors(DFlashDraft(s)))
    header = REFERENCE / "muse-glimmer-30b-dflash2.safetensors-header.json"
    published = set(json.loads(header.read_text())) - {"__metadata__"}
    assert names == published
    t = draft_tensors(DFlashDraft(s))
    H, G = s.hidden_size, s.hidden_size // s.conv_group_size
    assert t["layers.0.attention_conv.base_kernel"].shape == (2, s.conv_kernel_size, H)
    assert t["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * s.conv_kernel_size * G, H)
    assert t["candidate_selector.predecessor_codebook"].shape == (s.vocab_size, s.selector_rank)
    assert all(v.dtype == torch.bfloat16 for v in t.values())


def test_configs_resolve_in_the_package():
    from dflash2_numba.config import resolve_draft_config
    for kind in ("dflash2", "dflash"):
        s = spec(kind)
        cfg = resolve_draft_config(draft_config_json(s, eos_id=61))
        assert (cfg.kind, cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (kind, 4, 60, [0, 2])
        assert cfg.rope_theta == 10000.0 and cfg.layer_causal == [False, False]
        if kind == "dflash2":
            assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 8, 6, 5)
            assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (2.0, 0.5, 3.0)


def test_split_and_exclusions():
    assert corpus.is_excluded("test/test_os.py") and corpus.is_excluded("ctypes/test/x.py")
    assert corpus.is_excluded("idlelib/idle_test/htest.py") and corpus.is_excluded("unittest/test_x.py")
    assert corpus.is_excluded("site-packages/pip/x.py") and corpus.is_excluded("tkinter/tests/x.py")
    assert not corpus.is_excluded("json/decoder.py") and not corpus.is_excluded("unittest/case.py")
    files = corpus.stdlib_files()
    held = [f for f in files if corpus.split_of(f) == "heldout"]
    assert 0.02 < len(held) / len(files) < 0.09  # ~5% by hash
    assert corpus.split_of("json/tool.py") == corpus.split_of("json/tool.py")


ASSETS = Path(os.environ.get("DFLASH2_TRAIN_ASSETS", Path(__file__).resolve().parent.parent / "dflash2_numba" / "assets" / "default"))


@pytest.mark.skipif(not (ASSETS / "dflash2" / "config.json").exists(), reason="no trained assets yet")
def test_shipped_assets_load_through_the_package():
    """The shipped directories pass the package's own config resolution, pairing checks and
    tensor inventories (names, shapes), and the drafts are bf16."""
    from dflash2_numba.checkpoint import open_checkpoint
    from dflash2_numba.config import check_pairing, load_draft_config
    from dflash2_numba.families.qwen3 import expected_target_tensors, load_target_config
    from dflash2_numba.inventory import expected_draft_tensors
    tcfg = load_target_config(ASSETS / "target")
    tck = open_checkpoint(ASSETS / "target")
    expected = expected_target_tensors(tcfg)
    tck.require(expected, expected.optional)
    gen = json.loads((ASSETS / "target" / "generation_config.json").read_text())
    assert isinstance(gen["eos_token_id"], list)
    assert "chat_template" not in json.loads((ASSETS / "target" / "tokenizer_config.json").read_text())
    for kind in ("dflash2", "dflash"):
        dcfg = load_draft_config(ASSETS / kind, tcfg)
        check_pairing(dcfg, tcfg)
        assert dcfg.kind == kind and dcfg.layer_causal == [False] * dcfg.num_hidden_layers
        ck = open_checkpoint(ASSETS / kind)
        want = expected_draft_tensors(dcfg, tcfg.vocab_size)
        ck.require(want, want.optional)
        assert ck.names() == sorted(want), "extra tensors in the shipped draft"
        assert {ck.info(n).dtype for n in ck.names()} == {"BF16"}
