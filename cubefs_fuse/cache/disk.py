"""The NVMe tier (a ``tier.Tier``): checksummed blocks packed into append-only segment files
under a byte limit and a free-space floor. Offsets are handed out on the trio thread, an entry enters the
block list only once its write returned, eviction punches its range and deletes a segment
with its last block, and a read that meets a damaged or punched range is a miss, never
bytes; start-up reads ``index.bin`` (written at clean shutdown) or scans the segments'
headers after a crash; accounting is in allocated bytes, each put reserving its space before
its write, so the bytes on disk never exceed the limit. The formats and the accounting are
in docs/on-disk.md; the segment files, the accounting rule, freeing and the scan are the
engine's (``cache/segments.py``), the entry format and the block list this module's."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import numpy as np
import trio
import xxhash

from cubefs_fuse.cache import holes, segments
from cubefs_fuse.cache.holes import ALLOCATION_UNIT
from cubefs_fuse.cache.keys import KEY_BYTES
from cubefs_fuse.cache.segments import DISK_THREADS, Budget, Fields, LiveCounts, Release
from cubefs_fuse.cache._index import BlockIndex
from cubefs_fuse.cache.shards import SHARDS
from cubefs_fuse.cache.tier import SCRATCH_FRACTION, Tier
from cubefs_fuse.errors import ConfigError

log = logging.getLogger(__name__)

# magic, format, reserved, payload length, key, xxh3-64 of the payload, xxh32 of the 36 bytes before it
_HEADER = struct.Struct("<4sHHI16sQI")
_HEADER_BODY = _HEADER.size - 4
_MAGIC = b"CFSG"
_FORMAT = 2
HEADER_BYTES = _HEADER.size
_INDEX_HEADER = struct.Struct("<8sQQ")  # magic, entry count, xxh3-64 of the body
# Body: the keys (16 bytes each), then the locations and the path tags (<u8 each), eviction order.
_INDEX_MAGIC = b"CFIDX003"
# Bytes a segment file takes before a new one is started.  16 MiB amortise a file's
# creation (~50-100 us of ext4 inode and directory work) over ~140 blocks of ~110 KB or
# 16 of 1 MiB, and keep the extent-tree bound per segment (segment_slack) at 0.3 %.
SEGMENT_BYTES = 16 * 1024 * 1024
# ext4 extents per 4 KiB extent-tree block ((4096 - 12-byte header) / 12-byte extent).
_EXTENTS_PER_BLOCK = 340
# Bytes reserved for the segments/ directory's growth between two measurements (every
# write batch measures it): a one-block directory turning into an htree takes two more
# units, and a 4 KiB leaf holds ~150 of our ~24-byte entries and is half full after a
# split, while at most a segment per put, DISK_BATCH_BLOCKS * DISK_THREADS (256 < 75 *
# 4 KiB leaves' worth) names, can be created between two measurements that count.
DIR_SLACK = 2 * ALLOCATION_UNIT
# Blocks one write-behind batch (put_many: one thread hop, one statvfs) takes at most.
# 32 amortise the hop (~100 us here) to a few us per block; a batch of 32 1 MiB blocks
# is ~30 ms of NVMe writing, so blocks queued behind it wait little.
DISK_BATCH_BLOCKS = 32

# The largest payload an entry can hold: blockSize is at most 64 MiB (config.py).  A
# damaged header claiming more is refused before anything of that size is allocated.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024

# A block's location, one int per block (no per-block tuple or object), as index.bin
# stores it: allocated size, offset and segment id, the first two in allocation units.
# 16 bits of units hold 256 MiB, above the largest segment (one 64 MiB block); the id's
# 32 bits leave the location within the index's u64 for 2^32 segments, 64 PiB written
# through one cache.
_UNIT_BITS = 16
LOCATION = Fields((_UNIT_BITS, ALLOCATION_UNIT), (_UNIT_BITS, ALLOCATION_UNIT))
_size = LOCATION.field(0)
_segment = LOCATION.segment


def allocated_bytes(payload: int) -> int:
    """Bytes an entry of ``payload`` bytes occupies in its segment."""
    return segments.up(HEADER_BYTES + payload)


def segment_slack(length: int) -> int:
    """Allocated bytes a segment of ``length`` bytes may need beyond its entries: its
    extent tree on ext4 with one extent per 4 KiB unit (the worst case: every other
    range punched, or a fragmented filesystem).  The inode holds 4 extents, or 4
    pointers to leaf blocks of _EXTENTS_PER_BLOCK extents; more leaves need index
    blocks of as many pointers (a tree of depth 2 holds 4 * 340 * 340 extents, 1.8 GiB
    of units, far above any segment)."""
    units = -(-length // ALLOCATION_UNIT)
    if units <= 4:
        return 0
    leaves = -(-units // _EXTENTS_PER_BLOCK)
    index = 0 if leaves <= 4 else -(-leaves // _EXTENTS_PER_BLOCK)
    return (leaves + index) * ALLOCATION_UNIT


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
    startup_discarded: int  # found at start-up and deleted: damaged entries, junk and old-layout files
    directory_bytes: int  # allocated bytes beyond the entries (directory, segment slack), part of used_bytes
    segments: int


@dataclass(frozen=True, slots=True)
class _Loaded:
    """What start-up found in the cache directory (read in a worker thread)."""

    entries: OrderedDict[bytes, tuple[int, int]]  # key -> (location, path tag), oldest first
    source: str
    discarded: int
    segments: dict[int, int]  # segment id -> its slack
    dir_bytes: int
    next_segment: int


@dataclass(frozen=True, slots=True)
class _Write:
    segment: int
    path: str
    offset: int
    key: bytes
    data: bytes


@dataclass(frozen=True, slots=True)
class _Put:
    """A put's reservation, from ``_reserve`` to ``_settle``."""

    key: bytes
    location: int
    need: int  # the entry's allocated bytes
    slack: int  # what this put's range adds to its segment's slack
    reserved: int
    write: _Write | None  # None: no room, only the removals
    ops: Release  # what its worker frees before it writes


