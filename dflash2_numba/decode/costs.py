"""The cost table of the adaptive verify width (decode/width.py, docs/adaptive_width.md):
c(rows) = seconds of a target verify of 1..B rows, D = seconds of a draft step, f = seconds per
context row fed to the draft (its catch-up), measured once by a short timed sweep, cached on
disk beside the kernel cache, refreshed online from real step times.

    costs = costs_for(target, draft, B)   # CostTable: this process's, else the disk cache, else a sweep
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------- the cost table
SWEEP_RECIPE = 5  # bump when measure_costs times something else (cached tables are then re-measured)
CLIP = 1.5  # an online sample counts as at most 1.5x (at least 1/1.5x) the current estimate


@dataclass
class CostTable:
    """verify_s[r-1] = seconds of a target verify of r rows (r = 1..B), draft_s = seconds of
    one draft step (context update of the last step's tokens + the B-row proposal). `sweep_*`
    keep the measured values; `verify_s` / `draft_s` are refreshed online from real step times
    (`observe_*`): per row count an exponential average of (measured - swept), and for counts
    not seen yet the same average over all counts (the per-step overhead the sweep does not
    time: sampling, acceptance, bookkeeping). Samples are clipped to CLIP x the estimate, so one
    step slowed by a burst of load moves it by a few per cent only."""
    verify_s: np.ndarray  # [B] f64
    draft_s: float
    source: str = "sweep"  # "sweep" | "cache" | "injected"
    sweep_s: float = 0.0  # seconds the sweep took (0 when read from the cache)
    sweep_verify_s: np.ndarray = field(default=None, repr=False)
    sweep_draft_s: float = 0.0
    feed_s: float = 0.0  # seconds per context row fed to the draft (its catch-up); 0: unknown

    def __post_init__(self):
        # more rows never cost less: each count takes the cheapest time measured at it or above,
        # so one count slowed by a burst of load does not lift every count after it
        v = np.minimum.accumulate(np.asarray(self.verify_s, np.float64)[::-1])[::-1].copy()
        if v.ndim != 1 or len(v) < 1 or not np.all(np.isfinite(v)) or v.min() < 0:
            raise ValueError(f"verify costs must be a finite non-negative [B] vector, got {self.verify_s!r}")
        self.verify_s = v
        self.draft_s = float(self.draft_s)
        if self.sweep_verify_s is None:
            self.sweep_verify_s, self.sweep_draft_s = v.copy(), self.draft_s
        # the online state on Python floats (a plain decode step refreshes it: a few us in numpy)
        self._sweep = self.sweep_verify_s.tolist()
        self._off = [0.0] * len(v)  # per row count: average (measured - swept)
        self._seen = [False] * len(v)
        self._off_all = 0.0  # the same over every observation
        self.verify_list = v.tolist()  # verify_s as Python floats, for the width rule's per-step arithmetic

    @property
    def B(self) -> int:
        return len(self.verify_s)

    def frozen(self) -> "CostTable":
        """The measured values only (no online refresh seen): a seeded sampled run reads these,
        so that it draws the same tokens whatever ran before it in this process."""
        return CostTable(self.sweep_verify_s.copy(), self.sweep_draft_s, self.source, self.sweep_s,
                         feed_s=self.feed_s)

    def observe_verify(self, rows: int, seconds: float, weight: float = 0.1) -> None:
        i = rows - 1
        cur = self.verify_list[i]
        if cur > 0:
            seconds = min(max(seconds, cur / CLIP), cur * CLIP)
        delta = seconds - self._sweep[i]
        off, seen = self._off, self._seen
        if not seen[i]:
            off[i], seen[i] = self._off_all, True
        off[i] += weight * (delta - off[i])
        self._off_all += weight * (delta - self._off_all)
        live, top, rest = [], 0.0, self._off_all  # live costs: swept + offset, >= 0, non-decreasing
        for c, o, s in zip(self._sweep, off, seen):  # comparisons, not max(): this runs after every step
            x = c + (o if s else rest)
            if x > top:
                top = x
            live.append(top)
        self.verify_list = live
        self.verify_s[:] = live

    def observe_draft(self, seconds: float, weight: float = 0.1) -> None:
        if self.draft_s > 0:
            seconds = min(max(seconds, self.draft_s / CLIP), self.draft_s * CLIP)
        self.draft_s += weight * (seconds - self.draft_s)

    def to_json(self) -> dict:
        return {"verify_s": [float(x) for x in self.sweep_verify_s], "draft_s": self.sweep_draft_s,
                "feed_s": self.feed_s}


def sweep_rows(B: int) -> list[int]:
    """Row counts the sweep times (the rest interpolated): every count up to 8, then a few."""
    return sorted({r for r in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, B) if r <= B})


def interpolate(points: dict[int, float], B: int) -> np.ndarray:
    """Seconds per row count 1..B, linear between measured counts."""
    rows = sorted(points)
    return np.interp(np.arange(1, B + 1), rows, [points[r] for r in rows])


def measure_costs(target, draft, B: int, context: int = 32, reps: int = 3, budget_s: float = 1.0,
                  rows: int | None = None) -> CostTable:
    """Time verify steps (the target forward and the acceptance on its logits, as the decode loop
    times them) of each sweep row count 1..`rows` (default B; the server's batch budget sweeps
    max_running x B rows: decode/batch_width.py) after a `context`-token prefix, each in the
    order the loop runs it: one row in a run of one-row verifies, wider counts right after a
    draft step (the draft's B-row proposal, itself timed after a verify: D). Per context row,
    the draft's catch-up (the prefix fed to a fresh draft state: f). The minimum of up to `reps`
    rounds, interleaved so that load hits every count alike; rounds after the first stop once
    `budget_s` is spent, so a big model's sweep stays short. One verify step of 1 and of B rows
    and one proposal run untimed first (kernels already compiled by then, or compiled now)."""
    from .drafter import valid_vocab
    from .sampling import SamplingParams, mask_padded, verify_block
    from .step import check_finite

    t_start = time.perf_counter()
    R = int(rows or B)
    vocab = max(2, min(int(getattr(target, "valid_vocab", None) or target.config.vocab_size),
                       target.config.vocab_size))
    limit = getattr(target.config, "max_position_embeddings", None) or 1 << 30
    context = max(1, min(context, limit - R - 1))
    ids = (np.arange(1, context + R + 1) % vocab).astype(np.int64)
    taps_layers = tuple(draft.target_layer_ids)
    cache = target.new_cache(context + R + 1)
    _, taps = target.forward(ids[:context], cache, tap_layers=taps_layers)  # the prefix
    counts = sweep_rows(R)
    best = {r: np.inf for r in counts}
    d_best = f_best = np.inf
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    n_new = min(2, context)  # a step's context update: its accepted tokens + the bonus (about 2)

    def part(a, b):
        return None if taps is None else taps[a:b]

    def draft_state():
        """A fresh draft state holding the prefix but its last n_new tokens -> (state, seconds per
        row of feeding that prefix: the catch-up price f)."""
        st = draft.new_state(context + B + 1)
        t0 = time.perf_counter()
        if context > n_new:
            draft.extend_context(st, part(0, context - n_new), 0, ids[:context - n_new])
        return st, (time.perf_counter() - t0) / max(1, context - n_new)

    def draft_step(st) -> float:
        """One draft step on that state: the last n_new tokens' context update and the B-row proposal."""
        t0 = time.perf_counter()
        draft.extend_context(st, part(context - n_new, context), context - n_new, ids[context - n_new:context])
        draft.propose(st, int(ids[context]), context, B, greedy, rng)
        return time.perf_counter() - t0

    def verify_step(r: int) -> float:
        """What the decode loop times as a verify of r rows (decode/step.py, t1 -> t2): the
        forward, then the acceptance on its logits (finite check, masking, greedy acceptance of
        r - 1 drafts) and the cache commit. The acceptance is a per-step cost the forward alone
        misses (~20 us on the embedded pair, 10-15 % of its one-row step). -> seconds."""
        t0 = time.perf_counter()
        logits, _ = target.forward(ids[context:context + r], cache, tap_layers=taps_layers)  # [r, V]
        check_finite(logits, "cost sweep", context)
        verify_block(mask_padded(logits, vv), ids[context + 1:context + r], None, greedy, rng)
        cache.commit(context)  # (the sweep keeps the prefix only; a step commits start + a + 1)
        return time.perf_counter() - t0

    # Each count is timed in the order the decode loop runs it, because the two models evict
    # each other's code and data: one-row verifies in a row (a run of plain steps), every wider
    # verify right after a draft step, which itself follows a verify. On the embedded pair (Zen 5
    # VM) the first one-row forward after a draft step took ~1.2x the fourth in a row, and the
    # sweep's one-row time, taken once right after its draft step, read 1.3-1.7x the plain steps
    # of a decode: `auto` then drafted where plain steps were faster (docs/adaptive_width.md).
    vv = valid_vocab(target)
    for r in (1, R):  # untimed
        verify_step(r)
    draft_step(draft_state()[0])
    t_timed = time.perf_counter()
    for rep in range(1, reps + 1):
        if rep > 1 and time.perf_counter() - t_timed > budget_s:
            break
        for r in counts:
            if r == 1:
                verify_step(1)  # untimed: the step before
                best[1] = min(best[1], verify_step(1), verify_step(1), verify_step(1))
                continue
            st, f = draft_state()
            verify_step(1)  # untimed: the verify a draft step follows
            d = draft_step(st)
            best[r] = min(best[r], verify_step(r))
            d_best, f_best = min(d_best, d), min(f_best, f)
    return CostTable(interpolate(best, R), d_best, "sweep", time.perf_counter() - t_start, feed_s=f_best)


def _identity(target, draft, B: int, threads: int, rows: int) -> dict | None:
    """What the cost table depends on: model files, weight format, run mode, threads, the
    instruction-set path and CPU. None for models without a directory (test doubles)."""
    tdir = getattr(getattr(target, "checkpoint", None), "directory", None)
    ddir = getattr(getattr(draft, "checkpoint", None), "directory", None)
    if tdir is None or ddir is None:
        return None
    from .. import __version__
    from ..kernels import isa

    def files(d) -> list:  # a model rewritten in place gets a new table
        d = Path(d)
        return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns]
                      for p in [*d.glob("*.safetensors"), d / "config.json"] if p.is_file())

    info = isa.describe()
    return {"target": str(Path(tdir).resolve()), "draft": str(Path(ddir).resolve()),
            "files": [files(tdir), files(ddir)],
            "target_format": str(getattr(target.ops, "quantize", None)),
            "draft_format": str(getattr(getattr(draft, "ops", None), "quantize", None)),
            "dtype": str(getattr(target, "dtype", None)), "kv_dtype": str(getattr(target, "kv_dtype", "f32")),
            "device": str(getattr(target.ops, "device", None)),
            "threads": int(threads), "B": int(B), "rows": int(rows), "isa": info["isa"], "cpu": info["cpu_name"],
            "version": __version__, "sweep": SWEEP_RECIPE}


