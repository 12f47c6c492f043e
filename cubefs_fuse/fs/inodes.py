"""The inode table: inode numbers for paths, one per version of a file, with the kernel's
lookup counts. Because the kernel page cache belongs to an inode, an inode serves exactly
one identity of its path (a regular file's :class:`FileVersion`, else its file type); when
the path is found with another identity the inode is retired: the path gets a new number, so
new opens get a fresh inode, while the retired one serves its own version, attributes
frozen, to the files still open on it until the kernel forgets it. Numbers are never reused
(docs/contracts.md, "One inode per file version").  An inode is kept while the kernel holds
it or a published entry may hand it to the kernel again (``pin``)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import stat
from collections.abc import Iterator
from array import array
from dataclasses import dataclass
from typing import Any, Protocol

from cubefs_fuse.attrs import Attr, FileVersion, attr_fields
from cubefs_fuse.errors import FsError

ROOT_INODE = 1
# A recovered inode's lookup count (InodeTable.recovered): the real one died with the daemon
# that knew it, so it is one no stream of the kernel's FORGETs can bring to zero.
RECOVERED_LOOKUPS = 1 << 40

Identity = tuple[int, FileVersion | None]
# What a journal replays (fs/journal.py): {inode: (path, attributes, retired)}, the next number.
Replayed = tuple[dict[int, tuple[str, Attr, bool]], int]


@contextlib.contextmanager
def bulk() -> Iterator[None]:
    """Python's cyclic garbage collector off while a table is built in one go (a handover's
    or a recovery's, while readers wait): the objects made (nodes, attributes, tuples) form
    no cycles, and the collections their number triggers, each a walk over every object of
    the process, cost more than building them (measured: 0.83 s → 0.38 s to replay 100,000
    inodes)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class InodeLog(Protocol):
    """Where the table writes each inode it creates, retires or frees (fs/journal.py)."""

    def created(self, inode: int, path: str, attr: Attr) -> None: ...
    def retired(self, inode: int) -> None: ...
    def freed(self, inode: int) -> None: ...


def identity(attr: Attr) -> Identity:
    """What one inode may serve: a regular file's version (its pages), else only a type
    (the kernel caches no data of directories and symlinks on this mount)."""
    return stat.S_IFMT(attr.mode), attr.version if attr.is_file else None


@dataclass(slots=True)
class Node:
    path: str
    attr: Attr | None  # what this inode serves (None: the root before its first getattr)
    lookups: int = 0
    retired: bool = False  # the path has moved on to another inode (its file changed)
    pins: int = 0  # entries published to the FUSE session that may answer with this inode


@dataclass(frozen=True, slots=True)
class InodeStatistics:
    inodes: int
    retired: int  # retired inodes the kernel still holds
    changes: int  # files found changed while the kernel held the old version's inode


