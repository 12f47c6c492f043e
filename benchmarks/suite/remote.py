"""The emulated remote: one slowfs process per latency preset, shared by all systems.

Each preset's slowfs serves the same backing directory (``remote-disk``: the dataset and
the JuiceFS bucket) on its own mount point, with up to :data:`EMULATOR_THREADS`
operations in progress at once, so latency never turns into a throughput cap.  Its
statistics (operations, bytes, delays actually slept) are read before and after every
epoch, so each system's remote traffic is known.

Two implementations with the same options, semantics and statistics file: ``c``
(tools/slowfs_c, libfuse3 low-level API, built on demand; the default: its own cost per
operation is a few microseconds) and ``python`` (tools/slowfs.py, requests answered in Python: ~25+ us of CPU
per operation, a ceiling of ~350-400 files/s on 2 cores that caps every first epoch).  If
the C one cannot be built, the suite warns and falls back to the Python one.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.suite.cleanup import Registry
from tools.harness import HarnessError, Readers, build_tool
from tools.slowfs import REPO, SlowFSProcess

# Remote operations in progress at once.  Our daemon uses up to 64 backend threads,
# JuiceFS up to 200 downloads, a DataLoader up to 8 workers: 128 keeps every system's
# concurrency real without queueing in the emulator.
EMULATOR_THREADS = 128
# Reader processes of the ceiling measurement: as many as the widest DataLoader.
CEILING_READERS = 8
EMULATORS = ("c", "python")  # tools/slowfs_c (the default) and tools/slowfs.py
EMULATOR_TITLES = {"c": "tools/slowfs_c (C, libfuse3)", "python": "tools/slowfs.py (Python)"}
SLOWFS_C_BUILD = REPO / "tools" / "slowfs_c" / "build.sh"


@functools.cache
def slowfs_c_binary() -> Path | None:
    """Build tools/slowfs_c if needed (idempotent); None, with a warning printed, if it cannot."""
    try:
        return build_tool(SLOWFS_C_BUILD)
    except HarnessError as exc:
        print(f"warning: cannot build the C emulated remote ({exc}); falling back to tools/slowfs.py, "
              "whose own ceiling (~350-400 files/s on 2 cores) caps first epochs", file=sys.stderr)
        return None


class SlowFSCProcess(SlowFSProcess):
    """tools/slowfs_c's binary run as :class:`SlowFSProcess` runs tools/slowfs.py: the same
    options, start-up report (``--ready-fd``), SIGTERM handling and ``.slowfs_stats``."""

    def __init__(self, binary: Path, source: Path, mount_point: Path, *, latency_us: float, threads: int,
                 cache_timeout: float, bandwidth_mb_s: float) -> None:
        super().__init__(source, mount_point, latency_us=latency_us, threads=threads, cache_timeout=cache_timeout,
                         bandwidth_mb_s=bandwidth_mb_s)
        self.argv = [str(binary), os.path.abspath(source), os.path.abspath(mount_point),
                     f"--latency-us={latency_us:g}", f"--threads={threads}", f"--cache-timeout={cache_timeout:g}",
                     f"--bandwidth-mb-s={bandwidth_mb_s:g}", "--foreground"]


def emulator_process(emulator: str, backing: Path, mount_point: Path, *, latency_us: float, threads: int,
                     cache_timeout: float, bandwidth_mb_s: float) -> tuple[str, SlowFSProcess]:
    """The emulator asked for, or the Python one if the C one cannot be built: (name, process)."""
    if emulator not in EMULATORS:
        raise ValueError(f"unknown emulator {emulator!r}; choose from {', '.join(EMULATORS)}")
    binary = slowfs_c_binary() if emulator == "c" else None
    if binary is not None:
        return "c", SlowFSCProcess(binary, backing, mount_point, latency_us=latency_us, threads=threads,
                                   cache_timeout=cache_timeout, bandwidth_mb_s=bandwidth_mb_s)
    return "python", SlowFSProcess(backing, mount_point, latency_us=latency_us, threads=threads,
                                   bandwidth_mb_s=bandwidth_mb_s, cache_timeout=cache_timeout)


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
                 registry: Registry, cache_timeout_s: float = 0.0, emulator: str = "c") -> None:
        self.backing = backing
        self.mount_point = mount_point
        self.latency_us = latency_us
        self.bandwidth_mb_s = bandwidth_mb_s
        self._registry = registry
        self.cache_timeout_s = cache_timeout_s
        # The implementation actually used ("c" or, as a fallback, "python").
        self.emulator, self._fs = emulator_process(emulator, backing, mount_point, latency_us=latency_us,
                                                   threads=EMULATOR_THREADS, cache_timeout=cache_timeout_s,
                                                   bandwidth_mb_s=bandwidth_mb_s)
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
                    registry: Registry, cache_timeout_s: float = 0.0, emulator: str = "c") -> dict[str, Any]:
    """Files/s the emulator serves with zero latency to CEILING_READERS reader processes.

    One warm-up pass first (the backing files in the page cache, threads started), then
    the measured pass: what is left is the emulator's own cost per file.
    """
    remote = Remote(backing, mount_point, latency_us=0, bandwidth_mb_s=0, registry=registry,
                    cache_timeout_s=cache_timeout_s, emulator=emulator).start()
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
        "emulator": remote.emulator,
        "readers": CEILING_READERS,
        "files": result.files,
        "seconds": seconds,
        "files_per_s": result.files / seconds,
        "mb_per_s": result.bytes / seconds / 1e6,
        "ops_per_file": delta.ops / max(1, result.files),
    }
