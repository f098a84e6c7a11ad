"""Pre-quantized checkpoints loaded as stored (quant/stored.py), end to end on tiny Qwen3 targets
(hidden 128, so that compressed-tensors' group 128 is one group per row of q/k/v/gate/up):

- FP8 in Qwen's layout (quant_method fp8, blocks 64x64 so every matrix has several blocks):
  reference = transformers' own Fp8Dequantize on the stored bytes, in transformers'
  Qwen3ForCausalLM (float32).
- compressed-tensors pack-quantized int4 group 128, symmetric and asymmetric, WRITTEN BY THE
  compressed-tensors LIBRARY (its apply_quantization_config / calculate_qparams /
  ModelCompressor.compress_model, transformers' save_pretrained); reference = transformers
  loading it with CompressedTensorsConfig(run_compressed=False) (decompressed by the library).
- AWQ GEMM (group 64) and GPTQ v1 with desc_act (a random act order: non-monotone g_idx) and
  GPTQ v2 (group 32), packed by tests/quant_ckpt.py; reference = ports of AutoAWQ's
  dequantize_gemm and AutoGPTQ's torch dequantization (tests/quant_refs.py) in Qwen3ForCausalLM.

For each: logits within 1e-4 of max|logit| (measured ~1e-6), greedy == the reference's greedy,
and DFlash / DFlash2 speculative output == target-only greedy at Q = 2, 4, 8. The same for an
FP8-stored DFlash2 draft.
"""

from __future__ import annotations

import json
import shutil

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed")

from dflash2_numba import tiny
from dflash2_numba.api import load_draft, load_target
from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.decode.loop import generate
from dflash2_numba.numerics import as_f32
from dflash2_numba.quant.stored import StoredWeight

import quant_ckpt as qc
import quant_refs as qr

torch.set_num_threads(1)
PROMPT = list(range(5, 29))
NEW = 24
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    root = tmp_path_factory.mktemp("stored")
    tiny.write_target(root / "t", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, seed=0, init_std=0.2)
    tiny.write_draft(root / "d1", root / "t", kind="dflash", block_size=8, seed=1, init_std=0.2)
    tiny.write_draft(root / "d2", root / "t", kind="dflash2", block_size=8, seed=2, init_std=0.2)
    yield root
    numba.set_num_threads(threads)


# ------------------------------------------------------------------ checkpoints and their references
def _dense_from(directory, dequant):
    """Every tensor of `directory` as the reference sees it: plain tensors widened to f32,
    quantized linears through `dequant(checkpoint, module) -> [out, in]`."""
    ck = open_checkpoint(directory)
    out = {}
    for name in ck.names():
        out[name] = dequant(ck, name[:-len(".weight")]) if name in ck.stored else as_f32(ck.get(name))
    return out


