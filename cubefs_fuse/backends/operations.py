"""A backend's operations in worker threads, counted and timed: :class:`Operations` runs
each blocking call of a backend (the directory backend's syscalls, the S3 backend's
requests) in a thread under one ``trio.CapacityLimiter`` (probes under their own limiter
of one), abandoned on cancellation (``backends/workers.py``) and counted while it still
runs, and keeps per operation kind the counts, errors (logged once per file), bytes read
and latency histograms that :meth:`Operations.statistics` hands to the metrics."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from cubefs_fuse.backends.base import BackendStatistics
from cubefs_fuse.backends.workers import run_abandonable
from cubefs_fuse.stats import LatencyHistogram

log = logging.getLogger(__name__)
T = TypeVar("T")

# Distinct files whose errors are logged individually; past this many the log says so
# once and stays quiet (the counters keep counting).  Bounds memory under an error storm.
MAX_LOGGED_ERROR_FILES = 10_000


@dataclass
class Counters:
    operations: dict[str, int] = field(default_factory=dict)
    errors: dict[tuple[str, int], int] = field(default_factory=dict)
    bytes_read: int = 0
    latency: dict[str, LatencyHistogram] = field(default_factory=dict)


class ErrorLog:
    """Logs a backend error once per file, counts every one."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._saturated = False

    def report(self, op: str, path: str, exc: OSError) -> None:
        if path in self._seen or self._saturated:
            return
        if len(self._seen) >= MAX_LOGGED_ERROR_FILES:
            self._saturated = True
            log.warning("backend errors on more than %d files; further files are not logged "
                        "individually (see cubefs_fuse_backend_errors_total)", MAX_LOGGED_ERROR_FILES)
            return
        self._seen.add(path)
        log.warning("backend %s of %r failed: %s (logged once per file)", op, path, os.strerror(exc.errno or errno.EIO))


class _Call:
    """One worker-thread call, to count threads whose caller gave up on them."""

    __slots__ = ("running", "abandoned")

    def __init__(self) -> None:
        self.running = False
        self.abandoned = False


class Operations:
    """Worker threads, counters and the error log of one backend (see module doc)."""

    def __init__(self, threads: int) -> None:
        self.limiter = trio.CapacityLimiter(threads)
        # One probe at a time, in its own thread: a probe stuck on a hung remote keeps this
        # token, so later probes wait for it (under their caller's deadline) instead of
        # piling up threads, and the operation threads' limit is never taken by probes.
        self.probe_limiter = trio.CapacityLimiter(1)
        self.counters = Counters()
        self.errors = ErrorLog()
        self._calls_lock = threading.Lock()
        self.abandoned = 0

    async def thread(self, fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
        """``fn`` in a worker thread; on cancellation the thread is abandoned (and counted
        until it returns; one that has not started yet never runs ``fn``)."""
        call = _Call()
        lock = self._calls_lock

        def run() -> T:
            with lock:
                if call.abandoned:
                    raise OSError(errno.ECANCELED, "abandoned before it started")
                call.running = True
            try:
                return fn()
            finally:
                with lock:
                    call.running = False
                    if call.abandoned:
                        self.abandoned -= 1

        try:
            return await run_abandonable(run, limiter)
        except trio.Cancelled:
            with lock:
                call.abandoned = True
                if call.running:
                    self.abandoned += 1
            raise

    def _histogram(self, op: str) -> LatencyHistogram:
        histogram = self.counters.latency.get(op)
        if histogram is None:
            histogram = self.counters.latency[op] = LatencyHistogram()
        return histogram

    def count_error(self, op: str, path: str, exc: OSError) -> None:
        key = (op, exc.errno or errno.EIO)
        self.counters.errors[key] = self.counters.errors.get(key, 0) + 1
        self.errors.report(op, path, exc)

    async def run(self, op: str, path: str, fn: Callable[[], T], *, expected: tuple[int, ...] = ()) -> T:
        """Run ``fn`` in a worker thread; time it, count it, log its error once per file
        (errors whose errno is in ``expected``, a lookup's ENOENT, are not errors)."""
        counters = self.counters
        counters.operations[op] = counters.operations.get(op, 0) + 1

        def timed() -> tuple[T, float]:
            start = time.perf_counter()
            try:
                return fn(), time.perf_counter() - start
            except OSError as exc:
                exc.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]
                raise

        histogram = self._histogram(op)
        try:
            result, elapsed = await self.thread(timed, self.limiter)
        except OSError as exc:
            histogram.observe(getattr(exc, "elapsed", 0.0))
            if (exc.errno or errno.EIO) not in expected:
                self.count_error(op, path, exc)
            raise
        histogram.observe(elapsed)
        return result

    def count_read_part(self, path: str, elapsed: float, error: OSError | None, data: bytes | None) -> None:
        """The read part of a ``stat_read``: a read operation of its own, counted, timed and
        its error counted and logged as ``read_block``'s would be (its stat is the "stat")."""
        c = self.counters
        c.operations["read"] = c.operations.get("read", 0) + 1
        self._histogram("read").observe(elapsed)
        if error is not None:
            self.count_error("read", path, error)
        if data is not None:
            c.bytes_read += len(data)

    def statistics(self, *, reconnects: int = 0) -> BackendStatistics:
        c = self.counters
        return BackendStatistics(
            operations=dict(c.operations),
            errors=dict(c.errors),
            bytes_read=c.bytes_read,
            latency={op: h.snapshot() for op, h in c.latency.items()},
            threads_busy=self.limiter.borrowed_tokens,
            threads_total=int(self.limiter.total_tokens),
            reconnects=reconnects,
            threads_abandoned=self.abandoned,
        )
