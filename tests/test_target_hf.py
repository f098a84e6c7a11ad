"""Target model vs Hugging Face transformers on tiny random checkpoints written BY transformers.

Cases cover Qwen3 (q/k norm) and Llama, tied and untied heads, GQA and MHA, f32 and bf16
weights, single-file and sharded safetensors. Run with -s to see the measured differences.

Tolerances (measured, see the printed table):
- f32 run mode vs HF float32 on the same weights: max|diff| <= 1e-4 * max|logit|.
- bf16 run mode vs HF bfloat16 (SDPA, eager torch rounding at every op): BF16_TOL * max|logit|,
  against HF run in a subprocess on PINNED CPU paths (tests/hf_bf16_reference.py: ATen's scalar
  kernels, `ATEN_CPU_CAPABILITY=default`, and oneDNN off), never against the host's own torch.
  Why pinned: HF bf16's own logits move with the instruction set (ATen AVX2 vs AVX-512 kernels,
  oneDNN's AMX / AVX-512-bf16 GEMMs vs ATen's): bench/hf_bf16_spread.py measured HF vs HF across
  10 CPU configurations at up to 1.24e-2 (qwen3) and 1.52e-2 (llama) of max|logit|, as large as
  our whole modelling error against any one of them (1.2e-2 / 1.7-1.9e-2), so a gate against the
  host's torch measures the host (issue 18: an AVX2 EPYC failed a gate an AVX-512 box passed).
  The pinned paths have no instruction-set dispatch left, and they are the ones our rounding
  points model: measured (bench/results/hf_bf16_spread.json) our bf16 logits are BIT-IDENTICAL
  to pinned HF on qwen3-tied-gqa4 (0.0) and 9.8e-3 of max|logit| off on llama (2.3 ulps of its
  max logit; mean|diff| 7.9e-3 vs 2.6e-2 for our f32 mode), the same bits with numba and numpy
  on their AVX2 paths. BF16_TOL = 2^-6 = 1.56e-2: 1.6x the worst measured. The layer-0 residual
  (identical inputs) must be >= 95% bit-equal to pinned HF (measured 98.1% and 100%; it was
  76-79% against the host's vectorised torch, hence the old 65%), and our bf16 mode closer to HF
  bf16 than our f32 mode (max and mean).
  Mutations (one rounding point removed, measured vs pinned HF): SiLU output unrounded in the
  SwiGLU kernel -> qwen3 1.55e-2 with layer 0 60% bit-equal, llama 1.63e-2 / 61%: red (layer-0
  gate; llama also the max); attention probabilities unrounded -> 1.79e-2 / 1.87e-2, layer 0
  38% / 47% bit-equal: red; RMSNorm's normalised x unrounded before the weight -> 2.42e-2 /
  4.67e-2, layer 0 22% / 18%: red; residual add unrounded in the fused layer -> 1.70e-2 /
  2.07e-2: red. (Numba's on-disk cache does not recompile a cached caller when a function it
  inlines from another file changes: mutate kernels/rowwise.py or attention.py with an empty
  NUMBA_CACHE_DIR, or the fused layer keeps running the old code.)
"""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash2_numba.errors import (
    DeviceUnavailableError,
    GenerationArgumentError,
    MissingTensorsError,
    TensorShapeError,
    UnexpectedTensorsError,
)
from dflash2_numba.kernels.backend import get_ops
from dflash2_numba.families.qwen3 import TargetModel

from hf_bf16_reference import hf_bf16_pinned

torch.set_num_threads(1)  # tiny models: threads only add fork/join stalls on shared cores

V, H, LAYERS, PROMPT = 300, 64, 3, 20
BLOCKS = (1, 4, 16)  # incremental blocks after the 20-token prefill
F32_TOL = 1e-4
BF16_TOL = 2.0**-6  # of max|logit| vs pinned HF bf16; measured worst 9.8e-3 (see docstring)
LAYER0_BIT_EQUAL = 0.95  # measured 98.1% / 100% vs pinned HF bf16
TAPS = (0, 1, LAYERS - 1)

