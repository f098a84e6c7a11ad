"""Hostile inputs through the real CLI: every case is its own `python -m dflash2_numba ...`
process and must end with exit code 2, EXACTLY one stderr line `error: Name: ...` that names
the file / key / value, and an EMPTY stdout (nothing half-printed). The one exception is a
destination that fails only when written (`--json /dev/full`): the text has been streamed by
then, but the error is still the one and only stderr line, exit 2.

Issue 18's cases (red before the fix: what they did then) are marked in the table; the classes
they close are output paths / input files opened and bounded before any work
(`cli_checks.open_output`, `input_files`), and inspect reading every config value through the
loader's typed checks (the in-process sweep over every key is tests/test_config_type_sweep.py).

The table is cheap by construction: the tiny checkpoints are written once per module, the
numba cache is warmed in-process first (the non-finite-weight cases run one forward), and the
processes run a few at a time (each one's exit code, stdout and stderr checked separately).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from dflash2_numba import tiny

REPO = Path(__file__).resolve().parents[1]
MAX_POS = 64  # the tiny target's max_position_embeddings (size-limit cases)


@dataclass
class Case:
    id: str
    args: list  # CLI arguments; "{T}" / "{D}" / "{X}" are replaced by the good target / draft / the case's dir
    error: str  # expected class name after "error: "
    names: tuple = ()  # substrings the message must contain (file / key / value)
    make: object = None  # make(case_dir) -> None: writes the bad input into case_dir
    env: dict = field(default_factory=dict)
    text_first: bool = False  # a destination that fails only when written: the text may be on stdout
    stdout_to: str | None = None  # the process's stdout is this file (e.g. /dev/full), not a pipe


# ---------------------------------------------------------------- bad-input builders
def _copy_target(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst)
    return dst


def _config_patch(patch: dict):
    """A copy of the good target with config.json merged with `patch` (tiny.DELETE removes)."""
    def make(x, good):
        d = _copy_target(good, x / "m")
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(tiny._merge(cfg, patch)))
    return make


def _config_text(text: str):
    def make(x, good):
        d = _copy_target(good, x / "m")
        (d / "config.json").write_text(text)
    return make


def _draft_patch(patch: dict):
    def make(x, good_draft):
        d = x / "d"
        shutil.copytree(good_draft, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(tiny._merge(cfg, patch)))
    return make


def _split(path: Path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(path: Path, header, payload: bytes, n: int | None = None, pad: bool = True):
    head = json.dumps(header).encode() if not isinstance(header, bytes) else header
    if pad:
        head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head) if n is None else n) + head + payload)


def _st_edit(edit):
    """A copy of the good target whose model.safetensors header/payload `edit` rewrites:
    edit(n, header, payload) -> (header | bytes, payload, n | None)."""
    def make(x, good):
        d = _copy_target(good, x / "m")
        f = d / "model.safetensors"
        _write_st(f, *edit(*_split(f)))
    return make


def _lower_header_length(n, h, p):
    return json.dumps(h).encode() + b" " * 16, p, None  # then lower N by one below


def _tensor_names(h):
    return sorted(k for k in h if k != "__metadata__")


def _shifted(n, h, p):  # every offset +2 and two junk bytes in front: a gap at the start
    for k in _tensor_names(h):
        h[k]["data_offsets"] = [v + 2 for v in h[k]["data_offsets"]]
    return h, b"\0\0" + p, None


def _overlap(n, h, p):  # the second tensor reuses the first one's bytes (same size: both norms)
    names = [k for k in _tensor_names(h) if k.endswith("layernorm.weight")]
    h[names[1]]["data_offsets"] = list(h[names[0]]["data_offsets"])
    return h, p, None


def _trailing(n, h, p):
    return h, p + b"\0" * 8, None


def _dtype_list(n, h, p):
    h[_tensor_names(h)[0]]["dtype"] = ["BF16"]
    return h, p, None


def _huge_shape(n, h, p):
    k = _tensor_names(h)[0]
    h[k]["shape"] = [10 ** 30, 2]
    return h, p, None


def _nested_header(n, h, p):
    deep = b"{\"x\":" * 100000 + b"1" + b"}" * 100000
    return deep, p, None


def _nonfinite(name: str, value: float):
    """A copy of the good target with `name` (bf16) set to `value` everywhere."""
    def edit(n, h, p):
        b, e = h[name]["data_offsets"]
        bits = np.full((e - b) // 2, np.float32(value)).view(np.uint32) >> 16
        p = p[:b] + bits.astype("<u2").tobytes() + p[e:]
        return h, p, None
    return _st_edit(edit)


def _replace_weights(kind: str):
    def make(x, good):
        d = _copy_target(good, x / "m")
        f = d / "model.safetensors"
        f.unlink()
        if kind == "dir":
            f.mkdir()
        elif kind == "dangling":
            f.symlink_to(x / "nowhere.safetensors")
        elif kind == "loop":
            f.symlink_to(d / "loop.safetensors")
            (d / "loop.safetensors").symlink_to(f)
    return make


def _tok_config(patch: dict):
    def make(x, good):
        d = _copy_target(good, x / "m")
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **patch}))
    return make


def _file(name: str, content: bytes | str, sparse: int = 0):
    def make(x, good):
        f = x / name
        if sparse:
            with open(f, "wb") as fh:
                fh.truncate(sparse)
        else:
            f.write_bytes(content if isinstance(content, bytes) else content.encode())
    return make


def _model_file_is(name: str, kind: str):
    """A copy of the good target whose `name` is `kind`: "zero" (a symlink to /dev/zero, which
    never ends), "fifo" (nobody writes it: reading would block forever) or "huge" (a sparse file
    larger than the read limit for its kind)."""
    def make(x, good):
        d = _copy_target(good, x / "m")
        f = d / name
        if f.exists():
            f.unlink()
        if kind == "zero":
            f.symlink_to("/dev/zero")
        elif kind == "fifo":
            os.mkfifo(f)
        else:
            with open(f, "wb") as fh:
                fh.truncate(300 * 2 ** 20)
    return make


def _fifo(name: str, feed: bool):
    """A FIFO in the case dir; with `feed`, a `yes` writing into it forever (bounded by `timeout`,
    and ended by SIGPIPE once the reader closes it)."""
    def make(x, good):
        os.mkfifo(x / name)
        if feed:
            subprocess.Popen(["timeout", "90", "sh", "-c", f"yes > '{x / name}'"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    return make


def _sharded_outside(x, good):
    """A checkpoint whose index names a shard outside its directory (`../`)."""
    d = _copy_target(good, x / "m")
    names = _tensor_names(_split(d / "model.safetensors")[1])
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "../elsewhere/model.safetensors" for n in names}}))
    (x / "elsewhere").mkdir()
    shutil.copy(d / "model.safetensors", x / "elsewhere" / "model.safetensors")


def _qwen3_5_patch(patch: dict):
    """A tiny Qwen3.5 hybrid (text layout) with config.json merged with `patch`."""
    def make(x, good):
        from dflash2_numba.tiny_hybrid import write_qwen3_5_target

        d = write_qwen3_5_target(x / "m", layout="text", seed=1)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(tiny._merge(cfg, patch)))
    return make


def _corrupt_numba_cache(x, good):
    """NUMBA_CACHE_DIR (set for this case) holds a copy of the warm cache with one truncated file."""
    cache = x / "numba_cache"
    src = Path(os.environ["_BAD_INPUTS_CACHE_SRC"])
    shutil.copytree(src, cache / src.name)
    victim = sorted((cache / src.name).glob("rowwise._rms_norm_rows*.nbc"))[0]
    victim.write_bytes(victim.read_bytes()[:20])


GEN = ["generate", "--target", "{T}", "--prompt-ids", "5,6,7", "--max-new-tokens", "3"]
BADT = ["generate", "--target", "{X}/m", "--prompt-ids", "5,6,7", "--max-new-tokens", "3"]
BADD = ["generate", "--target", "{T}", "--draft", "{X}/d", "--prompt-ids", "5,6,7", "--max-new-tokens", "3"]
INSPECT = ["inspect", "{X}/m", "--no-hash"]
PROPOSE = ["propose", "--target", "{T}", "--draft", "{D}", "--prompt-ids", "5,6"]
D = tiny.DELETE

CASES = [
    # ---------------------------------------------------------- target config.json: types / ranges
    Case("arch-object", BADT, "ConfigValueError", ("config.json", "architectures = {}"), _config_patch({"architectures": {}})),
    Case("arch-string", BADT, "ConfigValueError", ("config.json", "architectures = 'Qwen3ForCausalLM'"), _config_patch({"architectures": "Qwen3ForCausalLM"})),
    Case("arch-empty", BADT, "UnknownArchitectureError", ("architectures",), _config_patch({"architectures": []})),
    Case("hidden-str", BADT, "ConfigValueError", ("config.json", "hidden_size = 'abc'",), _config_patch({"hidden_size": "abc"})),
    Case("hidden-zero", BADT, "ConfigValueError", ("hidden_size = 0",), _config_patch({"hidden_size": 0})),
    Case("hidden-bool", BADT, "ConfigValueError", ("hidden_size = True",), _config_patch({"hidden_size": True})),
    Case("hidden-float", BADT, "ConfigValueError", ("hidden_size = 32.5",), _config_patch({"hidden_size": 32.5})),
    Case("heads-zero", BADT, "ConfigValueError", ("num_attention_heads = 0",), _config_patch({"num_attention_heads": 0, "head_dim": D})),
    Case("heads-neg", BADT, "ConfigValueError", ("num_attention_heads = -2",), _config_patch({"num_attention_heads": -2})),
    Case("kv-heads-not-divisor", BADT, "ConfigValueError", ("num_key_value_heads = 3",), _config_patch({"num_key_value_heads": 3})),
    Case("head-dim-str", BADT, "ConfigValueError", ("head_dim = '16'",), _config_patch({"head_dim": "16"})),
    Case("intermediate-neg", BADT, "ConfigValueError", ("intermediate_size = -1",), _config_patch({"intermediate_size": -1})),
    Case("layers-zero", BADT, "ConfigValueError", ("num_hidden_layers = 0",), _config_patch({"num_hidden_layers": 0})),
    Case("vocab-str", BADT, "ConfigValueError", ("vocab_size = 'x'",), _config_patch({"vocab_size": "x"})),
    Case("rope-zero", BADT, "ConfigValueError", ("rope_theta = 0",), _config_patch({"rope_theta": 0})),
    Case("rope-neg", BADT, "ConfigValueError", ("rope_theta = -1",), _config_patch({"rope_theta": -1.0})),
    Case("rope-str", BADT, "ConfigValueError", ("rope_theta = '1e6'",), _config_patch({"rope_theta": "1e6"})),
    Case("rope-nested-neg", BADT, "ConfigValueError", ("rope_parameters.rope_theta = -5",),
         _config_patch({"rope_theta": D, "rope_parameters": {"rope_type": "default", "rope_theta": -5}})),
    Case("eps-neg", BADT, "ConfigValueError", ("rms_norm_eps = -1e-06",), _config_patch({"rms_norm_eps": -1e-6})),
    Case("eps-str", BADT, "ConfigValueError", ("rms_norm_eps = 'tiny'",), _config_patch({"rms_norm_eps": "tiny"})),
    Case("eps-nan", BADT, "ConfigValueError", ("rms_norm_eps = nan",),
         _config_text('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64, '
                      '"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, '
                      '"vocab_size": 320, "rms_norm_eps": NaN}')),
    Case("maxpos-zero", BADT, "ConfigValueError", ("max_position_embeddings = 0",), _config_patch({"max_position_embeddings": 0})),
    Case("tie-str", BADT, "ConfigValueError", ("tie_word_embeddings = 'false'",), _config_patch({"tie_word_embeddings": "false"})),
    Case("eos-str", BADT, "ConfigValueError", ("eos_token_id = 'abc'",), _config_patch({"eos_token_id": "abc"})),
    Case("eos-list-mixed", BADT, "ConfigValueError", ("eos_token_id",), _config_patch({"eos_token_id": [1, "x"]})),
    Case("bos-str", BADT, "ConfigValueError", ("bos_token_id = 'x'",), _config_patch({"bos_token_id": "x"})),
    Case("act-gelu", BADT, "UnsupportedConfigError", ("hidden_act", "gelu"), _config_patch({"hidden_act": "gelu"})),
    Case("rope-yarn", BADT, "UnsupportedConfigError", ("rope_scaling", "yarn"), _config_patch({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})),
    Case("swa-flag-str", BADT, "ConfigValueError", ("use_sliding_window", "'yes'"), _config_patch({"use_sliding_window": "yes"})),
    Case("swa-window-zero", BADT, "ConfigValueError", ("sliding_window = 0",), _config_patch({"use_sliding_window": True, "sliding_window": 0})),
    Case("swa-window-null", BADT, "ConfigValueError", ("use_sliding_window", "sliding_window"), _config_patch({"use_sliding_window": True, "sliding_window": None})),
    Case("swa-types-len", BADT, "ConfigValueError", ("layer_types has 3 entries", "num_hidden_layers = 2"),
         _config_patch({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention"] * 3})),
    Case("swa-types-no-window", BADT, "ConfigValueError", ("layer_types", "sliding_attention", "use_sliding_window"),
         _config_patch({"layer_types": ["sliding_attention", "full_attention"]})),
    Case("swa-types-unknown", BADT, "ConfigValueError", ("layer_types[0] = 'chunked_attention'",),
         _config_patch({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["chunked_attention", "full_attention"]})),
    Case("swa-max-window-str", BADT, "ConfigValueError", ("max_window_layers = 'x'",),
         _config_patch({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": "x"})),
    Case("config-list", BADT, "ConfigError", ("config.json", "list"), _config_text("[1]")),
    Case("config-bad-json", BADT, "CorruptHeaderError", ("config.json",), _config_text("{")),
    Case("config-deep", BADT, "CorruptHeaderError", ("config.json", "nest"), _config_text("[" * 100000 + "]" * 100000)),
    # ---------------------------------------------------------- safetensors payloads and headers
    Case("st-header-len-minus-1", BADT, "DataOffsetError", ("model.safetensors",),
         _st_edit(lambda n, h, p: (_lower_header_length(n, h, p)[0], p, len(_lower_header_length(n, h, p)[0]) - 1))),
    Case("inspect-header-len-minus-1", ["inspect", "{X}/m", "--no-hash"], "DataOffsetError", ("model.safetensors", "payload"),
         _st_edit(lambda n, h, p: (_lower_header_length(n, h, p)[0], p, len(_lower_header_length(n, h, p)[0]) - 1))),
    Case("st-gap-at-start", BADT, "DataOffsetError", ("model.safetensors", "0"), _st_edit(_shifted)),
    Case("st-overlap", BADT, "DataOffsetError", ("model.safetensors", "layernorm"), _st_edit(_overlap)),
    Case("st-trailing-bytes", BADT, "DataOffsetError", ("model.safetensors", "payload"), _st_edit(_trailing)),
    Case("st-truncated", BADT, "DataOffsetError", ("model.safetensors",), _st_edit(lambda n, h, p: (h, p[:-10], None))),
    Case("st-dtype-list", BADT, "CorruptHeaderError", ("model.safetensors", "dtype", "['BF16']"), _st_edit(_dtype_list)),
    Case("st-dtype-i64", BADT, "UnknownDTypeError", ("model.safetensors", "I64"),
         _st_edit(lambda n, h, p: (h.__setitem__(_tensor_names(h)[0], {**h[_tensor_names(h)[0]], "dtype": "I64"}) or h, p, None))),
    Case("st-shape-huge", BADT, "DataOffsetError", ("model.safetensors", str(10 ** 30)), _st_edit(_huge_shape)),
    Case("st-header-deep", BADT, "CorruptHeaderError", ("model.safetensors", "nest"), _st_edit(_nested_header)),
    Case("st-header-not-object", BADT, "CorruptHeaderError", ("model.safetensors", "object"), _st_edit(lambda n, h, p: (b"[1]", p, None))),
    Case("st-header-len-huge", BADT, "CorruptHeaderError", ("model.safetensors", "header length"), _st_edit(lambda n, h, p: (h, p, 2 ** 40))),
    Case("st-is-directory", BADT, "CheckpointNotFoundError", ("model.safetensors", "directory"), _replace_weights("dir")),
    Case("st-dangling-symlink", BADT, "CheckpointNotFoundError", ("model.safetensors",), _replace_weights("dangling")),
    Case("st-symlink-loop", BADT, "CheckpointNotFoundError", ("model.safetensors",), _replace_weights("loop")),
    Case("weights-nan", BADT, "NonFiniteLogitsError", ("prefill", "NaN"), _nonfinite("lm_head.weight", np.nan)),
    Case("weights-inf", BADT, "NonFiniteLogitsError", ("prefill",), _nonfinite("model.norm.weight", np.inf)),
    # ---------------------------------------------------------- tokenizer files
    Case("tokenizer-corrupt", BADT, "ConfigError", ("tokenizer.json",),
         lambda x, good: (_copy_target(good, x / "m") / "tokenizer.json").write_text("{nope")),
    Case("tokenizer-missing", BADT, "CheckpointNotFoundError", ("tokenizer.json",),
         lambda x, good: (_copy_target(good, x / "m") / "tokenizer.json").unlink()),
    Case("template-syntax", ["generate", "--target", "{X}/m", "--prompt", "hi", "--chat", "--max-new-tokens", "2"],
         "ChatTemplateError", ("tokenizer_config.json", "chat_template"), _tok_config({"chat_template": "{% if %}"})),
    Case("template-raise", ["generate", "--target", "{X}/m", "--prompt", "hi", "--chat", "--max-new-tokens", "2"],
         "ChatTemplateError", ("chat_template", "no users here"),
         _tok_config({"chat_template": "{{ raise_exception('no users here') }}"})),
    Case("template-jinja-not-utf8", ["generate", "--target", "{X}/m", "--prompt", "hi", "--chat", "--max-new-tokens", "2"],
         "ConfigError", ("chat_template.jinja",),
         lambda x, good: (_copy_target(good, x / "m") / "chat_template.jinja").write_bytes(b"\xff\xfe{{")),
    Case("prompt-file-directory", ["generate", "--target", "{T}", "--prompt-file", "{X}"], "BadParameter", ("--prompt-file",)),
    Case("tokenizer-config-json", BADT, "ConfigError", ("tokenizer_config.json",),
         lambda x, good: (_copy_target(good, x / "m") / "tokenizer_config.json").write_text("{")),
    Case("generation-eos-str", BADT, "ConfigError", ("generation_config.json", "eos_token_id"),
         lambda x, good: (_copy_target(good, x / "m") / "generation_config.json").write_text('{"eos_token_id": "x"}')),
    # ---------------------------------------------------------- CLI values
    Case("prompt-ids-empty-item", ["generate", "--target", "{T}", "--prompt-ids", "1,,2"], "GenerationArgumentError", ("--prompt-ids", "1,,2")),
    Case("prompt-ids-letter", ["generate", "--target", "{T}", "--prompt-ids", "1,a"], "GenerationArgumentError", ("--prompt-ids", "1,a")),
    Case("prompt-ids-negative", ["generate", "--target", "{T}", "--prompt-ids", "-1"], "GenerationArgumentError", ("-1",)),
    Case("prompt-ids-outside-vocab", ["generate", "--target", "{T}", "--prompt-ids", "99999"], "GenerationArgumentError", ("99999",)),
    Case("prompt-ids-blank", ["generate", "--target", "{T}", "--prompt-ids", ""], "GenerationArgumentError", ("--prompt-ids",)),
    Case("stop-token-neg", GEN + ["--stop-token", "-1"], "GenerationArgumentError", ("--stop-token", "-1")),
    Case("stop-token-huge", GEN + ["--stop-token", str(10 ** 30)], "GenerationArgumentError", ("--stop-token", str(10 ** 30))),
    Case("temperature-tiny", GEN + ["--temperature", "1e-320"], "GenerationArgumentError", ("temperature", "1e-320")),
    Case("temperature-huge", GEN + ["--temperature", "1e300"], "GenerationArgumentError", ("temperature", "1e+300")),
    Case("temperature-neg", GEN + ["--temperature", "-1"], "GenerationArgumentError", ("temperature", "-1")),
    Case("temperature-nan", GEN + ["--temperature", "nan"], "GenerationArgumentError", ("temperature", "nan")),
    Case("threads-zero", GEN + ["--threads", "0"], "GenerationArgumentError", ("--threads", "0", "NUMBA_NUM_THREADS")),
    Case("threads-beyond-pool", GEN + ["--threads", "100000"], "GenerationArgumentError", ("--threads", "100000")),
    Case("top-p-zero", GEN + ["--top-p", "0"], "GenerationArgumentError", ("top_p", "0")),
    Case("top-k-neg", GEN + ["--top-k", "-1"], "GenerationArgumentError", ("top_k", "-1")),
    Case("seed-neg", GEN + ["--seed", "-1"], "GenerationArgumentError", ("seed", "-1")),
    Case("max-new-zero", ["generate", "--target", "{T}", "--prompt-ids", "5", "--max-new-tokens", "0"], "GenerationArgumentError", ("max_new_tokens", "0")),
    Case("max-new-absurd", ["generate", "--target", "{T}", "--prompt-ids", "5", "--max-new-tokens", str(10 ** 9)],
         "ContextLengthError", (str(10 ** 9), str(MAX_POS), "max_position_embeddings")),
    Case("prompt-too-long", ["generate", "--target", "{T}", "--prompt-ids", ",".join(["5"] * (MAX_POS + 1))],
         "ContextLengthError", (str(MAX_POS + 1), str(MAX_POS))),
    Case("prompt-file-huge", ["generate", "--target", "{T}", "--prompt-file", "{X}/big.txt"], "ContextLengthError",
         ("big.txt", "bytes"), _file("big.txt", b"", sparse=20 * 2 ** 20)),
    Case("prompt-file-long", ["generate", "--target", "{T}", "--prompt-file", "{X}/long.txt"], "ContextLengthError",
         ("prompt", str(MAX_POS)), _file("long.txt", "the quick brown fox jumps over the lazy dog. " * 40)),
    Case("prompt-file-missing", ["generate", "--target", "{T}", "--prompt-file", "{X}/none.txt"], "GenerationArgumentError", ("none.txt",)),
    Case("prompt-file-not-utf8", ["generate", "--target", "{T}", "--prompt-file", "{X}/b.txt"], "GenerationArgumentError",
         ("b.txt", "utf-8"), _file("b.txt", b"\xff\xfe\xfa")),
    Case("no-prompt", ["generate", "--target", "{T}"], "GenerationArgumentError", ("--prompt",)),
    Case("block-size-abc", GEN + ["--block-size", "abc"], "BlockSizeError", ("block_size", "--block-size", "'abc'", "auto")),
    Case("block-size-zero", GEN + ["--block-size", "0"], "BlockSizeError", ("--block-size", "'0'", "auto")),
    Case("usage-device", GEN + ["--device", "gpu"], "BadParameter", ("--device", "gpu")),
    Case("usage-dtype", GEN + ["--dtype", "f16"], "BadParameter", ("--dtype", "f16")),
    Case("usage-unknown-option", GEN + ["--frobnicate"], "NoSuchOption", ("--frobnicate",)),
    Case("usage-unknown-command", ["frobnicate"], "NoSuchCommand", ("frobnicate",)),
    Case("usage-missing-value", ["generate", "--target"], "BadOptionUsage", ("--target",)),
    Case("block-size-too-big", ["generate", "--target", "{T}", "--draft", "{D}", "--prompt-ids", "5", "--block-size", "99"],
         "BlockSizeError", ("block_size", "99", "2..")),
    # ---------------------------------------------------------- output paths (checked BEFORE decoding)
    Case("json-missing-dir", GEN + ["--json", "{X}/no/such/dir/out.json"], "OutputPathError", ("--json", "no/such/dir")),
    Case("json-is-directory", GEN + ["--json", "{X}"], "OutputPathError", ("--json", "directory")),
    Case("json-under-file", GEN + ["--json", "{X}/f.txt/out.json"], "OutputPathError", ("--json", "f.txt"), _file("f.txt", "x")),
    Case("propose-json-directory", ["propose", "--target", "{T}", "--draft", "{D}", "--prompt-ids", "5,6", "--json", "{X}"],
         "OutputPathError", ("--json", "directory")),
    Case("inspect-json-directory", ["inspect", "{T}", "--json", "{X}"], "OutputPathError", ("--json", "directory")),
    # issue 18: os.access says yes to root, so these were only found when the JSON was written,
    # after the text had streamed (stdout not empty): now the destination is created first
    Case("json-under-proc", GEN + ["--json", "/proc/dflash2-out.json"], "OutputPathError", ("--json", "/proc/dflash2-out.json")),
    Case("json-under-sys", GEN + ["--json", "/sys/kernel/dflash2-out.json"], "OutputPathError", ("/sys/kernel/dflash2-out.json",)),
    Case("propose-json-under-proc", PROPOSE + ["--json", "/proc/dflash2-out.json"], "OutputPathError", ("/proc/dflash2-out.json",)),
    Case("inspect-json-under-proc", ["inspect", "{T}", "--json", "/proc/dflash2-out.json"], "OutputPathError", ("/proc/dflash2-out.json",)),
    # issue 18: was a hang (open() of a FIFO nobody reads blocks) until the case's time limit
    Case("json-fifo-no-reader", GEN + ["--json", "{X}/out.fifo"], "OutputPathError", ("out.fifo", "FIFO"), _fifo("out.fifo", False)),
    # fails only when written: the text is out, the error is the ONE stderr line (the stats block
    # used to come first: two-plus lines)
    Case("json-dev-full", GEN + ["--json", "/dev/full"], "OutputPathError", ("/dev/full", "No space left"), text_first=True),
    Case("propose-json-dev-full", PROPOSE + ["--json", "/dev/full"], "OutputPathError", ("/dev/full",)),
    Case("inspect-json-dev-full", ["inspect", "{T}", "--json", "/dev/full"], "OutputPathError", ("/dev/full",)),
    # issue 18 (class): a stdout that refuses bytes was an OSError traceback
    Case("stdout-dev-full", GEN, "OutputPathError", ("stdout", "No space left"), stdout_to="/dev/full"),
    Case("inspect-stdout-dev-full", ["inspect", "{T}", "--no-hash"], "OutputPathError", ("stdout",), stdout_to="/dev/full"),
    # ---------------------------------------------------------- input files that never end (issue 18)
    # was a MemoryError traceback: Path.read_text of /dev/zero allocates until it fails
    Case("prompt-file-dev-zero", ["generate", "--target", "{T}", "--prompt-file", "/dev/zero"], "ContextLengthError",
         ("--prompt-file /dev/zero", str(16 * 2 ** 20), "character device")),
    Case("prompt-file-fifo-forever", ["generate", "--target", "{T}", "--prompt-file", "{X}/p.fifo"], "ContextLengthError",
         ("p.fifo", "FIFO"), _fifo("p.fifo", True)),
    # model-directory files: a device or FIFO was "not found" (config.json, tokenizer.json) or
    # silently ignored (tokenizer_config.json, chat_template.jinja: is_file() is False)
    Case("config-json-dev-zero", BADT, "CheckpointNotFoundError", ("config.json", "character device"), _model_file_is("config.json", "zero")),
    Case("config-json-fifo", BADT, "CheckpointNotFoundError", ("config.json", "FIFO"), _model_file_is("config.json", "fifo")),
    Case("config-json-huge", BADT, "CorruptHeaderError", ("config.json", "bytes", "limit"), _model_file_is("config.json", "huge")),
    Case("tokenizer-json-dev-zero", BADT, "CheckpointNotFoundError", ("tokenizer.json", "character device"), _model_file_is("tokenizer.json", "zero")),
    Case("tokenizer-json-huge", BADT, "ConfigError", ("tokenizer.json", "limit"), _model_file_is("tokenizer.json", "huge")),
    Case("tokenizer-config-fifo", BADT, "CheckpointNotFoundError", ("tokenizer_config.json", "FIFO"), _model_file_is("tokenizer_config.json", "fifo")),
    Case("generation-config-dev-zero", BADT, "CheckpointNotFoundError", ("generation_config.json", "character device"),
         _model_file_is("generation_config.json", "zero")),
    Case("template-jinja-dev-zero", BADT, "CheckpointNotFoundError", ("chat_template.jinja", "character device"),
         _model_file_is("chat_template.jinja", "zero")),
    Case("inspect-config-dev-zero", INSPECT, "CheckpointNotFoundError", ("config.json", "character device"), _model_file_is("config.json", "zero")),
    # a shard path outside the checkpoint directory was followed
    Case("index-shard-outside", BADT, "CorruptHeaderError", ("model.safetensors.index.json", "../elsewhere"), _sharded_outside),
    # ---------------------------------------------------------- inspect: the loader's typed reads (issue 18)
    # were KeyError / TypeError tracebacks (inspect read architectures[0] untyped)
    Case("inspect-arch-object", INSPECT, "ConfigValueError", ("config.json", "architectures = {'Qwen3ForCausalLM': 1}"),
         _config_patch({"architectures": {"Qwen3ForCausalLM": 1}})),
    Case("inspect-arch-number", INSPECT, "ConfigValueError", ("config.json", "architectures = 5"), _config_patch({"architectures": 5})),
    Case("inspect-arch-string", INSPECT, "ConfigValueError", ("architectures = 'Qwen3ForCausalLM'",),
         _config_patch({"architectures": "Qwen3ForCausalLM"})),
    # TypeError: unhashable type 'list' (the family matchers compared model_type against names)
    Case("inspect-model-type-list", INSPECT, "UnknownArchitectureError", ("config.json", "Foo"),
         _config_patch({"architectures": ["Foo"], "model_type": ["qwen3_5"]})),
    Case("model-type-number", BADT, "ConfigValueError", ("model_type = 5",), _config_patch({"model_type": 5})),
    # MemoryError after a minute: the inventory listed 10**30 layers of tensor names
    Case("inspect-layers-huge", INSPECT, "ConfigValueError", ("num_hidden_layers", str(10 ** 30), "4096"),
         _config_patch({"num_hidden_layers": 10 ** 30})),
    # silently wrong before: bool("false") is True (a tied head / a BOS token nobody asked for)
    Case("qwen3_5-tie-str", INSPECT, "ConfigValueError", ("tie_word_embeddings = 'false'",), _qwen3_5_patch({"tie_word_embeddings": "false"})),
    Case("qwen3_5-model-type-list", INSPECT, "ConfigValueError", ("model_type = ['qwen3_5_text']",),
         _qwen3_5_patch({"model_type": ["qwen3_5_text"]})),
    Case("tokenizer-add-bos-str", ["generate", "--target", "{X}/m", "--prompt", "hi", "--max-new-tokens", "2"],
         "ConfigValueError", ("tokenizer_config.json", "add_bos_token = 'false'"), _tok_config({"add_bos_token": "false"})),
    # ---------------------------------------------------------- draft config.json
    Case("draft-block-str", BADD, "ConfigValueError", ("config.json", "block_size = 'abc'",), _draft_patch({"dflash_config": {"block_size": "abc"}})),
    Case("draft-block-one", BADD, "ConfigValueError", ("block_size = 1",), _draft_patch({"dflash_config": {"block_size": 1}})),
    Case("draft-mask-neg", BADD, "ConfigValueError", ("mask_token_id = -1",), _draft_patch({"dflash_config": {"mask_token_id": -1}})),
    Case("draft-taps-str", BADD, "ConfigValueError", ("target_layer_ids = 'abc'",), _draft_patch({"dflash_config": {"target_layer_ids": "abc"}})),
    Case("draft-taps-bool", BADD, "ConfigValueError", ("target_layer_ids[0] = True",), _draft_patch({"dflash_config": {"target_layer_ids": [True]}})),
    Case("draft-taps-range", BADD, "PairingError", ("target_layer_ids", "7"), _draft_patch({"dflash_config": {"target_layer_ids": [7]}})),
    Case("draft-conv-group-str", BADD, "ConfigValueError", ("conv_group_size = 'x'",), _draft_patch({"dflash_config": {"conv_group_size": "x"}})),
    Case("draft-topk-zero", BADD, "ConfigValueError", ("selector_top_k = 0",), _draft_patch({"dflash_config": {"selector_top_k": 0}})),
    Case("draft-softcap-str", BADD, "ConfigValueError", ("final_logit_softcapping = 'x'",), _draft_patch({"dflash_config": {"final_logit_softcapping": "x"}})),
    Case("draft-scale-str", BADD, "ConfigValueError", ("input_embedding_scale = 'big'",), _draft_patch({"dflash_config": {"input_embedding_scale": "big"}})),
    Case("draft-eps-neg", BADD, "ConfigValueError", ("rms_norm_eps = -1",), _draft_patch({"rms_norm_eps": -1})),
    Case("draft-rope-zero", BADD, "ConfigValueError", ("rope_theta = 0",), _draft_patch({"rope_parameters": {"rope_theta": 0}})),
    Case("draft-window-zero", BADD, "ConfigValueError", ("sliding_window = 0",),
         _draft_patch({"layer_types": ["sliding_attention"], "sliding_window": 0})),
    Case("draft-is-causal-str", BADD, "IsCausalTypeError", ("is_causal", "'false'"), _draft_patch({"is_causal": "false"})),
    Case("draft-arch-object", BADD, "ConfigValueError", ("architectures = {}",), _draft_patch({"architectures": {}})),
    Case("draft-heads-zero", BADD, "ConfigValueError", ("num_attention_heads = 0",), _draft_patch({"num_attention_heads": 0, "head_dim": D})),
    Case("draft-hidden-mismatch", BADD, "PairingError", ("hidden_size",), _draft_patch({"hidden_size": 48, "dflash_config": {"conv_group_size": 8}})),
    # ---------------------------------------------------------- numba's cache directory
    Case("numba-cache-truncated", GEN, "KernelCacheError", (".nbc",), _corrupt_numba_cache,
         env={"NUMBA_CACHE_DIR": "{X}/numba_cache"}),
]


def _limit_memory():
    """An unbounded allocation must fail inside the case, never take the shared machine down."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (8 * 2 ** 30, 8 * 2 ** 30))


