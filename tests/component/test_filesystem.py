"""The filesystem core without a kernel: Filesystem over a FakeBackend and a real BlockCache.

What the FUSE adapter relies on: inode numbers and lookup counts, directory handles,
version pinning at open (and whether the kernel may keep its page cache), reads
assembled from blocks, ESTALE instead of mixed versions, and the observer hooks.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from cubefs_fuse.cache.blockcache import BlockCache
from cubefs_fuse.cache.memory import MemoryTier
from cubefs_fuse.errors import FsError, StaleVersion, errno_of
from cubefs_fuse.fs.filesystem import Filesystem, OpenFile
from cubefs_fuse.fs.inodes import ROOT_INODE
from cubefs_fuse.fs.metadata import MetadataCache
from tests.fakes import FakeBackend

BLOCK = 4096


@asynccontextmanager
async def filesystem(backend: FakeBackend, *, attr_ttl: float = 3600.0) -> AsyncIterator[Filesystem]:
    async with trio.open_nursery() as nursery:
        cache = BlockCache(nursery, MemoryTier(64 * BLOCK), None, fetch_slots=4, prefetch_slots=2)
        meta = MetadataCache(backend, attr_ttl=attr_ttl, lookup_ttl=attr_ttl, max_entries=1000)
        yield Filesystem(meta, cache, backend, block_size=BLOCK)
        nursery.cancel_scope.cancel()


async def read_all(fs: Filesystem, fh: int, size: int, chunk: int = 1000) -> bytes:
    out = bytearray()
    for offset in range(0, size, chunk):
        out += await fs.read(fh, offset, chunk)
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
        fh, keep_cache = await fs.open(inode, os.O_RDONLY)
        assert keep_cache
        assert await read_all(fs, fh, len(data)) == data
        for offset, size in ((0, 1), (BLOCK - 1, 2), (BLOCK, BLOCK), (10, 3 * BLOCK), (len(data) - 5, 100)):
            assert bytes(await fs.read(fh, offset, size)) == data[offset:offset + size]
        assert await fs.read(fh, len(data), 10) == b""
        fs.release(fh)
        stats = fs.statistics()
        assert stats.file_requests == 1 and stats.file_misses == 1  # the first read waited on the backend


async def test_writes_directories_and_special_files_are_refused() -> None:
    backend = FakeBackend()
    backend.mkdir("d")
    backend.symlink("l", "d")
    async with filesystem(backend) as fs:
        d = await fs.lookup(ROOT_INODE, "d")
        link = await fs.lookup(ROOT_INODE, "l")
        for inode, flags, err in ((d.inode, os.O_RDONLY, errno.EISDIR), (link.inode, os.O_RDONLY, errno.EINVAL),
                                  (d.inode, os.O_WRONLY, errno.EROFS), (link.inode, os.O_RDWR, errno.EROFS)):
            with pytest.raises(FsError) as exc:
                await fs.open(inode, flags)
            assert exc.value.errno == err
        assert await fs.readlink(link.inode) == "d"
        with pytest.raises(FsError) as exc:
            await fs.readlink(d.inode)
        assert exc.value.errno == errno.EINVAL


async def test_a_changed_file_gets_estale_on_old_handles_and_a_fresh_page_cache_on_new_opens() -> None:
    backend = FakeBackend()
    backend.write("f", b"old" * 2000)
    async with filesystem(backend, attr_ttl=0.0) as fs:
        inode = (await fs.lookup(ROOT_INODE, "f")).inode
        old_fh, keep = await fs.open(inode, os.O_RDONLY)
        assert keep
        assert bytes(await fs.read(old_fh, 0, 3)) == b"old"
        backend.write("f", b"new" * 3000)
        with pytest.raises(StaleVersion):
            await fs.read(old_fh, BLOCK, 10)  # a block of the old version that is not cached
        assert fs.statistics().stale_reads == 1
        new_fh, keep = await fs.open(inode, os.O_RDONLY)
        assert not keep  # the kernel must drop the old version's pages
        assert await read_all(fs, new_fh, 9000) == b"new" * 3000
        again, keep = await fs.open(inode, os.O_RDONLY)
        assert keep  # same version as the last open: the page cache is good


async def test_the_observer_sees_each_open_and_release_with_its_owner() -> None:
    backend = FakeBackend()
    backend.write("f", b"y" * 100)
    seen: list[tuple[str, object]] = []

    class Observer:
        async def opened(self, pid: int, path: str) -> object:
            seen.append(("open", (pid, path)))
            return f"job-of-{pid}"

        def released(self, f: OpenFile) -> None:
            seen.append(("release", (f.path, f.owner, f.waited)))

    async with filesystem(backend) as fs:
        fs.observer = Observer()
        inode = (await fs.lookup(ROOT_INODE, "f")).inode
        fh, _ = await fs.open(inode, os.O_RDONLY, pid=42)
        await fs.read(fh, 0, 100)
        fs.release(fh)
        fs.release(fh)  # a second release of the same handle is ignored
        assert seen == [("open", (42, "f")), ("release", ("f", "job-of-42", True))]
