"""The inode journal: what a daemon that dies (SIGKILL, the OOM killer, a crash) leaves for
the daemon that recovers its mount.  The kernel keeps the inode numbers the dead daemon
gave; the new one must know what each still means, so every inode the table creates,
retires or frees is written here, at once, before the kernel can learn its number.

The journal is a memfd (RAM, no disk): the daemon's keeper process holds a descriptor of
it, with the /dev/fuse one (control/keeper.py), so it outlives the daemon.  A write to it is
complete when ``write()`` returns, whatever happens to the writer next.

The file starts with ``MAGIC``, which names its format: a release that reads another
refuses it (a recovery then fails with the reason) and never appends to it.  Records
(little-endian): ``H`` next number (a snapshot's first record), ``N`` inode, its 12
attribute fields (``attr_fields``; st_ino as its int64 bits), the path's length and bytes;
``R`` inode (retired: its path moved on to a new inode); ``F`` inode (freed); ``X``
(superseded: the last record of a journal a compaction replaced, which nobody may continue).  Lookup
counts are not written (a LOOKUP answered in C would need a write): a replayed inode is
kept until the mount ends (``inodes.RECOVERED_LOOKUPS``), a bounded leak of what the kernel held
when the daemon died.

A recovering daemon replays the journal and then continues it (it describes the table it
rebuilt already): a recovery that fails half-way has written what its successor needs too.
The journal grows with every inode ever created; ``compact()`` rewrites it as a snapshot of
the live table into a new memfd, the serialisation in a worker thread, the records written
meanwhile appended after it."""

from __future__ import annotations

import os
import struct
import trio

from cubefs_fuse.attrs import Attr, attr_fields
from cubefs_fuse.fs.inodes import ROOT_INODE, InodeTable, Node, Replayed, bulk

MAGIC = b"CFJ1"  # cubefs-fuse inode journal, format 1
_HEAD = struct.Struct("<cQ")  # kind, inode (or next number)
_SUPERSEDED = _HEAD.pack(b"X", 0)  # (unambiguous at the end: a path, the end of an N, has no NUL)
_NEW = struct.Struct("<cQ12qI")  # kind, inode, attribute fields, path length
_INO = 11  # attr_fields' index of the source inode number: unsigned, written as its bits
_WRAP = 1 << 64
# compact() is worth it once the journal holds this many records more than the table has
# inodes (and at least this many: a small journal costs nothing to keep).
COMPACT_AFTER = 1 << 16


class JournalError(ValueError):
    """The journal cannot be read (not one, or cut inside a record)."""


class InodeJournal:
    """Appends the inode table's changes to a memfd; ``fd`` is the descriptor to keep."""

    def __init__(self, fd: int | None = None, records: int = 0) -> None:
        """A new journal, or the one at ``fd`` continued (``records``: about how many it holds)."""
        if fd is None:
            fd = _new_memfd()
        else:
            _check_magic(fd)
            end = os.lseek(fd, 0, os.SEEK_END)
            if end >= len(MAGIC) + _HEAD.size and os.pread(fd, _HEAD.size, end - _HEAD.size) == _SUPERSEDED:
                raise JournalError("a journal a compaction has replaced")
        self.fd = fd
        self.records = records  # records written since the last snapshot
        self._tail: list[bytes] | None = None  # records also owed to a snapshot being written

    def close(self) -> None:
        os.close(self.fd)

    def _write(self, record: bytes) -> None:
        os.write(self.fd, record)  # memfd: never short, never blocks
        self.records += 1
        if self._tail is not None:
            self._tail.append(record)

    def created(self, inode: int, path: str, attr: Attr) -> None:
        self._write(_new_record(inode, path, attr))

    def retired(self, inode: int) -> None:
        self._write(_HEAD.pack(b"R", inode))

    def freed(self, inode: int) -> None:
        self._write(_HEAD.pack(b"F", inode))

    def worth_compacting(self, live: int) -> bool:
        return self._tail is None and self.records > max(2 * live, COMPACT_AFTER)

    async def compact(self, table: InodeTable) -> int:
        """Rewrite the journal as a snapshot of ``table`` in a new memfd, which becomes this
        journal's ``fd`` (returned; the caller hands it to the keeper, then closes the old
        one, which it gets back).  The table is copied on the trio thread (a list of
        references), serialised in a worker thread; a node changed meanwhile is also in the
        records written since, which follow the snapshot and win when replayed."""
        self._tail = []
        try:
            nodes = table.snapshot()
            data = await trio.to_thread.run_sync(_snapshot, nodes, table.next_number())
            fd = _new_memfd()
            try:
                os.write(fd, data)
                for record in self._tail:
                    os.write(fd, record)
            except BaseException:
                os.close(fd)
                raise
        finally:
            tail, self._tail = self._tail, None
        os.write(self.fd, _SUPERSEDED)  # a successor given this one must not continue it
        old, self.fd, self.records = self.fd, fd, len(tail)
        return old

    @classmethod
    def of(cls, table: InodeTable) -> InodeJournal:
        """A new journal that starts as a snapshot of ``table`` (a table restored from a
        handover or a recovery, before the mount is served)."""
        journal = cls()
        os.write(journal.fd, _snapshot(table.snapshot(), table.next_number()))
        return journal


