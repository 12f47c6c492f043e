"""Publications: the inodes the core lends to the FUSE session in C (its borrower).

The core lends the held blocks of the version an inode serves (the kernel opens files
without the daemon, so reads are all there is to serve).  An inode published with every
block lent is left as it is; one with blocks missing is published again with what is held
now.  The core takes a block back when the block leaves the RAM tier (lending the block's
NVMe entry instead where it has one), and everything when the kernel forgets the inode;
a file changed at the source, or metadata dropped, changes nothing lent (an old version's
inode keeps its blocks, exact for its version).  The borrower uses nothing once a call
returns, so the RAM limit holds with no block counted twice.  Reads the borrower served
are counted as reads are; one from a file's start is a file request, with the observer
told.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from cubefs_fuse.attrs import Attr
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.cache.keys import block_key
from cubefs_fuse.errors import FsError, StaleVersion
from cubefs_fuse.fs.filesystem import ANY_DEADLINE, OWNER_UNKNOWN, FileRequest, LentBlock
from cubefs_fuse.fs.inodes import ROOT_INODE
from tests.fakes import FakeBackend
from tests.stack import BLOCK, Stack, open_stack, stack_config


class FakeBorrower:
    """C's side: one publication per inode (its lent blocks), and how many were made."""

    def __init__(self) -> None:
        self.table: dict[int, list[LentBlock]] = {}
        self.entries: dict[tuple[int, str], tuple[int, int]] = {}  # (parent, name) -> (inode, deadline)
        self.publications = 0
        self.reports = 0

    def publish(self, inode: int, size: int, block_size: int, blocks: Sequence[LentBlock], /) -> None:
        assert block_size == BLOCK and len(blocks) == -(-size // block_size)
        self.table[inode] = list(blocks)
        self.publications += 1

    def lend(self, inode: int, index: int, block: LentBlock, /) -> bool:
        if inode not in self.table or index >= len(self.table[inode]):
            return False
        self.table[inode][index] = block
        return True

    def withdraw(self, inode: int, /) -> None:
        self.table.pop(inode, None)

    def publish_entry(self, parent: int, name: str, inode: int, attr: Attr, expires_ns: int, /) -> None:
        self.entries[(parent, name)] = (inode, expires_ns)

    def withdraw_entry(self, parent: int, name: str, expires_ns: int, /) -> bool:
        if (parent, name) not in self.entries or expires_ns not in (ANY_DEADLINE, self.entries[(parent, name)][1]):
            return False
        del self.entries[(parent, name)]
        return True

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


async def test_a_file_is_published_once_with_its_held_blocks() -> None:
    backend = FakeBackend()
    backend.write("f", b"a" * 100)
    backend.mkdir("d")
    async with lent_stack(backend) as (stack, borrower):
        inode = await published(stack, "f")  # the lookup brought the one-block file
        assert borrower.table[inode] == [b"a" * 100] and borrower.publications == 1
        entry = borrower.table[inode]
        await stack.fs.lookup(ROOT_INODE, "f")
        # Every block lent: the same publication, nothing to redo.
        assert stack.fs.publish(inode) and borrower.table[inode] is entry and borrower.publications == 1
        directory = (await stack.fs.lookup(ROOT_INODE, "d")).inode
        assert not stack.fs.publish(directory) and borrower.publications == 1
    async with lent_stack(backend, attr_valid=0.0, lookup_valid=0.0) as (stack, borrower):
        inode = (await stack.fs.lookup(ROOT_INODE, "f")).inode
        assert stack.fs.publish(inode)  # lent whether or not its attributes are trusted
        assert borrower.table[inode] == [b"a" * 100]


async def test_a_block_leaving_ram_is_taken_back_at_once() -> None:
    backend = FakeBackend()
    for i in range(4):
        backend.write(f"f{i}", bytes([i]) * BLOCK)
    async with lent_stack(backend, mem_cache_size=2 * BLOCK) as (stack, borrower):
        first = await published(stack, "f0")
        second = await published(stack, "f1")
        assert_ram_accounted(stack)
        # f2's block evicts f0's: f0 is lent nothing in its place (no NVMe tier here), and
        # its bytes stop counting, since the borrower no longer uses them.
        third = await published(stack, "f2")
        assert borrower.table[first] == [None]
        assert borrower.table[second] == [b"\1" * BLOCK] and borrower.table[third] == [b"\2" * BLOCK]
        assert_ram_accounted(stack)
        assert stack.cache.memory.used_bytes == 2 * BLOCK
        # Published again (its next lookup): nothing is held, so nothing is published and
        # the earlier publication is withdrawn (its READs go to Python, which lends what
        # they bring).
        publications = borrower.publications
        assert not stack.fs.publish(first) and first not in borrower.table
        assert borrower.publications == publications


async def test_a_one_block_file_leaving_ram_stays_lent_with_its_nvme_entry(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.write("f0", b"0" * BLOCK)
    backend.write("f1", b"1" * BLOCK)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    try:
        async with lent_stack(backend, disk, mem_cache_size=BLOCK) as (stack, borrower):  # RAM: one block
            first = await published(stack, "f0")
            # read once (until then it counts as the miss that brought it)
            assert bytes(await stack.fs.read(first, 0, 0, BLOCK)) == b"0" * BLOCK
            await stack.cache.drain()  # f0's block written to NVMe too
            await published(stack, "f1")  # evicts f0's block from RAM
            (lent,) = borrower.table[first]
            assert isinstance(lent, tuple) and lent[0].endswith(b".seg")  # a segment file's entry
            assert_ram_accounted(stack)
    finally:
        await disk.close()


async def test_a_large_files_blocks_on_nvme_are_lent_by_place_and_read_ahead_only_by_python(tmp_path: Path) -> None:
    """Each block of a file of many blocks that is on NVMe only is lent by its place (the
    borrower serves READs of whole blocks from it).  A READ the borrower served reads
    ahead only the blocks no tier holds: one on NVMe stays there (no copy into RAM); a
    READ served here reads ahead from NVMe too (the reader asked for part of a block)."""
    backend = FakeBackend()
    data = bytes(range(256)) * (6 * BLOCK // 256)  # six blocks
    backend.write("big", data)
    disk = await DiskTier.open(str(tmp_path), 1 << 22, 0.0)
    try:
        async with lent_stack(backend, disk) as (stack, borrower):
            inode = (await stack.fs.lookup(ROOT_INODE, "big")).inode
            assert bytes(await stack.fs.read(inode, 0, 0, 6 * BLOCK)) == data
            await stack.cache.drain()
        backend.operations.clear()
        async with lent_stack(backend, disk) as (stack, borrower):  # a restart: RAM empty
            fs = stack.fs
            inode = (await fs.lookup(ROOT_INODE, "big")).inode
            assert fs.publish(inode)
            lent = borrower.table[inode]
            assert len(lent) == 6 and all(isinstance(b, tuple) and b[0].endswith(b".seg") for b in lent)
            assert fs.served(inode, 42, 0, 0, 0, 0, 2 * BLOCK, 0b11) is None  # blocks 0-1 from NVMe
            await trio.testing.wait_all_tasks_blocked()
            assert stack.cache.statistics().prefetch_issued == 0 and stack.cache.memory.statistics().blocks == 0
            assert bytes(await fs.read(inode, 0, 2 * BLOCK + 10, 100)) == data[2 * BLOCK + 10:2 * BLOCK + 110]
            await trio.testing.wait_all_tasks_blocked()
            assert stack.cache.statistics().prefetch_issued == 2  # blocks 3 and 4, from NVMe
            assert backend.operations["read"] == 0
    finally:
        await disk.close()


async def test_a_change_or_dropped_attributes_leave_the_loans_and_a_forgotten_inode_is_withdrawn() -> None:
    backend = FakeBackend()
    backend.write("f", b"old")
    backend.write("g", b"g")
    async with lent_stack(backend, attr_valid=0.05, lookup_valid=0.05) as (stack, borrower):
        now = [10**12]
        stack.fs.clock_ns = lambda: now[0]  # the entries' deadlines: moved past by hand below
        old = await published(stack, "f")
        old_blocks = borrower.table[old]
        backend.write("f", b"newer")
        await trio.sleep(0.1)
        new = await published(stack, "f")  # the lookup found the change: the old inode retired
        assert new != old and borrower.table[new] == [b"newer"]
        # The old version's inode keeps its publication: its bytes are still exact for it.
        assert borrower.table[old] is old_blocks and old_blocks == [b"old"]
        publications = borrower.publications
        assert stack.fs.publish(old) and borrower.publications == publications  # whole: left as is
        stack.meta.invalidate("f")  # a read found the source changed
        stack.meta.clear()  # drop_cache
        assert borrower.table == {old: [b"old"], new: [b"newer"]} and borrower.publications == publications
        g = await published(stack, "g")
        assert stack.cache.memory.used_bytes == len(b"old" + b"newer" + b"g")  # nothing counted twice
        stack.fs.forget(g, 1)
        old_key = block_key("f", (await stack.fs.getattr(old)).attr.version, 0)
        stack.fs.forget(old, 1)  # the kernel lets the old version go ...
        assert set(borrower.table) == {old, new, g}  # ... kept while their entries may name them
        now[0] += 10**9
        stack.fs.expire_entries()  # past the entries' deadlines: withdrawn, their blocks given back
        assert set(borrower.table) == {new}
        memory = stack.cache.memory
        assert memory.used_bytes == len(b"old" + b"newer" + b"g")
        memory.discard(old_key)  # not lent any more: its bytes stop counting as it leaves
        assert memory.used_bytes == len(b"newer" + b"g") and set(borrower.table) == {new}


async def test_a_read_served_here_lends_what_it_brought() -> None:
    backend = FakeBackend()
    backend.write("big", b"b" * (2 * BLOCK))  # two blocks: the lookup does not bring it
    async with lent_stack(backend) as (stack, borrower):
        inode = (await stack.fs.lookup(ROOT_INODE, "big")).inode
        assert not stack.fs.publish(inode) and inode not in borrower.table  # nothing held: C sends its reads here
        assert bytes(await stack.fs.read(inode, 0, 0, BLOCK)) == b"b" * BLOCK
        assert borrower.table[inode] == [b"b" * BLOCK, None]
        assert bytes(await stack.fs.read(inode, 0, BLOCK, BLOCK)) == b"b" * BLOCK
        assert borrower.table[inode] == [b"b" * BLOCK] * 2  # C serves the next reads of both itself
        publications = borrower.publications
        assert stack.fs.publish(inode) and borrower.table[inode] == [b"b" * BLOCK] * 2
        assert borrower.publications == publications  # every block lent: nothing to redo
        assert_ram_accounted(stack)


async def test_an_inode_published_with_blocks_missing_is_published_again_with_what_is_held_now() -> None:
    backend = FakeBackend()
    backend.write("big", b"b" * (2 * BLOCK))  # two blocks: the lookup does not bring it
    async with lent_stack(backend) as (stack, borrower):
        fs = stack.fs
        inode = (await fs.lookup(ROOT_INODE, "big")).inode
        version = (await fs.getattr(inode)).attr.version
        # Brought by something other than a read of this inode (a prefetch): one block, then the other.
        await stack.cache.read(block_key("big", version, 0), fs.blocks.fetcher("big", version, 0))
        assert fs.publish(inode) and borrower.table[inode] == [b"b" * BLOCK, None] and borrower.publications == 1
        await stack.cache.read(block_key("big", version, 1), fs.blocks.fetcher("big", version, 1))
        assert borrower.table[inode] == [b"b" * BLOCK, None]  # nothing lent on its own
        assert fs.publish(inode) and borrower.publications == 2
        assert borrower.table[inode] == [b"b" * BLOCK] * 2
        assert fs.publish(inode) and borrower.publications == 2  # now whole: left as is
        assert_ram_accounted(stack)


async def test_a_read_the_borrower_served_from_a_files_start_is_a_request_counted_and_observed() -> None:
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

        def released(self, f: FileRequest) -> None:
            seen.append(("release", (f.path, f.owner)))

    async with lent_stack(backend) as (stack, _):
        fs = stack.fs
        inode = await published(stack, "f")
        assert fs.served(inode, 42, 0, 0, 100, 0b1, 0, 0) is None  # no observer: nothing left to do
        fs.observer = Observer()
        rest = fs.served(inode, 43, 0, 0, 100, 0b1, 0, 0)
        assert rest is not None and seen == []
        await rest
        assert seen == [("open", (43, "f")), ("release", ("f", "job-of-43"))]
        assert fs.served(inode, 44, 0, 0, 100, 0b1, 0, 0) is None  # the owner known at once: no task
        assert seen[2:] == [("open now", (44, "f")), ("release", ("f", "job-of-44"))]
        assert fs.served(inode, 44, 50, 0, 50, 0b1, 0, 0) is None  # not from the start: no request
        assert len(seen) == 4
        stats = fs.statistics()
        assert (stats.reads, stats.native_reads, stats.read_bytes, stats.file_requests) == (4, 4, 350, 3)
        # The first read of the block the lookup brought counts as the miss that brought it.
        assert (stats.bytes_by_source["backend"], stats.bytes_by_source["ram"], stats.file_misses) == (100, 250, 1)


async def test_settle_waits_until_each_read_served_before_it_is_counted() -> None:
    """A read the borrower served for a process not seen before is counted once its owner is
    resolved, in a task: settle() (what status, stats and a scrape do first) returns only
    once the reads served before it are counted, and does not wait for reads served after."""
    backend = FakeBackend()
    backend.write("f", b"y" * 100)
    gates = {43: trio.Event(), 45: trio.Event()}

    class Observer:
        async def opened(self, pid: int, path: str) -> object:
            await gates[pid].wait()  # resolving the owner waits (a /proc read in a thread)
            return f"job-of-{pid}"

        def opened_now(self, pid: int, path: str) -> object:
            return OWNER_UNKNOWN

        def released(self, f: FileRequest) -> None:
            pass

    async def run(rest: object) -> None:
        assert rest is not None
        await rest  # type: ignore[misc]

    async with lent_stack(backend) as (stack, _), trio.open_nursery() as nursery:
        fs = stack.fs
        inode = await published(stack, "f")
        fs.observer = Observer()
        nursery.start_soon(run, fs.served(inode, 43, 0, 0, 100, 0b1, 0, 0))
        settled = trio.Event()

        async def settle() -> None:
            await fs.settle()
            settled.set()

        nursery.start_soon(settle)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(run, fs.served(inode, 45, 0, 0, 100, 0b1, 0, 0))  # served after settle() began
        await trio.testing.wait_all_tasks_blocked()
        assert not settled.is_set() and fs.statistics().file_requests == 0
        gates[43].set()
        with trio.fail_after(5):
            await settled.wait()
        assert fs.statistics().file_requests == 1  # the later read is not waited for
        gates[45].set()


async def test_a_new_plan_first_takes_in_what_the_borrower_served() -> None:
    backend = FakeBackend()
    backend.write("f", b"y" * 100)
    async with open_stack(backend, stack_config(), service=True) as stack:
        borrower = FakeBorrower()
        stack.fs.lend_to(borrower)
        stack.service.jobs.register("job", 0, os.getpid())
        dataset, _ = await stack.service.register_dataset(b"f", 1)
        await stack.service.submit_plan(("job", 0), 0, dataset.id, np.asarray([0], dtype="<u4").tobytes(), "<u4")
        # The last epoch's reads, still queued in C, count for its plan, not for this one.
        assert borrower.reports == 1


async def test_a_listing_publishes_its_names_once_however_often_it_is_read() -> None:
    """READDIRPLUS publishes each listed name as a lookup does (the borrower then answers
    its lookups); a listing read again (``ls`` in a loop) while they are published adds no
    publication, so the deadlines kept stay one per name."""
    backend = FakeBackend()
    for i in range(3):
        backend.write(f"d/f{i}", b"z" * 10)
    async with lent_stack(backend, attr_valid=30.0) as (stack, borrower):
        fs = stack.fs
        d = (await fs.lookup(ROOT_INODE, "d")).inode
        for _ in range(5):
            handle = await fs.opendir(d)
            listed = [fs.entry(d, name, path, attr) for _, name, path, attr in fs.readdir(handle, 0)]
            fs.releasedir(handle)
            assert {(d, f"f{i}") for i in range(3)} <= set(borrower.entries)
            assert all(borrower.entries[(d, f"f{i}")][0] == listed[i].inode for i in range(3))
        assert len(fs._entry_deadlines) == 4  # d and its three names, once each
        assert all(fs.inodes.node(e.inode).lookups == 5 for e in listed)  # each listing the kernel took counts


async def test_a_lookup_missing_on_a_held_file_publishes_its_directory_once_per_attr_valid(
        autojump_clock: trio.testing.MockClock) -> None:
    """A lookup that misses the metadata cache on a file a tier holds (a restarted daemon,
    or a later epoch past the attributes' time) lists its directory in the background and
    publishes every name with its held blocks, the kernel holding no lookup of them, so the
    borrower answers the next lookups and reads.  Once per directory per ``attrValid``
    however many lookups miss in it; a cold file's miss lists nothing, nor does a miss in
    a directory of more than MAX_LISTED_NAMES names (it publishes nothing of it and is not
    listed again)."""
    backend = FakeBackend()
    for i in range(5):
        backend.write(f"d/f{i}", bytes([i]) * 100)
        backend.write(f"cold/f{i}", b"c" * 100)
        backend.write(f"big/f{i}", b"b" * 100)
    backend.write("d/shard", b"s" * (3 * BLOCK))
    async with lent_stack(backend, attr_valid=30.0) as (stack, borrower):
        fs = stack.fs
        for index in range(3):
            stack.cache.admit(block_key("d/shard", backend.version("d/shard"), index), b"s" * BLOCK)
        for directory in ("d", "big"):
            for i in range(5):  # held, as a restarted daemon finds its NVMe tier
                path = f"{directory}/f{i}"
                stack.cache.admit(block_key(path, backend.version(path), 0), bytes([i]) * 100 if directory == "d" else b"b" * 100)
        fs.meta.clear()
        d, cold, big = [(await fs.lookup(ROOT_INODE, name)).inode for name in ("d", "cold", "big")]
        await fs.lookup(cold, "f0")  # brings the file: nothing held, nothing listed
        await trio.testing.wait_all_tasks_blocked()
        assert backend.operations["listdir"] == 0 and (cold, "f1") not in borrower.entries
        f0 = await fs.lookup(d, "f0")
        await fs.lookup(d, "f1")  # a second miss while the listing runs: no second listing
        await trio.testing.wait_all_tasks_blocked()
        assert backend.operations["listdir"] == 1
        for i in range(5):
            inode, _ = borrower.entries[(d, f"f{i}")]
            assert borrower.table[inode] == [bytes([i]) * 100]  # its held block lent with it
            node = fs.inodes.node(inode)
            assert node.pins == 1 and node.lookups == (1 if i < 2 else 0)  # the kernel holds what it looked up
        assert borrower.entries[(d, "f0")][0] == f0.inode
        shard, _ = borrower.entries[(d, "shard")]
        assert shard not in borrower.table  # a file of many blocks: lent at its first READ
        assert bytes(await fs.read(shard, 0, BLOCK, BLOCK)) == b"s" * BLOCK
        assert len(borrower.table[shard]) == 3 and all(borrower.table[shard])
        fs.meta.clear()
        await fs.lookup(d, "f2")  # within attrValid: not listed again
        await trio.testing.wait_all_tasks_blocked()
        assert backend.operations["listdir"] == 1
        autojump_clock.jump(31.0)
        fs.meta.clear()
        await fs.lookup(d, "f3")
        await trio.testing.wait_all_tasks_blocked()
        assert backend.operations["listdir"] == 2
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("cubefs_fuse.fs.filesystem.MAX_LISTED_NAMES", 4)
            await fs.lookup(big, "f0")
            await trio.testing.wait_all_tasks_blocked()
            assert backend.operations["listdir"] == 3 and (big, "f1") not in borrower.entries
            autojump_clock.jump(31.0)
            fs.meta.clear()
            await fs.lookup(big, "f1")  # found too large: not listed again
            await trio.testing.wait_all_tasks_blocked()
            assert backend.operations["listdir"] == 3


async def test_a_lookup_publishes_its_entry_which_keeps_the_inode_until_its_deadline_passes() -> None:
    """An entry the core answered is published with its deadline (as long as the attributes
    are trusted): the borrower answers the name's next lookups, reported one by one, and the
    inode stays (its number, what it serves, its lent blocks) even once the kernel forgot
    it, until the deadline has passed; then the entry is withdrawn, the reports made before
    are taken in, and the inode goes if the kernel holds it no more."""
    backend = FakeBackend()
    backend.write("d/f", b"z" * 100)
    async with lent_stack(backend, attr_valid=30.0) as (stack, borrower):
        fs = stack.fs
        now = [10**12]
        fs.clock_ns = lambda: now[0]
        d = (await fs.lookup(ROOT_INODE, "d")).inode
        f = await fs.lookup(d, "f")
        fs.publish(f.inode)
        inode, deadline = borrower.entries[(d, "f")]
        assert inode == f.inode and 29e9 < deadline - now[0] <= 30e9
        assert (ROOT_INODE, "d") in borrower.entries and (d, ".") not in borrower.entries
        fs.forget(f.inode, 1)  # the kernel dropped its inode (memory pressure) ...
        assert f.inode in borrower.table and fs.inodes.node(f.inode).lookups == 0  # ... still published
        fs.looked_up(f.inode)  # ... and the borrower handed it to the kernel again
        stats = fs.statistics()
        assert (stats.lookups, stats.native_lookups) == (3, 1)
        fs.expire_entries()
        assert (d, "f") in borrower.entries and borrower.reports == 0  # not due: nothing done
        now[0] = deadline
        fs.forget(f.inode, 1)
        fs.expire_entries()
        assert (d, "f") not in borrower.entries and borrower.reports == 1  # withdrawn, reports taken in
        assert f.inode not in borrower.table  # no lookup held, no entry: the inode went
        with pytest.raises(FsError):
            fs.inodes.node(f.inode)
        assert fs.inodes.node(d).path == "d"  # the directory: the kernel still holds it


async def test_an_entry_republished_or_found_stale_is_answered_by_the_core_again() -> None:
    backend = FakeBackend()
    backend.write("f", b"1" * (2 * BLOCK))
    async with lent_stack(backend, attr_valid=30.0) as (stack, borrower):
        fs = stack.fs
        now = [10**12]
        fs.clock_ns = lambda: now[0]
        first = await fs.lookup(ROOT_INODE, "f")
        _, deadline = borrower.entries[(ROOT_INODE, "f")]
        now[0] += 10**9
        again = fs.lookup_now(ROOT_INODE, "f")  # a warm lookup here: published anew, a later deadline
        assert again is not None and borrower.entries[(ROOT_INODE, "f")][1] > deadline
        now[0] = deadline
        fs.expire_entries()  # the first publication's time: the later one stays, the inode too
        assert (ROOT_INODE, "f") in borrower.entries and fs.inodes.node(first.inode).pins == 1
        backend.write("f", b"2" * (2 * BLOCK))  # changed at the source: a read of a block not held finds it
        with pytest.raises(StaleVersion):
            await fs.read(first.inode, 0, 0, BLOCK)
        assert (ROOT_INODE, "f") not in borrower.entries  # the next lookup comes to the core
