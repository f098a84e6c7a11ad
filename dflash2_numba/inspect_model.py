"""`dflash2-decode inspect DIR`: what a checkpoint directory holds, without loading weights.

`inspect_model(path)` returns a JSON-serialisable dict (kind, resolved config, tensor
inventory, parameter count and bytes, sha256 of every file that defines the model);
`format_inspect(report)` renders it as text. Only headers are read, plus the files hashed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .checkpoint import DTYPES, INDEX_NAME, open_checkpoint
from .config import (
    DRAFT_ARCHITECTURES,
    human_bytes,
    read_config_json,
    resolve_draft_config,
)
from .config_checks import architecture_of
from .errors import CheckpointError
from .families import target_family
from .inventory import expected_draft_tensors

# files that change what the model computes or emits, hashed when present
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    INDEX_NAME,
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inspect_model(path: str | Path, hash_files: bool = True) -> dict:
    """Describe a target or draft directory. Raises the loader's typed errors on a broken one."""
    path = Path(path)
    config_path, raw = read_config_json(path)
    # the loaders' own typed reads: `architectures` of the wrong JSON type is a ConfigValueError
    if architecture_of(raw, str(config_path)) in DRAFT_ARCHITECTURES:
        cfg = resolve_draft_config(raw, source=str(config_path))
        kind = cfg.kind
    else:
        family = target_family(raw, str(config_path))  # refuses unknown architectures
        cfg = family.resolve(raw, str(config_path))
        kind = "target"
    ckpt = open_checkpoint(path)

    tensors = []
    n_params = n_bytes = 0
    for name in ckpt.names():
        t = ckpt.info(name)
        count = int(np.prod(t.shape, dtype=np.int64))
        n_params += count
        tensors.append({"name": name, "dtype": t.dtype, "shape": list(t.shape), "file": t.file.name})
    n_bytes = sum(t.end - t.begin for t in ckpt.raw_tensors.values())  # bytes in the files
    stored = stored_summary(ckpt)  # pre-quantized linears (quant/stored.py), {} for others

    # the inventory a loader would demand; reported, not raised, so inspect still describes
    # a checkpoint the loader would refuse
    if kind == "target":
        expected = family.expected_tensors(cfg)
    else:
        vocab = cfg.vocab_size  # the draft's own claim; the loader uses the target's
        expected = expected_draft_tensors(cfg, vocab or 0, include_selector=vocab is not None)
    ignored = expected.ignored(ckpt.names())  # name -> why: present, deliberately not read
    try:
        ckpt.require(expected)
        inventory_error = None
    except CheckpointError as e:
        inventory_error = f"{type(e).__name__}: {e}"

    files = {}
    if hash_files:
        names = [f for f in SIDE_FILES if (path / f).is_file()] + [f.name for f in ckpt.files]
        files = {name: file_sha256(path / name) for name in names}

    extra = family.describe(cfg) if kind == "target" and family.describe else {}
    if kind == "target":  # what the loaded weights hold at each --quantize (quant/formats.py)
        from .quant.formats import resident_bytes

        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if stored:  # loaded as stored: the quantized linears' layouts + the rest as the bf16 path holds it
            rest = resident_bytes([t for t in tensors if t["name"] not in ckpt.stored], ignored, tied)["bf16"]
            extra["resident_bytes"] = {"stored": rest + sum(g["resident_bytes"] for g in stored.values())}
        else:
            extra["resident_bytes"] = resident_bytes(tensors, ignored, tied)
        extra["kv_cache"] = kv_cache_bytes(cfg)
    return {
        **extra,  # family facts (e.g. layer schedule, recurrent-state bytes per request)
        "path": str(path),
        "kind": kind,
        "architecture": cfg.architecture,
        "config": asdict(cfg),
        "tensors": tensors,
        "num_tensors": len(tensors),
        "num_parameters": n_params,
        "num_bytes": n_bytes,
        "dtypes": sorted({t["dtype"] for t in tensors}),
        "stored_formats": stored,  # format -> {tensors, parameters, resident_bytes} (pre-quantized)
        "inventory_error": inventory_error,
        "ignored_tensors": ignored,  # name -> why it is not loaded
        "sha256": files,
    }