CASES = {
    # name: (architecture, tied, num_kv_heads, weight dtype, shard)
    "qwen3-untied-gqa-f32": ("qwen3", False, 2, torch.float32, False),
    "qwen3-tied-gqa4-bf16-sharded": ("qwen3", True, 1, torch.bfloat16, True),
    "llama-untied-gqa-bf16": ("llama", False, 2, torch.bfloat16, False),
    "llama-tied-mha-f32": ("llama", True, 4, torch.float32, False),
}


def build_hf_model(directory, arch, tied, nkv, dtype, shard, seed, extra=None):
    """Write a tiny random model with transformers' own save_pretrained (`extra`: more config keys)."""
    Config, Model = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    cfg = Config(
        vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=nkv, head_dim=16, tie_word_embeddings=tied,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **(extra or {}),
    )
    model = Model(cfg)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights away from 1 so a skipped norm shows
                val = 1.0 + 0.3 * rng.standard_normal(p.shape)
            elif "embed_tokens" in name:
                val = rng.standard_normal(p.shape)
            else:
                val = rng.standard_normal(p.shape) * (1.5 / np.sqrt(p.shape[1]))
            p.copy_(torch.from_numpy(val.astype(np.float32)))
    model.to(dtype).save_pretrained(directory, safe_serialization=True, max_shard_size="40KB" if shard else "5GB")
    return directory


def load_hf(directory, dtype):
    m = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return m.eval()


def hf_forward(model, ids, taps):
    """Full-sequence HF forward -> (logits [T, V] f32, {l: residual after layer l [T, H]})."""
    last = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    hs = out.hidden_states
    res = {}
    for l in taps:
        # HF's LAST hidden_states entry is post-final-norm; the residual after the last layer
        # is only visible through a hook. hidden_states[l+1] for every earlier layer.
        res[l] = (last["h"] if l == LAYERS - 1 else hs[l + 1])[0].float().numpy()
    return out.logits[0].float().numpy(), res


def run_blocks(target, seq, taps, max_len=8):
    """Prefill PROMPT tokens then the BLOCKS; returns stacked logits and taps for all rows.
    max_len=8 forces the cache to grow twice."""
    cache = target.new_cache(max_len)
    logits, tapped, pos = [], [], 0
    for n in (PROMPT,) + BLOCKS:
        lg, tp = target.forward(np.array(seq[pos : pos + n]), cache, tap_layers=taps)
        logits.append(lg)
        tapped.append(tp)
        pos += n
    assert cache.length == pos
    return np.concatenate(logits), np.concatenate(tapped)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for seed, (name, (arch, tied, nkv, dtype, shard)) in enumerate(CASES.items()):
        d = build_hf_model(tmp_path_factory.mktemp(name), arch, tied, nkv, dtype, shard, seed)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def seq():
    return [int(t) for t in np.random.default_rng(99).integers(0, V, PROMPT + sum(BLOCKS))]


REPORT = []


def report(case, what, diff, scale):
    REPORT.append((case, what, diff, scale))
    print(f"\n  {case:32s} {what:34s} max|diff| {diff:.3e}   max|ref| {scale:.2f}   rel {diff / scale:.2e}")


@pytest.mark.parametrize("case", CASES)
def test_f32_mode_matches_hf_float32(models, seq, case):
    """Logits of prefill + incremental blocks, and hidden taps, vs HF float32 full forward
    (for bf16 checkpoints HF upcasts the same bf16 weights exactly)."""
    d = models[case]
    assert (d / "model.safetensors.index.json").exists() == CASES[case][4]  # really sharded
    target = TargetModel.load(d, device="cpu", dtype="f32")
    ref_logits, ref_taps = hf_forward(load_hf(d, torch.float32), seq, TAPS)
    logits, taps = run_blocks(target, seq, TAPS)
    scale = np.abs(ref_logits).max()
    diff = np.abs(logits - ref_logits).max()
    report(case, "f32 logits vs HF f32", diff, scale)
    assert diff <= F32_TOL * scale
    for j, l in enumerate(TAPS):
        mine = taps[:, j * H : (j + 1) * H]
        tdiff = np.abs(mine - ref_taps[l]).max()
        assert tdiff <= F32_TOL * np.abs(ref_taps[l]).max(), (l, tdiff)
    report(case, "f32 taps vs HF residual", np.abs(taps - np.concatenate([ref_taps[l] for l in TAPS], 1)).max(),
           max(np.abs(t).max() for t in ref_taps.values()))


