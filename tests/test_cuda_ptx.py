"""Every @cuda.jit kernel compiles to PTX for compute capability 9.0 (H100/H200) without a GPU,
and the conv's PTX has no FMA (spec §6: NVVM contracts a*b+c into fma.rn, which would break
CPU == GPU bit-identity; the conv is built from mul.rn / add.rn intrinsics instead).

Under NUMBA_ENABLE_CUDASIM=1 (set by conftest) `cuda.compile_ptx` is the simulator's, so the
compiles run in a subprocess with that variable removed. Needs the NVVM wheel
(nvidia-cuda-nvcc / nvidia-nvvm); skipped with the reason only if NVVM cannot be loaded.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# the PTX compiles are numba-cuda's (numba's own built-in CUDA target, what `numba.cuda` is without
# it, asks for a CUDA driver to compile: measured "CudaSupportError: CUDA driver library cannot be
# found" on a machine without the package)
pytest.importorskip("numba_cuda", reason="numba-cuda (the [cuda] extra) is not installed: the sm_90 PTX "
                    "compiles need it")

ROOT = Path(__file__).resolve().parents[1]

# Runs with the simulator off. Prints one JSON object: kernel name -> PTX text (or an error).
_COMPILE_ALL = r"""
import json, sys
import numpy as np
from numba import cuda, types
try:
    from numba.cuda.cudadrv.nvvm import NVVM
    NVVM()
except Exception as e:  # no libnvvm: nothing can be compiled on this machine
    print(json.dumps({"__nvvm_missing__": repr(e)})); sys.exit(0)

from dflash2_numba.kernels import conv, cuda_attention, cuda_conv, cuda_gdn, cuda_linear

f32, u16, i64, b1 = types.float32, types.uint16, types.int64, types.boolean
def arr(t, nd, layout="C"):
    return types.Array(t, nd, layout)

def conv_sig(t):  # x, delta, base, out, group_size, block_len, and_arm
    return (arr(t, 2), arr(t, 3), arr(t, 2), arr(t, 2), i64, i64, b1)

def att_sig(kv_layout):  # q, k, v, q_pos, k_pos, first, causal, window, bf16_probs, scratch, out
    return (arr(f32, 3), arr(f32, 3, kv_layout), arr(f32, 3, kv_layout), arr(i64, 1), arr(i64, 1),
            i64, b1, i64, b1, arr(f32, 2), arr(f32, 3))

# positive control: the conv built from the CPU's plain a*b / a+b helpers (contractible)
first, tap = conv.make_conv_steps(conv._mul, conv._add, conv._same)
plain_f32 = cuda_conv.make_conv_kernel(conv._same, conv._same, first, tap)

kernels = {
    "conv_f32": (cuda_conv.kernel_for(np.float32), conv_sig(f32)),
    "conv_bf16": (cuda_conv.kernel_for(np.uint16), conv_sig(u16)),
    "conv_f32_plain_helpers": (plain_f32, conv_sig(f32)),
    "attention_contiguous_kv": (cuda_attention.kernel_for(), att_sig("C")),
    "attention_strided_kv": (cuda_attention.kernel_for(), att_sig("A")),
    "linear_bf16": (cuda_linear.kernel_for("uint16"), (arr(f32, 2), arr(u16, 2), arr(f32, 2))),
    "linear_f32": (cuda_linear.kernel_for("float32"), (arr(f32, 2), arr(f32, 2), arr(f32, 2))),
    # Gated DeltaNet: short conv (window, w, bf16, out); delta rule (q, k, v, g, beta, s_in, s_out, o)
    "gdn_short_conv": (cuda_gdn._short_conv_kernel, (arr(f32, 2), arr(f32, 2), b1, arr(f32, 2))),
    "gdn_delta_rule": (cuda_gdn._delta_kernel, (arr(f32, 3), arr(f32, 3), arr(f32, 3), arr(f32, 2), arr(f32, 2),
                                                arr(f32, 3), arr(f32, 3), arr(f32, 3))),
}
out = {}
for name, (kernel, sig) in kernels.items():
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        out[name] = {"ptx": ptx}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ALL], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "__nvvm_missing__" in result:
        pytest.skip(f"NVVM (libnvvm) not available, cannot compile PTX: {result['__nvvm_missing__']}")
    return result


def _instructions(ptx_text: str) -> list[str]:
    """PTX instruction mnemonics (first token of each statement), comments dropped."""
    ops = []
    for line in ptx_text.splitlines():
        line = line.split("//")[0].strip()
        if line and not line.startswith((".", "{", "}", "(", ")", "$", "@%")) and not line.endswith(":"):
            ops.append(line.split()[0].rstrip(";"))
        elif line.startswith("@%"):  # predicated instruction: "@%p1 bra ..."
            ops.append(line.split()[1].rstrip(";"))
    return ops


KERNELS = ["conv_f32", "conv_bf16", "conv_f32_plain_helpers", "attention_contiguous_kv",
           "attention_strided_kv", "linear_bf16", "linear_f32", "gdn_short_conv", "gdn_delta_rule"]


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_for_sm90(ptx, name):
    entry = ptx[name]
    assert "error" not in entry, entry.get("error")
    text = entry["ptx"]
    assert re.search(r"^\.target\s+sm_90", text, re.M), "PTX not for sm_90"
    assert re.search(r"^\.visible \.entry", text, re.M), "no kernel entry point in the PTX"


@pytest.mark.parametrize("name", ["conv_f32", "conv_bf16"])
def test_conv_has_no_fma(ptx, name):
    ops = _instructions(ptx[name]["ptx"])
    fma = [op for op in ops if op.startswith("fma")]
    assert not fma, f"{name}: contracted into {fma} (breaks bit-identity with the CPU kernel)"
    assert "mul.rn.f32" in ops and "add.rn.f32" in ops, f"{name}: expected mul.rn.f32 / add.rn.f32"


def test_fma_detector_catches_plain_helpers(ptx):
    """Positive control: with the CPU's plain a*b + c helpers NVVM DOES emit an fma, so the
    no-fma check above would go red if the conv were built from them."""
    ops = _instructions(ptx["conv_f32_plain_helpers"]["ptx"])
    assert any(op.startswith("fma.rn.f32") for op in ops), "expected an fma from the plain helpers"


def test_attention_and_linear_use_shared_memory_not_shuffles(ptx):
    for name in ("attention_contiguous_kv", "linear_bf16"):
        text = ptx[name]["ptx"]
        assert ".shared" in text, f"{name}: no shared-memory reduction"
        assert "shfl" not in text, f"{name}: warp shuffles (the simulator has none)"