def _fill(arg: str, paths: dict) -> str:
    for key, value in paths.items():
        arg = arg.replace("{" + key + "}", str(value))
    return arg


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("bad")
    # run only the cases pytest selected (-k), so one case can be rerun in seconds
    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items]
    selected = {p["case"].id for p in params if isinstance(p.get("case"), Case)}
    good = tiny.write_target(root / "target", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             tokenizer_vocab_size=300, max_position_embeddings=MAX_POS, seed=5)
    draft = tiny.write_draft(root / "draft", good, kind="dflash2", num_hidden_layers=1, block_size=4,
                             conv_group_size=16, selector_rank=8, selector_top_k=4, seed=6)
    # warm the numba cache the subprocesses read (a cold cache would cost every case a compile)
    warm = subprocess.run([sys.executable, "-m", "dflash2_numba", "generate", "--target", str(good),
                           "--prompt-ids", "5,6,7", "--max-new-tokens", "2"], cwd=REPO, capture_output=True,
                          text=True)
    assert warm.returncode == 0, warm.stderr
    # a copy of that cache laid out as numba reads it under NUMBA_CACHE_DIR (corrupted-cache case)
    from numba.core.caching import _CacheLocator

    kernels = REPO / "dflash2_numba" / "kernels"
    cache_src = root / "numba_cache_src" / _CacheLocator.get_suitable_cache_subpath(str(kernels / "rowwise.py"))
    cache_src.mkdir(parents=True)
    from dflash2_numba.kernels.cache_check import FINGERPRINT_FILE

    for f in [*(kernels / "__pycache__").glob("*.nb[ic]"), kernels / "__pycache__" / FINGERPRINT_FILE]:
        shutil.copy2(f, cache_src / f.name)  # the fingerprint too: without it all files count as stale
    os.environ["_BAD_INPUTS_CACHE_SRC"] = str(cache_src)

    def run(case: Case):
        x = root / case.id
        x.mkdir()
        if case.make is not None:
            case.make(x, draft if case.args is BADD else good)
        paths = {"T": good, "D": draft, "X": x}
        env = {**os.environ, **{k: _fill(v, paths) for k, v in case.env.items()}}
        env.pop("_BAD_INPUTS_CACHE_SRC", None)
        stdout = open(case.stdout_to, "w") if case.stdout_to else subprocess.PIPE
        try:
            r = subprocess.run([sys.executable, "-m", "dflash2_numba", *[_fill(a, paths) for a in case.args]],
                               cwd=REPO, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=60,
                               preexec_fn=_limit_memory)
            return subprocess.CompletedProcess(r.args, r.returncode, r.stdout or "", r.stderr)
        except subprocess.TimeoutExpired as e:  # reported by the case's own test
            return subprocess.CompletedProcess(e.cmd, None, e.stdout or "", f"timed out after 60 s\n{e.stderr or ''}")
        finally:
            if case.stdout_to:
                stdout.close()

    cases = [c for c in CASES if c.id in selected]
    with ThreadPoolExecutor(max_workers=3) as pool:
        out = dict(zip([c.id for c in cases], pool.map(run, cases)))
    out["_paths"] = {"target": good, "root": root}
    return out


