"""BlockCache: the tiers composed, single-flight fetches, foreground before prefetch. A
lookup tries RAM, then NVMe (a hit is promoted to RAM), then runs the caller's ``fetch``
under a fetch slot (the cache knows nothing of the remote); at most one fetch per key is in
flight, run in the cache's own nursery so a cancelled caller never cancels work others wait
on; prefetch holds at most ``background_max`` of the shared slots, a waiting foreground
fetch goes first, and a foreground read, ``prefetch(urgent=True)`` or ``promote`` lifts a
queued prefetch; fetched blocks go to RAM at once and to NVMe in the background, with
pending NVMe writes capped in bytes (``max_pending_disk_bytes``) so a slow disk cannot grow
memory (docs/concurrency.md)."""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

import trio

from cubefs_fuse.cache.disk import DISK_BATCH_BLOCKS, DiskStatistics, DiskTier
from cubefs_fuse.cache.memory import MemoryTier, TierStatistics
from cubefs_fuse.cache.segments import DISK_THREADS
from cubefs_fuse.cache.shards import SHARDS, ShardedDict, first_byte
from cubefs_fuse.cache.tier import Tier
from cubefs_fuse.errors import FsError

log = logging.getLogger(__name__)

Fetcher = Callable[[], Awaitable[bytes]]

# NVMe writes that may be queued at once, in bytes.  256 MiB absorbs a burst of misses
# at 10 Gbit/s for ~0.2 s while an NVMe drive catches up, and bounds the RAM it can pin.
DEFAULT_MAX_PENDING_DISK_BYTES = 256 * 1024 * 1024
# Seconds the write-behind waits for a batch to gather when fewer than DISK_BATCH_BLOCKS
# are queued.  A cold file read by one reader (~1,000 files/s here) queues one block, so
# without the wait each block paid a thread hop of its own (~40 us of daemon CPU with
# its wake-ups, as much as the write itself); 10 ms gather ~10 of them per hop.  The
# block is in RAM meanwhile, so no reader waits on it; only its NVMe copy lands 10 ms
# later, and the bytes queued stay bounded by max_pending_disk_bytes.
DISK_BATCH_LINGER = 0.01
# Prefetch flights accepted at once; callers (the prefetch scheduler) keep far fewer.
MAX_PREFETCH_FLIGHTS = 4096
# Prefetch flights' NVMe reads taken by one worker-thread call: a plan issues dozens of
# prefetches at once, and one hop per block (GIL hand-offs) was a fifth of the daemon's
# busy time in the NVMe regime; 8 blocks of ~110 KB are well under a millisecond of
# reading, so a prefetch waits little for the others in its call.  At most
# DISK_THREADS such calls run at once (the disk tier's own limiter).
DISK_READ_BATCH = 8


class _DiskRead:
    """A prefetch flight's NVMe read, queued for a batched worker-thread call."""

    __slots__ = ("key", "tag", "done", "data")

    def __init__(self, key: bytes, tag: int) -> None:
        self.key = key
        self.tag = tag
        self.done = trio.Event()
        self.data: bytes | None = None
# _admitted_unread's value for a block the NVMe tier brought (a stall is never negative).
_FROM_DISK = -1.0


class Source(Enum):
    RAM = "ram"
    DISK = "disk"
    BACKEND = "backend"


class _Waiter:
    __slots__ = ("event", "foreground", "granted", "in_background_queue")

    def __init__(self, foreground: bool) -> None:
        self.event = trio.Event()
        self.foreground = foreground
        self.granted = False
        # Appended to the background queue and not yet taken off it (a promoted waiter
        # stays there, ignored, until the queue reaches it: promotion is O(1)).
        self.in_background_queue = False


@dataclass(frozen=True, slots=True)
class SlotStatistics:
    total: int
    background_max: int
    busy_foreground: int
    busy_background: int
    waiting_foreground: int
    waiting_background: int


