"""Stored-format kernels against their numpy references, bit-for-bit row invariance, and the
named refusals of quant/stored.py's planners (docs/quantization.md, "Checkpoints quantized by
others"). The end-to-end model checks are tests/test_stored_models.py.
"""

from __future__ import annotations

import json

import numba
import numpy as np
import pytest

from dflash2_numba import tiny
from dflash2_numba.api import load_target
from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.errors import GenerationArgumentError, StoredFormatError, UnknownDTypeError
from dflash2_numba.inspect_model import format_inspect, inspect_model
from dflash2_numba.quant import bytes_kernel, int4, w8a8
from dflash2_numba.quant.stored import StoredWeight

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed")
import quant_ckpt as qc  # noqa: E402


def _run(w: StoredWeight, x: np.ndarray, parallel: bool = False) -> np.ndarray:
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    return w.linear(np.ascontiguousarray(x, np.float32), y, parallel)


def _rows_invariant(w: StoredWeight, x: np.ndarray) -> None:
    """A Q-row product == Q one-row products bit for bit, serial == parallel."""
    whole = _run(w, x)
    singles = np.concatenate([_run(w, x[i:i + 1]) for i in range(x.shape[0])])
    assert np.array_equal(whole, singles)
    threads = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        assert np.array_equal(_run(w, x, parallel=True), whole)
    finally:
        numba.set_num_threads(threads)


# ------------------------------------------------------------------ byte kernels (FP8 / int8)
def test_e4m3_table_matches_torch():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    ours = bytes_kernel.E4M3
    assert np.array_equal(np.isnan(ours), np.isnan(codes))
    assert np.array_equal(ours[~np.isnan(ours)], codes[~np.isnan(codes)])


