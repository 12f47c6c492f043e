"""The backend contract: what the cache and the filesystem core need from a remote volume.
Paths are relative to the volume root, ``/``-separated, ``""`` for the root; an
implementation runs every blocking call off the trio thread, and ``read_block`` raises
:class:`~cubefs_fuse.errors.StaleVersion` when the file is no longer ``version``."""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cubefs_fuse.attrs import Attr, FileVersion, FsStats
from cubefs_fuse.stats import HistogramSnapshot


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    operations: dict[str, int]
    errors: dict[tuple[str, int], int]
    bytes_read: int
    latency: dict[str, HistogramSnapshot]
    threads_busy: int
    threads_total: int
    # Filled by backends/deadline.py's DeadlineBackend (and the threads/reconnects by the
    # directory backend under it); a bare backend leaves the defaults.
    timeouts: dict[str, int] = field(default_factory=dict)  # op -> operations past the deadline
    failed_fast: dict[str, int] = field(default_factory=dict)  # op -> refused at once while down
    up: bool = True
    reconnects: int = 0  # times the source root was reopened
    threads_abandoned: int = 0  # worker threads still inside an operation their caller gave up on


class Backend(Protocol):
    async def stat(self, path: str) -> Attr: ...
    async def listdir(self, path: str, limit: int | None = None) -> list[tuple[str, Attr]]:
        """The directory's entries with their attributes; a directory of more than
        ``limit`` entries raises :func:`too_many_entries` without their attributes read."""
        ...
    async def read_block(self, path: str, version: FileVersion, offset: int, size: int) -> bytes: ...
    async def stat_read(self, path: str, max_size: int, want: Callable[[Attr], bool]) -> tuple[Attr, bytes | None]:
        """``stat(path)`` and, in the same worker-thread call, the whole file if it is a
        regular file of 1 to ``max_size`` bytes and ``want(attr)`` (called in the worker
        thread) says so: the bytes are those of exactly ``attr.version``, else None.  A
        failure of the read part gives None (the caller's read path reports it); a failure
        of the stat raises as ``stat`` does."""
        ...
    async def readlink(self, path: str) -> str: ...
    async def statfs(self) -> FsStats: ...
    def statistics(self) -> BackendStatistics: ...


class ProbedBackend(Backend, Protocol):
    """A backend that can check its remote with a cheap operation (what DeadlineBackend wraps)."""

    async def probe(self) -> bool:
        """Check that the remote answers; reopen the source root if it was replaced (e.g.
        remounted at the same path).  True if it was reopened; OSError if it does not answer.
        Cancellation abandons the check (its thread is bounded by the implementation)."""
        ...

    def close(self) -> None: ...


def too_many_entries(path: str, limit: int) -> OSError:
    """What a listing past its ``limit`` raises (``Backend.listdir``)."""
    return OSError(errno.E2BIG, f"more than {limit} entries", path)
