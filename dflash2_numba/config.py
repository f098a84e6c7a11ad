"""Config resolution for targets and drafts (spec §2).

Field names follow the Hugging Face keys. Every refusal names the file, the key, the expected
and the actual value. Resolution is pure: `resolve_*` take the parsed JSON dict; `load_*` read
the directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .config_checks import (
    MAX_LAYERS,
    architecture_of,
    check_bool,
    check_float,
    check_int,
    check_int_list,
    get_bool,
    get_float,
    get_int,
    get_object,
    get_str,
    head_geometry,
    token_ids,
)
from .errors import (
    AttentionSinkBiasError,
    CheckpointNotFoundError,
    ConfigError,
    ConfigValueError,
    CorruptHeaderError,
    GGUFNotSupportedError,
    IsCausalTypeError,
    PairingError,
    UnknownArchitectureError,
    UnsupportedConfigError,
)
from .input_files import MAX_CONFIG_BYTES, read_json_object

DRAFT_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2",
                       "MuseGlimmerAssistantModel": "dflash"}  # Meta's DFlash v1 head for Muse-Glimmer
MUSE_ASSISTANT = "MuseGlimmerAssistantModel"
MUSE_ASSISTANT_ROPE_THETA = 500000.0  # MuseGlimmerAssistantConfig's default_theta
DEFAULT_ROPE_THETA = 1e6


# ---------------------------------------------------------------- reading config.json
def refuse_gguf(path: Path) -> None:
    """There is no GGUF path here: say so, name the file."""
    path = Path(path)
    ggufs = [path] if path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    if ggufs and not (path.is_dir() and (path / "config.json").exists()):
        raise GGUFNotSupportedError(
            f"{ggufs[0]}: GGUF checkpoints are not supported (no GGUF path here); "
            "give a Hugging Face directory with config.json and *.safetensors"
        )


def read_config_json(model_dir: str | Path) -> tuple[Path, dict]:
    """-> (path of config.json, parsed dict). Typed errors for missing dir/file, GGUF, bad JSON."""
    model_dir = Path(model_dir)
    refuse_gguf(model_dir)
    if not model_dir.exists():
        raise CheckpointNotFoundError(f"{model_dir}: directory does not exist")
    if not model_dir.is_dir():
        raise CheckpointNotFoundError(f"{model_dir}: expected a model directory, got a file")
    path = model_dir / "config.json"
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: config.json not found in {model_dir}")
    raw = read_json_object(path, MAX_CONFIG_BYTES, CorruptHeaderError, not_object=ConfigError)
    return path, raw


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (inspect reports and family facts)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def rope_theta_of(raw: dict, source: str) -> float:
    """Flat `rope_theta` wins; nested `rope_parameters.rope_theta` is the fallback. > 0: a zero
    or negative base makes every inverse frequency inf / NaN."""
    if raw.get("rope_theta") is not None:
        return check_float(raw["rope_theta"], "rope_theta", source, positive=True)
    nested = get_object(raw, "rope_parameters", source)
    if nested.get("rope_theta") is not None:
        return check_float(nested["rope_theta"], "rope_parameters.rope_theta", source, positive=True)
    return DEFAULT_ROPE_THETA


def refuse_rope_scaling(raw: dict, source: str) -> None:
    """Only plain RoPE is implemented; anything else would be silently wrong."""
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if params and not isinstance(params, dict):
            raise ConfigError(f"{source}: {key} must be an object, got {type(params).__name__}")
        if params:
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in (None, "default"):
                raise UnsupportedConfigError(
                    f"{source}: {key}.rope_type = {kind!r} is not supported (only 'default' RoPE)"
                )


# ---------------------------------------------------------------- what every decoder stack has
@dataclass(frozen=True)
class DecoderDims:
    """The geometry every config here shares (targets of each family, drafts), HF key names.
    Family configs subclass it and add their own keys after these."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float


