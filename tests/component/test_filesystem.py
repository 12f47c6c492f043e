"""The filesystem core without a kernel: Filesystem over a FakeBackend and a real BlockCache.

What the FUSE adapter relies on: inode numbers and lookup counts, directory handles,
one inode per version of a file (a changed file is found at lookup, a new inode; the old
one keeps serving its own version), how long the kernel may keep an entry, reads
assembled from blocks without any open, ESTALE instead of mixed versions, and the
observer hooks.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from cubefs_fuse.errors import FsError, StaleVersion, errno_of
from cubefs_fuse.fs.filesystem import FileRequest, Filesystem
from cubefs_fuse.fs.inodes import ROOT_INODE
from tests.fakes import FakeBackend
from tests.stack import BLOCK, open_stack, stack_config


@asynccontextmanager
async def filesystem(backend: FakeBackend, *, attr_ttl: float = 3600.0) -> AsyncIterator[Filesystem]:
    async with open_stack(backend, stack_config(attr_valid=attr_ttl, lookup_valid=attr_ttl)) as stack:
        yield stack.fs


async def read_all(fs: Filesystem, inode: int, size: int, chunk: int = 1000) -> bytes:
    out = bytearray()
    for offset in range(0, size, chunk):
        out += await fs.read(inode, 0, offset, chunk)
    return bytes(out)


async def test_lookup_getattr_and_forget_keep_inode_numbers_by_lookup_count() -> None:
    backend = FakeBackend()
    backend.mkdir("d")
    backend.write("d/f", b"x" * 10)
    async with filesystem(backend) as fs:
        d = await fs.lookup(ROOT_INODE, "d")
        f1 = await fs.lookup(d.inode, "f")
        f2 = await fs.lookup(d.inode, "f")
        assert f1.inode == f2.inode != d.inode and f1.attr.size == 10
        assert (await fs.getattr(f1.inode)).attr == f1.attr
        assert (await fs.lookup(d.inode, "..")).inode == ROOT_INODE
        fs.forget(f1.inode, 1)
        assert (await fs.getattr(f1.inode)).attr.size == 10  # one lookup is still held
        fs.forget(f1.inode, 1)
        with pytest.raises(FsError) as stale:
            await fs.getattr(f1.inode)
        assert stale.value.errno == errno.ESTALE
        with pytest.raises(FsError) as bad:
            await fs.lookup(ROOT_INODE, "a/b")
        assert bad.value.errno == errno.EINVAL
        with pytest.raises((OSError, FsError)) as missing:
            await fs.lookup(ROOT_INODE, "nothing")
        assert errno_of(missing.value) == errno.ENOENT


async def test_readdir_pages_from_an_offset_and_releasedir_ends_the_handle() -> None:
    backend = FakeBackend()
    for name in ("c", "a", "b"):
        backend.write(name, name.encode())
    async with filesystem(backend) as fs:
        fh = await fs.opendir(ROOT_INODE)
        assert [(n, name, path) for n, name, path, _ in fs.readdir(fh, 0)] == [(1, "a", "a"), (2, "b", "b"),
                                                                                (3, "c", "c")]
        assert [name for _, name, _, _ in fs.readdir(fh, 2)] == ["c"]
        fs.releasedir(fh)
        with pytest.raises(FsError) as exc:
            list(fs.readdir(fh, 0))
        assert exc.value.errno == errno.EBADF


async def test_reads_of_every_range_match_the_source_across_blocks() -> None:
    backend = FakeBackend()
    data = os.urandom(3 * BLOCK + 123)
    backend.write("f", data)
    async with filesystem(backend) as fs:
        inode = (await fs.lookup(ROOT_INODE, "f")).inode
        # Reads are by inode: no open, no handle (the kernel opens files without the core).
        assert await read_all(fs, inode, len(data)) == data
        for offset, size in ((BLOCK - 1, 2), (BLOCK, BLOCK), (10, 3 * BLOCK), (len(data) - 5, 100), (0, 1)):
            assert bytes(await fs.read(inode, 0, offset, size)) == data[offset:offset + size]
        assert await fs.read(inode, 0, len(data), 10) == b""
        stats = fs.statistics()
        # Each read from the file's start is a request: the first waited on the backend.
        assert (stats.file_requests, stats.file_misses) == (2, 1)


async def test_reads_of_directories_and_special_files_are_refused() -> None:
    """The kernel opens files without the core (writes are refused by the FUSE session):
    what the core refuses is a READ of an inode that is no regular file."""
    backend = FakeBackend()
    backend.mkdir("d")
    backend.symlink("l", "d")
    async with filesystem(backend) as fs:
        d = await fs.lookup(ROOT_INODE, "d")
        link = await fs.lookup(ROOT_INODE, "l")
        for inode, err in ((d.inode, errno.EISDIR), (link.inode, errno.EINVAL)):
            with pytest.raises(FsError) as exc:
                await fs.read(inode, 0, 0, 10)
            assert exc.value.errno == err
        assert fs.statistics().file_requests == 0
        assert await fs.readlink(link.inode) == "d"
        with pytest.raises(FsError) as exc:
            await fs.readlink(d.inode)
        assert exc.value.errno == errno.EINVAL


async def test_a_changed_file_gets_a_new_inode_and_the_old_one_keeps_serving_its_version() -> None:
    backend = FakeBackend()
    backend.write("f", b"old" * 2000)
    async with filesystem(backend, attr_ttl=0.0) as fs:
        old = await fs.lookup(ROOT_INODE, "f")
        assert bytes(await fs.read(old.inode, 0, 0, 3)) == b"old"
        backend.write("f", b"new" * 3000)  # in place: same inode number, new size, mtime, ctime
        new = await fs.lookup(ROOT_INODE, "f")
        assert new.inode != old.inode and new.attr.size == 9000
        # The old inode keeps its own version's attributes: the kernel never sees the new
        # size or mtime on it (it would cut, extend or drop the old version's pages).
        assert (await fs.getattr(old.inode)).attr == old.attr
        assert (await fs.getattr(new.inode)).attr.size == 9000
        assert await read_all(fs, new.inode, 9000) == b"new" * 3000
        # The old inode reads its own version where it is cached, and fails (ESTALE) where
        # it is not: never the new bytes, never a mix.
        assert bytes(await fs.read(old.inode, 0, 0, 3)) == b"old"  # its cached block, its version
        with pytest.raises(StaleVersion):
            await fs.read(old.inode, 0, BLOCK, 10)  # a block of the old version that is not cached
        assert bytes(await fs.read(old.inode, 0, 0, BLOCK)) == (b"old" * 2000)[:BLOCK]
        stats = fs.statistics()
        assert (stats.version_changes, stats.stale_reads, stats.retired_inodes, stats.inodes) == (1, 1, 1, 3)
        assert (await fs.lookup(ROOT_INODE, "f")).inode == new.inode  # no further change, same inode
        fs.forget(old.inode, 1)  # the kernel lets the old inode go
        stats = fs.statistics()
        assert (stats.retired_inodes, stats.inodes) == (0, 2)
        with pytest.raises(FsError) as gone:
            await fs.getattr(old.inode)
        assert gone.value.errno == errno.ESTALE


@pytest.mark.parametrize("first", ["lookup", "getattr", "read"])
@pytest.mark.parametrize("change", ["in_place", "replaced", "same_size"])
async def test_whichever_request_finds_the_change_it_is_counted_once_and_the_path_moves_on(
        first: str, change: str) -> None:
    backend = FakeBackend()
    backend.write("d/f", b"a" * 5000)
    async with filesystem(backend, attr_ttl=0.0) as fs:
        d = await fs.lookup(ROOT_INODE, "d")
        old = await fs.lookup(d.inode, "f")  # pages of the old version may stay in the kernel
        if change == "replaced":
            backend.remove("d/f")
            backend.write("d/f", b"b" * 7000)  # a new file renamed over it: a new inode number
        else:
            backend.write("d/f", (b"b" * 5000) if change == "same_size" else b"b" * 3000)
        if first == "lookup":
            assert (await fs.lookup(d.inode, "f")).inode != old.inode
        elif first == "getattr":
            assert (await fs.getattr(old.inode)).attr == old.attr
        else:  # a read of the old inode's block that is not cached: ESTALE, never the new bytes
            with pytest.raises(StaleVersion):
                await fs.read(old.inode, 0, 0, 10)
            assert fs.statistics().stale_reads == 1
        new = await fs.lookup(d.inode, "f")
        assert new.inode != old.inode and new.attr.version == backend.version("d/f")
        assert (await fs.getattr(old.inode)).attr == old.attr
        assert (await fs.lookup(d.inode, "f")).inode == new.inode
        assert (await fs.lookup(ROOT_INODE, "d")).inode == d.inode  # its directory changed nothing
        stats = fs.statistics()
        assert stats.version_changes == 1
        assert await read_all(fs, new.inode, new.attr.size) == b"b" * new.attr.size


async def test_directories_keep_their_inode_but_a_change_of_type_gets_a_new_one() -> None:
    backend = FakeBackend()
    backend.write("d/f", b"x")
    async with filesystem(backend, attr_ttl=0.0) as fs:
        d = await fs.lookup(ROOT_INODE, "d")
        backend.write("d/g", b"y")  # a directory whose mtime changes is the same directory
        assert (await fs.lookup(ROOT_INODE, "d")).inode == d.inode
        assert (await fs.getattr(ROOT_INODE)).inode == ROOT_INODE
        f = await fs.lookup(d.inode, "f")
        backend.remove("d/f")
        backend.mkdir("d/f")  # a file replaced by a directory
        assert (await fs.lookup(d.inode, "f")).inode != f.inode
        assert fs.statistics().version_changes == 1


async def test_readdir_never_hands_back_an_older_version_than_the_current_inode() -> None:
    backend = FakeBackend()
    backend.write("f", b"old")
    async with filesystem(backend) as fs:  # attributes and listings cached for an hour
        listing = await fs.opendir(ROOT_INODE)
        backend.write("f", b"newer")
        await fs.meta.fresh_stat("f")  # e.g. a read found the change and invalidated it
        new = await fs.lookup(ROOT_INODE, "f")
        fs.releasedir(listing)
        listing = await fs.opendir(ROOT_INODE)  # the cached listing still says "old"
        [(_, name, path, attr)] = list(fs.readdir(listing, 0))
        assert (name, attr.size) == ("f", 5)
        assert fs.entry(ROOT_INODE, name, path, attr).inode == new.inode


async def test_the_observer_sees_each_read_from_a_files_start_with_its_owner() -> None:
    backend = FakeBackend()
    backend.write("f", b"y" * 100)
    seen: list[tuple[str, object]] = []

    class Observer:
        async def opened(self, pid: int, path: str) -> object:
            seen.append(("open", (pid, path)))
            return f"job-of-{pid}"

        def opened_now(self, pid: int, path: str) -> object:
            raise AssertionError("only for reads the FUSE session served")

        def released(self, f: FileRequest) -> None:
            seen.append(("release", (f.path, f.owner, f.waited)))

    async with filesystem(backend) as fs:
        fs.observer = Observer()
        inode = (await fs.lookup(ROOT_INODE, "f")).inode  # a lookup is no request
        assert seen == []
        await fs.read(inode, 0, 0, 100, pid=42)
        await fs.read(inode, 0, 50, 50, pid=42)  # not from the start: part of the same request
        await fs.read(inode, 0, 0, 100, pid=43)
        assert seen == [("open", (42, "f")), ("release", ("f", "job-of-42", True)),
                        ("open", (43, "f")), ("release", ("f", "job-of-43", False))]


async def test_entries_are_valid_as_long_as_the_metadata_cache_trusts_them(
        autojump_clock: trio.testing.MockClock) -> None:
    """The kernel may keep an entry and its attributes for ``valid_for`` seconds: as long
    as the metadata cache still trusts the path's attributes, so that it looks the name up
    again (and finds a changed file's new inode) at most ``attrValid`` after the source
    answered.  An answer the cache does not trust is valid for 0; an old version's inode
    for ever (its attributes never change)."""
    ttl = 100.0
    backend = FakeBackend()
    backend.write("f", b"1" * 10)
    async with filesystem(backend, attr_ttl=ttl) as fs:
        first = await fs.lookup(ROOT_INODE, "f")
        assert first.valid_for == pytest.approx(ttl)
        await trio.sleep(30)
        assert (await fs.getattr(first.inode)).valid_for == pytest.approx(ttl - 30)  # from the cache
        assert (await fs.lookup(ROOT_INODE, "f")).valid_for == pytest.approx(ttl - 30)
        await trio.sleep(ttl - 30 - 1)
        assert (await fs.getattr(first.inode)).valid_for == pytest.approx(1)
        backend.write("f", b"2" * 20)
        await trio.sleep(1)  # the attributes are no longer trusted: the next lookup asks the source
        assert fs.meta.peek("f") is None and fs.entry(ROOT_INODE, "f", "f", first.attr).valid_for == 0
        new = await fs.lookup(ROOT_INODE, "f")
        assert new.inode != first.inode and new.attr.size == 20 and new.valid_for == pytest.approx(ttl)
        assert bytes(await fs.read(new.inode, 0, 0, 100)) == b"2" * 20
        assert (await fs.getattr(first.inode)).valid_for == math.inf  # retired: its version's, for ever
    async with filesystem(backend, attr_ttl=0.0) as fs:  # nothing trusted: every entry valid for 0
        entry = await fs.lookup(ROOT_INODE, "f")
        assert entry.valid_for == 0 and (await fs.getattr(entry.inode)).valid_for == 0


async def test_a_warm_lookup_and_getattr_are_answered_without_waiting(autojump_clock: trio.testing.MockClock) -> None:
    """``lookup_now`` and ``getattr_now`` answer as the awaited calls do when the metadata
    cache holds the path's attributes, and say None (wait) when it does not."""
    backend = FakeBackend()
    backend.write("d/f", b"1" * 10)
    async with filesystem(backend, attr_ttl=10.0) as fs:
        d = await fs.lookup(ROOT_INODE, "d")
        assert fs.lookup_now(d.inode, "f") is None  # never asked: the source must be
        cold = await fs.lookup(d.inode, "f")
        lookups = fs.statistics().lookups
        warm = fs.lookup_now(d.inode, "f")
        assert warm is not None and (warm.inode, warm.attr) == (cold.inode, cold.attr)
        assert warm.valid_for == pytest.approx(10.0) and fs.statistics().lookups == lookups + 1
        assert fs.getattr_now(cold.inode) == await fs.getattr(cold.inode)
        await trio.sleep(11)  # past attrValid: both would wait on the source
        assert fs.lookup_now(d.inode, "f") is None and fs.getattr_now(cold.inode) is None
        backend.write("d/f", b"2" * 20)
        new = await fs.lookup(d.inode, "f")
        old = fs.getattr_now(cold.inode)  # retired: its own version, no wait, for ever
        assert new.inode != cold.inode and old is not None and old.attr.size == 10 and old.valid_for == math.inf
        with pytest.raises(FsError):
            fs.lookup_now(12345, "f")  # an unknown parent: ESTALE, as lookup says
