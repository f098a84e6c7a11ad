"""gpt-oss targets (families/gpt_oss.py, quant/mxfp4.py, models/rope.py, the attention sinks of
kernels/attention.py) against transformers 5.x, and the lossless loop on them.

Oracle: tests/gpt_oss_fixtures.py's tiny GptOssForCausalLM written by transformers (f32) and the
same model in the Hub's MXFP4 layout (transformers dequantizes it itself), both run by
transformers in f32 with the eager experts and attention. Measured: max|diff| ~2.5e-6 (f32) /
~2.0e-6 (MXFP4) of max|logit| (bound 1e-4). The mutations tried are listed in docs/gpt_oss.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpt_oss_fixtures import build_gpt_oss, load_hf, to_mxfp4_layout, torch
from moe_fixtures import hf_logits
from test_moe import (_prompt, assert_greedy_matches_hf, assert_logits_match, assert_speculation_lossless,
                      speculative_sampling_pvalue)

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.errors import StoredFormatError, UnsupportedConfigError
from dflash2_numba.families.gpt_oss import GptOssModel, glu, resolve_gpt_oss_config
from dflash2_numba.kernels.routing import route_topk_softmax, route_topk_softmax_reference
from dflash2_numba.models.rope import resolve_rope_scaling, rope_frequencies
from dflash2_numba.quant import mxfp4

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = build_gpt_oss(tmp_path_factory.mktemp("gpt-oss-f32"))
    m = to_mxfp4_layout(d, tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    return {"f32": (d, load_hf(d)), "mxfp4": (m, load_hf(m))}


# ---------------------------------------------------------------- the model against transformers
@pytest.mark.parametrize("case", ["f32", "mxfp4"])
def test_logits_match_hf_every_position(models, case):
    """30 positions (> sliding_window 8, > YaRN's original 16), cut into prefill / decode / verify."""
    d, hf = models[case]
    target = dn.load_target(d)
    assert isinstance(target, GptOssModel)
    assert_logits_match(target, hf, _prompt(), case)


def test_long_prefill_matches_hf(models):
    """A 40-row prefill (> 32 rows: BLAS products for the dense weights) is the same model."""
    d, hf = models["mxfp4"]
    assert_logits_match(dn.load_target(d), hf, _prompt(44, seed=3), "long prefill", cuts=(40, 44))


@pytest.mark.parametrize("case", ["f32", "mxfp4"])
def test_greedy_identical_to_hf(models, case):
    d, hf = models[case]
    assert_greedy_matches_hf(dn.load_target(d), hf)


def test_the_clamp_fires(models):
    """The fixture exercises the clamp: expert gate pre-activations above +limit AND below -limit."""
    _, hf = models["f32"]
    seen = []
    experts = [layer.mlp.experts for layer in hf.model.layers]
    hooks = [e.register_forward_hook(lambda mod, args, out: seen.append(args)) for e in experts]
    try:
        hf_logits(hf, _prompt())
    finally:
        for h in hooks:
            h.remove()
    gates = []
    for (x, ids, _w), e in zip(seen, experts):
        for ex in torch.unique(ids):
            gates.append((x @ e.gate_up_proj[ex] + e.gate_up_proj_bias[ex])[..., ::2].detach().numpy().ravel())
    g = np.concatenate(gates)
    assert (g > 7.0).sum() > 10 and (g < -7.0).sum() > 10, ((g > 7).sum(), (g < -7).sum())


@pytest.mark.parametrize("case,quantize", [("mxfp4", None), ("f32", "q8_0"), ("f32", "q4_0"), ("mxfp4", "q8_0")])
def test_verify_rows_equal_single_steps_bitwise(models, case, quantize):
    """A Q-row verify gives, bit for bit, the logits of Q one-row steps (every kernel is row-invariant:
    MXFP4, bf16 panels, q8_0 / q4_0). Not asserted for f32-STORED weights: their plain f32 GEMV
    (kernels/linear.py, every family) groups rows 8 / 4 / 1 with different vector reductions."""
    d, _ = models[case]
    target = dn.load_target(d, quantize=quantize)
    ids = _prompt(28, seed=7)
    cache = target.new_cache(64)
    target.forward(ids[:20], cache)
    block, _ = target.forward(ids[20:28], cache)  # one 8-row verify
    cache.commit(20)
    singles = np.concatenate([target.forward(ids[i:i + 1], cache)[0] for i in range(20, 28)])
    assert np.array_equal(block, singles)


def test_quantize_applies_to_the_bf16_layout(models):
    """--quantize q8_0 re-quantizes the bf16 re-upload's experts; the MXFP4 ones stay as stored."""
    from dflash2_numba.quant.stored import StoredWeight
    from dflash2_numba.quant.weights import QuantizedWeight

    assert isinstance(dn.load_target(models["f32"][0], quantize="q8_0").layers[0]["gate_up"][0], QuantizedWeight)
    assert isinstance(dn.load_target(models["mxfp4"][0], quantize="q8_0").layers[0]["gate_up"][0], StoredWeight)


# ---------------------------------------------------------------- speculative decoding
def _draft_with_bias_and_yarn(target_dir: Path, path: Path, kind: str, block_size: int = 8) -> Path:
    """A random DFlash / DFlash2 draft with attention_bias (q/k/v/o biases drawn) and YaRN."""
    from dflash2_numba.checkpoint import open_checkpoint
    from dflash2_numba.numerics import f32_to_bf16_array

    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 8}
    d = tiny.write_draft(path, target_dir, kind=kind, block_size=block_size, seed=3, mask_token_id=255,
                         extra_config={"attention_bias": True, "rope_theta": 10000.0,
                                       "rope_parameters": {**rope, "rope_theta": 10000.0}})
    ck = open_checkpoint(d)
    tensors = {n: np.array(ck.get(n)) for n in ck.names()}
    rng = np.random.default_rng(11)
    for n in list(tensors):
        if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            tensors[n[:-len("weight")] + "bias"] = f32_to_bf16_array(0.5 * rng.standard_normal(tensors[n].shape[0]))
    del ck
    tiny.save_safetensors(d / "model.safetensors", tensors)
    return d


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_draft_with_bias_and_yarn_matches_reference(models, tmp_path, kind):
    """The draft's block states against tests/draft_reference.py (float64, biases, transformers' YaRN)."""
    from draft_reference import DraftReference

    d, _ = models["f32"]
    target = dn.load_target(d)
    draft_dir = _draft_with_bias_and_yarn(d, tmp_path / kind, kind)
    draft = dn.load_draft(draft_dir, target)
    assert draft.config.attention_bias and draft.config.rope_scaling is not None
    ids = _prompt(20, seed=2)
    cache = target.new_cache(64)
    _, taps = target.forward(ids[:19], cache, tap_layers=draft.target_layer_ids)
    state = draft.new_state(64)
    draft.extend_context(state, taps, 0, ids[:19])
    got = draft.block_forward([state], [int(ids[19])], [19], 6)
    want, _ = DraftReference(d, draft_dir).forward(taps, int(ids[19]), 6)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("case", ["f32", "mxfp4"])
