"""Deterministic tiny checkpoints: HF-format targets and DFlash / DFlash2 drafts (spec §2, §8).

Used by tests, examples, the CLI's embedded default and the benchmarks. Stands alone: it
writes files, it never reads them back through the package's loader.

    train_tiny_tokenizer(vocab_size)       byte-level BPE trained on assets/tiny_corpus.txt
    write_target(path, ...)  -> Path       Qwen3ForCausalLM / LlamaForCausalLM directory
    write_draft(path, target_dir, ...)     DFlashDraftModel / DFlash2DraftModel directory
    save_safetensors(path, tensors)        writer with BF16 support (uint16 arrays -> "BF16")

Determinism: every tensor is drawn from its own RNG keyed by (seed, crc32(tensor name)), so the
same arguments give byte-identical files, an f32 and a bf16 write of one seed hold the same
values up to rounding, and a tied and an untied target share their embedding.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .numerics import f32_to_bf16_array

CORPUS_PATH = Path(__file__).parent / "assets" / "tiny_corpus.txt"

ENDOFTEXT, IM_START, IM_END, MASK_TOKEN, BEGIN_OF_TEXT = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|begin_of_text|>")
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK_TOKEN, BEGIN_OF_TEXT)
ADDED_TOKENS = ("<think>", "</think>")  # plain added tokens, as in Qwen3

# A ChatML template that honours `enable_thinking` like Qwen3's: with enable_thinking false
# the generation prompt carries an empty think block. Llama targets prefix `bos_token`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)

DELETE = object()  # value in `extra_config` that removes the key (tests write bad configs)


# ---------------------------------------------------------------- safetensors writer
_DTYPE_NAMES = {
    np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
_DTYPE_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2,
                "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def save_safetensors(path, tensors: dict[str, np.ndarray], dtypes: dict[str, str] | None = None,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file: u64-LE header length, JSON header, raw little-endian bytes.

    uint16 arrays are written as "BF16" (bf16 bits); `dtypes` overrides the dtype name per
    tensor (e.g. {"x": "U16"}) when the item size agrees. Tensors are laid out in sorted name
    order; `__metadata__` is {"format": "pt"} plus `metadata`; the header is space-padded to a
    multiple of 8 bytes as the reference implementation does.
    """
    dtypes = dtypes or {}
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if name in dtypes:
            dtype = dtypes[name]
        elif arr.dtype in _DTYPE_NAMES:
            dtype = _DTYPE_NAMES[arr.dtype]
        else:
            raise ValueError(f"tensor {name!r}: no safetensors dtype for numpy {arr.dtype}")
        if _DTYPE_SIZES.get(dtype) != arr.dtype.itemsize:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} needs {_DTYPE_SIZES.get(dtype)}-byte "
                             f"items, got numpy {arr.dtype} ({arr.dtype.itemsize} bytes)")
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for data in blobs:
            f.write(data)
    return path


