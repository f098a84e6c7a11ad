"""Zero-copy memory-mapped safetensors: single file and sharded (spec §2.1, §6).

A safetensors file is: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
payload; offsets are relative to the payload start. Tensors are returned as numpy views of
one `np.memmap` per file, so a 60 GB checkpoint costs no RAM until pages are touched.
BF16 is returned as `uint16` (the bits), F16 as float16, F32 as float32.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import errno
import os
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
from .input_files import MAX_CONFIG_BYTES, read_json_object
from .quant.stored import STORED_DTYPES  # pre-quantized checkpoints (hook: quant/stored.py)

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


def check_weight_file(path: Path, what: str = "safetensors file") -> Path:
    """`path` must be a regular file we can open: a directory, a dangling symlink or a symlink
    loop in its place is refused by name (`Path.is_file` would just say False)."""
    try:
        os.stat(path)  # follows symlinks: ENOENT (dangling) / ELOOP (loop) land here
    except OSError as e:
        if os.path.islink(path):
            link = os.readlink(path)
            why = "a symlink loop" if e.errno == errno.ELOOP else f"a dangling symlink to {link!r}"
            raise CheckpointNotFoundError(f"{path}: {what} is {why} ({e.strerror})") from e
        raise CheckpointNotFoundError(f"{path}: {what} cannot be read ({e.strerror})") from e
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise CheckpointNotFoundError(f"{path}: {what} is {kind}, expected a regular file")
    return path


def _parse_header(path: Path, raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptHeaderError(f"{path}: header is not valid JSON ({e})") from e
    except RecursionError as e:  # json recurses once per nesting level
        raise CorruptHeaderError(f"{path}: header JSON nested too deeply to parse (corrupt)") from e
    if not isinstance(header, dict):
        raise CorruptHeaderError(f"{path}: header is not a JSON object")
    meta = header.get("__metadata__", {})
    # the safetensors format (and its reference reader) allows only string -> string metadata
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptHeaderError(f"{path}: __metadata__ must map strings to strings, got {meta!r:.200}")
    return header


def _entry(path: Path, name: str, entry) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, types checked."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptHeaderError(f"{path}: tensor '{name}': malformed header entry {entry!r:.200}") from e
    if not isinstance(dtype, str):
        raise CorruptHeaderError(f"{path}: tensor '{name}': dtype {dtype!r:.100} must be a string")
    # JSON ints only: a float or string here would make the byte arithmetic below lie
    if not all(_is_count(v) for v in (*shape, begin, end)):
        raise CorruptHeaderError(
            f"{path}: tensor '{name}': shape {list(shape)!r:.200} and data_offsets {[begin, end]!r:.200} "
            "must be non-negative integers"
        )
    return dtype, shape, begin, end


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], payload_size: int) -> None:
    """The data offsets must tile the payload exactly: sorted by position, the first begins at
    0, each ends where the next begins, the last ends at the payload's end. A gap, an overlap
    or a wrong header length (which shifts every tensor) is a corrupt file, never a load."""
    pos, prev = 0, "the payload start"
    for begin, end, name in sorted(spans):
        if begin != pos:
            gap = "overlaps" if begin < pos else "leaves a gap after"
            raise DataOffsetError(
                f"{path}: tensor '{name}' data_offsets begin at {begin}, expected {pos}: it {gap} "
                f"{prev} (offsets must tile the payload exactly)")
        pos, prev = end, f"tensor '{name}'"
    if pos != payload_size:
        raise DataOffsetError(
            f"{path}: tensors end at byte {pos} of a payload of {payload_size} bytes "
            f"({payload_size - pos:+d} bytes unaccounted for: truncated, padded, or a wrong header length)")


def read_header(path: Path, stored_dtypes: bool = False) -> dict[str, TensorInfo]:
    """Parse and validate one file's header. Nothing is mapped yet. `stored_dtypes`: also accept
    the dtypes only a quantized checkpoint holds (F8_E4M3, I8, U8, I32, I64; quant/stored.py),
    for a directory whose config.json has a quantization_config."""
    readable = {**DTYPES, **STORED_DTYPES} if stored_dtypes else DTYPES
    check_weight_file(path)
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
    header = _parse_header(path, raw)
    payload_start, payload_size = 8 + n, size - 8 - n
    infos, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(path, name, entry)
        if dtype not in readable:
            raise UnknownDTypeError(
                f"{path}: tensor '{name}' has dtype {dtype!r:.100}; readable dtypes: {', '.join(DTYPES)}"
            )
        if not (0 <= begin <= end <= payload_size):
            raise DataOffsetError(
                f"{path}: tensor '{name}' data_offsets [{begin}, {end}] outside the payload of {payload_size} bytes"
            )
        expected = math.prod(shape) * np.dtype(readable[dtype]).itemsize  # Python ints: no overflow
        if end - begin != expected:
            raise DataOffsetError(
                f"{path}: tensor '{name}' spans {end - begin} bytes, expected {expected} for {dtype} {list(shape)}"
            )
        spans.append((begin, end, name))
        infos[name] = TensorInfo(name, dtype, shape, path, payload_start + begin, payload_start + end)
    _check_tiling(path, spans, payload_size)
    return infos


class Checkpoint:
    """All tensors of a model directory, memory-mapped lazily, one map per file."""

    def __init__(self, directory: Path, tensors: dict[str, TensorInfo], stored: dict | None = None,
                 raw: dict[str, TensorInfo] | None = None):
        """`stored` (quant/stored.py): logical name -> Entry of a pre-quantized linear; `tensors`
        then holds the logical view (each quantized `X.weight` as one [out, in] tensor, its
        auxiliary tensors hidden) and `raw` every tensor of the files."""
        self.directory = directory
        self.tensors = tensors
        self.stored = stored or {}
        self.raw_tensors = raw if raw is not None else tensors
        self._maps: dict[Path, np.memmap] = {}

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.raw_tensors.values()})

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def parameter_count(self) -> int:
        """Elements of every tensor in the checkpoint (ignored vision / MTP tensors included)."""
        return sum(int(np.prod(t.shape, dtype=np.int64)) for t in self.tensors.values())

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorsError(f"{self.directory}: tensor '{name}' not in the checkpoint")
        return self.tensors[name]

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of the tensor (uint16 for BF16); a pre-quantized linear's
        `X.weight` is a quant.stored.StoredWeight over its stored arrays."""
        t = self.info(name)
        if name in self.stored:
            return self.stored[name].load(self.get_raw)
        return self.get_raw(name)

    def get_raw(self, name: str) -> np.ndarray:
        """A tensor exactly as the file stores it (also the auxiliary tensors of quantized linears)."""
        if name not in self.raw_tensors:
            raise MissingTensorsError(f"{self.directory}: tensor '{name}' not in the checkpoint")
        t = self.raw_tensors[name]
        if t.file not in self._maps:
            self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        raw = self._maps[t.file][t.begin : t.end]
        return np.ndarray(t.shape, dtype={**DTYPES, **STORED_DTYPES}[t.dtype], buffer=raw)

    def rows_table(self, name: str) -> np.ndarray:
        """`get(name)` for a table read by rows on demand (the token embedding), its pages read
        into the OS page cache now (madvise WILLNEED, then one byte per page: llama.cpp
        prefetches its mmap the same way). Otherwise a decode step's first use of a token waits
        for a disk read: 8-17 ms a row on the Qwen3-30B-shaped bench, whose load had pushed the
        table out of the page cache. The table stays in the page cache (2 V H bytes), not in the
        process's own memory."""
        table = self.get(name)
        t = self.raw_tensors[name]
        m = getattr(self._maps.get(t.file), "_mmap", None)
        if m is not None and hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            start = t.begin - t.begin % mmap.PAGESIZE
            try:
                m.madvise(mmap.MADV_WILLNEED, start, t.end - start)
            except (OSError, ValueError):  # advice only: a platform that refuses it reads on demand
                pass
        if isinstance(table, np.ndarray) and table.size:
            int(table.reshape(-1).view(np.uint8)[::mmap.PAGESIZE].sum())  # touch every page once
        return table

    def stored_bytes(self, name: str) -> int | None:
        """Resident bytes of a pre-quantized linear once loaded (None: not one)."""
        e = self.stored.get(name)
        return None if e is None else e.resident

    def require(self, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] | set = ()) -> None:
        """Inventory check: every expected tensor present with its shape, nothing unknown.

        `expected` maps name -> shape; names in `optional` may be absent. An `ExpectedTensors`
        (config.py) also carries its own tolerated names and per-tensor shape notes; one with
        `ignored_prefixes` (prefix -> why) tolerates every name under those prefixes, unread."""
        if hasattr(expected, "pick"):  # ExpectedTensors: alternative layouts resolved against the file
            expected = expected.pick(self.tensors)
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
    weight_map = read_json_object(index, MAX_CONFIG_BYTES, CorruptHeaderError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CorruptHeaderError(f"{index}: weight_map must map tensor names to file names")
    for name, f in weight_map.items():  # a shard lives IN the directory: no '/', no '..'
        if f in ("", ".", "..") or "/" in f or "\\" in f or "\0" in f:
            raise CorruptHeaderError(f"{index}: tensor '{name}' names the shard {f!r}, expected a file name "
                                     "inside the checkpoint directory")
    return weight_map


def _shard_files(directory: Path) -> list[Path]:
    """Files named by model.safetensors.index.json, or the single model file."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = read_weight_map(index)
        files = [directory / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not os.path.lexists(f):
                raise CheckpointNotFoundError(f"{f}: shard named by {index} does not exist")
            check_weight_file(f, f"shard named by {index.name}")
        return files
    single = directory / SINGLE_NAME
    if os.path.lexists(single):  # present in the listing: it must be a readable regular file
        return [check_weight_file(single)]
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return [check_weight_file(f) for f in others]
    raise CheckpointNotFoundError(f"{directory}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors file")


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Read every header of a model directory (single file or sharded); map nothing yet."""
    directory = Path(directory)
    refuse_gguf(directory)
    if not directory.exists():
        raise CheckpointNotFoundError(f"{directory}: checkpoint directory does not exist")
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"{directory}: expected a model directory, got a file")
    from .quant.stored import read_quantization_config

    qcfg = read_quantization_config(directory)
    tensors: dict[str, TensorInfo] = {}
    for path in _shard_files(directory):
        for name, info in read_header(path, stored_dtypes=qcfg is not None).items():
            if name in tensors:
                raise CorruptHeaderError(f"{path}: tensor '{name}' also in {tensors[name].file}")
            tensors[name] = info
    index = directory / INDEX_NAME
    if index.exists():
        # the index is what loaders trust: every tensor it names must be in the shard it names
        wrong = sorted(n for n, f in read_weight_map(index).items() if n not in tensors or tensors[n].file.name != f)
        if wrong:
            raise MissingTensorsError(
                f"{index}: {len(wrong)} tensor(s) not found in the shard the index names: {', '.join(wrong)}"
            )
    if qcfg is not None:
        return _stored_view(directory, tensors, qcfg)
    return Checkpoint(directory, tensors)


def _stored_view(directory: Path, raw: dict[str, TensorInfo], qcfg: dict) -> Checkpoint:
    """A pre-quantized checkpoint (quant/stored.py): each quantized linear becomes one logical
    `X.weight` [out, in] whose dtype names its stored format; the tensors it consumes leave the
    inventory the families check."""
    from .quant.stored import consumed, plan_stored, weight_dtype_rule

    entries = plan_stored(directory, raw, Checkpoint(directory, raw).get_raw, qcfg)
    weight_dtype_rule(raw, entries, directory / "config.json")
    used = consumed(entries)
    logical = {n: t for n, t in raw.items() if n not in used}
    for name, e in entries.items():
        logical[name] = TensorInfo(name, e.format, tuple(e.shape), e.file, 0, 0)
    return Checkpoint(directory, logical, stored=entries, raw=raw)
