"""The NVMe tier: one checksummed file per block, a byte limit and a free-space floor.

Layout of the cache directory::

    lock                 flock()ed by the daemon that owns the directory (holds its pid)
    index.bin            the block list, written at clean shutdown, deleted at start-up
    blocks/ab/<hex key>  one file per block: 36-byte header + payload
    tmp/                 blocks being written (wiped at start-up)

Start-up reads ``index.bin`` (one sequential read, no per-block syscalls) and deletes
it, so a daemon that crashes later leaves no index and the next start falls back to a
directory scan.  Blocks are written to ``tmp/`` and renamed into place, so a block file
is complete or absent; a damaged one is caught by its checksum, counted, deleted and
reported as a miss, never served.

Accounting is in allocated bytes (header + payload rounded up to 4 KiB, what ``du``
shows), reserved on the trio thread before a write starts and released after an
unlink, so the bytes on disk never exceed the limit.  Directories count too:
``blocks/`` and ``tmp/`` as measured at start-up, each fan-out directory ``blocks/ab``
as last measured by a worker (``st_blocks``), plus ``DIR_SLACK`` while writes into it
are in flight (a rename may grow it); a fan-out whose last block goes is removed and
stops counting once it is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import trio
import xxhash

from cubefs_fuse.cache.keys import KEY_BYTES
from cubefs_fuse.cache.policy import SCRATCH_FRACTION, PlannedLru
from cubefs_fuse.cache.shards import SHARDS, ShardedDict
from cubefs_fuse.cache.tags import TagIndex
from cubefs_fuse.errors import ConfigError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHHI16sQ")  # magic, format, reserved, payload length, key, xxh3-64 of payload
_MAGIC = b"CFBK"
_FORMAT = 1
HEADER_BYTES = _HEADER.size
_INDEX_HEADER = struct.Struct("<8sQQ")  # magic, entry count, xxh3-64 of the body
# Body: the keys (16 bytes each), then the sizes and the path tags (<u8 each), eviction order.
_INDEX_MAGIC = b"CFIDX002"
# Filesystem allocation unit used for accounting; 4 KiB is the block size of ext4/xfs on NVMe.
ALLOCATION_UNIT = 4096
# Concurrent block file reads/writes.  NVMe queues are deep; 8 threads keep a drive busy
# without starving the backend's threads of the GIL on a 2-core machine.
DISK_THREADS = 8
# Bytes reserved for a fan-out directory while writes into it are in flight: creating it
# takes one allocation unit, and the largest growth one new entry can cause on ext4 is
# two (a one-block directory turning into an htree: a root and two leaves).  A 4 KiB
# leaf holds ~100 of our 40-byte entries and is half full after a split, so the at most
# DISK_BATCH_BLOCKS + DISK_THREADS (40 < 50) renames between two measurements that count
# (a batch's are counted when it returns) cannot cause two growths.
DIR_SLACK = 2 * ALLOCATION_UNIT
# Blocks one write-behind batch (put_many: one thread hop, one statvfs) takes at most.
# 32 amortise the hop (~100 us here) to a few us per block and keep DIR_SLACK sufficient
# (above); a batch of 32 1 MiB blocks is ~30 ms of NVMe writing, so blocks queued behind
# it wait little.
DISK_BATCH_BLOCKS = 32


# The largest payload a block file can hold: blockSize is at most 64 MiB (config.py).  A
# damaged header claiming more is refused before anything of that size is allocated.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


def allocated_bytes(payload: int) -> int:
    """Bytes a block file of ``payload`` bytes occupies on disk."""
    return -(-(HEADER_BYTES + payload) // ALLOCATION_UNIT) * ALLOCATION_UNIT


@dataclass(frozen=True, slots=True)
class DiskStatistics:
    used_bytes: int
    limit_bytes: int
    effective_limit_bytes: int  # the limit after the free-space floor
    blocks: int
    hits: int
    misses: int
    evictions: int
    inserts: int
    rejected: int
    checksum_failures: int
    write_errors: int
    read_errors: int
    startup_seconds: float
    startup_source: str  # "index", "scan" or "empty"
    startup_discarded: int  # files deleted at start-up: partial writes in tmp/, junk and truncated blocks
    directory_bytes: int  # allocated bytes of the tier's directories (part of used_bytes)


@dataclass(frozen=True, slots=True)
class _Loaded:
    """What start-up found in the cache directory (read in a worker thread)."""

    entries: OrderedDict[bytes, tuple[int, int]]  # key -> (allocated bytes, path tag), oldest first
    source: str
    discarded: int
    fan_blocks: dict[str, int]
    dir_bytes: dict[str, int]
    base_dir_bytes: int


class DiskTier:
    def __init__(self, directory: str, limit_bytes: int, free_ratio: float, lock_fd: int) -> None:
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.free_ratio = free_ratio
        self._lock_fd = lock_fd
        self._blocks_dir = os.path.join(directory, "blocks")
        self._tmp_dir = os.path.join(directory, "tmp")
        # key -> allocated bytes; sharded (cache/shards.py): no million-entry dict resize
        self._entries: ShardedDict[int] = ShardedDict()
        self._tags = TagIndex()  # key -> path tag (absent: unknown, e.g. after a crash scan)
        # Per fan-out directory ("ab"): blocks stored or being written there (at zero the
        # directory is removed), its allocated bytes as last measured (part of used_bytes;
        # absent: no directory, or one whose removal is in flight), and writes in flight.
        self._fan_blocks: dict[str, int] = {}
        self._dir_bytes: dict[str, int] = {}
        self._dir_writes: dict[str, int] = {}
        # Fan-out directories with DIR_SLACK reserved: 0 while it is part of a put's own
        # reservation, DIR_SLACK once held apart for the writes into it still in flight.
        self._slack_held: dict[str, int] = {}
        self._base_dir_bytes = 0  # blocks/ and tmp/ themselves (constant: see _measure_dirs)
        # Eviction order, as in the RAM tier: unplanned LRU first, then furthest next use.
        self.policy = PlannedLru(limit_bytes // SCRATCH_FRACTION)
        self._writing: dict[bytes, int] = {}  # key -> bytes reserved for a write in progress
        # Allocated bytes of stored blocks plus reservations of writes in progress.  A put
        # reserves max(its block, the victims it evicts) until its worker has unlinked the
        # victims and written the block, so a concurrent put can never reuse the space of
        # a file that is still on disk; dropped blocks likewise stay counted until unlinked.
        self.used_bytes = 0
        self._reserved = 0  # the in-flight part of used_bytes (writes and unlinks in progress)
        self._inserted_bytes = 0  # cumulative bytes of blocks stored by put(), for _set_headroom
        self._headroom = limit_bytes  # used_bytes may grow to this before the free-space floor is hit
        self._limiter = trio.CapacityLimiter(DISK_THREADS)
        self._pause_lock = trio.Lock()
        self._hits = self._misses = self._evictions = self._inserts = self._rejected = 0
        self._checksum_failures = self._write_errors = self._read_errors = 0
        self._tmp_serial = 0
        self.startup_seconds = 0.0
        self.startup_source = "empty"
        self.startup_discarded = 0

    # -- start-up and shutdown -------------------------------------------------------

    @classmethod
    async def open(cls, directory: str, limit_bytes: int, free_ratio: float) -> DiskTier:
        """Lock the directory and load its block list (index file, else a scan)."""
        start = time.perf_counter()
        lock_fd = await trio.to_thread.run_sync(_lock_directory, directory)
        tier = cls(directory, limit_bytes, free_ratio, lock_fd)
        try:
            loaded = await trio.to_thread.run_sync(tier._load)
        except BaseException:
            os.close(lock_fd)
            raise
        entries = loaded.entries
        for key, (size, tag) in entries.items():  # oldest first: the LRU order of the last run
            tier._entries[key] = size
            if tag:
                tier._tags.set(key, tag)
            tier.policy.add(key, size)
        tier._fan_blocks = loaded.fan_blocks
        tier._dir_bytes = loaded.dir_bytes
        tier._base_dir_bytes = loaded.base_dir_bytes
        tier.used_bytes = sum(tier._entries.values()) + tier._base_dir_bytes + sum(tier._dir_bytes.values())
        tier.startup_source = loaded.source
        tier.startup_discarded = loaded.discarded
        if loaded.discarded:
            log.warning("disk cache %s: deleted %d partial or damaged files at start-up", directory, loaded.discarded)
        await tier._refresh_headroom()
        await tier._shrink_to_fit()
        tier.startup_seconds = time.perf_counter() - start
        log.info("disk cache %s: %d blocks, %d bytes, loaded from %s in %.3f s", directory,
                 len(entries), tier.used_bytes, loaded.source, tier.startup_seconds)
        return tier

    def _load(self) -> _Loaded:
        discarded = _count_files(self._tmp_dir)  # partial writes of a daemon that died
        shutil.rmtree(self._tmp_dir, ignore_errors=True)
        os.makedirs(self._tmp_dir, exist_ok=True)
        os.makedirs(self._blocks_dir, exist_ok=True)
        index_path = os.path.join(self.directory, "index.bin")
        entries = _read_index(index_path)
        if entries is not None:
            # From here on the index is stale: only a clean shutdown writes a new one.
            os.unlink(index_path)
            source = "index"
        else:
            entries, junk = self._scan()
            discarded += junk
            source = "scan"
        fan_blocks: dict[str, int] = {}
        for key in entries:
            sub = key[:1].hex()
            fan_blocks[sub] = fan_blocks.get(sub, 0) + 1
        dir_bytes = _measure_fanouts(self._blocks_dir, fan_blocks)
        base = sum(os.lstat(d).st_blocks * 512 for d in (self._blocks_dir, self._tmp_dir))
        return _Loaded(entries, source, discarded, fan_blocks, dir_bytes, base)

    def _scan(self) -> tuple[OrderedDict[bytes, tuple[int, int]], int]:
        """Rebuild the block list from the files (after a crash), oldest write first, and
        the number of files deleted (names that are no key, files shorter than a header)."""
        found: list[tuple[int, bytes, int]] = []
        discarded = 0
        for sub in os.scandir(self._blocks_dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    key = bytes.fromhex(entry.name)
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, FileNotFoundError):
                    discarded += _unlink_quietly(entry.path)
                    continue
                if len(key) != KEY_BYTES or st.st_size < HEADER_BYTES or key[:1].hex() != sub.name:
                    discarded += _unlink_quietly(entry.path)
                    continue
                found.append((st.st_mtime_ns, key, allocated_bytes(st.st_size - HEADER_BYTES)))
        found.sort()
        # Tags come back as blocks are read.
        return OrderedDict((key, (size, 0)) for _, key, size in found), discarded

    async def close(self) -> None:
        """Write the index for a fast restart and release the directory lock."""
        entries = [(key, size, self._tags.get(key, 0)) for key, size in self._lru_order()]
        try:
            await trio.to_thread.run_sync(_write_index, os.path.join(self.directory, "index.bin"), entries)
        except OSError as exc:
            log.warning("could not write the disk cache index (next start will scan): %s", exc)
        finally:
            os.close(self._lock_fd)

    def release(self) -> None:
        """Release the directory lock without an index (the next start rescans)."""
        os.close(self._lock_fd)

    # -- the cache interface ---------------------------------------------------------

    @property
    def limiter(self) -> trio.CapacityLimiter:
        """The tier's worker-thread bound (``DISK_THREADS``), for callers that read blocks in
        a thread of their own (``read_in_thread``)."""
        return self._limiter

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    async def get(self, key: bytes, tag: int = 0) -> bytes | None:
        """The block, or None if absent or damaged (a damaged block is deleted).

        ``tag`` (the reader's path tag) restores a tag lost by a crash scan."""
        if key not in self._entries:
            self._misses += 1
            return None
        self.policy.touch(key)
        if tag and key not in self._tags:
            self._tags.set(key, tag)
        path = self._path(key)
        try:
            data = await trio.to_thread.run_sync(_read_block_file, path, key, limiter=self._limiter)
        except FileNotFoundError:
            data = None  # evicted while we were reading
        except _Corrupt as exc:
            self._checksum_failures += 1
            log.warning("disk cache block %s is damaged (%s): discarded, will refetch", path, exc)
            size = 0
            if key in self._entries:  # its bytes stay counted until the file is gone
                size = self._drop_entry(key, [])
            self._reserved += size
            try:
                await trio.to_thread.run_sync(_unlink_quietly, path, limiter=self._limiter)
            finally:
                self._reserved -= size
                self.used_bytes -= size
            data = None
        except OSError as exc:
            self._read_errors += 1
            log.warning("disk cache read of %s failed: %s", path, exc)
            data = None
        if data is None:
            self._forget(key)
            self._misses += 1
            return None
        self._hits += 1
        return data

    def read_in_thread(self, key: bytes) -> bytes | None:
        """The block's checked payload, read by the calling worker thread (not the trio
        thread), or None if it is not stored, was evicted meanwhile or is damaged (the
        trio thread's :meth:`get` then deals with it).  Touches no accounting: the trio
        thread calls :meth:`count_hit` with the bytes.  Block files are immutable once in
        place, so a concurrent eviction costs at most a None."""
        if key not in self._entries:
            return None
        try:
            return _read_block_file(self._path(key), key)
        except (OSError, _Corrupt):
            return None

    def count_hit(self, key: bytes, tag: int = 0) -> None:
        """Account a hit read by :meth:`read_in_thread` (on the trio thread)."""
        self._hits += 1
        if key in self._entries:
            self.policy.touch(key)
            if tag and key not in self._tags:
                self._tags.set(key, tag)

    async def put(self, key: bytes, data: bytes, *, next_use: int | None = None, tag: int = 0) -> bool:
        """Store a block (``next_use``: the plan position that reads it), evicting by the
        plan-aware policy; False if it was not stored."""
        return (await self.put_many([(key, data, next_use, tag)]))[0]

    async def put_many(self, blocks: list[tuple[bytes, bytes, int | None, int]]) -> list[bool]:
        """Store blocks ``(key, data, next_use, tag)`` as :meth:`put` does, in one worker
        thread call (one thread hop and one ``statvfs`` for them all); per block whether
        it was stored.  Every block's space is reserved before the call, so the limit
        holds at every instant exactly as for single puts."""
        puts = [self._reserve(key, data, next_use) for key, data, next_use, _ in blocks]
        jobs = [p.job for p in puts if p is not None]
        inserted_before = self._inserted_bytes
        space: tuple[int, int] | None = None
        done: list[_Written] = []
        try:
            if jobs:
                done, space = await trio.to_thread.run_sync(_write_block_files, jobs, self._tmp_dir,
                                                            limiter=self._limiter)
        except OSError as exc:  # not raised by the worker (it reports per block): nothing is known
            done = [_Written(-1, [-1] * len(job.emptied), exc) for job in jobs]
        except BaseException:
            done = [_Written(-1, [-1] * len(job.emptied), OSError(errno.ECANCELED, "cancelled")) for job in jobs]
            raise
        finally:
            results = iter(done)
            stored = []
            for put, (key, _, next_use, tag) in zip(puts, blocks):
                stored.append(self._settle(put, next(results), next_use, tag) if put is not None else True)
        if space is not None:
            own = sum(p.need for p, ok in zip(puts, stored) if p is not None and p.fits and ok)
            self._set_headroom(space, self._inserted_bytes - inserted_before - own)
        return stored

    def _reserve(self, key: bytes, data: bytes, next_use: int | None) -> _Put | None:
        """Reserve a block's space and choose its victims (None: already stored or being
        written, nothing to do)."""
        if key in self._entries or key in self._writing:
            if next_use is not None:
                self.policy.plan(key, next_use)
            return None
        sub = _fanout(key)
        # The block's fan-out directory may be created or grow: reserve DIR_SLACK for it
        # unless it is reserved already (for other writes into it still in flight).
        slack = 0 if sub in self._slack_held else DIR_SLACK
        need = allocated_bytes(len(data))
        limit = self.effective_limit_bytes
        chosen = (self.policy.victims(need + slack, limit - self.used_bytes, next_use)
                  if need + slack <= limit else None)
        victims = chosen or []
        self._fan_blocks[sub] = self._fan_blocks.get(sub, 0) + 1  # no rmdir of our own directory
        freed = 0
        emptied: list[str] = []
        for victim in victims:
            freed += self._drop_entry(victim, emptied)
            self._evictions += 1
        fits = chosen is not None and self.used_bytes - freed + need + slack <= limit
        if not fits:
            self._rejected += 1
            self._unclaim(sub)
            slack = 0
        freed += self._take_emptied(emptied)
        # The victims' files (and emptied directories) and the new file are never on disk
        # together (the worker removes first), so max() bounds what this put has on disk.
        reserved = max(need + slack, freed) if fits else freed
        self.used_bytes += reserved - freed
        self._reserved += reserved
        if fits:
            self._writing[key] = need
            self._dir_writes[sub] = self._dir_writes.get(sub, 0) + 1
            if slack:
                self._slack_held[sub] = 0  # inside this put's reservation for now
        self._tmp_serial += 1
        tmp = os.path.join(self._tmp_dir, f"{self._tmp_serial}")
        job = _Job([self._path(v) for v in victims], [self._dir_path(e) for e in emptied], tmp,
                   self._path(key) if fits else None, key, data)
        return _Put(key, sub, need, slack, reserved, fits, emptied, job)

    def _settle(self, put: _Put, done: _Written, next_use: int | None, tag: int) -> bool:
        """Account a reserved put whose worker returned ``done``; whether it was stored."""
        key, sub, fits, slack = put.key, put.sub, put.fits, put.slack
        self._writing.pop(key, None)
        self._reserved -= put.reserved
        self.used_bytes -= put.reserved
        if fits:
            self._dir_writes[sub] -= 1
            if slack and self._dir_writes[sub]:
                # Other writes into the directory still count on the slack: hold it apart.
                self._slack_held[sub] = slack
                self._reserved += slack
                self.used_bytes += slack
            elif not self._dir_writes[sub]:
                del self._dir_writes[sub]
                held = self._slack_held.pop(sub, 0)
                self._reserved -= held
                self.used_bytes -= held
        # (No await since the worker returned: the measured sizes replace the slack at once.)
        for name, size in zip(put.emptied, done.kept_dirs):
            self._keep_dir(name, size)
        if fits:
            self._keep_dir(sub, done.dir_bytes)
        if done.error is not None:
            self._write_errors += 1
            log.warning("disk cache write failed: %s", done.error)
            if fits:
                self._unclaim(sub)
            return False
        if fits:
            self._entries[key] = put.need
            self.used_bytes += put.need
            self.policy.add(key, put.need, next_use)
            if tag:
                self._tags.set(key, tag)
            self._inserted_bytes += put.need
            self._inserts += 1
        return fits

    def _drop_entry(self, key: bytes, emptied: list[str]) -> int:
        """Forget a stored block (its file is still on disk: the caller removes it and
        keeps its bytes counted until then); its size.  A fan-out directory left without
        blocks is appended to ``emptied``."""
        size = self._entries.pop(key)
        self.policy.remove(key)
        self._tags.pop(key)
        sub = _fanout(key)
        self._fan_blocks[sub] -= 1
        if not self._fan_blocks[sub]:
            del self._fan_blocks[sub]
            emptied.append(sub)
        return size

    def _unclaim(self, sub: str) -> None:
        """A write into ``sub`` that was counted in its blocks did not happen."""
        self._fan_blocks[sub] -= 1
        if not self._fan_blocks[sub]:
            del self._fan_blocks[sub]

    def _take_emptied(self, emptied: list[str]) -> int:
        """Fan-out directories about to be removed stop being known (a write that comes
        before the removal is done reserves a new directory); their bytes, which the caller
        keeps counted until the removal."""
        freed = 0
        for sub in emptied:
            freed += self._dir_bytes.pop(sub, 0)
        return freed

    def _keep_dir(self, sub: str, size: int) -> None:
        """A worker found fan-out ``sub`` on disk with ``size`` allocated bytes (-1: absent)."""
        if size < 0:
            return
        # Directories only grow while they exist; measurements may arrive out of order.
        old = self._dir_bytes.get(sub, 0)
        if size > old:
            self._dir_bytes[sub] = size
            self.used_bytes += size - old

    @contextlib.asynccontextmanager
    async def io_paused(self) -> AsyncIterator[None]:
        """Hold every disk worker slot: while inside, no block file or directory of the tier
        changes (workers in progress finish first), so the directory can be measured as one
        consistent state.  For tests and tools; the trio thread is not blocked."""
        borrowers = [object() for _ in range(DISK_THREADS)]
        acquired = []
        async with self._pause_lock:  # two pausers each holding half the slots would deadlock
            try:
                for borrower in borrowers:
                    await self._limiter.acquire_on_behalf_of(borrower)
                    acquired.append(borrower)
                yield
            finally:
                for borrower in acquired:
                    self._limiter.release_on_behalf_of(borrower)

    def plan(self, key: bytes, next_use: int) -> None:
        self.policy.plan(key, next_use)

    def unplan(self, key: bytes) -> None:
        self.policy.unplan(key)

    def tagged_shard(self, shard: int) -> tuple[list[bytes], list[int]]:
        """(key, tag) of the blocks whose tag is known, in one shard (``tags.SHARDS``)."""
        return self._tags.shard(shard)

    def unplan_some(self, count: int) -> bool:
        """Make up to ``count`` planned blocks unplanned; True if planned ones remain."""
        return self.policy.unplan_some(count)

    def _lru_order(self) -> list[tuple[bytes, int]]:
        """Blocks in eviction order (for the index: the next run starts from it)."""
        return [(key, self._entries[key]) for key in self.policy.order() if key in self._entries]

    async def clear(self) -> None:
        """Drop every stored block and its file (writes in progress still land).

        The index is emptied a shard at a time (``shards.SHARDS``, ~4k entries per shard
        at 10^6 blocks) with a checkpoint between shards, so FUSE requests are served
        while a large tier is dropped; a block stored meanwhile is newer than the drop
        and stays.  Each shard's bytes stay counted (``_reserved``) until the files are
        gone, as do the fan-out directories it emptied."""
        paths: list[str] = []
        emptied: list[str] = []
        freed = 0
        try:
            for shard in range(SHARDS):
                keys = list(self._entries.shards[shard])
                paths.extend(self._path(k) for k in keys)
                step: list[str] = []
                dropped = sum(self._drop_entry(key, step) for key in keys)
                dropped += self._take_emptied(step)
                emptied.extend(step)
                self._reserved += dropped  # counted until the files are gone
                freed += dropped
                await trio.lowlevel.checkpoint()
            kept = await trio.to_thread.run_sync(_remove_all, paths, [self._dir_path(e) for e in emptied],
                                                 limiter=self._limiter)
        finally:
            self._reserved -= freed
            self.used_bytes -= freed
        for name, size in zip(emptied, kept):
            self._keep_dir(name, size)

    @property
    def effective_limit_bytes(self) -> int:
        return max(0, min(self.limit_bytes, self._headroom))

    def statistics(self) -> DiskStatistics:
        return DiskStatistics(
            self.used_bytes, self.limit_bytes, self.effective_limit_bytes, len(self._entries),
            self._hits, self._misses, self._evictions, self._inserts, self._rejected,
            self._checksum_failures, self._write_errors, self._read_errors,
            self.startup_seconds, self.startup_source, self.startup_discarded,
            self._base_dir_bytes + sum(self._dir_bytes.values()),
        )

    # -- internals -------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self._blocks_dir, name[:2], name)

    def _dir_path(self, sub: str) -> str:
        return os.path.join(self._blocks_dir, sub)

    def _forget(self, key: bytes) -> None:
        """The block's file is gone (its directory stays, counted, until emptied by a put)."""
        if key in self._entries:
            self.used_bytes -= self._drop_entry(key, [])

    def _set_headroom(self, avail_bytes: tuple[int, int], stored_since: int = 0) -> None:
        """``avail_bytes`` was measured by a worker; ``stored_since`` bytes of blocks were
        stored after that worker started (their files may postdate the measurement)."""
        available, total = avail_bytes
        floor = int(self.free_ratio * total)
        # What we surely held when ``available`` was measured, plus what the filesystem
        # could still give before the floor.  Only blocks whose files were on disk at that
        # moment count: in-flight writes and unlinks may or may not have reached the
        # filesystem (``available`` may or may not include them), and neither may blocks
        # stored while the worker ran.  Counting any of them lets concurrent writes
        # overshoot the floor.
        self._headroom = self.used_bytes - self._reserved - stored_since + available - floor

    async def _refresh_headroom(self) -> None:
        st = await trio.to_thread.run_sync(os.statvfs, self.directory)
        self._set_headroom((st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize))

    async def _shrink_to_fit(self) -> None:
        """Evict down to the limit (the limit may have shrunk since the last run)."""
        limit = self.effective_limit_bytes
        victims = []
        emptied: list[str] = []
        if self.used_bytes > limit:
            for victim in self.policy.victims(self.used_bytes - limit, 0, None) or list(self._entries):
                if self.used_bytes <= limit:
                    break
                first = len(emptied)
                self.used_bytes -= self._drop_entry(victim, emptied)
                self.used_bytes -= self._take_emptied(emptied[first:])
                self._evictions += 1
                victims.append(self._path(victim))
        if victims:
            kept = await trio.to_thread.run_sync(_remove_all, victims, [self._dir_path(e) for e in emptied])
            for name, size in zip(emptied, kept):
                self._keep_dir(name, size)


class _Corrupt(Exception):
    pass


def _lock_directory(directory: str) -> int:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"key 'diskCacheDir': {directory!r} is in use by another cubefs-fuse daemon (pid {owner})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _read_block_file(path: str, key: bytes) -> bytes:
    # Header and payload in two preads: the payload is read into its own bytes object
    # (no copy of a whole block out of a header+payload buffer).
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = os.pread(fd, HEADER_BYTES, 0)
        if len(header) < HEADER_BYTES:
            raise _Corrupt("truncated header")
        magic, fmt, _, length, stored_key, checksum = _HEADER.unpack(header)
        if magic != _MAGIC or fmt != _FORMAT:
            raise _Corrupt("bad magic")
        if stored_key != key:
            raise _Corrupt("key mismatch")
        if length > MAX_PAYLOAD_BYTES:
            raise _Corrupt(f"length {length} too large")
        payload = os.pread(fd, length + 1, HEADER_BYTES)  # one byte more: a longer file is damaged too
    finally:
        os.close(fd)
    if len(payload) != length:
        raise _Corrupt(f"length {len(payload)} != {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise _Corrupt("checksum mismatch")
    return payload


@dataclass(frozen=True, slots=True)
class _Written:
    dir_bytes: int  # allocated bytes of the block's fan-out directory after the write (-1: none)
    kept_dirs: list[int]  # per emptied directory: -1 if removed, else its allocated bytes
    error: OSError | None


@dataclass(frozen=True, slots=True)
class _Job:
    """What a worker does for one put: unlink the victims, remove emptied directories,
    write the block through ``tmp`` and rename it to ``final`` (None: no room, only the
    removals)."""

    victims: list[str]
    emptied: list[str]
    tmp: str
    final: str | None
    key: bytes
    data: bytes


@dataclass(frozen=True, slots=True)
class _Put:
    """A put's reservation, from ``_reserve`` to ``_settle``."""

    key: bytes
    sub: str
    need: int
    slack: int
    reserved: int
    fits: bool
    emptied: list[str]
    job: _Job


def _write_block_files(jobs: list[_Job], tmp_dir: str) -> tuple[list[_Written], tuple[int, int] | None]:
    """The jobs in order, each reported on its own (an error ends only its block), then
    one ``statvfs`` of the cache filesystem (None if it failed)."""
    done = []
    for job in jobs:
        try:
            done.append(_write_block_file(job))
        except OSError as exc:  # unlinking a victim failed: nothing is known of this block
            done.append(_Written(-1, [-1] * len(job.emptied), exc))
    try:
        st = os.statvfs(tmp_dir)
    except OSError:
        return done, None
    return done, (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def _write_block_file(job: _Job) -> _Written:
    # Victims go first so the bytes on disk stay within the reservation at every instant.
    kept = _remove_all(job.victims, job.emptied)
    error: OSError | None = None
    dir_bytes = -1
    final, tmp, data = job.final, job.tmp, job.data
    if final is not None:
        try:
            header = _HEADER.pack(_MAGIC, _FORMAT, 0, len(data), job.key, xxhash.xxh3_64_intdigest(data))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.writev(fd, [header, data])
            finally:
                os.close(fd)
            try:
                os.rename(tmp, final)
            except FileNotFoundError:  # a new fan-out, or one just removed as emptied
                os.makedirs(os.path.dirname(final), exist_ok=True)
                os.rename(tmp, final)
        except OSError as exc:
            error = exc
            _unlink_quietly(tmp)
        dir_bytes = _allocated(os.path.dirname(final))
    return _Written(dir_bytes, kept, error)


def _remove_all(paths: list[str], directories: list[str]) -> list[int]:
    """Unlink ``paths``, then remove ``directories``; per directory -1 if it is gone, else
    its allocated bytes (a write put a block into it meanwhile)."""
    for path in paths:
        _unlink_quietly(path)
    kept = []
    for directory in directories:
        try:
            os.rmdir(directory)
            kept.append(-1)
        except FileNotFoundError:
            kept.append(-1)
        except OSError:
            kept.append(_allocated(directory))
    return kept


def _allocated(path: str) -> int:
    """Allocated bytes of a file or directory, -1 if it does not exist."""
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return -1


def _fanout(key: bytes) -> str:
    """The fan-out directory of a key: its first byte in hex."""
    return key[:1].hex()


def _measure_fanouts(blocks_dir: str, fan_blocks: dict[str, int]) -> dict[str, int]:
    """Allocated bytes of each fan-out directory that holds blocks; empty ones are removed."""
    sizes = {}
    for sub in os.scandir(blocks_dir):
        if not sub.is_dir(follow_symlinks=False):
            continue
        if sub.name in fan_blocks:
            sizes[sub.name] = sub.stat(follow_symlinks=False).st_blocks * 512
        else:
            with contextlib.suppress(OSError):  # not empty: files we do not know, left alone
                os.rmdir(sub.path)
    return sizes


def _count_files(directory: str) -> int:
    try:
        return sum(1 for _ in os.scandir(directory))
    except FileNotFoundError:
        return 0


def _unlink_quietly(path: str) -> int:
    """1 if ``path`` was unlinked, 0 if it was gone already."""
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def _read_index(path: str) -> OrderedDict[bytes, tuple[int, int]] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    if len(raw) < _INDEX_HEADER.size:
        log.warning("disk cache index %s is truncated; scanning instead", path)
        return None
    magic, count, checksum = _INDEX_HEADER.unpack_from(raw)
    body = memoryview(raw)[_INDEX_HEADER.size:]
    if magic != _INDEX_MAGIC or len(body) != count * (KEY_BYTES + 16) or xxhash.xxh3_64_intdigest(body) != checksum:
        log.warning("disk cache index %s is damaged; scanning instead", path)
        return None
    keys = bytes(body[: count * KEY_BYTES])
    sizes = np.frombuffer(body, dtype="<u8", offset=count * KEY_BYTES, count=count).tolist()
    tags = np.frombuffer(body, dtype="<u8", offset=count * (KEY_BYTES + 8), count=count).tolist()
    return OrderedDict(zip((keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)), zip(sizes, tags)))


def _write_index(path: str, entries: list[tuple[bytes, int, int]]) -> None:
    """(key, allocated size, path tag) per block, in eviction order."""
    body = (b"".join(k for k, _, _ in entries)
            + np.fromiter((s for _, s, _ in entries), dtype="<u8", count=len(entries)).tobytes()
            + np.fromiter((t for _, _, t in entries), dtype="<u8", count=len(entries)).tobytes())
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_INDEX_HEADER.pack(_INDEX_MAGIC, len(entries), xxhash.xxh3_64_intdigest(body)))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)

