"""What a cold run compiles: every numba dispatcher, its signatures, and the CPU seconds each took (process_time: steadier than wall time on a shared machine).

    python bench/compile_profile.py [-- dflash2-decode args ...]   (default: the README command)

Runs the CLI in this process with NUMBA_CACHE_DIR at an empty temp dir (set before numba is
imported) and listens to numba's "numba:compile" events. A compile nests the compiles of the
@njit functions it calls, so each dispatcher gets its INCLUSIVE seconds and its EXCLUSIVE
seconds (its own minus the nested ones); the exclusive column sums to the total. Also counts
the cached-kernel loads (hits) that did not compile.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import defaultdict

CACHE = tempfile.mkdtemp(prefix="dflash2-profile-cache-")
os.environ["NUMBA_CACHE_DIR"] = CACHE

from numba.core import event  # noqa: E402


class CompileListener(event.Listener):
    def __init__(self):
        self.stack = []  # [name, start, child seconds]
        self.incl = defaultdict(float)
        self.excl = defaultdict(float)
        self.sigs = defaultdict(list)
        self.parents = defaultdict(set)
        self.dispatchers = {}  # numba-internal compiles: which kernel pulled them in

    def on_start(self, ev):
        d = ev.data["dispatcher"]
        name = f"{d.py_func.__module__.replace('dflash2_numba.', '')}.{d.py_func.__name__}"
        kernel = next((f[0] for f in reversed(self.stack) if not f[0].startswith("numba.")), None)
        if kernel and name.startswith("numba."):
            self.parents[name].add(kernel)
        self.stack.append([name, time.process_time(), 0.0])
        self.dispatchers[name] = d
        self.sigs[name].append(", ".join(str(a) for a in ev.data["args"])[:160])

    def on_end(self, ev):
        name, t0, child = self.stack.pop()
        dt = time.process_time() - t0
        if self.stack:
            self.stack[-1][2] += dt
        if not any(frame[0] == name for frame in self.stack):  # recursion: count once
            self.incl[name] += dt
        self.excl[name] += dt - child


def main() -> None:
    args = sys.argv[1:] or ["generate", "--prompt", "def fibonacci(n):"]
    listener = CompileListener()
    event.register("numba:compile", listener)
    t0 = time.process_time()
    from dflash2_numba.cli import main as cli

    try:
        cli.main(args, standalone_mode=False)
    finally:
        wall = time.process_time() - t0
        total = sum(listener.excl.values())
        print(f"\n{'dispatcher':52s} {'sigs':>4s} {'excl s':>7s} {'incl s':>7s}", file=sys.stderr)
        for name in sorted(listener.excl, key=listener.excl.get, reverse=True):
            print(f"{name:52s} {len(listener.sigs[name]):4d} {listener.excl[name]:7.2f} "
                  f"{listener.incl[name]:7.2f}", file=sys.stderr)
        print(f"{'total compile':52s} {sum(map(len, listener.sigs.values())):4d} {total:7.2f}   "
              f"(run {wall:.1f} s CPU, cache {CACHE})", file=sys.stderr)
        for name, kernels in listener.parents.items():
            print(f"{name} <- {', '.join(sorted(kernels))}", file=sys.stderr)
        if os.environ.get("PROFILE_PASSES"):  # where a kernel's own seconds went
            for name in sorted(listener.excl, key=listener.excl.get, reverse=True)[:6]:
                d = listener.dispatchers[name]
                for sig in d.signatures:
                    md = d.get_metadata(sig)
                    passes = md.get("pipeline_times", {}).get("nopython", {})
                    top = sorted(((v.run, k) for k, v in passes.items()), reverse=True)[:5]
                    print(f"{name}: " + ", ".join(f"{k.split('_', 1)[1]} {t:.2f}" for t, k in top)
                          + f"; llvm_lock {md['timers'].get('llvm_lock', 0):.2f}", file=sys.stderr)
        if os.environ.get("PROFILE_SIGS"):
            for name, sigs in listener.sigs.items():
                if len(sigs) > 1:
                    print(f"\n{name}:", *("   " + s for s in sigs), sep="\n", file=sys.stderr)


if __name__ == "__main__":
    main()