def test_speculative_greedy_equals_target_only(models, tmp_path, kind, case):
    d, _ = models[case]
    target = dn.load_target(d)
    draft = dn.load_draft(_draft_with_bias_and_yarn(d, tmp_path / kind, kind), target)
    assert_speculation_lossless(target, draft, qs=(2, 4, 8))


def test_sampling_chi_square(models, tmp_path):
    d, _ = models["mxfp4"]
    target = dn.load_target(d)
    draft = dn.load_draft(_draft_with_bias_and_yarn(d, tmp_path / "d2", "dflash2", block_size=4), target)
    assert speculative_sampling_pvalue(target, draft) > 1e-3


# ---------------------------------------------------------------- the pieces against transformers
def test_glu_matches_transformers():
    """Gate values on both sides of +-limit (a lower gate clamp changes gate < -7 by orders of magnitude)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=32, num_local_experts=1))
    gu = np.linspace(-20, 20, 2 * 401, dtype=np.float32).reshape(1, -1)  # [1, 2I] interleaved gate / up
    gu = np.concatenate([gu, gu[:, ::-1].copy()])  # gates and ups swap roles in row 2
    want = experts._apply_gate(torch.from_numpy(gu)).numpy()
    got = glu(gu, 7.0, 1.702)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},  # gpt-oss-20b
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},  # truncate absent: true
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "mscale": 1.0,
     "mscale_all_dim": 0.5},
])
@pytest.mark.parametrize("hd,theta", [(64, 150000.0), (16, 10000.0)])
def test_yarn_matches_transformers(params, hd, theta):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {"hidden_size": 4 * hd, "num_attention_heads": 4, "head_dim": hd, "max_position_embeddings": 131072,
           "rope_parameters": {**params, "rope_theta": theta}}
    want_inv, want_att = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**raw), "cpu")
    scaling = resolve_rope_scaling(raw, "config.json", 131072)
    inv, att = rope_frequencies(hd, theta, scaling)
    np.testing.assert_allclose(inv, want_inv.numpy(), rtol=1e-6)
    assert abs(att - want_att) < 1e-12


def test_router_topk_then_softmax_matches_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    rng = np.random.default_rng(0)
    router = GptOssTopKRouter(GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3))
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((8, 16)).astype(np.float32)))
        router.bias.copy_(torch.from_numpy(rng.standard_normal(8).astype(np.float32)))
    x = rng.standard_normal((40, 16)).astype(np.float32)
    logits, want_w, want_ids = (t.detach().numpy() for t in router(torch.from_numpy(x)))
    ids, w = route_topk_softmax(logits, 3)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    rid, rw = route_topk_softmax_reference(logits, 3)
    assert np.array_equal(ids, rid) and np.allclose(w, rw, rtol=1e-6)


def test_mxfp4_kernel_and_reference():
    """numpy dequantization == transformers' convert_moe_packed_tensors (bit for bit, any byte);
    the kernel == x @ dequantized.T to f32 rounding, and row-invariant."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 48, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 48, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    dense = mxfp4.dequantize_mxfp4(blocks, scales)  # [E, N, K]
    assert np.array_equal(dense, want.numpy().transpose(0, 2, 1))
    w = mxfp4.Mxfp4Experts(blocks, scales).expert(2)
    x = rng.standard_normal((7, 128)).astype(np.float32)
    for parallel in (False, True):
        y = mxfp4.matmul_mxfp4(w.arrays, x, np.empty((7, 48), np.float32), parallel)
        np.testing.assert_allclose(y, x @ dense[2].T, rtol=1e-5, atol=1e-5 * np.abs(y).max())
        rows = [mxfp4.matmul_mxfp4(w.arrays, x[i:i + 1], np.empty((1, 48), np.float32), parallel) for i in range(7)]
        assert np.array_equal(y, np.concatenate(rows))
    again = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(dense))
    assert np.array_equal(again, dense)  # MXFP4 values survive a requantization