BF16_CASES = [c for c in CASES if CASES[c][3] == torch.bfloat16]


@pytest.fixture(scope="module")
def hf_bf16(models, seq):
    """HF bf16 logits and layer-0 residual of every bf16 case, on the pinned CPU paths (one
    subprocess for the module: tests/hf_bf16_reference.py)."""
    results, _ = hf_bf16_pinned([dict(kind="qwen3", dir=str(models[c]), ids=seq, taps=[0]) for c in BF16_CASES])
    return dict(zip(BF16_CASES, results))


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_mode_matches_hf_bfloat16(models, seq, hf_bf16, case):
    d = models[case]
    target = TargetModel.load(d, device="cpu", dtype="bf16")
    ref_logits, ref_tap0 = hf_bf16[case]["logits"], hf_bf16[case]["taps"][0]
    logits, taps = run_blocks(target, seq, TAPS)
    scale = np.abs(ref_logits).max()
    diff = np.abs(logits - ref_logits).max()
    report(case, "bf16 logits vs pinned HF bf16", diff, scale)
    assert diff <= BF16_TOL * scale
    # layer 0 sees identical inputs, so its output must be (almost) bit-equal to pinned torch's:
    # measured 98.1% / 100% (76-79% against the host's vectorised torch kernels)
    eq0 = np.mean(taps[:, :H] == ref_tap0)
    print(f"  layer-0 residual bit-equal to pinned HF bf16: {eq0:.1%}")
    assert eq0 >= LAYER0_BIT_EQUAL
    # our bf16 mode really rounds: every activation we hand out is a bf16 value
    assert np.array_equal(logits.view(np.uint32) & 0xFFFF, np.zeros_like(logits, dtype=np.uint32))
    assert np.array_equal(taps.view(np.uint32) & 0xFFFF, np.zeros_like(taps, dtype=np.uint32))
    # ...and is closer to HF bf16 than our f32 mode is (rounding matters and is modelled)
    f32_logits, _ = run_blocks(TargetModel.load(d, dtype="f32"), seq, TAPS)
    f32_diff = np.abs(f32_logits - ref_logits).max()
    report(case, "(f32 mode vs pinned HF bf16, contrast)", f32_diff, scale)
    mean, f32_mean = np.abs(logits - ref_logits).mean(), np.abs(f32_logits - ref_logits).mean()
    print(f"  mean|diff|: bf16 mode {mean:.3e}, f32 mode {f32_mean:.3e}")
    assert diff < f32_diff and mean < f32_mean


def greedy(target, prompt, n):
    cache = target.new_cache(16)
    logits, _ = target.forward(np.array(prompt), cache, last_only=True)
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        logits, _ = target.forward(np.array([tok]), cache)
    return out