@pytest.mark.parametrize("lut,block", [("e4m3", (16, 32)), ("e4m3", (1, 100)), ("int8", (1, 37)), ("e4m3", (40, 40))])
def test_bytes_kernel_matches_reference(lut, block):
    rng = np.random.default_rng(0)
    N, K = 70, 100  # ragged: neither a multiple of the block
    bn, bk = block
    table = bytes_kernel.E4M3 if lut == "e4m3" else bytes_kernel.INT8
    codes = rng.integers(0, 256, (N, K)).astype(np.uint8)
    codes[np.isnan(table[codes])] = 0  # no NaN weights
    scale = rng.uniform(0.5, 2.0, (-(-N // bn), -(-K // bk))).astype(np.float32)
    arrays = {"w": codes, "lut": table, "scale": scale, "block": np.array([bn, bk], np.int64)}
    w = StoredWeight("bytes", lut, (N, K), arrays, bytes_kernel.matmul_bytes, bytes_kernel.dequantize_bytes)
    x = rng.standard_normal((9, K)).astype(np.float32)
    ref = bytes_kernel.linear_bytes_reference(x, arrays, (N, K))
    assert np.abs(_run(w, x) - ref).max() <= 1e-5 * np.abs(ref).max()
    # each block carries its own scale: one scale for the whole tensor is far off
    flat = x @ (table[codes] * scale[0, 0]).T
    assert np.abs(flat - ref).max() > 1e-2 * np.abs(ref).max()
    _rows_invariant(w, x)


# ------------------------------------------------------------------ int4
def test_int4_pack_roundtrip_and_kernel():
    rng = np.random.default_rng(1)
    N, K = 40, 96
    codes = rng.integers(0, 16, (N, K)).astype(np.uint8)
    assert np.array_equal(int4.unpack_codes(int4.pack_codes(codes), K), codes)
    g_idx = rng.permutation(np.arange(K) // 16)  # desc_act-like: 6 groups of 16, shuffled
    perm, seg, sg = int4.index_segments(g_idx)
    assert perm is not None and np.array_equal(np.sort(g_idx), g_idx[perm])
    zero = rng.integers(0, 17, (N, 6)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, (N, 6)).astype(np.float32)
    arrays = int4.make_arrays(int4.pack_codes(codes[:, perm]), zero, scale, seg, sg, perm)
    w = StoredWeight("int4", "t", (N, K), arrays, int4.matmul_int4, int4.dequantize_int4)
    dense = (codes.astype(np.float32) - zero[:, g_idx]) * scale[:, g_idx]  # the definition, model order
    assert np.array_equal(w.dequantize(), dense)
    x = rng.standard_normal((7, K)).astype(np.float32)
    assert np.abs(_run(w, x) - x @ dense.T).max() <= 1e-5 * np.abs(x @ dense.T).max()
    _rows_invariant(w, x)


# ------------------------------------------------------------------ W8A8
def test_w8a8_activation_rule_and_kernel():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[2] = 0.0  # an all-zero row
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    xt = torch.from_numpy(x)[None]  # [1, M, K]: the library reduces per token over the last dim
    s, z = compute_dynamic_scales_and_zp(xt, args, module=torch.nn.Linear(1, 1))
    lib = fake_quantize(xt, s, z, args)[0].numpy()
    q, sx = w8a8.quantize_tokens(x)
    assert np.array_equal(q.astype(np.float32) * sx[:, None], lib)
    wq = rng.integers(-127, 128, (33, 64)).astype(np.int8)
    arrays = {"w": wq, "scale": rng.uniform(0.001, 0.01, 33).astype(np.float32)}
    w = StoredWeight("w8a8", "t", (33, 64), arrays, w8a8.matmul_w8a8, w8a8.dequantize_w8a8)
    ref = w8a8.linear_w8a8_reference(x, arrays)
    assert np.array_equal(_run(w, x), ref)
    _rows_invariant(w, x)


def test_e4m3_rounding_matches_torch_cast():
    """fp8_act.round_e4m3 == torch's float8_e4m3fn cast (round to nearest even) on random values
    over the whole range, every exact e4m3 value and every midpoint between neighbours (ties)."""
    from dflash2_numba.quant import fp8_act

    rng = np.random.default_rng(3)
    vals = bytes_kernel.E4M3[~np.isnan(bytes_kernel.E4M3)]
    pos = np.unique(vals[vals >= 0])
    mids = ((pos[1:].astype(np.float64) + pos[:-1]) / 2).astype(np.float32)  # exact in f32
    v = np.concatenate([rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 1e-2, vals, mids, -mids]).astype(np.float32)
    theirs = torch.from_numpy(v).to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(fp8_act.round_e4m3(v), theirs)


def test_fp8_dynamic_activation_rule_matches_library():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from dflash2_numba.quant import fp8_act

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 100, (6, 1))).astype(np.float32)
    x[3] = 0.0
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    xt = torch.from_numpy(x)[None]
    s, z = compute_dynamic_scales_and_zp(xt, args, module=torch.nn.Linear(1, 1))
    assert np.array_equal(fp8_act.quantize_tokens_fp8(x), fake_quantize(xt, s, z, args)[0].numpy())


# ------------------------------------------------------------------ refusals and the inventory
@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stored_unit")
    tiny.write_target(root / "t", seed=0, init_std=0.2)  # hidden 64, intermediate 128
    qc.fp8_checkpoint(root / "t", root / "fp8", block=(32, 32))
    return root


def _edit_config(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"]) if "quantization_config" in cfg else None
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fp8_inventory_hides_scales(fp8_dir):
    ck = open_checkpoint(fp8_dir / "fp8")
    name = "model.layers.0.mlp.down_proj.weight"
    assert name in ck.stored and ck.info(name).shape == (64, 128)
    assert not any(n.endswith("weight_scale_inv") for n in ck.names())
    w = ck.get(name)
    with pytest.raises(StoredFormatError, match="down_proj.weight' is stored quantized"):
        np.asarray(w)  # a family reading it as a plain array: refused by name, no dense copy
    from dflash2_numba.numerics import as_f32

    with pytest.raises(StoredFormatError):
        as_f32(w)
    assert isinstance(w, StoredWeight) and w.arrays["w"].dtype == np.uint8 and w.nbytes == 64 * 128 + 4 * 2 * 4 + 16 == ck.stored_bytes(name)


@pytest.mark.parametrize("edit,words", [
    (lambda q: q.update(quant_method="bitsandbytes"), ("quant_method", "bitsandbytes", "fp8")),
    (lambda q: q.update(fmt="e5m2"), ("quantization_config.fmt", "e4m3", "e5m2")),
    (lambda q: q.update(activation_scheme="static"), ("activation_scheme", "static")),
    (lambda q: q.update(scale_fmt="ue8m0"), ("scale_fmt", "ue8m0")),
    (lambda q: q.pop("weight_block_size"), ("weight_block_size", "absent")),
    (lambda q: q.update(weight_block_size=[64, 64]), ("weight_scale_inv", "[1, 2]", "[2, 4]")),
    (lambda q: q.update(modules_to_not_convert=["lm_head", "mlp"]), ("modules_to_not_convert", "mlp.down_proj")),
])
def test_fp8_refusals_name_key_expected_actual(fp8_dir, tmp_path, edit, words):
    d = _edit_config(fp8_dir / "fp8", tmp_path / "x", edit)
    with pytest.raises(StoredFormatError) as e:
        load_target(d)
    msg = str(e.value)
    assert all(w in msg for w in words), msg


def test_f8_without_config_is_unknown_dtype(fp8_dir, tmp_path):
    d = _edit_config(fp8_dir / "fp8", tmp_path / "x", lambda q: None)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownDTypeError, match="F8_E4M3"):
        open_checkpoint(d)


def test_requantizing_a_stored_checkpoint_is_refused(fp8_dir):
    with pytest.raises(GenerationArgumentError, match="stored pre-quantized"):
        load_target(fp8_dir / "fp8", quantize="q8_0")


def _ct_config(**over):
    q = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"], "config_groups": {"group_0": {
             "targets": ["Linear"], "input_activations": None, "output_activations": None,
             "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}}}
    q.update(over)
    return q


@pytest.mark.parametrize("over,words", [
    ({"format": "nvfp4-pack-quantized"}, ("format", "nvfp4-pack-quantized", "pack-quantized")),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, ("sparsity_config", "2:4", "sparse-24-bitmask")),
    ({"kv_cache_scheme": {"num_bits": 8}}, ("kv_cache_scheme",)),
    ({"ignore": []}, ("weight_shape", "missing")),  # lm_head targeted by "Linear", stored dense
    ({"quantization_status": "frozen"}, ("quantization_status", "compressed", "frozen")),
])
def test_ct_refusals(fp8_dir, tmp_path, over, words):
    """A compressed-tensors config over the bf16 target: every targeted linear must be stored
    packed, so each refusal comes before any tensor is read."""
    d = _edit_config(fp8_dir / "t", tmp_path / "x", lambda q: None)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = _ct_config(**over)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StoredFormatError) as e:
        open_checkpoint(d)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_ct_fp8_tensor_activations_refused(fp8_dir, tmp_path):
    d = _edit_config(fp8_dir / "t", tmp_path / "x", lambda q: None)
    cfg = json.loads((d / "config.json").read_text())
    q = _ct_config(format="float-quantized")
    q["config_groups"]["group_0"]["weights"] = {"num_bits": 8, "type": "float", "strategy": "channel"}
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "dynamic": False}  # static scales
    cfg["quantization_config"] = q
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StoredFormatError, match="input_activations"):
        open_checkpoint(d)