def _write_weights(model_dir: Path, tensors: dict[str, np.ndarray], num_shards: int) -> None:
    """model.safetensors, or num_shards files + model.safetensors.index.json.

    `tensors` is in model order; shards take contiguous runs of roughly equal byte size."""
    for stale in [*model_dir.glob("model*.safetensors"), model_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous write with another shard count
    if num_shards == 1:
        save_safetensors(model_dir / "model.safetensors", tensors)
        return
    names = list(tensors)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in 1..{len(names)} (tensor count), got {num_shards}")
    sizes = np.cumsum([tensors[n].nbytes for n in names])  # [T]
    total = int(sizes[-1])
    # shard of tensor i: the equal-bytes bucket its end falls in, clamped so that shards are
    # monotone, none is skipped (<= prev + 1) and later tensors can still reach the last one
    shard_of, prev = [], -1
    for i, end in enumerate(sizes):
        want = int((end - 1) * num_shards // total)
        s = min(max(want, prev, num_shards - (len(names) - i)), prev + 1)
        shard_of.append(s)
        prev = s
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n, sk in zip(names, shard_of) if sk == k}
        save_safetensors(model_dir / fname, part)
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(model_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


# ---------------------------------------------------------------- deterministic values
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _normal(seed: int, name: str, shape, std: float) -> np.ndarray:
    return (std * _rng(seed, name).standard_normal(shape)).astype(np.float32)  # shape


def _norm_weight(seed: int, name: str, n: int) -> np.ndarray:
    """RMSNorm gain around 1 (zeros would erase the signal)."""
    return (1.0 + 0.1 * _rng(seed, name).standard_normal(n)).astype(np.float32)  # [n]


def _cast(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    if dtype == "f32":
        return tensors
    if dtype == "bf16":
        return {n: f32_to_bf16_array(t) for n, t in tensors.items()}  # uint16 bits
    raise ValueError(f"dtype must be 'bf16' or 'f32', got {dtype!r}")


_HF_DTYPE = {"bf16": "bfloat16", "f32": "float32"}


def _merge(config: dict, extra: dict | None) -> dict:
    """Recursive merge of `extra` into `config` (sub-dicts merge; DELETE removes a key)."""
    for key, value in (extra or {}).items():
        if value is DELETE:
            config.pop(key, None)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = value
    return config


# ---------------------------------------------------------------- tokenizer
@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # every byte is in the initial alphabet, so any text encodes (no unknown tokens)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    # special tokens after the BPE vocabulary, like Qwen3 (ids vocab_size, vocab_size+1, ...)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(ADDED_TOKENS))
    return tok.to_str()


def train_tiny_tokenizer(vocab_size: int = 1000) -> Tokenizer:
    """Byte-level BPE with `vocab_size` learned entries (bytes included) + special tokens.

    Deterministic (no randomness in BPE training); trained once per process (~50 ms) and
    returned as a fresh object each call so callers may modify it."""
    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


def _target_tokenizer(architecture: str, vocab_size: int) -> Tokenizer:
    tok = train_tiny_tokenizer(vocab_size)
    if architecture == "llama":  # Llama 3 style: the post-processor prepends BOS
        bos = tok.token_to_id(BEGIN_OF_TEXT)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BEGIN_OF_TEXT} $A",
                                          pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT} $B",
                                          special_tokens=[(BEGIN_OF_TEXT, bos)]),
        ])
    return tok


