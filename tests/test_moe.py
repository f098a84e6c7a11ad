"""Qwen3-MoE targets (families/qwen3_moe.py, models/moe.py, kernels/fused_moe.py) against
transformers, and the lossless loop on them.

Oracle: a tiny Qwen3MoeForCausalLM written by transformers 5.x (8 experts, top-2, expert width 32,
layer 1 dense through mlp_only_layers), run by transformers in f32 with the eager experts and
attention on the same (bf16-valued) weights. Ours: the CPU fused engine (bf16 panels) and the
op-by-op path. Measured: max|diff| 3.0e-6 of max|logit| (bound 1e-4).

Mutations tried (each turned this file red; see docs/moe.md):
- renormalisation ignored (`renormalize` forced False) / always applied (forced True):
  test_logits_match_hf[norm] / [no-norm] red (max rel 2e-1 .. 5e-1);
- top-k THEN softmax over the k selected logits (no renormalisation semantics): [no-norm] red;
- gate / up halves swapped in the expert (`gu[:, I:]` as the gate): every logits test red;
- the dense layer (mlp_only_layers) treated as MoE: MissingTensorsError at load (no router);
- experts summed in slot (probability) order instead of ascending id, op by op: test_expert_order_*
  red (0.833 vs 0.0); in the fused kernel (descending id): fused != op-by-op on the top-4 model
  (with k = 2 the order cannot show: a + b == b + a).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_fixtures import build_qwen3_moe, fuse_expert_layout, hf_greedy, hf_logits, load_hf, torch

import dflash2_numba as dn
from dflash2_numba.errors import MissingTensorsError, TensorShapeError, UnknownArchitectureError
from dflash2_numba.families.qwen3_moe import Qwen3MoeModel, resolve_qwen3_moe_config
from dflash2_numba.models import moe as moe_mod
from dflash2_numba.kernels.routing import route, route_reference
from dflash2_numba import tiny

F32_TOL = 1e-4
CASES = {"norm": dict(norm_topk_prob=True), "no-norm": dict(norm_topk_prob=False, seed=1),
         "top4": dict(norm_topk_prob=True, num_experts_per_tok=4, seed=2)}  # k > 2: the summation order shows


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        seed = kw.pop("seed", 0)
        d = build_qwen3_moe(tmp_path_factory.mktemp(f"moe-{name}"), seed=seed, **kw)
        out[name] = (d, load_hf(d))
    fused = fuse_expert_layout(out["norm"][0], tmp_path_factory.mktemp("moe-norm-fused"))
    out["norm-fused-layout"] = (fused, out["norm"][1])
    return out


def _prompt(n=30, seed=0):
    return np.random.default_rng(seed).integers(0, 250, n)


def _run_blocks(target, ids, cuts=(20, 21, 25, 30)):
    """Prefill ids[:cuts[0]], then blocks between the cuts (a one-row decode and a 4-row and
    5-row verify): the logits of every position, stacked."""
    cache, outs, a = target.new_cache(8), [], 0
    for b in cuts:
        logits, _ = target.forward(ids[a:b], cache)
        outs.append(logits)
        a = b
    return np.concatenate(outs)


def assert_logits_match(target, hf, ids, label: str = "", cuts=(20, 21, 25, 30)) -> None:
    """`_run_blocks` of ids against transformers' logits of the whole sequence: max |diff| <=
    F32_TOL of max |logit| at every position."""
    ref = hf_logits(hf, ids)  # [T, V]
    rel = np.abs(_run_blocks(target, ids, cuts) - ref).max() / np.abs(ref).max()
    print(f"{label}: max rel diff {rel:.2e}")
    assert rel <= F32_TOL, (label, rel)


@pytest.mark.parametrize("case", ["norm", "no-norm", "top4", "norm-fused-layout"])
@pytest.mark.parametrize("fused", [True, False])
def test_logits_match_hf(models, case, fused):
    d, hf = models[case]
    target = dn.load_target(d)
    assert isinstance(target, Qwen3MoeModel) and target._fused_layers is not None
    target.fused = fused
    assert_logits_match(target, hf, _prompt(), f"{case} fused={fused}")


def test_long_prefill_blas_path_matches_hf(models):
    """A 40-row prefill (> 32 rows: the op-by-op path, BLAS products) is the same model."""
    d, hf = models["norm"]
    assert_logits_match(dn.load_target(d), hf, _prompt(44, seed=3), "long prefill", cuts=(40, 44))


@pytest.mark.parametrize("case", ["norm", "no-norm"])
def test_greedy_identical_to_hf(models, case):
    d, hf = models[case]
    assert_greedy_matches_hf(dn.load_target(d), hf)


def assert_greedy_matches_hf(target, hf, n: int = 16) -> None:
    """Target-only greedy on a 12-token prompt == transformers' greedy (full recomputation)."""
    prompt = [int(x) for x in _prompt(12, seed=5)]
    want = hf_greedy(hf, prompt, n)
    r = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=n)
    got = r.output_ids
    assert got == want[:len(got)] and (len(got) == n or r.finish_reason == "stop"), (got, want)


