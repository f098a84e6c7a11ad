"""Test doubles for the decode loop (used by test_speculative / test_sampling / test_generate).

HashTarget: a genuinely causal "language model" with the TargetModel interface whose
logits and taps at position t are a deterministic function of ids[0..t] (a rolling hash of the
prefix seeds an RNG). No numba, microseconds per token, so the loop's bookkeeping can be swept
exhaustively. A wrong commit / position / context changes the prefix hash and therefore every later
logit, exactly like a real transformer KV cache bug would.

RandomDrafter: proposes uniformly random tokens (greedy: reported one-hot; sampling: q uniform).
TapCheckingDrafter: wraps a drafter and asserts that every context it receives equals the
target's taps recomputed from scratch for the committed ids (catches taps of rejected rows,
skipped or duplicated positions, the anchor's taps passed early).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from dflash2_numba.decode.drafter import Proposal, valid_vocab
from dflash2_numba.decode.sampling import mask_padded
from dflash2_numba.kernels.backend import get_ops

_MOD = (1 << 61) - 1


class HashCache:
    def __init__(self, max_len: int):
        self.max_len = max_len
        self.hashes: list[int] = []  # prefix hash of ids[0..t] for every cached position t

    @property
    def length(self) -> int:
        return len(self.hashes)

    def commit(self, n: int) -> None:
        assert 0 <= n <= len(self.hashes), (n, len(self.hashes))
        del self.hashes[n:]


class HashTarget:
    def __init__(self, vocab_size=48, valid=44, hidden=4, n_layers=4, scale=3.0, seed=0):
        self.config = SimpleNamespace(vocab_size=vocab_size, hidden_size=hidden,
                                      num_hidden_layers=n_layers, eos_token_id=[])
        self.valid_vocab = valid
        self.tokenizer = None
        self.scale, self.seed, self.hidden = scale, seed, hidden
        self.forward_rows: list[int] = []  # rows per forward call (tests count verify passes)
        self._memo: dict = {}  # (prefix hash, taps) -> row: sampling tests revisit prefixes

    def new_cache(self, max_len: int) -> HashCache:
        return HashCache(max_len)

    def _row(self, h: int, tap_layers):
        key = (h, tuple(tap_layers))
        if key not in self._memo:
            self._memo[key] = self._compute_row(h, tap_layers)
        logits, taps = self._memo[key]
        return logits.copy(), taps

    def _compute_row(self, h: int, tap_layers):
        rng = np.random.default_rng([self.seed, h & 0xFFFFFFFF, h >> 32])
        logits = (self.scale * rng.standard_normal(self.config.vocab_size)).astype(np.float32)
        taps = [rng.standard_normal(self.hidden).astype(np.float32) + l for l in tap_layers]
        return logits, taps

    def forward(self, ids, cache: HashCache, tap_layers=(), last_only=False):
        ids = np.asarray(ids, np.int64)
        assert ids.ndim == 1 and len(ids) >= 1
        assert cache.length + len(ids) <= cache.max_len, "cache overflow"
        self.forward_rows.append(len(ids))
        h = cache.hashes[-1] if cache.hashes else 1469598103934665603 % _MOD
        logits, taps = [], []
        for t in ids:
            h = (h * 1000003 + int(t) + 1) % _MOD
            cache.hashes.append(h)
            lg, tp = self._row(h, tap_layers)
            logits.append(lg)
            taps.append(np.concatenate(tp) if tap_layers else None)
        logits = np.stack(logits[-1:] if last_only else logits)
        return logits, (np.stack(taps) if tap_layers else None)


def greedy_reference(target, prompt_ids, n_new, stops=()):
    """Manual argmax loop: one single-token forward per step (no draft, no loop code)."""
    cache = target.new_cache(len(prompt_ids) + n_new + 1)
    logits, _ = target.forward(np.asarray(prompt_ids, np.int64), cache)
    out = []
    while True:
        t = int(np.argmax(mask_padded(logits[-1], valid_vocab(target))))
        out.append(t)
        if t in stops or len(out) == n_new:
            return out
        logits, _ = target.forward(np.array([t], np.int64), cache)


class RandomDrafter:
    kind = "random"
    mask_token_id = -1

    def __init__(self, target, block_size=8, seed=0, target_layer_ids=()):
        self.block_size = block_size
        self.target_layer_ids = list(target_layer_ids)
        self.V = valid_vocab(target) or target.config.vocab_size
        self.Vfull = target.config.vocab_size
        self.rng = np.random.default_rng(seed)

    def new_state(self, max_len):
        return SimpleNamespace(length=0)

    def extend_context(self, state, taps, start_pos, token_ids):
        assert start_pos == state.length
        state.length += len(token_ids)

    def propose(self, state, anchor_id, anchor_pos, n_rows, sampling, rng):
        assert anchor_pos == state.length
        d = self.rng.integers(0, self.V, n_rows - 1)
        q = None
        if not sampling.greedy:
            q = np.zeros((n_rows - 1, self.Vfull), np.float32)
            q[:, :self.V] = 1.0 / self.V
        return Proposal(d.astype(np.int64), q, {})


class TapCheckingDrafter:
    """Delegates to `inner`, checking each context chunk against a fresh prefill's taps."""

    def __init__(self, inner, target, tap_layers=(0, 2), atol=0.0):
        self.inner, self.target, self.atol = inner, target, atol
        self.kind, self.block_size = inner.kind, inner.block_size
        self.mask_token_id = inner.mask_token_id
        self.target_layer_ids = list(tap_layers)
        self.ids: list[int] = []
        self.checked_rows = 0

    def new_state(self, max_len):
        return self.inner.new_state(max_len)

    def extend_context(self, state, taps, start_pos, token_ids):
        assert start_pos == len(self.ids), (start_pos, len(self.ids))
        assert taps is not None and taps.shape[0] == len(token_ids), (None if taps is None else taps.shape)
        self.ids.extend(int(t) for t in token_ids)
        cache = self.target.new_cache(len(self.ids))
        _, ref = self.target.forward(np.asarray(self.ids, np.int64), cache, tap_layers=tuple(self.target_layer_ids))
        np.testing.assert_allclose(taps, ref[start_pos:], atol=self.atol, rtol=0)
        self.checked_rows += len(token_ids)
        self.inner.extend_context(state, None, start_pos, token_ids)

    def propose(self, state, anchor_id, anchor_pos, n_rows, sampling, rng):
        assert anchor_pos == len(self.ids)
        return self.inner.propose(state, anchor_id, anchor_pos, n_rows, sampling, rng)