def decoder_dims(raw: dict, where: str, intermediate_key: str = "intermediate_size",
                 eps_default: float = 1e-6) -> dict:
    """The DecoderDims fields read from a (flat or text_config) dict, typed and range-checked;
    head_dim by head_geometry's rule. -> keyword dict for the family's dataclass."""
    H = get_int(raw, "hidden_size", where, minimum=1)
    nh, nkv, hd = head_geometry(raw, where, H)
    return dict(hidden_size=H, intermediate_size=get_int(raw, intermediate_key, where, minimum=1),
                num_hidden_layers=get_int(raw, "num_hidden_layers", where, minimum=1, maximum=MAX_LAYERS),
                num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
                rms_norm_eps=get_float(raw, "rms_norm_eps", where, default=eps_default, positive=True))


LAYER_TYPES = ("full_attention", "sliding_attention")


# ---------------------------------------------------------------- draft
def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """spec §2.2: [L//2] for one draft layer, else round(1 + i*(L-4)/(n-1)) (half-even)."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


@dataclass(frozen=True)
class DraftConfig(DecoderDims):
    architecture: str  # "DFlashDraftModel" | "DFlash2DraftModel"
    kind: str  # "dflash" | "dflash2"
    rope_theta: float
    block_size: int  # B, the trained block size (runtime Q may be smaller)
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    layer_types: list[str] | None
    sliding_window: int | None
    layer_causal: list[bool]  # per layer: key s visible from query q only if s <= q
    layer_window: list[int | None]  # per layer: symmetric window W (|q-s| <= W-1) or None = full
    vocab_size: int | None
    # DFlash2 only (None for v1)
    conv_kernel_size: int | None = None  # taps
    conv_group_size: int | None = None  # S
    selector_rank: int | None = None  # r
    selector_top_k: int | None = None  # K
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None = disabled
    source: str = "config.json"
    attention_bias: bool = False  # q/k/v/o biases (z-lab/gpt-oss-20b-DFlash)
    rope_scaling: object = None  # models/rope.RopeScaling (YaRN) or None = plain RoPE

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def conv_groups(self) -> int:  # G = H / S
        return self.hidden_size // self.conv_group_size

    @property
    def context_tensor_names(self) -> tuple[str, str]:
        """(context projection, its norm): z-lab names, or the Muse assistant's `encoder.*`."""
        if self.architecture == MUSE_ASSISTANT:
            return "encoder.fc.weight", "encoder.output_norm_enc.weight"
        return "fc.weight", "hidden_norm.weight"


def _first(*candidates: tuple[str, object]) -> tuple[str, object]:
    """(key, value) of the first candidate whose value is not None (first hit wins);
    (first key, None) when none is set. Keys are the dotted names used in messages."""
    for key, value in candidates:
        if value is not None:
            return key, value
    return candidates[0][0], None


def _layer_causality(raw: dict, dc: dict, n_layers: int, layer_types, source: str) -> list[bool]:
    """`is_causal` (JSON bool only), then `dflash_config.causal`, else the legacy rule.

    A string such as "false" is truthy in Python and would silently flip every layer to
    causal, so anything that is not a JSON bool is refused by name."""
    for key, value in (("is_causal", raw.get("is_causal")), ("dflash_config.causal", dc.get("causal"))):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise IsCausalTypeError(
                f"{source}: {key} must be a JSON bool (true/false), got {type(value).__name__} {value!r}"
            )
        return [value] * n_layers
    if layer_types is None:
        return [False] * n_layers
    return [t == "sliding_attention" for t in layer_types]


