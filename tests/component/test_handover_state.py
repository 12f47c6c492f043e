"""What a daemon hands its successor about the kernel's view (Filesystem.export/restore,
control/handover.py): after the state has gone as the handover sends it (JSON, its bytes
values raw) to a second filesystem, every
inode the kernel holds means what it meant (number, path, version, retired or not, lookup
count), an open directory handle goes on from its offset, numbers are not reused, and
nothing else comes across."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from cubefs_fuse.attrs import Attr
from cubefs_fuse.control import handover
from cubefs_fuse.errors import FsError
from cubefs_fuse.fs.inodes import ROOT_INODE, InodeTable
from tests.fakes import FakeBackend
from tests.stack import open_stack


async def test_what_the_kernel_holds_means_the_same_after_a_handover() -> None:
    backend = FakeBackend()
    backend.write("d/a", b"A" * 100)
    backend.write("d/b", b"B" * 100)
    async with open_stack(backend) as old:
        fs = old.fs
        d = (await fs.lookup(ROOT_INODE, "d")).inode
        a = (await fs.lookup(d, "a")).inode
        assert (await fs.lookup(d, "a")).inode == a  # the kernel holds two lookups of it
        b = (await fs.lookup(d, "b")).inode
        fh = await fs.opendir(d)
        assert [name for _, name, _, _ in fs.readdir(fh, 0)][:1] == ["a"]  # the kernel read one entry
        backend.write("d/a", b"Z" * 50)  # changed at the source: the old inode retires
        old.meta.invalidate("d/a")
        a_new = (await fs.lookup(d, "a")).inode
        assert a_new != a and fs.inodes.node(a).retired
        fs.forget(b, 1)  # the kernel let b go
        blobs: list[bytes] = []
        state = handover.with_blobs(json.loads(json.dumps(handover.without_blobs(fs.export(), blobs))), blobs)

    async with open_stack(backend) as new:
        fs = new.fs
        fs.restore(state)
        retired = fs.inodes.node(a)
        assert retired.retired and retired.attr is not None and retired.attr.size == 100  # its own version
        assert bytes(await fs.read(a_new, 0, 0, 100, pid=1)) == b"Z" * 50
        with pytest.raises(FsError) as info:
            fs.inodes.node(b)  # forgotten before: not handed over
        assert info.value.errno == errno.ESTALE
        assert [name for _, name, _, _ in fs.readdir(fh, 1)] == ["b"]  # the listing goes on
        assert fs.statistics().open_dirs == 1
        fs.forget(a, 1)
        assert fs.inodes.node(a).lookups == 1  # the count came across: one FORGET left
        fs.forget(a, 1)
        with pytest.raises(FsError):
            fs.inodes.node(a)
        backend.write("d/c", b"C")
        c = (await fs.lookup(d, "c")).inode
        assert c > a_new  # numbers are never reused, across the handover either
        assert await fs.opendir(d) > fh  # nor directory handles


def test_the_inode_table_goes_over_whole_whatever_its_paths_and_numbers() -> None:
    """Names with any byte but NUL and "/" (newlines, invalid UTF-8), source inode numbers
    past 2^63 (st_ino is unsigned), timestamps before 1970."""
    table = InodeTable()
    names = ["a\nb", os.fsdecode(b"\xff\xfe"), "plain"]
    for i, name in enumerate(names):
        attr = Attr(stat.S_IFREG | 0o444, 1, 0, 0, 0, i, 1, 4096, -5, -5, -5, (1 << 64) - 1 - i)
        for _ in range(i + 1):
            table.remember(f"d/{name}", attr)
    copy = InodeTable.restore(table.export())
    for path in (f"d/{name}" for name in names):
        inode = table.current(path)
        assert inode is not None and copy.current(path) == inode
        assert copy.node(inode) == table.node(inode)
    assert len(copy) == len(table)


async def test_a_state_that_is_not_one_is_refused_whole() -> None:
    async with open_stack(FakeBackend()) as stack:
        before = stack.fs.inodes
        good = stack.fs.inodes.export()
        for broken in ({}, {"inodes": {**good, "count": 2}, "dirs": [], "next_handle": 1},
                       {"inodes": {**good, "numbers": good["numbers"][:-8]}, "dirs": [], "next_handle": 1},
                       {"inodes": {**good, "paths": "not bytes"}, "dirs": [], "next_handle": 1}):
            with pytest.raises(ValueError):
                stack.fs.restore(broken)
        assert stack.fs.inodes is before  # nothing was taken
