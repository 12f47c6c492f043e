"""Warmup: whole files or subtrees brought into the cache on an operator's request
(``cubefs-fuse warmup``) at prefetch priority, behind application reads, with progress kept
for :data:`MAX_WARMUPS` queries."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import trio

from cubefs_fuse.attrs import Attr
from cubefs_fuse.errors import FsError, errno_of
from cubefs_fuse.fs.filesystem import Filesystem
from cubefs_fuse.limits import MAX_WARMUP_PATHS

log = logging.getLogger(__name__)

# Warmup tasks remembered for progress queries.
MAX_WARMUPS = 64
# Files a warmup fetches at once (each at prefetch priority, behind application reads).
WARMUP_CONCURRENCY = 16
# Failed paths a warmup keeps with their reason, for its report (the count goes on).
MAX_ERROR_DETAILS = 10


@dataclass
class Warmup:
    id: int
    paths: list[str]
    check_only: bool
    files_total: int = 0
    files_done: int = 0
    files_cached: int = 0  # --check: files whose blocks are all cached
    bytes_total: int = 0
    bytes_done: int = 0
    bytes_cached: int = 0
    errors: int = 0
    error_details: list[tuple[str, str]] = field(default_factory=list)  # (path, reason), the first ones
    done: bool = False
    started: float = field(default_factory=time.time)
    finished: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id, "paths": self.paths[:10], "check": self.check_only, "done": self.done,
            "files_total": self.files_total, "files_done": self.files_done, "files_cached": self.files_cached,
            "bytes_total": self.bytes_total, "bytes_done": self.bytes_done, "bytes_cached": self.bytes_cached,
            "cached_percent": 100.0 * self.bytes_cached / self.bytes_total if self.bytes_total else 100.0,
            "errors": self.errors, "elapsed": (self.finished or time.time()) - self.started,
            "error_details": [{"path": path, "error": reason} for path, reason in self.error_details],
        }

    def failed(self, path: str, exc: BaseException) -> None:
        self.errors += 1
        if len(self.error_details) < MAX_ERROR_DETAILS:
            code = errno_of(exc)
            self.error_details.append((path or "/", f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"))


class Warmups:
    """Runs warmups in the daemon's nursery and keeps the latest ones for progress queries."""

    def __init__(self, nursery: trio.Nursery, fs: Filesystem) -> None:
        self._nursery = nursery
        self._fs = fs
        self._warmups: OrderedDict[int, Warmup] = OrderedDict()
        self._next_id = 1

    def start(self, paths: list[str], check_only: bool) -> Warmup:
        """Start warming ``paths`` (normalised, relative to the volume root)."""
        warmup = Warmup(self._next_id, paths, check_only)
        self._next_id += 1
        self._warmups[warmup.id] = warmup
        while len(self._warmups) > MAX_WARMUPS:
            self._warmups.popitem(last=False)
        self._nursery.start_soon(self._run, warmup)
        return warmup

    def get(self, warmup_id: int) -> Warmup | None:
        return self._warmups.get(warmup_id)

    async def _run(self, warmup: Warmup) -> None:
        try:
            files: list[tuple[str, Attr]] = []
            for path in warmup.paths:
                await self._collect(path, files, warmup)
            warmup.files_total = len(files)
            warmup.bytes_total = sum(attr.size for _, attr in files)
            slots = trio.Semaphore(WARMUP_CONCURRENCY)
            async with trio.open_nursery() as nursery:
                for path, attr in files:
                    await slots.acquire()
                    nursery.start_soon(self._warm_one, path, attr, warmup, slots)
        except Exception as exc:
            log.exception("warmup %d failed", warmup.id)
            warmup.failed("", exc)
        finally:
            warmup.done = True
            warmup.finished = time.time()

    async def _warm_one(self, path: str, attr: Attr, warmup: Warmup, slots: trio.Semaphore) -> None:
        try:
            if self._fs.blocks.cached_fraction(path, attr) == 1.0:
                warmup.files_cached += 1
                warmup.bytes_cached += attr.size
            elif not warmup.check_only:
                await self._fs.blocks.warm_file(path)
                warmup.files_cached += 1
                warmup.bytes_cached += attr.size
        except (OSError, FsError) as exc:
            warmup.failed(path, exc)
        finally:
            warmup.files_done += 1
            warmup.bytes_done += attr.size
            slots.release()

    async def _collect(self, path: str, out: list[tuple[str, Attr]], warmup: Warmup) -> None:
        try:
            attr = await self._fs.meta.stat(path)
        except (OSError, FsError) as exc:
            warmup.failed(path, exc)
            return
        if attr.is_file:
            out.append((path, attr))
        elif attr.is_dir:
            try:
                entries = await self._fs.meta.listdir(path)
            except (OSError, FsError) as exc:
                warmup.failed(path, exc)
                return
            for name, child in sorted(entries):
                child_path = f"{path}/{name}" if path else name
                if child.is_dir:
                    await self._collect(child_path, out, warmup)
                elif child.is_file:
                    out.append((child_path, child))
