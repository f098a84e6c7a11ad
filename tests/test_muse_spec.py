"""Speculative decoding on a Muse-Glimmer target (tiny, written by transformers): a DFlash2 and a
DFlash v1 draft from the project's writer, and Meta's MuseGlimmerAssistantModel (written by
transformers) checked against HF's own assistant; the published DFlash2 config against the 30B
target config; a scaled published pair through the production loader; lossless sampling; cuda.

Mutations tried (and what went red) are listed in docs/targets/muse_glimmer.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.config import check_pairing, resolve_draft_config
from dflash2_numba.families.muse_glimmer import check_muse_pairing, resolve_muse_config
from dflash2_numba.decode.sampling import SamplingParams
from dflash2_numba.errors import PairingError, UnsupportedConfigError
from dflash2_numba.inspect_model import inspect_model
from dflash2_numba.kernels.cuda_ops import cuda_available
from dflash2_numba.models.draft import DFlashDraft
from dflash2_numba.families.muse_glimmer import MuseGlimmerTarget

from draft_reference import check_greedy_equals_target_only, check_seeded_sampling
from muse_fixtures import (H, MASK_ID, build_muse, hf_assistant, prompt, read_config, write_assistant,
                           write_muse_target)
from test_sampling import exact_sequence_probs, gof_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = Path(__file__).parent / "data"
TAPS = [0, 2]  # sliding layers of the 4-layer target [s, s, s, F]
B = 16  # trained block size of every tiny draft here: runtime Q up to 16


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    root = tmp_path_factory.mktemp("muse_spec")
    target_dir = write_muse_target(root / "target", "f32")
    target = MuseGlimmerTarget.load(target_dir)
    c = target.config
    drafts = {
        "dflash2": tiny.write_draft(root / "dflash2", target_dir, kind="dflash2", block_size=B, mask_token_id=MASK_ID,
                                    target_layer_ids=TAPS, seed=3, init_std=0.3, dtype="f32",
                                    output_multiplier=c.output_multiplier,
                                    final_logit_softcapping=c.final_logit_softcapping),
        "dflash": tiny.write_draft(root / "dflash", target_dir, kind="dflash", block_size=B, mask_token_id=MASK_ID,
                                   target_layer_ids=TAPS, seed=4, init_std=0.3, dtype="f32",
                                   layer_types=["sliding_attention"] * 2, sliding_window=4),
        "assistant": write_assistant(root / "assistant", TAPS, block_size=B, window=4),
    }
    return target_dir, target, {k: dn.load_draft(v, target) for k, v in drafts.items()}, drafts


@pytest.mark.parametrize("kind", ["dflash2", "dflash", "assistant"])
def test_greedy_equals_target_only(muse, kind):
    """Q in {2, 5, 8, 16}, 40 tokens, prompt of 9 > W = 4 (the target's window binds)."""
    _, target, drafts, _ = muse
    check_greedy_equals_target_only(target, drafts[kind], block_sizes=(2, 5, 8, 16), n_new=40)


def test_seeded_sampling_through_each_draft(muse):
    _, target, drafts, _ = muse
    target.tokenizer = None  # no tokenizer: stops are the config's eos ids (none here)
    for draft in drafts.values():
        runs = [dn.generate(target, draft, prompt_ids=[5, 6, 7], max_new_tokens=20, block_size=4,
                            temperature=0.8, top_k=20, seed=11).output_ids for _ in range(2)]
        assert runs[0] == runs[1] and len(runs[0]) == 20


# ---------------------------------------------------------------- Meta's assistant vs HF
def test_assistant_matches_hf(muse):
    """One draft step with a 20-token context (> W = 4: the |q-s| <= W window binds): block
    states, RAW candidate logits (HF: lm_head(out[1:]), no multiplier / softcap) and the greedy
    drafts equal HF's MuseGlimmerAssistantModel driven as DFlashTokenCandidateGenerator drives it."""
    from transformers.cache_utils import DFlashCache

    target_dir, target, drafts, paths = muse
    draft = drafts["assistant"]
    n, anchor = 20, 57
    ids = prompt(n, seed=5)
    _, taps = target.forward(np.array(ids), target.new_cache(n), tap_layers=tuple(TAPS))  # HF hidden_states[l+1]
    state = draft.new_state(n)
    draft.extend_context(state, taps, 0, np.array(ids))
    ours = draft.block_forward([state], [anchor], [n], B)  # [B, H]

    hf = hf_assistant(paths["assistant"])
    noise = torch.from_numpy(target.embed_table[[anchor] + [MASK_ID] * (B - 1)].astype(np.float32))[None]  # raw rows
    cache = DFlashCache(config=hf.config)
    cache.activate_past_recording()
    cache.set_previous_accepted_tokens(n)
    with torch.no_grad():
        ref = hf(noise_embeds=noise, context_hidden_states=torch.from_numpy(taps)[None],
                 position_ids=torch.arange(n + B)[None], attention_mask=torch.ones(1, n + B, dtype=torch.long),
                 cache=cache).last_hidden_state[0].numpy()
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    lm = target.lm_head_w.astype(np.float32)  # [V, H] the target's raw head
    z_ours, z_ref = target.lm_head(ours[1:]), ref[1:] @ lm.T
    z_err = np.max(np.abs(z_ours - z_ref)) / np.max(np.abs(z_ref))
    print(f"assistant vs HF: states {err:.2e}, candidate logits {z_err:.2e}")
    assert err < 1e-5 and z_err < 1e-5
    prop = draft.propose(state, anchor, n, B, SamplingParams(), None)
    assert prop.draft_ids.tolist() == np.argmax(z_ref, -1).tolist()


def test_assistant_config_rules(muse, tmp_path):
    *_, drafts, paths = muse
    c = drafts["assistant"].config
    assert c.architecture == "MuseGlimmerAssistantModel" and c.kind == "dflash"
    assert c.layer_types == ["sliding_attention"] * 2 and "is_causal" not in read_config(paths["assistant"])
    assert c.layer_causal == [False, False]  # the legacy "causal iff sliding" rule must not apply
    assert c.layer_window == [4 + 1] * 2  # HF eager/sdpa: |q - s| <= W; the kernel's window w: <= w - 1
    assert c.context_tensor_names == ("encoder.fc.weight", "encoder.output_norm_enc.weight")
    report = inspect_model(paths["assistant"])  # no num_target_layers in the file: still described
    assert report["kind"] == "dflash" and report["inventory_error"] is None
    raw = read_config(paths["assistant"])
    with pytest.raises(UnsupportedConfigError, match="is_causal = True"):
        resolve_draft_config({**raw, "is_causal": True}, source="assistant")


# ---------------------------------------------------------------- pairing
def _published():
    draft = json.loads((DATA / "muse-glimmer-30b-dflash2.config.json").read_text())
    target = json.loads((DATA / "muse-glimmer-30b.config.json").read_text())
    return draft, target


def test_published_dflash2_pairs_with_the_30b_target():
    draft_raw, target_raw = _published()
    t = resolve_muse_config(target_raw, "muse-30b")
    d = resolve_draft_config(draft_raw, source="dflash2-30b")
    check_pairing(d, t)
    check_muse_pairing(d, t)
    assert all(t.layer_types[i] == "sliding_attention" and i < t.num_hidden_layers - 1 for i in d.target_layer_ids)
    assert d.hidden_size * d.n_taps == 33280 and d.mask_token_id < t.vocab_size
    for key, value in (("output_multiplier", 0.2), ("final_logit_softcapping", 30.0)):
        bad = json.loads(json.dumps(draft_raw))
        bad["dflash_config"][key] = value
        with pytest.raises(PairingError, match=key):
            check_muse_pairing(resolve_draft_config(bad, source="bad"), t)
    with pytest.raises(PairingError, match="num_target_layers 48"):
        check_muse_pairing(resolve_draft_config({**draft_raw, "num_target_layers": 48}, source="bad"), t)


def test_dflash2_with_another_logit_transform_is_refused_at_load(muse, tmp_path):
    target_dir, target, *_ = muse
    d = tiny.write_draft(tmp_path / "d", target_dir, kind="dflash2", block_size=4, mask_token_id=MASK_ID,
                         target_layer_ids=TAPS)  # writer default: output_multiplier 1.0, no softcap
    with pytest.raises(PairingError, match="output_multiplier = 1.0 != target output_multiplier = 0.196"):
        dn.load_draft(d, target)


def test_scaled_published_pair_decodes(tmp_path):
    """The published DFlash2 config.json (sizes shrunk, every other key as published) with a
    scaled release-layout Muse target (8 layers: globals 3 and 7; taps on sliding layers; vision
    tower present), both through api.load_target / api.load_draft; greedy == target-only."""
    draft_raw, _ = _published()
    target_dir = tmp_path / "target"
    build_muse(dict(num_hidden_layers=8), seed=9).save_pretrained(target_dir)
    tiny.train_tiny_tokenizer(290).save(str(target_dir / "tokenizer.json"))
    taps, dc = [0, 1, 2, 4, 5], draft_raw["dflash_config"]
    draft_dir = tiny.write_draft(tmp_path / "draft", target_dir, kind="dflash2", num_hidden_layers=5,
                                 block_size=dc["block_size"], target_layer_ids=taps, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=32, intermediate_size=96, selector_rank=8,
                                 selector_top_k=dc["selector_top_k"], mask_token_id=MASK_ID, seed=8, init_std=0.3)
    cfg = json.loads(json.dumps(draft_raw))
    cfg.update(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
               num_target_layers=8, vocab_size=300, sliding_window=4, bos_token_id=1, eos_token_id=None)
    cfg["dflash_config"].update(selector_rank=8, target_layer_ids=taps, mask_token_id=MASK_ID)
    (draft_dir / "config.json").write_text(json.dumps(cfg))
    target = dn.load_target(target_dir)
    draft = dn.load_draft(draft_dir, target)
    assert isinstance(target, MuseGlimmerTarget) and draft.kind == "dflash2" and target.ignored_tensors
    assert draft.config.output_multiplier == target.config.output_multiplier
    ids = prompt(10, seed=6)
    ref = dn.generate(target, None, prompt_ids=ids, max_new_tokens=24)
    for Q in (16, 5):
        out = dn.generate(target, draft, prompt_ids=ids, max_new_tokens=24, block_size=Q)
        assert out.output_ids == ref.output_ids and max(out.stats.block_rows) == Q


# ---------------------------------------------------------------- lossless sampling
N_SAMPLES, N_NEW, PROMPT, VALID = 1500, 3, [5, 17, 40, 81, 9], 4


@pytest.fixture(scope="module")
def small_vocab_pair(muse, tmp_path_factory):
    """The Muse target with only ids 0..3 valid (the padded-vocabulary mechanism), so that the
    random drafts' q and the target's p share their support: with unrelated top-k supports every
    draft is rejected and even a broken verifier looks lossless."""
    target_dir, _, _, paths = muse
    target = MuseGlimmerTarget.load(target_dir)
    target.valid_vocab = VALID
    c = target.config
    v2 = tiny.write_draft(tmp_path_factory.mktemp("v2") / "d", target_dir, kind="dflash2", block_size=4,
                          mask_token_id=MASK_ID, target_layer_ids=TAPS, selector_top_k=VALID, seed=5, init_std=0.3,
                          output_multiplier=c.output_multiplier, final_logit_softcapping=c.final_logit_softcapping)
    return target, {"dflash2": dn.load_draft(v2, target), "assistant": dn.load_draft(paths["assistant"], target)}


@pytest.mark.parametrize("kind", ["dflash2", "assistant"])
def test_speculative_sampling_matches_exact_distribution(small_vocab_pair, kind):
    """3-token continuations at T 1 over 4 valid ids (64 sequences) of the real Muse target
    (softcapped logits): 1500 speculative samples (prefill token + ONE 3-row step) against the
    exact enumerated distribution, chi-square p > 1e-3 (the method of tests/test_sampling.py);
    some drafts must be accepted, else the check would not exercise the acceptance rule."""
    target, drafts = small_vocab_pair
    exact = exact_sequence_probs(target, PROMPT, N_NEW, SamplingParams(temperature=1.0))
    counts, accepted = {}, 0
    for i in range(N_SAMPLES):
        r = dn.generate(target, drafts[kind], prompt_ids=PROMPT, max_new_tokens=N_NEW, block_size=3,
                        temperature=1.0, seed=i)
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
        accepted += sum(r.stats.acceptance_lengths) - len(r.stats.acceptance_lengths)
    p = gof_pvalue(counts, exact, N_SAMPLES)
    print(f"{kind}: chi-square p = {p:.3g} over {len(exact)} sequences; {accepted / N_SAMPLES:.2f} drafts accepted per step")
    assert p > 1e-3 and accepted > N_SAMPLES / 4


# ---------------------------------------------------------------- device cuda (simulator)
@pytest.fixture
def fast_simulator_switching():
    """As in tests/test_cuda_sim.py: the simulator busy-polls its block threads, and a short GIL
    switch interval makes it ~10x faster. Restored afterwards."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(old)


@pytest.mark.skipif(not (numba.config.ENABLE_CUDASIM or cuda_available()), reason="no CUDA device, no simulator")
def test_muse_decode_on_cuda_equals_cpu(tmp_path, fast_simulator_switching):
    """A 2-layer Muse ([sliding, global], W 2) with a DFlash2 draft: device "cuda" (the simulator
    here) emits the CPU's tokens, which are the target's own greedy tokens."""
    target_dir = tmp_path / "t"
    build_muse(dict(num_hidden_layers=2, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, sliding_window=2), seed=11).save_pretrained(target_dir)
    tiny.train_tiny_tokenizer(290).save(str(target_dir / "tokenizer.json"))
    cfg = read_config(target_dir)["text_config"]
    draft_dir = tiny.write_draft(tmp_path / "d", target_dir, kind="dflash2", num_hidden_layers=1, block_size=4,
                                 conv_group_size=8, target_layer_ids=[0], mask_token_id=MASK_ID, seed=2,
                                 init_std=0.5, output_multiplier=cfg["output_multiplier"],
                                 final_logit_softcapping=cfg["final_logit_softcapping"])
    out = {}
    for device in ("cpu", "cuda"):
        target = dn.load_target(target_dir, device=device)
        draft = dn.load_draft(draft_dir, target)
        assert target.ops.device == device and draft.ops is target.ops
        out[device] = dn.generate(target, draft, prompt_ids=[5, 6, 7], max_new_tokens=6).output_ids
    assert out["cuda"] == out["cpu"] and len(out["cpu"]) == 6
    assert out["cpu"] == dn.generate(dn.load_target(target_dir), None, prompt_ids=[5, 6, 7], max_new_tokens=6).output_ids
