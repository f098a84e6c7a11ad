"""Qwen3.5-MoE targets (families/qwen3_5_moe.py): the Gated-DeltaNet hybrid with routed experts
(always renormalised) and a sigmoid-gated shared expert, against transformers 5.x.

Oracle: a tiny Qwen3_5MoeForConditionalGeneration (vision tower included and ignored by name,
8 experts top-2, shared expert of width 96) saved by transformers (per-expert names) and the
same weights rewritten into the Hub's fused layout; transformers runs it in f32 with the eager
experts. Measured: max|diff| 6.6e-6 of max|logit| in both layouts (bound 1e-4).

Mutations tried (each red here; docs/moe.md): the shared-expert gate dropped (sigmoid(.) -> 1)
and the shared expert dropped: every logits test red; renormalisation ignored: red.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_fixtures import build_qwen3_5_moe, hf_greedy, hf_logits, load_hf

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.errors import UnsupportedConfigError
from dflash2_numba.families.qwen3_5 import resolve_qwen3_5_config
from dflash2_numba.families.qwen3_5_moe import Qwen3_5MoeModel, resolve_qwen3_5_moe_config
from test_moe import _prompt, _run_blocks, assert_speculation_lossless, speculative_sampling_pvalue

F32_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import Qwen3_5MoeForConditionalGeneration

    d = build_qwen3_5_moe(tmp_path_factory.mktemp("q35moe"))  # .../fused, beside .../per-expert
    return {"fused": d, "per-expert": d.parent / "per-expert"}, load_hf(d.parent / "per-expert",
                                                                         Qwen3_5MoeForConditionalGeneration)


@pytest.mark.parametrize("layout", ["fused", "per-expert"])
def test_logits_match_hf(model, layout):
    dirs, hf = model
    ids = _prompt()
    ref = hf_logits(hf, ids)
    target = dn.load_target(dirs[layout])
    assert isinstance(target, Qwen3_5MoeModel)
    ours = _run_blocks(target, ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"{layout}: max rel diff {rel:.2e}")
    assert rel <= F32_TOL


def test_greedy_identical_to_hf(model):
    dirs, hf = model
    prompt = [int(x) for x in _prompt(12, seed=5)]
    want = hf_greedy(hf, prompt, 16)
    r = dn.generate(dn.load_target(dirs["fused"]), None, prompt_ids=prompt, max_new_tokens=16)
    assert r.output_ids == want[:len(r.output_ids)] and (len(r.output_ids) == 16 or r.finish_reason == "stop")


@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_verify_rows_equal_single_steps_bitwise(model, quantize):
    dirs, _ = model
    target = dn.load_target(dirs["fused"], quantize=quantize)
    ids = _prompt(28, seed=7)
    cache = target.new_cache(64)
    target.forward(ids[:20], cache)
    block, _ = target.forward(ids[20:28], cache)
    cache.commit(20)
    singles = np.concatenate([target.forward(ids[i:i + 1], cache)[0] for i in range(20, 28)])
    assert np.array_equal(block, singles)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_speculative_greedy_equals_target_only(model, tmp_path, kind):
    dirs, _ = model
    target = dn.load_target(dirs["fused"])
    draft = dn.load_draft(tiny.write_draft(tmp_path / kind, dirs["fused"], kind=kind, block_size=8, seed=3,
                                           intermediate_size=128, mask_token_id=255), target)
    assert_speculation_lossless(target, draft)


def test_sampling_chi_square(model, tmp_path):
    dirs, _ = model
    target = dn.load_target(dirs["fused"])
    draft = dn.load_draft(tiny.write_draft(tmp_path / "d2", dirs["fused"], kind="dflash2", block_size=4, seed=1,
                                           intermediate_size=128, mask_token_id=255), target)
    assert speculative_sampling_pvalue(target, draft) > 1e-3


def test_config_spellings_and_the_dense_family_refusal(model):
    import json

    dirs, _ = model
    raw = json.loads((dirs["fused"] / "config.json").read_text())
    c = resolve_qwen3_5_moe_config(raw)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == \
        (8, 2, 64, 96)
    assert c.prefix == "model.language_model."
    flat = dict(raw["text_config"], architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
    assert resolve_qwen3_5_moe_config(flat).prefix == "model."
    dense = dict(flat, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", intermediate_size=64)
    with pytest.raises(UnsupportedConfigError, match="qwen3_5_moe"):
        resolve_qwen3_5_config(dense)  # a dense config carrying experts is refused, never half-built
