"""What every layer says about files: attributes, versions and volume statistics; the shared
types at the bottom of the package (the backends produce them, the cache keys blocks by
:class:`FileVersion`, the filesystem core and the FUSE adapter hand them on), importing
nothing of the package."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FileVersion:
    """Everything that changes when a file's content may have changed (cache/keys.py says why)."""

    size: int
    mtime_ns: int
    ino: int
    ctime_ns: int


@dataclass(frozen=True, slots=True)
class Attr:
    """The attributes of a source file, as the backend saw them."""

    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    blocks: int
    blksize: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @classmethod
    def from_stat(cls, st: os.stat_result) -> Attr:
        return cls(
            st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_rdev, st.st_size,
            st.st_blocks, st.st_blksize, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
        )

    @property
    def version(self) -> FileVersion:
        return FileVersion(self.size, self.mtime_ns, self.ino, self.ctime_ns)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)


def attr_fields(attr: Attr) -> list[int]:
    """The attributes as a list in field order (``Attr(*fields)`` makes them again)."""
    return [attr.mode, attr.nlink, attr.uid, attr.gid, attr.rdev, attr.size, attr.blocks, attr.blksize,
            attr.atime_ns, attr.mtime_ns, attr.ctime_ns, attr.ino]


@dataclass(frozen=True, slots=True)
class FsStats:
    block_size: int
    fragment_size: int
    blocks: int
    blocks_free: int
    blocks_available: int
    files: int
    files_free: int
    name_max: int