# ---------------------------------------------------------------- target
_TARGET_ARCH = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def write_target(path, *, architecture: str = "qwen3", hidden_size: int = 64,
                 intermediate_size: int = 128, num_hidden_layers: int = 4,
                 num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                 vocab_size: int | None = None, tie_word_embeddings: bool = False,
                 dtype: str = "bf16", num_shards: int = 1, seed: int = 0,
                 rope_theta: float = 1e6, rms_norm_eps: float = 1e-6,
                 max_position_embeddings: int = 4096, init_std: float = 0.02,
                 chat_template: bool = True, tokenizer_vocab_size: int = 1000,
                 extra_config: dict | None = None) -> Path:
    """Write a random Qwen3 / Llama target as a Hugging Face directory; returns its path.

    vocab_size None -> the next multiple of 64 strictly above the tokenizer's size, so there
    are padded ids the tokenizer does not know (as Qwen3: 151936 vs 151669).
    init_std is the std of every matrix (embeddings included); raise it (e.g. 0.5) for random
    models with peaky next-token distributions.
    """
    if architecture not in _TARGET_ARCH:
        raise ValueError(f"architecture must be one of {sorted(_TARGET_ARCH)}, got {architecture!r}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {num_key_value_heads}")
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = _target_tokenizer(architecture, tokenizer_vocab_size)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    V = (n_tok // 64 + 1) * 64 if vocab_size is None else vocab_size
    if V < n_tok:
        raise ValueError(f"vocab_size {V} is smaller than the tokenizer's {n_tok} tokens")
    H, I, nh, nkv, hd = hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim

    # ---- weights, in model order (shards follow it)
    w: dict[str, np.ndarray] = {}
    w["model.embed_tokens.weight"] = _normal(seed, "model.embed_tokens.weight", (V, H), init_std)
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = _norm_weight(seed, p + "input_layernorm.weight", H)
        for proj, shape in (("q_proj", (nh * hd, H)), ("k_proj", (nkv * hd, H)),
                            ("v_proj", (nkv * hd, H)), ("o_proj", (H, nh * hd))):
            name = p + f"self_attn.{proj}.weight"
            w[name] = _normal(seed, name, shape, init_std)
        if architecture == "qwen3":
            for norm in ("q_norm", "k_norm"):
                name = p + f"self_attn.{norm}.weight"
                w[name] = _norm_weight(seed, name, hd)
        w[p + "post_attention_layernorm.weight"] = _norm_weight(seed, p + "post_attention_layernorm.weight", H)
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            name = p + f"mlp.{proj}.weight"
            w[name] = _normal(seed, name, shape, init_std)
    w["model.norm.weight"] = _norm_weight(seed, "model.norm.weight", H)
    if not tie_word_embeddings:
        w["lm_head.weight"] = _normal(seed, "lm_head.weight", (V, H), init_std)
    _write_weights(model_dir, _cast(w, dtype), num_shards)

    # ---- config.json (published Qwen3 / Llama 3 field names)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    bos_id = ids[BEGIN_OF_TEXT] if architecture == "llama" else ids[ENDOFTEXT]
    config = {
        "architectures": [_TARGET_ARCH[architecture]], "model_type": architecture,
        "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": bos_id, "eos_token_id": ids[IM_END],
        "head_dim": hd, "hidden_act": "silu", "hidden_size": H, "initializer_range": init_std,
        "intermediate_size": I, "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": nh, "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": nkv, "rms_norm_eps": rms_norm_eps, "rope_scaling": None,
        "rope_theta": rope_theta, "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": _HF_DTYPE[dtype], "use_cache": True, "vocab_size": V,
    }
    if architecture == "qwen3":
        config.update(max_window_layers=num_hidden_layers, sliding_window=None, use_sliding_window=False)
    else:
        config.update(mlp_bias=False, pretraining_tp=1)
    _write_json(model_dir / "config.json", _merge(config, extra_config))
    _write_json(model_dir / "generation_config.json", {
        "bos_token_id": bos_id, "eos_token_id": [ids[ENDOFTEXT], ids[IM_END]],
        "pad_token_id": ids[ENDOFTEXT], "do_sample": False})

    write_tokenizer_files(model_dir, tok, architecture, max_position_embeddings, chat_template)
    return model_dir


def write_tokenizer_files(model_dir: Path, tok: Tokenizer, architecture: str, max_position_embeddings: int,
                          chat_template: bool = True) -> None:
    """tokenizer.json + tokenizer_config.json (Llama: BOS prepended; ChatML template)."""
    (model_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "add_bos_token": architecture == "llama",
        "bos_token": BEGIN_OF_TEXT if architecture == "llama" else None,
        "eos_token": IM_END, "pad_token": ENDOFTEXT,
    }
    if chat_template:
        prefix = "{{- bos_token }}\n" if architecture == "llama" else ""
        tok_config["chat_template"] = prefix + CHAT_TEMPLATE
    _write_json(model_dir / "tokenizer_config.json", tok_config)


# ---------------------------------------------------------------- draft
def build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """spec §2.2: [L // 2] for one tap, else round(1 + i*(L-4)/(n-1)) (half-even)."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


def _default_tap_ids(L: int, n: int) -> list[int]:
    """The the spec formula when it gives n distinct layers below the last; for tiny targets
    (where it collapses or runs past the end) n distinct layers spread evenly over 0..L-2.
    The last layer is avoided: its output is the post-final-norm state in HF terms."""
    ids = build_target_layer_ids(L, n)
    if len(set(ids)) == n and all(0 <= i <= L - 2 for i in ids):
        return ids
    if n > L - 1:
        raise ValueError(f"cannot choose {n} distinct tap layers below the last of a {L}-layer "
                         "target; pass target_layer_ids explicitly")
    return [round(x) for x in np.linspace(0, L - 2, n)]  # step >= 1, so distinct


def write_draft(path, target_dir, *, kind: str = "dflash2", num_hidden_layers: int = 2,
                block_size: int = 8, target_layer_ids: list[int] | None = None,
                num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                head_dim: int | None = None, intermediate_size: int | None = None,
                layer_types: list[str] | None = None, sliding_window: int | None = None,
                is_causal: bool | None = False, mask_token_id: int | None = None,
                conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 16,
                selector_top_k: int = 8, input_embedding_scale: float = 1.0,
                output_multiplier: float = 1.0, final_logit_softcapping: float | None = None,
                nested: bool = True, dtype: str = "bf16", seed: int = 0, init_std: float = 0.02,
                include_selector: bool = True, identity_conv: bool = False,
                zero_selector: bool = False, extra_config: dict | None = None) -> Path:
    """Write a random DFlash (kind="dflash") or DFlash2 (kind="dflash2") draft for a target
    directory written by `write_target` (or any HF Qwen3/Llama directory); returns its path.

    Shapes, sizes and token ids come from the target's config.json; mask_token_id None -> the
    target tokenizer's `<|mask|>`. nested=True keeps block_size / mask_token_id /
    target_layer_ids in `dflash_config`, nested=False puts them top level (spec §2.2).
    is_causal=None omits the key (legacy rule). identity_conv=True makes both convs the
    identity (tap-0 base 1, other taps 0, kernel_projection 0); zero_selector=True zeroes the
    codebooks (selector scores = candidate values, so the walk picks the argmax).
    """
    if kind not in ("dflash", "dflash2"):
        raise ValueError(f"kind must be 'dflash' or 'dflash2', got {kind!r}")
    target_dir = Path(target_dir)
    tcfg = json.loads((target_dir / "config.json").read_text())
    tcfg = {**tcfg, **(tcfg.get("text_config") or {})}  # composite targets (Muse-Glimmer, Qwen3.5) nest the text keys
    H, V, L_target = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"]
    nh = num_attention_heads or tcfg["num_attention_heads"]
    nkv = num_key_value_heads or tcfg.get("num_key_value_heads", nh)
    hd = head_dim or tcfg.get("head_dim") or H // nh
    I = intermediate_size or tcfg["intermediate_size"]
    L = num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = _default_tap_ids(L_target, L)
    n_taps = len(target_layer_ids)
    if mask_token_id is None:
        mask_token_id = Tokenizer.from_file(str(target_dir / "tokenizer.json")).token_to_id(MASK_TOKEN)
        if mask_token_id is None:
            raise ValueError(f"{target_dir / 'tokenizer.json'}: no {MASK_TOKEN} token; pass mask_token_id")
    if layer_types is not None and "sliding_attention" in layer_types and sliding_window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
    v2 = kind == "dflash2"
    if v2 and H % conv_group_size:
        raise ValueError(f"conv_group_size {conv_group_size} does not divide hidden_size {H}")
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)

    # ---- weights (no embed_tokens / lm_head: the draft borrows the target's)
    w: dict[str, np.ndarray] = {}
    w["fc.weight"] = _normal(seed, "fc.weight", (H, n_taps * H), init_std)
    w["hidden_norm.weight"] = _norm_weight(seed, "hidden_norm.weight", H)
    for i in range(L):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = _norm_weight(seed, p + "input_layernorm.weight", H)
        for proj, shape in (("q_proj", (nh * hd, H)), ("k_proj", (nkv * hd, H)),
                            ("v_proj", (nkv * hd, H)), ("o_proj", (H, nh * hd))):
            w[p + f"self_attn.{proj}.weight"] = _normal(seed, p + f"self_attn.{proj}.weight", shape, init_std)
        for norm in ("q_norm", "k_norm"):
            w[p + f"self_attn.{norm}.weight"] = _norm_weight(seed, p + f"self_attn.{norm}.weight", hd)
        w[p + "post_attention_layernorm.weight"] = _norm_weight(seed, p + "post_attention_layernorm.weight", H)
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w[p + f"mlp.{proj}.weight"] = _normal(seed, p + f"mlp.{proj}.weight", shape, init_std)
        if v2:
            G, T = H // conv_group_size, conv_kernel_size
            for conv in ("attention_conv", "mlp_conv"):
                base_name, proj_name = p + f"{conv}.base_kernel", p + f"{conv}.kernel_projection.weight"
                base = np.zeros((2, T, H), np.float32)  # [side, tap, H]
                if identity_conv:
                    base[:, 0, :] = 1.0
                    proj = np.zeros((2 * T * G, H), np.float32)
                else:  # tap 0 near 1, older taps small: a perturbed identity
                    base = 0.1 * _rng(seed, base_name).standard_normal((2, T, H)).astype(np.float32)
                    base[:, 0, :] += 1.0
                    proj = _normal(seed, proj_name, (2 * T * G, H), init_std)
                w[base_name], w[proj_name] = base, proj
    w["norm.weight"] = _norm_weight(seed, "norm.weight", H)
    if v2 and include_selector:
        r = selector_rank
        w["candidate_selector.hidden_projection.weight"] = _normal(
            seed, "candidate_selector.hidden_projection.weight", (r, H), init_std)
        for cb in ("predecessor_codebook", "successor_codebook"):
            name = f"candidate_selector.{cb}"
            w[name] = np.zeros((V, r), np.float32) if zero_selector else _normal(seed, name, (V, r), init_std)
    _write_weights(model_dir, _cast(w, dtype), 1)

    # ---- config.json (v2 follows the published DFlash2 layout)
    dflash = {"block_size": block_size, "mask_token_id": mask_token_id,
              "target_layer_ids": list(target_layer_ids)}
    config = {
        "architectures": ["DFlash2DraftModel" if v2 else "DFlashDraftModel"], "model_type": "qwen3",
        "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": tcfg.get("bos_token_id"), "eos_token_id": tcfg.get("eos_token_id"),
        "dtype": _HF_DTYPE[dtype], "head_dim": hd, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": init_std, "intermediate_size": I,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "max_window_layers": L, "num_attention_heads": nh, "num_hidden_layers": L,
        "num_key_value_heads": nkv, "num_target_layers": L_target,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6), "sliding_window": sliding_window,
        "tie_word_embeddings": False, "use_cache": False,
        "use_sliding_window": bool(layer_types and "sliding_attention" in layer_types),
        "vocab_size": V,
    }
    rope_theta = tcfg.get("rope_theta") or tcfg.get("rope_parameters", {}).get("rope_theta", 1e6)
    if v2:  # published DFlash2: nested rope_parameters only, no flat rope_theta
        config["rope_parameters"] = {"rope_theta": rope_theta, "rope_type": "default"}
        config["dflash_config"] = {
            "conv_group_size": conv_group_size, "conv_kernel_size": conv_kernel_size,
            "selector_rank": selector_rank, "selector_top_k": selector_top_k,
            "input_embedding_scale": input_embedding_scale, "output_multiplier": output_multiplier,
            "final_logit_softcapping": final_logit_softcapping}
    else:
        config["rope_theta"] = rope_theta
        config["rope_scaling"] = None
        config["dflash_config"] = {}
    if nested:
        config["dflash_config"].update(dflash)
    else:
        config.update(dflash)
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
    if is_causal is not None:
        config["is_causal"] = is_causal
    _write_json(model_dir / "config.json", _merge(config, extra_config))
    return model_dir
