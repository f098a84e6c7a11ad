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
SWEEP_RECIPE = 8  # bump when measure_costs times something else (cached tables are then re-measured)
SMALL_BLOCKS = (4, 8)  # smaller runtime draft blocks the sweep times (those below the draft's B)
PLAIN_RUN = 8  # one-row verifies in a row per sweep round (c(1): the last half's, the target's caches refilled)
CLIP = 1.5  # an online sample counts as at most 1.5x (at least 1/1.5x) the current estimate


@dataclass
class CostTable:
    """verify_s[r-1] = seconds of a target verify of r rows (r = 1..B), draft_s = seconds of
    one draft step (context update of the last step's tokens + the B-row proposal). `sweep_*`
    keep the measured values; `verify_s` / `draft_s` are refreshed online from real step times
    (`observe_*`): per row count an exponential average of (measured - swept), and for wider
    counts not seen yet the same average over the wider counts seen (what a verify right after
    a draft step costs beyond the sweep's). A one-row verify (a plain step) learns only from
    its own samples: it runs in a plain run, not after a draft step, and a drafted verify's
    extra, lent to c(1), made plain steps look dearer than they were and `auto` draft where
    they were faster (docs/adaptive_width.md). Until a wider count or a draft step has been
    timed, they follow c(1) in proportion (the host faster or slower than at the sweep: plain
    steps alone must not make drafting look cheaper). Samples are clipped to CLIP x the
    estimate, so one step slowed by a burst of load moves it by a few per cent only; each count's
    first samples are averaged with the sweep's value as one sample among them (weight 1/2,
    1/3, ... down to the exponential weight), so the table reaches the decode's costs within a few
    steps."""
    verify_s: np.ndarray  # [B] f64
    draft_s: float
    source: str = "sweep"  # "sweep" | "cache" | "injected"
    sweep_s: float = 0.0  # seconds the sweep took (0 when read from the cache)
    sweep_verify_s: np.ndarray = field(default=None, repr=False)
    sweep_draft_s: float = 0.0
    feed_s: float = 0.0  # seconds per context row fed to the draft (its catch-up); 0: unknown
    # {q: seconds} of a draft step of q < B rows (a smaller runtime block: the proposal is cheaper,
    # fewer drafts to verify); live values keep the swept ratio to draft_s (`draft_for`)
    draft_rows: dict = field(default_factory=dict)

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
        self._off_all = 0.0  # the same over every observation of a wider count (rows >= 2)
        self._draft_seen = False  # draft_s refreshed from a draft step (else it follows c(1))
        self._n = [0] * len(v)  # observations per row count, and of draft steps: the first few
        self._n_draft = 0  # are averaged plainly (the sweep's values can be 10-30 % off a decode's)
        self.verify_list = v.tolist()  # verify_s as Python floats, for the width rule's per-step arithmetic

    @property
    def B(self) -> int:
        return len(self.verify_s)

    def frozen(self) -> "CostTable":
        """The measured values only (no online refresh seen): a seeded sampled run reads these,
        so that it draws the same tokens whatever ran before it in this process."""
        return CostTable(self.sweep_verify_s.copy(), self.sweep_draft_s, self.source, self.sweep_s,
                         feed_s=self.feed_s, draft_rows=dict(self.draft_rows))

    def draft_for(self, rows: int) -> float:
        """Seconds of a draft step of `rows` rows: draft_s (the full block) unless the sweep timed
        that smaller block, then its swept time scaled as draft_s has moved since the sweep."""
        d = self.draft_rows.get(rows)
        if d is None or self.sweep_draft_s <= 0:
            return self.draft_s
        return d * (self.draft_s / self.sweep_draft_s)

    def without_backlog(self, seconds: float, rows: int) -> float | None:
        """A draft step's seconds without the `rows` context rows it fed past one block (a prompt,
        or a run of plain steps' backlog: the price of resuming, not of drafting), at feed_s a
        row; None where that price is unknown (feed_s 0)."""
        if rows <= 0:
            return seconds
        return max(0.0, seconds - rows * self.feed_s) if self.feed_s > 0 else None

    def draft_choices(self, B: int) -> list[int]:
        """The runtime draft blocks to choose from: the timed smaller ones and B."""
        return sorted({q for q in self.draft_rows if 2 <= q < B} | {int(B)})

    def observe_verify(self, rows: int, seconds: float, weight: float = 0.1) -> None:
        i = rows - 1
        self._n[i] += 1
        weight = max(weight, 1.0 / (1 + self._n[i]))  # the sweep counts as one sample
        cur = self.verify_list[i]
        if cur > 0:
            seconds = min(max(seconds, cur / CLIP), cur * CLIP)
        delta = seconds - self._sweep[i]
        off, seen = self._off, self._seen
        if not seen[i]:
            off[i], seen[i] = (self._off_all if i else 0.0), True
        off[i] += weight * (delta - off[i])
        if i:
            self._off_all += weight * (delta - self._off_all)
        sw0 = self._sweep[0]
        drift = (sw0 + off[0]) / sw0 if seen[0] and sw0 > 0 else 1.0  # c(1) now / at the sweep
        wide = any(seen[1:])
        live, top, rest = [], 0.0, self._off_all  # live costs: swept + offset, >= 0, non-decreasing
        for j, (c, o, s) in enumerate(zip(self._sweep, off, seen)):  # comparisons, not max(): per step
            x = c + o if s else c if not j else c + rest if wide else c * drift
            if x > top:
                top = x
            live.append(top)
        self.verify_list = live
        self.verify_s[:] = live
        if not self._draft_seen:
            self.draft_s = self.sweep_draft_s * drift

    def observe_draft(self, seconds: float, weight: float = 0.1, rows: int | None = None) -> None:
        """A draft step's seconds (of `rows` rows: a smaller block counts at its swept ratio)."""
        d = self.draft_rows.get(rows)
        if d:
            seconds *= self.sweep_draft_s / d
        self._draft_seen = True
        self._n_draft += 1
        weight = max(weight, 1.0 / (1 + self._n_draft))  # the sweep counts as one sample
        if self.draft_s > 0:
            seconds = min(max(seconds, self.draft_s / CLIP), self.draft_s * CLIP)
        self.draft_s += weight * (seconds - self.draft_s)

    def to_json(self, live: bool = False) -> dict:
        """The swept values, or with `live` the refreshed ones (what a decode measured)."""
        v, d = (self.verify_s, self.draft_s) if live else (self.sweep_verify_s, self.sweep_draft_s)
        rows = {str(q): float(self.draft_for(q) if live else x) for q, x in self.draft_rows.items()}
        return {"verify_s": [float(x) for x in v], "draft_s": float(d), "feed_s": self.feed_s, "draft_rows": rows}

    def save(self) -> bool:
        """Write the refreshed costs back to the disk cache this table came from (costs_for),
        once a decode has timed a plain step and a drafted one: the next process starts from
        what decodes measured here, not from the sweep again. A one-shot command (the README's)
        otherwise paid its first re-test and drafting stretch every run before the table
        learned that drafting did not pay on that host (docs/adaptive_width.md). -> written."""
        where = getattr(self, "_cache", None)
        if where is None or not (self._seen[0] and self._draft_seen):
            return False
        _write_cached(where[0], where[1], self, live=True)
        return True


