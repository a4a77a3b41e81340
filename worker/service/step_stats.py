"""Per-step engine figures for ``/metrics``: fixed-bucket histograms and counters, written by the
engine loop thread once per step (a few integer adds and three bisects, no lock, no prometheus
object); the worker's metrics collector reads them when Prometheus scrapes."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class FixedHistogram:
    """A histogram with fixed upper bounds, for one writer thread; readers get a consistent-enough
    snapshot (the count is derived from the buckets, so count and +Inf always agree)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        counts, total = list(self.counts), self.sum
        out, acc = [], 0
        for bound, n in zip((*map(_le, self.bounds), "+Inf"), counts, strict=True):
            acc += n
            out.append((bound, acc))
        return out, total


def _le(bound: float) -> str:
    return repr(float(bound))


class StepStats:
    """The process's step counters, written by the engine loop thread: ``start`` when a work step
    begins (the canary's are not counted), ``observe`` when it finished. The engine's own counters
    restart with every rebuilt engine; these keep counting across rebuilds, and they are the only
    lifetime step counters (``/stats`` and ``/metrics`` both read them)."""

    def __init__(self) -> None:
        self.num_started = 0  # work steps started, finished or not: numbers the steps (faults)
        self.num_started_seqs = 0  # sequences over those steps
        self.step_seconds = FixedHistogram(STEP_SECONDS_BUCKETS)
        self.batch_size = FixedHistogram(BATCH_SIZE_BUCKETS)
        self.step_tokens = FixedHistogram(STEP_TOKENS_BUCKETS)
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0
        self._gen: int | None = None
        self._prev = (0, 0, 0)

    def start(self, num_seqs: int) -> int:
        """A work step of ``num_seqs`` sequences begins; returns its 1-based number in this process."""
        self.num_started += 1
        self.num_started_seqs += num_seqs
        return self.num_started

    @property
    def num_step_tokens(self) -> int:
        """Tokens (prefill and decode) over the steps that finished."""
        return int(self.step_tokens.sum)

    def observe(self, gen: int, seconds: float, stats: dict[str, Any]) -> None:
        """One finished step of engine generation ``gen``; ``stats`` is that engine's ``stats()``."""
        self.step_seconds.observe(seconds)
        self.batch_size.observe(stats["last_step_num_seqs"])
        self.step_tokens.observe(stats["last_step_num_tokens"])
        cur = (stats["num_preemptions"], stats["prefix_cache_hit_tokens"], stats["prefix_cache_query_tokens"])
        prev = self._prev if gen == self._gen else (0, 0, 0)  # a new engine counts from zero
        self._gen, self._prev = gen, cur
        self.num_preemptions += cur[0] - prev[0]
        self.prefix_cache_hit_tokens += cur[1] - prev[1]
        self.prefix_cache_query_tokens += cur[2] - prev[2]
