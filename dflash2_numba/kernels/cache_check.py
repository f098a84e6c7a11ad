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


def _cache_dirs(modules) -> set[Path]:
    """Directories numba reads the cached kernels of `modules` from (the package __pycache__,
    or NUMBA_CACHE_DIR/<module dir>_<hash>)."""
    dirs = set()
    for module in modules:
        for obj in vars(module).values():
            path = getattr(getattr(obj, "_cache", None), "_cache_path", None)
            if path:
                dirs.add(Path(path))
    return dirs


@functools.lru_cache(maxsize=None)
def check_kernel_cache() -> None:
    from . import attention, conv, linear, rowwise

    for directory in sorted(_cache_dirs((attention, conv, linear, rowwise))):
        for path in sorted(directory.glob("*.nbc")):
            try:
                pickle.loads(path.read_bytes())
            except FileNotFoundError:
                continue  # removed by another process since the glob: numba recompiles
            except Exception as e:  # truncated / corrupt: any unpickling failure
                raise KernelCacheError(
                    f"{path}: unreadable file in numba's kernel cache ({type(e).__name__}: {e}); "
                    "delete it (numba recompiles the kernel)") from e