def resolve_draft_config(raw: dict, target=None, source: str = "config.json") -> DraftConfig:
    """spec §2.2 table. `target` supplies num_target_layers / vocab when the draft omits them."""
    arch = architecture_of(raw, source)
    if arch not in DRAFT_ARCHITECTURES:
        raise UnknownArchitectureError(
            f"{source}: architectures[0] = {arch!r}; supported drafts: {', '.join(DRAFT_ARCHITECTURES)}"
        )
    kind = DRAFT_ARCHITECTURES[arch]
    dc = get_object(raw, "dflash_config", source)
    for key, sink in (("dflash_config.attention_sink_bias", dc.get("attention_sink_bias")),
                      ("attention_sink_bias", raw.get("attention_sink_bias"))):
        if sink is not None and sink is not False:
            raise AttentionSinkBiasError(
                f"{source}: {key} = {sink!r} is refused (expected false or absent): this decoder has "
                "no attention-sink path and would compute a different attention"
            )
    rope_scaling = _draft_rope_scaling(raw, source)

    def nested_or_top(name: str):  # dflash_config.<name> wins over the top-level key
        return _first((f"dflash_config.{name}", dc.get(name)), (name, raw.get(name)))

    key, block_size = nested_or_top("block_size")
    if block_size is None:
        raise ConfigError(f"{source}: block_size missing (looked in dflash_config.block_size, block_size)")
    block_size = check_int(block_size, key, source, minimum=2)  # anchor + at least one mask
    key, mask_token_id = nested_or_top("mask_token_id")
    if mask_token_id is None:
        raise ConfigError(f"{source}: mask_token_id missing (looked in dflash_config.mask_token_id, mask_token_id)")
    mask_token_id = check_int(mask_token_id, key, source, minimum=0)

    dims = decoder_dims(raw, source)
    H, n_layers = dims["hidden_size"], dims["num_hidden_layers"]
    key, num_target_layers = _first(("num_target_layers", raw.get("num_target_layers")),
                                    ("dflash_config.num_target_layers", dc.get("num_target_layers")))
    if num_target_layers is None and target is not None:
        num_target_layers = target.num_hidden_layers
    if num_target_layers is None and arch != MUSE_ASSISTANT:  # the assistant names its taps, no count
        raise ConfigError(f"{source}: num_target_layers unknown and no target given")
    if num_target_layers is not None:
        num_target_layers = check_int(num_target_layers, key, source, minimum=1)
    key, tap_ids = nested_or_top("target_layer_ids")
    if tap_ids is None:
        if num_target_layers is None:
            raise ConfigError(f"{source}: neither {key} nor num_target_layers is given (and no target)")
        tap_ids = build_target_layer_ids(num_target_layers, n_layers)
    tap_ids = check_int_list(tap_ids, key, source, minimum=0)
    if not tap_ids:
        raise ConfigValueError(f"{source}: {key} = [], expected at least one target layer")

    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ConfigError(f"{source}: layer_types must be a list, got {type(layer_types).__name__}")
        if len(layer_types) != n_layers:
            raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries, expected {n_layers}")
        for t in layer_types:
            if t not in LAYER_TYPES:
                raise ConfigError(f"{source}: layer_types entry {t!r} is not full_attention/sliding_attention")
        sliding = [t == "sliding_attention" for t in layer_types]
    else:
        use_swa = dc.get("use_swa", False)
        sliding = [check_bool(use_swa, "dflash_config.use_swa", source) if use_swa is not None else False] * n_layers
    key, window = _first(("dflash_config.swa_window_size", dc.get("swa_window_size")),
                         ("sliding_window", raw.get("sliding_window")))
    if any(sliding) and window is None:
        raise ConfigError(f"{source}: a layer slides but no window (dflash_config.swa_window_size, sliding_window)")
    window = None if window is None else check_int(window, key, source, minimum=1)
    layer_window = [window if s else None for s in sliding]
    layer_causal = _layer_causality(raw, dc, n_layers, layer_types, source)
    rope_theta = rope_theta_of(raw, source)
    if arch == MUSE_ASSISTANT:
        layer_causal, layer_window, rope_theta = _muse_assistant_rules(raw, layer_window, source)

    v2: dict = {}
    if kind == "dflash2":
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if dc.get(name) is None:
                raise ConfigError(f"{source}: dflash_config.{name} is required for DFlash2DraftModel")
            v2[name] = check_int(dc[name], f"dflash_config.{name}", source, minimum=1)
        if H % v2["conv_group_size"]:
            raise ConfigValueError(
                f"{source}: conv_group_size {v2['conv_group_size']} does not divide hidden_size {H}"
            )

    def scalar(name: str, default: float | None) -> float | None:  # dflash_config.<name>, finite
        value = dc.get(name)
        return default if value is None else check_float(value, f"dflash_config.{name}", source)

    cap = scalar("final_logit_softcapping", None)
    cap = cap if cap is not None and cap > 0 else None  # <= 0 disables, as in the reference

    return DraftConfig(
        architecture=arch,
        kind=kind,
        **dims,
        rope_theta=rope_theta_of(raw, source),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tap_ids,
        num_target_layers=num_target_layers,
        layer_types=list(layer_types) if layer_types is not None else None,
        sliding_window=window,
        layer_causal=layer_causal,
        layer_window=layer_window,
        vocab_size=get_int(raw, "vocab_size", source, default=None, minimum=1),
        input_embedding_scale=scalar("input_embedding_scale", 1.0),
        output_multiplier=scalar("output_multiplier", 1.0),
        final_logit_softcapping=cap,
        source=source,
        attention_bias=get_bool(raw, "attention_bias", source, default=False),
        rope_scaling=rope_scaling,
        **v2,
    )


