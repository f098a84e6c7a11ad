"""Transformer building blocks in plain numpy (picoGPT style), shared by target and drafts.

Activations are float32 `[rows, features]` (or `[rows, heads, hd]`). Every function takes
`bf16: bool`: False computes in f32 (run mode "f32"); True rounds to bf16 at each point where
eager PyTorch in bfloat16 materialises a tensor (run mode "bf16", spec §6), so elementwise
steps match torch bit for bit. Weights may be uint16 (bf16 bits) or float; small ones
(norm weights) are converted here, big ones go through `ops.linear`.
"""

import numpy as np

from ..errors import GenerationArgumentError
from ..numerics import as_f32, round_bf16_array
from .rope import rope_frequencies


def rnd_if(x: np.ndarray, bf16: bool) -> np.ndarray:
    """rnd(x) in bf16 mode, x itself in f32 mode."""
    return round_bf16_array(x) if bf16 else x


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, bf16: bool = False) -> np.ndarray:
    """HF RMSNorm: w * cast(x * rsqrt(mean(x^2) + eps)), statistics in f32.
    x [..., D] f32, w [D] -> [..., D] f32."""
    x = x.astype(np.float32, copy=False)
    var = np.mean(x * x, axis=-1, keepdims=True)  # [..., 1]
    normed = rnd_if(x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))), bf16)  # [..., D]
    return rnd_if(as_f32(w) * normed, bf16)


def rope_tables(positions: np.ndarray, head_dim: int, theta: float, bf16: bool = False, scaling=None):
    """cos, sin [n, hd] for NeoX rotate-half RoPE, computed in f32 as HF does
    (inv_freq_i = 1 / theta^(2i/hd), or YaRN's mix when `scaling` (models/rope.RopeScaling) is
    given, whose attention factor then multiplies cos and sin; in bf16 mode the tables are cast
    to bf16, like HF's `cos.to(x.dtype)`)."""
    inv_freq, factor = rope_frequencies(head_dim, theta, scaling)  # [hd/2]
    freqs = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # [n, hd/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [n, hd]
    cos, sin = np.cos(emb), np.sin(emb)
    if scaling is not None:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return rnd_if(cos, bf16), rnd_if(sin, bf16)


class RopeTables:
    """`rope_tables` for any positions, served from one [P, hd] table that grows (doubling) as
    positions grow: the same bits (every entry is an elementwise function of its position), one
    row gather per forward instead of fresh cos/sin/concatenate calls.

        rope = RopeTables(head_dim, theta, bf16, scaling)   # scaling: models/rope.RopeScaling or None
        cos, sin = rope(positions)      # [n, hd] each, any positions
        cos, sin = rope.span(start, n)  # positions start..start+n-1, as views"""

    def __init__(self, head_dim: int, theta: float, bf16: bool = False, scaling=None):
        self.head_dim, self.theta, self.bf16, self.scaling = int(head_dim), float(theta), bool(bf16), scaling
        self.cos = self.sin = np.empty((0, self.head_dim), np.float32)  # [P, hd]

    def __call__(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [n, hd] of arbitrary positions [n] (row copies)."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)  # [n]
        if positions.size and positions.min() < 0:
            return rope_tables(positions, self.head_dim, self.theta, self.bf16, self.scaling)
        self._grow(int(positions.max()) + 1 if positions.size else 0)
        return self.cos[positions], self.sin[positions]

    def span(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [n, hd] of positions start..start+n-1: read-only views, no copy."""
        self._grow(start + n)
        return self.cos[start:start + n], self.sin[start:start + n]

    def _grow(self, top: int) -> None:
        if top > self.cos.shape[0]:
            P = max(top, 2 * self.cos.shape[0], 256)
            self.cos, self.sin = rope_tables(np.arange(P), self.head_dim, self.theta, self.bf16, self.scaling)
            self.cos.flags.writeable = self.sin.flags.writeable = False


def rotate_half(x: np.ndarray) -> np.ndarray:
    """[..., hd] -> [-x2, x1] with x1, x2 the two halves."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, bf16: bool = False) -> np.ndarray:
    """x [n, heads, hd], cos/sin [n, hd] -> x*cos + rotate_half(x)*sin (each product rounded
    in bf16 mode, then the sum)."""
    c, s = cos[:, None, :], sin[:, None, :]  # [n, 1, hd]
    return rnd_if(rnd_if(x * c, bf16) + rnd_if(rotate_half(x) * s, bf16), bf16)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, bf16: bool = False) -> np.ndarray:
    """x [n, heads, hd] rotated to positions [n]."""
    cos, sin = rope_tables(positions, x.shape[-1], theta, bf16)
    return apply_rope(x, cos, sin, bf16)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in f32 (exp overflow for very negative x gives -0, as torch)."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray, bf16: bool = False) -> np.ndarray:
    """silu(gate) * up; eager bf16 rounds silu's output, then the product. [n, I] -> [n, I]."""
    return rnd_if(rnd_if(silu(gate), bf16) * up, bf16)


def mlp(x, w_gate, w_up, w_down, linear, bf16: bool = False, swiglu=swiglu) -> np.ndarray:
    """down(silu(gate(x)) * up(x)). x [n, H] -> [n, H]; `linear` and `swiglu` are the ops'."""
    g = rnd_if(linear(x, w_gate), bf16)  # [n, I]
    u = rnd_if(linear(x, w_up), bf16)  # [n, I]
    return rnd_if(linear(swiglu(g, u, bf16), w_down), bf16)  # [n, H]


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a [V, H] table (bf16 bits or float) as f32 [n, H]; only those rows are
    read and converted."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [n]
    V = table.shape[0]
    bad = ids[(ids < 0) | (ids >= V)]
    if bad.size:
        raise GenerationArgumentError(f"token id {int(bad[0])} outside the embedding table [0, {V})")
    return as_f32(table[ids])  # [n, H]


ROW_INVARIANT_ROWS = 32  # kernels/linear.GEMV_MAX_ROWS: up to here no weight kind goes to BLAS


def in_row_chunks(fn, x: np.ndarray, rows: int = ROW_INVARIANT_ROWS) -> np.ndarray:
    """fn(x) computed over chunks of at most `rows` rows of x [n, ...], concatenated. `fn` must
    be row-wise (each output row depends on its input row only). With the CPU linear (the
    panel GEMV up to 32 rows: one fma chain per output) every row then gets the bits it gets
    alone, whatever else is stacked with it; above 32 rows an unpacked (float32 / float16)
    weight goes to BLAS, whose blocking depends on the row count (packed bf16 and quantized
    weights keep one order at any count). The batched forwards (models/batched.py) rely on it."""
    if x.shape[0] <= rows:
        return fn(x)
    return np.concatenate([fn(x[a:a + rows]) for a in range(0, x.shape[0], rows)])