def sweep_rows(B: int) -> list[int]:
    """Row counts the sweep times (the rest interpolated): every count up to 8, then a few."""
    return sorted({r for r in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, B) if r <= B})


def interpolate(points: dict[int, float], B: int) -> np.ndarray:
    """Seconds per row count 1..B, linear between measured counts."""
    rows = sorted(points)
    return np.interp(np.arange(1, B + 1), rows, [points[r] for r in rows])


def measure_costs(target, draft, B: int, context: int = 32, reps: int = 8, budget_s: float = 1.0,
                  rows: int | None = None) -> CostTable:
    """Time verify steps (the target forward and the acceptance on its logits, as the decode loop
    times them) of each sweep row count 1..`rows` (default B; the server's batch budget sweeps
    max_running x B rows: decode/batch_width.py) and draft steps (the pending rows' context
    update + the B-row proposal: D; the same with the smaller runtime blocks of SMALL_BLOCKS:
    draft_rows) in a short decode after a `context`-token prefix: one cache
    and one draft state that grow as a decode's do, each count in the order the loop runs it
    (one row in a run of one-row verifies, wider counts right after a draft step, each draft
    step right after a wider verify). Per context row, the draft's catch-up (the prefix fed to a
    fresh draft state: f). The median over up to `reps` rounds, interleaved so that load hits
    every count alike; rounds after the first stop once `budget_s` is spent, so a big model's
    sweep stays short. One draft step and one B-row verify run untimed first (kernels already
    compiled by then, or compiled now)."""
    from .drafter import valid_vocab
    from .sampling import SamplingParams, mask_padded, verify_block
    from .step import check_finite

    t_start = time.perf_counter()
    R = int(rows or B)
    vocab = max(2, min(int(getattr(target, "valid_vocab", None) or target.config.vocab_size),
                       target.config.vocab_size))
    limit = getattr(target.config, "max_position_embeddings", None) or 1 << 30
    counts = sweep_rows(R)
    n_new = 2  # a drafted step's commit: its accepted tokens + the bonus (about 2)
    small = [q for q in SMALL_BLOCKS if q < B]  # the smaller runtime draft blocks to time
    per_round = PLAIN_RUN + 1 + n_new * (len(counts) + len(small))  # positions one round commits (below)
    context = max(n_new + 1, min(context, limit - R - 1 - (2 + n_new) - per_round))
    reps = max(1, min(reps, (limit - context - R - 1 - (2 + n_new)) // per_round))
    room = context + (2 + n_new) + reps * per_round + R + 1  # the prefix, the untimed steps, every round
    ids = (np.arange(1, room + 1) % vocab).astype(np.int64)
    taps_layers = tuple(draft.target_layer_ids)
    cache = target.new_cache(room)
    _, taps = target.forward(ids[:context], cache, tap_layers=taps_layers)  # the prefix
    times = {r: [] for r in counts}  # seconds per count, every round's
    d_times, f_best = [], np.inf
    d_small = {q: [] for q in small}
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    vv = valid_vocab(target)

    def part(t, a, b):
        return None if t is None else t[a:b]

    for _ in range(2):  # f: a fresh draft state fed the prefix but its last n_new rows (the catch-up price)
        st = draft.new_state(room)
        t0 = time.perf_counter()
        draft.extend_context(st, part(taps, 0, context - n_new), 0, ids[:context - n_new])
        f_best = min(f_best, (time.perf_counter() - t0) / (context - n_new))
    # the decode in progress: the anchor at `pos` (= cache.length); the committed rows the draft
    # has not seen yet start at pending[1] (their taps: pending[0], pieces joined at the next step)
    pos, pending = context, ([part(taps, context - n_new, context)], context - n_new)

    def draft_step(q: int = B) -> float:
        """One draft step as the loop runs it: the pending rows' context update, the q-row proposal."""
        nonlocal pending
        pieces, start = pending
        joined = None if pieces[0] is None else pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        t0 = time.perf_counter()
        draft.extend_context(st, joined, start, ids[start:pos])
        draft.propose(st, int(ids[pos]), pos, q, greedy, rng)
        seconds = time.perf_counter() - t0
        pending = ([], pos)
        return seconds

    def verify_step(r: int, keep: int) -> float:
        """What the decode loop times as a verify of r rows (decode/step.py, t1 -> t2): the
        forward, then the acceptance on its logits (finite check, masking, greedy acceptance of
        r - 1 drafts) and the cache commit of `keep` rows (the anchor and keep - 1 drafts). The
        acceptance is a per-step cost the forward alone misses (~20 us on the embedded pair,
        10-15 % of its one-row step). -> seconds."""
        nonlocal pos
        t0 = time.perf_counter()
        logits, tp = target.forward(ids[pos:pos + r], cache, tap_layers=taps_layers)  # [r, V]
        check_finite(logits, "cost sweep", pos)
        verify_block(mask_padded(logits, vv), ids[pos + 1:pos + r], None, greedy, rng)
        cache.commit(pos + keep)
        seconds = time.perf_counter() - t0
        pending[0].append(part(tp, 0, keep))
        pos += keep
        return seconds

    # Each count is timed as a decode runs it, on one growing cache and one draft state, because
    # the two models evict each other's code and data: c(1) in a run of one-row verifies (a
    # plain run), every wider count right after a draft step, and D right after a wider verify
    # (a drafting run). On the embedded pair (Zen 5 VM) the first one-row forward after a draft
    # step took ~1.2x the fourth in a row: c(1) timed right after a draft step (recipe <= 4) read
    # 1.3-1.7x the plain steps of a decode, and `auto` drafted where plain steps were faster. D
    # timed on a fresh draft state just fed its prefix (recipe <= 6) read 15-30 % under the
    # draft steps of a fixed-width decode (docs/adaptive_width.md).
    draft_step()  # untimed: kernels already compiled by now (or compiled here)
    verify_step(R, n_new)
    t_timed = time.perf_counter()
    for rep in range(1, reps + 1):
        if rep > 1 and time.perf_counter() - t_timed > budget_s:
            break
        for r in counts:
            if r == 1:  # a plain run: its first steps, the target's caches filling again, are not c(1)'s
                runs = [verify_step(1, 1) for _ in range(PLAIN_RUN)]
                times[1] += runs[PLAIN_RUN // 2:]
                draft_step()  # untimed: resuming (the plain run's backlog) after the plain run
                verify_step(R, 1)  # untimed: the verify a drafting run's draft step follows
                continue
            d_times.append(draft_step())
            times[r].append(verify_step(r, n_new))
        for q in small:  # a smaller block's proposal, in the same place of a drafting run
            d_small[q].append(draft_step(q))
            verify_step(q, n_new)  # untimed: the verify it is followed by
    # the median of each count's samples: robust to a burst of load, and alike for counts
    # timed more or less often (the minimum of D's many samples read under a decode's typical D)
    med = {r: float(np.median(v)) for r, v in times.items()}
    return CostTable(interpolate(med, R), float(np.median(d_times)), "sweep", time.perf_counter() - t_start,
                     feed_s=f_best, draft_rows={q: float(np.median(v)) for q, v in d_small.items()})


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
        q = {int(k): float(x) for k, x in raw["draft_rows"].items()}
        if v.shape != (rows,) or not f >= 0 or not all(x > 0 for x in q.values()):
            return None
        return CostTable(v, d, "cache", feed_s=f, draft_rows=q)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, truncated or from another layout: measure again


def _write_cached(path: Path, ident: dict, table: CostTable, live: bool = False) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"identity": ident, **table.to_json(live)}, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only cache: measured again next time


def costs_for(target, draft, B: int, rows: int | None = None) -> CostTable:
    """The pair's cost table for B-row blocks (verify counts 1..`rows`, default B) at the
    current thread count: this process's copy
    (kept on the draft, refreshed online by every auto run), else the disk cache, else a sweep
    (then written to the cache). A one-request decode writes its refreshed table back
    (`CostTable.save`, decode/loop.py)."""
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
    if ident is not None:
        table._cache = (_cache_file(ident), ident)  # where `save` writes the refreshed costs
    memo[key] = table
    return table
