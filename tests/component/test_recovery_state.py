"""What a daemon that recovers a dead one's mount knows of the kernel's view
(Filesystem.recover, fs/journal.py): from the journal alone, every inode the kernel may
hold means what it meant (number, path, version, retired or not), a forgotten one is gone,
numbers are not reused, and the dead daemon's directory handles are refused, never taken
for a new listing's."""

from __future__ import annotations

import errno

import pytest

from cubefs_fuse.errors import FsError
from cubefs_fuse.fs import journal as journals
from cubefs_fuse.fs.inodes import ROOT_INODE
from tests.fakes import FakeBackend
from tests.stack import open_stack


async def test_what_the_kernel_holds_means_the_same_after_a_crash() -> None:
    backend = FakeBackend()
    backend.write("d/a", b"A" * 100)
    backend.write("d/b", b"B" * 100)
    async with open_stack(backend) as dead:
        fs = dead.fs
        fs.inodes.journal = journal = journals.InodeJournal.of(fs.inodes)
        d = (await fs.lookup(ROOT_INODE, "d")).inode
        a = (await fs.lookup(d, "a")).inode
        b = (await fs.lookup(d, "b")).inode
        old_handle = await fs.opendir(d)
        backend.write("d/a", b"Z" * 50)  # changed at the source: the old inode retires
        dead.meta.invalidate("d/a")
        a_new = (await fs.lookup(d, "a")).inode
        assert a_new != a and fs.inodes.node(a).retired
        fs.forget(b, 1)  # the kernel let b go
        highest = fs.inodes.next_number() - 1

    async with open_stack(backend) as new:
        fs = new.fs
        fs.recover(journals.read(journal.fd))
        journal.close()
        assert fs.inodes.node(d).path == "d"
        retired = fs.inodes.node(a)
        assert retired.retired and retired.attr is not None and retired.attr.size == 100  # its own version
        assert bytes(await fs.read(a_new, 0, 0, 100, pid=1)) == b"Z" * 50
        assert (await fs.lookup(d, "a")).inode == a_new  # the path's current inode
        with pytest.raises(FsError) as info:
            fs.inodes.node(b)  # forgotten before the crash
        assert info.value.errno == errno.ESTALE
        backend.write("d/c", b"C")
        assert (await fs.lookup(d, "c")).inode > highest  # no number given twice
        with pytest.raises(FsError) as info:
            list(fs.readdir(old_handle, 0))  # the dead daemon's listing is gone ...
        assert info.value.errno == errno.EBADF
        assert await fs.opendir(d) != old_handle  # ... and its number never names a new one
