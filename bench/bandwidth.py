"""The machine's memory read bandwidth, as the benchmarks compare against it.

    from bandwidth import read_bandwidth
    read_bandwidth(threads=[1, 2], gib=1.0)  # {"1": {"best_gbs": ..., "runs_gbs": [...]}, ...}

A numba parallel sum over a `gib` GiB array (larger than any cache), best of `repeats`. Each
thread's chunk is read as FOUR interleaved streams (four quarters summed in one loop): one core
keeps more cache-line requests in flight that way, as a GEMV that reads several weight rows or
panels at once does. Measured here (2-core Xeon VM): a single-stream sum reads 8 GB/s on one
thread, the four-stream one 14.5 (and 28 on two threads), so a single-stream probe would
understate what the memory system gives and make any GEMV look like >100% of it.
The data is uint64 words (integer adds: the loop is load-bound and needs no fastmath).
"""

import time

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=False)
def _four_stream_sum(a, chunks):
    step = (a.size + chunks - 1) // chunks
    partial = np.zeros(chunks, np.uint64)
    for c in prange(chunks):
        lo = c * step
        hi = min(a.size, lo + step)
        q = (hi - lo) // 4
        a0, a1, a2, a3 = a[lo:lo + q], a[lo + q:lo + 2 * q], a[lo + 2 * q:lo + 3 * q], a[lo + 3 * q:lo + 4 * q]
        s0 = s1 = s2 = s3 = np.uint64(0)
        for i in range(q):
            s0 += a0[i]
            s1 += a1[i]
            s2 += a2[i]
            s3 += a3[i]
        for i in range(lo + 4 * q, hi):  # the chunk's last < 4 words
            s0 += a[i]
        partial[c] = s0 + s1 + s2 + s3
    return partial.sum()


def read_bandwidth(threads: list[int], gib: float = 1.0, repeats: int = 5) -> dict:
    """{str(t): {"best_gbs", "runs_gbs"}} for each thread count t (numba's thread count is left
    at the last t)."""
    import numba

    words = np.ones(int(gib * (1 << 30)) // 8, np.uint64)  # written once: every page is resident
    out = {}
    for t in threads:
        numba.set_num_threads(t)
        _four_stream_sum(words[:1024], t)  # compile / warm
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            total = _four_stream_sum(words, t)
            runs.append(words.nbytes / (time.perf_counter() - t0) / 1e9)
            assert total == words.size, "bandwidth probe summed wrong"
        out[str(t)] = {"best_gbs": max(runs), "runs_gbs": runs}
    return out
