"""The daemon's sample store: opaque entries under (owner uid, cache name, integer key),
what ``cube_torch.CachedDataset`` caches, shared by every rank and job of the node and kept
across restarts, in a RAM tier (promoted reads, and puts NVMe did not take) and an NVMe tier
(files.py: one segment per put batch, written straight from the connection's ring) under
node-wide budgets (``sampleCacheMemSize``, ``sampleCacheDiskSize``), evicted by
a ``BlockIndex`` (cache/_index.c) per tier over every cache of the node, with names scoped by owner (``~UID/NAME``
another user's, readable only when shared or by an administrator). All state lives on the
trio thread, file I/O runs in worker threads, and work proportional to a cache (a plan, a
drop, the start-up merge) runs in chunks of :data:`CHUNK` with checkpoints
(docs/contracts.md, "The processed-sample cache (daemon store)")."""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from cubefs_fuse.cache._index import BlockIndex
from cubefs_fuse.cache.tier import SCRATCH_FRACTION
from cubefs_fuse.cache.segments import DISK_THREADS, Budget, LiveCounts, Release
from cubefs_fuse.cache.shards import SHARD, ShardedDict, low_byte
from cubefs_fuse.errors import BadRequest, Forbidden, NoRoom, NotFound
from cubefs_fuse.limits import (MAX_SAMPLE_CACHES, MAX_SAMPLE_CACHES_PER_UID, MAX_SAMPLE_KEYS, MAX_SAMPLE_PLAN_KEYS,
                                MAX_SAMPLE_PLAN_SOURCES, MAX_SAMPLE_PLANNED_KEYS, sample_cache_reference)
from cubefs_fuse.samples import files, index
from cubefs_fuse.samples.index import FIELD, charge_of, offset_of, segment_of, size_of

log = logging.getLogger(__name__)

# What one RAM entry costs beyond its bytes: the bytes object's header (33), its slots in
# the index's two dicts and its location word (~120, index.py) and the eviction order's
# record (~60, cache/_index.c): ~215, rounded up.
RAM_ENTRY_OVERHEAD = 256
# Entries handled between two checkpoints of the trio thread (a plan's re-ranking, a
# drop, the start-up merge): ~4 ms of Python each, so FUSE requests never wait longer.
CHUNK = 4096
# A re-ranking handles each entry in both policies (``plan`` or ``unplan``, ~2 us each):
# ~16 ms per CHUNK measured at 10^6 entries, so it takes a quarter as many per step.
RERANK_CHUNK = CHUNK // 4
# Entries one reading thread takes at least: below 16 (~2 MiB of typical samples) a thread
# hop (~100 us here) costs more than the reads it parallelises.
READ_SHARE = 16

# (key, cache id): one policy key over every cache of the node.  The key comes first and
# little-endian, so the policies' hash tables (split by a key's first byte) spread one
# cache's keys over all their shards; cache id first put a whole cache in one shard.
_PK = struct.Struct("<qI")
# A put's payload: bytes, or a view of the connection's ring (valid until the put returns).
Payload = bytes | memoryview


@dataclass(frozen=True, slots=True)
class SampleCacheStatistics:
    name: str
    owner: int
    entries: int
    bytes: int  # payload bytes of the entries held (in RAM, on NVMe or both)
    ram_bytes: int
    disk_bytes: int  # allocated bytes of its files
    hits: int
    misses: int
    stored: int  # entries put
    evictions: int  # entries that left the store to make room
    planned: int  # keys of its current plan (0: none)
    shared: bool


@dataclass(frozen=True, slots=True)
class SampleStoreStatistics:
    ram_used_bytes: int
    ram_limit_bytes: int
    disk_used_bytes: int
    disk_limit_bytes: int
    ram_entries: int
    disk_entries: int
    corrupt: int  # damaged files found on reads (deleted, answered as misses)
    write_errors: int
    dropped: int  # entries a put could not keep (no room in either tier, loading, free-space floor)
    loaded: bool
    startup_seconds: float
    startup_discarded: int
    caches: tuple[SampleCacheStatistics, ...]
    hits: int = 0  # keys every cache's gets answered with an entry, dropped caches' included
    hit_bytes: int = 0  # the bytes of those entries