class DiskTier(Tier[DiskStatistics]):
    def __init__(self, directory: str, limit_bytes: int, free_ratio: float, lock_fd: int) -> None:
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.free_ratio = free_ratio
        self._lock_fd = lock_fd
        self._segments_dir = os.path.join(directory, "segments")
        # key -> its packed location (LOCATION), allocated bytes and path tag (0: unknown,
        # e.g. after a crash scan), in eviction order as in the RAM tier: unplanned LRU
        # first, then furthest next use (cache/_index.c).
        self.index = BlockIndex(limit_bytes // SCRATCH_FRACTION)
        # Per segment: blocks stored or being written there (at zero a sealed segment is
        # deleted; the active one is appended to, None: start one) and its slack (part of
        # used_bytes while the segment file may exist).
        self._segs = LiveCounts()
        self._seg_slack: dict[int, int] = {}
        self._slack_total = 0  # sum of _seg_slack (statistics() reads it: no pass over segments)
        self._tail = 0  # the active segment's next free offset
        self._next_segment = 0
        self._dir_bytes = 0  # segments/ as last measured (directories only grow while they exist)
        self._writing: dict[bytes, int] = {}  # key -> bytes reserved for a write in progress
        # Allocated bytes of stored blocks, segment slack and the directory, plus the
        # reservations of writes and frees in progress (segments.Budget's rule).
        self._budget = Budget()
        self._inserted_bytes = 0  # cumulative bytes of blocks stored by put(), for _set_headroom
        self._headroom = limit_bytes  # used_bytes may grow to this before the free-space floor is hit
        self._limiter = trio.CapacityLimiter(DISK_THREADS)
        self._pause_lock = trio.Lock()
        self._hits = self._misses = self._evictions = self._inserts = self._rejected = 0
        self._checksum_failures = self._write_errors = self._read_errors = 0
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
        live = tier._segs.live
        live.update(dict.fromkeys(loaded.segments, 0))
        stored = 0
        for key, (location, tag) in entries.items():  # oldest first: the LRU order of the last run
            size = _size(location)
            tier.index.add(key, size, value=location, tag=tag)
            stored += size
            live[_segment(location)] += 1
        tier._seg_slack = dict(loaded.segments)
        tier._slack_total = sum(tier._seg_slack.values())
        tier._next_segment = loaded.next_segment
        tier._dir_bytes = loaded.dir_bytes
        tier._budget.used = stored + tier._slack_total + tier._dir_bytes + DIR_SLACK
        tier.startup_source = loaded.source
        tier.startup_discarded = loaded.discarded
        if loaded.discarded:
            log.warning("disk cache %s: deleted %d damaged entries or junk files at start-up", directory,
                        loaded.discarded)
        await tier._refresh_headroom()
        if tier.effective_limit_bytes < limit_bytes:
            # The floor, not diskCacheSize, is the limit now: say so once, with the numbers an
            # operator needs (a full shared disk otherwise looks like an NVMe tier that never hits).
            log.warning("disk cache %s: the filesystem keeps diskFreeRatio %.2f free, which leaves the "
                        "NVMe tier %d of its %d bytes (diskCacheSize); free space or lower diskFreeRatio",
                        directory, free_ratio, tier.effective_limit_bytes, limit_bytes)
        await tier._shrink_to_fit()
        tier.startup_seconds = time.perf_counter() - start
        log.info("disk cache %s: %d blocks in %d segments, %d bytes, loaded from %s in %.3f s", directory,
                 len(entries), len(live), tier.used_bytes, loaded.source, tier.startup_seconds)
        return tier

    def _load(self) -> _Loaded:
        discarded = 0
        for old in ("blocks", "tmp"):  # the layout before segments: one file per block
            path = os.path.join(self.directory, old)
            if os.path.isdir(path):
                discarded += segments.remove_junk(path)
        os.makedirs(self._segments_dir, exist_ok=True)
        _check_hole_punching(self._segments_dir)
        names, junk = segments.list_segments(self._segments_dir, _segment_id)
        discarded += junk
        index_path = os.path.join(self.directory, "index.bin")
        entries = _read_index(index_path)
        if entries is not None:
            # From here on the index is stale: only a clean shutdown writes a new one.
            os.unlink(index_path)
            source = "index"
            missing = [key for key, (location, _) in entries.items() if _segment(location) not in names]
            for key in missing:
                del entries[key]
            discarded += len(missing)
        else:
            scan = segments.scan_segments(names, _parse_at)
            # Tags come back as blocks are read again.
            entries = OrderedDict((key, (LOCATION.pack(f.segment, f.span, f.offset), 0))
                                  for key, f in scan.entries.items())
            discarded += scan.junk
            source = "scan"
        used = {_segment(location) for location, _ in entries.values()}
        slack: dict[int, int] = {}
        for segment, path in names.items():
            if segment in used:
                slack[segment] = segment_slack(os.stat(path).st_size)
            else:  # nothing live in it: a segment emptied while its deletion was in flight
                segments.unlink_quietly(path)
        dir_bytes = os.lstat(self._segments_dir).st_blocks * 512
        return _Loaded(entries, source, discarded, slack, dir_bytes, max(names, default=-1) + 1)

    async def close(self) -> None:
        """Write the index for a fast restart and release the directory lock."""
        entries = [(key, location, self.index.tag(key)) for key, location in self._lru_order()]
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
        return key in self.index

    def _location(self, key: bytes) -> int | None:
        """The block's location word; None if not stored (any thread: one call of the index)."""
        location: int | None = self.index.get(key)  # type: ignore[assignment]  # values are ints
        return location

    def _touch(self, key: bytes, tag: int) -> None:
        """A hit: the block is the most recently used; ``tag`` restores a tag lost by a crash scan."""
        index = self.index
        index.touch(key)
        if tag and not index.tag(key):
            index.set_tag(key, tag)

    async def get(self, key: bytes, tag: int = 0) -> bytes | None:
        """The block, or None if absent or damaged (a damaged block is punched out).

        ``tag`` (the reader's path tag) restores a tag lost by a crash scan."""
        location = self._location(key)
        if location is None:
            self._misses += 1
            return None
        self._touch(key, tag)
        path = self._segment_path(_segment(location))
        try:
            data = await trio.to_thread.run_sync(_read_entry, path, location, key, limiter=self._limiter)
        except FileNotFoundError:
            data = None  # evicted while we were reading
        except _Corrupt as exc:
            if self._location(key) == location:  # not a range punched by an eviction meanwhile
                self._checksum_failures += 1
                log.warning("disk cache block %s at %s is damaged (%s): discarded, will refetch",
                            key.hex(), path, exc)
                await self._free([key])
            data = None
        except OSError as exc:
            self._read_errors += 1
            log.warning("disk cache read of %s failed: %s", path, exc)
            data = None
        if data is None:
            if self._location(key) == location:
                await self._free([key])
            self._misses += 1
            return None
        self._hits += 1
        return data

    def read_in_thread(self, key: bytes) -> bytes | None:
        """The block's checked payload, read by the calling worker thread (not the trio
        thread), or None if it is not stored, was evicted meanwhile or is damaged (the
        trio thread's :meth:`get` then deals with it).  Touches no accounting: the trio
        thread calls :meth:`count_hit` with the bytes.  An entry is never rewritten in
        place, so a concurrent eviction costs at most a None."""
        location = self._location(key)
        if location is None:
            return None
        try:
            return _read_entry(self._segment_path(_segment(location)), location, key)
        except (OSError, _Corrupt):
            return None

    def locate(self, key: bytes) -> tuple[str, int, int] | None:
        """(segment path, offset, allocated bytes) of the block's entry, for a reader that
        checks and reads it itself; None if not stored.  Touches no accounting: the
        reader's hits are counted with :meth:`count_hit`.  An entry is never rewritten in
        place, so a reader that races an eviction finds zeros or no file, never other bytes."""
        location = self._location(key)
        if location is None:
            return None
        segment, size, offset = LOCATION.unpack(location)
        return self._segment_path(segment), offset, size

    def count_hit(self, key: bytes, tag: int = 0) -> None:
        """Account a hit read by :meth:`read_in_thread` (on the trio thread)."""
        self._hits += 1
        self._touch(key, tag)

    async def put(self, key: bytes, data: bytes, *, next_use: int | None = None, tag: int = 0) -> bool:
        """Store a block (``next_use``: the plan position that reads it), evicting by the
        plan-aware policy; False if it was not stored."""
        return (await self.put_many([(key, data, next_use, tag)]))[0]

    async def put_many(self, blocks: list[tuple[bytes, bytes, int | None, int]]) -> list[bool]:
        """Store blocks ``(key, data, next_use, tag)`` as :meth:`put` does, in one worker
        thread call (one thread hop, one ``statvfs`` and one open per segment for them
        all); per block whether it was stored.  Every block's space is reserved before
        the call, so the limit holds at every instant exactly as for single puts."""
        puts = [self._reserve(key, data, next_use) for key, data, next_use, _ in blocks]
        jobs = [(p.ops, p.write) for p in puts if p is not None]
        inserted_before = self._inserted_bytes
        space: tuple[int, int] | None = None
        errors: list[OSError | None] = []
        dir_bytes = -1
        try:
            if jobs:
                errors, dir_bytes, space = await trio.to_thread.run_sync(
                    _run_jobs, jobs, self._segments_dir, limiter=self._limiter)
        except OSError as exc:  # not raised by the worker (it reports per block): nothing is known
            errors = [exc] * len(jobs)
        except BaseException:
            errors = [OSError(errno.ECANCELED, "cancelled")] * len(jobs)
            raise
        finally:
            results = iter(errors)
            stored = []
            for put, (_, _, next_use, tag) in zip(puts, blocks):
                stored.append(self._settle(put, next(results), next_use, tag) if put is not None else True)
            self._keep_dir(dir_bytes)
        if space is not None:
            own = sum(p.need for p, ok in zip(puts, stored) if p is not None and p.write is not None and ok)
            self._set_headroom(space, self._inserted_bytes - inserted_before - own)
        return stored

    def _reserve(self, key: bytes, data: bytes, next_use: int | None) -> _Put | None:
        """Reserve a block's space, choose its victims and its place (None: already stored
        or being written, nothing to do)."""
        if key in self.index or key in self._writing:
            if next_use is not None:
                self.index.plan(key, next_use)
            return None
        need = allocated_bytes(len(data))
        segs = self._segs
        new_segment = segs.active is None or self._tail + need > SEGMENT_BYTES
        tail = 0 if new_segment else self._tail
        slack = segment_slack(tail + need) - segment_slack(tail)  # the segment's extent-tree bound grows
        limit = self.effective_limit_bytes
        chosen = (self.index.victims(need + slack, limit - self.used_bytes, next_use)
                  if need + slack <= limit else None)
        ops = Release()
        freed = sum(self._drop_entry(victim, ops) for victim in chosen or [])
        self._evictions += len(chosen or [])
        fits = chosen is not None and self.used_bytes - freed + need + slack <= limit
        location = 0
        write = None
        if fits:
            if new_segment:
                old = segs.active
                segs.active = self._next_segment
                self._next_segment += 1
                self._tail = 0
                segs.live[segs.active] = 0
                self._seg_slack[segs.active] = 0
                if old is not None and not segs.live[old]:
                    freed += self._drop_segment(old, ops)
            segment = segs.active
            assert segment is not None
            location = LOCATION.pack(segment, need, self._tail)
            write = _Write(segment, self._segment_path(segment), self._tail, key, data)
            self._tail += need
            segs.live[segment] += 1
            self._seg_slack[segment] += slack
            self._slack_total += slack
            self._writing[key] = need
        else:
            self._rejected += 1
            slack = 0
        # The new entry's reservation includes the extent-tree growth its range may cause:
        # part of the reservation until _settle, then counted with the segment.
        reserved = self._budget.reserve(need + slack if fits else 0, freed)
        return _Put(key, location, need if fits else 0, slack, reserved, write, ops)

    def _settle(self, put: _Put, error: OSError | None, next_use: int | None, tag: int) -> bool:
        """Account a reserved put whose worker returned ``error``; whether it was stored."""
        key = put.key
        self._writing.pop(key, None)
        write = put.write
        if write is None:
            self._budget.settle(put.reserved, 0)
            return False
        # The segment's slack grew for this put's range, written or not: counted with the
        # segment from now on.
        if error is not None:
            self._budget.settle(put.reserved, put.slack)
            self._write_errors += 1
            log.warning("disk cache write failed: %s", error)
            self._unclaim(write.segment)
            return False
        self._budget.settle(put.reserved, put.slack + put.need)
        self.index.add(key, put.need, next_use, value=put.location, tag=tag)
        self._inserted_bytes += put.need
        self._inserts += 1
        return True

    def _drop_entry(self, key: bytes, ops: Release) -> int:
        """Forget a stored block (its range is still allocated: the caller frees it with
        ``ops`` and keeps its bytes counted until then); the bytes freed, with its
        segment's slack if that segment goes too."""
        location: int = self.index.pop(key)  # type: ignore[assignment]  # the caller checked it is stored
        segment, size, offset = LOCATION.unpack(location)
        if self._segs.leave(segment, self._segment_path(segment), offset, size, ops):
            return size + self._drop_slack(segment)
        return size

    def _drop_segment(self, segment: int, ops: Release) -> int:
        """A segment without blocks goes: ``ops`` deletes its file; its slack."""
        self._segs.drop(segment, self._segment_path(segment), ops)
        return self._drop_slack(segment)

    def _drop_slack(self, segment: int) -> int:
        slack = self._seg_slack.pop(segment)
        self._slack_total -= slack
        return slack

    def _unclaim(self, segment: int) -> None:
        """A write into ``segment`` that was counted in its blocks did not happen (the
        worker punched whatever of it reached the file).  A sealed segment left without
        blocks this way (its other writes failed too) stays, counted, until the next
        start deletes it: write errors are rare, and the file holds only holes."""
        self._segs.live[segment] -= 1

    def _keep_dir(self, size: int) -> None:
        """A worker measured segments/ at ``size`` allocated bytes (-1: not measured)."""
        # Directories only grow while they exist; measurements may arrive out of order.
        if size > self._dir_bytes:
            self._budget.used += size - self._dir_bytes
            self._dir_bytes = size

    async def _free(self, keys: Iterable[bytes]) -> None:
        """Drop ``keys`` (stored ones) and free their ranges; their bytes stay counted
        until a worker has punched them."""
        ops = Release()
        freed = sum(self._drop_entry(key, ops) for key in keys if key in self.index)
        await self._budget.free(ops, freed, self._limiter)

    @contextlib.asynccontextmanager
    async def io_paused(self) -> AsyncIterator[None]:
        """Hold every disk worker slot: while inside, no segment of the tier changes
        (workers in progress finish first), so the directory can be measured as one
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

    def _lru_order(self) -> list[tuple[bytes, int]]:
        """(key, location) in eviction order (for the index: the next run starts from it)."""
        index = self.index
        return [(key, index.get(key)) for key in index.order()]  # type: ignore[misc]  # values are ints

    async def clear(self) -> None:
        """Drop every stored block (writes in progress still land).

        The index is emptied a shard at a time (``shards.SHARDS``, ~4k entries per shard
        at 10^6 blocks) with a checkpoint between shards, so FUSE requests are served
        while a large tier is dropped; a block stored meanwhile is newer than the drop
        and stays.  The active segment is sealed first, so every segment left without
        blocks is deleted whole; each shard's bytes stay counted (in flight, segments.Budget)
        until the worker has freed them."""
        segs, budget = self._segs, self._budget
        active, segs.active = segs.active, None  # the next put starts a new segment
        ops = Release()
        freed = 0
        if active is not None and not segs.live[active]:  # no block left in it already
            freed = self._drop_segment(active, ops)
            budget.reserve(0, freed)
        try:
            for shard in range(SHARDS):
                keys = self.index.shard_keys(shard)
                dropped = sum(self._drop_entry(key, ops) for key in keys)
                budget.reserve(0, dropped)  # counted until the space is freed
                freed += dropped
                await trio.lowlevel.checkpoint()
            if ops:  # (punches into segments deleted later in the drop are skipped)
                await trio.to_thread.run_sync(segments.free, ops, limiter=self._limiter)
        finally:
            budget.settle(freed, 0)

    @property
    def used_bytes(self) -> int:
        """Allocated bytes counted against the limit (segments.Budget): stored blocks,
        segment slack, the directory, and what writes and frees in progress hold."""
        return self._budget.used

    @property
    def effective_limit_bytes(self) -> int:
        return max(0, min(self.limit_bytes, self._headroom))

    @property
    def blocks(self) -> int:
        return len(self.index)

    def statistics(self) -> DiskStatistics:
        return DiskStatistics(
            self.used_bytes, self.limit_bytes, self.effective_limit_bytes, len(self.index),
            self._hits, self._misses, self._evictions, self._inserts, self._rejected,
            self._checksum_failures, self._write_errors, self._read_errors,
            self.startup_seconds, self.startup_source, self.startup_discarded,
            self._dir_bytes + DIR_SLACK + self._slack_total, len(self._segs.live),
        )

    # -- internals -------------------------------------------------------------------

    def _segment_path(self, segment: int) -> str:
        return os.path.join(self._segments_dir, f"{segment:08x}.seg")

    def _set_headroom(self, avail_bytes: tuple[int, int], stored_since: int = 0) -> None:
        """``avail_bytes`` was measured by a worker; ``stored_since`` bytes of blocks were
        stored after that worker started (their entries may postdate the measurement)."""
        available, total = avail_bytes
        floor = int(self.free_ratio * total)
        # What we surely held when ``available`` was measured, plus what the filesystem
        # could still give before the floor.  Only blocks whose entries were on disk at
        # that moment count: in-flight writes and punches may or may not have reached the
        # filesystem (``available`` may or may not include them), and neither may blocks
        # stored while the worker ran.  Counting any of them lets concurrent writes
        # overshoot the floor.
        self._headroom = self._budget.used - self._budget.in_flight - stored_since + available - floor

    async def _refresh_headroom(self) -> None:
        st = await trio.to_thread.run_sync(os.statvfs, self.directory)
        self._set_headroom((st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize))

    async def _shrink_to_fit(self) -> None:
        """Evict down to the limit (the limit may have shrunk since the last run)."""
        limit = self.effective_limit_bytes
        if self.used_bytes <= limit:
            return
        ops = Release()
        freed = 0
        for victim in self.index.victims(self.used_bytes - limit, 0, None) or self.index.order():
            if self.used_bytes - freed <= limit:
                break
            freed += self._drop_entry(victim, ops)
            self._evictions += 1
        await self._budget.free(ops, freed, self._limiter)


class _Corrupt(Exception):
    pass


def _segment_id(name: str) -> int | None:
    stem, dot, ext = name.partition(".")
    if ext != "seg" or not dot or not stem:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


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


def _header(key: bytes, data: bytes) -> bytes:
    body = struct.pack("<4sHHI16sQ", _MAGIC, _FORMAT, 0, len(data), key, xxhash.xxh3_64_intdigest(data))
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body))


def _parse_header(header: bytes) -> tuple[int, bytes, int] | None:
    """(payload length, key, payload checksum) of a sound header, else None."""
    if len(header) < HEADER_BYTES:
        return None
    magic, fmt, _, length, key, checksum, own = _HEADER.unpack_from(header)
    if magic != _MAGIC or fmt != _FORMAT or length > MAX_PAYLOAD_BYTES:
        return None
    if xxhash.xxh32_intdigest(memoryview(header)[:_HEADER_BODY]) != own:
        return None
    return length, key, checksum


def _read_entry(path: str, location: int, key: bytes) -> bytes:
    # Header and payload in two preads: the payload is read into its own bytes object
    # (no copy of a whole block out of a header+payload buffer).
    _, size, offset = LOCATION.unpack(location)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parsed = _parse_header(os.pread(fd, HEADER_BYTES, offset))
        if parsed is None:
            raise _Corrupt("bad header")
        length, stored_key, checksum = parsed
        if stored_key != key:
            raise _Corrupt("key mismatch")
        if allocated_bytes(length) != size:
            raise _Corrupt(f"length {length} does not fit the entry")
        payload = os.pread(fd, length, offset + HEADER_BYTES)
    finally:
        os.close(fd)
    if len(payload) != length:
        raise _Corrupt(f"length {len(payload)} != {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise _Corrupt("checksum mismatch")
    return payload


def _check_hole_punching(segments_dir: str) -> None:
    """Refuse a filesystem that cannot punch holes (``EOPNOTSUPP``): evicted blocks would
    stay allocated while counted free, and the limit would not hold.  ext4, xfs, btrfs
    and tmpfs can."""
    if not holes.can_punch(segments_dir):
        raise ConfigError(f"key 'diskCacheDir': the filesystem of {segments_dir!r} cannot punch holes "
                          "(fallocate PUNCH_HOLE), which the NVMe tier needs to free evicted blocks")


def _run_jobs(jobs: list[tuple[Release, _Write | None]], segments_dir: str
              ) -> tuple[list[OSError | None], int, tuple[int, int] | None]:
    """The jobs in order, each freeing its space first (so the bytes on disk stay within
    the reservation at every instant) and then writing its entry, each reported on its
    own (an error ends only its block); then the allocated bytes of ``segments_dir`` (-1
    if unknown) and one ``statvfs`` of the cache filesystem (None if it failed).  Raises
    nothing of its own: a block written is always reported as written."""
    errors: list[OSError | None] = []
    fds: dict[str, int] = {}
    dir_bytes = -1
    try:
        for ops, write in jobs:
            if ops:
                segments.free(ops)
                for path in ops.unlinks:
                    fd = fds.pop(path, None)
                    if fd is not None:
                        os.close(fd)
            if write is None:
                errors.append(None)
                continue
            errors.append(_write_entry(fds, write))
        with contextlib.suppress(OSError):
            dir_bytes = os.lstat(segments_dir).st_blocks * 512
    finally:
        for fd in fds.values():
            os.close(fd)
    try:
        st = os.statvfs(segments_dir)
    except OSError:
        return errors, dir_bytes, None
    return errors, dir_bytes, (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def _write_entry(fds: dict[str, int], write: _Write) -> OSError | None:
    """Write one entry (header and payload, one ``pwritev``); on an error, punch what of
    it reached the file."""
    fd = fds.get(write.path)
    try:
        if fd is None:
            fd = os.open(write.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fds[write.path] = fd
        data = write.data
        written = os.pwritev(fd, [_header(write.key, data), data], write.offset)
        if written != HEADER_BYTES + len(data):
            raise OSError(errno.ENOSPC, f"short write ({written} of {HEADER_BYTES + len(data)} bytes)")
        return None
    except OSError as exc:
        if fd is not None:
            with contextlib.suppress(OSError):
                holes.punch(fd, write.offset, allocated_bytes(len(write.data)))
        return exc


def _parse_at(fd: int, offset: int, size: int) -> tuple[bytes, int, None] | None:
    """The start-up scan's parser (segments.scan_segments): (key, allocated bytes, None) of
    the entry at ``offset`` of a segment of ``size`` bytes, if a sound header of an entry
    that fits the file lies there.  Payloads are checked when read."""
    parsed = _parse_header(os.pread(fd, HEADER_BYTES, offset))
    if parsed is None or offset + HEADER_BYTES + parsed[0] > size:
        return None
    return parsed[1], allocated_bytes(parsed[0]), None


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
        log.warning("disk cache index %s is damaged or of another format; scanning instead", path)
        return None
    keys = bytes(body[: count * KEY_BYTES])
    locations = np.frombuffer(body, dtype="<u8", offset=count * KEY_BYTES, count=count).tolist()
    tags = np.frombuffer(body, dtype="<u8", offset=count * (KEY_BYTES + 8), count=count).tolist()
    return OrderedDict(zip((keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)), zip(locations, tags)))


def _write_index(path: str, entries: list[tuple[bytes, int, int]]) -> None:
    """(key, location, path tag) per block, in eviction order."""
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
