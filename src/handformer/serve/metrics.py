"""What the server counts, in Prometheus' text exposition format (``GET /metrics``).

Written out by hand (the format is a few lines of text per metric): gauges for the requests
running and waiting and the KV blocks used and free, counters for tokens, requests by how
they ended and preemptions, and two histograms — time to first token (arrival → first
token) and per-token latency (the gap between two tokens of one request). The engine's
thread records, the HTTP thread renders; a lock keeps each histogram's buckets, sum and
count consistent with one another.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

__all__ = ["Histogram", "ServerMetrics"]

PREFIX = "handformer"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative buckets (``le``), a sum and a count, as Prometheus defines a histogram."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """The engine's counters and histograms; ``render(gauges)`` adds the live gauges."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.finished: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token.",
                              TTFT_BUCKETS)
        self.per_token = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                                   "Seconds between two consecutive tokens of one request.",
                                   TOKEN_BUCKETS)

    def token(self, since_arrival: float | None, since_last: float | None) -> None:
        """One generated token: its request's first (``since_arrival``) or a later one."""
        with self._lock:
            self.tokens_generated += 1
            if since_arrival is not None:
                self.ttft.observe(since_arrival)
            if since_last is not None:
                self.per_token.observe(since_last)

    def prompt(self, tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens

    def finish(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def render(self, gauges: dict[str, tuple[str, float]],
               counters: dict[str, tuple[str, int]] | None = None) -> str:
        """The exposition text; ``gauges`` (and ``counters`` the caller keeps) map a name
        without the prefix to (help, value)."""
        lines: list[str] = []
        for name, (help_text, value) in gauges.items():
            full = f"{PREFIX}_{name}"
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} gauge", f"{full} {value:g}"]
        with self._lock:
            for name, help_text, value in (
                    ("generation_tokens_total", "Tokens generated.", self.tokens_generated),
                    ("prompt_tokens_total", "Prompt tokens admitted.", self.prompt_tokens),
                    *((n, h, v) for n, (h, v) in (counters or {}).items())):
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter",
                          f"{full} {value}"]
            for name, help_text, label, counter in (
                    ("requests_finished_total", "Requests that ended, by finish reason.",
                     "reason", self.finished),
                    ("requests_rejected_total", "Requests refused before any work, by cause.",
                     "cause", self.rejected)):
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
                lines += [f'{full}{{{label}="{key}"}} {n}' for key, n in sorted(counter.items())]
            lines += self.ttft.render() + self.per_token.render()
        return "\n".join(lines) + "\n"
