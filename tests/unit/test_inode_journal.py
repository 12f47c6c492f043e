"""The inode journal (fs/journal.py): what a dead daemon's successor rebuilds its inode table
from.  Every inode the kernel may hold must come back with its number, path, attributes and
retirement; freed ones must not; numbers must never be given twice; a compaction that runs
while the table changes must lose nothing; a journal that is not one is refused."""

from __future__ import annotations

import os
import stat

import pytest
import trio

from cubefs_fuse.attrs import Attr
from cubefs_fuse.fs import journal as journals
from cubefs_fuse.fs.inodes import RECOVERED_LOOKUPS, ROOT_INODE, InodeTable


def attr(size: int, mtime: int = 1, ino: int = 7) -> Attr:
    return Attr(stat.S_IFREG | 0o644, 1, 0, 0, 0, size, 8, 4096, -5, mtime, mtime, ino)


def journalled() -> tuple[InodeTable, journals.InodeJournal]:
    table = InodeTable()
    table.journal = journals.InodeJournal.of(table)
    return table, table.journal


def assert_same(table: InodeTable, recovered: InodeTable) -> None:
    live = {inode: (n.path, n.attr, n.retired) for inode, n in table.snapshot() if inode != ROOT_INODE}
    back = {inode: (n.path, n.attr, n.retired) for inode, n in recovered.snapshot() if inode != ROOT_INODE}
    assert back == live
    for inode, (path, _, retired) in live.items():
        assert (recovered.current(path) == inode) == (not retired)
    assert recovered.next_number() >= table.next_number()


def test_a_recovered_table_holds_every_inode_the_kernel_may_hold_and_no_freed_one() -> None:
    table, journal = journalled()
    names = ["a", "d/b", "weird\nname", os.fsdecode(b"bad\xffutf8"), "big"]
    numbers = {name: table.remember(name, attr(10 + i, ino=(1 << 64) - 1 - i)) for i, name in enumerate(names)}
    table.remember("a", attr(10, ino=(1 << 64) - 1))  # looked up twice: same inode
    changed = table.remember("d/b", attr(99, mtime=2))  # a new version: the old inode is retired
    assert changed != numbers["d/b"] and table.node(numbers["d/b"]).retired
    assert table.forget(numbers["big"], 1)  # the kernel forgot it: freed
    recovered = InodeTable.recovered(journals.read(journal.fd))
    assert_same(table, recovered)
    assert numbers["big"] not in {inode for inode, _ in recovered.snapshot()}
    assert recovered.node(numbers["d/b"]).retired and recovered.current("d/b") == changed
    assert recovered.node(numbers["weird\nname"]).attr == attr(12, ino=(1 << 64) - 3)  # st_ino past 2^63
    # Lookup counts are unknown: no FORGET stream frees a recovered inode.
    assert recovered.node(numbers["a"]).lookups == RECOVERED_LOOKUPS
    assert not recovered.forget(numbers["a"], 1_000_000)
    # Numbers are never given twice, the freed one's included.
    assert recovered.remember("new", attr(1)) > max(numbers.values())
    journal.close()


@pytest.mark.parametrize("journal_of_the_recovered", ["continued", "a snapshot"])
def test_a_recovered_table_recovers_again(journal_of_the_recovered: str) -> None:
    table, journal = journalled()
    for i in range(50):
        table.remember(f"f{i}", attr(i))
    again = InodeTable.recovered(journals.read(journal.fd))
    own = journals.InodeJournal(os.dup(journal.fd), records=len(again)) if journal_of_the_recovered == "continued" \
        else journals.InodeJournal.of(again)
    again.journal = own
    again.remember("later", attr(1))
    again.remember("f3", attr(1000))  # retires f3's inode
    third = InodeTable.recovered(journals.read(own.fd))
    assert_same(again, third)
    journal.close()
    own.close()


def test_compaction_while_the_table_changes_loses_nothing() -> None:
    table, journal = journalled()
    for i in range(20_000):
        table.remember(f"f{i}", attr(i))
    for i in range(0, 20_000, 2):
        table.forget(table.current(f"f{i}") or 0, 1)  # half of them forgotten: records to drop
    assert journal.records > 20_000

    async def main() -> None:
        async def change() -> None:
            for i in range(200):
                table.remember(f"g{i}", attr(i))
                table.remember(f"f{2 * i + 1}", attr(10**6 + i))  # retires the odd inodes' versions
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(change)
            old = await journal.compact(table)
        os.close(old)

    replaced = os.dup(journal.fd)
    trio.run(main)
    # The replaced journal is complete, and marked: a recovery may read it, nobody continue it.
    assert len(journals.read(replaced)[0]) > 0
    with pytest.raises(journals.JournalError, match="compaction"):
        journals.InodeJournal(replaced)
    os.close(replaced)
    assert 0 < journal.records <= 600  # 3 per step at most: only the records written while the snapshot was made count as growth
    assert_same(table, InodeTable.recovered(journals.read(journal.fd)))
    assert os.fstat(journal.fd).st_size < 20_000 * 130  # the forgotten half is gone
    journal.close()


def test_compaction_is_asked_for_only_past_its_bound() -> None:
    table, journal = journalled()
    for i in range(100):
        table.remember(f"f{i}", attr(i))
    assert not journal.worth_compacting(len(table))  # small: kept as it is
    journal.records = journals.COMPACT_AFTER + 1
    assert journal.worth_compacting(len(table))
    assert not journal.worth_compacting(journals.COMPACT_AFTER)  # not when the table is as large
    journal.close()


@pytest.mark.parametrize("damage", ["cut record", "cut path", "unknown kind"])
def test_what_is_not_a_journal_is_refused(damage: str) -> None:
    table, journal = journalled()
    table.remember("some/file", attr(5))
    data = os.pread(journal.fd, 1 << 20, 0)
    bad = {"cut record": data[:-20], "cut path": data[:-3], "unknown kind": data + b"Z" + bytes(8)}[damage]
    fd = os.memfd_create("bad", os.MFD_CLOEXEC)
    try:
        os.write(fd, bad)
        with pytest.raises(journals.JournalError):
            journals.read(fd)
    finally:
        os.close(fd)
        journal.close()


def test_a_journal_of_another_format_is_neither_read_nor_continued() -> None:
    table, journal = journalled()
    table.remember("some/file", attr(5))
    os.pwrite(journal.fd, b"CFJ9", 0)  # what a release with another format would have written
    with pytest.raises(journals.JournalError, match="format"):
        journals.read(journal.fd)
    other = os.dup(journal.fd)
    with pytest.raises(journals.JournalError, match="format"):
        journals.InodeJournal(other)
    os.close(other)
    journal.close()