def cost_cache_dir() -> Path:
    """Beside numba's kernel cache (the fused kernel's cache directory, which NUMBA_CACHE_DIR
    moves); DFLASH2_COST_CACHE overrides it."""
    env = os.environ.get("DFLASH2_COST_CACHE")
    if env:
        return Path(env).expanduser()
    try:
        from ..kernels.fused import kernel_variants

        return Path(kernel_variants()[0]._cache._cache_path) / "dflash2_costs"
    except Exception:  # no numba cache path (e.g. a cache locator numba could not set up)
        from ..default import cache_root

        return cache_root() / "costs"


def _cache_file(ident: dict) -> Path:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return cost_cache_dir() / f"costs-{key}.json"


def _read_cached(path: Path, ident: dict, rows: int) -> CostTable | None:
    try:
        raw = json.loads(path.read_text())
        if raw.get("identity") != ident:
            return None
        v, d, f = np.asarray(raw["verify_s"], np.float64), float(raw["draft_s"]), float(raw["feed_s"])
        if v.shape != (rows,) or not f >= 0:
            return None
        return CostTable(v, d, "cache", feed_s=f)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, truncated or from another layout: measure again


def _write_cached(path: Path, ident: dict, table: CostTable) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"identity": ident, **table.to_json()}, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only cache: measured again next time


def costs_for(target, draft, B: int, rows: int | None = None) -> CostTable:
    """The pair's cost table for B-row blocks (verify counts 1..`rows`, default B) at the
    current thread count: this process's copy
    (kept on the draft, refreshed online by every auto run), else the disk cache, else a sweep
    (then written to the cache)."""
    import numba

    threads = numba.get_num_threads()
    memo = getattr(draft, "_width_costs", None)
    if memo is None:
        memo = {}
        try:
            draft._width_costs = memo
        except AttributeError:
            pass
    rows = int(rows or B)
    key = (int(B), threads, rows)
    if key in memo:
        return memo[key]
    ident = _identity(target, draft, B, threads, rows)
    table = _read_cached(_cache_file(ident), ident, rows) if ident is not None else None
    if table is None:
        table = measure_costs(target, draft, B, rows=rows)
        if ident is not None:
            _write_cached(_cache_file(ident), ident, table)
    memo[key] = table
    return table