def test_sink_attention_matches_transformers_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from dflash2_numba.kernels.attention import attention, attention_reference

    rng = np.random.default_rng(1)
    nq, nh, nkv, hd, T, W = 6, 4, 2, 16, 20, 5
    q = rng.standard_normal((nq, nh, hd)).astype(np.float32)
    k, v = (rng.standard_normal((nkv, T, hd)).astype(np.float32) for _ in range(2))
    sinks = (3 * rng.standard_normal(nh)).astype(np.float32)
    q_pos, k_pos = np.arange(T - nq, T), np.arange(T)
    d = q_pos[:, None] - k_pos[None]
    mask = np.where((d >= 0) & (d < W), 0.0, -np.inf).astype(np.float32)

    class Mod:
        num_key_value_groups, training = nh // nkv, False
    Mod.sinks = torch.from_numpy(sinks)
    want, _ = eager_attention_forward(Mod, torch.from_numpy(q.transpose(1, 0, 2))[None], torch.from_numpy(k)[None],
                                      torch.from_numpy(v)[None], torch.from_numpy(mask)[None, None], hd ** -0.5)
    want = want[0].numpy()  # [nq, nh, hd]
    for fn in (attention, attention_reference):
        got = fn(q, k, v, q_pos, k_pos, True, W, False, sinks=sinks)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------- config, inventory, refusals
