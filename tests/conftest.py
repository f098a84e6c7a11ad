"""Shared pytest setup.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported (numba.config reads it once):
the @cuda.jit kernels then run on numba's CUDA simulator, so the CUDA tests run on machines
without a GPU. It only affects numba.cuda; @njit CPU kernels compile and run as usual.
Set NUMBA_ENABLE_CUDASIM=0 in the environment to test against a real GPU instead.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


import numba  # noqa: E402  (after NUMBA_ENABLE_CUDASIM is set)
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: numba thread wake-ups would dominate; modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(threads)
