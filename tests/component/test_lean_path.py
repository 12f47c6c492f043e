"""The lean FUSE path (docs/contracts.md, "The lean path"), without a kernel.

A cold small file costs one backend call (the lookup's ``stat_read``) and still counts
as the miss it was; files larger than a block, metadata hits, cached files and busy
fetch slots fall back to a plain stat; the bytes are always those of the version the
lookup saw.
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from cubefs_fuse.attrs import Attr
from cubefs_fuse.backends.localdir import LocalDirBackend
from cubefs_fuse.cache.blockcache import Source
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.cache.keys import block_key
from cubefs_fuse.errors import StaleVersion
from cubefs_fuse.fs.filesystem import Filesystem
from cubefs_fuse.fs.inodes import ROOT_INODE
from tests.fakes import FakeBackend
from tests.helpers import damage_block
from tests.stack import BLOCK, open_stack, stack_config

LATENCY = 0.01


@asynccontextmanager
async def filesystem(backend: FakeBackend, *, fetch_slots: int = 4,
                     disk: DiskTier | None = None) -> AsyncIterator[Filesystem]:
    async with open_stack(backend, stack_config(backend_threads=fetch_slots), disk=disk) as stack:
        yield stack.fs


async def read_file(fs: Filesystem, path: str) -> bytes:
    """lookup (each component), read whole in 1000-byte requests (no open: the kernel
    opens files without the daemon)."""
    inode = ROOT_INODE
    for name in path.split("/"):
        entry = await fs.lookup(inode, name)
        inode = entry.inode
    out = bytearray()
    for offset in range(0, entry.attr.size, 1000):
        out += await fs.read(inode, 0, offset, 1000)
    return bytes(out)


async def test_a_cold_small_file_costs_one_backend_call_and_counts_as_a_miss(autojump_clock: object) -> None:
    backend = FakeBackend(latency=LATENCY)
    data = bytes(range(256)) * 12  # 3072 bytes: one block
    backend.write("d/f", data)
    async with filesystem(backend) as fs:
        await fs.lookup(ROOT_INODE, "d")
        backend.operations.clear()
        assert await read_file(fs, "d/f") == data
        # One stat_read (counted as one stat), no read_block: the reads were RAM reads.
        assert dict(backend.operations) == {"stat": 1} and backend.stat_reads == 1
        assert backend.read_calls == {("d/f", 0): 1}
        s = fs.statistics()
        assert (s.file_requests, s.file_misses) == (1, 1)  # the lookup waited for it: a miss
        assert s.stall_seconds > 0  # ... and its wait (real time) is the file's stall
        assert s.blocks_by_source[Source.BACKEND.value] == 1
        assert s.blocks_by_source[Source.RAM.value] == 3  # the other 3 reads of the block
        assert fs.cache.statistics().misses == 1
        # The next read of the file is a hit, with no backend call at all.
        assert await read_file(fs, "d/f") == data
        s = fs.statistics()
        assert (s.file_requests, s.file_misses) == (2, 1) and dict(backend.operations) == {"stat": 1}


async def test_large_files_cached_files_and_metadata_hits_only_stat(autojump_clock: object) -> None:
    backend = FakeBackend()
    big = b"b" * (BLOCK + 1)
    backend.write("big", big)
    backend.write("small", b"s" * 100)
    async with filesystem(backend) as fs:
        assert await read_file(fs, "big") == big  # larger than a block: stat, then read_block
        assert backend.stat_reads == 0 and backend.read_calls == {("big", 0): 1, ("big", BLOCK): 1}
        await fs.lookup(ROOT_INODE, "small")  # a cold lookup brings it ...
        assert backend.stat_reads == 1
        fs.meta.invalidate("small")
        await fs.getattr((await fs.lookup(ROOT_INODE, "small")).inode)  # ... a later miss of a cached file does not
        assert backend.stat_reads == 1 and backend.operations["stat"] == 3
        assert await read_file(fs, "small") == b"s" * 100
        assert backend.read_calls[("small", 0)] == 1  # fetched once in all
        assert fs.statistics().file_misses == 2  # big and small, each once


async def test_a_getattr_miss_brings_the_file_too(autojump_clock: object) -> None:
    backend = FakeBackend()
    backend.write("f", b"f" * 10)
    async with filesystem(backend) as fs:
        fs.lookup_fetch = False
        inode = (await fs.lookup(ROOT_INODE, "f")).inode
        assert backend.stat_reads == 0
        fs.lookup_fetch = True
        fs.meta.invalidate("f")
        await fs.getattr(inode)
        assert backend.stat_reads == 1
        assert await fs.read(inode, 0, 0, 100) == b"f" * 10
        assert backend.operations["read"] == 0 and fs.statistics().file_misses == 1


async def test_without_a_free_fetch_slot_a_lookup_only_stats(autojump_clock: object) -> None:
    backend = FakeBackend()
    backend.write("f", b"f" * 10)
    async with filesystem(backend, fetch_slots=2) as fs:
        slots = [fs.cache.try_fetch_slot() for _ in range(2)]
        assert all(slots) and fs.cache.try_fetch_slot() is None
        await fs.lookup(ROOT_INODE, "f")
        assert backend.stat_reads == 0 and backend.operations["stat"] == 1
        for slot in slots:
            fs.cache.release_fetch_slot(slot)
        assert fs.cache.statistics().slots.busy_foreground == 0


async def test_a_lookup_fetch_never_admits_bytes_of_another_version(autojump_clock: object) -> None:
    backend = FakeBackend()
    backend.write("f", b"1" * 100)
    gate = backend.gate("f")  # the read part of the lookup waits here
    async with filesystem(backend) as fs, trio.open_nursery() as nursery:
        entries = []

        async def lookup() -> None:
            entries.append(await fs.lookup(ROOT_INODE, "f"))

        nursery.start_soon(lookup)
        await trio.sleep(1)
        new = backend.write("f", b"2" * 100)  # changed between the stat and the read
        gate.set()
        await trio.sleep(1)
        old = entries[0].attr.version
        assert old != new and backend.stat_reads == 0
        assert not fs.cache.contains(block_key("f", old, 0)) and not fs.cache.contains(block_key("f", new, 0))
        # A read of the old version's inode finds the change (ESTALE, never the "2"s) and
        # drops the name's attributes: its next lookup gives the new version's inode.
        with pytest.raises(StaleVersion) as stale:
            await fs.read(entries[0].inode, 0, 0, 100)
        assert stale.value.errno == errno.ESTALE
        assert (await fs.lookup(ROOT_INODE, "f")).inode != entries[0].inode
        assert await read_file(fs, "f") == b"2" * 100


async def test_an_evicted_admitted_block_leaves_no_trace(autojump_clock: object) -> None:
    backend = FakeBackend()
    for i in range(70):  # more one-block files than the 64-block RAM tier holds
        backend.write(f"f{i}", bytes([i]) * BLOCK)
    async with filesystem(backend) as fs:
        for i in range(70):
            await fs.lookup(ROOT_INODE, f"f{i}")
        assert backend.stat_reads == 70
        assert len(fs.cache._admitted_unread) == fs.cache.memory.statistics().blocks == 64
        assert await read_file(fs, "f0") == bytes([0]) * BLOCK  # evicted: read_block fetches it
        assert backend.read_calls[("f0", 0)] == 2 and fs.statistics().file_misses == 1
        await fs.cache.clear()
        assert not fs.cache._admitted_unread


async def test_the_directory_backend_reads_beneath_the_root_only_the_version_it_stats(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"f" * 100)
    (root / "big").write_bytes(b"b" * (BLOCK + 1))
    (tmp_path / "secret").write_bytes(b"s" * 10)
    (root / "d" / "link").symlink_to(tmp_path / "secret")
    (root / "dlink").symlink_to(root / "d")
    backend = LocalDirBackend(str(root), 2)
    try:
        attr, data = await backend.stat_read("d/f", BLOCK, lambda a: True)
        assert attr.size == 100 and data == b"f" * 100
        assert (await backend.stat_read("d/f", BLOCK, lambda a: False))[1] is None  # not wanted
        attr, data = await backend.stat_read("big", BLOCK, lambda a: True)
        assert attr.size == BLOCK + 1 and data is None  # larger than the limit: stat only
        attr, data = await backend.stat_read("d/link", BLOCK, lambda a: True)
        assert attr.is_symlink and data is None  # served as a symlink, never followed
        with pytest.raises(OSError) as loop:
            await backend.stat_read("dlink/f", BLOCK, lambda a: True)
        assert loop.value.errno == errno.ELOOP  # a symlinked directory on the way
        with pytest.raises(FileNotFoundError):
            await backend.stat_read("d/none", BLOCK, lambda a: True)

        def rewrite(attr: Attr) -> bool:  # the file changes between the stat and the read
            (root / "d" / "f").write_bytes(b"g" * 101)  # another size: a version change at any clock granularity
            return True

        attr, data = await backend.stat_read("d/f", BLOCK, rewrite)
        assert attr.size == 100 and data is None  # never the new bytes under the old version
        stats = backend.statistics()
        # Two read parts ran (d/f, and the rewritten one): each is a read, timed like read_block's.
        assert stats.operations["stat"] == 7 and stats.operations["read"] == 2 and stats.bytes_read == 100
        assert stats.latency["read"].count == 2
    finally:
        backend.close()


async def test_a_file_on_nvme_is_left_there_by_its_lookup_and_read_as_a_disk_hit(tmp_path: Path) -> None:
    """After a restart (RAM and metadata empty, NVMe kept), a lookup's one backend call
    stats the file and leaves its block on NVMe (no copy into RAM: the borrower, where
    there is one, serves it from its NVMe place); the source is not read and the
    application's read is an NVMe hit."""
    backend = FakeBackend()
    backend.write("f", b"n" * 3000)
    backend.write("bad", b"b" * 3000)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    try:
        async with filesystem(backend, disk=disk) as fs:
            assert await read_file(fs, "f") == b"n" * 3000
            assert await read_file(fs, "bad") == b"b" * 3000
            await fs.cache.drain()
        damage_block(tmp_path, block_key("bad", backend.version("bad"), 0), -1)  # damaged on NVMe
        backend.operations.clear()
        async with filesystem(backend, disk=disk) as fs:  # a fresh RAM tier and metadata cache
            assert await read_file(fs, "f") == b"n" * 3000
            assert dict(backend.operations) == {"stat": 1} and backend.stat_reads == 2  # only the first run's
            s, c = fs.statistics(), fs.cache.statistics()
            assert (s.file_requests, s.file_misses) == (1, 0)
            assert s.blocks_by_source[Source.DISK.value] == 1 and c.hits_disk == 1
            assert c.disk is not None and c.disk.hits == 1
            # A damaged block is not admitted: the read path finds it, drops it and refetches.
            assert await read_file(fs, "bad") == b"b" * 3000
            c = fs.cache.statistics()
            assert c.disk is not None and c.disk.checksum_failures == 1 and backend.operations["read"] == 1
            assert fs.statistics().file_misses == 1
    finally:
        await disk.close()
