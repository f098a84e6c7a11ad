"""DFlash2 candidate selector (spec §4.3, §4.4): replaces the per-slot argmax of DFlash v1.

For the k mask rows of one draft block (row l predicts position p+1+l):

    z_l        = target lm_head(h_l)                              [V] f32 logits
    ids_l, v_l = topK(z_l)                                        descending, ties -> ascending id
    u_l        = scalars(v_l)                                     v*mult, then cap*tanh(u/cap)
    pi_l       = hidden_projection(h_l)                           [r]
    S[l,a,c]   = u_l[c] + sum_r A[pred(l,a), r] * pi_l[r] * Bc[ids_l[c], r]
    pred(0,a)  = anchor;  pred(l,a) = ids_{l-1}[a]
    walk:        prev = 0; c* = argmax_c S[l,prev,c] (+ Gumbel noise / T when sampling)

API (everything float32 unless said; `k` mask rows, `K` = selector_top_k, `V` = target vocab):

    sel = CandidateSelector.from_checkpoint(ckpt, cfg, vocab_size, valid_vocab=None)
          # raises SelectorRefusedError; defer_refusal=True returns a RefusedSelector instead
    CandidateSelector.refusal_reason(ckpt, cfg, vocab_size, valid_vocab=None) -> str | None
    CandidateSelector(hidden_projection [r,H], predecessor_codebook [V,r], successor_codebook [V,r],
                      top_k, output_multiplier=1.0, softcap=None, valid_vocab=None)
          # weights: uint16 (bf16 bits, e.g. zero-copy checkpoint views), float16 or float32

    sel.select(h [k,H], z [k,V], anchor_id, positions [k], sampling, rng)
        -> (draft_ids [k] int64, q [k,V] f32 | None, info)
          h: final-normed mask rows (NOT the anchor row); z: their target logits (unmasked is
          fine: padding ids >= valid_vocab and NaN become -inf here); positions[l] = p+1+l.
          sampling: anything with .temperature / .greedy / .seed (decode.sampling.SamplingParams).
          q is None for greedy (one-hot); otherwise q_l = softmax(S[l,prev_l,:]/T) scattered onto
          the K candidate ids, zero elsewhere — the exact law of draft_ids[l] given the prefix.
          info = {"slots": [{"candidate_ids", "candidate_values", "candidate_scores"}...],
                  "chosen_slots": [...]}; candidate_scores = S[l, prev_l, :] (the edge scores
          the walk compared at row l).
    pieces, for tests and the `propose` report:
    sel.candidates(z) -> (ids [k,K] int64, values [k,K])
    sel.scalars(v) -> u
    sel.scores(h, ids, u, anchor_id) -> S [k,K,K]
    sel.walk_greedy(S) -> slots [k]
    sel.walk_sampled(S, ids, temperature, seed, positions) -> (slots [k], q [k,V])

Refusals (SelectorRefusedError, message names the boundary): selector tensors absent, a
selector tensor in a dtype we do not compute with faithfully, codebook rows != target vocab,
shapes that disagree with [r, H] / [V, r], selector_top_k > valid vocab; at select time, logits
whose width is not the codebook vocab. The draft checks `refusal_reason` at load (prints a
notice), still runs its block forward, and the refusal is raised by `select` (RefusedSelector).

Numerics: always f32 (both run modes): top-K on f32 logits, scalars as f32 multiply and f32
np.tanh, pi = h @ Wp^T and the bilinear term as f32 matmuls from bf16 weights, S kept in f32
(rounding S to bf16 moves a row's argmax ~0.8% of the time).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..decode.drafter import LazyInfo
from ..errors import SelectorRefusedError
from ..kernels.linear import _load
from ..numerics import as_f32

PREFIX = "candidate_selector."
TENSORS = (PREFIX + "hidden_projection.weight", PREFIX + "predecessor_codebook", PREFIX + "successor_codebook")
FAITHFUL_DTYPES = ("BF16", "F16", "F32")  # what as_f32 reads exactly; anything else is quantized


# ---------------------------------------------------------------- keyed Gumbel noise
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mixer whose outputs
    pass BigCrush for consecutive inputs. uint64 arithmetic wraps mod 2^64 (intended)."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
    return x ^ (x >> np.uint64(31))


def keyed_uniform(seed: int, positions: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """U(0,1) float64, one per element, a pure function of (seed, position, token id):
    a counter-based generator (hash the key, no state). Broadcasts positions against ids.
    Strictly inside (0, 1) so the Gumbel transform below is finite."""
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    tok = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full(np.broadcast_shapes(pos.shape, tok.shape), np.uint64(seed & 0xFFFFFFFFFFFFFFFF)))
        h = _splitmix64(h ^ pos)
        h = _splitmix64(h ^ tok)
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53  # 53-bit mantissa


def keyed_gumbel(seed: int, positions: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise -log(-log U) keyed by (seed, position, token id), float64."""
    return -np.log(-np.log(keyed_uniform(seed, positions, token_ids)))