def kv_cache_bytes(cfg) -> dict:
    """The target's KV cache (f32 K and V of every attention layer, models/base.KVCache): bytes
    per cached position and at max_position_embeddings."""
    layers = getattr(cfg, "attention_layers", None)
    n = len(layers) if layers is not None else cfg.num_hidden_layers
    per = 2 * n * cfg.num_key_value_heads * cfg.head_dim * 4
    limit = getattr(cfg, "max_position_embeddings", None)
    return {"bytes_per_position": per, "max_positions": limit, "bytes_at_max": per * limit if limit else None}


def stored_summary(ckpt) -> dict:
    """{stored format: {"tensors", "parameters", "resident_bytes"}} of a pre-quantized
    checkpoint's linears (quant/stored.py); {} for a checkpoint stored in float."""
    out: dict = {}
    for name, e in sorted(ckpt.stored.items()):
        g = out.setdefault(e.format, {"tensors": 0, "parameters": 0, "resident_bytes": 0})
        g["tensors"] += 1
        g["parameters"] += math.prod(e.shape)  # [out, in], or [E, out, in] (MXFP4 experts)
        g["resident_bytes"] += e.resident
    return out


def format_inspect(report: dict) -> str:
    """Readable rendering of `inspect_model`'s report."""
    lines = [
        f"{report['path']}: {report['kind']} ({report['architecture']})",
        f"  parameters: {report['num_parameters']:,} in {report['num_tensors']} tensors, "
        f"{human_bytes(report['num_bytes'])} ({', '.join(report['dtypes']) or 'no tensors'})",
        f"  inventory:  {'ok' if report['inventory_error'] is None else report['inventory_error']}",
    ]
    lines += [f"  {line}" for line in report.get("summary_lines", [])]  # family facts (schedule, state)
    for fmt, g in (report.get("stored_formats") or {}).items():
        lines.append(f"  stored:     {g['tensors']} linears as {fmt}: {g['parameters']:,} parameters, "
                     f"{human_bytes(g['resident_bytes'])} resident")
    if report.get("resident_bytes"):
        lines.append("  weights resident: " + ", ".join(f"{fmt} {human_bytes(b)}" for fmt, b in report["resident_bytes"].items()))
    kv = report.get("kv_cache")
    if kv:
        at_max = f", {human_bytes(kv['bytes_at_max'])} at {kv['max_positions']:,} positions" if kv["bytes_at_max"] else ""
        lines.append(f"  kv cache:   {human_bytes(kv['bytes_per_position'])} per position (f32 K and V){at_max}; "
                     f"half that with --kv-dtype bf16")
    ignored = report.get("ignored_tensors") or {}
    if ignored:
        reasons = {}
        for name, why in ignored.items():
            reasons.setdefault(why, []).append(name)
        lines.append(f"  ignored:    {len(ignored)} tensors, not loaded (by name)")
        lines += [f"    {len(names)} x {names[0]} ... : {why}" for why, names in reasons.items()]
    lines.append("config:")
    width = max((len(k) for k in report["config"]), default=0)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in report["config"].items()]
    lines.append("tensors:")
    width = max((len(t["name"]) for t in report["tensors"]), default=0)
    for t in report["tensors"]:
        mark = "  (ignored)" if t["name"] in ignored else ""
        lines.append(f"  {t['name'].ljust(width)}  {t['dtype']:<4} {str(t['shape']):<18} {t['file']}{mark}")
    if report["sha256"]:
        lines.append("sha256:")
        lines += [f"  {digest}  {name}" for name, digest in report["sha256"].items()]
    return "\n".join(lines)