def make_ct(base, sym: bool = True, scheme: str = "int4", record: dict | None = None):
    """A compressed-tensors checkpoint written by the library itself: scheme "int4"
    (pack-quantized, group 128, symmetric or not), "w8a8" (int-quantized: int8 channel weights,
    int8 dynamic per-token activations) or "fp8" (float-quantized e4m3 channel weights, weight-only).
    `record`: filled with {module: (input, output)} of the library's own quantized forward
    (fake-quantized weights and activations) on PROMPT, before compression."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    from compressed_tensors.quantization import QuantizationStatus

    model = AutoModelForCausalLM.from_pretrained(base / "t", dtype=torch.float32)
    acts, group = None, 128
    if scheme == "int4":
        args, fmt = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=128), "pack-quantized"
    elif scheme == "w8a8":
        args, fmt = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"), "int-quantized"
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    else:  # "fp8" weight-only, "fp8_dynamic": FP8 weights and dynamic per-token FP8 activations
        args, fmt = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"), "float-quantized"
        if scheme == "fp8_dynamic":
            acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    if scheme != "int4":
        group = None
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)},
        ignore=["lm_head"]))
    for _, m in model.named_modules():
        if hasattr(m, "weight_scale"):  # min / max observer per (row, group), the library's qparams
            N, K = m.weight.shape
            wg = m.weight.data.reshape(N, K // (group or K), group or K)
            s, z = calculate_qparams(wg.amin(-1), wg.amax(-1), m.quantization_scheme.weights)
            m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(z.reshape(m.weight_zero_point.shape))
            m.quantization_status = QuantizationStatus.FROZEN  # the library's quantized forward
    if record is not None:
        hooks = [m.register_forward_hook(lambda mod, i, o, n=n: record.__setitem__(n, (i[0][0].numpy().copy(), o[0].numpy().copy())))
                 for n, m in model.named_modules() if hasattr(m, "weight_scale")]
        with torch.no_grad():
            model(torch.tensor([PROMPT]))
        for h in hooks:
            h.remove()
    comp = ModelCompressor.from_pretrained_model(model, fmt)
    comp.compress_model(model)
    dst = base / (f"ct_{'sym' if sym else 'asym'}" if scheme == "int4" else f"ct_{scheme}")
    model.save_pretrained(dst)
    comp.update_config(dst)
    for f in (base / "t").iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "special_tokens_map.json",
                                                        "chat_template.jinja"):
            shutil.copy(f, dst / f.name)
    return dst


def ct_reference(dst):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()


def awq_deq(ck, X):
    g = json.loads((ck.directory / "config.json").read_text())["quantization_config"]["group_size"]
    return qr.awq_dequantize_gemm(ck.get_raw(X + ".qweight"), ck.get_raw(X + ".qzeros"), ck.get_raw(X + ".scales"),
                                  4, g).T


def gptq_deq(ck, X):
    v1 = json.loads((ck.directory / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq"
    return qr.gptq_dequantize(ck.get_raw(X + ".qweight"), ck.get_raw(X + ".qzeros"), ck.get_raw(X + ".scales"),
                              ck.get_raw(X + ".g_idx"), 4, v1=v1).T


def build(base, kind):
    """(directory, reference torch model) for one format."""
    d = base / kind
    if kind == "fp8":
        dense = qc.fp8_checkpoint(base / "t", d, block=(64, 64))
        return d, qc.hf_model(d, dense)
    if kind in ("ct_sym", "ct_asym"):
        d = make_ct(base, kind == "ct_sym")
        return d, ct_reference(d)
    if kind == "ct_fp8":
        d = make_ct(base, scheme="fp8")
        return d, ct_reference(d)
    if kind == "awq":
        qc.awq_checkpoint(base / "t", d, group=64, rng=np.random.default_rng(3))
        return d, qc.hf_model(d, _dense_from(d, awq_deq))
    if kind == "gptq_desc":
        qc.gptq_checkpoint(base / "t", d, group=32, desc_act=True, seed=4)
        return d, qc.hf_model(d, _dense_from(d, gptq_deq))
    if kind == "gptq_v2":
        qc.gptq_checkpoint(base / "t", d, group=32, v2=True, seed=5)
        return d, qc.hf_model(d, _dense_from(d, gptq_deq))
    raise ValueError(kind)


KINDS = ["fp8", "ct_sym", "ct_asym", "ct_fp8", "awq", "gptq_desc", "gptq_v2"]


@pytest.fixture(scope="module")
def models(base):
    return {}


def _get(models, base, kind):
    if kind not in models:
        models[kind] = build(base, kind)
    return models[kind]


def hf_greedy(model, ids, n, valid):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            z = model(torch.tensor([seq])).logits[0, -1].float().numpy()
            z[valid:] = -np.inf  # our decode never emits padded ids
            seq.append(int(z.argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_match_reference(base, models, kind):
    d, ref = _get(models, base, kind)
    target = load_target(d)
    stored = [L[n] for L in target.layers for n in LINEARS]
    assert all(isinstance(w, StoredWeight) for w in stored)
    assert not isinstance(target.lm_head_w, StoredWeight)  # lm_head ignored / not converted: bf16
    ids = PROMPT
    ours, _ = target.forward(np.array(ids), target.new_cache(64))
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(f"\n{kind}: max|logit diff| / max|logit| = {rel:.2e}")
    assert rel < 1e-4
    out = generate(target, None, prompt_ids=ids, max_new_tokens=NEW).output_ids
    assert len(out) >= 8
    assert out == hf_greedy(ref, ids, NEW, target.valid_vocab)[:len(out)]


@pytest.mark.parametrize("scheme", ["w8a8", "fp8_dynamic"])
def test_activation_schemes_follow_the_library(base, scheme):
    """compressed-tensors W8A8 (int8 channel weights, dynamic per-token int8 activations) and
    FP8_DYNAMIC (FP8 channel weights, dynamic per-token FP8 activations), written by the library:
    every linear, fed the library's own input at that layer, gives the library's own quantized
    forward (fake-quantized activations and weights) within f32 rounding. The whole model's
    logits are NOT compared at 1e-4: an input that differs by 1e-6 (attention / norm rounding,
    ours vs torch) can move one activation across a rounding boundary of its 8-bit grid, and
    measured (W8A8) that moves the tiny model's logits by ~2.5e-2 of max|logit| (the per-linear
    check is the one that pins the scheme). Speculation stays lossless: Q-row == Q one-row steps."""
    record = {}
    d = make_ct(base, scheme=scheme, record=record)
    target = load_target(d)
    names = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
             "down_proj": "down"}
    assert len(record) == 7 * len(target.layers)
    worst = 0.0
    for name, (x, y_ref) in record.items():
        w = target.layers[int(name.split(".")[2])][names[name.rsplit(".", 1)[1]]]
        assert isinstance(w, StoredWeight) and "per-token" in w.format
        y = np.empty(y_ref.shape, np.float32)
        w.linear(np.ascontiguousarray(x), y, False)
        worst = max(worst, float(np.abs(y - y_ref).max() / np.abs(y_ref).max()))
    print(f"\n{scheme}: worst per-linear max|diff| / max|out| vs compressed-tensors' forward = {worst:.2e}")
    assert worst < 1e-5
    ref = generate(target, None, prompt_ids=PROMPT, max_new_tokens=NEW).output_ids
    for draft_dir in ("d1", "d2"):
        draft = load_draft(base / draft_dir, target)
        for Q in (2, 4, 8):
            assert generate(target, draft, prompt_ids=PROMPT, max_new_tokens=NEW, block_size=Q).output_ids == ref


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_equals_target_greedy(base, models, kind):
    d, _ = _get(models, base, kind)
    target = load_target(d)
    ref = generate(target, None, prompt_ids=PROMPT, max_new_tokens=NEW).output_ids
    for draft_dir in ("d1", "d2"):
        draft = load_draft(base / draft_dir, target)
        for Q in (2, 4, 8):
            assert generate(target, draft, prompt_ids=PROMPT, max_new_tokens=NEW, block_size=Q).output_ids == ref, \
                (kind, draft_dir, Q)


@pytest.mark.parametrize("kind", ["fp8", "gptq_desc"])
def test_verify_rows_equal_single_steps(base, models, kind):
    """An 8-row verify block == 8 one-row steps bit for bit, and a 40-row prefill (> 32 rows) ==
    the same tokens fed 8 at a time: every layer's output and the logits bit for bit (the stored
    kernels and the bf16 head's panel kernel take any row count in one fma order)."""
    d, _ = _get(models, base, kind)
    target = load_target(d)
    ids = np.random.default_rng(0).integers(0, target.valid_vocab, 48)
    whole, steps = target.new_cache(64), target.new_cache(64)
    target.forward(ids[:40], whole)
    block, _ = target.forward(ids[40:], whole)
    layers = tuple(range(target.config.num_hidden_layers))
    chunks = [target.forward(ids[i:i + 8], steps, tap_layers=layers) for i in range(0, 40, 8)]
    singles = np.concatenate([target.forward(ids[i:i + 1], steps)[0] for i in range(40, 48)])
    assert np.array_equal(block, singles)
    logits, states = target.forward(ids[:40], target.new_cache(64), tap_layers=layers)  # [40, V], [40, L*H]
    assert np.array_equal(states, np.concatenate([t for _, t in chunks]))
    assert np.array_equal(logits, np.concatenate([lg for lg, _ in chunks]))


