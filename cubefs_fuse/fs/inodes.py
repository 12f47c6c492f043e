"""The inode table: inode numbers for paths, with the kernel's lookup counts.

An inode lives while the kernel holds a lookup on it (``forget`` brings the count to
zero) and keeps the version whose pages the kernel page cache may hold.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from itertools import count

from cubefs_fuse.attrs import FileVersion
from cubefs_fuse.errors import FsError

ROOT_INODE = 1


@dataclass(slots=True)
class Node:
    path: str
    lookups: int = 0
    last_version: FileVersion | None = None  # the version the kernel page cache may hold


class InodeTable:
    """Inode numbers for paths, with the kernel's lookup counts (freed at zero)."""

    def __init__(self) -> None:
        self._nodes: dict[int, Node] = {ROOT_INODE: Node("", lookups=1)}
        self._by_path: dict[str, int] = {"": ROOT_INODE}
        self._numbers = count(ROOT_INODE + 1)

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, inode: int) -> Node:
        try:
            return self._nodes[inode]
        except KeyError:
            raise FsError(errno.ESTALE, f"unknown inode {inode}") from None

    def remember(self, path: str) -> int:
        """The inode of ``path``, its lookup count raised by one."""
        inode = self._by_path.get(path)
        if inode is None:
            inode = next(self._numbers)
            self._by_path[path] = inode
            self._nodes[inode] = Node(path)
        self._nodes[inode].lookups += 1
        return inode

    def forget(self, inode: int, n: int) -> None:
        node = self._nodes.get(inode)
        if node is None or inode == ROOT_INODE:
            return
        node.lookups -= n
        if node.lookups <= 0:
            del self._nodes[inode]
            if self._by_path.get(node.path) == inode:
                del self._by_path[node.path]


def child_path(parent: str, name: str) -> str:
    if not name or "/" in name or "\0" in name:
        raise FsError(errno.EINVAL, f"bad name {name!r}")
    return f"{parent}/{name}" if parent else name