class SelectorDrafter(RandomDrafter):  # inherits only the context bookkeeping
    """The REAL DFlash2 CandidateSelector (random codebooks / projection) on top of a stand-in
    block forward: final states h and mask logits z drawn from an RNG keyed by the anchor.
    Sampling goes through the selector's Gumbel walk and hands its q to the verifier, so a
    distribution test over this drafter checks that the walk's q is honest end to end (the
    DFlash2 block forward itself is deterministic and gated elsewhere against a reference).
    Red when the walk samples from anything but the q it reports (tried: walk at 3x the
    logits' scale -> p < 1e-3 in both settings). Note that reporting q=None (one-hot) for a
    sampled draw is NOT a bug: one-hot verification is lossless for any proposal rule that is
    independent of the verifier's coins, it only accepts less."""

    kind = "dflash2-selector"
    mask_token_id = -1

    def __init__(self, target, block_size=4, hidden=6, rank=4, top_k=4, seed=0,
                 output_multiplier=0.7, softcap=3.0):
        from dflash2_numba.models.selector import CandidateSelector

        rng = np.random.default_rng(seed)
        V = target.config.vocab_size
        self.block_size, self.hidden, self.seed = block_size, hidden, seed
        self.target_layer_ids: list[int] = []
        self.selector = CandidateSelector(
            rng.standard_normal((rank, hidden)).astype(np.float32),  # hidden_projection [r, H]
            rng.standard_normal((V, rank)).astype(np.float32),  # predecessor_codebook [V, r]
            rng.standard_normal((V, rank)).astype(np.float32),  # successor_codebook [V, r]
            top_k, output_multiplier, softcap, valid_vocab=valid_vocab(target))
        self.V = V

    def propose(self, state, anchor_id, anchor_pos, n_rows, sampling, rng):
        assert anchor_pos == state.length
        k = n_rows - 1
        key = np.random.default_rng([self.seed, int(anchor_id), int(anchor_pos)])
        h = key.standard_normal((k, self.hidden)).astype(np.float32)  # [k, H]
        z = (1.5 * key.standard_normal((k, self.V))).astype(np.float32)  # [k, V]
        positions = np.arange(anchor_pos + 1, anchor_pos + 1 + k)
        ids, q, info = self.selector.select(h, z, int(anchor_id), positions, sampling, rng)
        return Proposal(ids, q, info)


def rowwise_ops():
    """The CPU kernels with GEMV and attention called one row at a time. The production GEMV
    shares weight loads across groups of 8/4/1 rows, and its FMA contraction differs by an ulp
    between groups, so a block and a prefill computing the same row can differ by ~2e-6 of the
    logits; one-row calls make every row's arithmetic independent of the block it is in, so a
    correct rollback must reproduce a fresh run BIT FOR BIT (and a wrong one cannot hide in
    rounding noise)."""
    ops = get_ops("cpu")

    def linear(x, w, out=None):
        return np.concatenate([ops.linear(x[i:i + 1], w) for i in range(x.shape[0])])  # [n, N]

    def attention(q, k, v, q_pos, k_pos, causal=True, window=0, bf16=False):
        return np.concatenate([ops.attention(q[i:i + 1], k, v, q_pos[i:i + 1], k_pos[:q_pos[i] + 1], causal,
                                             window, bf16) for i in range(q.shape[0])])  # [n, nh, hd]

    return replace(ops, linear=linear, attention=attention)
