"""The emulated remote: one tools/slowfs.py process per latency preset, shared by all systems.

Each preset's slowfs serves the same backing directory (``remote-disk``: the dataset and
the JuiceFS bucket) on its own mount point, with up to :data:`EMULATOR_THREADS`
operations in progress at once, so latency never turns into a throughput cap.  Its
statistics (operations, bytes, delays actually slept) are read before and after every
epoch, so each system's remote traffic is known.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.suite.cleanup import Registry
from demo.harness import Readers
from tools.slowfs import SlowFSProcess

# Remote operations in progress at once.  Our daemon uses up to 32 backend threads,
# JuiceFS up to 200 downloads, a DataLoader up to 8 workers: 128 keeps every system's
# concurrency real without queueing in the emulator.
EMULATOR_THREADS = 128
# Reader processes of the ceiling measurement: as many as the widest DataLoader.
CEILING_READERS = 8


@dataclass
class RemoteStats:
    ops: int  # every remote operation (lookup, getattr, open, read, readdir, ...)
    reads: int
    bytes: int
    delays: int
    delay_us_total: float

    @staticmethod
    def of(raw: dict[str, Any]) -> RemoteStats:
        delay = raw.get("delay", {})
        count = int(delay.get("count", 0))
        return RemoteStats(sum(int(v) for k, v in raw.get("ops", {}).items() if k != "release"),
                           int(raw.get("ops", {}).get("read", 0)), int(raw.get("bytes_read", 0)), count,
                           float(delay.get("mean_us", 0.0)) * count)

    def minus(self, before: RemoteStats) -> RemoteStats:
        return RemoteStats(self.ops - before.ops, self.reads - before.reads, self.bytes - before.bytes,
                           self.delays - before.delays, self.delay_us_total - before.delay_us_total)

    @property
    def mean_delay_us(self) -> float:
        return self.delay_us_total / self.delays if self.delays else 0.0


class Remote:
    """One latency preset of the emulated remote (a slowfs child process)."""

    def __init__(self, backing: Path, mount_point: Path, *, latency_us: float, bandwidth_mb_s: float,
                 registry: Registry, cache_timeout_s: float = 0.0) -> None:
        self.backing = backing
        self.mount_point = mount_point
        self.latency_us = latency_us
        self.bandwidth_mb_s = bandwidth_mb_s
        self._registry = registry
        self.cache_timeout_s = cache_timeout_s
        self._fs = SlowFSProcess(backing, mount_point, latency_us=latency_us, threads=EMULATOR_THREADS,
                                 bandwidth_mb_s=bandwidth_mb_s, cache_timeout=cache_timeout_s)
        self._stop: Callable[[], None] | None = None

    def start(self) -> Remote:
        self.mount_point.mkdir(parents=True, exist_ok=True)
        # Registered before it starts: an interrupt during start-up still unmounts it.
        self._stop = self._registry.push(f"slowfs {self.mount_point}", self._stop_fs)
        self._fs.start()
        return self

    def _stop_fs(self) -> None:
        self._fs.stop()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    @property
    def pid(self) -> int:
        return self._fs.pid

    def stats(self) -> RemoteStats:
        return RemoteStats.of(self._fs.stats())

    def raw_stats(self) -> dict[str, Any]:
        return self._fs.stats()


def measure_ceiling(backing: Path, mount_point: Path, dataset_dir: str, files: list[str],
                    registry: Registry, cache_timeout_s: float = 0.0) -> dict[str, Any]:
    """Files/s the emulator serves with zero latency to CEILING_READERS reader processes.

    One warm-up pass first (the backing files in the page cache, threads started), then
    the measured pass: what is left is the emulator's own cost per file.
    """
    remote = Remote(backing, mount_point, latency_us=0, bandwidth_mb_s=0, registry=registry,
                    cache_timeout_s=cache_timeout_s).start()
    readers = Readers(CEILING_READERS)
    close_readers = registry.push("ceiling readers", readers.close)
    try:
        root = mount_point / dataset_dir
        readers.read(root, files, seed=1)
        before = remote.stats()
        started = time.perf_counter()
        result = readers.read(root, files, seed=2)
        seconds = time.perf_counter() - started
        delta = remote.stats().minus(before)
    finally:
        close_readers()
        remote.stop()
    return {
        "readers": CEILING_READERS,
        "files": result.files,
        "seconds": seconds,
        "files_per_s": result.files / seconds,
        "mb_per_s": result.bytes / seconds / 1e6,
        "ops_per_file": delta.ops / max(1, result.files),
    }
