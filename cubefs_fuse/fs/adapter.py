"""The thin pyfuse3 adapter: requests to ``fs.filesystem.Filesystem`` calls and results back
to pyfuse3's types, with no logic beyond that; every handler goes through ``_translating``,
which turns any exception into ``FUSEError(errors.errno_of(exc))`` and logs unexpected ones
(bugs) with their traceback once per exception type."""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from cubefs_fuse.attrs import Attr
from cubefs_fuse.fs.filesystem import Entry, Filesystem
from cubefs_fuse.errors import FsError, errno_of

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
_logged_bugs: set[type[BaseException]] = set()


def _translating(handler: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            if not isinstance(exc, (OSError, FsError)) and type(exc) not in _logged_bugs:
                _logged_bugs.add(type(exc))
                log.exception("unexpected error in %s (reported as EIO)", handler.__name__)
            raise pyfuse3.FUSEError(errno_of(exc)) from None

    return wrapper


async def _erofs(*_: Any) -> Any:
    raise pyfuse3.FUSEError(errno.EROFS)


class FuseOperations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem, *, entry_timeout: float, attr_timeout: float,
                 on_init: Callable[[], object] | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.on_init = on_init

    def init(self) -> None:
        """The kernel's INIT request is being answered (synchronously, on the trio thread):
        ``on_init`` may schedule work that must come after the kernel took the answer."""
        if self.on_init is not None:
            self.on_init()

    def _attributes(self, inode: int, attr: Attr) -> pyfuse3.EntryAttributes:
        out = pyfuse3.EntryAttributes()
        out.st_ino = pyfuse3.InodeT(inode)
        out.generation = 0
        out.entry_timeout = self.entry_timeout
        out.attr_timeout = self.attr_timeout
        out.st_mode = pyfuse3.ModeT(attr.mode)
        out.st_nlink = attr.nlink
        out.st_uid = attr.uid
        out.st_gid = attr.gid
        out.st_rdev = attr.rdev
        out.st_size = attr.size
        out.st_blksize = attr.blksize
        out.st_blocks = attr.blocks
        out.st_atime_ns = attr.atime_ns
        out.st_mtime_ns = attr.mtime_ns
        out.st_ctime_ns = attr.ctime_ns
        return out

    def _entry(self, entry: Entry) -> pyfuse3.EntryAttributes:
        return self._attributes(entry.inode, entry.attr)

    @_translating
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:  # type: ignore[override]
        return self._entry(await self.fs.lookup(parent_inode, os.fsdecode(name)))

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:  # type: ignore[override]
        for inode, n in inode_list:
            self.fs.forget(inode, n)

    @_translating
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:  # type: ignore[override]
        return self._entry(await self.fs.getattr(inode))

    @_translating
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:  # type: ignore[override]
        return os.fsencode(await self.fs.readlink(inode))

    @_translating
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:  # type: ignore[override]
        return await self.fs.opendir(inode)

    @_translating
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:  # type: ignore[override]
        for next_id, name, path, attr in self.fs.readdir(fh, start_id):
            entry = self.fs.entry(path, attr)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(entry), next_id):
                self.fs.forget(entry.inode, 1)  # the kernel did not take this entry
                break

    @_translating
    async def releasedir(self, fh: int) -> None:  # type: ignore[override]
        self.fs.releasedir(fh)

    @_translating
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:  # type: ignore[override]
        fh = await self.fs.open(inode, flags, ctx.pid)
        # keep_cache always: an inode serves one version of a file (a changed file gets a
        # new inode, fs/inodes.py), so the pages the kernel holds for it are always good.
        # No invalidation notices at all: nothing here waits on the kernel's page locks.
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), keep_cache=True)

    @_translating
    async def read(self, fh: int, off: int, size: int) -> bytes:  # type: ignore[override]
        return await self.fs.read(fh, off, size)  # type: ignore[return-value]  # any buffer will do

    async def flush(self, fh: int) -> None:
        # Every close() of a FUSE file would be a FLUSH request; nothing is written here, so
        # the first one answers ENOSYS, which the kernel remembers for the connection
        # (fc->no_flush): no close costs a request after that (tests/mounted/test_request_count.py).
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_translating
    async def release(self, fh: int) -> None:  # type: ignore[override]
        self.fs.release(fh)

    @_translating
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:  # type: ignore[override]
        st = await self.fs.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.block_size
        out.f_frsize = st.fragment_size
        out.f_blocks = st.blocks
        out.f_bfree = st.blocks_free
        out.f_bavail = st.blocks_available
        out.f_files = st.files
        out.f_ffree = st.files_free
        out.f_favail = st.files_free
        out.f_namemax = st.name_max
        return out

    # The volume is read-only: every modifying operation is refused.
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs  # type: ignore[assignment]
    write = create = setxattr = removexattr = fallocate = _erofs  # type: ignore[assignment]