def _draft_rope_scaling(raw: dict, source: str):
    """The draft's RoPE (models/rope.py): plain, or YaRN from rope_parameters / rope_scaling. A
    draft whose model_type is gpt_oss and that names no RoPE object gets what transformers'
    GptOssConfig fills in (YaRN factor 32 over 4096 positions, truncate false): its config
    class is the one AutoConfig builds for it."""
    from .models.rope import GPT_OSS_YARN, resolve_rope_scaling

    if raw.get("architectures") == [MUSE_ASSISTANT]:
        refuse_rope_scaling(raw, source)
        return None
    default = GPT_OSS_YARN if raw.get("model_type") == "gpt_oss" else None
    max_pos = get_int(raw, "max_position_embeddings", source, default=131072 if default else 32768, minimum=1)
    return resolve_rope_scaling(raw, source, max_pos, default=default)


def _muse_assistant_rules(raw: dict, layer_window: list, source: str):
    """MuseGlimmerAssistantModel (HF) -> (layer_causal, layer_window, rope_theta).

    Always non-causal (HF hard-codes it; the config has no is_causal, and the legacy rule
    "causal iff sliding" would wrongly make every layer causal). Its sliding mask (HF eager /
    sdpa) shows keys with |q - s| <= W, one more than the z-lab rule |q - s| <= W-1 that the
    attention kernel's `window` means, hence window W+1. RoPE theta defaults to the class's 5e5."""
    if raw.get("is_causal") is not None and raw.get("is_causal") is not False:
        raise UnsupportedConfigError(
            f"{source}: is_causal = {raw['is_causal']!r} for {MUSE_ASSISTANT}; expected absent or false "
            "(the assistant's block attention is always bidirectional)")
    has_theta = raw.get("rope_theta") is not None or (raw.get("rope_parameters") or {}).get("rope_theta") is not None
    theta = rope_theta_of(raw, source) if has_theta else MUSE_ASSISTANT_ROPE_THETA
    return [False] * len(layer_window), [w + 1 if w else None for w in layer_window], theta


def load_draft_config(draft_dir: str | Path, target=None) -> DraftConfig:
    path, raw = read_config_json(draft_dir)
    return resolve_draft_config(raw, target, source=str(path))


def check_pairing(draft: DraftConfig, target) -> None:
    """Refuse a draft that cannot read this target's states (names both values)."""
    where = f"{draft.source} vs {target.source}"
    if draft.hidden_size != target.hidden_size:
        raise PairingError(f"{where}: draft hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}")
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise PairingError(
            f"{where}: target_layer_ids {bad} out of range for a target with {target.num_hidden_layers} layers"
        )
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise PairingError(f"{where}: mask_token_id {draft.mask_token_id} not < target vocab_size {target.vocab_size}")
