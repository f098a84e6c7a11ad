"""numba's on-disk kernel cache (`@njit(cache=True)`), checked once per process before the
first kernel runs.

numba recompiles when an index file (.nbi) is unreadable, but a truncated or corrupt data file
(.nbc) ends in a bare `pickle.UnpicklingError` traceback from inside numba at the first call.
Here every data file of this package's cached kernels is unpickled up front (~60 ms for the
whole set) and a bad one is refused by name, with the fix: delete it and numba recompiles.

Stale kernels: numba keys a cached kernel on ITS OWN source file's timestamp, so a kernel that
inlines helpers from another file (the fused layer inlines rowwise, attention, panels, numerics,
quant) is loaded from the cache unchanged after those helpers changed — an upgrade or an edit
would run the old code, silently. So every cache directory carries a fingerprint (sha256 of the
source of every module whose code is compiled into a kernel: `KERNEL_SOURCES`); when it does not
match the installed sources, that directory's kernels are deleted first and recompiled.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from pathlib import Path

from ..errors import KernelCacheError


PACKAGE = Path(__file__).resolve().parent.parent
# every file whose code ends up inside a cached kernel (compiled or inlined)
KERNEL_SOURCES = ("kernels/*.py", "quant/*.py", "numerics.py", "models/selector.py")
FINGERPRINT_FILE = "dflash2_kernel_sources.sha256"


def _kernel_modules():
    from . import attention, conv, fused, fused_moe, gdn, linear, panels, routing, rowwise
    from ..models import selector  # its top-K / walk kernels are cached too
    from ..quant import kernels_int8, kernels_q4k, q4_k, weights
    from ..quant import bytes_kernel, int4, w8a8  # pre-quantized checkpoints' kernels (quant/stored.py)

    return (attention, conv, fused, fused_moe, gdn, linear, panels, routing, rowwise, selector, kernels_int8, weights,
            kernels_q4k, q4_k, bytes_kernel, int4, w8a8)


@functools.lru_cache(maxsize=None)
def sources_fingerprint() -> str:
    h = hashlib.sha256()
    for path in sorted(p for pattern in KERNEL_SOURCES for p in PACKAGE.glob(pattern)):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def drop_stale_kernels(directory: Path, fingerprint: str) -> int:
    """Delete the cached kernels in `directory` unless its fingerprint file says they were
    compiled from sources with `fingerprint` (a directory without one, from before this check,
    counts as stale); then record `fingerprint`. Returns how many files were deleted. A cache
    directory we cannot write is left as it is."""
    marker = directory / FINGERPRINT_FILE
    try:
        if marker.read_text().strip() == fingerprint:
            return 0
    except OSError:
        pass
    dropped = 0
    for f in directory.glob("*.nb[ic]"):
        try:
            f.unlink()
            dropped += 1
        except FileNotFoundError:
            pass  # another process dropped it first
        except OSError:
            return dropped  # read-only cache: nothing recorded
    try:
        marker.write_text(fingerprint + "\n")
    except OSError:
        pass
    return dropped


def _cached_dispatchers(modules):
    """Every `@njit(cache=True)` dispatcher defined in `modules`, with the compile-time variants
    a module makes on demand (its `kernel_variants()`: kernels/fused.py)."""
    found = []
    for module in modules:
        objs = list(vars(module).values())
        if callable(getattr(module, "kernel_variants", None)):
            objs += module.kernel_variants()
        found += [obj for obj in objs if getattr(getattr(obj, "_cache", None), "_cache_path", None)]
    return found


def kernel_cache_is_cold() -> bool:
    """True on this package's first run here: the fused layer, which every CPU decode of a bf16
    model calls (and the largest compile), has no index file in numba's cache yet (the run will
    start with seconds of compiling: docs/cold_start.md)."""
    from .fused import kernel_variants

    return not Path(kernel_variants()[0]._cache._cache_file._index_path).exists()


def kernels_compiled() -> int:
    """How many kernel specialisations this process has compiled (numba cache misses) so far."""
    return sum(sum(d.stats.cache_misses.values()) for d in _cached_dispatchers(_kernel_modules()))


def _cache_dirs(modules) -> set[Path]:
    """Directories numba reads the cached kernels of `modules` from (the package __pycache__,
    or NUMBA_CACHE_DIR/<module dir>_<hash>)."""
    return {Path(d._cache._cache_path) for d in _cached_dispatchers(modules)}


@functools.lru_cache(maxsize=None)
def check_kernel_cache() -> None:
    for directory in sorted(_cache_dirs(_kernel_modules())):
        if directory.is_dir():
            drop_stale_kernels(directory, sources_fingerprint())
        for path in sorted(directory.glob("*.nbc")):
            try:
                pickle.loads(path.read_bytes())
            except FileNotFoundError:
                continue  # removed by another process since the glob: numba recompiles
            except Exception as e:  # truncated / corrupt: any unpickling failure
                raise KernelCacheError(
                    f"{path}: unreadable file in numba's kernel cache ({type(e).__name__}: {e}); "
                    "delete it (numba recompiles the kernel)") from e
