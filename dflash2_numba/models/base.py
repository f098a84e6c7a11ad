"""What every target family's model shares (mlx-lm's `base.py`): the croppable KV cache, the
span of a request's rows in a batched forward, the argument checks of `forward` and its tap columns."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import GenerationArgumentError
from ..numerics import kv_array


class KVCache:
    """Per-layer keys/values of positions 0..length-1: k, v [L, nkv, max_len, hd], f32 or
    (dtype np.uint16, `--kv-dtype bf16`) bf16 bits: the kernels widen elements as they read them.

    Positions >= length are scratch: `forward` writes there, then bumps `length`; `commit(n)`
    just lowers `length` (rejected drafts are overwritten by the next forward). The buffer
    doubles when a forward would run past max_len.

    `zeros` allocates the buffers: `np.zeros` on the CPU, `ops.zeros` (a device-resident
    DeviceBuffer) on CUDA, so the cache stays on the GPU across steps without a model fork."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int = 256,
                 zeros=np.zeros, dtype=np.float32):
        shape = (num_layers, num_kv_heads, max(1, int(max_len)), head_dim)
        self.zeros = zeros
        self.dtype = np.dtype(dtype)
        self.k = zeros(shape, dtype=self.dtype)
        self.v = zeros(shape, dtype=self.dtype)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for n more positions (copies into a bigger buffer if needed)."""
        need = self.length + n
        if need <= self.max_len:
            return
        new_len = max(need, 2 * self.max_len)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self.zeros(old.shape[:2] + (new_len,) + old.shape[3:], dtype=self.dtype)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """K/V rows k, v [n, nkv, hd] f32 at positions start..start+n-1 of `layer` (rounded to
        bf16 in a bf16 cache, as the fused kernels' writes are)."""
        end = start + k.shape[0]
        if self.dtype == np.uint16:
            k, v = kv_array(k, self.dtype), kv_array(v, self.dtype)
        self.k[layer, :, start:end] = k.transpose(1, 0, 2)  # [nkv, n, hd]
        self.v[layer, :, start:end] = v.transpose(1, 0, 2)

    def bytes_at(self, positions: int) -> int:
        """Bytes of K and V that `positions` cached positions take (every layer, both tensors)."""
        L, nkv, _, hd = self.k.shape
        return 2 * L * nkv * int(positions) * hd * np.dtype(self.k.dtype).itemsize

    def commit(self, n: int) -> None:
        """Keep positions 0..n-1 (n <= length): after a verify forward, n = the anchor's position
        + accepted rows + 1. The one call the decode loop makes on a target cache of any layer
        kind; a KV cache just lowers `length` (rejected rows are overwritten next time)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"{type(self).__name__}.commit({n}): cache holds {self.length} positions")
        self.length = int(n)


@dataclass(frozen=True)
class Span:
    """One request's rows of a forward: rows `rows` of h sit at positions q_pos [n_r]
    (cache.length = start ..) and attend to keys k_pos [start + n_r] of its own cache."""
    cache: object
    start: int
    q_pos: np.ndarray
    k_pos: np.ndarray
    rows: slice


def forward_ids(ids, tap_layers: Sequence[int], num_layers: int, who: str) -> np.ndarray:
    """The checks every target's forward makes: ids -> int64 [n] (n >= 1), tap layers in range."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [n]
    if ids.shape[0] == 0:
        raise GenerationArgumentError(f"{who}.forward: no token ids given")
    for l in tap_layers:
        if not 0 <= l < num_layers:
            raise GenerationArgumentError(f"tap layer {l} outside 0..{num_layers - 1}")
    return ids



def tap_columns(tap_layers: Sequence[int], H: int) -> dict:
    """{layer: the column slices of its tap rows} for a forward's taps [n, len(tap_layers)*H], a
    layer listed twice getting both (scaled published drafts repeat tap layers). Looked up once
    per layer and built once per (tap layers, H): a plain decode step's Python is a few per cent
    of a small target's step (docs/adaptive_width.md). Do not modify the returned dict."""
    return _tap_columns(tuple(tap_layers), H)


@functools.lru_cache(maxsize=64)
def _tap_columns(tap_layers: tuple, H: int) -> dict:
    at: dict = {}
    for j, l in enumerate(tap_layers):
        at.setdefault(int(l), []).append(slice(j * H, (j + 1) * H))
    return {l: tuple(cols) for l, cols in at.items()}


PROGRESS_MIN_BYTES = 1 << 30  # checkpoints from this size on report their load on stderr


class LoadProgress:
    """One stderr line, rewritten per layer, while a big checkpoint loads (quantizing a 30B MoE
    takes minutes): `loading DIR: layer i/L, x.x GiB of y.y GiB read, t s`. Silent for small
    checkpoints (tests, the embedded pair)."""

    def __init__(self, checkpoint, num_layers: int, stream=None):
        self.total = sum(t.end - t.begin for t in checkpoint.tensors.values())
        self.loud = self.total >= PROGRESS_MIN_BYTES
        self.where, self.num_layers, self.t0 = checkpoint.directory, num_layers, time.perf_counter()
        self.stream = stream or sys.stderr
        self.layer_bytes = self.total / max(1, num_layers)

    def layer_done(self, i: int) -> None:
        if not self.loud:
            return
        done = (i + 1) * self.layer_bytes / 2**30
        print(f"\rloading {self.where}: layer {i + 1}/{self.num_layers}, ~{done:.1f} of {self.total / 2**30:.1f} GiB, "
              f"{time.perf_counter() - self.t0:.0f} s", end="" if i + 1 < self.num_layers else "\n",
              file=self.stream, flush=True)