def test_config_defaults_as_transformers():
    """layer_types, sliding_window, YaRN and theta default as GptOssConfig's do."""
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 256, "num_local_experts": 8, "num_experts_per_tok": 2}
    c = resolve_gpt_oss_config(raw)
    assert c.layer_window == (128, None, 128, None) and c.rope_theta == 150000.0
    assert c.rope_scaling.factor == 32.0 and c.rope_scaling.truncate is False
    assert c.rope_scaling.original_max_position_embeddings == 4096
    with pytest.raises(UnsupportedConfigError, match="longrope"):
        resolve_gpt_oss_config({**raw, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_real_config_resolves():
    c = resolve_gpt_oss_config(json.loads((DATA / "gpt-oss-20b.config.json").read_text()))
    assert (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, c.hidden_size) == (32, 4, 2880, 2880)
    assert c.layer_window[:2] == (128, None) and c.rope_scaling.truncate is False


def test_blocks_without_scales_refused(models, tmp_path):
    from dflash2_numba.checkpoint import open_checkpoint

    src = models["mxfp4"][0]
    ck = open_checkpoint(src)
    tensors = {n: np.array(ck.get_raw(n)) for n in ck.raw_tensors if n != "model.layers.1.mlp.experts.down_proj_scales"}
    tiny.save_safetensors(tmp_path / "model.safetensors", tensors, dtypes={n: "U8" for n in tensors
                                                                            if tensors[n].dtype == np.uint8})
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(StoredFormatError, match=r"down_proj_blocks' has no 'model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        dn.load_target(tmp_path)


def test_inspect_reports_resident_and_active_bytes(models):
    """inspect's resident bytes (as stored) and bytes read per token, against a count made here
    from the file's own tensors: resident = MXFP4 blocks + scales as stored, other matrices at 2
    bytes (bf16 panels), 1-D tensors f32, the untied embedding not at all (rows read on demand);
    per token = every non-expert matrix, k/E of the experts, one embedding row."""
    from dflash2_numba.checkpoint import open_checkpoint
    from dflash2_numba.inspect_model import format_inspect, inspect_model

    d = models["mxfp4"][0]
    report = inspect_model(d, hash_files=False)
    raw = open_checkpoint(d).raw_tensors
    E, k, H = 8, 2, 64
    resident = read = 0.0
    for n, t in raw.items():
        size, nb = int(np.prod(t.shape)), t.end - t.begin
        if n.endswith(("_blocks", "_scales")):
            resident, read = resident + nb, read + nb * k / E
        elif "embed_tokens" in n:
            read += 2 * H
        elif len(t.shape) == 1:
            resident, read = resident + 4 * size, read + 4 * size
        else:  # matrices, and the 2-D expert biases [E, out] (k/E of them read)
            share = k / E if ".experts." in n else 1.0
            resident, read = resident + 2 * size, read + 2 * size * share
    assert abs(report["resident_bytes"]["stored"] / resident - 1) < 1e-6, (report["resident_bytes"], resident)
    assert abs(report["bytes_read_per_token"]["mxfp4 (as stored)"] / read - 1) < 1e-6, (report["bytes_read_per_token"], read)
    text = format_inspect(report)
    assert "mixture of experts: 8 experts, 2 per token" in text and "mxfp4 (as stored)" in text


# ---------------------------------------------------------------- the published draft
def test_published_draft_config_resolves():
    """z-lab/gpt-oss-20b-DFlash's config.json as published: block_size at the top level,
    mask_token_id / taps nested, attention_bias, model_type gpt_oss and no RoPE object (so
    transformers' GptOssConfig supplies YaRN: the inverse frequencies must be its own)."""
    from draft_reference import hf_yarn

    from dflash2_numba.config import check_pairing, resolve_draft_config
    from dflash2_numba.inventory import expected_draft_tensors

    raw = json.loads((DATA / "gpt-oss-20b-dflash.config.json").read_text())
    target = resolve_gpt_oss_config(json.loads((DATA / "gpt-oss-20b.config.json").read_text()))
    c = resolve_draft_config(raw, target)
    assert (c.kind, c.block_size, c.mask_token_id, c.target_layer_ids) == ("dflash", 8, 200000, [1, 6, 11, 16, 21])
    assert c.attention_bias and (c.hidden_size, c.num_hidden_layers, c.head_dim) == (2880, 8, 64)
    check_pairing(c, target)
    inv, att = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
    want_inv, want_att = hf_yarn(raw)
    np.testing.assert_allclose(inv, want_inv, rtol=1e-6)
    assert abs(att - want_att) < 1e-12
    assert "layers.7.self_attn.o_proj.bias" in expected_draft_tensors(c, target.vocab_size)


def test_published_draft_layout_loads_and_is_lossless(models, tmp_path):
    """A tiny draft spelled like the published one (the keys above, no RoPE object) loads
    unchanged, matches the float64 reference and keeps speculation lossless."""
    from draft_reference import DraftReference

    d, _ = models["mxfp4"]
    draft_dir = _draft_with_bias_and_yarn(d, tmp_path / "published", "dflash")
    cfg = json.loads((draft_dir / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        cfg.pop(key, None)
    cfg["block_size"] = cfg["dflash_config"].pop("block_size")
    cfg.update(model_type="gpt_oss", attention_bias=True, rope_theta=150000)
    (draft_dir / "config.json").write_text(json.dumps(cfg))
    target = dn.load_target(d)
    draft = dn.load_draft(draft_dir, target)
    assert draft.config.rope_scaling.factor == 32.0 and draft.config.rope_scaling.truncate is False
    ids = _prompt(20, seed=4)
    _, taps = target.forward(ids[:19], target.new_cache(64), tap_layers=draft.target_layer_ids)
    state = draft.new_state(64)
    draft.extend_context(state, taps, 0, ids[:19])
    got = draft.block_forward([state], [int(ids[19])], [19], 8)
    want, _ = DraftReference(d, draft_dir).forward(taps, int(ids[19]), 8)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert_speculation_lossless(target, draft, qs=(2, 8))


def test_mxfp4_module_listed_as_not_converted_refused(models, tmp_path):
    src = models["mxfp4"][0]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.*.mlp.experts")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StoredFormatError, match=r"module 'model\.layers\.0\.mlp\.experts' is in .*modules_to_not_convert"):
        dn.load_target(tmp_path)
