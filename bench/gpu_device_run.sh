#!/usr/bin/env bash
# The GPU checks as one script, for a CUDA machine lent for a few minutes (docs/gpu.md):
#   1. the machine and the package versions it runs with;
#   2. bench/gpu_check.py at the published shapes (kernel parity with the CPU kernels, decode identity);
#   3. the tests that run against a real device with the simulator off (PTX for sm_90, Muse on cuda);
#   4. the README pair and the widened x8 pair (bench/scaled_pair.py) decoded on --device cuda
#      against --device cpu: the same tokens, and the time of each;
#   5. bf16 run mode over a prompt longer than one attention tile (both: bench/gpu_decode.py).
# Each step is bounded by `timeout`; every log lands in $OUT (or ./gpu_out) for the closing note.
# Run from the repository root: `bash bench/gpu_device_run.sh`.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NUMBA_CACHE_DIR=/tmp/numba_cache
PY=${PY:-python3}
step() { echo "=== $1 ($(date -u +%H:%M:%S))"; }

step "machine" | tee "$OUT/env.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  lscpu | grep -E "Model name|^CPU\(s\)"
  $PY - <<'EOF'
import numpy, numba, sys
print("python", sys.version.split()[0], "numpy", numpy.__version__, "numba", numba.__version__)
try:
    import numba_cuda; print("numba-cuda", numba_cuda.__version__)
except Exception as e: print("numba-cuda:", e)
from numba import cuda
print("cuda available", cuda.is_available(), cuda.get_current_device().name if cuda.is_available() else "")
EOF
} 2>&1 | tee -a "$OUT/env.txt"

step "gpu_check (full shapes)"
timeout 240 $PY bench/gpu_check.py 2>&1 | tee "$OUT/gpu_check.txt"
echo "gpu_check exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_check.txt"

step "tests on the real device (simulator off)"
NUMBA_ENABLE_CUDASIM=0 timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_ptx.py \
    "tests/test_muse_spec.py::test_muse_decode_on_cuda_equals_cpu" 2>&1 | tee "$OUT/pytest_device.txt"

step "decode: README pair and widened x8 pair, cuda vs cpu"
for pair in readme x8; do
    timeout 120 $PY -W ignore bench/gpu_decode.py --pair $pair 2>&1 | tee -a "$OUT/decode.txt"
done

step "bf16 run mode over a 374-token prompt, cuda vs cpu"
timeout 150 $PY -W ignore bench/gpu_decode.py --dtype bf16 --long-prompt --new-tokens 48 2>&1 | tee "$OUT/bf16_decode.txt"
step "done"
