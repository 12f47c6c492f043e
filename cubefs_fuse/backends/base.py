"""The backend contract: what the cache and the filesystem core need from a remote volume.

Paths are relative to the volume root, ``/``-separated, ``""`` for the root.  An
implementation runs every blocking call off the trio thread; ``read_block`` raises
:class:`~cubefs_fuse.errors.StaleVersion` when the file is no longer ``version``.
"""

from __future__ import annotations

from dataclasses import dataclass
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


class Backend(Protocol):
    async def stat(self, path: str) -> Attr: ...
    async def listdir(self, path: str) -> list[tuple[str, Attr]]: ...
    async def read_block(self, path: str, version: FileVersion, offset: int, size: int) -> bytes: ...
    async def readlink(self, path: str) -> str: ...
    async def statfs(self) -> FsStats: ...
    def statistics(self) -> BackendStatistics: ...
