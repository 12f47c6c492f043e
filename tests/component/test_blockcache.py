"""BlockCache over a FakeBackend: single flight, foreground before prefetch, promotion,
NVMe hits promoted to RAM, corrupted NVMe blocks refetched, errors not cached, and the
cap on pending NVMe writes.

Slow remotes are simulated with ``autojump_clock`` (virtual time: a 1 s fetch costs no
wall time); "held" fetches use the fake's gates and ``wait_all_tasks_blocked``.
"""

from __future__ import annotations

import os
import errno
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cubefs_fuse.cache.blockcache import MAX_PREFETCH_FLIGHTS, BlockCache, Fetcher, Source
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.cache.keys import block_key
from cubefs_fuse.cache.memory import MemoryTier
from cubefs_fuse.errors import errno_of
from tests.fakes import FakeBackend
from tests.helpers import damage_block

BLOCK = 4096  # small blocks keep the tests light; the cache does not care about the size
LATENCY = 1.0  # seconds of virtual time per backend read under autojump_clock


class Blocks:
    """Keys and fetchers for blocks of files in a FakeBackend (what core.py builds)."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def file(self, path: str, blocks: int) -> None:
        self.backend.write(path, bytes((i * 7 + len(path)) % 251 for i in range(blocks * BLOCK)))

    def key(self, path: str, index: int) -> bytes:
        return block_key(path, self.backend.version(path), index)

    def fetcher(self, path: str, index: int) -> Fetcher:
        version = self.backend.version(path)

        async def fetch() -> bytes:
            return await self.backend.read_block(path, version, index * BLOCK, BLOCK)

        return fetch

    def expected(self, path: str, index: int) -> bytes:
        data = bytes((i * 7 + len(path)) % 251 for i in range(index * BLOCK, (index + 1) * BLOCK))
        return data

    async def get(self, cache: BlockCache, path: str, index: int) -> tuple[bytes, Source]:
        return await cache.get(self.key(path, index), self.fetcher(path, index))

    def prefetch(self, cache: BlockCache, path: str, index: int) -> bool:
        return cache.prefetch(self.key(path, index), self.fetcher(path, index))


@asynccontextmanager
async def open_cache(
    ram_bytes: int = 1 << 24, disk: DiskTier | None = None, *, fetch_slots: int = 8,
    prefetch_slots: int = 4, max_pending_disk_bytes: int = 1 << 24,
) -> AsyncIterator[BlockCache]:
    async with trio.open_nursery() as nursery:
        yield BlockCache(nursery, MemoryTier(ram_bytes), disk, fetch_slots=fetch_slots,
                         prefetch_slots=prefetch_slots, max_pending_disk_bytes=max_pending_disk_bytes)
        nursery.cancel_scope.cancel()


async def test_single_flight(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    blocks = Blocks(backend)
    blocks.file("f", 2)
    results: list[tuple[bytes, Source]] = []
    async with open_cache() as cache:

        async def reader() -> None:
            results.append(await blocks.get(cache, "f", 1))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(reader)
        assert backend.read_calls == {("f", BLOCK): 1}
        assert results == [(blocks.expected("f", 1), Source.BACKEND)] * 50
        stats = cache.statistics()
        assert stats.joined == 49 and stats.flights == 0
        # Afterwards it is a RAM hit: still one backend read.
        assert await blocks.get(cache, "f", 1) == (blocks.expected("f", 1), Source.RAM)
        assert backend.operations["read"] == 1


async def test_foreground_not_starved_by_prefetch(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    blocks = Blocks(backend)
    blocks.file("pre", 100)
    blocks.file("fg", 1)
    # 4 slots, prefetch may hold 2 of them: 100 prefetches take 50 rounds of LATENCY.
    async with open_cache(fetch_slots=4, prefetch_slots=2) as cache:
        start = trio.current_time()
        for i in range(100):
            assert blocks.prefetch(cache, "pre", i)
        await trio.testing.wait_all_tasks_blocked()
        assert cache.statistics().slots.waiting_background == 98

        assert await blocks.get(cache, "fg", 0) == (blocks.expected("fg", 0), Source.BACKEND)
        fg_done = trio.current_time() - start
        stats = cache.statistics()
        # The foreground read took one backend round trip, not a place in the queue ...
        assert fg_done == pytest.approx(LATENCY)
        # ... while the prefetch queue is still almost full.
        assert stats.prefetch_completed <= 2
        assert stats.slots.waiting_background >= 96

        while cache.statistics().prefetch_completed < 100:
            await trio.sleep(LATENCY)
        drained = trio.current_time() - start
        assert drained >= 50 * LATENCY  # prefetch never used more than its 2 slots
        assert fg_done * 10 < drained
        assert cache.statistics().prefetch_failed == 0
        assert backend.operations["read"] == 101


async def test_an_announced_read_promotes_a_queued_prefetch_without_reading() -> None:
    """``promote`` (a plan's next files) and ``prefetch(urgent=True)``: a prefetch queued
    behind the prefetch slot starts at once on a free foreground slot, ahead of the
    prefetches queued before it; nothing is counted as read, and a later read of it is a
    used prefetch (a RAM hit once it landed).  The promoted waiter's old place in the
    prefetch queue is skipped, and the queue's counts stay exact."""
    backend = FakeBackend()
    blocks = Blocks(backend)
    for name in ("p0", "p1", "p2", "p3", "p4"):
        blocks.file(name, 1)
    gates = {name: backend.gate(name) for name in ("p0", "p1", "p2")}
    async with open_cache(fetch_slots=4, prefetch_slots=1) as cache:
        for name in ("p0", "p1", "p2"):  # one at a time: trio may run new tasks in any order
            assert blocks.prefetch(cache, name, 0)
            await trio.testing.wait_all_tasks_blocked()
        slots = cache.statistics().slots
        assert (slots.busy_background, slots.waiting_background) == (1, 2)  # p0 runs; p1, p2 queue
        cache.promote(blocks.key("p2", 0))
        await trio.testing.wait_all_tasks_blocked()
        slots = cache.statistics().slots
        assert (slots.busy_foreground, slots.busy_background, slots.waiting_background) == (1, 1, 1)
        assert [path for path, _ in backend.read_log] == ["p0", "p2"]  # ahead of p1
        # Not queued yet when announced: starts as a foreground fetch, still a prefetch.
        assert cache.prefetch(blocks.key("p3", 0), blocks.fetcher("p3", 0), urgent=True)
        await trio.testing.wait_all_tasks_blocked()
        assert ("p3", 0) in backend.read_log
        stats = cache.statistics()
        assert (stats.misses, stats.hits_ram, stats.prefetch_issued) == (0, 0, 4)
        assert stats.slots.busy_foreground == 1  # p3 landed already (no gate); p2 holds its slot
        gates["p2"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert await blocks.get(cache, "p2", 0) == (blocks.expected("p2", 0), Source.RAM)
        assert cache.statistics().prefetch_used == 1
        gates["p0"].set()  # p1 gets the prefetch slot; p2's stale queue entry is skipped
        await trio.testing.wait_all_tasks_blocked()
        slots = cache.statistics().slots
        assert (slots.busy_background, slots.waiting_background) == (1, 0)
        assert [path for path, _ in backend.read_log] == ["p0", "p2", "p3", "p1"]
        gates["p1"].set()
        await trio.testing.wait_all_tasks_blocked()
        stats = cache.statistics()
        assert stats.prefetch_completed == 4 and stats.flights == 0
        assert (stats.slots.busy_foreground, stats.slots.busy_background, stats.slots.waiting_background) == (0, 0, 0)
        # A prefetch of a block already in flight, announced: promoted, not started twice.
        assert blocks.prefetch(cache, "p4", 0)
        assert not cache.prefetch(blocks.key("p4", 0), blocks.fetcher("p4", 0), urgent=True)
        await trio.testing.wait_all_tasks_blocked()
        assert backend.read_calls[("p4", 0)] == 1


async def test_waiting_foreground_served_before_waiting_prefetch() -> None:
    backend = FakeBackend()
    blocks = Blocks(backend)
    for name in ("held0", "held1", "held2", "pre", "fg"):
        blocks.file(name, 20)
    gates = [backend.gate(f"held{i}") for i in range(3)]
    fg_gate = backend.gate("fg")  # held too, so its slot cannot pass on to a prefetch early
    async with open_cache(fetch_slots=3, prefetch_slots=2) as cache:
        async with trio.open_nursery() as readers:
            # Three foreground reads hold every slot.
            for i in range(3):
                readers.start_soon(blocks.get, cache, f"held{i}", 0)
            await trio.testing.wait_all_tasks_blocked()
            assert backend.reads_in_flight == 3
            for i in range(20):
                blocks.prefetch(cache, "pre", i)
            readers.start_soon(blocks.get, cache, "fg", 0)
            await trio.testing.wait_all_tasks_blocked()
            slots = cache.statistics().slots
            assert (slots.waiting_foreground, slots.waiting_background) == (1, 20)

            gates[0].set()  # one slot frees up: it must go to the foreground read
            await trio.testing.wait_all_tasks_blocked()
            started = [path for path, _ in backend.read_log]
            assert "fg" in started
            assert "pre" not in started
            slots = cache.statistics().slots
            assert (slots.busy_foreground, slots.waiting_background) == (3, 20)
            for gate in (fg_gate, gates[1], gates[2]):
                gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert cache.statistics().prefetch_completed == 20
        assert cache.memory.get(blocks.key("fg", 0)) == blocks.expected("fg", 0)
        # The prefetches ran after the foreground read, not before it.
        assert backend.read_log.index(("fg", 0)) < backend.read_log.index(("pre", 0))


async def test_foreground_get_promotes_prefetch(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    blocks = Blocks(backend)
    for name in ("p1", "p2", "p3"):
        blocks.file(name, 1)
    p1_gate = backend.gate("p1")
    # 2 slots, prefetch may hold 1: once p1's prefetch holds it, other prefetches queue.
    async with open_cache(fetch_slots=2, prefetch_slots=1) as cache:
        assert blocks.prefetch(cache, "p1", 0)
        await trio.testing.wait_all_tasks_blocked()  # p1 holds the prefetch slot ...
        assert blocks.prefetch(cache, "p2", 0)
        await trio.testing.wait_all_tasks_blocked()  # ... so p2 queues behind it
        slots = cache.statistics().slots
        assert (slots.busy_background, slots.waiting_background) == (1, 1)

        # Queued prefetch joined by a foreground read: promoted, fetched while p1 still holds
        # the prefetch slot.  Without promotion this would wait on p1 (forever: its gate is
        # never set here), and fail_after would fire at once under the autojump clock.
        with trio.fail_after(60):
            assert await blocks.get(cache, "p2", 0) == (blocks.expected("p2", 0), Source.BACKEND)
        # A prefetch whose task has not even queued yet, joined at once: also promoted.
        assert blocks.prefetch(cache, "p3", 0)
        with trio.fail_after(60):
            assert await blocks.get(cache, "p3", 0) == (blocks.expected("p3", 0), Source.BACKEND)
        assert not p1_gate.is_set()
        stats = cache.statistics()
        assert stats.joined == 2 and stats.prefetch_completed == 2
        assert backend.read_calls[("p2", 0)] == 1 and backend.read_calls[("p3", 0)] == 1
        p1_gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert cache.statistics().prefetch_completed == 3


async def test_promoted_prefetches_do_not_leak_prefetch_capacity() -> None:
    # core.py starts every block of a multi-block read as a prefetch and then get()s each
    # one, promoting it before its task even runs.  Each such flight must still be
    # released as a prefetch flight, or prefetch() refuses everything after
    # MAX_PREFETCH_FLIGHTS of them.
    backend = FakeBackend()
    blocks = Blocks(backend)
    n = MAX_PREFETCH_FLIGHTS + 10
    backend.write("big", bytes(n * BLOCK))
    async with open_cache(ram_bytes=BLOCK) as cache:
        for i in range(n):
            assert blocks.prefetch(cache, "big", i)
            await blocks.get(cache, "big", i)
        stats = cache.statistics()
        assert stats.prefetch_issued == stats.prefetch_completed == n
        assert stats.flights == 0
        blocks.file("other", 1)
        assert blocks.prefetch(cache, "other", 0)


async def test_prefetch_refuses_duplicates(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    blocks = Blocks(backend)
    blocks.file("f", 2)
    async with open_cache() as cache:
        assert blocks.prefetch(cache, "f", 0)
        assert not blocks.prefetch(cache, "f", 0)  # already in flight
        await blocks.get(cache, "f", 0)
        assert not blocks.prefetch(cache, "f", 0)  # already in RAM
        assert backend.operations["read"] == 1
        # A prefetched block is no application hit until an application reads it.
        assert blocks.prefetch(cache, "f", 1)
        with trio.fail_after(60):  # virtual time: a stuck prefetch fails at once
            while cache.statistics().prefetch_completed < 2:
                await trio.sleep(LATENCY / 10)
        stats = cache.statistics()
        assert (stats.hits_ram, stats.prefetch_completed) == (0, 2)


async def test_drain_waits_on_the_writes_without_polling(tmp_path: Path,
                                                         autojump_clock: trio.testing.MockClock) -> None:
    # Under the autojump clock a wait that polls (a sleep) moves virtual time; drain()
    # waits on an event the last write sets, so time stands still while it waits.
    backend = FakeBackend()
    blocks = Blocks(backend)
    blocks.file("f", 4)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    try:
        async with open_cache(disk=disk) as cache:
            cache.disk_batch_linger = 0
            for i in range(4):
                cache.admit(blocks.key("f", i), blocks.expected("f", i))
            assert cache.statistics().pending_disk_bytes == 4 * BLOCK
            before = trio.current_time()
            await cache.drain()
            assert trio.current_time() == before
            assert cache.statistics().pending_disk_bytes == 0
            assert all(blocks.key("f", i) in disk for i in range(4))
            cache.admit(blocks.key("f", 9), blocks.expected("f", 0))  # pending again: a new wait
            await cache.drain()
            assert blocks.key("f", 9) in disk and trio.current_time() == before
    finally:
        await disk.close()


async def test_nvme_hit_promoted_to_ram(tmp_path: Path) -> None:
    backend = FakeBackend()
    blocks = Blocks(backend)
    blocks.file("f", 2)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    try:
        async with open_cache(ram_bytes=BLOCK, disk=disk) as cache:  # RAM holds one block
            assert (await blocks.get(cache, "f", 0))[1] is Source.BACKEND
            assert (await blocks.get(cache, "f", 1))[1] is Source.BACKEND  # evicts block 0 from RAM
            await cache.drain()
            assert blocks.key("f", 0) not in cache.memory
            assert blocks.key("f", 0) in disk

            assert await blocks.get(cache, "f", 0) == (blocks.expected("f", 0), Source.DISK)
            assert blocks.key("f", 0) in cache.memory  # promoted
            assert await blocks.get(cache, "f", 0) == (blocks.expected("f", 0), Source.RAM)
            stats = cache.statistics()
            assert (stats.hits_disk, stats.hits_ram, stats.misses) == (1, 1, 2)
            assert backend.read_calls == {("f", 0): 1, ("f", BLOCK): 1}
    finally:
        await disk.close()


async def test_corrupted_disk_block_refetched(tmp_path: Path) -> None:
    backend = FakeBackend()
    blocks = Blocks(backend)
    blocks.file("f", 2)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    try:
        async with open_cache(ram_bytes=BLOCK, disk=disk) as cache:
            await blocks.get(cache, "f", 0)
            await blocks.get(cache, "f", 1)  # evicts block 0 from RAM
            await cache.drain()
            damage_block(tmp_path, blocks.key("f", 0), 100)

            assert await blocks.get(cache, "f", 0) == (blocks.expected("f", 0), Source.BACKEND)
            stats = cache.statistics()
            assert stats.disk is not None and stats.disk.checksum_failures == 1
            assert backend.read_calls[("f", 0)] == 2  # refetched, not served from NVMe
            # The refetched block is written back, sound this time.
            await blocks.get(cache, "f", 1)  # evicts block 0 from RAM again
            await cache.drain()
            assert await blocks.get(cache, "f", 0) == (blocks.expected("f", 0), Source.DISK)
            stats = cache.statistics()
            assert stats.disk is not None and stats.disk.checksum_failures == 1
    finally:
        await disk.close()


async def test_fetch_error_reaches_every_waiter_and_is_not_cached(
    tmp_path: Path, autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(latency=LATENCY)
    blocks = Blocks(backend)
    blocks.file("bad", 1)
    backend.fail("bad", errno.EIO, ops=("read",))
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    errors: list[int] = []
    try:
        async with open_cache(disk=disk) as cache:

            async def reader() -> None:
                try:
                    await blocks.get(cache, "bad", 0)
                except Exception as exc:  # noqa: BLE001 - the test records what each waiter saw
                    errors.append(errno_of(exc))

            async with trio.open_nursery() as nursery:
                for _ in range(10):
                    nursery.start_soon(reader)
            assert errors == [errno.EIO] * 10
            assert backend.read_calls[("bad", 0)] == 1
            await cache.drain()
            stats = cache.statistics()
            assert stats.fetch_errors == 1 and stats.flights == 0
            assert blocks.key("bad", 0) not in cache.memory and blocks.key("bad", 0) not in disk
            assert stats.disk is not None and stats.disk.inserts == 0

            backend.heal("bad")
            assert await blocks.get(cache, "bad", 0) == (blocks.expected("bad", 0), Source.BACKEND)
            assert backend.read_calls[("bad", 0)] == 2
    finally:
        await disk.close()


class SlowDiskTier(DiskTier):
    """A DiskTier whose writes wait on ``gate`` (a disk that cannot keep up)."""

    def __init__(self, directory: str, limit_bytes: int, free_ratio: float, lock_fd: int) -> None:
        super().__init__(directory, limit_bytes, free_ratio, lock_fd)
        self.gate = trio.Event()

    async def put_many(self, blocks: list[tuple[bytes, bytes, int | None, int]]) -> list[bool]:
        await self.gate.wait()
        return await super().put_many(blocks)


async def test_pending_disk_writes_capped(tmp_path: Path) -> None:
    backend = FakeBackend()
    blocks = Blocks(backend)
    blocks.file("f", 10)
    disk = await SlowDiskTier.open(str(tmp_path), 1 << 20, 0.0)
    assert isinstance(disk, SlowDiskTier)
    cap = 3 * BLOCK
    try:
        async with open_cache(disk=disk, max_pending_disk_bytes=cap) as cache:
            for i in range(10):
                assert (await blocks.get(cache, "f", i))[1] is Source.BACKEND
                await trio.testing.wait_all_tasks_blocked()
                assert cache.statistics().pending_disk_bytes <= cap
            stats = cache.statistics()
            assert stats.pending_disk_bytes == cap
            assert stats.disk_writes_skipped == 7
            assert stats.disk is not None and stats.disk.inserts == 0
            disk.gate.set()
            await cache.drain()
            stats = cache.statistics()
            assert stats.pending_disk_bytes == 0
            assert stats.disk is not None and stats.disk.inserts == 3
            assert [blocks.key("f", i) in disk for i in range(10)] == [True] * 3 + [False] * 7
            # Every block was still served, from RAM, whatever the disk did.
            for i in range(10):
                assert await blocks.get(cache, "f", i) == (blocks.expected("f", i), Source.RAM)
    finally:
        await disk.close()


async def test_nvme_write_behind_is_batched_one_thread_hop_per_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """N blocks fetched at once reach NVMe in at most ceil(N / DISK_BATCH_BLOCKS) worker
    thread calls (plus the first, which starts before the rest are queued), each with one
    statvfs; every block lands, checksummed, and the limit is held."""
    from cubefs_fuse.cache.disk import DISK_BATCH_BLOCKS

    hops: list[str] = []
    statvfs_calls = 0
    real_run_sync = trio.to_thread.run_sync
    real_statvfs = os.statvfs

    async def counting_run_sync(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        hops.append(getattr(fn, "__name__", "?"))
        return await real_run_sync(fn, *args, **kwargs)

    def counting_statvfs(path):  # type: ignore[no-untyped-def]
        nonlocal statvfs_calls
        statvfs_calls += 1
        return real_statvfs(path)

    backend = FakeBackend()
    blocks = Blocks(backend)
    n = 3 * DISK_BATCH_BLOCKS + 5
    blocks.file("f", n)
    disk = await DiskTier.open(str(tmp_path), 64 << 20, 0.0)
    monkeypatch.setattr(trio.to_thread, "run_sync", counting_run_sync)  # the trio and os modules disk.py uses
    monkeypatch.setattr(os, "statvfs", counting_statvfs)
    try:
        async with open_cache(disk=disk, ram_bytes=4 * n * BLOCK) as cache:
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(blocks.get, cache, "f", i)
            await cache.drain()
            writes = hops.count("_run_jobs")
            assert writes <= -(-n // DISK_BATCH_BLOCKS) + 1 and writes == statvfs_calls
            assert cache._disk_batches == writes
            stats = cache.statistics()
            assert stats.disk is not None and stats.disk.inserts == n and stats.pending_disk_bytes == 0
            assert stats.disk.used_bytes <= stats.disk.limit_bytes
            for i in range(n):
                assert await disk.get(blocks.key("f", i)) == blocks.expected("f", i)
    finally:
        monkeypatch.undo()
        await disk.close()


async def test_write_behind_gathers_blocks_missed_one_at_a_time(tmp_path: Path) -> None:
    """One reader missing blocks one after another (a cold file each, as one DataLoader
    worker does) queues one block at a time: the write-behind waits DISK_BATCH_LINGER for
    more instead of a thread hop per block, and every block still lands."""
    backend = FakeBackend()
    blocks = Blocks(backend)
    n = 20
    blocks.file("f", n)
    disk = await DiskTier.open(str(tmp_path), 64 << 20, 0.0)
    try:
        async with open_cache(disk=disk, ram_bytes=4 * n * BLOCK) as cache:
            for i in range(n):  # sequential misses, each well within the linger of the last
                assert await blocks.get(cache, "f", i) == (blocks.expected("f", i), Source.BACKEND)
            await cache.drain()
            # Not one hop per block: ~10 per hop on a quiet machine, fewer when a loaded one
            # spaces the misses past the linger (3 hops seen), never one each.
            assert cache._disk_batches <= n // 4, cache._disk_batches
            stats = cache.statistics()
            assert stats.disk is not None and stats.disk.inserts == n and stats.pending_disk_bytes == 0
            for i in range(n):
                assert await disk.get(blocks.key("f", i)) == blocks.expected("f", i)
    finally:
        await disk.close()


async def test_prefetches_from_nvme_share_worker_thread_calls(tmp_path: Path) -> None:
    """Prefetch flights whose blocks are on NVMe read them DISK_READ_BATCH at a time in one
    worker-thread call each (not one call per block); every block arrives and counts as an
    NVMe hit; a damaged one is still caught by its checksum, dropped and fetched from the
    source; a foreground read joining a batched prefetch gets the same bytes."""
    from cubefs_fuse.cache.blockcache import DISK_READ_BATCH

    backend = FakeBackend()
    blocks = Blocks(backend)
    n = 4 * DISK_READ_BATCH + 3
    blocks.file("f", n)
    disk = await DiskTier.open(str(tmp_path), 64 << 20, 0.0)
    try:
        async with open_cache(disk=disk, ram_bytes=4 * n * BLOCK) as cache:
            for i in range(n):
                await blocks.get(cache, "f", i)
            await cache.drain()
        damage_block(tmp_path, blocks.key("f", 5), -1)
        reads = backend.statistics().operations.get("read", 0)
        async with open_cache(disk=disk, ram_bytes=4 * n * BLOCK, prefetch_slots=4) as cache:  # RAM empty
            for i in range(n):
                assert blocks.prefetch(cache, "f", i)
            joined, _ = await blocks.get(cache, "f", 0)  # a reader joining a queued prefetch
            assert joined == blocks.expected("f", 0)
            while cache.statistics().flights:
                await trio.sleep(0.01)
            stats = cache.statistics()
            assert stats.prefetch_completed == n and stats.prefetch_failed == 0
            # At most DISK_THREADS readers start with a partial batch; the rest are full.
            assert cache._disk_read_batches <= -(-n // DISK_READ_BATCH) + 8 < n
            assert stats.disk is not None and stats.disk.hits == n - 1 and stats.disk.checksum_failures == 1
            assert backend.statistics().operations.get("read", 0) == reads + 1  # only the damaged block
            for i in range(n):
                data, source = await blocks.get(cache, "f", i)
                assert data == blocks.expected("f", i) and source is Source.RAM
    finally:
        await disk.close()


def _references_the_collector_visits() -> int:
    """What a full collection traverses: the references held by every tracked object."""
    gc.collect()
    return sum(len(gc.get_referents(o)) for o in gc.get_objects())


async def test_cached_blocks_add_nothing_for_the_garbage_collector_to_visit(tmp_path: Path) -> None:
    """Thousands of blocks in both tiers, read, prefetched with positions, admitted,
    planned, evicted: a full collection visits no more references than with an empty
    cache (docs/concurrency.md: per-block state only in untracked dicts),
    so its pause does not grow with the cache."""
    backend = FakeBackend()
    blocks = Blocks(backend)
    files, per_file = 40, 100
    for f in range(files):
        blocks.file(f"f{f}", per_file)
    disk = await DiskTier.open(str(tmp_path), 64 << 20, 0.0)
    try:
        # RAM for half the blocks: the rest is evicted to make room (eviction paths too).
        async with open_cache(disk=disk, ram_bytes=files * per_file * BLOCK // 2) as cache:
            await blocks.get(cache, "f0", 0)  # every code path warm before the baseline
            backend.read_calls.clear()  # the fake's own per-read records
            backend.read_log.clear()
            before = _references_the_collector_visits()
            for f in range(files):
                for i in range(per_file):
                    path = f"f{f}"
                    if f % 4 == 0:
                        await blocks.get(cache, path, i)  # foreground miss
                        await blocks.get(cache, path, i)  # RAM hit
                    elif f % 4 == 1:
                        cache.prefetch(blocks.key(path, i), blocks.fetcher(path, i), next_use=f * per_file + i)
                    elif f % 4 == 2:
                        cache.admit(blocks.key(path, i), blocks.expected(path, i), stall=0.01)
                    else:
                        await blocks.get(cache, path, i)
                        cache.plan(blocks.key(path, i), 10**6 - f * per_file - i)
                await trio.testing.wait_all_tasks_blocked()
            await cache.drain()
            backend.read_calls.clear()
            backend.read_log.clear()
            stats = cache.statistics()
            ram = cache.memory.statistics()
            assert ram.blocks > 1000 and ram.evictions > 0 and ram.planned_bytes > 0
            assert stats.disk is not None and stats.disk.blocks > 2000
            grown = _references_the_collector_visits() - before
            # Far below one reference per block (an OrderedDict or a set of the blocks
            # would add 1-2 per block: 4,000-8,000).
            assert grown < files * per_file // 10, grown
    finally:
        await disk.close()


async def test_dropping_the_cache_yields_to_other_tasks_between_shards(tmp_path: Path) -> None:
    """``clear`` (cubefs-fuse drop-cache) empties both tiers a shard at a time with a
    checkpoint between: another task runs many times during one drop (a single step
    would let it run at most once), and afterwards both tiers and their accounting are
    empty; the files are gone."""
    from cubefs_fuse.cache.shards import SHARDS

    backend = FakeBackend()
    blocks = Blocks(backend)
    n = 600  # spread over most of the 256 shards (keys are hashes)
    blocks.file("f", n)
    disk = await DiskTier.open(str(tmp_path), 256 << 20, 0.0)
    empty = disk.used_bytes  # the tier's own directories
    try:
        async with open_cache(disk=disk, ram_bytes=2 * n * BLOCK) as cache:
            for i in range(n):
                await blocks.get(cache, "f", i)
            await cache.drain()
            assert cache.memory.statistics().blocks == n and disk.statistics().blocks == n
            ticks = 0
            done = False

            async def other() -> None:
                nonlocal ticks
                while not done:
                    ticks += 1
                    await trio.lowlevel.checkpoint()

            # The other task's tick count at each NVMe index drop: all equal if the
            # index were emptied in one step.
            seen: set[int] = set()
            drop = disk._drop_entry

            def counted_drop(key: bytes, ops: Any) -> int:
                seen.add(ticks)
                return drop(key, ops)

            disk._drop_entry = counted_drop  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(other)
                await trio.lowlevel.checkpoint()  # it has started
                start = ticks
                await cache.clear()
                during = ticks - start
                done = True
            assert during >= 2 * SHARDS, during  # each tier a shard at a time
            assert len(seen) >= SHARDS // 2, len(seen)  # the shards hit by 600 hashed keys
            assert cache.memory.statistics().blocks == 0 and cache.memory.used_bytes == 0
            stats = disk.statistics()
            assert stats.blocks == 0 and disk.used_bytes == empty, (disk.used_bytes, empty)
            assert os.listdir(tmp_path / "segments") == []  # every segment emptied, so deleted
            data, source = await blocks.get(cache, "f", 3)  # the cache still works
            assert data == blocks.expected("f", 3) and source is Source.BACKEND
    finally:
        await disk.close()