class _Plan:
    """A cache's next order: key -> first position, and which keys a get consumed."""

    def __init__(self, keys: np.ndarray, positions: np.ndarray | None = None) -> None:
        if positions is None:
            positions = np.arange(len(keys), dtype=np.int64)
        order = np.lexsort((positions, keys))  # by key, a key's earliest position first
        ordered = keys[order]
        first = np.ones(len(ordered), dtype=bool)
        first[1:] = ordered[1:] != ordered[:-1]
        self.keys = ordered[first]
        self.positions = positions[order][first].astype(np.int32)  # < MAX_SAMPLE_PLAN_KEYS
        self.consumed = np.zeros(len(self.keys), dtype=bool)
        self.length = len(keys)

    @classmethod
    def build(cls, data: bytes) -> _Plan:  # a worker thread: O(n log n)
        return cls(np.frombuffer(data, dtype="<i8").astype(np.int64))

    @classmethod
    def merge(cls, parts: list[np.ndarray]) -> _Plan:  # a worker thread: O(n log n)
        """One plan of several sources' orders read side by side (the ranks of a node, each
        its share of the epoch): a key's position is its position in its own order."""
        if len(parts) == 1:
            return cls(parts[0])
        return cls(np.concatenate(parts), np.concatenate([np.arange(len(p), dtype=np.int64) for p in parts]))

    def _index(self, key: int) -> int:
        i = int(np.searchsorted(self.keys, key))
        return i if i < len(self.keys) and int(self.keys[i]) == key else -1

    def next_use(self, key: int) -> int | None:
        i = self._index(key)
        return int(self.positions[i]) if i >= 0 and not self.consumed[i] else None

    def next_uses(self, keys: list[int]) -> list[int]:
        """Each key's next position, -1 where none (vectorised: a chunk of a re-ranking)."""
        wanted = np.array(keys, dtype=np.int64)
        i = np.searchsorted(self.keys, wanted)
        i[i >= len(self.keys)] = 0
        hit = (self.keys[i] == wanted) & ~self.consumed[i] if len(self.keys) else np.zeros(len(keys), dtype=bool)
        out: list[int] = np.where(hit, self.positions[i] if len(self.keys) else 0, -1).tolist()
        return out

    def consume(self, key: int) -> bool:
        i = self._index(key)
        if i < 0 or self.consumed[i]:
            return False
        self.consumed[i] = True
        return True


class _Got:
    """A get's answer, key by key (the prefix of the keys answered): ``data``: the entry's
    bytes, True (in the destination, not kept), or None (a miss); ``places``: its offset
    in the destination; ``sizes``: its length; ``filled``: whether it is in the
    destination already (read there from NVMe) rather than to be copied there."""

    __slots__ = ("data", "places", "sizes", "filled")

    def __init__(self) -> None:
        self.data: list[bytes | bool | None] = []
        self.places: list[int] = []
        self.sizes: list[int] = []
        self.filled: list[bool] = []

    @classmethod
    def misses(cls, count: int) -> _Got:
        got = cls()
        got.data = [None] * count
        got.places = [0] * count
        got.sizes = [0] * count
        got.filled = [False] * count
        return got


class _Cache:
    __slots__ = ("id", "owner", "name", "entries", "ram", "plan", "plan_parts", "plan_generation", "hits", "misses",
                 "stored", "evictions", "ram_bytes", "disk_bytes", "bytes", "io_lock", "writing", "dropped", "shared",
                 "segments")

    def __init__(self, cache_id: int, owner: int, name: str, shared: bool) -> None:
        self.id = cache_id
        self.owner = owner
        self.name = name
        # Every entry: key -> its location word (index.py: size and NVMe place), and the
        # RAM copies of those in RAM; atoms in shards, never walked by the collector.
        self.entries: ShardedDict[int, int] = ShardedDict(low_byte)
        self.ram: ShardedDict[int, bytes] = ShardedDict(low_byte)
        self.plan: _Plan | None = None
        # Its plan's sources (the peer pid of each process that plans it: a node's ranks each
        # send their share of the epoch), least recently planned first: source -> its keys.
        self.plan_parts: OrderedDict[int, np.ndarray] = OrderedDict()
        self.plan_generation = 0  # a plan being merged is stale once another one has come
        self.hits = self.misses = self.stored = self.evictions = 0
        self.ram_bytes = self.disk_bytes = self.bytes = 0
        self.io_lock = trio.Lock()  # its NVMe writes and its removal, one at a time
        self.writing: set[int] = set()  # keys whose entry is being written
        self.dropped = False
        self.shared = shared
        self.segments = LiveCounts()  # segment id -> its entries on NVMe (counted in disk_entries)