def test_fp8_draft_is_stored_and_lossless(base, models):
    """A DFlash2 draft in FP8 (fc and the layer linears quantized, conv and selector bf16) next to
    an FP8 target: its weights stay FP8, speculative output == target-only greedy."""
    d, _ = _get(models, base, "fp8")
    qc.fp8_checkpoint(base / "d2", base / "d2_fp8", block=(64, 64), skip=())
    target = load_target(d)
    draft = load_draft(base / "d2_fp8", target)
    assert isinstance(draft.fc, StoredWeight) and all(isinstance(draft.layers[0][n], StoredWeight) for n in LINEARS)
    ref = generate(target, None, prompt_ids=PROMPT, max_new_tokens=NEW).output_ids
    for Q in (2, 4, 8):
        assert generate(target, draft, prompt_ids=PROMPT, max_new_tokens=NEW, block_size=Q).output_ids == ref


def test_numpy_device_dequantizes(base, models):
    """The numpy device computes on the dequantized weights: the same logits within f32 rounding."""
    d, _ = _get(models, base, "awq")
    from dflash2_numba.families.qwen3 import TargetModel

    cpu, ref = load_target(d), TargetModel.load(d, device="numpy")
    a = cpu.forward(np.array(PROMPT), cpu.new_cache(64))[0]
    b = ref.forward(np.array(PROMPT), ref.new_cache(64))[0]
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
