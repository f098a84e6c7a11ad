"""Safetensors reader (spec §2.1, §6): every refusal by type and message, zero-copy views,
BF16/F16/F32 bits against independent writers, sharded checkpoints, and `inspect`.

Broken files are written by hand here (8-byte LE header length + JSON + payload), so the
reader is never checked against itself."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file as np_save_file

from dflash2_numba.checkpoint import open_checkpoint, read_header
from dflash2_numba.config import resolve_draft_config
from dflash2_numba.families.qwen3 import load_target_config
from dflash2_numba.inventory import expected_draft_tensors
from dflash2_numba.errors import (
    CheckpointNotFoundError,
    CorruptHeaderError,
    DataOffsetError,
    GGUFNotSupportedError,
    MissingTensorsError,
    TensorShapeError,
    UnexpectedTensorsError,
    UnknownDTypeError,
)
from dflash2_numba.inspect_model import format_inspect, inspect_model


# ---------------------------------------------------------------- hand-written files
def write_raw(path: Path, header: dict, payload: bytes) -> Path:
    """A safetensors file byte by byte: <u64 LE n> <n bytes JSON> <payload>."""
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + payload)
    return path


def write_tensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    """Valid file from {name: (safetensors dtype, array)}; BF16 given as uint16 bits."""
    header, payload = {}, b""
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [len(payload), len(payload) + len(data)]}
        payload += data
    return write_raw(path, header, payload)


def one_f32(tmp_path: Path, name="w", shape=(2, 3)) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    np_save_file({name: np.zeros(shape, np.float32)}, str(d / "model.safetensors"))
    return d


# ---------------------------------------------------------------- missing things
def test_missing_directory(tmp_path):
    d = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as e:
        open_checkpoint(d)
    assert str(d) in str(e.value)
    assert isinstance(e.value, FileNotFoundError)


def test_file_instead_of_directory(tmp_path):
    f = one_f32(tmp_path) / "model.safetensors"
    with pytest.raises(CheckpointNotFoundError, match="expected a model directory") as e:
        open_checkpoint(f)
    assert str(f) in str(e.value)


def test_no_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError) as e:
        open_checkpoint(tmp_path)
    assert str(tmp_path) in str(e.value) and "model.safetensors" in str(e.value)


def test_shard_named_by_index_missing(tmp_path):
    np_save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointNotFoundError) as e:
        open_checkpoint(tmp_path)
    msg = str(e.value)
    assert "model-00002-of-00002.safetensors" in msg and "model.safetensors.index.json" in msg


def test_index_names_tensor_absent_from_its_shard(tmp_path):
    np_save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    np_save_file({"b": np.zeros(2, np.float32)}, str(tmp_path / "s2.safetensors"))
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}  # b is really in s2
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingTensorsError, match=r"not found in the shard the index names: b$"):
        open_checkpoint(tmp_path)


def test_corrupt_index(tmp_path):
    np_save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CorruptHeaderError, match="model.safetensors.index.json"):
        open_checkpoint(tmp_path)


def test_gguf_file_refused_by_name(tmp_path):
    f = tmp_path / "qwen3-8b-q4_k_m.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(GGUFNotSupportedError) as e:
        open_checkpoint(f)
    assert str(f) in str(e.value) and "GGUF" in str(e.value)
    with pytest.raises(GGUFNotSupportedError) as e:  # config.json path says the same
        load_target_config(f)
    assert str(f) in str(e.value)


def test_directory_holding_only_gguf_refused_by_name(tmp_path):
    f = tmp_path / "draft.gguf"
    f.write_bytes(b"GGUF")
    for load in (open_checkpoint, load_target_config):
        with pytest.raises(GGUFNotSupportedError) as e:
            load(tmp_path)
        assert str(f) in str(e.value)


# ---------------------------------------------------------------- broken headers
def test_truncated_file_of_four_bytes(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x10\x00\x00\x00")
    with pytest.raises(CorruptHeaderError) as e:
        open_checkpoint(tmp_path)
    assert str(f) in str(e.value) and "4 bytes" in str(e.value)


def test_header_length_larger_than_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1000) + b'{"a": 1}')
    with pytest.raises(CorruptHeaderError) as e:
        read_header(f)
    msg = str(e.value)
    assert str(f) in msg and "1000" in msg and str(f.stat().st_size) in msg


def test_corrupt_header_json(tmp_path):
    blob = b'{"w": {"dtype": "F32", "shape": [1], '  # cut mid-object
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 4)
    with pytest.raises(CorruptHeaderError, match="not valid JSON") as e:
        open_checkpoint(tmp_path)
    assert str(f) in str(e.value)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [1]},  # no data_offsets
        {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]},  # floats
        {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},  # negative dim
        "F32",  # not an object
    ],
)
def test_malformed_entry(tmp_path, entry):
    f = write_raw(tmp_path / "model.safetensors", {"w": entry}, b"\0" * 4)
    with pytest.raises(CorruptHeaderError) as e:
        read_header(f)
    assert str(f) in str(e.value) and "'w'" in str(e.value)


@pytest.mark.parametrize("offsets", [[0, 16], [8, 24], [-4, 12]])
def test_data_offsets_outside_file(tmp_path, offsets):
    # 12-byte payload; the 16-byte F32 [4] claims bytes past it (or before it)
    f = write_raw(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": offsets}}, b"\0" * 12)
    err = DataOffsetError if offsets[0] >= 0 else CorruptHeaderError
    with pytest.raises(err) as e:
        read_header(f)
    msg = str(e.value)
    assert str(f) in msg and "'w'" in msg
    if err is DataOffsetError:
        assert str(offsets) in msg and "12 bytes" in msg


def test_byte_size_mismatch(tmp_path):
    # F32 [2, 3] needs 24 bytes; the entry spans 20
    header = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}
    f = write_raw(tmp_path / "model.safetensors", header, b"\0" * 24)
    with pytest.raises(DataOffsetError) as e:
        read_header(f)
    msg = str(e.value)
    assert "'w'" in msg and "20 bytes" in msg and "expected 24" in msg and "[2, 3]" in msg


@pytest.mark.parametrize("dtype", ["I8", "F8_E4M3", "F64", "U16"])
def test_unknown_dtype(tmp_path, dtype):
    header = {"w": {"dtype": dtype, "shape": [4], "data_offsets": [0, 4]}}
    f = write_raw(tmp_path / "model.safetensors", header, b"\0" * 4)
    with pytest.raises(UnknownDTypeError) as e:
        open_checkpoint(tmp_path)
    msg = str(e.value)
    assert str(f) in msg and "'w'" in msg and repr(dtype) in msg and "BF16" in msg


def test_metadata_entry_is_ignored(tmp_path):
    d = tmp_path
    np_save_file({"w": np.arange(3, dtype=np.float32)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert open_checkpoint(d).names() == ["w"]


# ---------------------------------------------------------------- inventory (require)
def inventory_ckpt(tmp_path):
    np_save_file(
        {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32), "c": np.zeros(1, np.float32)},
        str(tmp_path / "model.safetensors"),
    )
    return open_checkpoint(tmp_path)


def test_require_passes_exact_inventory(tmp_path):
    inventory_ckpt(tmp_path).require({"a": (2, 3), "b": (4,), "c": (1,)})


def test_require_lists_missing_tensors(tmp_path):
    ckpt = inventory_ckpt(tmp_path)
    with pytest.raises(MissingTensorsError) as e:
        ckpt.require({"a": (2, 3), "b": (4,), "c": (1,), "x.weight": (1,), "y.weight": (2,)})
    assert "2 required" in str(e.value) and "x.weight, y.weight" in str(e.value)
    ckpt.require({"a": (2, 3), "b": (4,), "c": (1,), "x.weight": (1,)}, optional={"x.weight"})


def test_require_lists_unexpected_tensors(tmp_path):
    ckpt = inventory_ckpt(tmp_path)
    with pytest.raises(UnexpectedTensorsError) as e:
        ckpt.require({"a": (2, 3)})
    assert "2 unexpected" in str(e.value) and "b, c" in str(e.value)
    ckpt.require({"a": (2, 3), "b": (4,)}, optional={"c"})  # tolerated when optional


def test_require_names_shape_mismatch(tmp_path):
    ckpt = inventory_ckpt(tmp_path)
    with pytest.raises(TensorShapeError) as e:
        ckpt.require({"a": (3, 2), "b": (4,), "c": (1,)})
    msg = str(e.value)
    assert "'a'" in msg and "shape [2, 3]" in msg and "expected [3, 2]" in msg
    assert "model.safetensors" in msg


def test_missing_tensor_lookup(tmp_path):
    with pytest.raises(MissingTensorsError, match="'zz'"):
        inventory_ckpt(tmp_path).get("zz")


# ---------------------------------------------------------------- values and zero-copy
def test_zero_copy_view_of_memmap(tmp_path):
    w = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    np_save_file({"w": w}, str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    a = ckpt.get("w")
    np.testing.assert_array_equal(a, w)
    assert not a.flags.owndata and not a.flags.writeable
    base = a
    while not isinstance(base, np.memmap):  # the base chain ends in the file's map
        base = base.base
        assert base is not None, "array is not backed by a memmap"
    assert np.shares_memory(a, base)
    assert ckpt.get("w").ctypes.data == a.ctypes.data  # same pages, no copy per call


def _torch():
    """torch and safetensors' torch writer, or a skip (only the two torch cross-checks need them)."""
    torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch cross-check needs it")
    from safetensors.torch import save_file

    return torch, save_file


