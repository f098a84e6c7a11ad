"""HF bf16's own spread across CPU instruction sets, and ours against each, on the checkpoints and
inputs of every bf16-vs-HF gate in the suite:

    tests/test_target_hf.py::test_bf16_mode_matches_hf_bfloat16      (qwen3-tied-gqa4-bf16-sharded, llama-untied-gqa-bf16)
    tests/test_qwen3_5_target.py::test_bf16_mode_matches_hf_bfloat16 (text-tied-bf16, multimodal-untied-bf16)
    tests/test_muse_target.py::test_bf16_run_mode_close_to_hf_bf16   (bf16)

    python bench/hf_bf16_spread.py [--out bench/results/hf_bf16_spread.json] [--configs ...] [--no-ours-avx2]

The checkpoints are written by the tests' own fixture builders (same seeds), the token sequences
are the tests' own. HF bf16 logits are computed once per CPU configuration, each in its own
subprocess (tests/hf_bf16_reference.py; ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA are read when
torch is imported), torch on 1 thread. Ours (bf16 and f32 run modes) is computed once here.

Reported per gate: max|HF_a - HF_b| / max|logit| for every pair of configurations, and
max|ours - HF_x| / max|logit| (plus the mean|diff| and the f32-mode contrast the gates also
check, and for the Qwen3 / Llama gate the layer-0 bit-equal fraction) for each x. The maximum
logit is HF's (the gates' scale); it moves by at most an ulp between configurations.

Unless --no-ours-avx2: the script then reruns itself (pinned configuration only) with numba
compiling for Haswell (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES: AVX2 + FMA, no AVX-512) and numpy's
AVX-512 dispatch disabled (NPY_DISABLE_CPU_FEATURES), and records whether our bf16 logits and
pinned HF's are bit-identical to this run's (`ours_avx2_paths`): our side of the gate must not
move with the host either.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import hf_bf16_reference as ref  # noqa: E402  (tests/hf_bf16_reference.py)

# name: ISA variables; which real machines run that way
CONFIGS = {
    "native": ({}, "this host as it is"),
    "aten-avx512+onednn-avx512_core_bf16": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
                                            "AVX-512 with bf16, no AMX (Cooper Lake, Zen 4)"),
    "aten-avx512+onednn-avx512_core": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
                                       "AVX-512 without bf16 (Skylake-SP, Cascade Lake)"),
    "aten-avx512+onednn-avx2": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                                "ATen AVX-512, ATen's own bf16 GEMM (isolates the GEMM)"),
    "aten-avx2+onednn-avx2": ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                              "AVX2 only (Zen 2/3 EPYC, Haswell..Comet Lake)"),
    "aten-avx2+onednn-native": ({"ATEN_CPU_CAPABILITY": "avx2"}, "ATen AVX2, oneDNN native (isolates ATen)"),
    "aten-default+onednn-avx2": ({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                                 "ATen without vector kernels"),
    "aten-default+onednn-native": ({"ATEN_CPU_CAPABILITY": "default"}, "ATen without vector kernels, oneDNN native"),
    "pinned": (ref.PINNED, "ATen without vector kernels, oneDNN off: the tests' reference"),
    "aten-avx2+onednn-off": ({"ATEN_CPU_CAPABILITY": "avx2", "DFLASH2_HF_MKLDNN": "0"}, "ATen AVX2, oneDNN off"),
}


# numba and numpy on their AVX2 code paths on an AVX-512 host (what an AVX2-only CPU runs)
OURS_AVX2_ENV = {
    "NUMBA_CPU_NAME": "haswell",
    "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,"
                          "+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
}


def build_gates(root: Path) -> dict:
    """gate name -> dict(job for the worker, ours_bf16, ours_f32, taps0 for the layer-0 check)."""
    import torch  # noqa: F401  (the test modules need it)

    import test_muse_target as tm
    import test_qwen3_5_target as tq
    import test_target_hf as th
    from dflash2_numba.families.muse_glimmer import MuseGlimmerTarget
    from dflash2_numba.families.qwen3_5 import Qwen3_5Model
    from dflash2_numba.families.qwen3 import TargetModel
    from muse_fixtures import prompt, write_muse_target
    from qwen3_5_fixtures import build_hf_qwen3_5

    gates = {}
    seq = [int(t) for t in np.random.default_rng(99).integers(0, th.V, th.PROMPT + sum(th.BLOCKS))]
    for seed, (name, (arch, tied, nkv, dtype, shard)) in enumerate(th.CASES.items()):
        if dtype != torch.bfloat16:
            continue
        d = th.build_hf_model(root / name, arch, tied, nkv, dtype, shard, seed)
        b16, taps = th.run_blocks(TargetModel.load(d, device="cpu", dtype="bf16"), seq, th.TAPS)
        f32, _ = th.run_blocks(TargetModel.load(d, dtype="f32"), seq, th.TAPS)
        gates[f"test_target_hf[{name}]"] = dict(job=dict(kind="qwen3", dir=str(d), ids=seq, taps=[0]),
                                                bf16=b16, f32=f32, tap0=taps[:, :th.H])
    seq = [int(t) for t in np.random.default_rng(99).integers(0, tq.V, tq.PROMPT + sum(tq.BLOCKS))]
    for i, (name, (mm, tied, dtype)) in enumerate(tq.CASES.items()):
        if dtype != torch.bfloat16:
            continue
        d = build_hf_qwen3_5(root / name, multimodal=mm, tied=tied, dtype=dtype, seed=i)
        b16, _ = tq.run_blocks(Qwen3_5Model.load(d, dtype="bf16"), seq, tq.TAPS)
        f32, _ = tq.run_blocks(Qwen3_5Model.load(d, dtype="f32"), seq, tq.TAPS)
        gates[f"test_qwen3_5_target[{name}]"] = dict(job=dict(kind="qwen3_5", dir=str(d), ids=seq), bf16=b16, f32=f32)
    d = write_muse_target(root / "muse-bf16", "bf16")
    seq = prompt(sum(tm.BLOCKS), seed=1)
    b16, _ = tm.run_blocks(MuseGlimmerTarget.load(d, dtype="bf16"), seq, ())
    f32, _ = tm.run_blocks(MuseGlimmerTarget.load(d, dtype="f32"), seq, ())
    gates["test_muse_target[bf16]"] = dict(job=dict(kind="muse", dir=str(d), ids=seq), bf16=b16, f32=f32)
    return gates


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hf_bf16_spread.json"))
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--no-ours-avx2", action="store_true", help="skip the rerun with numba / numpy on AVX2 paths")
    args = ap.parse_args()
    import numba
    import torch

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    flags = set()
    try:
        flags = set(next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split())
    except (OSError, StopIteration):
        pass
    result = {"cpu": cpu_model(), "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
              "torch": torch.__version__, "numba": numba.__version__,
              "numba_cpu": {k: os.environ.get(k) for k in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")},
              "configs": {}, "gates": {}}
    with tempfile.TemporaryDirectory() as tmp:
        gates = build_gates(Path(tmp))
        names = list(gates)
        hf = {}
        for c in args.configs:
            env, what = CONFIGS[c]
            t0 = time.perf_counter()
            res, info = ref.run_worker([gates[n]["job"] for n in names], env)
            info["seconds"] = round(time.perf_counter() - t0, 1)
            info["what"] = what
            result["configs"][c] = info
            hf[c] = dict(zip(names, res))
            print(f"{c:40s} ATen {info['capability']:8s} oneDNN bf16 {info['mkldnn_bf16']!s:5s} {info['seconds']:.0f} s",
                  flush=True)
    for n in names:
        g = gates[n]
        scale = float(np.abs(hf[args.configs[0]][n]["logits"]).max())
        out = {"max_abs_logit": scale, "ours_bf16_sha256": hashlib.sha256(g["bf16"].tobytes()).hexdigest(),
               "hf_sha256": {c: hashlib.sha256(hf[c][n]["logits"].tobytes()).hexdigest() for c in args.configs},
               "hf_pairs": {}, "ours_bf16": {}}
        for a, b in itertools.combinations(args.configs, 2):
            la, lb = hf[a][n]["logits"], hf[b][n]["logits"]
            out["hf_pairs"][f"{a} vs {b}"] = float(np.abs(la - lb).max() / np.abs(lb).max())
        for c in args.configs:
            r = hf[c][n]["logits"]
            s = float(np.abs(r).max())
            row = {"max_rel": float(np.abs(g["bf16"] - r).max() / s), "mean_abs": float(np.abs(g["bf16"] - r).mean()),
                   "f32_mode_max_rel": float(np.abs(g["f32"] - r).max() / s),
                   "f32_mode_mean_abs": float(np.abs(g["f32"] - r).mean()), "max_abs_logit": s}
            if "tap0" in g:
                row["layer0_bit_equal"] = float(np.mean(g["tap0"] == hf[c][n]["taps"][0]))
            out["ours_bf16"][c] = row
        out["hf_spread_max"] = max(out["hf_pairs"].values()) if out["hf_pairs"] else 0.0
        out["ours_worst"] = max(r["max_rel"] for r in out["ours_bf16"].values())
        result["gates"][n] = out
        print(f"\n{n}: max|logit| {scale:.2f}; HF cross-config spread max {out['hf_spread_max']:.2e}")
        for c, r in out["ours_bf16"].items():
            extra = f"  layer0 bit-equal {r['layer0_bit_equal']:.1%}" if "layer0_bit_equal" in r else ""
            print(f"  ours vs {c:40s} {r['max_rel']:.2e} (mean {r['mean_abs']:.2e}; f32 mode {r['f32_mode_max_rel']:.2e}, "
                  f"mean {r['f32_mode_mean_abs']:.2e}){extra}")
    if not args.no_ours_avx2 and "pinned" in args.configs:
        import subprocess

        with tempfile.TemporaryDirectory() as tmp:
            sub = Path(tmp) / "avx2.json"
            subprocess.run([sys.executable, __file__, "--configs", "pinned", "--no-ours-avx2", "--out", str(sub)],
                           env={**os.environ, **OURS_AVX2_ENV}, check=True, stdout=subprocess.DEVNULL)
            other = json.loads(sub.read_text())
        result["ours_avx2_paths"] = {
            "env": OURS_AVX2_ENV,
            "ours_bf16_bit_identical": {n: other["gates"][n]["ours_bf16_sha256"] == result["gates"][n]["ours_bf16_sha256"]
                                        for n in names},
            "pinned_hf_bit_identical": {n: other["gates"][n]["hf_sha256"]["pinned"] == result["gates"][n]["hf_sha256"]["pinned"]
                                        for n in names},
            "ours_vs_pinned_max_rel": {n: other["gates"][n]["ours_bf16"]["pinned"]["max_rel"] for n in names}}
        print("\nnumba / numpy on AVX2 paths:", json.dumps(result["ours_avx2_paths"], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
