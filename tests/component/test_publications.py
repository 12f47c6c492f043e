"""Publications: the inodes the core vouches for to the FUSE session in C (its borrower).

The core publishes a file's inode for as long as its attributes are trusted, lending the
blocks of its version that are held; it withdraws the publication when that stops being
true (the file changed, its metadata was dropped, the kernel forgot the inode, a lent block
left the RAM tier) and takes the lent blocks back once the borrower frees it.  The RAM
limit holds throughout: a lent block that leaves the tier stays counted until given back.
Opens the borrower answered are counted as opens are, with the observer told.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import trio

from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.fs.filesystem import OWNER_UNKNOWN, LentBlock, OpenFile
from cubefs_fuse.fs.inodes import ROOT_INODE
from tests.fakes import FakeBackend
from tests.stack import BLOCK, Stack, open_stack, stack_config


class FakeBorrower:
    """C's side: one publication per inode; one that is withdrawn or replaced is freed at
    once unless a handle reads it (``readers``), as fs/_session.c frees them."""

    def __init__(self) -> None:
        self.table: dict[int, tuple[int, float, list[LentBlock]]] = {}
        self.readers: dict[int, int] = {}  # publication id -> handles reading it
        self.invalidations = 0
        self.reports = 0

    def publish(self, inode: int, id: int, valid_for: float, keep_cache: bool, direct_io: bool, size: int,
                block_size: int, blocks: Sequence[LentBlock], /) -> int:
        freed = self.withdraw(inode)
        self.table[inode] = (id, valid_for, list(blocks))
        return freed

    def withdraw(self, inode: int, /) -> int:
        old = self.table.pop(inode, None)
        if old is None or self.readers.get(old[0]):
            return 0
        return old[0]

    def invalidate_all(self) -> None:
        self.invalidations += 1

    def report(self) -> None:
        self.reports += 1


@asynccontextmanager
async def lent_stack(backend: FakeBackend, disk: DiskTier | None = None,
                     **config: float) -> AsyncIterator[tuple[Stack[FakeBackend], FakeBorrower]]:
    async with open_stack(backend, stack_config(**config), disk=disk) as stack:
        borrower = FakeBorrower()
        stack.fs.lend_to(borrower)
        yield stack, borrower


async def published(stack: Stack[FakeBackend], name: str) -> int:
    """Look ``name`` up and publish it, as the session does before answering the LOOKUP."""
    inode = (await stack.fs.lookup(ROOT_INODE, name)).inode
    assert stack.fs.publish(inode)
    return inode


def assert_ram_accounted(stack: Stack[FakeBackend], ghost_bytes: int = 0) -> None:
    ram = stack.cache.memory
    held = ram.statistics().blocks * BLOCK
    assert ram.used_bytes == held + ghost_bytes <= ram.limit_bytes


async def test_a_file_is_published_with_its_held_blocks_for_as_long_as_its_attributes_are_trusted() -> None:
    backend = FakeBackend()
    backend.write("f", b"a" * 100)
    backend.mkdir("d")
    async with lent_stack(backend) as (stack, borrower):
        inode = await published(stack, "f")  # the lookup brought the one-block file
        first, valid_for, blocks = borrower.table[inode]
        assert 3500 < valid_for <= 3600 and blocks == [b"a" * 100]
        await stack.fs.lookup(ROOT_INODE, "f")
        assert stack.fs.publish(inode) and borrower.table[inode][0] == first  # the same: nothing to redo
        directory = (await stack.fs.lookup(ROOT_INODE, "d")).inode
        assert not stack.fs.publish(directory)
    async with lent_stack(backend, attr_valid=0.0, lookup_valid=0.0) as (stack, borrower):
        inode = (await stack.fs.lookup(ROOT_INODE, "f")).inode
        assert not stack.fs.publish(inode) and borrower.table == {}  # nothing trusted: every open asks


async def test_a_block_leaving_ram_is_no_longer_lent_and_comes_back_when_freed() -> None:
    backend = FakeBackend()
    for i in range(4):
        backend.write(f"f{i}", bytes([i]) * BLOCK)
    async with lent_stack(backend, mem_cache_size=2 * BLOCK) as (stack, borrower):
        first = await published(stack, "f0")
        reading = borrower.table[first][0]
        borrower.readers[reading] = 1  # a handle reads it: C frees it at that handle's release
        second = await published(stack, "f1")
        # f2's block evicts f0's, which is still lent, so still counted: room is made by
        # evicting f1's too, whose publication nothing reads (given back at once).  Both
        # are published again with what is held now: nothing (no NVMe tier here).
        third = await published(stack, "f2")
        assert borrower.table[first][2] == borrower.table[second][2] == [None]
        assert borrower.table[first][0] != reading
        assert_ram_accounted(stack, ghost_bytes=BLOCK)
        stack.fs.freed(reading)  # the last handle's release freed it
        assert_ram_accounted(stack)
        assert second != third


async def test_a_one_block_file_leaving_ram_stays_published_with_its_nvme_entry(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.write("f0", b"0" * BLOCK)
    backend.write("f1", b"1" * BLOCK)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    try:
        async with lent_stack(backend, disk, mem_cache_size=BLOCK) as (stack, borrower):  # RAM: one block
            first = await published(stack, "f0")
            fh = await stack.fs.open(first, os.O_RDONLY)  # read once (until then it counts as a miss)
            assert bytes(await stack.fs.read(fh, 0, BLOCK)) == b"0" * BLOCK
            stack.fs.release(fh)
            await stack.cache.drain()  # f0's block written to NVMe too
            await published(stack, "f1")  # evicts f0's block from RAM
            (lent,) = borrower.table[first][2]
            assert isinstance(lent, tuple) and lent[0].endswith(b".seg")  # a segment file's entry
            assert_ram_accounted(stack)
    finally:
        await disk.close()


async def test_a_changed_file_a_dropped_attribute_and_a_forgotten_inode_withdraw_the_publication() -> None:
    backend = FakeBackend()
    backend.write("f", b"old")
    backend.write("g", b"g")
    async with lent_stack(backend, attr_valid=0.05, lookup_valid=0.05) as (stack, borrower):
        old = await published(stack, "f")
        assert borrower.table[old][1] <= 0.05
        backend.write("f", b"newer")
        await trio.sleep(0.1)
        new = await published(stack, "f")  # the lookup found the change: the old inode retired
        assert new != old and set(borrower.table) == {new}
        stack.meta.invalidate("f")  # a read found the source changed
        assert new not in borrower.table
        g = await published(stack, "g")
        stack.fs.forget(g, 1)
        assert g not in borrower.table
        stack.meta.clear()  # drop_cache: no publication answers an open any more
        assert borrower.invalidations == 1


async def test_a_release_of_a_handle_read_here_lends_what_its_reads_brought() -> None:
    backend = FakeBackend()
    backend.write("big", b"b" * (2 * BLOCK))  # two blocks: the lookup does not bring it
    async with lent_stack(backend) as (stack, borrower):
        inode = await published(stack, "big")
        assert borrower.table[inode][2] == [None, None]  # C sends the open here
        fh = await stack.fs.open(inode, os.O_RDONLY)
        assert bytes(await stack.fs.read(fh, 0, 2 * BLOCK)) == b"b" * (2 * BLOCK)
        stack.fs.release(fh)
        assert borrower.table[inode][2] == [b"b" * BLOCK] * 2  # C answers the next open


async def test_an_open_the_borrower_answered_is_counted_and_observed_even_if_released_first() -> None:
    backend = FakeBackend()
    backend.write("f", b"y" * 100)
    seen: list[tuple[str, object]] = []

    class Observer:
        async def opened(self, pid: int, path: str) -> object:
            await trio.sleep(0)  # looking the owner up may wait
            seen.append(("open", (pid, path)))
            return f"job-of-{pid}"

        def opened_now(self, pid: int, path: str) -> object:
            if pid == 43:
                return OWNER_UNKNOWN  # not known without waiting: opened() in a task
            seen.append(("open now", (pid, path)))
            return f"job-of-{pid}"

        def released(self, f: OpenFile) -> None:
            seen.append(("release", (f.path, f.owner)))

    async with lent_stack(backend) as (stack, _):
        fs = stack.fs
        inode = await published(stack, "f")
        fh = 1 << 62  # C's own handle numbers
        assert fs.open_served(inode, fh, 42) is None  # no observer: nothing left to do
        fs.release(fh)
        fs.observer = Observer()
        rest = fs.open_served(inode, fh + 1, 43)
        assert rest is not None
        fs.release(fh + 1)  # the release came before the owner was known
        assert seen == []
        await rest
        assert seen == [("open", (43, "f")), ("release", ("f", "job-of-43"))]
        assert fs.open_served(inode, fh + 2, 44) is None  # the owner known at once: no task
        fs.release(fh + 2)
        assert seen[2:] == [("open now", (44, "f")), ("release", ("f", "job-of-44"))]
        stats = fs.statistics()
        assert (stats.opens, stats.native_opens, stats.open_files, stats.file_requests) == (3, 3, 0, 3)


async def test_a_new_plan_first_takes_in_what_the_borrower_answered() -> None:
    backend = FakeBackend()
    backend.write("f", b"y" * 100)
    async with open_stack(backend, stack_config(), service=True) as stack:
        borrower = FakeBorrower()
        stack.fs.lend_to(borrower)
        stack.service.jobs.register("job", 0, os.getpid())
        dataset, _ = await stack.service.register_dataset(b"f", 1)
        await stack.service.submit_plan(("job", 0), 0, dataset.id, np.asarray([0], dtype="<u4").tobytes(), "<u4")
        # The last epoch's opens, still queued in C, count for its plan, not for this one.
        assert borrower.reports == 1