def test_table_is_large_and_distinct():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(results, case):
    r = results[case.id]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    if case.text_first:  # the generated text went out before the write failed
        assert r.stdout.strip(), "expected the streamed text on stdout"
    else:
        assert r.stdout == "", r.stdout[-500:]
    assert len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"error: {case.error}: "), lines[0]
    for name in case.names:
        assert name in lines[0], (name, lines[0])


def test_certain_selector_refusal_before_any_output(results):
    """A DFlash2 draft whose selector refuses every step (selector_top_k above the vocabulary):
    the load notice and the named refusal on stderr, and not even the prefill token on stdout."""
    good, root = results["_paths"]["target"], results["_paths"]["root"]
    vocab = json.loads((good / "config.json").read_text())["vocab_size"]
    draft = tiny.write_draft(root / "refusing", good, kind="dflash2", num_hidden_layers=1, block_size=4,
                             selector_rank=8, selector_top_k=vocab + 1, seed=6)
    r = subprocess.run([sys.executable, "-m", "dflash2_numba", "generate", "--target", str(good), "--draft",
                        str(draft), "--prompt-ids", "5,6,7", "--max-new-tokens", "4"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("notice: the DFlash2 candidate selector will refuse every step") and "selector_top_k" in lines[0]
    assert lines[1].startswith("error: SelectorRefusedError: ") and f"selector_top_k = {vocab + 1}" in lines[1]
    # in-process: stream_generate refuses when called, before the prefill step is yielded (a
    # token that decodes to a held-back partial character would not show on stdout above)
    import dflash2_numba as dn

    target = dn.load_target(good)
    with pytest.raises(dn.SelectorRefusedError, match="selector_top_k"):
        dn.stream_generate(target, dn.load_draft(draft, target), prompt_ids=[5, 6, 7], max_new_tokens=4)