def _new_memfd() -> int:
    fd = os.memfd_create("cubefs-fuse-inodes", os.MFD_CLOEXEC)
    os.write(fd, MAGIC)
    return fd


def _check_magic(fd: int) -> None:
    magic = os.pread(fd, len(MAGIC), 0)
    if magic != MAGIC:
        raise JournalError(f"an inode journal of format {magic!r}, not {MAGIC!r} (another release's)")


def _new_record(inode: int, path: str, attr: Attr) -> bytes:
    fields = attr_fields(attr)
    if fields[_INO] >= 1 << 63:
        fields[_INO] -= _WRAP
    raw = os.fsencode(path)
    return _NEW.pack(b"N", inode, *fields, len(raw)) + raw


def _snapshot(nodes: list[tuple[int, Node]], next_number: int) -> bytes:
    parts = [_HEAD.pack(b"H", next_number)]
    for inode, node in nodes:
        attr = node.attr  # read once: the trio thread may replace it meanwhile
        if attr is None or inode == ROOT_INODE:  # the root: every table has it
            continue
        parts.append(_new_record(inode, node.path, attr))
        if node.retired:
            parts.append(_HEAD.pack(b"R", inode))
    return b"".join(parts)


def read(fd: int) -> Replayed:
    """Every inode the journal at ``fd`` says is live: {inode: (path, attributes, retired)},
    and the next number to give.  JournalError if it is not a journal.  (Written for speed:
    it runs while the mount's readers wait: ~4 µs per record here, most of it ``Attr()``.)"""
    with bulk():
        return _read(fd)


def _read(fd: int) -> Replayed:
    _check_magic(fd)
    data = os.pread(fd, os.fstat(fd).st_size, 0)
    size = len(data)
    nodes: dict[int, tuple[str, Attr, bool]] = {}
    unpack_new, unpack_head, new, head = _NEW.unpack_from, _HEAD.unpack_from, _NEW.size, _HEAD.size
    highest, at = 0, len(MAGIC)
    try:
        while at < size:
            kind = data[at]
            if kind == _N:
                (_, inode, mode, nlink, uid, gid, rdev, length_, blocks, blksize, atime, mtime, ctime, ino,
                 length) = unpack_new(data, at)
                start = at + new
                at = start + length
                if at > size:
                    raise JournalError(f"a path cut at byte {start}")
                if ino < 0:
                    ino += _WRAP
                nodes[inode] = (data[start:at].decode("utf-8", "surrogateescape"),
                                Attr(mode, nlink, uid, gid, rdev, length_, blocks, blksize, atime, mtime, ctime, ino),
                                False)
            elif kind == _X:
                at += head
                continue
            elif kind == _R or kind == _F or kind == _H:
                _, inode = unpack_head(data, at)
                at += head
                if kind == _H:
                    inode -= 1  # the next number: the highest given is below it
                elif kind == _F:
                    nodes.pop(inode, None)
                elif inode in nodes:
                    path, attr, _ = nodes[inode]
                    nodes[inode] = (path, attr, True)
            else:
                raise JournalError(f"unknown record {data[at:at + 1]!r} at byte {at}")
            if inode > highest:
                highest = inode
    except struct.error as exc:
        raise JournalError(f"a record cut at byte {at}: {exc}") from None
    return nodes, highest + 1


_N, _R, _F, _H, _X = b"NRFHX"  # the record kinds as the bytes of the journal hold them
