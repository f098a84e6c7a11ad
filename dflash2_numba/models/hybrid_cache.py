"""The cache of a hybrid target: a KV cache for the full-attention layers, a conv state and a
recurrent state for the Gated DeltaNet layers, behind the one `commit(n)` the decode loop calls.

A recurrent state cannot be cropped: S after row m of a verify block is not recoverable from S
after the last row. The scheme here (docs/targets/qwen3_5.md, "Rollback"): keep the state at a
FLOOR position and every recurrence input since, and replay the accepted rows on commit.

- Floor. `pre` holds the recurrent state at position `floor`, `conv_floor` the conv state there.
  The first forward after a commit swaps the `state` / `pre` buffers and runs the recurrence
  FROM `pre` INTO `state`, so keeping the floor state costs no copy. A forward always leaves the
  cache as if every row were accepted (length += n, state = after its last row).
- Capture. Each GDN layer records its recurrence inputs (q, k, v, g, beta) and its raw qkv rows
  for every row since the floor.
- `commit(n)`, floor <= n <= length: with m = n - floor, the conv state becomes rows m..m+K-2
  of [conv_floor | raw rows], and the recurrence is REPLAYED over the first m captured rows from
  `pre` into `state` (the same deterministic kernel as the forward, so the state equals the
  forward's after row m-1 bit for bit). n = length costs nothing. Then n is the new floor.

The decode loop commits after every verify forward, so only one block is ever captured. Several
forwards without a commit (a drafter that runs the target row by row, then commits back to its
anchor) stay replayable as long as they hold at most REPLAY_ROWS rows; a forward that would go
past that first seals the rows before it (commits them: they can no longer be rolled back). A
forward of more than REPLAY_ROWS rows (a prefill) captures nothing and is sealed at its end:
capturing a long prompt would cost ~3.8 MiB per row at the 27B shape.
"""

from __future__ import annotations

import numpy as np

from .base import KVCache

# most rows kept replayable (>= any verify block Q); each costs (2 Hk dk + Hv dv + 2 Hv + C) f32
# per GDN layer
REPLAY_ROWS = 64


class HybridCache:
    """length: positions held. kv: KVCache of the attention layers (slot = attention_slot[i]).
    conv [n_gdn, K-1, C] f32; state / pre [n_gdn, Hv, dk, dv] f32 (device buffers on CUDA)."""

    def __init__(self, config, ops, max_len: int = 256, kv_dtype=np.float32):
        c = config
        zeros = getattr(ops, "zeros", np.zeros)  # device-resident buffers on CUDA
        self.ops = ops
        self.attention_slot = {layer: j for j, layer in enumerate(c.attention_layers)}
        self.gdn_slot = {layer: j for j, layer in enumerate(c.gdn_layers)}
        self.kv = KVCache(max(1, len(self.attention_slot)), c.num_key_value_heads, c.head_dim, max_len, zeros,
                          kv_dtype)
        n_gdn, K = max(1, len(self.gdn_slot)), c.linear_conv_kernel_dim
        state_shape = (n_gdn, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.conv = np.zeros((n_gdn, K - 1, c.conv_dim), np.float32)  # [n_gdn, K-1, C] raw qkv rows
        self.conv_floor = self.conv.copy()
        self.state = zeros(state_shape, dtype=np.float32)  # after position length-1
        self.pre = zeros(state_shape, dtype=np.float32)  # at the floor (valid while rows are captured)
        self.captured: list[list[tuple]] = [[] for _ in range(n_gdn)]  # per GDN layer: (raw, q, k, v, g, beta)
        self.length = 0
        self.floor = 0  # the lowest position commit(n) may return to
        self._from_pre = False  # does the running forward start from `pre`?

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def replayable_rows(self) -> int:
        return self.length - self.floor

    # ------------------------------------------------------------------ forward side
    def begin_block(self, n: int) -> None:
        """Called by the model before a forward of n rows."""
        self.kv.reserve(n)
        if self.replayable_rows and self.replayable_rows + n > REPLAY_ROWS:
            self._seal()
        self._from_pre = self.replayable_rows == 0
        if self._from_pre:  # the committed state becomes the floor state: swap, no copy
            self.pre, self.state = self.state, self.pre
        self._rows = n
        self._capture = n <= REPLAY_ROWS  # a longer block (a prefill) is sealed, not captured

    def conv_window(self, layer: int, raw: np.ndarray) -> np.ndarray:
        """[K-1, C] cached rows ++ raw [n, C] -> window [K-1+n, C]; the conv state moves to its
        right K-1 rows (what full acceptance keeps)."""
        j = self.gdn_slot[layer]
        window = np.concatenate([self.conv[j], raw], axis=0)  # [K-1+n, C]
        self.conv[j] = window[window.shape[0] - self.conv.shape[1]:]
        return window

    def recurrence(self, layer: int, raw, q, k, v, g, beta) -> np.ndarray:
        """The gated delta rule over the block (from `pre` if it is the first block since the
        floor, else in place), its inputs captured for a replay."""
        j = self.gdn_slot[layer]
        if self._capture:
            self.captured[j].append((raw, q, k, v, g, beta))
        source = self.pre[j] if self._from_pre else self.state[j]
        return self.ops.gated_delta(q, k, v, g, beta, source, self.state[j])  # [n, Hv, dv]

    def end_block(self) -> None:
        self.length += self._rows
        self.kv.length = self.length
        if not self._capture:
            self._seal()

    def _seal(self) -> None:
        """Accept everything held: the current state becomes the floor."""
        self.floor = self.length
        self.conv_floor = self.conv.copy()
        self.captured = [[] for _ in self.captured]

    # ------------------------------------------------------------------ the decode loop's call
    def commit(self, n: int) -> None:
        """Keep positions 0..n-1: every layer's state becomes exactly the state after position
        n-1. n may go back to the floor (the last commit, or a sealed position), no further."""
        if not self.floor <= n <= self.length:
            raise ValueError(f"{type(self).__name__}.commit({n}): a hybrid cache can keep {self.floor}.."
                             f"{self.length} positions (the recurrent state before position {self.floor} "
                             "is gone)")
        if n < self.length:
            m, K1 = n - self.floor, self.conv.shape[1]
            for j, blocks in enumerate(self.captured):
                if not blocks:
                    continue
                raw, q, k, v, g, beta = (np.concatenate(parts)[:m] for parts in zip(*blocks))
                window = np.concatenate([self.conv_floor[j], raw])  # [K-1+m, C]
                self.conv[j] = window[m : m + K1]  # the K-1 raw rows before position n
                self.ops.gated_delta(q, k, v, g, beta, self.pre[j], self.state[j])
            self.length = n
            self.kv.commit(n)
        self._seal()
