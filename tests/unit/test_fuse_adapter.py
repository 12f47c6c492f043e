"""The pyfuse3 adapter over a fake core: type conversion and errno mapping, nothing else.

No kernel: handlers are awaited directly.  What it must do is translate: attributes with
the configured timeouts, every exception to FUSEError(errno) (bugs to EIO, logged once),
writes refused with EROFS, readdir entries the kernel did not take forgotten, and every
open keeping the page cache without any invalidation notice (one inode serves one version).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterator
from typing import Any

import pyfuse3
import pytest

from cubefs_fuse.attrs import Attr, FsStats
from cubefs_fuse.errors import FsError
from cubefs_fuse.fs import adapter
from cubefs_fuse.fs.adapter import FuseOperations
from cubefs_fuse.fs.filesystem import Entry

FILE = Attr(stat.S_IFREG | 0o644, 1, 1000, 1000, 0, 1234, 8, 4096, 1, 2, 3, 77)


class FakeCore:
    """Records calls; answers from a script; raises what a test puts in ``fail``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail: BaseException | None = None
        self.forgotten: list[tuple[int, int]] = []

    def _maybe_fail(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def lookup(self, parent: int, name: str) -> Entry:
        self.calls.append(("lookup", parent, name))
        self._maybe_fail()
        return Entry(5, FILE)

    async def getattr(self, inode: int) -> Entry:
        self._maybe_fail()
        return Entry(inode, FILE)

    def entry(self, path: str, attr: Attr) -> Entry:
        return Entry(100 + len(path), attr)

    def forget(self, inode: int, n: int) -> None:
        self.forgotten.append((inode, n))

    def readdir(self, fh: int, start: int) -> Iterator[tuple[int, str, str, Attr]]:
        names = ["a", "bb", "ccc"]
        for i in range(start, len(names)):
            yield i + 1, names[i], names[i], FILE

    async def open(self, inode: int, flags: int, pid: int) -> int:
        self.calls.append(("open", inode, flags, pid))
        self._maybe_fail()
        return 9

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self._maybe_fail()
        return b"d" * size

    def release(self, fh: int) -> None:
        self.calls.append(("release", fh))

    async def statfs(self) -> FsStats:
        return FsStats(4096, 4096, 100, 50, 40, 1000, 900, 255)


class Ctx:
    pid = 4242


@pytest.fixture
def ops() -> tuple[FuseOperations, FakeCore]:
    core = FakeCore()
    return FuseOperations(core, entry_timeout=7.0, attr_timeout=3.0), core  # type: ignore[arg-type]


async def test_attributes_are_converted_with_the_configured_timeouts(ops: tuple[FuseOperations, FakeCore]) -> None:
    fuse, core = ops
    out = await fuse.lookup(1, b"name\xff", Ctx())  # type: ignore[arg-type]
    assert core.calls == [("lookup", 1, os.fsdecode(b"name\xff"))]
    assert (out.st_ino, out.st_size, out.st_mode, out.st_uid, out.st_mtime_ns) == (5, 1234, FILE.mode, 1000, 2)
    assert (out.entry_timeout, out.attr_timeout) == (7.0, 3.0)
    st = await fuse.statfs(Ctx())  # type: ignore[arg-type]
    assert (st.f_bsize, st.f_blocks, st.f_bavail, st.f_favail, st.f_namemax) == (4096, 100, 40, 900, 255)


@pytest.mark.parametrize(("raised", "expected"), [
    (FsError(errno.ESTALE), errno.ESTALE),
    (OSError(errno.EACCES, "denied"), errno.EACCES),
    (FileNotFoundError(errno.ENOENT, "gone"), errno.ENOENT),
    (OSError("no errno"), errno.EIO),
    (ValueError("a bug"), errno.EIO),
])
async def test_every_exception_becomes_one_errno(ops: tuple[FuseOperations, FakeCore], raised: BaseException,
                                                 expected: int) -> None:
    fuse, core = ops
    core.fail = raised
    for call in (fuse.lookup(1, b"x", Ctx()), fuse.getattr(1, Ctx()), fuse.read(1, 0, 10)):  # type: ignore[arg-type]
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await call
        assert exc.value.errno == expected


async def test_a_bug_is_logged_once_per_exception_type(ops: tuple[FuseOperations, FakeCore],
                                                      caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "_logged_bugs", set())
    fuse, core = ops
    core.fail = KeyError("bug")
    with caplog.at_level(logging.ERROR, logger=adapter.__name__):
        for _ in range(3):
            with pytest.raises(pyfuse3.FUSEError):
                await fuse.getattr(1, Ctx())  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == ["unexpected error in getattr (reported as EIO)"]


async def test_every_modifying_operation_is_refused_with_erofs(ops: tuple[FuseOperations, FakeCore]) -> None:
    fuse, _ = ops
    for name in ("setattr", "mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link", "write", "create",
                 "setxattr", "removexattr", "fallocate"):
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await getattr(fuse, name)(1, b"x", 0, Ctx())
        assert exc.value.errno == errno.EROFS, name


async def test_open_passes_the_pid_keeps_the_page_cache_and_sends_no_invalidation(
        ops: tuple[FuseOperations, FakeCore], monkeypatch: pytest.MonkeyPatch) -> None:
    fuse, core = ops
    notices: list[str] = []
    for name in ("invalidate_inode", "invalidate_entry", "invalidate_entry_async"):
        monkeypatch.setattr(pyfuse3, name, lambda *_, _name=name, **__: notices.append(_name))
    info = await fuse.open(5, os.O_RDONLY, Ctx())  # type: ignore[arg-type]
    assert (info.fh, info.keep_cache, notices) == (9, True, [])
    assert core.calls[-1] == ("open", 5, os.O_RDONLY, 4242)
    core.fail = FsError(errno.ESTALE)  # a retired inode: the kernel retries the lookup
    with pytest.raises(pyfuse3.FUSEError) as exc:
        await fuse.open(5, os.O_RDONLY, Ctx())  # type: ignore[arg-type]
    assert (exc.value.errno, notices) == (errno.ESTALE, [])
    core.fail = None
    await fuse.release(9)
    assert core.calls[-1:] == [("release", 9)]


async def test_readdir_forgets_the_entry_the_kernel_did_not_take(ops: tuple[FuseOperations, FakeCore],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fuse, core = ops
    replies: list[tuple[bytes, int, int]] = []

    def reply(token: object, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        replies.append((name, attr.st_ino, next_id))
        return len(replies) < 2  # the kernel's buffer is full after the second entry

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    await fuse.readdir(3, 0, object())  # type: ignore[arg-type]
    assert replies == [(b"a", 101, 1), (b"bb", 102, 2)]
    assert core.forgotten == [(102, 1)]