class PrioritySlots:
    """``total`` slots; background holders never exceed ``background_max``; foreground first."""

    def __init__(self, total: int, background_max: int) -> None:
        if not 1 <= background_max <= total:
            raise ValueError("need 1 <= background_max <= total")
        self.total = total
        self.background_max = background_max
        self._busy_fg = 0
        self._busy_bg = 0
        self._fg: deque[_Waiter] = deque()
        self._bg: deque[_Waiter] = deque()
        self._bg_promoted = 0  # waiters in _bg that were promoted (skipped when reached)

    def _can_grant(self, foreground: bool) -> bool:
        if self._busy_fg + self._busy_bg >= self.total:
            return False
        return foreground or (self._busy_bg < self.background_max and not self._fg)

    def _grant(self, waiter: _Waiter) -> None:
        if waiter.foreground:
            self._busy_fg += 1
        else:
            self._busy_bg += 1
        waiter.granted = True

    def try_acquire(self) -> _Waiter | None:
        """A foreground slot now, without waiting, or None if none is free (release it
        with :meth:`release`)."""
        if not self._can_grant(True):
            return None
        waiter = _Waiter(True)
        self._grant(waiter)
        return waiter

    async def acquire(self, waiter: _Waiter) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._can_grant(waiter.foreground):
            self._grant(waiter)
            return
        if waiter.foreground:
            self._fg.append(waiter)
        else:
            self._bg.append(waiter)
            waiter.in_background_queue = True
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release(waiter)
            elif waiter.foreground:
                self._fg.remove(waiter)  # a promoted one's stale entry in _bg is skipped later
            else:
                self._bg.remove(waiter)
                waiter.in_background_queue = False
            raise

    def release(self, waiter: _Waiter) -> None:
        if waiter.foreground:
            self._busy_fg -= 1
        else:
            self._busy_bg -= 1
        waiter.granted = False
        while self._fg and self._can_grant(True):
            self._wake(self._fg.popleft())
        while self._bg:
            if self._bg[0].foreground:  # promoted: it waits (or waited) in _fg
                self._bg.popleft().in_background_queue = False
                self._bg_promoted -= 1
                continue
            if not self._can_grant(False):
                break
            waiter = self._bg.popleft()
            waiter.in_background_queue = False
            self._wake(waiter)

    def _wake(self, waiter: _Waiter) -> None:
        self._grant(waiter)
        waiter.event.set()

    def promote(self, waiter: _Waiter) -> None:
        """Make a background waiter a foreground one (queued or not yet queued), in O(1):
        its entry in the background queue stays, and is skipped when reached."""
        if waiter.foreground or waiter.granted:
            return
        waiter.foreground = True
        if not waiter.in_background_queue:
            return  # not queued yet (still reading the disk tier): it will queue as foreground
        self._bg_promoted += 1
        if self._can_grant(True):
            self._wake(waiter)
        else:
            self._fg.append(waiter)

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(self.total, self.background_max, self._busy_fg, self._busy_bg,
                              len(self._fg), len(self._bg) - self._bg_promoted)


class _Flight:
    __slots__ = ("done", "waiter", "prefetch", "data", "source", "error", "next_use", "tag", "joined")

    def __init__(self, foreground: bool, prefetch: bool, next_use: int | None, tag: int) -> None:
        self.done = trio.Event()
        self.waiter = _Waiter(foreground)
        # Fixed at start: a read that joins promotes the waiter to foreground, but the
        # flight still counts as (and among) the prefetch flights it was started as; an
        # urgent prefetch starts at foreground priority and is a prefetch all the same.
        self.prefetch = prefetch
        self.data: bytes | None = None
        self.source = Source.BACKEND
        self.error: BaseException | None = None
        self.next_use = next_use  # the plan position that reads this block (prefetch)
        self.tag = tag  # the file's path hash, kept with the block for re-planning
        self.joined = False  # an application read waited on this flight


@dataclass(frozen=True, slots=True)
class BlockCacheStatistics:
    ram: TierStatistics
    disk: DiskStatistics | None
    hits_ram: int
    hits_disk: int
    misses: int  # foreground gets that waited on the backend
    joined: int  # foreground gets that waited on a flight another caller started
    fetch_errors: int
    prefetch_issued: int
    prefetch_completed: int
    prefetch_failed: int
    prefetch_used: int  # prefetched blocks an application then read
    prefetch_wasted: int  # prefetched blocks evicted (or not admitted) before any read
    disk_writes_skipped: int
    pending_disk_bytes: int
    flights: int
    slots: SlotStatistics


