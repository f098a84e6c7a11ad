"""Hugging Face bfloat16 reference logits computed in a SUBPROCESS with torch's CPU code paths
pinned, so that a bf16 gate compares against the same numbers on every x86 host.

Why: torch's bf16 CPU kernels round and accumulate differently per instruction set. ATen's own
kernels (softmax, norms, SDPA's flash kernel, the fallback GEMM) are picked by CPU capability
(`ATEN_CPU_CAPABILITY` = default / avx2 / avx512), and bf16 matmuls go to oneDNN only when oneDNN
supports bf16 on the host (AVX-512 core or AMX; capped by `ONEDNN_MAX_CPU_ISA`), else to ATen's
own GEMM. An AVX2-only machine (e.g. an AMD EPYC Zen 2/3) and an AVX-512 / AMX machine therefore
produce different HF bf16 logits from the same checkpoint: measured by bench/hf_bf16_spread.py
(bench/results/hf_bf16_spread.json). Both variables are read once, when torch is first imported,
hence the subprocess.

PINNED = ATen's scalar kernels (`ATEN_CPU_CAPABILITY=default`, which every CPU has) with oneDNN
switched off (`torch.backends.mkldnn.enabled = False`: bf16 matmuls and convs take ATen's own
scalar GEMM / conv too). No instruction-set dispatch is left on the HF side, so the reference is
the same on every host (measured: the spread JSON's `default` configurations), and it is also
the HF run our bf16 mode models most closely (our rounding points follow torch's scalar ops:
bit-identical logits on 2 of the 5 gated checkpoints).

    hf_bf16_pinned(jobs) -> (results, info)      jobs: [{"kind", "dir", "ids", "taps"}]
    python tests/hf_bf16_reference.py JOBS.json OUT.npz      (the worker; env decides the paths,
                                                              DFLASH2_HF_MKLDNN=0 turns oneDNN off)

kinds: "qwen3" (Qwen3 / Llama of tests/test_target_hf.py), "qwen3_5" (tests/qwen3_5_fixtures.py),
"muse" (tests/muse_fixtures.py, SDPA as the bf16 test uses).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PINNED = {"ATEN_CPU_CAPABILITY": "default", "DFLASH2_HF_MKLDNN": "0"}
ISA_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "DFLASH2_HF_MKLDNN")


def run_worker(jobs: list[dict], env_over: dict, timeout: float = 600) -> tuple[list[dict], dict]:
    """Run the jobs in a fresh interpreter with exactly `env_over` for the ISA variables."""
    env = {k: v for k, v in os.environ.items() if k not in ISA_VARS}
    env.update(env_over)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        jf, out = Path(tmp) / "jobs.json", Path(tmp) / "out.npz"
        jf.write_text(json.dumps(jobs))
        proc = subprocess.run([sys.executable, str(Path(__file__)), str(jf), str(out)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"HF bf16 reference worker failed ({env_over}):\n{proc.stderr[-3000:]}")
        data = np.load(out)
        info = json.loads(str(data["info"]))
        results = []
        for i, job in enumerate(jobs):
            results.append({"logits": data[f"logits_{i}"],
                            "taps": {l: data[f"tap_{i}_{l}"] for l in job.get("taps", ())}})
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    info["wall_s"] = time.perf_counter() - t0  # the cost of the subprocess, start-up included
    info["cpu_s"] = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    print(f"\n  pinned HF bf16 reference ({len(jobs)} forwards): {info['wall_s']:.1f} s wall, {info['cpu_s']:.1f} s CPU")
    return results, info


def hf_bf16_pinned(jobs: list[dict]) -> tuple[list[dict], dict]:
    """HF bf16 references at PINNED (checked: the worker reports ATen DEFAULT, oneDNN off)."""
    results, info = run_worker(jobs, PINNED)
    assert info["capability"] == "DEFAULT" and not info["mkldnn_enabled"], info
    return results, info


def _worker(jobs_file: str, out_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    if os.environ.get("DFLASH2_HF_MKLDNN") == "0":
        torch.backends.mkldnn.enabled = False
    jobs = json.loads(Path(jobs_file).read_text())
    arrays = {}
    for i, job in enumerate(jobs):
        d, ids, taps = Path(job["dir"]), list(job["ids"]), tuple(job.get("taps", ()))
        if job["kind"] == "qwen3":
            import test_target_hf as t

            logits, tapped = t.hf_forward(t.load_hf(d, torch.bfloat16), ids, taps)
        elif job["kind"] == "qwen3_5":
            import qwen3_5_fixtures as f

            logits, tapped = f.hf_forward(f.load_hf(d, torch.bfloat16), ids, taps)
        elif job["kind"] == "muse":
            import muse_fixtures as f

            logits, hidden = f.hf_logits_and_taps(f.hf_target(d, torch.bfloat16, attn="sdpa"), ids)
            tapped = {l: hidden[l + 1] for l in taps}
        else:
            raise ValueError(f"unknown kind {job['kind']!r}")
        arrays[f"logits_{i}"] = logits
        for l in taps:
            arrays[f"tap_{i}_{l}"] = tapped[l]
    info = {"capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
            "mkldnn_bf16": bool(torch.backends.mkldnn.enabled and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "torch": torch.__version__, "env": {k: os.environ.get(k) for k in ISA_VARS if k in os.environ}}
    np.savez(out_file, info=json.dumps(info), **arrays)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
