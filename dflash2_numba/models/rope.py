"""RoPE frequencies: plain (`rope_type` "default") and YaRN, as transformers 5.x computes them
(modeling_rope_utils `_compute_default_rope_parameters` / `_compute_yarn_parameters`), shared by
targets and drafts (models/layers.RopeTables takes the result).

    scaling = resolve_rope_scaling(raw, source, max_position_embeddings)   # RopeScaling | None
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling)  # f32 [hd/2], float

YaRN (docs/gpt_oss.md): with pos_freqs_i = theta^(2i/d) (i < d/2),
    extrapolation_i = 1 / pos_freqs_i,   interpolation_i = 1 / (factor * pos_freqs_i)
    low / high = d * ln(orig / (beta * 2 pi)) / (2 ln theta)  for beta = beta_fast / beta_slow,
                 floor / ceil'd only when `truncate` (transformers' default when the key is
                 absent: true; gpt-oss sets false), then clipped to [0, d - 1]
    ramp_i = clip((i - low) / (high - low), 0, 1),   extrapolation weight e_i = 1 - ramp_i
    inv_freq_i = interpolation_i * (1 - e_i) + extrapolation_i * e_i
    attention_factor = 0.1 ln(factor) + 1 (or from mscale / mscale_all_dim, or given), and it
    multiplies BOTH cos and sin (so q.k scales by its square).
Computed in f32 like torch (the ramp from f32 aranges, the bounds as Python floats).

Every other rope_type is refused by name (UnsupportedConfigError); a family that has not wired
the tables in keeps refusing YaRN too (config.refuse_rope_scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config_checks import check_bool, check_float, check_int
from ..errors import ConfigError, UnsupportedConfigError

IMPLEMENTED = ("default", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A resolved YaRN configuration (HF key names)."""
    rope_type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


# gpt-oss's GptOssConfig fills this in when a config.json has no rope_scaling / rope_parameters
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def rope_params_of(raw: dict, source: str) -> tuple[str, dict | None]:
    """(key, dict) of `rope_parameters` or the older `rope_scaling` (first non-empty), or (key, None)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if params and not isinstance(params, dict):
            raise ConfigError(f"{source}: {key} must be an object, got {type(params).__name__}")
        if params:
            return key, params
    return "rope_parameters", None


def resolve_rope_scaling(raw: dict, source: str, max_position_embeddings: int,
                         default: dict | None = None) -> RopeScaling | None:
    """None for plain RoPE; a RopeScaling for YaRN; UnsupportedConfigError for any other type.
    `default`: what the model's config class fills in when config.json has no RoPE object."""
    key, params = rope_params_of(raw, source)
    if params is None:
        params, key = default, "rope_parameters (the config class's default)"
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind not in IMPLEMENTED:
        raise UnsupportedConfigError(f"{source}: {key}.rope_type = {kind!r} is not supported "
                                     f"(implemented: {', '.join(IMPLEMENTED)})")
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if prf not in (None, 1, 1.0):
        raise UnsupportedConfigError(f"{source}: partial_rotary_factor = {prf!r} with YaRN is not supported (expected 1)")

    def num(name, default=None, positive=True):
        v = params.get(name)
        return default if v is None else check_float(v, f"{key}.{name}", source, positive=positive)

    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    orig = max_position_embeddings if orig is None else check_int(orig, f"{key}.original_max_position_embeddings",
                                                                  source, minimum=1)
    factor = num("factor")
    if factor is None:
        factor = max_position_embeddings / orig
    truncate = params.get("truncate")
    truncate = True if truncate is None else check_bool(truncate, f"{key}.truncate", source)
    att, mscale, mscale_all = num("attention_factor"), num("mscale"), num("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if att is None:
        if mscale and mscale_all:
            att = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
        else:
            att = get_mscale(factor)
    return RopeScaling("yarn", float(factor), int(orig), num("beta_fast") or 32.0, num("beta_slow") or 1.0,
                       truncate, float(att))


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """1 / theta^(2i/hd) in f32, as HF: [hd/2]."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)  # [hd/2]
    return np.float32(1.0) / (np.float32(theta) ** exponent)


def yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """The YaRN-mixed inverse frequencies [hd/2] f32 (module docstring)."""
    d = head_dim

    def correction_dim(rotations):
        return (d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))  # [hd/2]
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(s.factor) * pos_freqs)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra_w = np.float32(1.0) - ramp.astype(np.float32)  # [hd/2] weight of extrapolation
    return (interpolation * (np.float32(1.0) - extra_w) + extrapolation * extra_w).astype(np.float32)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(inv_freq [hd/2] f32, attention factor multiplying cos and sin)."""
    if scaling is None:
        return default_inv_freq(head_dim, theta), 1.0
    return yarn_inv_freq(head_dim, theta, scaling), scaling.attention_factor
