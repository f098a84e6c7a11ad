"""Decode statistics (spec §5.3).

Definitions (peers disagree, so here they are):
- a step is one target verify forward after the prefill (autoregressive: one token per step);
- acceptance length of a step = drafts accepted + 1 (the bonus / correction token), counted
  before stop-token truncation; `tau` = its mean over steps;
- acceptance_histogram[i] = number of steps whose acceptance length is i+1, for 1..Q;
- block_rows = rows verified per step (the chosen widths; 1 = a plain target step),
  width_histogram[i] = steps that verified i+1 rows; width = the rule ("fixed" | "auto"),
  drafted_steps = steps that ran the draft;
- per_position_acceptance[j] = among steps that offered a draft at slot j (0-based, i.e. a
  block of more than j+1 rows), the fraction that accepted it;
- prefill_s: the target prompt forward + first token; draft_s: drafter time (context extension
  and proposals); catch_up_steps / catch_up_draft_s: the drafted steps that fed the draft more
  than a block of context (the prompt's catch-up before its first draft, or a backlog of plain
  steps) and their draft seconds, part of draft_s; draft_s_per_step: the draft seconds of the
  other drafted steps, per step (what a drafted step costs once the context is caught up);
  verify_s: target verify forwards + acceptance; decode_s: wall time of all
  steps (draft + verify + bookkeeping); tokens_per_s = generated tokens / (prefill_s + decode_s)
  and decode_tokens_per_s = tokens after the first / decode_s;
- threads: numba threads the kernels ran with; compile_s: the CLI's first-run warm-up (kernel
  compilation), kept out of every timing above; peak_rss_mb: the process's peak resident set
  (getrusage ru_maxrss) when the CLI reports.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    block_size: int = 1  # runtime Q (1 = autoregressive)
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    block_rows: list[int] = field(default_factory=list)  # rows verified per step (Bv): the chosen widths
    width: str = "fixed"  # the verify width rule: "fixed" (min(Q, budget) rows) | "auto" (decode/width.py)
    drafted_steps: int = 0  # steps that ran the draft (auto may choose plain target steps)
    draft_window: int = 0  # the draft attends to the last N context positions (0 = all of them)
    kv_cache_bytes: int = 0  # target KV cache bytes held at the run's context (prompt + new tokens)
    kv_dtype: str = "f32"  # the KV cache's element type ("f32" | "bf16": --kv-dtype)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    catch_up_steps: int = 0  # drafted steps that fed more than a block of context (part of drafted_steps)
    catch_up_draft_s: float = 0.0  # their draft seconds (part of draft_s)
    verify_s: float = 0.0
    decode_s: float = 0.0
    baseline_tokens_per_s: float | None = None
    speedup: float | None = None
    threads: int = 1  # numba threads the kernels ran with
    compile_s: float | None = None  # first-run kernel compilation (a warm-up), not in any timing above
    peak_rss_mb: float | None = None  # the process's peak resident memory (ru_maxrss), set by the CLI

    def record_step(self, rows: int, accepted: int, drafted: bool | None = None) -> None:
        self.steps += 1
        self.drafted_steps += int(rows > 1 if drafted is None else drafted)
        self.block_rows.append(rows)
        self.acceptance_lengths.append(accepted + 1)

    @property
    def tau(self) -> float:
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else 0.0

    @property
    def acceptance_histogram(self) -> list[int]:
        hist = [0] * max(self.block_size, 1)
        for a in self.acceptance_lengths:
            hist[a - 1] += 1
        return hist

    @property
    def width_histogram(self) -> list[int]:
        """[i] = steps that verified i+1 rows (i drafts), i = 0..Q-1."""
        hist = [0] * max(self.block_size, 1)
        for r in self.block_rows:
            hist[r - 1] += 1
        return hist

    @property
    def per_position_acceptance(self) -> list[float | None]:
        rates = []
        for j in range(max(self.block_size - 1, 0)):
            offered = [a for a, r in zip(self.acceptance_lengths, self.block_rows) if r > j + 1]
            rates.append(sum(a > j + 1 for a in offered) / len(offered) if offered else None)
        return rates

    @property
    def draft_s_per_step(self) -> float | None:
        """Draft seconds per drafted step, the context catch-ups left out (None: no such step)."""
        n = self.drafted_steps - self.catch_up_steps
        return (self.draft_s - self.catch_up_draft_s) / n if n > 0 else None

    @property
    def tokens_per_s(self) -> float:
        t = self.prefill_s + self.decode_s
        return self.new_tokens / t if t > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - 1  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def set_baseline(self, baseline: "DecodeStats") -> None:
        self.baseline_tokens_per_s = baseline.tokens_per_s
        self.speedup = (self.tokens_per_s / baseline.tokens_per_s
                        if baseline.tokens_per_s > 0 else None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_histogram=self.acceptance_histogram, width_histogram=self.width_histogram,
                 per_position_acceptance=self.per_position_acceptance,
                 tokens_per_s=self.tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s,
                 draft_s_per_step=self.draft_s_per_step)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def format(self) -> str:
        """Readable multi-line block (the CLI prints it to stderr)."""
        lines = [
            f"tokens   {self.new_tokens} new ({self.prompt_tokens} prompt), {self.steps} steps, "
            f"block Q={self.block_size}",
            f"tau      {self.tau:.3f} (mean acceptance length, bonus included)",
        ]
        if self.block_size > 1:
            lines.append("accept   histogram 1..Q: " + " ".join(map(str, self.acceptance_histogram)))
            rates = " ".join("-" if r is None else f"{r:.2f}" for r in self.per_position_acceptance)
            lines.append(f"         per position: {rates}")
            if self.width != "fixed":
                lines.append(f"width    {self.width}: verify rows 1..Q: " + " ".join(map(str, self.width_histogram))
                             + f" ({self.drafted_steps} of {self.steps} steps drafted)")
        lines.append(f"time     prefill {self.prefill_s:.3f}s  decode {self.decode_s:.3f}s "
                     f"(draft {self.draft_s:.3f}s, verify {self.verify_s:.3f}s)")
        if self.catch_up_steps:
            per = self.draft_s_per_step
            lines.append(f"         draft context catch-up {self.catch_up_draft_s:.3f}s in {self.catch_up_steps} step"
                         + ("s" if self.catch_up_steps != 1 else "")
                         + ("" if per is None else f"; other drafted steps {1e3 * per:.1f} ms each"))
        lines.append(f"speed    {self.tokens_per_s:.1f} tok/s overall, "
                     f"{self.decode_tokens_per_s:.1f} tok/s decode, {self.threads} thread"
                     + ("s" if self.threads != 1 else ""))
        if self.compile_s is not None:
            lines.append(f"compile  {self.compile_s:.1f}s first-run kernel compilation (not in the times above)")
        if self.kv_cache_bytes:
            lines.append(f"kv cache {self.kv_cache_bytes / 2**20:.1f} MiB at {self.prompt_tokens + self.new_tokens} "
                         f"positions ({self.kv_dtype} K and V)"
                         + (f"; draft window {self.draft_window}" if self.draft_window else ""))
        if self.peak_rss_mb is not None:
            lines.append(f"memory   {self.peak_rss_mb:.0f} MB peak resident (weights, caches, kernels)")
        if self.baseline_tokens_per_s is not None:
            sp = "n/a" if self.speedup is None else f"{self.speedup:.2f}x"
            lines.append(f"baseline {self.baseline_tokens_per_s:.1f} tok/s autoregressive, speedup {sp}")
        return "\n".join(lines)


def peak_rss_mb() -> float:
    """The process's peak resident memory in MB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024