def test_bf16_bits_match_torch(tmp_path):
    torch, torch_save_file = _torch()
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(6, 10, generator=g) * 3).to(torch.bfloat16)
    t[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    torch_save_file({"w": t}, str(tmp_path / "model.safetensors"))
    a = open_checkpoint(tmp_path).get("w")
    assert a.dtype == np.uint16 and a.shape == (6, 10)
    expected = t.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(a, expected)


@pytest.mark.parametrize("ndtype", [np.float16, np.float32])
def test_f16_f32_values_match_torch(tmp_path, ndtype):
    torch, torch_save_file = _torch()
    tdtype = {np.float16: torch.float16, np.float32: torch.float32}[ndtype]
    t = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1)).to(tdtype)
    torch_save_file({"w": t}, str(tmp_path / "model.safetensors"))
    a = open_checkpoint(tmp_path).get("w")
    assert a.dtype == ndtype
    np.testing.assert_array_equal(a.view(np.uint8), t.numpy().view(np.uint8))  # same bits


def test_sharded_checkpoint(tmp_path):
    rng = np.random.default_rng(2)
    part1 = {"model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(np.float32)}
    part2 = {"model.norm.weight": rng.standard_normal(4).astype(np.float32),
             "lm_head.weight": rng.standard_normal((8, 4)).astype(np.float32)}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    np_save_file(part1, str(tmp_path / names[0]))
    np_save_file(part2, str(tmp_path / names[1]))
    weight_map = {n: names[0] for n in part1} | {n: names[1] for n in part2}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "model.safetensors").write_bytes(b"stale")  # the index wins over a stray single file

    ckpt = open_checkpoint(tmp_path)
    assert ckpt.names() == sorted(weight_map)
    for name, arr in (part1 | part2).items():
        np.testing.assert_array_equal(ckpt.get(name), arr)
        assert ckpt.info(name).file.name == weight_map[name]
    assert [f.name for f in ckpt.files] == list(names)
    assert ckpt.sha256() == {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in names}


