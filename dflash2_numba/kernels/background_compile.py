"""A cold start on two cores: the attention kernels compile in a second process.

A first run spends most of its time in numba compiling kernels, one after the other on one
core (docs/cold_start.md). The longest chain is attention (its IR loops, ~1/3 of the total)
followed by the fused layer that calls it. So when the kernel cache is cold, `start` runs
`python -m dflash2_numba.kernels.background_compile` beside the warm-up: the child compiles the
attention drivers (`_attention_ser`, and `_attention_par` when the run has threads) into numba's
on-disk cache, while this process compiles what does not need them (the draft's context
update and the kernels it calls). `BackgroundCompile.wait` joins the child before the first
layer; the layer's compile then LOADS attention from the cache instead of compiling it.

Nothing depends on the child for correctness: a child that fails, is killed or writes no cache
leaves this process to compile attention itself, as without it (only the time is lost). The
cache entry is the one the fused layer and `kernels.attention.attention` ask for: the child
calls the drivers with the argument types they pass (float32 queries and output, int64
positions, Python ints and bools, the run's K/V dtype, an empty or per-head sinks array).
tests/test_background_compile.py checks that the run then compiles no attention of its own.

Off with DFLASH2_BACKGROUND_COMPILE=0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ENV_SWITCH = "DFLASH2_BACKGROUND_COMPILE"


def _drivers(parallel: bool) -> list:
    from .attention import _attention_par, _attention_ser

    return [_attention_ser, _attention_par] if parallel else [_attention_ser]


def attention_args(kv_dtype: str, sinks: bool) -> tuple:
    """Tiny arguments of the attention drivers, typed as a run passes them (a K/V cache of
    `kv_dtype`, "float32" or "uint16" = bf16 bits; sinks: one per query head, or the read-only
    empty NO_SINKS that the fused layer passes)."""
    from .attention import NO_SINKS

    nh, nkv, hd, T = 2, 1, 16, 4
    q = np.zeros((1, nh, hd), np.float32)  # [n, nh, hd]
    k = np.zeros((nkv, T, hd), np.dtype(kv_dtype))  # [nkv, T, hd]
    v = np.zeros((nkv, T, hd), np.dtype(kv_dtype))
    q_pos = np.full(1, T - 1, np.int64)
    k_pos = np.arange(T, dtype=np.int64)
    s = np.zeros(nh, np.float32) if sinks else NO_SINKS
    return q, k, v, q_pos, k_pos, 0, T, True, 0, False, s, np.empty(q.shape, np.float32)


def compile_attention(kv_dtype: str, sinks: bool, parallel: bool) -> None:
    """Compile (and cache) the attention drivers: one tiny call of each."""
    for driver in _drivers(parallel):
        driver(*attention_args(kv_dtype, sinks))


class BackgroundCompile:
    def __init__(self, process: subprocess.Popen | None):
        self.process = process

    def wait(self) -> None:
        """Block until the child is done (at once when there is none)."""
        if self.process is not None:
            self.process.wait()
            self.process = None


def _cache_writable(parallel: bool) -> bool:
    """numba would store the drivers' compiles on disk, and they are not there yet."""
    from numba import config

    if config.DISABLE_JIT:
        return False
    for driver in _drivers(parallel):
        path = getattr(getattr(driver, "_cache", None), "_cache_path", None)
        if path is None:
            return False
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            return False
        if not os.access(path, os.W_OK):
            return False
    return True


def _cpus() -> int:
    """CPUs this process may run on (one: a second process would only take turns with it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def start(kv_dtype, sinks: bool, parallel: bool) -> BackgroundCompile:
    """Start the child when the kernel cache is cold and can be written and this process may use
    more than one CPU; else a no-op handle."""
    from .cache_check import kernel_cache_is_cold

    if (os.environ.get(ENV_SWITCH, "1") == "0" or _cpus() < 2 or not kernel_cache_is_cold()
            or not _cache_writable(parallel)):
        return BackgroundCompile(None)
    spec = json.dumps({"kv_dtype": np.dtype(kv_dtype).name, "sinks": bool(sinks), "parallel": bool(parallel)})
    try:
        child = subprocess.Popen([sys.executable, "-m", __name__, spec], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return BackgroundCompile(None)
    return BackgroundCompile(child)


if __name__ == "__main__":
    compile_attention(**json.loads(sys.argv[1]))
