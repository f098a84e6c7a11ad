"""numba's on-disk kernel cache (`@njit(cache=True)`), checked once per process before the
first kernel runs.

numba recompiles when an index file (.nbi) is unreadable, but a truncated or corrupt data file
(.nbc) ends in a bare `pickle.UnpicklingError` traceback from inside numba at the first call.
Here every data file of this package's cached kernels is unpickled up front (~60 ms for the
whole set) and a bad one is refused by name, with the fix: delete it and numba recompiles.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

from ..errors import KernelCacheError


def _kernel_modules():
    from . import attention, conv, fused, gdn, linear, panels, rowwise

    return attention, conv, fused, gdn, linear, panels, rowwise


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
        for path in sorted(directory.glob("*.nbc")):
            try:
                pickle.loads(path.read_bytes())
            except FileNotFoundError:
                continue  # removed by another process since the glob: numba recompiles
            except Exception as e:  # truncated / corrupt: any unpickling failure
                raise KernelCacheError(
                    f"{path}: unreadable file in numba's kernel cache ({type(e).__name__}: {e}); "
                    "delete it (numba recompiles the kernel)") from e
