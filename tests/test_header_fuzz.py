"""Seeded fuzz of the safetensors header (in-process): every mutated file either raises a named
DFlashError subclass from our reader, or loads tensors byte-identical (names, dtypes, shapes,
bytes) to what the `safetensors` library itself reads from the same file. A file we load that
the reference refuses is a failure too: our reader must be at least as strict.
"""

from __future__ import annotations

import collections
import json
import struct

import numpy as np
import pytest
from safetensors import deserialize

from dflash2_numba.checkpoint import Checkpoint, read_header
from dflash2_numba.errors import DFlashError
from dflash2_numba.tiny import save_safetensors

N_CASES = 600
SEED = 20261201


def _base_file(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.integers(0, 2 ** 16, (3, 4), dtype=np.uint16),  # BF16 bits
        "b.bias": rng.standard_normal(5).astype(np.float32),
        "c.half": rng.standard_normal((2, 3)).astype(np.float16),
        "d.empty": np.zeros((0, 4), np.float32),
        "e.scalar": np.array(1.5, np.float32),
    }
    path = save_safetensors(tmp_path / "base.safetensors", tensors, metadata={"k": "v"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _pack(header, payload: bytes, n_delta: int = 0, pad: bool = True) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        head += b" " * (-len(head) % 8)
    return struct.pack("<Q", max(0, len(head) + n_delta)) + head + payload


ODD_VALUES = [0, 1, -1, 2, 7, 10 ** 30, 2 ** 63, 1.5, "3", None, True, [], {}, [1, 2]]
DTYPES = ["BF16", "F16", "F32", "F64", "I64", "U8", "bf16", "", ["BF16"], 4, None]


def mutate(rng: np.random.Generator, header: dict, payload: bytes) -> tuple[str, bytes]:
    """One random mutation -> (kind, file bytes)."""
    h = json.loads(json.dumps(header))  # deep copy
    names = sorted(k for k in h if k != "__metadata__")
    name = names[rng.integers(len(names))]
    kind = ["header_len", "offset", "swap_offsets", "dtype", "shape", "offsets_type", "drop_key",
            "truncate", "append", "flip_byte", "metadata", "duplicate_range", "new_tensor",
            "not_object", "deep", "reshape", "rename", "leading_space", "zero_len"][rng.integers(19)]
    p, n_delta = payload, 0
    if kind == "header_len":
        n_delta = int(rng.choice([-9, -8, -2, -1, 1, 2, 8, 16]))
        return kind, _pack(json.dumps(h).encode() + b" " * 16, p, n_delta, pad=False)
    if kind == "offset":
        i = int(rng.integers(2))
        h[name]["data_offsets"][i] += int(rng.choice([-4, -2, -1, 1, 2, 4, 1000]))
    elif kind == "swap_offsets":
        other = names[rng.integers(len(names))]
        h[name]["data_offsets"], h[other]["data_offsets"] = h[other]["data_offsets"], h[name]["data_offsets"]
    elif kind == "dtype":
        h[name]["dtype"] = DTYPES[rng.integers(len(DTYPES))]
    elif kind == "shape":
        shape = h[name]["shape"]
        if shape and rng.random() < 0.7:
            shape[rng.integers(len(shape))] = ODD_VALUES[rng.integers(len(ODD_VALUES))]
        elif rng.random() < 0.5:
            shape.append(int(rng.choice([1, 2])))
        else:
            h[name]["shape"] = ODD_VALUES[rng.integers(len(ODD_VALUES))]
    elif kind == "offsets_type":
        h[name]["data_offsets"] = [ODD_VALUES[rng.integers(len(ODD_VALUES))], h[name]["data_offsets"][1]] \
            if rng.random() < 0.5 else ODD_VALUES[rng.integers(len(ODD_VALUES))]
    elif kind == "drop_key":
        del h[name][["dtype", "shape", "data_offsets"][rng.integers(3)]]
    elif kind == "truncate":
        p = p[:-int(rng.integers(1, 9))]
    elif kind == "append":
        p = p + b"\0" * int(rng.integers(1, 9))
    elif kind == "flip_byte":
        head = bytearray(json.dumps(h).encode())
        head[rng.integers(len(head))] = int(rng.integers(32, 127))
        return kind, _pack(bytes(head), p)
    elif kind == "metadata":
        h["__metadata__"] = ODD_VALUES[rng.integers(len(ODD_VALUES))] if rng.random() < 0.5 else {"k": 1}
    elif kind == "duplicate_range":
        other = next(o for o in names if o != name)
        h[other] = dict(h[name])
    elif kind == "new_tensor":
        end = len(p)
        h["z.new"] = {"dtype": "U8" if rng.random() < 0.3 else "F32", "shape": [1],
                      "data_offsets": [end, end + int(rng.choice([1, 4]))]}
        p = p + b"\1\2\3\4"[:h["z.new"]["data_offsets"][1] - end]
    elif kind == "not_object":
        return kind, _pack(json.dumps(ODD_VALUES[rng.integers(len(ODD_VALUES))]).encode(), p)
    elif kind == "deep":
        depth = int(rng.choice([10, 2000, 100000]))
        return kind, _pack(b'{"x":' * depth + b"1" + b"}" * depth, p)
    elif kind == "reshape":  # same element count, another shape: a valid file
        if len(h[name]["shape"]) == 2:
            h[name]["shape"] = h[name]["shape"][::-1]
    elif kind == "rename":
        h["renamed." + name] = h.pop(name)
    elif kind == "leading_space":
        return kind, _pack(b"  " + json.dumps(h).encode(), p)
    elif kind == "zero_len":
        return kind, struct.pack("<Q", 0) + p
    return kind, _pack(h, p)


def _ours(path):
    infos = read_header(path)
    ckpt = Checkpoint(path.parent, infos)
    return {name: (infos[name].dtype, list(infos[name].shape), ckpt.get(name).tobytes()) for name in infos}


def _reference(data: bytes):
    return {name: (t["dtype"], list(t["shape"]), bytes(t["data"])) for name, t in deserialize(data)}


def test_header_fuzz(tmp_path):
    header, payload = _base_file(tmp_path)
    rng = np.random.default_rng(SEED)
    counts = collections.Counter()
    kinds_loaded = collections.Counter()
    for i in range(N_CASES):
        kind, data = mutate(rng, header, payload)
        path = tmp_path / f"m{i}.safetensors"
        path.write_bytes(data)
        try:
            ours = _ours(path)
        except DFlashError as e:
            counts[type(e).__name__] += 1
            continue  # any other exception type escapes and fails the test, naming the case
        try:
            ref = _reference(data)
        except Exception as e:  # the reference refuses a file we loaded: we were too lenient
            pytest.fail(f"case {i} ({kind}): we loaded {sorted(ours)} but safetensors refuses: {e}")
        assert ours == ref, f"case {i} ({kind}): tensors differ from safetensors' reading"
        counts["loaded identically"] += 1
        kinds_loaded[kind] += 1
        path.unlink()
    print(f"\nheader fuzz, {N_CASES} mutations:", dict(counts.most_common()), "loaded by kind:", dict(kinds_loaded))
    assert sum(counts.values()) == N_CASES
    # the fuzz must exercise both outcomes, and refusals of several kinds
    assert counts["loaded identically"] >= 20
    assert {"CorruptHeaderError", "DataOffsetError", "UnknownDTypeError"} <= set(counts)


def test_unmutated_file_loads_like_safetensors(tmp_path):
    header, payload = _base_file(tmp_path)
    data = _pack(header, payload)
    path = tmp_path / "ok.safetensors"
    path.write_bytes(data)
    assert _ours(path) == _reference(data)
