"""Shared pytest setup.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported (numba.config reads it once):
the @cuda.jit kernels then run on numba's CUDA simulator, so the CUDA tests run on machines
without a GPU. It only affects numba.cuda; @njit CPU kernels compile and run as usual.
Set NUMBA_ENABLE_CUDASIM=0 in the environment to test against a real GPU instead.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# the adaptive width's cost tables (decode/width.py) go to a per-session directory, not beside
# the kernel cache: a test's tiny pairs live in temporary directories (CLI subprocesses inherit it)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "DFLASH2_COST_CACHE" not in os.environ:
    os.environ["DFLASH2_COST_CACHE"] = tempfile.mkdtemp(prefix="dflash2-costs-")
    atexit.register(shutil.rmtree, os.environ["DFLASH2_COST_CACHE"], ignore_errors=True)  # no dir left in /tmp


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


# ---------------------------------------------------------------- the draft tests' tiny target
# test_draft.py and test_dflash2_draft.py pair their drafts with this 4-layer, hidden-64 Qwen3
# (a module that defines its own `target_dir`, e.g. test_tiny_writer.py, overrides it).
DRAFT_TEST_HIDDEN = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from dflash2_numba import tiny

    return tiny.write_target(tmp_path_factory.mktemp("t") / "target", hidden_size=DRAFT_TEST_HIDDEN,
                             intermediate_size=128, num_hidden_layers=4, seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    import dflash2_numba as dn

    return dn.load_target(target_dir)