def test_duplicate_tensor_across_shards(tmp_path):
    np_save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "x1.safetensors"))
    np_save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "x2.safetensors"))
    with pytest.raises(CorruptHeaderError, match="'a' also in"):
        open_checkpoint(tmp_path)


# ---------------------------------------------------------------- inspect
def tiny_dflash2_config(vocab=40):
    """The published Muse-Glimmer layout scaled down: 5 layers, 5 taps, taps=2, S=16."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_target_layers": 12, "vocab_size": vocab,
        "layer_types": ["sliding_attention"] * 5, "sliding_window": 64,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "dflash_config": {"block_size": 8, "mask_token_id": vocab - 1, "target_layer_ids": [1, 3, 5, 7, 9],
                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 6, "selector_top_k": 4,
                          "output_multiplier": 0.5, "final_logit_softcapping": 20.0},
    }


def write_draft(d: Path, raw: dict, vocab: int, seed=3, extra=None) -> dict[str, np.ndarray]:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    cfg = resolve_draft_config(raw)
    rng = np.random.default_rng(seed)
    arrays = {n: rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for n, s in expected_draft_tensors(cfg, vocab).items()}
    arrays |= extra or {}
    write_tensors(d / "model.safetensors", {n: ("BF16", a) for n, a in arrays.items()})
    return arrays


def test_inspect_dflash2_draft(tmp_path):
    raw = tiny_dflash2_config()
    arrays = write_draft(tmp_path / "draft", raw, vocab=40)
    report = inspect_model(tmp_path / "draft")
    json.loads(json.dumps(report))  # serialisable as is

    assert report["kind"] == "dflash2" and report["architecture"] == "DFlash2DraftModel"
    assert report["config"]["target_layer_ids"] == [1, 3, 5, 7, 9]
    assert report["config"]["output_multiplier"] == 0.5
    assert report["inventory_error"] is None
    assert {t["name"]: (t["dtype"], tuple(t["shape"])) for t in report["tensors"]} == {
        n: ("BF16", a.shape) for n, a in arrays.items()
    }
    assert report["num_parameters"] == sum(a.size for a in arrays.values())
    assert report["num_bytes"] == sum(a.nbytes for a in arrays.values())
    assert report["sha256"] == {
        n: hashlib.sha256((tmp_path / "draft" / n).read_bytes()).hexdigest() for n in ("config.json", "model.safetensors")
    }
    text = format_inspect(report)
    assert "dflash2 (DFlash2DraftModel)" in text
    assert "candidate_selector.predecessor_codebook" in text and "[40, 6]" in text
    assert report["sha256"]["model.safetensors"] in text


def test_inspect_reports_bad_inventory_without_raising(tmp_path):
    raw = tiny_dflash2_config()
    write_draft(tmp_path / "d", raw, vocab=40, extra={"lm_head.weight": np.zeros((40, 32), np.uint16)})
    report = inspect_model(tmp_path / "d", hash_files=False)
    assert report["inventory_error"].startswith("UnexpectedTensorsError") and "lm_head.weight" in report["inventory_error"]
    assert report["sha256"] == {}


def test_inspect_target_hashes_tokenizer_files(tmp_path):
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "tie_word_embeddings": True,
           "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    rng = np.random.default_rng(4)
    shapes = {"model.embed_tokens.weight": (10, 8), "model.norm.weight": (8,),
              "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
              "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (8, 8),
              "model.layers.0.self_attn.v_proj.weight": (8, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
              "model.layers.0.mlp.gate_proj.weight": (16, 8), "model.layers.0.mlp.up_proj.weight": (16, 8),
              "model.layers.0.mlp.down_proj.weight": (8, 16)}
    np_save_file({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}, str(tmp_path / "model.safetensors"))
    report = inspect_model(tmp_path)
    assert report["kind"] == "target" and report["config"]["tie_word_embeddings"] is True
    assert report["inventory_error"] is None
    assert report["num_parameters"] == sum(int(np.prod(s)) for s in shapes.values())
    assert report["num_bytes"] == 4 * report["num_parameters"]
    assert sorted(report["sha256"]) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert report["sha256"]["tokenizer.json"] == hashlib.sha256(b"{}").hexdigest()
    assert "target (LlamaForCausalLM)" in format_inspect(report)


def _resident_pages(a: np.ndarray) -> tuple[int, int]:
    """(resident, total) pages under array a, by mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = a.ctypes.data - a.ctypes.data % page
    n = -(-(a.ctypes.data + a.nbytes - start) // page)
    vec = (ctypes.c_ubyte * n)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec), n


def test_rows_table_reads_the_embedding_into_the_page_cache(tmp_path):
    """The token embedding is read by rows from the file's map; rows_table has its pages read at
    load, so a decode step's first use of a token waits for no disk read. Checked with mincore on
    a table evicted from the page cache first (posix_fadvise DONTNEED), at an offset that is not
    page-aligned; the values are get()'s."""
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("mincore / posix_fadvise: Linux")
    rng = np.random.default_rng(0)
    table = rng.standard_normal((3001, 77)).astype(np.float32)  # 924 KB: 226 pages
    path = tmp_path / "model.safetensors"
    np_save_file({"a.norm": np.ones(5, np.float32), "model.embed_tokens.weight": table}, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    ck = open_checkpoint(tmp_path)
    lazy = ck.get("model.embed_tokens.weight")
    resident, total = _resident_pages(lazy)
    if resident > total // 2:
        pytest.skip(f"this filesystem keeps the file resident ({resident}/{total} pages after DONTNEED)")
    got = ck.rows_table("model.embed_tokens.weight")
    resident, total = _resident_pages(got)  # before anything here reads the values
    assert resident == total, (resident, total)
    assert np.array_equal(got, table) and np.array_equal(got, lazy)
