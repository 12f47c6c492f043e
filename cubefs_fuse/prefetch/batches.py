"""Batch resolution for cube_torch's fast path: one request answers every file of a batch as
an open and full read through the mount would (attributes from the metadata cache, the
version pinned, every block through ``BlockCache.get`` at foreground priority, the mount's
permission rules). A file whose bytes are all there within :data:`BATCH_WAIT` is served; any
other is answered "read it through the mount" while its flights go on, so the worker's FUSE
read joins them. Accounting is the FUSE path's: a file is opened at the ask, advancing the
job's plan cursor so the window moves past the batch while it is fetched, and each open the
worker reports at release (``commit``) is one request, a hit unless a block waited on the
backend; a file never opened from Python is counted by its READ through the mount instead."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from cubefs_fuse.attrs import Attr, FileVersion
from cubefs_fuse.cache.blockcache import Source
from cubefs_fuse.cache.keys import block_key, path_tag
from cubefs_fuse.errors import FsError, StaleVersion
from cubefs_fuse.fs.filesystem import FileRequest
from cubefs_fuse.prefetch.jobs import JobKey
from cubefs_fuse.prefetch.service import PrefetchService

# How long a batch may wait for its files' blocks (cache hits need no wait; misses take a
# few remote round trips each).  Beyond it the late files go through the mount, where the
# worker's reads join the same flights: the bound keeps a slow remote from holding a
# whole batch hostage to its slowest file, and stays well below the client's own timeout
# (cube_torch/fastpath.py's REPLY_TIMEOUT).
BATCH_WAIT = 2.0


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks: the data socket's peer credentials (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


@dataclass(slots=True)
class Resolved:
    """One file of a batch: its blocks in order (served), or None (through the mount)."""

    path: str
    parts: list[bytes] | None = None
    size: int = 0
    version: FileVersion | None = None
    keys: tuple[bytes, ...] = ()  # the served version's block keys (the consumed file's, to unplan)
    owner: object = None  # the job the open was attributed to
    waited: bool = False  # a block waited on the backend
    stall: float = 0.0
    reason: str | None = None  # why it goes through the mount


@dataclass(slots=True)
class BatchStatistics:
    batches: int = 0
    served_hits: int = 0  # files served, every block from RAM or NVMe
    served_misses: int = 0  # files served after a block waited on the backend
    to_mount: int = 0  # files answered "read it through the mount"
    served_bytes: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)  # why files went to the mount
    served_stall: float = 0.0  # seconds served misses waited on the backend


def may_read(caller: Caller, attr: Attr, need: int) -> bool:
    """The kernel's ``default_permissions`` check for one inode, with the caller's primary
    gid only (supplementary groups are not in SO_PEERCRED: a file readable only through
    one goes through the mount, where the kernel decides).  ``need``: 4 read, 1 search."""
    if caller.uid == 0:
        return True
    mode = attr.mode
    if caller.uid == attr.uid:
        return (mode >> 6) & need == need
    if caller.gid == attr.gid:
        return (mode >> 3) & need == need
    return mode & need == need


class BatchResolver:
    def __init__(self, service: PrefetchService, *, allow_other: bool, wait: float = BATCH_WAIT) -> None:
        self.service = service
        self.fs = service.fs
        self.allow_other = allow_other  # without it the kernel lets only the daemon's uid in
        self.wait = wait
        self.stats = BatchStatistics()

    async def resolve(self, caller: Caller, paths: list[str], room: int) -> list[Resolved]:
        """Every file of the batch, served (at most ``room`` bytes in all) or sent to the mount.

        ``paths`` are checked relative paths (control/dataplane.py).  Nothing is counted
        until :meth:`commit`."""
        self.stats.batches += 1
        results = [Resolved(p) for p in paths]
        if not self.allow_other and caller.uid != os.geteuid():
            for r in results:
                r.reason = "no allow_other"
            self._to_mount(len(paths), "no allow_other")
            return results
        budget = [room]
        with trio.move_on_after(self.wait):
            key = await self.service.jobs.resolve(caller.pid)  # as an open's attribution
            if key is not None:
                self.service.jobs.touch(key)
            # A later epoch's batch is all in RAM: resolved here, without a task per file
            # and without looking for its blocks on NVMe.
            waiting = [entry for entry in results if not self._one_now(caller, key, entry, budget)]
            if waiting and await self._load_from_disk(caller, [entry.path for entry in waiting], budget[0]):
                waiting = [entry for entry in waiting if not self._one_now(caller, key, entry, budget)]
            if waiting:
                async with trio.open_nursery() as nursery:
                    for entry in waiting:
                        nursery.start_soon(self._one, caller, key, entry, budget)
        # Files cut off by the deadline (neither served nor sent back with a reason).
        self._to_mount(sum(1 for r in results if r.parts is None and r.reason is None), "not ready in time")
        return results

    def statistics(self) -> BatchStatistics:
        s = self.stats
        return BatchStatistics(s.batches, s.served_hits, s.served_misses, s.to_mount, s.served_bytes,
                               dict(s.by_reason), s.served_stall)

    def commit(self, results: list[Resolved], opens: list[int] | None = None) -> None:
        """The served files were handed to the worker: count each open of one as a request,
        like a read through the mount (``opens``: per file of the batch, as the
        worker reports them; None: once per served file).  The first open is a hit if no
        block waited on the backend; further opens of the same file are hits (through the
        mount the kernel's page cache would answer them).  The first open advanced the
        plan's cursor when the batch asked (:meth:`_one`); each further one advances it here."""
        for i, r in enumerate(results):
            if r.parts is None or r.version is None:
                continue
            count = 1 if opens is None else (opens[i] if i < len(opens) else 0)
            for n in range(count):
                if n and isinstance(r.owner, tuple):
                    self.service.scheduler.observe_open(r.owner, r.path)  # the plan's cursor, per further open
                waited = r.waited and n == 0
                if waited:
                    self.stats.served_misses += 1
                    self.stats.served_stall += r.stall
                else:
                    self.stats.served_hits += 1
                self.stats.served_bytes += r.size
                self.service.released(FileRequest(0, r.path, r.version, owner=r.owner, waited=waited, keys=r.keys,
                                               stall=r.stall if waited else 0.0))

    def _to_mount(self, count: int, reason: str) -> None:
        self.stats.to_mount += count
        if reason and count:
            self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + count

    def _send_back(self, entry: Resolved, reason: str) -> None:
        entry.reason = reason
        self._to_mount(1, reason)

    def _one_now(self, caller: Caller, key: JobKey | None, entry: Resolved, budget: list[int]) -> bool:
        """:meth:`_one` for a file it would answer without waiting: attributes cached and
        unexpired, readable by the caller from them, and either too large for the room left
        (sent back) or every block of that version in RAM (served).  False, with nothing
        done or counted, for any other file (:meth:`_one` then decides).  The accounting is
        :meth:`_one`'s: an attribute hit, each block's read, the open that moves the plan's
        cursor (here after the blocks, as nothing is fetched)."""
        path = entry.path
        meta, cache = self.fs.meta, self.fs.cache
        attr = meta.peek(path)
        if attr is None or not attr.is_file or not self._permitted_cached(caller, path, attr):
            return False
        if attr.size > budget[0]:
            meta.hit(path)
            self._send_back(entry, "ring full")
            return True
        version = attr.version
        keys = [block_key(path, version, index) for index in range(self.fs.blocks.count(attr.size))]
        if not all(k in cache.memory for k in keys):
            return False
        meta.hit(path)  # counted as the stat of _one would be
        parts: list[bytes] = []
        for k in keys:  # nothing ran since the check: each read is a RAM hit
            found = cache.read_now(k)
            assert found is not None
            data, source, _ = found
            if source is Source.BACKEND:
                entry.waited = True
            parts.append(data)
        budget[0] -= attr.size
        entry.owner = key
        if key is not None:
            self.service.scheduler.observe_open(key, path)
        if sum(len(p) for p in parts) != attr.size:  # blocks that do not add up to its size
            meta.invalidate(path)
            self._send_back(entry, "changed at the source")
            return True
        entry.version, entry.size, entry.parts, entry.keys = version, attr.size, parts, tuple(keys)
        return True

    async def _one(self, caller: Caller, key: JobKey | None, entry: Resolved, budget: list[int]) -> None:
        path = entry.path
        try:
            attr, _ = await self.fs.blocks.stat_bringing(path)  # a small cold file comes with its stat
            if not attr.is_file:
                self._send_back(entry, "not a regular file")
                return
            if not await self._permitted(caller, path, attr):
                self._send_back(entry, "permission")
                return
            if attr.size > budget[0]:
                self._send_back(entry, "ring full")
                return
            budget[0] -= attr.size  # reserved before any await: the ring never overflows
            entry.owner = key
            if key is not None:
                # The worker's open of this file, made now (module doc): the plan's cursor
                # moves before the blocks are fetched, as at an open through the mount.
                self.service.scheduler.observe_open(key, path)
            version, tag = attr.version, path_tag(path)
            blocks = self.fs.blocks
            parts: list[bytes] = []
            start = time.perf_counter()
            for index in range(blocks.count(attr.size)):
                data, source = await self.fs.cache.get(block_key(path, version, index),
                                                       blocks.fetcher(path, version, index), tag=tag)
                if source is Source.BACKEND:
                    entry.waited = True
                parts.append(data)
            if sum(len(p) for p in parts) != attr.size:
                raise StaleVersion(path)  # blocks that do not add up to its size
        except StaleVersion:
            self.fs.meta.invalidate(path)  # as a read through the mount does: the next lookup sees the new version
            self._send_back(entry, "changed at the source")
            return
        except (FsError, OSError):
            self._send_back(entry, "error")
            return
        if entry.waited:
            entry.stall = time.perf_counter() - start
        entry.version, entry.size, entry.parts = version, attr.size, parts

    async def _load_from_disk(self, caller: Caller, paths: list[str], room: int) -> int:
        """The blocks only on NVMe of the batch's files not served from RAM, read in **one**
        worker-thread call (``BlockCache.load_from_disk``) before those files are resolved,
        instead of one thread hop per block; how many were brought into RAM.  Only for files whose attributes are cached (as the plan's listings
        leave them) and that the caller may read by them, within the ring's room; whatever
        is left out, :meth:`_one` reads as before.  The bytes are only brought into RAM:
        :meth:`_one` checks every file again and serves or refuses it."""
        meta, blocks = self.fs.meta, self.fs.blocks
        wanted: list[tuple[bytes, int]] = []
        for path in paths:
            attr = meta.peek(path)
            if attr is None or not attr.is_file or attr.size > room or not self._permitted_cached(caller, path, attr):
                continue
            room -= attr.size
            version, tag = attr.version, path_tag(path)
            wanted += [(block_key(path, version, i), tag) for i in range(blocks.count(attr.size))]
        return await self.fs.cache.load_from_disk(wanted) if wanted else 0

    def _permitted_cached(self, caller: Caller, path: str, attr: Attr) -> bool:
        """:meth:`_permitted` from cached attributes only (False where one is not cached)."""
        if caller.uid == 0:
            return True
        if not may_read(caller, attr, 4):
            return False
        for parent in _parents(path):
            directory = self.fs.meta.peek(parent)
            if directory is None or not stat.S_ISDIR(directory.mode) or not may_read(caller, directory, 1):
                return False
        return True

    async def _permitted(self, caller: Caller, path: str, attr: Attr) -> bool:
        """Read permission on the file and search permission on every directory above it,
        from the same attributes the kernel would check (the mount uses default_permissions)."""
        if caller.uid == 0:
            return True
        if not may_read(caller, attr, 4):
            return False
        for parent in _parents(path):
            directory = await self.fs.meta.stat(parent)
            if not stat.S_ISDIR(directory.mode) or not may_read(caller, directory, 1):
                return False
        return True


def _parents(path: str) -> Iterator[str]:
    """Every directory above a relative path, nearest first, the root ("") last."""
    while path:
        path = path.rpartition("/")[0]
        yield path
