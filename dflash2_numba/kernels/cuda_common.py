"""Shared pieces of the @cuda.jit kernels: simulator switch, launch sizes, host/device moves.

The kernels are written once and run on a GPU or under the CUDA simulator
(`NUMBA_ENABLE_CUDASIM=1`, decided when numba is imported). Under the simulator every CUDA
thread is a Python thread and every array access is interpreted, so the launch sizes below
shrink there: the kernels use grid-stride / block-stride loops, so the same code is correct for
any grid and block size — only the speed changes.
"""

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

