"""Small counters shared by components' ``statistics()``, counted with plain integers on the
trio thread and read by the metrics exporter at scrape time (metrics.py), so that the hot
path never takes a lock; no Prometheus here.  :func:`app_reads` is the one count of what
applications read, whichever path served it, that every operator view shows."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Protocol

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


# -- what applications read, whichever path served it ---------------------------------
#
# One count feeds every operator view (``/metrics``, ``status``, ``stats``, the dashboard;
# docs/metrics.md, "What a job reads"): a *request* is one file an application read, opened
# through the mount or handed to a DataLoader worker by cube_torch's fast path, or one sample
# the daemon's sample cache served in place of reading its files.  The paths' counters live
# in their components; the Protocols below name the figures taken from each, so this module
# imports none of them (it sits below them all).


class _MountFigures(Protocol):
    @property
    def file_requests(self) -> int: ...
    @property
    def file_misses(self) -> int: ...
    @property
    def read_bytes(self) -> int: ...
    @property
    def stall_seconds(self) -> float: ...


class _FastFigures(Protocol):
    @property
    def served_hits(self) -> int: ...
    @property
    def served_misses(self) -> int: ...
    @property
    def served_bytes(self) -> int: ...
    @property
    def served_stall(self) -> float: ...


class _SampleFigures(Protocol):
    @property
    def hits(self) -> int: ...
    @property
    def hit_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PathReads:
    """One path's requests (hits: nothing waited on the remote), bytes and stall."""

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    stall_seconds: float = 0.0

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    def as_dict(self) -> dict[str, int | float]:
        return {"requests": self.requests, "hits": self.hits, "misses": self.misses, "bytes": self.bytes,
                "stall_seconds": self.stall_seconds}


@dataclass(frozen=True, slots=True)
class AppReads:
    """What applications read, per path; every figure is a monotonic counter."""

    mount: PathReads
    fastpath: PathReads
    sample_cache: PathReads

    def by_path(self) -> dict[str, PathReads]:
        return {"mount": self.mount, "fastpath": self.fastpath, "sample_cache": self.sample_cache}

    @property
    def total(self) -> PathReads:
        return _summed(self.mount, self.fastpath, self.sample_cache)

    @property
    def files(self) -> PathReads:
        """The file requests (``file_*`` metrics, ``status``'s ``hits``): the mount's and the
        fast path's, without the sample cache's."""
        return _summed(self.mount, self.fastpath)

    def as_dict(self) -> dict[str, Any]:
        total = self.total
        return {**total.as_dict(), "hit_rate": total.hits / total.requests if total.requests else 0.0,
                "by_path": {name: p.as_dict() for name, p in self.by_path().items()}}


def _summed(*paths: PathReads) -> PathReads:
    return PathReads(sum(p.hits for p in paths), sum(p.misses for p in paths), sum(p.bytes for p in paths),
                     sum(p.stall_seconds for p in paths))


def app_reads(mount: _MountFigures, fastpath: _FastFigures | None, samples: _SampleFigures | None) -> AppReads:
    """The count from the components' statistics (None: a path this daemon does not serve).

    The mount's requests are its opens of regular files, counted at release (a file whose
    pages the kernel cached is a hit through its open); its bytes are those of the READs that
    reached the daemon, the C session's included.  The fast path counts each open a worker
    reported of a file it served; the sample cache each key a get answered with an entry, and
    never a miss: a sample it lacks is computed by reading its files, which those paths count."""
    fast = (PathReads(fastpath.served_hits, fastpath.served_misses, fastpath.served_bytes, fastpath.served_stall)
            if fastpath is not None else PathReads())
    cached = PathReads(samples.hits, 0, samples.hit_bytes) if samples is not None else PathReads()
    return AppReads(PathReads(mount.file_requests - mount.file_misses, mount.file_misses, mount.read_bytes,
                              mount.stall_seconds), fast, cached)