def test_awq_gptq_refusals(fp8_dir, tmp_path):
    qc.awq_checkpoint(fp8_dir / "t", tmp_path / "awq", group=32)
    d = _edit_config(tmp_path / "awq", tmp_path / "awq2", lambda q: q.update(version="gemv"))
    with pytest.raises(StoredFormatError, match='version: expected "gemm"'):
        open_checkpoint(d)
    qc.gptq_checkpoint(fp8_dir / "t", tmp_path / "gptq", group=32)
    d = _edit_config(tmp_path / "gptq", tmp_path / "gptq2", lambda q: q.update(bits=8))
    with pytest.raises(StoredFormatError, match="bits: expected 4, got 8"):
        open_checkpoint(d)
    d = _edit_config(tmp_path / "gptq", tmp_path / "gptq3", lambda q: q.update(checkpoint_format="marlin"))
    with pytest.raises(StoredFormatError, match="checkpoint_format"):
        open_checkpoint(d)


def test_inspect_names_stored_formats(fp8_dir, tmp_path):
    qc.gptq_checkpoint(fp8_dir / "t", tmp_path / "gptq", group=32, desc_act=True)
    for d, label in ((fp8_dir / "fp8", "fp8-e4m3 block 32x32"), (tmp_path / "gptq", "gptq-int4 g32 desc_act")):
        rep = inspect_model(d, hash_files=False)
        assert rep["inventory_error"] is None
        groups = rep["stored_formats"]
        assert label in groups and groups[label]["tensors"] == 7 * 4 and groups[label]["resident_bytes"] > 0
        text = format_inspect(rep)
        assert label in text and "stored" in text
        dense = inspect_model(fp8_dir / "t", hash_files=False)
        assert groups[label]["resident_bytes"] < 0.6 * 2 * groups[label]["parameters"]  # vs bf16 panels
        assert rep["resident_bytes"]["stored"] < dense["resident_bytes"]["bf16"]