@pytest.mark.parametrize("case", ["norm", "top4"])
@pytest.mark.parametrize("quantize", [None, "q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_verify_rows_equal_single_steps_bitwise(models, quantize, dtype, case):
    """A Q-row verify gives, bit for bit, the logits of Q one-row steps (whatever experts the
    rows share), and the fused MoE layer equals the op-by-op path, on every weight format."""
    if quantize and dtype == "bf16":
        pytest.skip("quantized weights run in f32 mode")
    d, _ = models[case]
    _verify_equals_single_steps(dn.load_target(d, quantize=quantize, dtype=dtype))


def test_q4_k_experts_verify_rows_equal_single_steps(tmp_path):
    """The same on Q4_K experts (a model 256 wide: q4_k's super-block; the fixtures' 64 are
    refused), through the fused MoE kernel and op by op."""
    d = build_qwen3_moe(tmp_path, seed=3, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                        num_attention_heads=8)
    target = dn.load_target(d, quantize="q4_k")
    assert target._fused_layers is not None
    moe = target.layers[0]["moe"]
    assert {w.format for w in moe.gate_up + moe.down} == {"q4_k"} and moe.stacked is not None
    _verify_equals_single_steps(target)


@pytest.mark.parametrize("quantize", [None, "q4_0"])
def test_grouped_experts_on_two_threads_equal_single_steps(models, quantize):
    """With every product split over two threads (parallel threshold 0), the fused layer's
    grouped expert product (one parallel pass over all picked experts' column items) gives the
    bits of one-row steps and of the op-by-op path, which calls each expert on its own."""
    import numba

    from dflash2_numba.decode.warmup import parallel_threshold

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    saved = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        with parallel_threshold(0):
            _verify_equals_single_steps(dn.load_target(models["top4"][0], quantize=quantize))
    finally:
        numba.set_num_threads(saved)


def _verify_equals_single_steps(target):
    ids = _prompt(28, seed=7)
    cache = target.new_cache(64)
    target.forward(ids[:20], cache)
    block, _ = target.forward(ids[20:28], cache)  # one 8-row verify
    cache.commit(20)
    singles = np.concatenate([target.forward(ids[i:i + 1], cache)[0] for i in range(20, 28)])
    assert np.array_equal(block, singles)
    target.fused = False
    cache.commit(20)
    ops_block, _ = target.forward(ids[20:28], cache)
    assert np.array_equal(block, ops_block)


def test_quantized_moe_tracks_bf16(models):
    """Sanity of the quantized experts (their kernels are gated bit-exactly in test_quant.py):
    measured mean |diff| 4.5% (q8_0) and 44% (q4_0) of mean |logit| on this random 3-layer
    model, argmax agreement 90% / 43%; q8_0 must stay well closer than q4_0 and agree on >= 80%."""
    d, _ = models["norm"]
    ids = _prompt()
    ref = _run_blocks(dn.load_target(d), ids)
    err, agree = {}, {}
    for fmt in ("q8_0", "q4_0"):
        got = _run_blocks(dn.load_target(d, quantize=fmt), ids)
        err[fmt] = np.abs(got - ref).mean() / np.abs(ref).mean()
        agree[fmt] = (got.argmax(1) == ref.argmax(1)).mean()
    print(err, agree)
    assert err["q8_0"] * 4 < err["q4_0"] and agree["q8_0"] >= 0.8


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("case", ["norm", "no-norm"])
def test_speculative_greedy_equals_target_only(models, tmp_path, kind, case):
    d, _ = models[case]
    target = dn.load_target(d)
    draft_dir = tiny.write_draft(tmp_path / kind, d, kind=kind, block_size=8, seed=3, mask_token_id=255)
    assert_speculation_lossless(target, dn.load_draft(draft_dir, target))


def assert_speculation_lossless(target, draft, qs=(2, 4, 8)):
    """Greedy speculative output == target-only greedy on two prompts at every Q in qs."""
    for prompt_seed in (0, 1):
        prompt = [int(x) for x in _prompt(10, seed=prompt_seed)]
        base = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=24).output_ids
        for Q in qs:
            got = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=24, block_size=Q)
            assert got.output_ids == base, (Q, prompt_seed)
            assert got.stats.steps >= 1