def hf_greedy(model, prompt, n):
    """HF greedy by full recomputation (independent of any KV cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("case", CASES)
def test_greedy_64_identical_to_hf(models, seq, case):
    d = models[case]
    mine = greedy(TargetModel.load(d, dtype="f32"), seq[:PROMPT], 64)
    ref = hf_greedy(load_hf(d, torch.float32), seq[:PROMPT], 64)
    print(f"\n  {case}: greedy {len(set(ref))} distinct ids in 64; first mismatch at "
          f"{next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)}")
    assert mine == ref


def test_commit_then_recompute_equals_fresh(models, seq):
    d = models["qwen3-untied-gqa-f32"]
    target = TargetModel.load(d)
    prompt, x, y = seq[:PROMPT], seq[PROMPT : PROMPT + 4], seq[PROMPT + 4 : PROMPT + 8]
    cache = target.new_cache(64)
    target.forward(np.array(prompt), cache)
    target.forward(np.array(x), cache)
    cache.commit(PROMPT)
    got, got_taps = target.forward(np.array(y), cache, tap_layers=(1,))
    fresh = target.new_cache(64)
    target.forward(np.array(prompt), fresh)
    want, want_taps = target.forward(np.array(y), fresh, tap_layers=(1,))
    np.testing.assert_array_equal(got, want)  # same op sequence: bit-identical
    np.testing.assert_array_equal(got_taps, want_taps)
    assert cache.length == PROMPT + 4
    with pytest.raises(ValueError):
        cache.commit(PROMPT + 5)


def test_last_only_and_numpy_device(models, seq):
    d = models["llama-untied-gqa-bf16"]
    cpu, ref = TargetModel.load(d, device="cpu"), TargetModel.load(d, device="numpy")
    full, _ = cpu.forward(np.array(seq[:PROMPT]), cpu.new_cache())
    last, _ = cpu.forward(np.array(seq[:PROMPT]), cpu.new_cache(), last_only=True)
    np.testing.assert_allclose(last, full[-1:], rtol=0, atol=1e-5 * np.abs(full).max())
    numpy_logits, _ = ref.forward(np.array(seq[:PROMPT]), ref.new_cache())
    assert ref.lm_head_w.dtype == np.float32  # numpy device: weights converted once at load
    np.testing.assert_allclose(numpy_logits, full, rtol=0, atol=1e-5 * np.abs(full).max())


def test_padded_vocab_hook(models, seq):
    target = TargetModel.load(models["llama-tied-mha-f32"])
    logits, _ = target.forward(np.array(seq[:5]), target.new_cache())
    assert logits.shape == (5, V)  # the model never masks by itself
    target.valid_vocab = V - 10
    masked = target.mask_padded(logits.copy())
    assert np.all(masked[:, V - 10 :] == -np.inf) and np.array_equal(masked[:, : V - 10], logits[:, : V - 10])


def _rewrite(src, dst, edit):
    """Copy a single-file f32 checkpoint with its tensors edited."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_inventory_refusals(models, tmp_path):
    src = models["qwen3-untied-gqa-f32"]
    d = _rewrite(src, tmp_path / "missing", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(MissingTensorsError, match="model.layers.1.self_attn.k_norm.weight"):
        TargetModel.load(d)
    d = _rewrite(src, tmp_path / "extra", lambda t: t.__setitem__("model.layers.9.mlp.x", np.zeros(3, np.float32)))
    with pytest.raises(UnexpectedTensorsError, match="model.layers.9.mlp.x"):
        TargetModel.load(d)
    d = _rewrite(src, tmp_path / "shape",
                 lambda t: t.__setitem__("model.norm.weight", np.zeros(H + 1, np.float32)))
    with pytest.raises(TensorShapeError, match=r"model.norm.weight.*\[65\].*\[64\]"):
        TargetModel.load(d)
    # untied config without lm_head.weight is refused; tied config may omit it (HF does)
    d = _rewrite(src, tmp_path / "nohead", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(MissingTensorsError, match="lm_head.weight"):
        TargetModel.load(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    TargetModel.load(d)


def test_device_and_dtype_refusals(models):
    d = models["llama-tied-mha-f32"]
    with pytest.raises(DeviceUnavailableError, match="tpu"):
        get_ops("tpu")
    with pytest.raises(GenerationArgumentError, match="fp8"):
        TargetModel.load(d, dtype="fp8")
    ops = get_ops("cpu")
    assert ops.grouped_conv.__module__.endswith("kernels.conv")  # DFlash2 conv wired in
