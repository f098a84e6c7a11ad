"""Typed reads of config.json values: the JSON type and the range of every number a model is
built from, checked before anything is computed with it (spec §2).

Python would happily run `int("64")`, `bool("false")` (True!) or `float("1e6")`, and a zero head
count or a negative eps only shows up later as a traceback or as NaN logits. Every helper here
either returns a value of the promised type and range or raises ConfigValueError naming the
file, the key (dotted for nested keys: `dflash_config.block_size`), what was expected and the
value found. Config resolvers of every target family use them:

    H   = get_int(raw, "hidden_size", source, minimum=1)              # required
    nkv = get_int(raw, "num_key_value_heads", source, default=nh, minimum=1)
    eps = get_float(raw, "rms_norm_eps", source, default=1e-6, positive=True)
    tie = get_bool(raw, "tie_word_embeddings", source, default=False)
    ids = check_int_list(value, "dflash_config.target_layer_ids", source, minimum=0)

A key whose value is JSON null counts as absent (Hugging Face writes `"head_dim": null`).
"""

from __future__ import annotations

import math

from .errors import ConfigError, ConfigValueError

REQUIRED = object()  # `default` sentinel: the key must be present and not null
# num_hidden_layers above this is refused: the inventory lists every layer's tensors, so 10**30
# would allocate until the process dies (the largest published models have ~130 layers)
MAX_LAYERS = 4096


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


def _shown(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _missing(key: str, source: str):
    raise ConfigError(f"{source}: required key '{key}' is missing")


def check_int(value, key: str, source: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """A JSON integer (not a bool, not 64.0, not "64") within [minimum, maximum]."""
    if not _is_int(value):
        raise ConfigValueError(f"{source}: {key} = {_shown(value)}, expected a JSON integer")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = [f">= {minimum}"] * (minimum is not None) + [f"<= {maximum}"] * (maximum is not None)
        raise ConfigValueError(f"{source}: {key} = {value}, expected an integer {' and '.join(bounds)}")
    return int(value)


def check_float(value, key: str, source: str, positive: bool = False, minimum: float | None = None) -> float:
    """A finite JSON number (int or float, not a bool or a string); positive: > 0."""
    if not (_is_int(value) or isinstance(value, float)):
        raise ConfigValueError(f"{source}: {key} = {_shown(value)}, expected a JSON number")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigValueError(f"{source}: {key} = {value!r}, expected a finite number")
    if positive and not value > 0:
        raise ConfigValueError(f"{source}: {key} = {value!r}, expected a number > 0")
    if minimum is not None and value < minimum:
        raise ConfigValueError(f"{source}: {key} = {value!r}, expected a number >= {minimum}")
    return value


def check_bool(value, key: str, source: str) -> bool:
    """A JSON bool: "false" is a truthy string in Python and would flip the meaning."""
    if not isinstance(value, bool):
        raise ConfigValueError(f"{source}: {key} = {_shown(value)}, expected a JSON bool (true/false)")
    return value


def check_int_list(value, key: str, source: str, minimum: int | None = None) -> list[int]:
    """A JSON list of integers, each >= minimum."""
    if not isinstance(value, list):
        raise ConfigValueError(f"{source}: {key} = {_shown(value)}, expected a JSON list of integers")
    return [check_int(v, f"{key}[{i}]", source, minimum) for i, v in enumerate(value)]


def _get(raw: dict, key: str, source: str, default):
    value = raw.get(key)
    if value is None:
        if default is REQUIRED:
            _missing(key, source)
        return default, True
    return value, False


def get_int(raw: dict, key: str, source: str, default=REQUIRED, minimum: int | None = None,
            maximum: int | None = None, shown_key: str | None = None):
    """raw[key] checked by check_int; `default` (may be None) when absent or null."""
    value, absent = _get(raw, key, source, default)
    return value if absent else check_int(value, shown_key or key, source, minimum, maximum)


def get_float(raw: dict, key: str, source: str, default=REQUIRED, positive: bool = False,
              minimum: float | None = None, shown_key: str | None = None):
    value, absent = _get(raw, key, source, default)
    return value if absent else check_float(value, shown_key or key, source, positive, minimum)


def get_bool(raw: dict, key: str, source: str, default=REQUIRED, shown_key: str | None = None):
    value, absent = _get(raw, key, source, default)
    return value if absent else check_bool(value, shown_key or key, source)


def get_str(raw: dict, key: str, source: str, default=REQUIRED, shown_key: str | None = None):
    """A JSON string (`model_type`, `hidden_act`, ...): a number or a list there is refused, not
    compared against names (a list is not even hashable)."""
    value, absent = _get(raw, key, source, default)
    if not absent and not isinstance(value, str):
        raise ConfigValueError(f"{source}: {shown_key or key} = {_shown(value)}, expected a JSON string")
    return value


def get_object(raw: dict, key: str, source: str) -> dict:
    """A nested JSON object (absent / null -> {})."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigValueError(f"{source}: {key} = {_shown(value)}, expected a JSON object")
    return value


def architecture_of(raw: dict, source: str) -> str | None:
    """`architectures[0]` of a config (None when absent or empty); a value that is not a list
    of strings is refused (a bare string would otherwise be read as its first letter)."""
    archs = raw.get("architectures")
    if archs is None:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigValueError(f"{source}: architectures = {_shown(archs)}, expected a JSON list of strings")
    return archs[0] if archs else None


def token_ids(value, key: str, source: str) -> list[int]:
    """`eos_token_id`-style value: an integer >= 0, a list of them, or null -> []."""
    if value is None:
        return []
    if isinstance(value, list):
        return check_int_list(value, key, source, minimum=0)
    return [check_int(value, key, source, minimum=0)]


def bos_token_id(text: dict, raw: dict, where: str, source: str) -> int | None:
    """`bos_token_id` of a nested text config, else of the top level (composite configs put it
    in either place): an integer >= 0 or absent."""
    if text.get("bos_token_id") is not None:
        return get_int(text, "bos_token_id", where, minimum=0)
    return get_int(raw, "bos_token_id", source, default=None, minimum=0)


def head_geometry(raw: dict, source: str, H: int, prefix: str = "") -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim), checked: heads >= 1, the KV heads
    divide the query heads (GQA), and head_dim given or H divisible by the heads."""
    nh = get_int(raw, "num_attention_heads", source, minimum=1, shown_key=prefix + "num_attention_heads")
    nkv = get_int(raw, "num_key_value_heads", source, default=nh, minimum=1,
                  shown_key=prefix + "num_key_value_heads")
    if nh % nkv:
        raise ConfigValueError(f"{source}: {prefix}num_key_value_heads = {nkv} does not divide "
                               f"num_attention_heads = {nh} (grouped-query attention needs a divisor)")
    hd = get_int(raw, "head_dim", source, default=None, minimum=1, shown_key=prefix + "head_dim")
    if hd is None:
        if H % nh:
            raise ConfigValueError(f"{source}: no head_dim and hidden_size = {H} is not divisible by "
                                   f"num_attention_heads = {nh}")
        hd = H // nh
    if hd % 2:
        raise ConfigValueError(f"{source}: {prefix}head_dim = {hd}, expected an even number (RoPE rotates pairs)")
    return nh, nkv, hd
