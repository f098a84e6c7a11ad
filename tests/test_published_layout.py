"""A scaled-down copy of a PUBLISHED DFlash2 checkpoint (z-lab/Muse-Glimmer-30B-DFlash2, header
and config.json in tests/data/) through the production loader and the decode loop.

The config is the published config.json with only the sizes shrunk (every other key, nested
spelling and scalar kept as published: rope_parameters only, is_causal false, five sliding
layers, taps 2, group 16, block 16, output_multiplier, final_logit_softcapping). The weights are
written by tiny.write_draft; their names must equal the published header's, and every shape must
be the published shape with each size mapped to its scaled value.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.models.dflash2 import DFlash2Draft
from dflash2_numba.models.selector import CandidateSelector

DATA = Path(__file__).parent / "data"
HEADER = json.loads((DATA / "muse-glimmer-30b-dflash2.safetensors-header.json").read_text())
CONFIG = json.loads((DATA / "muse-glimmer-30b-dflash2.config.json").read_text())

# the scaled model: H 6656 -> 64, I 19968 -> 96, 32 x 128 query heads -> 4 x 32, 8 -> 1 KV heads
# (GQA 4:1 and nh*hd != H as published), r 256 -> 8; 5 layers, 5 taps of an 8-layer target
H, I, NH, NKV, HD, R, WINDOW = 64, 96, 4, 1, 32, 8, 4
TAP_IDS = [1, 2, 3, 5, 6]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("published")
    target_dir = tiny.write_target(tmp / "target", hidden_size=H, intermediate_size=128,
                                   num_hidden_layers=8, seed=7, init_std=0.3)
    V = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    dc = CONFIG["dflash_config"]
    draft_dir = tiny.write_draft(
        tmp / "draft", target_dir, kind="dflash2", num_hidden_layers=CONFIG["num_hidden_layers"],
        block_size=dc["block_size"], target_layer_ids=TAP_IDS, num_attention_heads=NH,
        num_key_value_heads=NKV, head_dim=HD, intermediate_size=I,
        conv_kernel_size=dc["conv_kernel_size"], conv_group_size=dc["conv_group_size"],
        selector_rank=R, selector_top_k=dc["selector_top_k"], seed=8, init_std=0.2)
    # config.json: the published file, sizes and token ids replaced, nothing else touched
    tiny_cfg = json.loads((draft_dir / "config.json").read_text())
    cfg = json.loads(json.dumps(CONFIG))
    cfg.update(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
               head_dim=HD, num_target_layers=8, vocab_size=V, sliding_window=WINDOW,
               bos_token_id=tiny_cfg["bos_token_id"], eos_token_id=tiny_cfg["eos_token_id"],
               pad_token_id=tiny_cfg["bos_token_id"])
    cfg["dflash_config"].update(selector_rank=R, target_layer_ids=TAP_IDS,
                                mask_token_id=tiny_cfg["dflash_config"]["mask_token_id"])
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return target_dir, draft_dir, V


def test_names_ranks_and_scaled_shapes_follow_the_published_header(pair):
    _, draft_dir, V = pair
    published = {n: e for n, e in HEADER.items() if n != "__metadata__"}
    ours = open_checkpoint(draft_dir).tensors
    assert set(ours) == set(published) and len(ours) == 81
    taps, G = 2, H // 16
    size_map = {6656: H, 19968: I, 4096: NH * HD, 1024: NKV * HD, 128: HD, 256: R, 202048: V,
                33280: 5 * H, 1664: 2 * taps * G, 2: 2}  # published size -> scaled size
    for name, entry in published.items():
        assert entry["dtype"] == "BF16" and ours[name].dtype == "BF16", name
        assert ours[name].shape == tuple(size_map[s] for s in entry["shape"]), name


def test_published_config_resolves_and_decodes(pair):
    target_dir, draft_dir, _ = pair
    target = dn.load_target(target_dir)
    draft = dn.load_draft(draft_dir, target)
    c = draft.config
    assert isinstance(draft, DFlash2Draft) and isinstance(draft.selector, CandidateSelector)
    assert c.layer_causal == [False] * 5 and c.layer_window == [WINDOW] * 5
    assert c.rope_theta == CONFIG["rope_parameters"]["rope_theta"] and c.rms_norm_eps == 1e-5
    assert c.block_size == 16 and c.conv_kernel_size == 2 and c.conv_groups == H // 16
    assert c.output_multiplier == CONFIG["dflash_config"]["output_multiplier"]
    assert c.final_logit_softcapping == CONFIG["dflash_config"]["final_logit_softcapping"]
    prompt = np.random.default_rng(0).integers(0, target.valid_vocab, 12).tolist()
    ref = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=24)
    for Q in (16, 5):
        out = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=24, block_size=Q)
        assert out.output_ids == ref.output_ids, Q
        assert max(out.stats.block_rows) == Q
