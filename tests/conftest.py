"""Shared pytest setup.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported (numba.config reads it once):
the @cuda.jit kernels then run on numba's CUDA simulator, so the CUDA tests run on machines
without a GPU. It only affects numba.cuda; @njit CPU kernels compile and run as usual.
Set NUMBA_ENABLE_CUDASIM=0 in the environment to test against a real GPU instead.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
