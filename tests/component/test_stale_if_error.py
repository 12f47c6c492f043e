"""Stale-if-error (fs/outage.py) on trio's virtual clock, over DeadlineBackend and FakeBackend:
while the source counts as down, files the cache holds whole are looked up (their
getattrs answered) at the version last validated and read from the cache, their
directories looked up and listed, each answer counted and the outage logged once; files
not held whole, failures that are not the outage's and forgotten metadata still fail;
``staleIfError`` off gives EIO as before; a stale answer is valid for 0 seconds, so the
kernel asks again, and the source's first answer afterwards revalidates (a file changed
meanwhile gets a new inode and new bytes, its old inode keeps its own version).

Mounted: tests/mounted/test_stale_if_error_mount.py.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from cubefs_fuse.backends.deadline import DeadlineBackend
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.cache.keys import block_key
from cubefs_fuse.errors import FsError, errno_of
from cubefs_fuse.fs.filesystem import Entry, Filesystem
from cubefs_fuse.fs.inodes import ROOT_INODE
from cubefs_fuse.fs.outage import OPS, StaleIfError
from tests.fakes import FakeBackend
from tests.stack import BLOCK, Stack, open_stack, stack_config

TIMEOUT = 30.0  # backendTimeout
PROBE = 1.0
TTL = 10.0  # attrValid and lookupValid: short, so that a test can outlive them
LOGGER = "cubefs_fuse.fs.outage"
BIG = b"".join(bytes([i]) * BLOCK for i in range(3)) + b"tail"  # four blocks, the last one short


@asynccontextmanager
async def outage_stack(fake: FakeBackend, *, disk: DiskTier | None = None,
                       **config: Any) -> AsyncIterator[tuple[DeadlineBackend, Stack[DeadlineBackend]]]:
    backend = DeadlineBackend(fake, TIMEOUT, probe_interval=PROBE)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.supervise)
        async with open_stack(backend, stack_config(attr_valid=TTL, lookup_valid=TTL, **config), disk=disk) as stack:
            yield backend, stack
        nursery.cancel_scope.cancel()


def source(**files: bytes) -> FakeBackend:
    fake = FakeBackend()
    for name, data in files.items():
        fake.write(f"d/{name}", data)
    return fake


async def read_whole(fs: Filesystem, inode: int) -> bytes:
    return bytes(await fs.read(inode, 0, 0, 1 << 20, pid=1))


async def lookup(fs: Filesystem, path: str) -> Entry:
    inode = ROOT_INODE
    for name in path.split("/"):
        entry = await fs.lookup(inode, name)
        inode = entry.inode
    return entry


async def errno_of_call(call: Any) -> int:
    """The errno ``call`` fails with, as the FUSE session would answer it."""
    with pytest.raises((OSError, FsError)) as failure:
        await call
    return errno_of(failure.value)


def served(fs: Filesystem) -> dict[str, int]:
    return {op: n for op, n in fs.statistics().stale_if_error.items() if n}


def outage_lines(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.name == LOGGER and "served at the version last validated" in r.getMessage() for r in caplog.records)


async def test_cached_file_is_served_at_its_last_version_while_down_counted_and_logged_once(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    fake = source(cached=BIG, small=b"s" * 100, other=b"o" * 100)
    async with outage_stack(fake) as (backend, stack):
        fs = stack.fs
        d = await lookup(fs, "d")
        await fs.opendir(d.inode)  # every child's attributes, none of the bytes
        cached = await fs.lookup(d.inode, "cached")
        assert await read_whole(fs, cached.inode) == BIG
        small = await fs.lookup(d.inode, "small")  # a one-block file
        assert await read_whole(fs, small.inode) == b"s" * 100
        other_inode = (await fs.lookup(d.inode, "other")).inode  # attributes cached, bytes never read
        fake.hang()
        await trio.sleep(TTL + 1)  # every attribute and listing expired
        assert served(fs) == {} and outage_lines(caplog) == 0
        start = trio.current_time()
        again = await lookup(fs, "d/cached")  # the first lookup waits the deadline, then is answered stale
        assert trio.current_time() - start == pytest.approx(TIMEOUT) and backend.down
        assert again.inode == cached.inode and again.attr.version == fake.version("d/cached")
        assert again.valid_for == 0  # not trusted: the kernel asks again, and meets the source once it answers
        sent = sum(fake.operations.values())
        start = trio.current_time()
        assert await read_whole(fs, cached.inode) == BIG  # reads from RAM: no metadata needed
        assert (await fs.getattr(cached.inode)).attr.size == len(BIG)
        assert await read_whole(fs, (await fs.lookup(d.inode, "small")).inode) == b"s" * 100
        names = [name for _, name, _, _ in fs.readdir(await fs.opendir(d.inode), 0)]
        assert names == ["cached", "other", "small"]  # the directory's last listing
        # A file whose bytes were never read: EIO, at once.
        assert await errno_of_call(fs.lookup(d.inode, "other")) == errno.EIO
        assert await errno_of_call(fs.getattr(other_inode)) == errno.EIO
        assert await errno_of_call(fs.read(other_inode, 0, 0, 100, pid=1)) == errno.EIO
        assert trio.current_time() == start and sum(fake.operations.values()) == sent  # nothing reached the remote
        assert served(fs) == {"lookup": 3, "getattr": 1, "opendir": 1}  # "d" and "d/cached" first
        assert set(fs.statistics().stale_if_error) == set(OPS)
        assert outage_lines(caplog) == 1
        fake.unhang()


async def test_a_file_not_held_whole_fails_with_eio(autojump_clock: trio.testing.MockClock) -> None:
    fake = source(big=BIG)
    async with outage_stack(fake) as (backend, stack):
        fs = stack.fs
        big = await lookup(fs, "d/big")
        assert await fs.read(big.inode, 0, 0, BLOCK, pid=1) == BIG[:BLOCK]  # one block of four (readahead brings two more)
        await trio.testing.wait_all_tasks_blocked()
        assert 0 < fs.blocks.cached_fraction("d/big", big.attr) < 1
        fake.hang()
        await trio.sleep(TTL + 1)
        assert await errno_of_call(lookup(fs, "d/big")) == errno.EIO
        assert await errno_of_call(fs.getattr(big.inode)) == errno.EIO
        assert await errno_of_call(fs.read(big.inode, 0, 3 * BLOCK, BLOCK, pid=1)) == errno.EIO  # the block not held
        assert backend.down and served(fs) == {"lookup": 1}  # the directory "d" only
        fake.unhang()


async def test_turned_off_the_outage_gives_eio_as_before(autojump_clock: trio.testing.MockClock) -> None:
    fake = source(cached=BIG)
    async with outage_stack(fake, stale_if_error=False) as (backend, stack):
        fs = stack.fs
        cached = await lookup(fs, "d/cached")
        assert await read_whole(fs, cached.inode) == BIG
        fake.hang()
        await trio.sleep(TTL + 1)
        assert await errno_of_call(lookup(fs, "d/cached")) == errno.EIO
        assert await errno_of_call(fs.getattr(cached.inode)) == errno.EIO
        assert backend.down and served(fs) == {}
        fake.unhang()


async def test_only_the_outage_and_only_remembered_metadata_are_answered_stale(
        autojump_clock: trio.testing.MockClock) -> None:
    fake = source(a=b"a" * 100, b=b"b" * 100)
    async with outage_stack(fake) as (backend, stack):
        fs = stack.fs
        a = await lookup(fs, "d/a")
        b = await lookup(fs, "d/b")
        assert await read_whole(fs, a.inode) == b"a" * 100 and await read_whole(fs, b.inode) == b"b" * 100
        await trio.sleep(TTL + 1)
        # A file's own EIO while the source answers (it is not down): passed on.
        fake.fail("d/a", errno.EIO)
        assert await errno_of_call(lookup(fs, "d/a")) == errno.EIO and not backend.down
        assert await errno_of_call(fs.getattr(a.inode)) == errno.EIO and not backend.down
        fake.heal("d/a")
        assert served(fs) == {}
        await trio.sleep(TTL + 1)
        # The decision itself: only "no answer" errors, only while down.
        stale = StaleIfError(stack.meta, fs.blocks, backend)
        assert stale.attr("d/a", OSError(errno.EIO, "x"), "getattr") is None  # the source is up
        fake.hang()
        await fake_down(fs, backend)
        assert stale.attr("d/a", OSError(errno.EIO, "x"), "getattr") is not None
        assert stale.attr("d/a", OSError(errno.ENOTCONN, "x"), "getattr") is not None
        assert stale.attr("d/a", OSError(errno.EACCES, "x"), "getattr") is None  # an answer of the source
        assert stale.attr("d/nothing", OSError(errno.EIO, "x"), "getattr") is None  # never validated
        # Forgotten: a read found a newer version (invalidated), or drop-cache cleared everything.
        stack.meta.invalidate("d/a")
        assert await errno_of_call(fs.getattr(a.inode)) == errno.EIO
        assert (await fs.getattr(b.inode)).attr.size == 100  # still answered stale
        stack.meta.clear()
        assert await errno_of_call(fs.getattr(b.inode)) == errno.EIO
        assert StaleIfError(stack.meta, fs.blocks, None).attr("d/b", OSError(errno.EIO, "x"), "getattr") is None
        fake.unhang()


async def test_the_first_answer_afterwards_revalidates_a_changed_file_gets_a_new_inode(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    fake = source(f=BIG)
    async with outage_stack(fake) as (backend, stack):
        fs = stack.fs
        old = await lookup(fs, "d/f")
        assert await read_whole(fs, old.inode) == BIG
        fake.hang()
        await trio.sleep(TTL + 1)
        assert (await lookup(fs, "d/f")).inode == old.inode  # stale, after the deadline (a process opens it)
        new = b"N" * (BLOCK + 7)
        fake.write("d/f", new)  # changed at the source during the outage
        assert await read_whole(fs, old.inode) == BIG  # still the version last validated
        fake.unhang()
        await trio.sleep(backend.probe_timeout + PROBE + 0.1)
        assert not backend.down
        before = served(fs)
        # The stale entry was valid for 0 seconds: the next open looks the name up again,
        # which asks the source: the file changed, and the name leads to a new inode.
        fresh = await lookup(fs, "d/f")
        assert fresh.inode != old.inode and fresh.attr.version == fake.version("d/f") and fresh.valid_for > 0
        assert await read_whole(fs, fresh.inode) == new
        # The old inode (still open) keeps its own version: its attributes, its cached bytes.
        assert (await fs.getattr(old.inode)).attr == old.attr
        assert await fs.read(old.inode, 0, 0, 4) == BIG[:4]
        assert served(fs) == before  # nothing stale once the source answers
        # A second outage is logged again, once.
        fake.hang()
        await trio.sleep(TTL + 1)
        assert await read_whole(fs, (await lookup(fs, "d/f")).inode) == new
        assert outage_lines(caplog) == 2
        fake.unhang()


async def test_a_stale_listing_gives_each_child_its_newest_attributes(autojump_clock: trio.testing.MockClock) -> None:
    fake = source(f=b"1" * 10, gone=b"g" * 10, kept=b"k" * 10)
    async with outage_stack(fake) as (backend, stack):
        fs = stack.fs
        d = await lookup(fs, "d")
        await fs.opendir(d.inode)  # the listing: f at its first version
        await trio.sleep(1)
        fake.write("d/f", b"2" * 20)
        fake.remove("d/gone")
        stack.meta.invalidate("d/f")
        stack.meta.invalidate("d/gone")
        f = await fs.lookup(d.inode, "f")  # newer than the listing
        assert f.attr.size == 20
        assert await errno_of_call(fs.lookup(d.inode, "gone")) == errno.ENOENT  # absent, after the listing
        fake.hang()
        await trio.sleep(TTL + 1)
        await fake_down(fs, backend)
        children = {name: attr.size for _, name, _, attr in fs.readdir(await fs.opendir(d.inode), 0)}
        assert children == {"f": 20, "kept": 10}
        fake.unhang()


async def fake_down(fs: Filesystem, backend: DeadlineBackend) -> None:
    """Make the backend count as down: one operation waits the deadline."""
    with pytest.raises(OSError):
        await fs.statfs()
    assert backend.down


async def test_a_file_held_only_on_nvme_is_served(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    fake = source(f=BIG, g=b"g" * BLOCK)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    try:
        async with outage_stack(fake, disk=disk, mem_cache_size=BLOCK) as (backend, stack):  # RAM: one block
            fs = stack.fs
            f = await lookup(fs, "d/f")
            assert await read_whole(fs, f.inode) == BIG
            assert await read_whole(fs, (await lookup(fs, "d/g")).inode) == b"g" * BLOCK  # f's last block leaves RAM
            await stack.cache.drain()
            assert not any(key in stack.cache.memory for key in f_keys(f))
            assert all(key in disk for key in f_keys(f))
            fake.hang()
            await trio.sleep(TTL + 1)
            hits = stack.cache.statistics().hits_disk
            assert await read_whole(fs, (await lookup(fs, "d/f")).inode) == BIG
            # From NVMe (how many count as hits rather than prefetches depends on the timing
            # of the disk threads: the RAM tier holds one block at a time).
            # The lookup of "f" was answered stale because every block is held (on NVMe).
            assert stack.cache.statistics().hits_disk > hits and served(fs) == {"lookup": 2}
            fake.unhang()
    finally:
        await disk.close()


def f_keys(f: Entry) -> list[bytes]:
    return [block_key("d/f", f.attr.version, i) for i in range(-(-len(BIG) // BLOCK))]