class BlockCache:
    def __init__(
        self,
        nursery: trio.Nursery,
        memory: MemoryTier,
        disk: DiskTier | None,
        *,
        fetch_slots: int,
        prefetch_slots: int,
        max_pending_disk_bytes: int = DEFAULT_MAX_PENDING_DISK_BYTES,
    ) -> None:
        self._nursery = nursery
        self.memory = memory
        self.disk = disk
        # The tiers, fastest first: what every tier is asked alike (plans, membership) is
        # asked of each in turn; reads and stores, which differ by medium, go to each by name.
        self.tiers: tuple[Tier[object], ...] = (memory,) if disk is None else (memory, disk)
        self.slots = PrioritySlots(fetch_slots, max(1, min(prefetch_slots, fetch_slots - 1)))
        self._flights: dict[bytes, _Flight] = {}
        self._max_pending_disk = max_pending_disk_bytes
        self._pending_disk = 0
        self._drained = trio.Event()  # set while no NVMe write is pending (drain() waits on it)
        self._drained.set()
        self._hits_ram = self._hits_disk = self._misses = self._joined = self._fetch_errors = 0
        self._prefetch_issued = self._prefetch_completed = self._prefetch_failed = 0
        self._prefetch_flights = 0
        self._prefetch_used = self._prefetch_wasted = 0
        # Prefetched blocks no application read yet (values unused).  This and
        # _admitted_unread can hold every block of the RAM tier: sharded dicts of bytes and
        # floats, which the garbage collector does not track (cache/shards.py).
        self._unused_prefetched: ShardedDict[bytes, bool] = ShardedDict(first_byte)
        self._disk_writes_skipped = 0
        # Blocks admitted for a reader (``admit``) that no application read yet -> the
        # seconds that reader waited for them (_FROM_DISK: it came from the NVMe tier).
        # Entries go with the block (read, evicted, cleared), so this never outgrows the
        # RAM tier's block count.
        self._admitted_unread: ShardedDict[bytes, float] = ShardedDict(first_byte)
        # NVMe write-behind: blocks waiting for the writer task, which runs while any are.
        self._disk_queue: deque[tuple[bytes, bytes, int | None, int]] = deque()
        self._disk_writer = False
        self._disk_batches = 0  # put_many calls (thread hops) made by the writer
        self.disk_batch_linger = DISK_BATCH_LINGER  # 0 for a caller that waits on every write
        # Prefetch flights' NVMe reads waiting for a batched read, and the reader tasks.
        self._disk_reads: deque[_DiskRead] = deque()
        self._disk_readers = 0
        self._disk_read_batches = 0  # worker-thread calls the readers made
        memory.on_evict = self._evicted

    async def get(self, key: bytes, fetch: Fetcher, *, tag: int = 0) -> tuple[bytes, Source]:
        """The block's bytes and where they came from (an application read)."""
        data, source, _ = await self.read(key, fetch, tag=tag)
        return data, source

    async def read(self, key: bytes, fetch: Fetcher, *, tag: int = 0) -> tuple[bytes, Source, float]:
        """As :meth:`get`, plus the seconds an earlier wait of this reader cost when the
        block was brought by ``admit`` (its first read counts as the miss it was)."""
        found = self.read_now(key)
        if found is not None:
            return found
        flight = self._flights.get(key)
        if flight is None:
            flight = self._start(key, fetch, foreground=True, prefetch=False, tag=tag)
        else:
            self._joined += 1
            if flight.prefetch and not flight.joined:
                self._prefetch_used += 1
            self.slots.promote(flight.waiter)
        flight.joined = True
        await flight.done.wait()
        if flight.error is not None:
            raise flight.error
        assert flight.data is not None
        if flight.source is Source.DISK:
            self._hits_disk += 1
        else:
            self._misses += 1
        return flight.data, flight.source, 0.0

    def read_now(self, key: bytes) -> tuple[bytes, Source, float] | None:
        """:meth:`read` of a block in RAM, counted as that read counts it; None (nothing
        counted) when it is not in RAM.  Synchronous: no task or checkpoint per block."""
        data = self.memory.get(key)
        if data is None:
            return None
        if self._admitted_unread:
            stall = self._admitted_unread.pop(key, None)
            if stall == _FROM_DISK:
                self._hits_disk += 1
                return data, Source.DISK, 0.0
            if stall is not None:
                self._misses += 1
                return data, Source.BACKEND, stall
        self._hits_ram += 1
        if self._unused_prefetched.pop(key, None) is not None:
            self._prefetch_used += 1
        return data, Source.RAM, 0.0

    def lend(self, key: bytes) -> bytes | None:
        """A RAM block for a reader that serves it itself (the FUSE session in C), kept
        in memory and counted against the RAM limit until :meth:`give_back`.  Nothing is
        counted until :meth:`served`."""
        return self.memory.lend(key)

    def give_back(self, key: bytes) -> None:
        self.memory.give_back(key)

    def locate_on_disk(self, key: bytes) -> tuple[str, int, int] | None:
        """Where the NVMe tier holds ``key`` (``DiskTier.locate``), for a reader that checks
        and reads the entry itself; None if it is not there, a flight is bringing it, or
        its first read must count as the miss that brought it (``admit``)."""
        if self.disk is None or key in self._flights or (self._admitted_unread and key in self._admitted_unread):
            return None
        return self.disk.locate(key)

    def served(self, key: bytes, source: Source, tag: int = 0) -> tuple[Source, float]:
        """The borrower read a lent block from ``source`` (RAM or DISK), counted as
        :meth:`read_now` or a disk read counts it; what the read counts as, and the seconds
        an earlier wait cost (a block brought by ``admit`` counts as the miss it was)."""
        if source is Source.DISK:
            self._hits_disk += 1
            if self.disk is not None:
                self.disk.count_hit(key, tag)
            return Source.DISK, 0.0
        stall = self._admitted_unread.pop(key, None) if self._admitted_unread else None
        if stall == _FROM_DISK:
            self._hits_disk += 1
            return Source.DISK, 0.0
        if stall is not None:
            self._misses += 1
            return Source.BACKEND, stall
        self._hits_ram += 1
        self.memory.count_hit(key)
        if self._unused_prefetched.pop(key, None) is not None:
            self._prefetch_used += 1
        return Source.RAM, 0.0

    def wanted(self, key: bytes) -> bool:
        """Whether ``key`` is in no tier and no flight.  Only reads dicts (one membership
        test each, atomic under the GIL), so a worker thread may ask it: an answer that is
        stale by the time it is used costs at most one redundant fetch or one skipped one."""
        return not (key in self._flights or self.contains(key))

    def try_fetch_slot(self) -> object | None:
        """A foreground fetch slot if one is free now (for a fetch made outside a flight,
        ``admit``): it keeps the bound on concurrent fetches and never queues.  Give it
        back with :meth:`release_fetch_slot`."""
        return self.slots.try_acquire()

    def new_fetch_slot(self, *, foreground: bool) -> object:
        """A fetch slot for a fetch made outside a flight (:meth:`admit_prefetched`'s
        reads), to wait for at foreground or prefetch priority as a flight's would be
        (:meth:`acquire_fetch_slot`), promoted while it waits as a flight's is
        (:meth:`promote_fetch_slot`), given back with :meth:`release_fetch_slot`."""
        return _Waiter(foreground)

    async def acquire_fetch_slot(self, slot: object) -> None:
        assert isinstance(slot, _Waiter)
        await self.slots.acquire(slot)

    def promote_fetch_slot(self, slot: object) -> None:
        """A reader is about to ask for what ``slot`` is to fetch: it waits as a foreground
        fetch from now on (:meth:`promote`)."""
        assert isinstance(slot, _Waiter)
        self.slots.promote(slot)

    def release_fetch_slot(self, slot: object) -> None:
        assert isinstance(slot, _Waiter)
        self.slots.release(slot)

    async def load_from_disk(self, blocks: list[tuple[bytes, int]]) -> int:
        """Those of ``blocks`` ((key, tag) pairs) that are on NVMe and neither in RAM nor in
        flight, read in **one** worker-thread call (``DiskTier.read_in_thread``: checksum
        checked; a damaged or evicted block is left to the usual path) and admitted as NVMe
        hits at their first read (:meth:`admit`).  For a batch of blocks that will all be
        read at once (the fast path's batches): one thread hop instead of one per block.
        Returns how many were admitted."""
        disk = self.disk
        if disk is None:
            return 0
        wanted = [(key, tag) for key, tag in blocks if key in disk and key not in self.memory and key not in self._flights]
        if not wanted:
            return 0

        def read_all() -> list[bytes | None]:
            return [disk.read_in_thread(key) for key, _ in wanted]

        found = await trio.to_thread.run_sync(read_all, limiter=disk.limiter)
        admitted = 0
        for (key, tag), data in zip(wanted, found):
            if data is not None and key not in self.memory and key not in self._flights:
                self.admit(key, data, tag=tag, from_disk=True)
                admitted += 1
        return admitted

    def admit(self, key: bytes, data: bytes, *, tag: int = 0, stall: float = 0.0, from_disk: bool = False) -> None:
        """A block read for a reader outside a flight (a lookup that read the whole file,
        from the source or, ``from_disk``, from NVMe): into RAM (and a source block, in
        the background, to NVMe) as if a flight had brought it.  Its first application
        read counts as what it was: a miss that waited ``stall`` seconds, or an NVMe hit
        (``read``).  A block already in RAM or in flight is left alone."""
        if key in self.memory or key in self._flights:
            return
        if from_disk:
            assert self.disk is not None
            self.disk.count_hit(key, tag)
        else:
            self._write_behind(key, data, None, tag)
        if self.memory.put(key, data, tag=tag):
            self._admitted_unread[key] = _FROM_DISK if from_disk else stall

    def admit_prefetched(self, key: bytes, data: bytes, *, next_use: int | None, tag: int = 0) -> None:
        """A block a plan's prefetch read outside a flight (a small file that came with its
        stat, ``FileBlocks.prefetch_file``): into RAM ranked at ``next_use`` (and, in the
        background, to NVMe) as a prefetch flight would have put it, and counted as one,
        issued and completed: used at its first read, wasted if evicted unread.  A block
        already in RAM or in flight is left alone."""
        if key in self.memory or key in self._flights:
            return
        self._prefetch_issued += 1
        self._write_behind(key, data, next_use, tag)
        self._prefetch_landed(key, self.memory.put(key, data, next_use=next_use, tag=tag), joined=False)

    def join_prefetched(self, key: bytes, stall: float) -> None:
        """A reader waited ``stall`` seconds for the prefetch that brought ``key`` outside a
        flight (:meth:`admit_prefetched`), as a read joins a prefetch flight, and is counted
        as that read is (:meth:`read`): the prefetch used, the reader's first read of the
        block the miss it waited for."""
        if key in self.memory and key not in self._admitted_unread:
            self._joined += 1
            if self._unused_prefetched.pop(key, None) is not None:
                self._prefetch_used += 1
            self._admitted_unread[key] = stall

    def _prefetch_landed(self, key: bytes, stored: bool, *, joined: bool) -> None:
        """A prefetched block came (``stored``: the RAM tier took it); a read waited for it
        (``joined``): neither used nor wasted then."""
        self._prefetch_completed += 1
        if not joined:
            if stored:
                self._unused_prefetched[key] = True
            else:
                self._prefetch_wasted += 1

    def prefetch(self, key: bytes, fetch: Fetcher, *, next_use: int | None = None, tag: int = 0,
                 urgent: bool = False) -> bool:
        """Bring a block into RAM in the background; False if already there or too busy.

        ``next_use`` is the plan position that will read the block (for eviction).
        ``urgent``: a reader is about to ask for it (:meth:`promote`): fetched at
        foreground priority, beyond the prefetch slots, and still counted as a prefetch."""
        if key in self.memory:
            if next_use is not None:
                self.plan(key, next_use)
            return False
        if key in self._flights:
            if urgent:
                self.promote(key)
            return False
        if self._prefetch_flights >= MAX_PREFETCH_FLIGHTS:
            return False
        self._prefetch_issued += 1
        self._start(key, fetch, foreground=urgent, prefetch=True, next_use=next_use, tag=tag)
        return True

    def promote(self, key: bytes) -> None:
        """A reader is about to ask for ``key`` (a plan's next positions): its flight, if it
        is a prefetch still waiting behind the prefetch slots, waits as a foreground fetch
        instead, as if the read had come.  Not a read: nothing is counted.  O(prefetches
        waiting) at worst (the slot queue's removal), as a read that joins one."""
        flight = self._flights.get(key)
        if flight is not None:
            self.slots.promote(flight.waiter)

    def plan(self, key: bytes, next_use: int) -> None:
        """An active plan reads ``key`` at ``next_use`` (every tier evicts by it)."""
        for tier in self.tiers:
            tier.plan(key, next_use)

    def unplan(self, key: bytes) -> None:
        """No active plan reads ``key`` any more."""
        for tier in self.tiers:
            tier.unplan(key)

    def tagged_shard(self, shard: int) -> tuple[list[bytes], list[int]]:
        """Keys and path tags of the blocks of one shard (``shards.SHARDS``) in any tier
        (a block in two tiers may be listed twice): a re-ranking walks the cache shard by
        shard."""
        keys: list[bytes] = []
        tags: list[int] = []
        for tier in self.tiers:
            tier_keys, tier_tags = tier.tagged_shard(shard)
            keys += tier_keys
            tags += tier_tags
        return keys, tags

    def unplan_some(self, count: int) -> bool:
        """Make up to ``count`` planned blocks of each tier unplanned; True if some remain."""
        more = False
        for tier in self.tiers:
            more = tier.unplan_some(count) or more
        return more

    def _evicted(self, key: bytes) -> None:
        self._admitted_unread.pop(key, None)
        if self._unused_prefetched.pop(key, None) is not None:
            self._prefetch_wasted += 1

    async def warm(self, key: bytes, fetch: Fetcher) -> None:
        """Bring a block into the cache at prefetch priority and wait for it.

        Not an application read: it counts as neither hit nor miss."""
        if self.contains(key):
            return
        flight = self._flights.get(key)
        if flight is None:
            self._prefetch_issued += 1
            flight = self._start(key, fetch, foreground=False, prefetch=True)
            flight.joined = True  # a warmup waits for it: neither used nor wasted prefetch
        await flight.done.wait()
        if flight.error is not None:
            raise flight.error

    async def settled(self, key: bytes) -> None:
        """Wait until ``key``'s flight, if one is in progress, has ended.  Not a read: it
        neither counts nor joins (a prefetch waited on this way stays used or wasted by
        what applications do with it)."""
        flight = self._flights.get(key)
        if flight is not None:
            await flight.done.wait()

    def contains(self, key: bytes) -> bool:
        """Whether a tier holds ``key`` (nothing counted, nothing touched)."""
        for tier in self.tiers:
            if key in tier:
                return True
        return False

    async def clear(self) -> None:
        """Drop every block of both tiers (``cubefs-fuse drop-cache``), a shard at a time
        with a checkpoint between (no step proportional to the cache's size)."""
        for shard in range(SHARDS):
            self.memory.clear_shard(shard)
            self._unused_prefetched.clear_shard(shard)
            self._admitted_unread.clear_shard(shard)
            await trio.lowlevel.checkpoint()
        if self.disk is not None:
            await self.disk.clear()

    async def drain(self) -> None:
        """Wait until every queued NVMe write has finished (used at shutdown)."""
        while self._pending_disk:
            await self._drained.wait()

    def _start(self, key: bytes, fetch: Fetcher, *, foreground: bool, prefetch: bool, next_use: int | None = None,
               tag: int = 0) -> _Flight:
        flight = _Flight(foreground, prefetch, next_use, tag)
        self._flights[key] = flight
        if prefetch:
            self._prefetch_flights += 1
        self._nursery.start_soon(self._fly, key, fetch, flight)
        return flight

    async def _fly(self, key: bytes, fetch: Fetcher, flight: _Flight) -> None:
        prefetch = flight.prefetch
        try:
            if self.disk is None or key not in self.disk:
                data = None
            elif prefetch:
                data = await self._disk_get_batched(key, flight.tag)
            else:
                data = await self.disk.get(key, flight.tag)
            if data is not None:
                flight.source = Source.DISK
            else:
                await self.slots.acquire(flight.waiter)
                try:
                    data = await fetch()
                finally:
                    self.slots.release(flight.waiter)
                self._write_behind(key, data, flight.next_use, flight.tag)
            stored = self.memory.put(key, data, next_use=flight.next_use, tag=flight.tag)
            flight.data = data
            if prefetch:
                self._prefetch_landed(key, stored, joined=flight.joined)
        except BaseException as exc:
            self._fetch_errors += 1
            if prefetch:
                self._prefetch_failed += 1
            flight.error = exc if isinstance(exc, Exception) else FsError(errno.EIO, "cache shutting down")
            if not isinstance(exc, Exception):
                raise
        finally:
            del self._flights[key]
            if prefetch:
                self._prefetch_flights -= 1
            flight.done.set()

    async def _disk_get_batched(self, key: bytes, tag: int) -> bytes | None:
        """``DiskTier.get`` for a prefetch flight, its read made together with other
        flights' in one worker-thread call (``DiskTier.read_in_thread``, checksum checked).
        A block that call did not return (evicted meanwhile, damaged, an error) goes
        through ``DiskTier.get``, which reads it again and deals with it."""
        assert self.disk is not None
        request = _DiskRead(key, tag)
        self._disk_reads.append(request)
        if self._disk_readers < DISK_THREADS:
            self._disk_readers += 1
            self._nursery.start_soon(self._read_from_disk)
        await request.done.wait()
        if request.data is None:
            return await self.disk.get(key, tag)
        self.disk.count_hit(key, tag)
        return request.data

    async def _read_from_disk(self) -> None:
        """A reader task: takes up to DISK_READ_BATCH queued reads per worker-thread call
        until the queue is empty (every request it took is answered, also on errors)."""
        disk = self.disk
        assert disk is not None
        queue = self._disk_reads
        batch: list[_DiskRead] = []
        try:
            while queue:
                batch = [queue.popleft() for _ in range(min(len(queue), DISK_READ_BATCH))]
                keys = [r.key for r in batch]
                self._disk_read_batches += 1
                found = await trio.to_thread.run_sync(lambda: [disk.read_in_thread(k) for k in keys],
                                                      limiter=disk.limiter)
                for request, data in zip(batch, found):
                    request.data = data
                    request.done.set()
                batch = []
        finally:
            self._disk_readers -= 1
            for request in batch:  # interrupted mid-call: those flights read for themselves
                request.done.set()

    def _write_behind(self, key: bytes, data: bytes, next_use: int | None, tag: int) -> None:
        if self.disk is None:
            return
        if self._pending_disk + len(data) > self._max_pending_disk:
            self._disk_writes_skipped += 1
            return
        if self._drained.is_set():
            self._drained = trio.Event()
        self._pending_disk += len(data)
        self._disk_queue.append((key, data, next_use, tag))
        if not self._disk_writer:
            self._disk_writer = True
            self._nursery.start_soon(self._write_to_disk)

    async def _write_to_disk(self) -> None:
        """The one write-behind task: drains the queue in batches of up to
        DISK_BATCH_BLOCKS, one thread hop each (``DiskTier.put_many``), waiting
        DISK_BATCH_LINGER before a batch that would not be full; ends when empty."""
        assert self.disk is not None
        queue = self._disk_queue
        try:
            while queue:
                if len(queue) < DISK_BATCH_BLOCKS:
                    await trio.sleep(self.disk_batch_linger)  # let a batch gather: one hop for several blocks
                batch = [queue.popleft() for _ in range(min(len(queue), DISK_BATCH_BLOCKS))]
                self._disk_batches += 1
                try:
                    await self.disk.put_many(batch)
                finally:
                    self._written(batch)
        finally:
            self._disk_writer = False
            if queue:  # cancelled with blocks queued (shutdown): they are not written
                self._written(list(queue))
                queue.clear()

    def _written(self, batch: list[tuple[bytes, bytes, int | None, int]]) -> None:
        """The batch's NVMe writes ended (stored, failed or given up): no longer pending."""
        self._pending_disk -= sum(len(data) for _, data, _, _ in batch)
        if not self._pending_disk:
            self._drained.set()

    def statistics(self) -> BlockCacheStatistics:
        return BlockCacheStatistics(
            ram=self.memory.statistics(),
            disk=self.disk.statistics() if self.disk is not None else None,
            hits_ram=self._hits_ram,
            hits_disk=self._hits_disk,
            misses=self._misses,
            joined=self._joined,
            fetch_errors=self._fetch_errors,
            prefetch_issued=self._prefetch_issued,
            prefetch_completed=self._prefetch_completed,
            prefetch_failed=self._prefetch_failed,
            prefetch_used=self._prefetch_used,
            prefetch_wasted=self._prefetch_wasted,
            disk_writes_skipped=self._disk_writes_skipped,
            pending_disk_bytes=self._pending_disk,
            flights=len(self._flights),
            slots=self.slots.statistics(),
        )