class SampleStore:
    def __init__(self, root: str, mem_limit: int, disk_limit: int, free_ratio: float, *,
                 shared: frozenset[tuple[int, str]] = frozenset(), admins: frozenset[int] | None = None) -> None:
        self.root = root
        self.mem_limit = mem_limit
        self.disk_limit = disk_limit
        self.free_ratio = free_ratio
        self._floor_warned = False  # the free-space floor was reached once (logged)
        self.shared = shared
        self.admins = admins if admins is not None else frozenset({0, os.geteuid()})
        self.ram_policy = BlockIndex(mem_limit // SCRATCH_FRACTION, key_bytes=_PK.size)
        self.disk_policy = BlockIndex(disk_limit // SCRATCH_FRACTION, key_bytes=_PK.size)
        self.ram_used = 0
        self._budget = Budget()  # allocated bytes on NVMe, including writes and frees in flight
        self.ram_entries = self.disk_entries = 0
        self._caches: dict[tuple[int, str], _Cache] = {}
        self._by_id: dict[int, _Cache] = {}
        self._next_id = 0
        self._per_uid: dict[int, int] = {}
        self._plans: OrderedDict[int, _Cache] = OrderedDict()  # caches with a plan, least recently planned first
        self.planned_keys = 0  # distinct keys of every plan held (at most MAX_SAMPLE_PLANNED_KEYS)
        self.corrupt = self.write_errors = self.dropped = 0
        # Every cache's hits and the bytes of their entries, kept when a cache is dropped (its
        # own counters go with it): what applications read from the store (stats.app_reads).
        self.hits = self.hit_bytes = 0
        self.loaded = False
        self.startup_seconds = 0.0
        self.startup_discarded = 0
        self._limiter = trio.CapacityLimiter(DISK_THREADS)
        # Segment ids: unique in the store, so a late eviction of a dropped cache's entry can
        # never punch a segment of a new cache of the same name.
        self._next_segment = 0
        self.segment_entries = MAX_SAMPLE_KEYS  # entries per segment: 1 where holes cannot be punched

    @classmethod
    async def open(cls, nursery: trio.Nursery, directory: str, mem_limit: int, disk_limit: int,
                   free_ratio: float, *, shared: frozenset[tuple[int, str]] = frozenset(),
                   admins: frozenset[int] | None = None) -> SampleStore:
        """The store over ``directory`` (created); its NVMe entries load in the background."""
        store = cls(directory, mem_limit, disk_limit, free_ratio, shared=shared, admins=admins)
        if disk_limit:
            if not await trio.to_thread.run_sync(files.prepare, directory):
                store.segment_entries = 1
                log.warning("sample store: %s cannot punch holes; entries are written one per segment file", directory)
            nursery.start_soon(store._load)
        else:
            store.loaded = True
        return store

    # -- names and permissions --------------------------------------------------------

    def resolve(self, caller: int, reference: Any, *, write: bool = False, drop: bool = False) -> tuple[int, str]:
        """(owner uid, name) of a cache reference, or Forbidden/BadRequest."""
        try:
            foreign, name = sample_cache_reference(reference)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        owner = caller if foreign is None else foreign
        if owner == caller:
            return owner, name
        if write:
            raise Forbidden(f"sample cache {name!r} belongs to uid {owner}: only its owner writes to it")
        if caller in self.admins or (not drop and (owner, name) in self.shared):
            return owner, name
        raise Forbidden(f"sample cache {name!r} of uid {owner} is not shared with uid {caller}"
                        + ("" if not drop else ": only its owner or root may drop it"))

    def _cache(self, owner: int, name: str, *, create: bool) -> _Cache | None:
        cache = self._caches.get((owner, name))
        if cache is not None or not create:
            return cache
        if len(self._caches) >= MAX_SAMPLE_CACHES:
            raise NoRoom(f"the daemon keeps {MAX_SAMPLE_CACHES} sample caches already: drop one "
                         "('cubefs-fuse drop-cache --samples NAME')")
        if self._per_uid.get(owner, 0) >= MAX_SAMPLE_CACHES_PER_UID:
            raise NoRoom(f"uid {owner} has {MAX_SAMPLE_CACHES_PER_UID} sample caches already: drop one "
                         "('cubefs-fuse drop-cache --samples NAME')")
        cache = _Cache(self._next_id, owner, name, (owner, name) in self.shared)
        self._next_id += 1
        self._caches[(owner, name)] = self._by_id[cache.id] = cache
        self._per_uid[owner] = self._per_uid.get(owner, 0) + 1
        return cache

    # -- the three operations ---------------------------------------------------------

    async def get_many(self, caller: int, reference: Any, keys: list[int]) -> list[bytes | None]:
        """Each key's entry or None, in order (as bytes: what a caller without a ring gets)."""
        got = await self._get(caller, reference, keys, None)
        return [data if isinstance(data, bytes) else None for data in got.data]

    async def get_into(self, caller: int, reference: Any, keys: list[int],
                       dest: memoryview) -> tuple[list[tuple[int, int] | None], list[tuple[int, bytes]]]:
        """Each key's entry laid out in ``dest`` (a data connection's ring: page-aligned), for
        the prefix of the keys that fits it (at least one key): its (offset, length) in
        ``dest``, or None (a miss).  Entries read from NVMe are read straight into ``dest``
        (files.py's direct read: no copy, no fresh memory), each at an ALIGN boundary;
        entries found in RAM are returned as (offset, bytes) for the caller to copy there
        (in steps, on the trio thread)."""
        got = await self._get(caller, reference, keys, dest)
        layout: list[tuple[int, int] | None] = []
        copies: list[tuple[int, bytes]] = []
        for data, place, size, filled in zip(got.data, got.places, got.sizes, got.filled):
            if data is None or data is False:
                layout.append(None)
                continue
            layout.append((place, len(data) if isinstance(data, bytes) else size))
            if not filled:
                assert isinstance(data, bytes)
                copies.append((place, data))
        return layout, copies

    async def _get(self, caller: int, reference: Any, keys: list[int], dest: memoryview | None) -> _Got:
        owner, name = self.resolve(caller, reference)
        cache = self._cache(owner, name, create=owner == caller and self.loaded)
        if cache is None or cache.dropped:
            return _Got.misses(len(keys))
        got = _Got()
        out = got.data
        from_disk: list[int] = []
        # key, segment, offset and size of each entry read from NVMe, as they were when asked
        located: list[tuple[int, int, int, int]] = []
        targets: list[files.Target] = []
        at = 0  # the next free byte of dest
        entries, ram = cache.entries.shards, cache.ram.shards
        for i, key in enumerate(keys):
            word = entries[key & SHARD].get(key)
            copy = None if word is None else ram[key & SHARD].get(key)
            on_disk = word is not None and charge_of(word) != 0
            place = at
            if (copy is not None or on_disk) and dest is not None:
                assert word is not None
                # An entry from NVMe takes whole blocks at a block boundary (its direct read).
                place, need = (at, len(copy)) if copy is not None else (files.up(at), files.up(size_of(word)))
                if place + need > len(dest):
                    if i:
                        break
                    copy, on_disk = None, False  # larger than dest (a ring smaller than an entry): a miss
                else:
                    at = place + need
            out.append(copy)
            got.places.append(place)
            got.sizes.append(0 if word is None else size_of(word))
            got.filled.append(False)
            if copy is not None:
                self.ram_policy.touch(_PK.pack(key, cache.id))
            elif on_disk:
                assert word is not None
                from_disk.append(i)
                located.append((key, segment_of(word), offset_of(word), size_of(word)))
                if dest is not None:
                    # A private copy too where the entry could enter the RAM tier (see below).
                    keep = bool(self.mem_limit) and key not in cache.ram
                    targets.append(files.Target(dest[place:place + files.up(size_of(word))], keep))
        keys = keys[:len(out)]
        if from_disk:
            try:
                read = await self._read(owner, name, located, targets if dest is not None else None)
            finally:
                for target in targets:  # (views of the caller's memory: none may outlive the call)
                    target.memory.release()
            if cache.dropped:  # dropped meanwhile: nothing of it may enter the tiers again
                return _Got.misses(len(keys))
            damaged = Release()
            freed = 0
            for i, (key, segment, offset, size), data in zip(from_disk, located, read):
                word = cache.entries.get(key)
                if isinstance(data, bytes) and len(data) != size:
                    continue  # rewritten meanwhile: a miss (its room in dest was counted for the old size)
                if isinstance(data, bytes) or data is True:
                    out[i] = data
                    got.filled[i] = dest is not None
                    if (isinstance(data, bytes) and word is not None and key not in cache.ram
                            and size_of(word) == len(data)):
                        self._admit_ram(cache, key, data)
                    if word is not None:
                        self.disk_policy.touch(_PK.pack(key, cache.id))
                    continue
                if word is None or not charge_of(word) or (segment_of(word), offset_of(word)) != (segment, offset):
                    continue  # evicted or rewritten meanwhile (its range freed under the read): a miss
                if data is False:
                    self.corrupt += 1
                    log.warning("sample cache %r of uid %d: entry %d was damaged on NVMe; freed", name, owner, key)
                freed += self._forget_disk(cache, key, damaged)  # damaged, or its segment is gone
            if damaged:
                await self._budget.free(damaged, freed, self._limiter)
        hits = sum(1 for data in out if data is not None)
        cache.hits += hits
        self.hits += hits
        self.hit_bytes += sum(len(data) if isinstance(data, bytes) else size
                              for data, size in zip(out, got.sizes) if data is not None)
        cache.misses += len(keys) - hits
        plan = cache.plan
        if plan is not None:
            for key in keys:
                if plan.consume(key):
                    pk = _PK.pack(key, cache.id)
                    self.ram_policy.unplan(pk)
                    self.disk_policy.unplan(pk)
        return got

    async def put_many(self, caller: int, reference: Any, items: Sequence[tuple[int, Payload]],
                       digests: Mapping[int, int] | None = None) -> int:
        """Store what fits; how many entries were kept.  ``digests``: the checksums the
        client sent for some keys (their entries' last put in ``items``), written to NVMe
        as given (files.write_segments).

        With an NVMe tier an entry is written there only, straight from ``items`` (it
        enters RAM when a get first reads it); RAM takes what NVMe does not (no room, the
        free-space floor, a failed write), or everything without an NVMe tier.  The
        payloads may be views of a buffer the caller reuses once this returns (the
        connection's ring): only copies of them are kept, made in worker threads.
        """
        owner, name = self.resolve(caller, reference, write=True)
        if not self.loaded:
            self.dropped += len(items)
            return 0
        cache = self._cache(owner, name, create=True)
        assert cache is not None
        if cache.dropped:  # being dropped right now
            self.dropped += len(items)
            return 0
        latest: dict[int, Payload] = {}  # the last put of a key in a batch wins
        entries = cache.entries
        for key, data in items:
            latest[key] = data
            size = len(data)  # <= MAX_SAMPLE_ENTRY_BYTES (the ring): fits its field
            word = entries.get(key)
            if word is None:
                entries[key] = size
                cache.bytes += size
            else:  # a new value: the old one leaves RAM (and NVMe, below)
                self._forget_ram(cache, key)
                cache.bytes += size - size_of(word)
                entries[key] = index.resized(word, size)
            cache.stored += 1
        if self.disk_limit:
            kept, copies = await self._write(cache, latest, digests)
        else:  # up to a ring of bytes: copied in a worker thread
            kept, copies = set(), await trio.to_thread.run_sync(_copies, list(latest.items()))
        ram = cache.ram.shards
        for key, data in copies:
            word = entries.shards[key & SHARD].get(key)
            if (not cache.dropped and word is not None and key not in ram[key & SHARD]
                    and word & FIELD == len(data) and self._admit_ram(cache, key, data)):  # its size
                kept.add(key)
        for key in latest:
            word = entries.shards[key & SHARD].get(key)
            if (word is not None and key not in ram[key & SHARD] and not charge_of(word)
                    and key not in cache.writing):
                self._remove_entry(cache, key)
        self.dropped += len(latest.keys() - kept)
        return len(kept)

    async def plan(self, caller: int, reference: Any, data: bytes, source: int = 0) -> int:
        """The cache's next order (little-endian int64 keys) from ``source`` (the caller's
        pid; 0: unknown); how many keys were kept.  A source's plan replaces its previous
        one; the plans of the sources still alive are merged (ranks read side by side), at
        most MAX_SAMPLE_PLAN_SOURCES of them and MAX_SAMPLE_PLAN_KEYS keys together (the
        least recently planned go first)."""
        owner, name = self.resolve(caller, reference, write=True)
        data = data[:MAX_SAMPLE_PLAN_KEYS * 8]
        keys = await trio.to_thread.run_sync(lambda: np.frombuffer(data, dtype="<i8").astype(np.int64))
        cache = self._cache(owner, name, create=True)
        assert cache is not None
        if cache.dropped:
            return 0
        parts = cache.plan_parts
        for gone in [s for s in parts if s != source and not _alive(s)]:
            del parts[gone]  # a process gone (an earlier run): its order will not be read
        parts[source] = keys
        parts.move_to_end(source)
        while len(parts) > MAX_SAMPLE_PLAN_SOURCES or sum(len(p) for p in parts.values()) > MAX_SAMPLE_PLAN_KEYS:
            parts.popitem(last=False)
        cache.plan_generation += 1
        generation = cache.plan_generation
        plan = await trio.to_thread.run_sync(_Plan.merge, list(parts.values()))
        if cache.dropped or cache.plan_generation != generation:
            return len(keys)  # a newer plan of this cache is being merged (with this source's keys)
        self._forget_plan(cache)
        # Plans of other caches go, least recently planned first, until this one fits.
        while self.planned_keys + len(plan.keys) > MAX_SAMPLE_PLANNED_KEYS and self._plans:
            _, other = self._plans.popitem(last=False)
            self._forget_plan(other)
            other.plan_parts.clear()
            log.info("sample cache %r of uid %d: plan dropped (plans are held for %d keys at most)",
                     other.name, other.owner, MAX_SAMPLE_PLANNED_KEYS)
            await self._rerank(other, None)
        cache.plan = plan
        self._plans[cache.id] = cache
        self.planned_keys += len(plan.keys)
        await self._rerank(cache, plan)
        return len(keys)

    async def held(self, caller: int, reference: Any, data: bytes) -> np.ndarray:
        """Which of the keys (little-endian int64) the cache holds an entry for, one uint8
        each (1: held), CHUNK keys between checkpoints.  What cube_torch leaves out of the
        file plan it sends for prefetch (an entry may still turn out stale: then its sample
        is computed from a file read on demand)."""
        owner, name = self.resolve(caller, reference)
        keys = np.frombuffer(data, dtype="<i8")
        out = np.zeros(len(keys), dtype=np.uint8)
        cache = self._cache(owner, name, create=False)
        if cache is None or cache.dropped:
            return out
        for start in range(0, len(keys), CHUNK):
            entries = cache.entries
            out[start:start + CHUNK] = [k in entries for k in keys[start:start + CHUNK].tolist()]
            await trio.lowlevel.checkpoint()
        return out

    def _forget_plan(self, cache: _Cache) -> None:
        if cache.plan is not None:
            self.planned_keys -= len(cache.plan.keys)
            cache.plan = None
            self._plans.pop(cache.id, None)

    async def _rerank(self, cache: _Cache, plan: _Plan | None) -> None:
        """Rank the cache's entries by ``plan`` (None: unplanned), shard by shard,
        RERANK_CHUNK entries at most between checkpoints (a shard's keys are listed when it
        is reached: an entry put meanwhile was ranked by its put)."""
        for keys in _chunks(cache.entries, RERANK_CHUNK):
            if cache.plan is not plan or cache.dropped:
                return  # a newer plan took over
            uses = plan.next_uses(keys) if plan is not None else [-1] * len(keys)
            for key, use in zip(keys, uses):
                pk = _PK.pack(key, cache.id)
                if use < 0:
                    self.ram_policy.unplan(pk)
                    self.disk_policy.unplan(pk)
                else:
                    self.ram_policy.plan(pk, use)
                    self.disk_policy.plan(pk, use)
            await trio.lowlevel.checkpoint()

    async def drop(self, caller: int, reference: Any) -> tuple[int, int]:
        """Destroy a cache: (entries, bytes) it held."""
        owner, name = self.resolve(caller, reference, drop=True)
        if not self.loaded:
            raise BadRequest("the sample store is still loading its NVMe entries: retry in a moment")
        cache = self._cache(owner, name, create=False)
        if cache is None:
            raise NotFound(f"no sample cache {name!r} of uid {owner}")
        async with cache.io_lock:
            if cache.dropped:
                raise NotFound(f"no sample cache {name!r} of uid {owner}")
            # Gets miss and puts are dropped from now on; the files go first, so a cache of the
            # same name made right after never shares a directory with this one.
            cache.dropped = True
            self._forget_plan(cache)
            entries, total = len(cache.entries), cache.bytes  # what it held when the drop began
            await trio.to_thread.run_sync(files.remove_cache, self.root, owner, name, limiter=self._limiter)
            del self._caches[(owner, name)]
            self._per_uid[owner] -= 1
            if not self._per_uid[owner]:
                del self._per_uid[owner]
            # Out of the policies shard by shard, CHUNK entries at most between checkpoints;
            # meanwhile another cache's put may still evict one of its entries (which then
            # releases its own bytes), so each entry's state is read when it is reached, the
            # NVMe bytes left to release after the loop, and the cache stays known by id
            # until then.  An entry leaves its shard once it is out of both policies (so the
            # shards end empty: nothing is freed in bulk).
            words = cache.entries
            for keys in _chunks(words):
                for key in keys:
                    word = words.pop(key, None)
                    if word is None:
                        continue  # evicted meanwhile
                    self._forget_ram(cache, key)
                    if charge_of(word):
                        self.disk_policy.remove(_PK.pack(key, cache.id))
                        self.disk_entries -= 1
                await trio.lowlevel.checkpoint()
            del self._by_id[cache.id]
            self._budget.used -= cache.disk_bytes  # its files are gone
            cache.disk_bytes = 0
        log.info("sample cache %r of uid %d dropped (%d entries, %d bytes) by uid %d", name, owner, entries, total, caller)
        return entries, total

    # -- tiers ------------------------------------------------------------------------

    async def _read(self, owner: int, name: str, wanted: list[tuple[int, int, int, int]],
                    into: Sequence[files.Target | None] | None = None) -> list[bytes | None | bool]:
        """The (key, segment, offset, size) entries (into their targets, if given: see
        files.read_entries), read by up to DISK_THREADS worker threads at once (reading
        them in parallel keeps the NVMe queue busy)."""
        share = max(READ_SHARE, -(-len(wanted) // DISK_THREADS))
        parts = [wanted[i:i + share] for i in range(0, len(wanted), share)]
        targets = [None if into is None else into[i:i + share] for i in range(0, len(wanted), share)]
        results: list[list[bytes | None | bool]] = [[] for _ in parts]

        async def read(i: int) -> None:
            results[i] = await trio.to_thread.run_sync(files.read_entries, self.root, owner, name, parts[i],
                                                       targets[i], limiter=self._limiter)

        async with trio.open_nursery() as nursery:
            for i in range(len(parts)):
                nursery.start_soon(read, i)
        return [data for part in results for data in part]

    def _next_use(self, cache: _Cache, key: int) -> int | None:
        return cache.plan.next_use(key) if cache.plan is not None else None

    def _next_uses(self, cache: _Cache, keys: list[int]) -> list[int | None]:
        """``_next_use`` of each key, in one numpy pass (a batch's: ~10 us per key one by one)."""
        if cache.plan is None:
            return [None] * len(keys)
        return [None if use < 0 else use for use in cache.plan.next_uses(keys)]

    def _admit_ram(self, cache: _Cache, key: int, data: bytes) -> bool:
        if not self.mem_limit:
            return False
        need = len(data) + RAM_ENTRY_OVERHEAD
        victims = self.ram_policy.victims(need, self.mem_limit - self.ram_used, self._next_use(cache, key))
        if victims is None:
            return False
        for pk in victims:
            victim_key, cache_id = _PK.unpack(pk)
            owner = self._by_id[cache_id]
            self._forget_ram(owner, victim_key)
            if not charge_of(owner.entries[victim_key]) and victim_key not in owner.writing:
                owner.evictions += 1
                self._remove_entry(owner, victim_key)
        cache.ram[key] = data
        self.ram_policy.add(_PK.pack(key, cache.id), need, self._next_use(cache, key))
        self.ram_used += need
        self.ram_entries += 1
        cache.ram_bytes += len(data)
        return True

    def _forget_ram(self, cache: _Cache, key: int) -> None:
        data = cache.ram.pop(key, None)
        if data is None:
            return
        self.ram_used -= self.ram_policy.remove(_PK.pack(key, cache.id))
        self.ram_entries -= 1
        cache.ram_bytes -= len(data)

    def _forget_disk(self, cache: _Cache, key: int, release: Release) -> int:
        """The entry (on NVMe) leaves NVMe and, held nowhere else, the cache; ``release``
        frees its range, and the caller keeps its bytes (returned) counted until then
        (``Budget.free``)."""
        charge = self._leave_disk(cache, key, release)
        if key not in cache.ram and key not in cache.writing:
            self._remove_entry(cache, key)
        return charge

    def _leave_disk(self, cache: _Cache, key: int, release: Release) -> int:
        """Take the entry (on NVMe) off NVMe in the index (the caller settles the budget):
        its range is punched, or its segment unlinked if no other entry of it is left.  The
        bytes it was charged."""
        word = cache.entries[key]
        charge, segment = charge_of(word), segment_of(word)
        self.disk_policy.remove(_PK.pack(key, cache.id))
        cache.disk_bytes -= charge
        self.disk_entries -= 1
        path = files.segment_path(self.root, cache.owner, cache.name, segment)
        cache.segments.leave(segment, path, offset_of(word), files.span_of(charge), release)
        cache.entries[key] = index.off_disk(word)
        return charge

    def _remove_entry(self, cache: _Cache, key: int) -> None:
        """Forget an entry held in neither tier (nor being written)."""
        word = cache.entries.pop(key, None)
        if word is not None:
            cache.bytes -= size_of(word)

    async def _write(self, cache: _Cache, items: dict[int, Payload],
                     digests: Mapping[int, int] | None = None) -> tuple[set[int], list[tuple[int, bytes]]]:
        """Write the items as one new segment, evicting what must go, in one worker-thread
        hop: the keys written, and copies of the items that were not (for RAM)."""
        async with cache.io_lock:
            if cache.dropped:
                return set(), []
            # key, data, its bytes on NVMe, the bytes reserved for it
            batch: list[tuple[int, Payload, int, int]] = []
            others: list[tuple[int, Payload]] = []  # not for NVMe: copied for RAM
            release = Release()
            stale = 0
            for (key, data), use in zip(items.items(), self._next_uses(cache, list(items))):
                if key in cache.writing:  # another put of it is being written: this value is for RAM
                    others.append((key, data))
                    continue
                need = files.allocated_bytes(len(data))
                victims = self.disk_policy.victims(need, self.disk_limit - self.disk_used, use)
                if victims is None:
                    word = cache.entries.get(key)
                    if word is not None and charge_of(word):  # NVMe holds the older value: it goes too
                        stale += self._leave_disk(cache, key, release)  # counted until freed
                    others.append((key, data))
                    continue
                freed = 0
                for pk in victims:
                    victim_key, cache_id = _PK.unpack(pk)
                    owner = self._by_id[cache_id]
                    freed += self._leave_disk(owner, victim_key, release)
                    if victim_key not in owner.ram:
                        owner.evictions += 1
                        self._remove_entry(owner, victim_key)
                word = cache.entries.get(key)
                if word is not None and charge_of(word):  # the older value's range is freed too
                    freed += self._leave_disk(cache, key, release)
                # The freed bytes become part of this write's reservation: the worker frees
                # them before it writes, so the disk never holds more than what is counted.
                reserved = self._budget.reserve(need, freed)
                cache.writing.add(key)
                batch.append((key, data, need, reserved))
            if not batch and not release and not others:
                return set(), []
            # One segment for the batch (one per entry where holes cannot be punched).
            step = self.segment_entries
            groups = [batch[i:i + step] for i in range(0, len(batch), step)]
            segments = [self._next_segment + i for i in range(len(groups))]
            self._next_segment += len(groups)
            result = files.WriteResult([False] * len(groups), len(batch), 0)
            copies: list[tuple[int, bytes]] = []
            stale = self._budget.reserve(0, stale)  # older values' ranges: counted until freed
            try:
                result, copies = await trio.to_thread.run_sync(
                    _write_and_copy, self.root, cache.owner, cache.name,
                    [(segment, [(b[0], b[1]) for b in group]) for segment, group in zip(segments, groups)],
                    release, self.free_ratio, others if self.mem_limit else None, digests, limiter=self._limiter)
            finally:
                self._budget.settle(stale, 0)
                written: set[int] = set()
                for segment, group, ok in zip(segments, groups, result.written):
                    offsets = files.layout([len(b[1]) for b in group])
                    uses = self._next_uses(cache, [b[0] for b in group])  # the plan may have changed meanwhile
                    for (key, data, need, reserved), offset, use in zip(group, offsets, uses):
                        cache.writing.discard(key)
                        self._budget.settle(reserved, need if ok else 0)
                        if not ok:
                            continue
                        word = cache.entries.get(key)
                        if word is None:
                            word = len(data)
                            cache.bytes += word
                        cache.entries[key] = index.located(size_of(word), need, segment, offset)
                        cache.disk_bytes += need
                        self.disk_entries += 1
                        self.disk_policy.add(_PK.pack(key, cache.id), need, use)
                        written.add(key)
                    if ok:
                        cache.segments.add(segment, len(group))
                self.write_errors += result.errors
                if result.skipped_full and not self._floor_warned:
                    # Said once: otherwise a full shared disk looks like an NVMe tier that keeps
                    # nothing (entries then live in RAM only and do not survive a restart).
                    self._floor_warned = True
                    log.warning("sample store %s: the filesystem is at its free-space floor (diskFreeRatio %.2f): "
                                "new entries are kept in RAM only (or dropped without a RAM tier), not on NVMe; "
                                "free space or lower diskFreeRatio (said once)", self.root, self.free_ratio)
            return written, copies

    async def _load(self) -> None:
        """Scan the NVMe entries (a worker thread), then merge them into the index in chunks."""
        started = time.monotonic()
        found, junk = await trio.to_thread.run_sync(files.scan, self.root, limiter=self._limiter)
        over: set[tuple[int, str]] = set()
        release = Release()
        for start in range(0, len(found), CHUNK):
            for f in found[start:start + CHUNK]:
                try:
                    cache = self._cache(f.uid, f.name, create=True)
                except NoRoom:
                    over.add((f.uid, f.name))
                    continue
                assert cache is not None
                if not index.fits(f.payload, f.offset):  # not a range this store wrote: freed
                    release.punches.append((files.segment_path(self.root, f.uid, f.name, f.segment), f.offset,
                                            f.span))
                    junk += 1
                    continue
                need = f.allocated
                cache.entries[f.key] = index.located(f.payload, need, f.segment, f.offset)
                cache.segments.add(f.segment)
                self._next_segment = max(self._next_segment, f.segment + 1)
                cache.bytes += f.payload
                cache.disk_bytes += need
                self._budget.used += need
                self.disk_entries += 1
                self.disk_policy.add(_PK.pack(f.key, cache.id), need)
            await trio.lowlevel.checkpoint()
        evicted = freed = 0
        if self.disk_used > self.disk_limit:  # the budget shrank since the entries were written
            for pk in self.disk_policy.victims(self.disk_used - self.disk_limit, 0, None) or []:
                key, cache_id = _PK.unpack(pk)
                cache = self._by_id[cache_id]
                freed += self._forget_disk(cache, key, release)
                evicted += 1
        for owner, name in over:
            await trio.to_thread.run_sync(files.remove_cache, self.root, owner, name, limiter=self._limiter)
        await self._budget.free(release, freed, self._limiter)
        self.startup_discarded = junk + evicted
        self.startup_seconds = time.monotonic() - started
        self.loaded = True
        log.info("sample store: %d entries in %d caches loaded from %s in %.2f s (%d discarded)",
                 self.disk_entries, len(self._caches), self.root, self.startup_seconds, self.startup_discarded)

    # -- reporting --------------------------------------------------------------------

    @property
    def disk_used(self) -> int:
        """Allocated bytes on NVMe, including writes and frees in flight (segments.Budget)."""
        return self._budget.used

    def statistics(self) -> SampleStoreStatistics:
        caches = tuple(SampleCacheStatistics(c.name, c.owner, len(c.entries), c.bytes, c.ram_bytes, c.disk_bytes,
                                             c.hits, c.misses, c.stored, c.evictions,
                                             c.plan.length if c.plan is not None else 0, c.shared)
                       for c in self._caches.values())
        return SampleStoreStatistics(self.ram_used, self.mem_limit, self.disk_used, self.disk_limit,
                                     self.ram_entries, self.disk_entries, self.corrupt, self.write_errors,
                                     self.dropped, self.loaded, self.startup_seconds, self.startup_discarded,
                                     caches, self.hits, self.hit_bytes)

    def status(self) -> dict[str, Any]:
        s = self.statistics()
        return {"loaded": s.loaded, "ram": {"used_bytes": s.ram_used_bytes, "limit_bytes": s.ram_limit_bytes,
                                            "entries": s.ram_entries},
                "disk": {"used_bytes": s.disk_used_bytes, "limit_bytes": s.disk_limit_bytes, "entries": s.disk_entries},
                "corrupt": s.corrupt, "dropped": s.dropped,
                "caches": [{"name": c.name, "owner": c.owner, "entries": c.entries, "bytes": c.bytes,
                            "ram_bytes": c.ram_bytes, "disk_bytes": c.disk_bytes, "hits": c.hits, "misses": c.misses,
                            "stored": c.stored, "evictions": c.evictions, "planned": c.planned, "shared": c.shared}
                           for c in sorted(s.caches, key=lambda c: (c.owner, c.name))]}


def _chunks(entries: ShardedDict[int, int], size: int = CHUNK) -> Iterator[list[int]]:
    """The keys, shard by shard, in lists of ``size`` at most (a walk with a checkpoint after
    each: a shard's keys are listed when the walk reaches it, ~4,000 at 10^6 entries)."""
    chunk: list[int] = []
    for shard in entries.shards:
        keys = list(shard)
        start = 0
        while start < len(keys):
            taken = keys[start:start + size - len(chunk)]
            chunk += taken
            start += len(taken)
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _copies(items: list[tuple[int, Payload]]) -> list[tuple[int, bytes]]:
    """Each payload as bytes of its own (a worker thread: up to a ring of bytes)."""
    return [(key, bytes(data)) for key, data in items]


def _write_and_copy(root: str, owner: int, name: str, segments: list[tuple[int, list[tuple[int, Payload]]]],
                    release: Release, free_ratio: float,
                    others: list[tuple[int, Payload]] | None,
                    digests: Mapping[int, int] | None) -> tuple[files.WriteResult, list[tuple[int, bytes]]]:
    """A put's worker-thread part: free what it evicts, write its segments, and copy for RAM
    what NVMe did not take (``others``, and the entries of a segment that failed; None:
    there is no RAM tier, nothing to copy)."""
    result = files.write_segments(root, owner, name, segments, release, free_ratio, digests)
    if others is None:
        return result, []
    for (_, entries), ok in zip(segments, result.written):
        if not ok:
            others = others + entries
    return result, _copies(others)


def _alive(pid: int) -> bool:
    """Whether the process that sent a plan still runs (pid 0, unknown: always)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True