# ---------------------------------------------------------------- top-K kernel
TOPK_CHUNK = 64  # ids per screening test of _top_k_rows


@njit(inline="always")
def _topk_insert(z, l, t, valid_vocab, ids, vals, n, K):
    """Offer id t of row l to the sorted list of the n (<= K) kept so far -> the new n."""
    v = z[l, t] if t < valid_vocab else -np.inf
    if v != v:  # NaN
        v = -np.inf
    if n == K and not v > vals[l, K - 1]:
        return n
    pos = min(n, K - 1)  # the slot it lands in: shift worse values one place down
    while pos > 0 and vals[l, pos - 1] < v:
        if pos < K:
            vals[l, pos] = vals[l, pos - 1]
            ids[l, pos] = ids[l, pos - 1]
        pos -= 1
    vals[l, pos] = v
    ids[l, pos] = t
    return min(n + 1, K)


@njit(inline="always")
def _any_above(x, thr):
    """Does any value of the 1-D x exceed thr (NaN never does)? Vectorises: no early exit."""
    hit = False
    for i in range(x.shape[0]):
        hit = hit | (x[i] > thr)
    return hit


@njit(cache=True, nogil=True)
def _top_k_rows(z, valid_vocab, ids, vals):
    """Per row of z [k, V]: the K = ids.shape[1] best ids, value descending, ties by ascending
    id; ids >= valid_vocab and NaN count as -inf. Writes ids [k, K] int64, vals [k, K] f32.

    One pass over the row in id order keeping a sorted list of K: a later id enters only if
    STRICTLY better than the current K-th (so among equal values the lower id stays), and is
    placed after every kept value >= its own (so equal values stay in ascending id order).
    Once K are kept, a chunk of TOPK_CHUNK ids is first screened with one vectorised test
    (does any value beat the K-th? NaN never does) and skipped whole when none does: the ids
    it would have offered are exactly the ones the one-by-one pass turns away (same result,
    ~10x fewer branches on a real vocab). Padding ids (-inf) can never enter a full list."""
    k, V = z.shape
    K = ids.shape[1]
    for l in range(k):
        n = 0  # kept so far
        t = 0
        while t < V:
            end = min(t + TOPK_CHUNK, V)
            if n == K:
                if t >= valid_vocab:
                    break
                end = min(end, valid_vocab)
                if not _any_above(z[l, t:end], vals[l, K - 1]):
                    t = end
                    continue
            for i in range(t, end):
                n = _topk_insert(z, l, i, valid_vocab, ids, vals, n, K)
            t = end


@njit(fastmath={"reassoc"}, cache=True, nogil=True)
def _scores_kernel(u, pi, pred, ids, A, Bc, S):
    """S[l, a, c] = u[l, c] + sum_j (A[pred[l, a], j] * pi[l, j]) * Bc[ids[l, c], j] in f32.
    u [k, K], pi [k, r], pred / ids [k, K] int64, A / Bc [V, r] uint16 (bf16 bits) or f32,
    S [k, K, K] written. The candidate rows are gathered and converted once per row l; the
    r-term sums may be reassociated (vectorised): f32 rounding, as numpy's matmul."""
    k, K = ids.shape
    r = pi.shape[1]
    left = np.empty((K, r), np.float32)  # [K(a), r] A[pred] * pi of row l
    right = np.empty((K, r), np.float32)  # [K(c), r] Bc[ids] of row l
    for l in range(k):
        for a in range(K):
            for j in range(r):
                left[a, j] = _load(A[pred[l, a], j]) * pi[l, j]
                right[a, j] = _load(Bc[ids[l, a], j])
        for a in range(K):
            for c in range(K):
                acc = np.float32(0.0)
                for j in range(r):
                    acc += left[a, j] * right[c, j]
                S[l, a, c] = u[l, c] + acc


