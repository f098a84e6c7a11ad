"""Without numba's CUDA target (the `cuda` extra not installed), `get_ops("cuda")` is the named
DeviceUnavailableError, not a bare ImportError. The extra is hidden in a subprocess by
bench/hide_extras (its sitecustomize makes the listed modules raise ModuleNotFoundError).
Red on: the import of kernels/cuda_ops.py left unguarded.

The same for a numba-cuda whose kernel compiler cannot load with the installed numpy (numba-cuda
0.30.4 under numpy 2.5, which removed np.row_stack: seen on an H200); here np.row_stack is deleted
in the subprocess. Red on: CudaOps without _check_kernel_compiler (then a GPU-less host says "no
CUDA device" and a GPU host fails inside the first kernel launch)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CODE = """
from dflash2_numba.errors import DeviceUnavailableError
from dflash2_numba.kernels.backend import get_ops
try:
    get_ops("cuda")
except DeviceUnavailableError as e:
    print("refused:", e)
"""


def test_get_ops_cuda_without_the_extra_is_a_named_refusal():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench" / "hide_extras"),
           "DFLASH2_HIDE_MODULES": "numba_cuda,numba.cuda"}
    r = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("refused: device 'cuda'") and "cuda` extra" in r.stdout, r.stdout


def test_get_ops_cuda_with_a_numpy_numba_cuda_cannot_compile_for_is_a_named_refusal():
    code = "import numpy\ndel numpy.row_stack\n" + CODE
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # the real target
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("refused: device 'cuda': numba-cuda ") and "cannot compile kernels with numpy" in r.stdout \
        and "row_stack" in r.stdout, r.stdout


def test_a_numba_cuda_without_that_module_is_not_refused_for_it():
    """The probe imports numba.cuda.cudaimpl; a numba-cuda laid out otherwise (the module gone) is
    not refused for that: here, without a GPU, the ordinary "no CUDA device" refusal follows."""
    code = ("import importlib\nreal = importlib.import_module\n"
            "def fake(name, *a, **k):\n"
            "    if name == 'numba.cuda.cudaimpl':\n"
            "        raise ModuleNotFoundError('gone', name=name)\n"
            "    return real(name, *a, **k)\n"
            "importlib.import_module = fake\n") + CODE
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("refused: device 'cuda': no CUDA device is available"), r.stdout