class InodeTable:
    """Inode numbers for (path, identity), with the kernel's lookup counts (freed at zero)."""

    def __init__(self) -> None:
        self._nodes: dict[int, Node] = {ROOT_INODE: Node("", None, lookups=1)}
        self._by_path: dict[str, int] = {"": ROOT_INODE}  # the current inode of each path
        self._next = ROOT_INODE + 1  # numbers are never reused
        self._retired = 0
        self._changes = 0
        # Where every inode created, retired or freed is written before the kernel can learn
        # of it, for a daemon that recovers the mount after this one died (fs/journal.py).
        self.journal: InodeLog | None = None

    def __len__(self) -> int:
        return len(self._nodes)

    def current(self, path: str) -> int | None:
        """The inode serving ``path`` now, if the kernel holds one."""
        return self._by_path.get(path)

    def node(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise FsError(errno.ESTALE, f"unknown inode {inode}") from None

    def remember(self, path: str, attr: Attr) -> int:
        """The inode serving ``attr`` at ``path``, its lookup count raised by one.

        If the path's current inode serves another identity, it is retired and the path
        gets a new inode."""
        inode = self._by_path.get(path)
        if inode is None or not self.serves(inode, attr):
            inode = self._next
            self._next += 1
            self._by_path[path] = inode
            self._nodes[inode] = Node(path, attr)
            if self.journal is not None:
                self.journal.created(inode, path, attr)
        self._nodes[inode].lookups += 1
        return inode

    def serves(self, inode: int, attr: Attr) -> bool:
        """Whether ``inode`` serves ``attr`` (its path's current attributes).

        True: the node takes the fresh attributes (same identity).  False: the inode is
        retired (now, if it was its path's current one; the change is counted) and keeps
        the attributes of its own version."""
        node = self.node(inode)
        if node.retired:
            return False
        if node.attr is attr:  # the metadata cache's same answer: nothing to compare (every warm open)
            return True
        if inode != ROOT_INODE and node.attr is not None and identity(node.attr) != identity(attr):
            self._retire(inode, node)
            return False
        node.attr = attr
        return True

    def _retire(self, inode: int, node: Node) -> None:
        node.retired = True
        self._retired += 1
        if self._by_path.get(node.path) == inode:
            del self._by_path[node.path]
        self._changes += 1
        if self.journal is not None:
            self.journal.retired(inode)

    def looked_up(self, inode: int) -> None:
        """One more lookup the kernel holds, answered from a published entry (the inode is
        pinned by it, so it exists)."""
        self._nodes[inode].lookups += 1

    def pin(self, inode: int) -> None:
        """Keep ``inode`` while an entry naming it is published (even at no lookups)."""
        self._nodes[inode].pins += 1

    def unpin(self, inode: int) -> bool:
        """An entry naming ``inode`` was withdrawn; True if that freed the inode."""
        node = self._nodes.get(inode)
        if node is None:
            return False
        node.pins -= 1
        return self._free_if_unused(inode, node)

    def forget(self, inode: int, n: int) -> bool:
        """Lower the kernel's lookup count; True if that freed the inode."""
        node = self._nodes.get(inode)
        if node is None or inode == ROOT_INODE:
            return False
        node.lookups -= n
        return self._free_if_unused(inode, node)

    def _free_if_unused(self, inode: int, node: Node) -> bool:
        if node.lookups > 0 or node.pins > 0 or inode == ROOT_INODE:
            return False
        del self._nodes[inode]
        if node.retired:
            self._retired -= 1
        elif self._by_path.get(node.path) == inode:
            del self._by_path[node.path]
        if self.journal is not None:
            self.journal.freed(inode)
        return True

    def statistics(self) -> InodeStatistics:
        return InodeStatistics(len(self._nodes), self._retired, self._changes)

    # -- a handover (control/handover.py): the kernel keeps its inode numbers and lookup counts ------

    def export(self) -> dict[str, Any]:
        """The table for the next daemon: every inode the kernel holds (number, path, what
        it serves, lookups, retired) and the next number, in columns (``paths``: the paths
        NUL-separated; ``numbers``: a row of ``_ROW`` int64 per inode), as the handover
        sends them raw: a million inodes cost seconds as JSON lists, a fraction as columns.
        Pins are left out: they keep inodes for entries published to this session, which
        the next one does not have; an inode kept only by a pin is not handed over."""
        kept = [(inode, n) for inode, n in self._nodes.items() if n.lookups > 0 or inode == ROOT_INODE]
        numbers = array("q")
        for inode, n in kept:
            attr = n.attr
            numbers.extend((inode, n.lookups, n.retired, attr is not None))
            numbers.extend(_signed(attr_fields(attr)) if attr is not None else _NO_ATTR)
        return {"next": self._next, "changes": self._changes, "count": len(kept),
                "paths": b"\0".join(os.fsencode(n.path) for _, n in kept), "numbers": numbers.tobytes()}

    @classmethod
    def restore(cls, data: dict[str, Any]) -> InodeTable:
        """The table :meth:`export` described (ValueError if it is not one)."""
        with bulk():
            return cls._restored(data)

    @classmethod
    def _restored(cls, data: dict[str, Any]) -> InodeTable:
        table = cls()
        try:
            table._next = int(data["next"])
            table._changes = int(data["changes"])
            rows = int(data["count"])
            paths = data["paths"].split(b"\0")
            numbers = array("q")
            numbers.frombytes(data["numbers"])
            if len(paths) != rows or len(numbers) != rows * _ROW:
                raise ValueError(f"{rows} inodes, {len(paths)} paths, {len(numbers)} numbers")
            nodes, by_path, fsdecode = table._nodes, table._by_path, os.fsdecode
            for i, raw in enumerate(paths):
                o = i * _ROW
                inode, lookups, retired, has_attr = numbers[o:o + 4]
                node = Node(fsdecode(raw), Attr(*_unsigned(numbers[o + 4:o + _ROW].tolist())) if has_attr else None,
                            lookups, bool(retired))
                nodes[inode] = node
                if node.retired:
                    table._retired += 1
                else:
                    by_path[node.path] = inode
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not an inode table: {exc!r}") from None
        return table


    # -- a recovery (fs/journal.py): the kernel keeps the numbers a dead daemon gave ---------------

    def snapshot(self) -> list[tuple[int, Node]]:
        """Every inode and its node, for a journal's snapshot (a copy of references: the
        nodes are read later, maybe from a worker thread)."""
        return list(self._nodes.items())

    def next_number(self) -> int:
        return self._next

    @classmethod
    def recovered(cls, replayed: Replayed) -> InodeTable:
        """The table a journal describes (``journal.read``).  Lookup counts are unknown: each
        inode keeps ``RECOVERED_LOOKUPS``, so it stays until the mount ends."""
        nodes, next_number = replayed
        with bulk():
            return cls._recovered(nodes, next_number)

    @classmethod
    def _recovered(cls, nodes: dict[int, tuple[str, Attr, bool]], next_number: int) -> InodeTable:
        table = cls()
        table._next = max(next_number, table._next)
        for inode, (path, attr, retired) in nodes.items():
            if inode == ROOT_INODE:
                continue
            table._nodes[inode] = Node(path, attr, RECOVERED_LOOKUPS, retired)
            if retired:
                table._retired += 1
            else:
                table._by_path[path] = inode
        return table


# A handed-over inode's row: number, lookups, retired, has attributes, then the 12 fields of
# attr_fields (zeros for none).  int64: st_ino is unsigned 64-bit, so it goes as its bits.
_ROW = 16
_NO_ATTR = (0,) * 12
_INO = 11  # attr_fields' index of the source inode number
_WRAP = 1 << 64


def _signed(fields: list[int]) -> list[int]:
    if fields[_INO] >= 1 << 63:
        fields[_INO] -= _WRAP
    return fields


def _unsigned(fields: list[int]) -> list[int]:
    if fields[_INO] < 0:
        fields[_INO] += _WRAP
    return fields


def child_path(parent: str, name: str) -> str:
    if not name or "/" in name or "\0" in name:
        raise FsError(errno.EINVAL, f"bad name {name!r}")
    return f"{parent}/{name}" if parent else name
