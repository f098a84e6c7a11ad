"""The cache of a hybrid target: a KV cache for the full-attention layers, a conv state and a
recurrent state for the Gated DeltaNet layers, behind the one `commit(n)` the decode loop calls.

A recurrent state cannot be cropped: S after row m of a verify block is not recoverable from S
after the last row. The scheme here (docs/targets/qwen3_5.md, "Rollback"):

- Double buffer. Every forward swaps `state` and `pre` and runs the recurrence FROM `pre` INTO
  `state`, so `pre` keeps the state before the block at no copy cost. The forward leaves the
  cache as if every row were accepted (length += n, state = after the last row).
- Capture. Each GDN layer records the block's recurrence inputs (q, k, v, g, beta) and its conv
  window ([old conv state | the block's raw qkv rows]).
- `commit(n)` with n = block start + m: the conv state becomes rows m..m+K-2 of the window, and
  the recurrence is REPLAYED over the first m captured rows from `pre` into `state` (the same
  deterministic kernel as the forward, so the state is bit-identical to the forward's after row
  m-1). Full acceptance (n = length) costs nothing. Replay costs m rows of the recurrence per
  GDN layer: ~4 Hv dk dv flops per row, no weights read.

Rolling back past the start of the last forward is impossible (the older states are gone) and
is refused.
"""

from __future__ import annotations

import numpy as np

from .target import KVCache


class HybridCache:
    """length: positions held. kv: KVCache of the attention layers (slot = attention_slot[i]).
    conv [n_gdn, K-1, C], state / pre [n_gdn, Hv, dk, dv] f32 (device buffers on CUDA)."""

    def __init__(self, config, ops, max_len: int = 256):
        c = config
        zeros = getattr(ops, "zeros", np.zeros)  # device-resident buffers on CUDA
        self.ops = ops
        self.attention_slot = {layer: j for j, layer in enumerate(c.attention_layers)}
        self.gdn_slot = {layer: j for j, layer in enumerate(c.gdn_layers)}
        self.kv = KVCache(max(1, len(self.attention_slot)), c.num_key_value_heads, c.head_dim, max_len, zeros)
        n_gdn, K = max(1, len(self.gdn_slot)), c.linear_conv_kernel_dim
        state_shape = (n_gdn, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.conv = np.zeros((n_gdn, K - 1, c.conv_dim), np.float32)  # [n_gdn, K-1, C] raw qkv rows
        self.state = zeros(state_shape, dtype=np.float32)  # after the last committed row
        self.pre = zeros(state_shape, dtype=np.float32)  # before the last forward's block
        self.captured: list[tuple | None] = [None] * n_gdn  # per GDN layer: (window, q, k, v, g, beta)
        self.length = 0
        self.block_start = 0  # first position of the last forward: the rollback floor
        self.block_rows = 0

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    # ------------------------------------------------------------------ forward side
    def begin_block(self, n: int) -> None:
        """Called by the model before a forward of n rows."""
        self.kv.reserve(n)
        self.pre, self.state = self.state, self.pre  # run from the committed state into the other buffer
        self.block_start, self.block_rows = self.length, n
        self.captured = [None] * len(self.captured)

    def conv_window(self, layer: int, raw: np.ndarray) -> np.ndarray:
        """[K-1, C] cached rows ++ raw [n, C] -> window [K-1+n, C]; the conv state moves to its
        right K-1 rows (what full acceptance keeps)."""
        j = self.gdn_slot[layer]
        window = np.concatenate([self.conv[j], raw], axis=0)  # [K-1+n, C]
        self.conv[j] = window[window.shape[0] - self.conv.shape[1]:]
        return window

    def recurrence(self, layer: int, window, q, k, v, g, beta) -> np.ndarray:
        """Run the gated delta rule for the block from `pre` into `state`, keeping its inputs."""
        j = self.gdn_slot[layer]
        self.captured[j] = (window, q, k, v, g, beta)
        return self.ops.gated_delta(q, k, v, g, beta, self.pre[j], self.state[j])  # [n, Hv, dv]

    def end_block(self) -> None:
        self.length = self.block_start + self.block_rows
        self.kv.length = self.length

    # ------------------------------------------------------------------ the decode loop's call
    def commit(self, n: int) -> None:
        """Keep positions 0..n-1: the state becomes exactly the state after position n-1."""
        if not self.block_start <= n <= self.length:
            lo = self.block_start
            raise ValueError(f"{type(self).__name__}.commit({n}): a hybrid cache can keep {lo}..{self.length} "
                             f"positions (the recurrent state before position {lo} is gone)")
        if n == self.length:
            return
        m = n - self.block_start  # accepted rows of the last block
        K1 = self.conv.shape[1]
        for j, captured in enumerate(self.captured):
            if captured is None:
                continue
            window, q, k, v, g, beta = captured
            self.conv[j] = window[m : m + K1]  # the K-1 raw rows before position n
            self.ops.gated_delta(q[:m], k[:m], v[:m], g[:m], beta[:m], self.pre[j], self.state[j])
        self.length = n
        self.kv.commit(n)
