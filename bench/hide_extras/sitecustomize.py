"""Make optional extras look uninstalled, to check that the tests needing them skip.

    PYTHONPATH=bench/hide_extras DFLASH2_HIDE_MODULES=numba_cuda,torch python -m pytest -q tests/...

Python imports `sitecustomize` at start-up from sys.path, so this file runs in every interpreter
started with it on PYTHONPATH (pytest and the subprocesses the tests start). Each listed module
(and its submodules; `numba.cuda` names a subpackage) then raises ModuleNotFoundError on import,
as when its package is not installed. For
`numba_cuda` (the numba-cuda package) the `_numba_cuda_redirector` finder its .pth file installs
is removed too, so `numba.cuda` is numba's own built-in target, as without the package.
"""

import importlib.abc
import os
import sys

HIDDEN = {m.strip() for m in os.environ.get("DFLASH2_HIDE_MODULES", "").split(",") if m.strip()}


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in HIDDEN):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by bench/hide_extras)", name=name)
        return None


if HIDDEN:
    if "numba_cuda" in HIDDEN:
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != "_numba_cuda_redirector"]
    sys.meta_path.insert(0, _Hide())