@njit(cache=True, nogil=True)
def _walk_greedy_kernel(S, slots):
    """prev = 0; slots[l] = first argmax_c S[l, prev, c] with NaN never winning and an all
    -inf (or all NaN) row giving slot 0; prev = slots[l]. S [k, K, K], slots [k] written."""
    prev = 0
    for l in range(S.shape[0]):
        best, slot = -np.inf, 0
        for c in range(S.shape[2]):
            v = S[l, prev, c]
            if v > best:  # strict: ties keep the lower slot; NaN compares False
                best, slot = v, c
        slots[l] = slot
        prev = slot


# ---------------------------------------------------------------- the selector
class CandidateSelector:
    def __init__(self, hidden_projection: np.ndarray, predecessor_codebook: np.ndarray,
                 successor_codebook: np.ndarray, top_k: int, output_multiplier: float = 1.0,
                 softcap: float | None = None, valid_vocab: int | None = None, source: str = "selector"):
        r, H = hidden_projection.shape
        V = predecessor_codebook.shape[0]
        for name, t in (("predecessor_codebook", predecessor_codebook), ("successor_codebook", successor_codebook)):
            if t.shape != (V, r):
                raise SelectorRefusedError(
                    f"{source}: {PREFIX}{name} has shape {list(t.shape)}, expected [{V}, {r}] "
                    f"(rows = target vocab, columns = selector_rank of hidden_projection [{r}, {H}])")
        valid = V if valid_vocab is None else min(int(valid_vocab), V)
        if not 1 <= top_k <= valid:
            raise SelectorRefusedError(
                f"{source}: selector_top_k = {top_k} but the target has {valid} valid vocab ids: "
                f"top-K needs 1 <= K <= valid vocab")
        self.W_pi = as_f32(hidden_projection)  # [r, H] f32 (small: converted once)
        self.A = predecessor_codebook  # [V, r] kept as given (bf16 memmap): rows gathered per step
        self.Bc = successor_codebook  # [V, r]
        self.top_k, self.vocab_size, self.valid_vocab = int(top_k), V, valid
        self.rank, self.hidden_size = r, H
        self.output_multiplier = np.float32(output_multiplier)
        self.softcap = None if softcap is None or softcap <= 0 else np.float32(softcap)
        self.source = source

    # ---- loading and refusals
    @staticmethod
    def refusal_reason(ckpt, cfg, vocab_size: int, valid_vocab: int | None = None) -> str | None:
        """Why this checkpoint's selector cannot run faithfully, or None. `ckpt` is a
        checkpoint.Checkpoint (anything with `in`, `.info(name).dtype/.shape`, `.directory`),
        `cfg` the DraftConfig, `vocab_size` the TARGET's vocab (the codebooks are indexed by
        target ids), `valid_vocab` the ids the target may emit (tokenizer size)."""
        where = getattr(ckpt, "directory", "draft")
        missing = [n for n in TENSORS if n not in ckpt]
        if missing:
            return f"{where}: DFlash2 selector tensor(s) absent: {', '.join(missing)}"
        r, H, K = cfg.selector_rank, cfg.hidden_size, cfg.selector_top_k
        expected = {TENSORS[0]: (r, H), TENSORS[1]: (vocab_size, r), TENSORS[2]: (vocab_size, r)}
        for name, shape in expected.items():
            info = ckpt.info(name)
            if info.dtype not in FAITHFUL_DTYPES:
                return (f"{where}: {name} is {info.dtype}; the selector computes only from "
                        f"{'/'.join(FAITHFUL_DTYPES)} tensors (quantized selector not supported)")
            if tuple(info.shape) != shape:
                why = ("codebook rows must equal the target vocab_size" if "codebook" in name
                       else "[selector_rank, hidden_size]")
                return f"{where}: {name} has shape {list(info.shape)}, expected {list(shape)} ({why})"
        valid = vocab_size if valid_vocab is None else min(int(valid_vocab), vocab_size)
        if not 1 <= K <= valid:
            return (f"{cfg.source}: dflash_config.selector_top_k = {K} exceeds the target's valid "
                    f"vocab {valid}: top-K needs 1 <= K <= valid vocab")
        return None

    @classmethod
    def from_checkpoint(cls, ckpt, cfg, vocab_size: int, valid_vocab: int | None = None,
                        defer_refusal: bool = False):
        """The selector of a DFlash2 draft checkpoint. On a refusal: raise SelectorRefusedError,
        or with defer_refusal=True return a RefusedSelector that raises it at `select`."""
        reason = cls.refusal_reason(ckpt, cfg, vocab_size, valid_vocab)
        if reason is not None:
            if defer_refusal:
                return RefusedSelector(reason)
            raise SelectorRefusedError(reason)
        return cls(ckpt.get(TENSORS[0]), ckpt.get(TENSORS[1]), ckpt.get(TENSORS[2]), cfg.selector_top_k,
                   output_multiplier=cfg.output_multiplier, softcap=cfg.final_logit_softcapping,
                   valid_vocab=valid_vocab, source=str(getattr(ckpt, "directory", "selector")))

    # ---- §4.4 pieces
    def candidates(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-K of each logits row. z [k, V] -> ids [k, K] int64, values [k, K] f32.
        Order: descending value, ties by ascending id. Padding ids (>= valid_vocab) and NaN
        are -inf first; since K <= valid vocab and padding ids are the largest, a padding id
        never makes the cut (a valid -inf id wins the tie)."""
        z = np.ascontiguousarray(z, dtype=np.float32)  # [k, V]
        if z.ndim != 2 or z.shape[1] != self.vocab_size:
            raise SelectorRefusedError(
                f"{self.source}: logits have shape {list(z.shape)}, expected [k, {self.vocab_size}] "
                f"(the selector codebooks cover the target vocab {self.vocab_size})")
        k, K = z.shape[0], self.top_k
        ids = np.empty((k, K), np.int64)  # [k, K]
        vals = np.empty((k, K), np.float32)  # [k, K]
        _top_k_rows(z, self.valid_vocab, ids, vals)
        return ids, vals

    def scalars(self, v: np.ndarray) -> np.ndarray:
        """§4.3 on candidate values, f32, in this order: u = v * mult; u = cap * tanh(u / cap).
        A -inf value (masked id) stays -inf: softcap would map it to -cap and let an id the
        target head ruled out (or a padding id) compete."""
        v = np.asarray(v, dtype=np.float32)
        u = v * self.output_multiplier
        if self.softcap is not None:
            cap = self.softcap
            u = cap * np.tanh(u / cap)  # f32 in, f32 out
        return np.where(v == -np.inf, np.float32(-np.inf), u).astype(np.float32)

    def scores(self, h: np.ndarray, ids: np.ndarray, u: np.ndarray, anchor_id: int) -> np.ndarray:
        """S [k, K, K] f32 from h [k, H] (final-normed mask rows), ids/u [k, K], the anchor id."""
        h = np.asarray(h, dtype=np.float32)
        if h.shape != (ids.shape[0], self.hidden_size):
            raise SelectorRefusedError(
                f"{self.source}: mask-row states have shape {list(h.shape)}, expected "
                f"[{ids.shape[0]}, {self.hidden_size}] (hidden_projection is [{self.rank}, {self.hidden_size}])")
        pi = (h @ self.W_pi.T).astype(np.float32)  # [k, r]
        pred = np.empty_like(ids)  # [k, K] predecessor token of slot a
        pred[0] = anchor_id  # row 0 follows the anchor whatever the slot
        pred[1:] = ids[:-1]  # row l follows the token chosen from row l-1's slot a
        u = np.ascontiguousarray(u, dtype=np.float32)
        S = np.empty((ids.shape[0], self.top_k, self.top_k), np.float32)  # [k, K(a), K(c)]
        if self.A.dtype in (np.uint16, np.float32) and self.Bc.dtype == self.A.dtype:
            _scores_kernel(u, pi, np.ascontiguousarray(pred), np.ascontiguousarray(ids), self.A, self.Bc, S)
        else:  # float16 codebooks (rare): the same products in numpy
            left = as_f32(self.A[pred]) * pi[:, None, :]  # [k, K(a), r]
            right = as_f32(self.Bc[ids])  # [k, K(c), r]
            S[:] = u[:, None, :] + left @ right.transpose(0, 2, 1)
        return S

    @staticmethod
    def walk_greedy(S: np.ndarray) -> np.ndarray:
        """prev = 0; c* = argmax_c S[l, prev, c]. Ties -> lowest slot (np.argmax takes the first
        maximum), NaN never wins (-> -inf), an all -inf row -> slot 0. -> slots [k] int64."""
        slots = np.zeros(S.shape[0], np.int64)
        _walk_greedy_kernel(np.ascontiguousarray(S, dtype=np.float32), slots)
        return slots

    def walk_sampled(self, S: np.ndarray, ids: np.ndarray, temperature: float, seed: int,
                     positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gumbel-max walk: c* = argmax_c (S[l,prev,c]/T + g(seed, positions[l], ids[l,c])), which
        is an exact draw from softmax(S[l,prev,:]/T) because the g are i.i.d. standard Gumbel.
        -> slots [k] int64, q [k, V] f32 (that softmax on the K candidate ids, zero elsewhere).

        Why a keyed (seed, position, token) noise is still exact inside speculative decoding:
        the key involves neither the verifier's uniforms (they come from the loop's own rng) nor
        anything that depends on the noise, so given the committed prefix the noise is fresh. A
        rejected position is never drafted again (the next step's drafts start one past the
        correction token), positions only grow, so each position's noise reaches at most one
        committed decision; re-drafting a position that was drafted but not reached by the
        verifier reuses noise that influenced nothing emitted. Same seed, same situation ->
        same draft (reproducible), by design."""
        k, K = ids.shape
        T = np.float32(temperature)
        slots = np.zeros(k, np.int64)
        q = np.zeros((k, self.vocab_size), np.float32)  # [k, V]
        prev = 0
        for l in range(k):
            logits = (S[l, prev] / T).astype(np.float32)  # [K] f32
            logits = np.where(np.isnan(logits), np.float32(-np.inf), logits)
            if not np.isfinite(logits.max()):  # all -inf: the walk takes slot 0 deterministically
                prev = slots[l] = 0
                q[l, ids[l, 0]] = 1.0
                continue
            noise = keyed_gumbel(seed, np.int64(positions[l]), ids[l])  # [K] f64
            prev = slots[l] = int(np.argmax(logits.astype(np.float64) + noise))
            e = np.exp(logits.astype(np.float64) - logits.max())  # [K]; -inf -> 0
            q[l, ids[l]] = (e / e.sum()).astype(np.float32)
        return slots, q

    # ---- one call per draft step
    def select(self, h: np.ndarray, z: np.ndarray, anchor_id: int, positions: np.ndarray,
               sampling, rng: np.random.Generator | None = None, with_confidence: bool = False):
        """The whole §4.4 step. -> (draft_ids [k] int64, q [k, V] f32 or None, info dict), and
        with `with_confidence` a 4th item: confidence [k] f64, row l's max of softmax(S[l, prev_l]
        / T) (T = 1 when greedy), the walk's conditional top-1 probability given the earlier
        slots: it reads the distribution row l is drawn from, never the drawn slot.
        With sampling.seed None the noise seed is drawn from `rng` (one draw per step)."""
        ids, v = self.candidates(z)  # [k, K]
        u = self.scalars(v)  # [k, K]
        S = self.scores(h, ids, u, anchor_id)  # [k, K, K]
        if sampling is None or sampling.greedy:
            slots, q = self.walk_greedy(S), None
        else:
            seed = sampling.seed
            if seed is None:
                if rng is None:
                    rng = np.random.default_rng()
                seed = int(rng.integers(0, 2 ** 63))
            slots, q = self.walk_sampled(S, ids, sampling.temperature, int(seed), np.asarray(positions))
        k = ids.shape[0]
        prevs = np.concatenate([[0], slots[:-1]]).astype(np.int64)  # [k] the slot each row followed
        draft_ids = ids[np.arange(k), slots]  # [k]
        info = LazyInfo(lambda: {
            "slots": [{"candidate_ids": ids[l].tolist(), "candidate_values": u[l].tolist(),
                       "candidate_scores": S[l, prevs[l]].tolist()} for l in range(k)],
            "chosen_slots": slots.tolist(),
        })
        if not with_confidence:
            return draft_ids, q, info
        if q is not None:
            conf = q.max(axis=-1).astype(np.float64)  # [k]
        else:
            rows = S[np.arange(k), prevs].astype(np.float64)  # [k, K] the row each slot's walk read
            rows = np.where(np.isnan(rows), -np.inf, rows)
            m = rows.max(axis=-1, keepdims=True)  # [k, 1]
            with np.errstate(invalid="ignore"):
                conf = 1.0 / np.exp(rows - m).sum(axis=-1)  # [k]
            conf = np.where(np.isfinite(m[:, 0]), conf, 1.0)  # all -inf: the walk takes slot 0 surely
        return draft_ids, q, info, conf


class RefusedSelector:
    """Stands in for a selector that cannot run faithfully: the draft forward still runs, and
    the step is refused by name here, before anything is sampled (spec §4.4). Never a
    fallback to argmax drafting."""

    def __init__(self, reason: str):
        self.reason = reason
        self.notice = f"notice: the DFlash2 candidate selector will refuse every step: {reason}"

    def select(self, *args, **kwargs):
        raise SelectorRefusedError(self.reason)
