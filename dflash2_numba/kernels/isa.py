"""Which x86 instruction-set path the kernels compile for, read from numba's own codegen target.

    isa.selected()        -> "avx512_vnni" | "avx_vnni" | "avx2" | "generic"
    isa.vector_bits()     -> 512 | 256 | 128: the register file the bf16 panel tiles are sized for
    isa.target_features() -> {feature: bool} that LLVM will compile for

Why numba's target and not the host: numba compiles for `NUMBA_CPU_NAME` / `NUMBA_CPU_FEATURES`
when they are set (portable caches, CI compile-only checks), and an x86 intrinsic the target
lacks is not a Python exception: LLVM aborts the whole process ("Cannot select", "Do not know how
to split"). So every kernel asks this module, at compile time, which path it may emit, and the
answer is a pure function of the feature string numba hands LLVM. numba's on-disk cache key
holds that string too, so a kernel cached for one path is never loaded for another.

Features not named in the string count as absent (a `NUMBA_CPU_NAME` with an empty or partial
feature list gets the lower path: slower, never an abort).

The override `DFLASH2_ISA=<path>` forces a LOWER path, e.g. to run and benchmark the AVX2 and
generic kernels on an AVX-512 host. It rewrites numba's target features before numba's codegen
exists (`apply_override`, called when `dflash2_numba` is imported), so LLVM really compiles for
that path: 16 ymm registers for avx2, SSE2 for generic. A path above what the target has is
refused (IsaUnavailableError), as is an override that comes after numba built its codegen.
"""

from __future__ import annotations

import os

from ..errors import IsaUnavailableError

PATHS = ("generic", "avx2", "avx_vnni", "avx512_vnni")  # lowest first
ENV = "DFLASH2_ISA"

# feature families an override to a lower path switches off (LLVM's feature names)
_WIDE_PREFIXES = ("avx512", "avx10", "amx", "evex512")
_VNNI_PREFIXES = ("avxvnni", "avxifma", "avxneconvert")

_applied: str | None = None  # the override applied to numba's config, if any


def _numba_target() -> tuple[str, str]:
    """(cpu name, feature string) numba's JIT codegen uses: numba.core.codegen's own rule."""
    import llvmlite.binding as ll
    from numba.core import config

    name = config.CPU_NAME or ll.get_host_cpu_name()
    if config.CPU_FEATURES is not None:
        return name, config.CPU_FEATURES
    return name, ll.get_host_cpu_features().flatten()


def parse_features(text: str) -> dict[str, bool]:
    """'+avx2,-avx512f,...' -> {'avx2': True, 'avx512f': False, ...}."""
    out = {}
    for item in text.split(","):
        item = item.strip()
        if len(item) > 1 and item[0] in "+-":
            out[item[1:]] = item[0] == "+"
    return out


def target_features() -> dict[str, bool]:
    return parse_features(_numba_target()[1])


def classify(features: dict[str, bool]) -> str:
    """The highest path every instruction of whose kernels the features allow."""
    has = lambda *names: all(features.get(n, False) for n in names)  # noqa: E731
    if not has("avx2", "fma"):
        return "generic"
    if has("avx512f", "avx512bw", "avx512vl", "avx512vnni"):
        return "avx512_vnni"
    if has("avxvnni"):
        return "avx_vnni"
    return "avx2"


def selected() -> str:
    """The path the kernels compile for (override already folded into numba's features)."""
    return classify(target_features())


def vector_bits() -> int:
    f = target_features()
    if f.get("avx512f", False):
        return 512
    return 256 if f.get("avx2", False) and f.get("fma", False) else 128


def _lowered(features: str, path: str) -> tuple[str | None, str]:
    """(cpu name or None to keep, feature string) that compiles for `path` and nothing above."""
    if path == "generic":
        return "generic", ""  # x86-64 baseline (SSE2): LLVM legalises the vector IR
    flags = parse_features(features)
    drop = _WIDE_PREFIXES + (() if path == "avx_vnni" else _VNNI_PREFIXES)
    for name in flags:
        if name.startswith(drop):
            flags[name] = False
    return None, ",".join(("+" if on else "-") + name for name, on in flags.items())


def apply_override() -> str | None:
    """Fold DFLASH2_ISA into numba's codegen config (once, before numba's codegen exists).
    Returns the forced path, or None without an override."""
    global _applied
    want = os.environ.get(ENV, "").strip().lower()
    if not want or _applied == want:
        return _applied
    if want not in PATHS:
        raise IsaUnavailableError(f"{ENV}={want!r}: expected one of {', '.join(PATHS)}")
    have = selected()
    if PATHS.index(want) > PATHS.index(have):
        raise IsaUnavailableError(
            f"{ENV}={want!r}: numba's target ({_numba_target()[0]}) supports at most {have!r}; "
            "the override can only force a lower path")
    from numba.core import config, registry

    if "_toplevel_target_context" in vars(registry.cpu_target):
        raise IsaUnavailableError(
            f"{ENV}={want!r}: numba's CPU codegen already exists (something compiled before "
            "dflash2_numba was imported); set it in the environment of a fresh process")
    if want != have:  # the target's own path needs no rewrite
        name, features = _lowered(_numba_target()[1], want)
        if name is not None:
            config.CPU_NAME = name
        config.CPU_FEATURES = features
    _applied = want
    if selected() != want:  # e.g. avx_vnni forced on an AVX-512 VNNI host without AVX-VNNI
        raise IsaUnavailableError(f"{ENV}={want!r}: this target has no such path (it would run {selected()!r})")
    return want


# cores whose hardware prefetcher streams a product's weights and a long K/V cache faster without
# the kernels' software prefetch (Zen 4, session 21: docs/roofline.md, docs/long_context.md);
# elsewhere the prefetch was measured to help (Xeon, Zen 5)
NO_SOFTWARE_PREFETCH = ("znver4",)


def cpu_name() -> str:
    """The cpu name numba compiles for (`NUMBA_CPU_NAME` or the host's), e.g. "znver4"; numba's
    cache key holds it too."""
    return _numba_target()[0]


def software_prefetch() -> bool:
    """Whether the kernels issue their software prefetches on the core numba compiles for (a
    compile-time constant of quant/kernels_int8.py and kernels/attention.py)."""
    return cpu_name() not in NO_SOFTWARE_PREFETCH


def describe() -> dict:
    """What bench results record: the cpu name, the path, the register file, the override."""
    return {"cpu_name": cpu_name(), "isa": selected(), "vector_bits": vector_bits(), "override": _applied}
