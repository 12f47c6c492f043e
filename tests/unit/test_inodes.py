"""fs/inodes.py without a kernel: one inode per version of a file, retiring, lookup counts."""

from __future__ import annotations

import dataclasses
import errno
import stat

import pytest

from cubefs_fuse.attrs import Attr
from cubefs_fuse.errors import FsError
from cubefs_fuse.fs.inodes import ROOT_INODE, InodeTable, identity

FILE = Attr(stat.S_IFREG | 0o644, 1, 0, 0, 0, 100, 1, 4096, 1, 10, 10, 500)
DIR = Attr(stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 8, 4096, 1, 10, 10, 600)


def changed(attr: Attr, **fields: int) -> Attr:
    return dataclasses.replace(attr, **fields)


@pytest.mark.parametrize("field", ["size", "mtime_ns", "ino", "ctime_ns"])
def test_any_change_of_a_files_version_gives_the_path_a_new_inode(field: str) -> None:
    table = InodeTable()
    old = table.remember("f", FILE)
    assert table.remember("f", changed(FILE, atime_ns=99, nlink=2)) == old  # not part of the version
    new = table.remember("f", changed(FILE, **{field: getattr(FILE, field) + 1}))
    assert new != old and new > old
    assert table.node(old).retired and table.node(old).attr == changed(FILE, atime_ns=99, nlink=2)
    assert not table.node(new).retired
    assert table.statistics().changes == 1


def test_a_retired_inode_never_serves_again_even_the_version_it_had() -> None:
    table = InodeTable()
    old = table.remember("f", FILE)
    assert not table.serves(old, changed(FILE, size=5))  # found changed through the old inode
    assert not table.serves(old, FILE)  # the source went back: still a new inode for it
    new = table.remember("f", FILE)
    assert new != old and table.serves(new, FILE)
    assert table.statistics().changes == 1  # counted once


def test_directories_keep_their_inode_and_a_change_of_type_retires() -> None:
    table = InodeTable()
    d = table.remember("d", DIR)
    assert table.remember("d", changed(DIR, mtime_ns=99, ctime_ns=99, size=8192)) == d
    assert table.serves(ROOT_INODE, DIR) and table.serves(ROOT_INODE, FILE)  # the root is never retired
    assert table.remember("d", FILE) != d
    assert identity(DIR) == (stat.S_IFDIR, None) and identity(FILE) == (stat.S_IFREG, FILE.version)


def test_each_change_is_counted_once_and_the_old_inodes_stay_until_forgotten() -> None:
    table = InodeTable()
    a, b = table.remember("a", FILE), table.remember("b", FILE)
    table.remember("a", changed(FILE, size=1))
    table.remember("b", changed(FILE, size=1))
    assert not table.serves(a, changed(FILE, size=1))  # retired already: not counted again
    stats = table.statistics()
    assert (stats.changes, stats.retired, stats.inodes) == (2, 2, 5)
    assert table.forget(b, 1)
    assert table.statistics().retired == 1


def test_forget_frees_current_and_retired_inodes_without_touching_the_path_of_the_other() -> None:
    table = InodeTable()
    old = table.remember("f", FILE)
    table.remember("f", FILE)  # two lookups
    new = table.remember("f", changed(FILE, size=7))
    table.forget(old, 1)
    assert table.node(old).lookups == 1
    table.forget(old, 1)
    with pytest.raises(FsError) as gone:
        table.node(old)
    assert gone.value.errno == errno.ESTALE
    assert table.statistics().retired == 0
    assert table.remember("f", changed(FILE, size=7)) == new  # the path still has its inode
    table.forget(new, 2)
    again = table.remember("f", changed(FILE, size=7))
    assert again not in (old, new)  # numbers are never reused
    table.forget(ROOT_INODE, 5)
    assert table.node(ROOT_INODE).lookups == 1
