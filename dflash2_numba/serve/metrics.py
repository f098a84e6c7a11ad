"""Server counters in the Prometheus text format (GET /metrics), names after vLLM's and
llama.cpp's under a `dflash2:` prefix. The engine thread updates them under one lock; the
HTTP side only renders.

    requests_running, requests_waiting                      gauges
    requests_total                                          every request that reached the engine or was refused there
    request_success_total{finished_reason}                  stop | length
    requests_rejected_total{reason}                         queue_full | draining | not_ready | invalid
    requests_cancelled_total, request_errors_total          client gone / ended by the server
    prompt_tokens_total, generation_tokens_total
    spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total,
    spec_decode_num_accepted_tokens_per_pos_total{position}
    engine_steps_total, engine_batched_steps_total          steps (those with more than one request)
    engine_step_rows_total                                  verify rows summed over steps
    time_to_first_token_seconds (histogram), step_rows (histogram: rows per verify forward)
"""

from __future__ import annotations

import threading
from collections import defaultdict

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFIX = "dflash2:"


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, x: float) -> None:
        self.sum += x
        self.count += 1
        for i, b in enumerate(self.buckets):
            if x <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    COUNTERS = ("requests_total", "requests_cancelled_total", "request_errors_total", "prompt_tokens_total",
                "generation_tokens_total", "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens_total", "engine_steps_total", "engine_batched_steps_total",
                "engine_step_rows_total")

    def __init__(self):
        self.lock = threading.Lock()
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.success = defaultdict(int)  # finished_reason -> count
        self.rejected = defaultdict(int)  # reason -> count
        self.accepted_per_pos = defaultdict(int)  # draft position -> accepted count
        self.running = self.waiting = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.step_rows = Histogram(ROW_BUCKETS)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def reject(self, reason: str) -> None:
        with self.lock:
            self.counters["requests_total"] += 1
            self.rejected[reason] += 1

    def snapshot(self) -> dict:
        """The counters as one dict (tests and the load test reconcile against it)."""
        with self.lock:
            return {**self.counters, "running": self.running, "waiting": self.waiting,
                    "success": dict(self.success), "rejected": dict(self.rejected)}

    def render(self) -> str:
        with self.lock:
            lines = [f"# TYPE {PREFIX}requests_running gauge", f"{PREFIX}requests_running {self.running}",
                     f"# TYPE {PREFIX}requests_waiting gauge", f"{PREFIX}requests_waiting {self.waiting}"]
            for name, value in self.counters.items():
                lines += [f"# TYPE {PREFIX}{name} counter", f"{PREFIX}{name} {value}"]
            labelled = (("request_success_total", "finished_reason", self.success),
                        ("requests_rejected_total", "reason", self.rejected),
                        ("spec_decode_num_accepted_tokens_per_pos_total", "position", self.accepted_per_pos))
            for name, label, values in labelled:
                lines.append(f"# TYPE {PREFIX}{name} counter")
                lines += [f'{PREFIX}{name}{{{label}="{k}"}} {v}' for k, v in sorted(values.items())]
            lines += self.ttft.lines(f"{PREFIX}time_to_first_token_seconds")
            lines += self.step_rows.lines(f"{PREFIX}step_rows")
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (comments skipped): for tests and the bench."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key.removeprefix(PREFIX)] = float(value)
    return out