def speculative_sampling_pvalue(target, draft, n: int = 1500) -> float:
    """Chi-square p-value of speculative sampling (T = 1, top-k 4, Q = 4) against the exact
    distribution of 3-token continuations enumerated from the target's own logits."""
    from test_sampling import exact_sequence_probs, gof_pvalue

    from dflash2_numba.decode.sampling import SamplingParams

    params, prompt, n_new = SamplingParams(temperature=1.0, top_k=4), [3, 1], 3
    exact = exact_sequence_probs(target, prompt, n_new, params)
    counts = {}
    for i in range(n):
        r = dn.generate(target, draft, prompt_ids=prompt, max_new_tokens=n_new, block_size=4, temperature=1.0,
                        top_k=4, seed=i)
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    return gof_pvalue(counts, exact, n)


def test_sampling_chi_square_on_moe_target(models, tmp_path):
    d, _ = models["norm"]
    target = dn.load_target(d)
    draft = dn.load_draft(tiny.write_draft(tmp_path / "d2", d, kind="dflash2", block_size=4, seed=1,
                                           mask_token_id=255), target)
    assert speculative_sampling_pvalue(target, draft) > 1e-3


# ---------------------------------------------------------------- the block alone
def _crafted_block():
    """A 4-expert top-3 block whose three selected outputs are +B, -B (cancelling exactly) and
    a small s below half an ulp of B; routing probabilities 4 : 2 : 1 put the big ones first in
    slot order. Ascending expert id (transformers' index_add_ order) gives s + B - B = 0;
    slot order gives B - B + s = s. Every product is exact (powers of two, silu(20) == 20 in
    f32), so the comparison with transformers is exact too."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    H = I = 32
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=4, num_experts_per_tok=3,
                         norm_topk_prob=True)
    cfg._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(cfg)
    ln2 = float(np.float32(np.log(2.0)))
    router = np.zeros((4, H), np.float32)
    router[:, 0] = [-2 * ln2, 0.0, -ln2, -1000.0]  # p(e1) : p(e2) : p(e0) = 4 : 2 : 1, e3 never
    gate_up = np.zeros((4, 2 * I, H), np.float32)
    gate_up[:, 0, 0] = 20.0  # gate row 0: silu(20) == 20 in f32
    gate_up[:, I, 0] = 1.0  # up row 0
    down = np.zeros((4, H, I), np.float32)
    down[1, 0, 0] = 2.0**24  # w1 * 20 * 2^24 = B
    down[2, 0, 0] = -(2.0**25)  # w2 = w1 / 2: exactly -B
    down[0, 0, 0] = 0.25  # s = w0 * 5
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(router))
        block.experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
        block.experts.down_proj.copy_(torch.from_numpy(down))
    x = np.zeros((2, H), np.float32)
    x[:, 0] = 1.0
    with torch.no_grad():
        ref = block(torch.from_numpy(x)[None])[0].numpy()
    return router, gate_up, down, x, ref


def _block_weights(router, gate_up, down, prepare):
    from dflash2_numba.numerics import f32_to_bf16_array

    bf = lambda a: prepare(f32_to_bf16_array(a))  # noqa: E731  (every value here is exact in bf16)
    gu = [bf(gate_up[e]) for e in range(4)]
    dn_ = [bf(down[e]) for e in range(4)]
    return moe_mod.ExpertWeights(router, gu, dn_, 3, True, 32,  # the router as f32: -ln 2 is not a bf16 value
                                 stacked=(moe_mod.stack_panels(gu), moe_mod.stack_panels(dn_)))


def test_expert_order_ascending_id_as_transformers():
    from dflash2_numba.kernels.backend import get_ops
    from dflash2_numba.kernels.panels import pack_bf16

    router, gate_up, down, x, ref = _crafted_block()
    assert np.all(ref[:, 0] == 0.0) and np.all(ref[:, 1:] == 0.0)  # ascending id: s + B - B
    ops = get_ops("cpu")
    moe = _block_weights(router, gate_up, down, pack_bf16)
    got = moe_mod.moe_mlp(x, moe, ops.linear, swiglu=ops.swiglu)
    assert np.array_equal(got, ref), got[:, 0]


def test_route_rows_against_numpy_reference():
    rng = np.random.default_rng(0)
    for E, k in ((8, 2), (16, 4), (5, 5), (7, 1)):
        logits = (rng.standard_normal((20, E)) * 3).astype(np.float32)
        logits[3, :] = logits[3, 0]  # a full tie: lowest ids win
        for renorm in (True, False):
            ids, w = route(logits, k, renorm, False)
            rid, rw = route_reference(logits, k, renorm)
            assert np.array_equal(ids, rid)
            np.testing.assert_allclose(w, rw, rtol=2e-6)
        assert list(ids[3]) == list(range(k))


# ---------------------------------------------------------------- config and inventory
def test_config_rules(models):
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
           "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
           "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    c = resolve_qwen3_moe_config(raw)
    assert c.moe_layers == [1, 5]  # (i+1) % 2 == 0, minus mlp_only_layers
    assert c.norm_topk_prob is False  # the class default
    assert c.has_qk_norm
    alt = dict(raw, num_local_experts=8)
    del alt["num_experts"]
    assert resolve_qwen3_moe_config(alt).num_experts == 8
    from dflash2_numba.errors import ConfigValueError
    with pytest.raises(ConfigValueError, match="num_local_experts"):
        resolve_qwen3_moe_config(dict(raw, num_local_experts=4))
    with pytest.raises(ConfigValueError, match="mlp_only_layers"):
        resolve_qwen3_moe_config(dict(raw, mlp_only_layers=[6]))
    with pytest.raises(UnknownArchitectureError):
        resolve_qwen3_moe_config(dict(raw, architectures=["Qwen3ForCausalLM"]))


def test_transposed_fused_layout_refused(models, tmp_path):
    """Qwen3-VL-MoE's [E, H, 2I] gate_up is refused with the expected shape named."""
    from dflash2_numba.checkpoint import open_checkpoint

    src = models["norm-fused-layout"][0]
    dst = tmp_path / "t"
    dst.mkdir()
    ck = open_checkpoint(src)
    tensors = {n: np.array(ck.get(n)) for n in ck.names()}
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = np.ascontiguousarray(tensors[name].transpose(0, 2, 1))  # [E, H, 2I]
    tiny.save_safetensors(dst / "model.safetensors", tensors)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    with pytest.raises(TensorShapeError, match=r"gate_up_proj' has shape \[8, 64, 128\], expected \[8, 128, 64\]"):
        dn.load_target(dst)


