"""The public entry points (spec §9): load a (target, draft) pair, then stream.

    target = load_target("models/Qwen3-8B")                 # TargetModel + target.tokenizer
    draft  = load_draft("models/Qwen3-8B-DFlash-b16", target) # v1 or v2, decided by config.json
    for step in stream_generate(target, draft, "prompt", max_new_tokens=256): ...
    result = generate(target, None, "prompt")                # draft=None: target-only
"""

from __future__ import annotations

from pathlib import Path

from .config import DRAFT_ARCHITECTURES, read_config_json
from .config_checks import architecture_of
from .errors import DeviceUnavailableError, GenerationArgumentError, UnknownArchitectureError

DEVICES = ("cpu", "cuda")
DTYPES = ("f32", "bf16")
KV_DTYPES = ("f32", "bf16")  # the KV cache element types (numerics.KV_DTYPES maps them to numpy dtypes)


QUANTIZE = ("bf16", "q8_0", "q4_0", "q4_k")  # "bf16": the weights as stored


def _quantize_arg(quantize):
    """None / "bf16" / "none" -> None (as stored); "q8_0" / "q4_0" / "q4_k" pass; anything else refused."""
    if quantize in (None, "bf16", "none"):
        return None
    if quantize not in QUANTIZE:
        raise GenerationArgumentError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    return quantize


def load_target(model_dir, device: str = "cpu", dtype: str = "f32", quantize: str | None = None,
                keep_head: bool = False, kv_dtype: str = "f32"):
    """A Hugging Face target directory (any family in `families.FAMILIES`) -> its model with
    `.tokenizer` attached. quantize "q8_0" / "q4_0" / "q4_k": every linear weight (the lm_head too,
    unless keep_head) is quantized at load with llama.cpp's block math (Qwen3 / Llama targets).
    kv_dtype "f32" | "bf16": the element type of the KV caches of the target and of a draft
    loaded for it (bf16 halves the bytes attention reads at long context; CPU only)."""
    quantize = _quantize_arg(quantize)
    if device not in DEVICES:
        raise GenerationArgumentError(f"device must be one of {DEVICES}, got {device!r}")
    if dtype not in DTYPES:
        raise GenerationArgumentError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if kv_dtype not in KV_DTYPES:
        raise GenerationArgumentError(f"kv_dtype must be one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype != "f32" and device != "cpu":
        raise GenerationArgumentError(f"kv_dtype={kv_dtype!r} is implemented on the CPU only (the CUDA attention "
                                      f"kernel reads an f32 cache); use kv_dtype='f32' with device={device!r}")
    if device == "cuda":
        _require_cuda()
    from .families import target_family  # lazy: importing compiles nothing, but keeps
    from .tokenizer import Tokenizer      # `import dflash2_numba` cheap

    config_path, raw = read_config_json(model_dir)
    family = target_family(raw, str(config_path))
    # config and tokenizer first: their refusals need no kernel module (no numba import)
    family.resolve(raw, str(config_path))
    tok = Tokenizer.from_dir(model_dir)
    cls = family.model_class()
    if quantize is None:
        target = cls.load(model_dir, device=device, dtype=dtype)
    else:
        if not getattr(cls, "quantizable", False):
            raise GenerationArgumentError(
                f"{config_path}: quantize={quantize!r} is implemented for the Qwen3 / Llama, Qwen3-MoE and "
                f"Qwen3.5 (dense and MoE) targets, not {cls.__name__}")
        target = cls.load(model_dir, device=device, dtype=dtype, quantize=quantize, keep_head=keep_head)
    target.kv_dtype = kv_dtype
    target.tokenizer = tok
    # ids >= the tokenizer's size are padding (§2.1); the decode loop masks them to -inf
    target.valid_vocab = min(tok.vocab_size, target.config.vocab_size)
    return target


def _require_cuda() -> None:
    try:
        from numba import cuda
        ok = cuda.is_available()
    except Exception:  # numba-cuda missing or broken driver: same answer for the user
        ok = False
    if not ok:
        raise DeviceUnavailableError("--device cuda: no CUDA device is available (numba.cuda.is_available() is False)")


def draft_kind(draft_dir) -> str:
    """"dflash" | "dflash2" from config.json architectures[0] (typed error otherwise)."""
    path, raw = read_config_json(draft_dir)
    arch = architecture_of(raw, str(path))
    if arch not in DRAFT_ARCHITECTURES:
        raise UnknownArchitectureError(
            f"{path}: architectures[0] = {arch!r}; supported drafts: {', '.join(DRAFT_ARCHITECTURES)}")
    return DRAFT_ARCHITECTURES[arch]


def load_draft(draft_dir, target, quantize: str | None = "auto"):
    """A DFlash (v1) or DFlash2 draft directory, paired with a loaded target. quantize: "auto"
    (quant/draft_format.py: the format measured cheaper for this kernel path and target, else the
    target's), "same" (the target's weight format), "bf16" (as stored), "q8_0", "q4_0", "q4_k".
    The draft's `.weight_format` and `.format_reason` say what it runs. Draft activations stay f32."""
    kind = draft_kind(draft_dir)
    from .models import draft as draft_models  # lazy: the model module is heavy

    reason = None
    if quantize == "auto":
        quantize, reason = _auto_draft_format(draft_dir, target)
    ops = None
    if quantize != "same":
        quantize = _quantize_arg(quantize)
        if quantize != getattr(target.ops, "quantize", None):
            from .kernels.backend import get_ops

            ops = get_ops(target.ops.device, quantize)
    draft = draft_models.load_draft(Path(draft_dir), target, kind=kind, ops=ops)
    draft.weight_format = getattr(draft.ops, "quantize", None) or "bf16"
    draft.format_reason = reason or ("--draft-quantize " + ("same" if quantize == "same" else (quantize or "bf16")))
    return draft


def _auto_draft_format(draft_dir, target) -> tuple[str, str]:
    from .quant import draft_format

    _, raw = read_config_json(draft_dir)
    fmt, why = draft_format.choose(getattr(target.ops, "quantize", None), target.ops.device, draft_format.kernel_path(),
                                   draft_format.draft_bytes(draft_dir), "quantization_config" in raw)
    return fmt, "--draft-quantize auto: " + why
