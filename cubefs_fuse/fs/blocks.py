"""Whole-file block operations: the blocks of one version of a file in the cache. The read
path takes its keys (``cache.keys.block_key``) and fetchers from here; a metadata miss on a
small file brings its bytes in the same backend call (``stat_bringing``); ai_prefetch and
warmup bring whole files in (``prefetch_file``, ``warm_file``), mark consumed ones
(``unplan_file``) and ask what is held (``cached_fraction``)."""

from __future__ import annotations

import time

import trio

from cubefs_fuse.attrs import Attr, FileVersion
from cubefs_fuse.backends.base import Backend
from cubefs_fuse.cache.blockcache import BlockCache, Fetcher
from cubefs_fuse.cache.keys import block_key, path_tag
from cubefs_fuse.fs.metadata import MetadataCache


class _Bring:
    """A prefetch stat'ing a file with its bytes (``FileBlocks.prefetch_file``): the fetch
    slot it waits for or holds, and ``done`` once it has ended, however it ended."""

    __slots__ = ("slot", "done")

    def __init__(self, slot: object) -> None:
        self.slot = slot
        self.done = trio.Event()


class FileBlocks:
    def __init__(self, meta: MetadataCache, cache: BlockCache, backend: Backend, block_size: int) -> None:
        self.meta = meta
        self.cache = cache
        self.backend = backend
        self.block_size = block_size
        # Files a prefetch is stat'ing with their bytes (prefetch_file): a reader's lookup
        # waits for it as a read joins a flight, and promotes it as promote_file does.
        self._bringing: dict[str, _Bring] = {}

    def fetcher(self, path: str, version: FileVersion, index: int) -> Fetcher:
        bs = self.block_size
        length = min(bs, version.size - index * bs)

        async def fetch() -> bytes:
            return await self.backend.read_block(path, version, index * bs, length)

        return fetch

    async def stat_bringing(self, path: str) -> tuple[Attr, bool]:
        """``path``'s attributes for a reader about to read it (``MetadataCache.stat``), and
        whether its bytes came with them; on
        a miss, a regular file of at most one block that no tier holds comes with them in
        the same backend call (``Backend.stat_read``: over S3 one ranged GET instead of a
        HEAD and a GET; over a directory one thread hop instead of two), if a fetch slot
        is free now (never waited for: without one it only stats).  The reader's first
        read of it counts as the miss it waited for (``BlockCache.admit``).  A block on
        NVMe stays there: the borrower serves the READ from its NVMe place, published with
        the inode and checked by its checksum (``Filesystem.publish``), an NVMe hit with no
        copy into the RAM tier (reading it here cost the worker thread the read and the
        trio thread an admission with its evictions: ~350 us per file, 2-core VM)."""
        cache, meta = self.cache, self.meta
        if meta.peek(path) is not None:
            return await meta.stat(path), False
        bring = self._bringing.get(path)
        if bring is not None:  # a prefetch is bringing it: wait for it as a read joins a flight
            start = time.perf_counter()
            cache.promote_fetch_slot(bring.slot)
            await bring.done.wait()
            attr = await meta.stat(path)
            if attr.is_file and attr.size <= self.block_size:
                cache.join_prefetched(block_key(path, attr.version, 0), time.perf_counter() - start)
            return attr, False
        slot = cache.try_fetch_slot()
        if slot is None:
            return await meta.stat(path), False
        start = time.perf_counter()
        attr, data = await self._stat_read(path, slot)
        if data is None:
            return attr, False
        cache.admit(block_key(path, attr.version, 0), data, tag=path_tag(path), stall=time.perf_counter() - start)
        return attr, True

    async def _stat_read(self, path: str, slot: object) -> tuple[Attr, bytes | None]:
        """``MetadataCache.stat_read`` of ``path`` holding the fetch slot ``slot`` (given
        back however it ends): its attributes, and the bytes of a file of at most one block
        that no tier and no flight holds when the worker thread has its stat."""
        cache = self.cache

        def want(attr: Attr) -> bool:
            # Runs in the backend's worker thread, between the stat and the source read.
            return cache.wanted(block_key(path, attr.version, 0))

        try:
            return await self.meta.stat_read(path, self.block_size, want)
        finally:
            cache.release_fetch_slot(slot)

    def count(self, size: int) -> int:
        return -(-size // self.block_size)

    async def prefetch_file(self, path: str, next_use: int | None = None, urgent: bool = False) -> int:
        """Start bringing every block of ``path`` into RAM; its size (0 if not a file).

        ``next_use``: the plan position that will read it (protects it from eviction).
        ``urgent``: a reader is about to ask for it (``BlockCache.prefetch``).

        A file whose attributes are not cached is stat'ed under a fetch slot (at the
        priority its flights would have), and if it is a file of at most one block that no
        tier holds, its bytes come in the same backend call (``Backend.stat_read``) and
        land as a prefetch (``BlockCache.admit_prefetched``): one backend call per cold
        small file instead of a stat and a read (over a directory one thread hop, over S3
        one ranged GET instead of a HEAD and a GET)."""
        if self.meta.peek(path) is None and path not in self._bringing:
            cache = self.cache
            bring = self._bringing[path] = _Bring(cache.new_fetch_slot(foreground=urgent))
            try:
                await cache.acquire_fetch_slot(bring.slot)
                attr, data = await self._stat_read(path, bring.slot)
                if data is not None:
                    cache.admit_prefetched(block_key(path, attr.version, 0), data, next_use=next_use,
                                           tag=path_tag(path))
                    return attr.size
            finally:
                del self._bringing[path]
                bring.done.set()
        else:
            attr = await self.meta.stat(path)
        if not attr.is_file:
            return 0
        version, tag = attr.version, path_tag(path)
        for index in range(self.count(attr.size)):
            self.cache.prefetch(block_key(path, version, index), self.fetcher(path, version, index),
                                next_use=next_use, tag=tag, urgent=urgent)
        return attr.size

    def plan_if_resident(self, path: str, next_use: int) -> int | None:
        """:meth:`prefetch_file` for a file with nothing to fetch, without a task or a wait:
        its attributes cached and every block of that version in RAM; each block is ranked
        at ``next_use`` (as the prefetch would rank it) and the file's size returned.  None,
        with nothing done, for any other file (:meth:`prefetch_file` then decides)."""
        attr = self.meta.peek(path)
        if attr is None:
            return None
        if not attr.is_file:
            return 0
        version, memory = attr.version, self.cache.memory
        keys = [block_key(path, version, index) for index in range(self.count(attr.size))]
        if not all(key in memory for key in keys):
            return None
        for key in keys:
            self.cache.plan(key, next_use)
        return attr.size

    def promote_file(self, path: str) -> None:
        """A reader is about to ask for ``path``: its blocks' prefetches, if still waiting
        behind the prefetch slots, wait as foreground fetches (``BlockCache.promote``).
        A file whose prefetch still waits for a fetch slot to stat it and bring its bytes
        (``prefetch_file``) has that slot promoted."""
        bring = self._bringing.get(path)
        if bring is not None:
            self.cache.promote_fetch_slot(bring.slot)
            return
        attr = self.meta.peek(path)
        if attr is None or not attr.is_file:
            return
        for index in range(self.count(attr.size)):
            self.cache.promote(block_key(path, attr.version, index))

    async def settled(self, path: str) -> None:
        """Wait until no block of ``path`` (at its cached version) is in flight any more:
        a prefetch issued for it has landed or failed.  Not a read: nothing is counted."""
        bring = self._bringing.get(path)
        if bring is not None:
            await bring.done.wait()
        attr = self.meta.peek(path)
        if attr is None or not attr.is_file:
            return
        for index in range(self.count(attr.size)):
            await self.cache.settled(block_key(path, attr.version, index))

    def unplan_file(self, path: str, version: FileVersion, keys: tuple[bytes, ...] = ()) -> None:
        """No plan reads this version of ``path`` again (it was just consumed); ``keys``:
        its blocks' keys if the caller has them."""
        for key in keys or [block_key(path, version, index) for index in range(self.count(version.size))]:
            self.cache.unplan(key)

    async def warm_file(self, path: str) -> int:
        """Bring every block of ``path`` into the cache and wait; its size (0 if not a file)."""
        attr = await self.meta.stat(path)
        if not attr.is_file:
            return 0
        version = attr.version
        for index in range(self.count(attr.size)):
            await self.cache.warm(block_key(path, version, index), self.fetcher(path, version, index))
        return attr.size

    def cached_fraction(self, path: str, attr: Attr) -> float:
        """The fraction of ``path``'s blocks (at version ``attr``) held by a cache tier."""
        blocks = self.count(attr.size)
        if not blocks:
            return 1.0
        held = sum(self.cache.contains(block_key(path, attr.version, i)) for i in range(blocks))
        return held / blocks

    def prefetch_range(self, path: str, version: FileVersion, first: int, end: int, *, from_nvme: bool = True) -> None:
        """Start fetching blocks ``first`` up to ``end`` (exclusive, cut at the file's end)
        into RAM; ``from_nvme`` False: only those no tier holds (one on NVMe stays there)."""
        for index in range(first, min(end, self.count(version.size))):
            key = block_key(path, version, index)
            if from_nvme or not self.cache.contains(key):
                self.cache.prefetch(key, self.fetcher(path, version, index))
