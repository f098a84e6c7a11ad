"""Cold start of the README's first command, as a new user meets it (issue 16 item 6).

    python bench/cold_start.py [--warm-runs 2] [--out bench/results/cold_start.json]
                               [--source .] [--keep] [--quantize q4_k]

1. a fresh venv (--system-site-packages: the dependencies come from this interpreter) and
   `pip install --no-deps .` into it: a NON-editable install into its site-packages, as the
   README's `pip install .` does (the numba kernel cache is then keyed on the installed files);
2. the README command `dflash2-decode generate --prompt "def fibonacci(n):"` with
   NUMBA_CACHE_DIR pointing at an EMPTY temp dir (cold: every kernel compiles), then the same
   command again `--warm-runs` times against the now-filled cache;
3. a second cold run WITHOUT NUMBA_CACHE_DIR (numba's default: `__pycache__` beside the installed
   sources in site-packages, empty after a fresh install), and a warm run after it, so the
   default location is shown to cache too (the installed files' stamps stay put).

Per run: wall seconds to the end of the command's output, CPU seconds of the child (user + sys
from resource.getrusage(RUSAGE_CHILDREN): the honest number on a shared, contended machine),
the load average before it, the decode tok/s and the compile seconds the CLI prints. The CPU
model (lscpu) and numba's target CPU name go into the header.

With NUMBA_DEBUG_CACHE / per-dispatcher numbers see `bench/compile_profile.py`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README_ARGS = ["generate", "--prompt", "def fibonacci(n):"]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    m = re.search(r"^Model name:\s*(.+)$", out, re.M)
    n = re.search(r"^CPU\(s\):\s*(\d+)$", out, re.M)
    return f"{m.group(1).strip() if m else 'unknown'} x {n.group(1) if n else '?'}"


def make_venv(root: Path, source: Path) -> Path:
    """-> the venv's python, with the package pip-installed (non-editable) from `source`."""
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root)
    py = root / "bin" / "python"
    t0 = time.perf_counter()
    # no pip of its own: the system pip (seen through --system-site-packages) run by the venv's
    # python installs into the venv's site-packages
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                    str(source)], check=True, cwd=root)
    print(f"venv {root}: pip install . {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    where = subprocess.run([str(py), "-c", "import dflash2_numba, sys; print(dflash2_numba.__file__)"],
                           capture_output=True, text=True, check=True, cwd=root).stdout.strip()
    if not where.startswith(str(root)):
        raise SystemExit(f"the venv imports dflash2_numba from {where}, not its own install")
    return py


def run_once(cmd: list[str], env: dict, cwd: Path) -> dict:
    load = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    err = proc.stderr
    tok = re.search(r"([\d.]+) tok/s overall, ([\d.]+) tok/s decode", err)
    comp = re.search(r"^compile\s+([\d.]+)s", err, re.M)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "sys_s": round(after.ru_stime - before.ru_stime, 2),
        "loadavg_before": [round(x, 2) for x in load],
        "tokens_per_s": float(tok.group(1)) if tok else None,
        "decode_tokens_per_s": float(tok.group(2)) if tok else None,
        "compile_s_reported": float(comp.group(1)) if comp else None,
        "stdout_chars": len(proc.stdout),
        "stdout_sha256": hashlib.sha256(proc.stdout.encode()).hexdigest()[:16],  # same text before / after
        "stderr_tail": err.strip().splitlines()[-12:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=REPO, help="what `pip install .` installs")
    ap.add_argument("--warm-runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cold_start.json")
    ap.add_argument("--label", default="", help="a note stored with the results (e.g. the commit)")
    ap.add_argument("--keep", action="store_true", help="keep the temp venv / caches")
    ap.add_argument("--quantize", default=None, help="append `--quantize FMT` to the command (its kernels' cost)")
    args = ap.parse_args()
    command = README_ARGS + (["--quantize", args.quantize] if args.quantize else [])

    tmp = Path(tempfile.mkdtemp(prefix="dflash2-cold-"))
    try:
        py = make_venv(tmp / "venv", args.source.resolve())
        exe = [str(tmp / "venv" / "bin" / "dflash2-decode"), *command]
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
        base_env["DFLASH2_CACHE"] = str(tmp / "dflash2-cache")  # the tiny-pair fallback, if any
        runs = []

        cache = tmp / "numba-cache"
        cache.mkdir()
        env = dict(base_env, NUMBA_CACHE_DIR=str(cache))
        for i in range(1 + args.warm_runs):
            r = run_once(exe, env, tmp)
            r["kind"] = "cold (empty NUMBA_CACHE_DIR)" if i == 0 else "warm (NUMBA_CACHE_DIR)"
            runs.append(r)
            print(json.dumps({k: r[k] for k in ("kind", "wall_s", "cpu_s", "loadavg_before",
                                                "tokens_per_s", "decode_tokens_per_s", "compile_s_reported")}), file=sys.stderr)
        cache_files = sorted(p.name for p in cache.rglob("*.nbi"))

        for i in range(2):  # numba's default location: __pycache__ in the venv's site-packages
            r = run_once(exe, base_env, tmp)
            r["kind"] = "cold (default cache dir)" if i == 0 else "warm (default cache dir)"
            runs.append(r)
            print(json.dumps({k: r[k] for k in ("kind", "wall_s", "cpu_s", "loadavg_before",
                                                "tokens_per_s", "decode_tokens_per_s", "compile_s_reported")}), file=sys.stderr)

        import numba
        from numba.core import codegen  # noqa: F401  (host CPU name as numba's codegen sees it)
        import llvmlite.binding as llvm

        result = {
            "label": args.label,
            "command": "pip install . && dflash2-decode " + " ".join(
                a if " " not in a else repr(a) for a in command),
            "cpu": cpu_model(),
            "llvm_host_cpu": llvm.get_host_cpu_name(),
            "numba": numba.__version__,
            "python": sys.version.split()[0],
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "kernel_cache_index_files": len(cache_files),
            "runs": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"-> {args.out}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