def test_missing_expert_named(models, tmp_path):
    from dflash2_numba.checkpoint import open_checkpoint

    src = models["norm"][0]
    dst = tmp_path / "m"
    dst.mkdir()
    ck = open_checkpoint(src)
    tensors = {n: np.array(ck.get(n)) for n in ck.names() if n != "model.layers.2.mlp.experts.5.up_proj.weight"}
    tiny.save_safetensors(dst / "model.safetensors", tensors)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    with pytest.raises(MissingTensorsError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        dn.load_target(dst)


def test_inspect_reports_total_and_active_parameters(models):
    """inspect's MoE facts (computed from the config's inventory) against the checkpoint's own
    tensors: total = every tensor; active = total minus the (E - k) / E share of the experts."""
    from dflash2_numba.checkpoint import open_checkpoint
    from dflash2_numba.inspect_model import format_inspect, inspect_model

    d, _ = models["norm"]
    report = inspect_model(d, hash_files=False)
    ck = open_checkpoint(d)
    sizes = {n: int(np.prod(ck.info(n).shape)) for n in ck.names()}
    experts = sum(s for n, s in sizes.items() if ".experts." in n)
    E, k = 8, 2
    assert report["total_parameters"] == sum(sizes.values())
    assert report["active_parameters_per_token"] == sum(sizes.values()) - experts * (E - k) // E
    assert report["bytes_read_per_token"]["q4_0"] < report["bytes_read_per_token"]["q8_0"] < \
        report["bytes_read_per_token"]["bf16"]
    assert "mixture of experts: 8 experts, 2 per token" in format_inspect(report)
