"""Shared pieces of the @cuda.jit kernels: simulator switch, launch sizes, host/device moves.

The kernels are written once and run on a GPU or under the CUDA simulator
(`NUMBA_ENABLE_CUDASIM=1`, decided when numba is imported). Under the simulator every CUDA
thread is a Python thread and every array access is interpreted, so the launch sizes below
shrink there: the kernels use grid-stride / block-stride loops, so the same code is correct for
any grid and block size — only the speed changes.
"""

import sys
import threading
import warnings

import numpy as np
from numba import config, cuda
from numba.core.errors import NumbaPerformanceWarning

SIMULATOR = bool(config.ENABLE_CUDASIM)

# Decode-size launches (one query x a few heads, a short conv) are small grids by nature; numba
# would warn "Grid size N will likely result in GPU under-utilization" on every call.
warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-utilization",
                        category=NumbaPerformanceWarning)

# Threads per block of the block-reduction kernels (linear, attention): a power of two. The
# kernels are built per thread count (a compile-time constant of their shared arrays), so tests
# can also run the simulator with deeper reduction trees. Under the simulator every
# __syncthreads is a round trip through its Python scheduler: 2 threads is the fastest size
# that still runs the tree-reduction code.
REDUCE_THREADS = 2 if SIMULATOR else 128
# Threads per block of the elementwise conv kernel.
ELEMENT_THREADS = 32 if SIMULATOR else 256
# Upper bound on blocks of a grid-stride launch (the simulator walks blocks one by one).
MAX_BLOCKS = 2 if SIMULATOR else 65535


def _make_simulator_shared_arrays_thread_safe() -> None:
    """Make the simulator's `cuda.shared.array` give every thread of a block the SAME array.

    The simulator keys a block's static shared arrays by the calling (file, line) and creates
    one on first use with an unlocked check-then-insert (`get`, `np.empty`, store). Its CUDA
    threads are Python threads, so two threads of the first block of a launch can both miss and
    each keep a private array: a tree reduction then adds a slot the other thread never wrote
    (stale memory from an earlier launch). That made the simulator decode tests fail now and
    then (a wrong token), more often with the tests' short GIL switch interval or under CPU
    load. The kernels themselves are fenced correctly; the allocation is not. Same keying,
    same dynamic-shared-memory path, with the lookup-and-create under one lock."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared_cls = kernelapi.FakeCUDAShared
    if getattr(shared_cls, "_dflash2_thread_safe", False):
        return
    original = shared_cls.array
    lock = threading.Lock()

    def array(self, shape, dtype):  # the simulator's signature
        if shape == 0:  # dynamic shared memory: one buffer made up front, no race there
            return original(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)  # the kernel line: the key the simulator uses
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            res = self._allocations.get(key)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[key] = res
        return res

    shared_cls.array = array
    shared_cls._dflash2_thread_safe = True


if SIMULATOR:
    _make_simulator_shared_arrays_thread_safe()


def is_device_array(a) -> bool:
    """A numba device array (or the simulator's stand-in for one); numpy arrays are not."""
    return hasattr(a, "copy_to_host") and not isinstance(a, np.ndarray)


def to_device(a, dtype=None):
    """Host array (any layout) -> C-contiguous device array; device arrays pass unchanged."""
    if is_device_array(a):
        return a
    return cuda.to_device(np.ascontiguousarray(a, dtype=dtype))


def grid_blocks(n_items: int) -> int:
    """Blocks for a block-per-item launch with a block-stride loop."""
    return max(1, min(int(n_items), MAX_BLOCKS))

