"""Small counters shared by components' ``statistics()``, counted with plain integers on the
trio thread and read by the metrics exporter at scrape time (metrics.py), so that the hot
path never takes a lock; no Prometheus here."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Backend latency buckets in seconds: 50 µs (a local NVMe read) up to 10 s (a stuck
# remote).  300 µs and 2 ms, the distributed-FS and object-storage round trips, fall on
# bucket edges so the dashboard can tell them apart.
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005,
    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    cumulative_counts: tuple[int, ...]  # one per bound, then +Inf
    total: float

    @property
    def count(self) -> int:
        return self.cumulative_counts[-1]


class LatencyHistogram:
    """A fixed-bucket histogram (Prometheus semantics: cumulative at snapshot time)."""

    __slots__ = ("_counts", "_sum")

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        cumulative = []
        running = 0
        for count in self._counts:
            running += count
            cumulative.append(running)
        return HistogramSnapshot(LATENCY_BUCKETS, tuple(cumulative), self._sum)
