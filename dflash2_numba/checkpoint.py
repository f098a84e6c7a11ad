"""Zero-copy memory-mapped safetensors: single file and sharded (DESIGN §2.1, §6).

A safetensors file is: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
payload; offsets are relative to the payload start. Tensors are returned as numpy views of
one `np.memmap` per file, so a 60 GB checkpoint costs no RAM until pages are touched.
BF16 is returned as `uint16` (the bits), F16 as float16, F32 as float32.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import refuse_gguf
from .errors import (
    CheckpointNotFoundError,
    CorruptHeaderError,
    DataOffsetError,
    MissingTensorsError,
    TensorShapeError,
    UnexpectedTensorsError,
    UnknownDTypeError,
)

# safetensors dtype -> numpy dtype we hand out (BF16 stays as its bits)
DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors spelling: "BF16", "F16", "F32"
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset in the file
    end: int


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header. Nothing is mapped yet."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptHeaderError(f"{path}: truncated: {size} bytes, no 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CorruptHeaderError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt)")
        if 8 + n > size:
            raise CorruptHeaderError(
                f"{path}: header length {n} + 8 exceeds the file size {size} (truncated or corrupt)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptHeaderError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CorruptHeaderError(f"{path}: header is not a JSON object")
    payload_start, payload_size = 8 + n, size - 8 - n
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptHeaderError(f"{path}: tensor '{name}': malformed header entry {entry!r}") from e
        # JSON ints only: a float or string here would make the byte arithmetic below lie
        if not all(_is_count(v) for v in (*shape, begin, end)):
            raise CorruptHeaderError(
                f"{path}: tensor '{name}': shape {list(shape)} and data_offsets {[begin, end]} "
                "must be non-negative integers"
            )
        if dtype not in DTYPES:
            raise UnknownDTypeError(
                f"{path}: tensor '{name}' has dtype {dtype!r}; readable dtypes: {', '.join(DTYPES)}"
            )
        if not (0 <= begin <= end <= payload_size):
            raise DataOffsetError(
                f"{path}: tensor '{name}' data_offsets [{begin}, {end}] outside the payload of {payload_size} bytes"
            )
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if end - begin != expected:
            raise DataOffsetError(
                f"{path}: tensor '{name}' spans {end - begin} bytes, expected {expected} for {dtype} {list(shape)}"
            )
        infos[name] = TensorInfo(name, dtype, shape, path, payload_start + begin, payload_start + end)
    return infos


class Checkpoint:
    """All tensors of a model directory, memory-mapped lazily, one map per file."""

    def __init__(self, directory: Path, tensors: dict[str, TensorInfo]):
        self.directory = directory
        self.tensors = tensors
        self._maps: dict[Path, np.memmap] = {}

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorsError(f"{self.directory}: tensor '{name}' not in the checkpoint")
        return self.tensors[name]

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of the tensor (uint16 for BF16)."""
        t = self.info(name)
        if t.file not in self._maps:
            self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        raw = self._maps[t.file][t.begin : t.end]
        return np.ndarray(t.shape, dtype=DTYPES[t.dtype], buffer=raw)

    def require(self, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] | set = ()) -> None:
        """Inventory check: every expected tensor present with its shape, nothing unknown.

        `expected` maps name -> shape; names in `optional` may be absent. An `ExpectedTensors`
        (config.py) also carries its own tolerated names and per-tensor shape notes; one with
        `ignored_prefixes` (prefix -> why) tolerates every name under those prefixes, unread."""
        optional = set(optional) | getattr(expected, "optional", set())
        if hasattr(expected, "ignored"):  # ExpectedTensors: names under its ignored prefixes
            optional |= set(expected.ignored(self.tensors))
        notes = getattr(expected, "notes", {})
        missing = sorted(n for n in expected if n not in self.tensors and n not in optional)
        if missing:
            raise MissingTensorsError(f"{self.directory}: missing {len(missing)} required tensor(s): {', '.join(missing)}")
        extra = sorted(n for n in self.tensors if n not in expected and n not in optional)
        if extra:
            raise UnexpectedTensorsError(f"{self.directory}: {len(extra)} unexpected tensor(s): {', '.join(extra)}")
        for name, shape in expected.items():
            if name in self.tensors and self.tensors[name].shape != tuple(shape):
                why = f" ({notes[name]})" if name in notes else ""
                raise TensorShapeError(
                    f"{self.tensors[name].file}: tensor '{name}' has shape {list(self.tensors[name].shape)}, "
                    f"expected {list(shape)}{why}"
                )

    def sha256(self) -> dict[str, str]:
        """sha256 of every file of the checkpoint (for `inspect`)."""
        out = {}
        for path in self.files:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[path.name] = h.hexdigest()
        return out


def read_weight_map(index: Path) -> dict[str, str]:
    """`{"weight_map": {tensor: file}}` of a sharded checkpoint."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CorruptHeaderError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CorruptHeaderError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def _shard_files(directory: Path) -> list[Path]:
    """Files named by model.safetensors.index.json, or the single model file."""
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = read_weight_map(index)
        files = [directory / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointNotFoundError(f"{f}: shard named by {index} does not exist")
        return files
    single = directory / SINGLE_NAME
    if single.is_file():
        return [single]
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return others
    raise CheckpointNotFoundError(f"{directory}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors file")


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Read every header of a model directory (single file or sharded); map nothing yet."""
    directory = Path(directory)
    refuse_gguf(directory)
    if not directory.exists():
        raise CheckpointNotFoundError(f"{directory}: checkpoint directory does not exist")
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"{directory}: expected a model directory, got a file")
    tensors: dict[str, TensorInfo] = {}
    for path in _shard_files(directory):
        for name, info in read_header(path).items():
            if name in tensors:
                raise CorruptHeaderError(f"{path}: tensor '{name}' also in {tensors[name].file}")
            tensors[name] = info
    index = directory / INDEX_NAME
    if index.is_file():
        # the index is what loaders trust: every tensor it names must be in the shard it names
        wrong = sorted(n for n, f in read_weight_map(index).items() if n not in tensors or tensors[n].file.name != f)
        if wrong:
            raise MissingTensorsError(
                f"{index}: {len(wrong)} tensor(s) not found in the shard the index names: {', '.join(wrong)}"
            )
    return Checkpoint(directory, tensors)
