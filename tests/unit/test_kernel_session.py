"""The Python side of the FUSE session over a fake core and a fake C session.

No kernel: requests are queued on a recording stand-in for ``fs/_session.c`` and the real
``serve()`` loop answers them.  What it must do is translate: attributes into the tuple C
packs with each answer's own timeout, every exception into one errno (bugs to EIO, logged
once), an opener's opens keeping the page cache, readdir entries the kernel did not take
forgotten, FORGET and INIT passed on, inodes published to C before the answers that let
the kernel read them, the reads C served and the releases of the opener's handles
reported, and the end of the session ending ``serve()``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest
import trio

from cubefs_fuse.attrs import Attr, FsStats
from cubefs_fuse.errors import FsError
from cubefs_fuse.fs import _session as c
from cubefs_fuse.fs import session
from cubefs_fuse.fs.filesystem import Borrower, Entry, LentBlock
from cubefs_fuse.fs.session import AttrTuple, KernelSession, Request, Served

FILE = Attr(stat.S_IFREG | 0o644, 1, 1000, 1000, 0, 1234, 8, 4096, 1, 2, 3, 77)


class FakeCore:
    """Records calls; answers from a script; raises what a test puts in ``fail``.  It is an
    opener too (tools/slowfs.py is one): the tests that push OP_OPEN mount it as one."""

    keep_cache = True
    direct_io = False

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail: BaseException | None = None
        self.forgotten: list[tuple[int, int]] = []
        self.publishes = True  # what publish() answers
        self.borrower: Borrower | None = None
        self.observed: list[int] = []  # pids whose file requests the observer's part saw
        self.handle = 9  # what open() answers
        self.warm = False  # lookup_now and getattr_now answer (the metadata cache's hit)
        self.expiries = 0  # expire_entries() calls

    def _maybe_fail(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def lookup(self, parent: int, name: str) -> Entry:
        self.calls.append(("lookup", parent, name))
        self._maybe_fail()
        return Entry(5, FILE, 12.5)

    def lookup_now(self, parent: int, name: str) -> Entry | None:
        if not self.warm:
            return None
        self.calls.append(("lookup_now", parent, name))
        self._maybe_fail()
        return Entry(5, FILE, 12.5)

    def looked_up(self, inode: int) -> None:
        self.calls.append(("looked_up", inode))
        self._maybe_fail()

    def expire_entries(self) -> None:
        self.expiries += 1

    def getattr_now(self, inode: int) -> Entry | None:
        if not self.warm:
            return None
        self.calls.append(("getattr_now", inode))
        self._maybe_fail()
        return Entry(inode, FILE, 12.5)

    async def getattr(self, inode: int) -> Entry:
        self._maybe_fail()
        return Entry(inode, FILE, 0.0 if inode == 8 else 12.5)

    async def readlink(self, inode: int) -> str:
        return "target"

    def entry(self, parent_inode: int, name: str, path: str, attr: Attr) -> Entry:
        return Entry(100 + len(path), attr, 12.5)

    def forget(self, inode: int, n: int) -> None:
        self.forgotten.append((inode, n))

    async def opendir(self, inode: int) -> int:
        return 3

    def readdir(self, fh: int, start: int) -> Iterator[tuple[int, str, str, Attr]]:
        self._maybe_fail()
        names = ["a", "bb", "ccc"]
        for i in range(start, len(names)):
            yield i + 1, names[i], names[i], FILE

    def releasedir(self, fh: int) -> None:
        self.calls.append(("releasedir", fh))

    async def open(self, inode: int, flags: int, pid: int = 0) -> int:
        self.calls.append(("open", inode, flags, pid))
        self._maybe_fail()
        return self.handle

    async def read(self, inode: int, fh: int, offset: int, size: int, pid: int) -> bytes:
        self.calls.append(("read", inode, fh, offset, size, pid))
        self._maybe_fail()
        return b"d" * size

    def lend_to(self, borrower: Borrower) -> None:
        self.borrower = borrower

    def publish(self, inode: int) -> bool:
        self.calls.append(("publish", inode))
        return self.publishes

    def served(self, inode: int, pid: int, offset: int, first: int, ram_bytes: int, ram_mask: int,
               disk_bytes: int, disk_mask: int) -> Coroutine[Any, Any, None] | None:
        self.calls.append(("served", inode, pid, offset, first, ram_bytes, ram_mask, disk_bytes, disk_mask))

        async def observe() -> None:
            await trio.sleep(0)
            self.observed.append(pid)

        return observe() if pid else None

    def release(self, fh: int) -> None:
        self.calls.append(("release", fh))

    async def statfs(self) -> FsStats:
        return FsStats(4096, 4096, 100, 50, 40, 1000, 900, 255)


if TYPE_CHECKING:  # the fake's methods are checked against the C type's stub
    NativeSession = c.Session
else:  # the C type cannot be subclassed (nor would a fake want its connection)
    NativeSession = object


class FakeNative(NativeSession):
    """The C session's interface: requests go in through ``push``, replies are recorded."""

    def __init__(self, readdir_room: int = 99, take_opens: bool = True) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.queue: list[Request] = []
        self.replies: dict[int, tuple[Any, ...]] = {}
        self.published: list[tuple[Any, ...]] = []
        self.readdir_room = readdir_room
        self.take_opens = take_opens
        self.gone = False
        self.started = self.closed = False
        self.next_id = 1

    def push(self, op: int, ino: int = 1, *, fh: int = 0, offset: int = 0, size: int = 0, flags: int = 0,
             pid: int = 4242, name: bytes = b"", served: Served | None = None, signal: bool = True) -> int:
        reports = (c.OP_FORGET, c.OP_INIT, c.OP_EXIT, c.OP_RELEASE, c.OP_SERVED, c.OP_LOOKED)
        rid = self.next_id if op not in reports else 0
        self.next_id += 1
        self.queue.append((rid, op, ino, fh, offset, size, flags, pid, 0, 0, name, served))
        if signal:  # C signals reports late (REPORT_DELAY_NS)
            os.eventfd_write(self.fd, 1)
        return rid

    def start(self) -> None:
        self.started = True

    def fileno(self) -> int:
        return self.fd

    def take(self) -> list[Request]:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        out, self.queue = self.queue, []
        return out

    def _reply(self, rid: int, *what: Any) -> None:
        assert rid not in self.replies, "a request answered twice"
        self.replies[rid] = what
        if self.gone:  # C answered it at its deadline already: recorded, then refused
            raise c.Gone(rid)

    def reply_err(self, id: int, err: int, /) -> None:
        self._reply(id, "err", err)

    def reply_entry(self, id: int, attr: AttrTuple, valid_for: float, /) -> None:
        self._reply(id, "entry", attr, valid_for)

    def reply_attr(self, id: int, attr: AttrTuple, valid_for: float, /) -> None:
        self._reply(id, "attr", attr, valid_for)

    def reply_open(self, id: int, fh: int, keep_cache: bool, direct_io: bool, /) -> None:
        self._reply(id, "open", fh, keep_cache, direct_io)
        if not self.take_opens and fh:  # as C does: a handle Python gave is reported released
            self.push(c.OP_RELEASE, fh=fh)

    def reply_opendir(self, id: int, dh: int, /) -> bool:
        self._reply(id, "opendir", dh)
        return self.take_opens

    def publish(self, inode: int, size: int, block_size: int, blocks: Sequence[LentBlock], /) -> None:
        self.published.append((inode, size))

    def lend(self, inode: int, index: int, block: LentBlock, /) -> bool:
        return True

    def withdraw(self, inode: int, /) -> None:
        pass

    def publish_entry(self, parent: int, name: bytes, attr: AttrTuple, expires_ns: int, /) -> None:
        self.published.append((parent, name, attr[0], expires_ns))

    def withdraw_entry(self, parent: int, name: bytes, expires_ns: int, /) -> bool:
        return True

    def reply_buf(self, id: int, data: bytes | bytearray | memoryview, /) -> None:
        self._reply(id, "buf", bytes(data))

    def reply_readlink(self, id: int, target: bytes, /) -> None:
        self._reply(id, "readlink", target)

    def reply_statfs(self, id: int, fields: tuple[int, int, int, int, int, int, int, int, int], /) -> None:
        self._reply(id, "statfs", fields)

    def reply_readdir(self, id: int, entries: Sequence[tuple[bytes, AttrTuple, int, float]], /) -> int:
        taken = list(entries)[:self.readdir_room]
        self._reply(id, "readdir", [(name, attr[0], nxt) for name, attr, nxt, _ in taken])
        return len(taken)

    def exit(self) -> None:
        self.push(c.OP_EXIT, 0)

    def close(self) -> None:
        self.closed = True
        os.close(self.fd)


async def served(native: FakeNative, core: FakeCore, inits: list[int] | None = None) -> None:
    """Serve what is queued until the session's end (pushed last)."""
    s = KernelSession(core, native, on_init=(lambda: inits.append(1)) if inits is not None else None, opener=core)
    native.push(c.OP_EXIT, 0)
    with trio.fail_after(10):
        await s.serve()


async def answer(native: FakeNative, core: FakeCore, *pushes: tuple[int, dict[str, Any]],
                 session: KernelSession | None = None) -> list[tuple[Any, ...]]:
    """Queue the requests, serve until each is answered, return the replies in order."""
    s = session or KernelSession(core, native, opener=core)
    ids = [native.push(op, **kw) for op, kw in pushes]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.serve)
        with trio.fail_after(10):
            while not all(i in native.replies for i in ids):
                await trio.sleep(0.001)
        s.terminate()
    return [native.replies[i] for i in ids]


def attr_of(inode: int) -> AttrTuple:
    return session.attr_tuple(inode, FILE)


async def test_attributes_are_converted_for_c_to_pack() -> None:
    native, core = FakeNative(), FakeCore()
    entry, attr, untrusted, statfs = await answer(native, core, (c.OP_LOOKUP, {"ino": 1, "name": b"name\xff"}),
                                                  (c.OP_GETATTR, {"ino": 7}), (c.OP_GETATTR, {"ino": 8}),
                                                  (c.OP_STATFS, {}))
    # The file is published before the entry is answered: the kernel's READ may follow at once.
    assert core.calls == [("lookup", 1, os.fsdecode(b"name\xff")), ("publish", 5)]
    # Each answer carries how long the core trusts it, for C to give the kernel as its timeout.
    assert entry == ("entry", (5, FILE.mode, 1, 1000, 1000, 0, 1234, 4096, 8, 1, 2, 3), 12.5)
    assert attr == ("attr", attr_of(7), 12.5) and untrusted == ("attr", attr_of(8), 0.0)
    assert statfs == ("statfs", (4096, 4096, 100, 50, 40, 1000, 900, 900, 255))


async def test_a_warm_lookup_or_getattr_is_answered_in_the_dispatch_step_without_a_task() -> None:
    native, core = FakeNative(), FakeCore()
    core.warm = True
    s = KernelSession(core, native)
    native.push(c.OP_LOOKUP, 1, name=b"f")
    native.push(c.OP_GETATTR, 7)
    s._nursery = object()  # type: ignore[assignment]  # a task would fail: none may be started
    s._dispatch()
    assert [native.replies[i][0] for i in sorted(native.replies)] == ["entry", "attr"]
    assert core.calls == [("lookup_now", 1, "f"), ("publish", 5), ("getattr_now", 7)]
    core.fail = FsError(errno.ENOENT)
    native.push(c.OP_LOOKUP, 1, name=b"g")
    s._dispatch()
    assert list(native.replies.values())[-1] == ("err", errno.ENOENT)


@pytest.mark.parametrize(("raised", "expected"), [
    (FsError(errno.ESTALE), errno.ESTALE),
    (OSError(errno.EACCES, "denied"), errno.EACCES),
    (FileNotFoundError(errno.ENOENT, "gone"), errno.ENOENT),
    (OSError("no errno"), errno.EIO),
    (ValueError("a bug"), errno.EIO),
])
async def test_every_exception_becomes_one_errno(raised: BaseException, expected: int) -> None:
    native, core = FakeNative(), FakeCore()
    core.fail = raised
    replies = await answer(native, core, (c.OP_LOOKUP, {"name": b"x"}), (c.OP_GETATTR, {}),
                           (c.OP_READ, {"ino": 5, "size": 10}), (c.OP_READDIR, {"fh": 3, "size": 4096}))
    assert replies == [("err", expected)] * 4


async def test_a_bug_is_logged_once_per_exception_type(caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "_logged_bugs", set())
    native, core = FakeNative(), FakeCore()
    core.fail = KeyError("bug")
    with caplog.at_level(logging.ERROR, logger=session.__name__):
        replies = await answer(native, core, *[(c.OP_GETATTR, {})] * 3)
    assert replies == [("err", errno.EIO)] * 3
    assert [r.getMessage() for r in caplog.records] == [f"unexpected error in request {c.OP_GETATTR} (reported as EIO)"]


async def reported(native: FakeNative, core: FakeCore, *pushes: tuple[int, dict[str, Any]]) -> None:
    """Queue reports (no reply), then the session's end; serve until it."""
    for op, kw in pushes:
        native.push(op, **kw)
    await served(native, core)


async def test_an_openers_open_passes_flags_and_pid_and_its_page_cache_choice() -> None:
    native, core = FakeNative(), FakeCore()
    (opened,) = await answer(native, core, (c.OP_OPEN, {"ino": 5, "flags": os.O_RDONLY, "pid": 77}))
    assert opened == ("open", 9, True, False)
    assert core.calls == [("open", 5, os.O_RDONLY, 77)]
    core.fail = FsError(errno.ESTALE)  # a retired inode: the kernel retries the lookup
    assert await answer(native, core, (c.OP_OPEN, {"ino": 5})) == [("err", errno.ESTALE)]


async def test_a_read_is_by_inode_with_the_callers_pid() -> None:
    native, core = FakeNative(), FakeCore()
    (read,) = await answer(native, core, (c.OP_READ, {"ino": 5, "fh": 0, "offset": 4, "size": 3, "pid": 77}))
    assert read == ("buf", b"ddd")
    assert core.calls == [("read", 5, 0, 4, 3, 77)]


async def test_a_release_c_answered_is_reported_for_pythons_handle() -> None:
    native, core = FakeNative(), FakeCore()
    await reported(native, core, (c.OP_RELEASE, {"fh": 9}), (c.OP_RELEASE, {"fh": 10}))
    assert core.calls == [("release", 9), ("release", 10)]
    assert native.replies == {}  # C answered the kernel already


async def test_a_read_c_served_is_counted_by_the_core_and_its_owner_looked_up_in_a_task() -> None:
    native, core = FakeNative(), FakeCore()
    s = KernelSession(core, native)
    native.push(c.OP_SERVED, 5, offset=0, size=6, pid=77, served=(0, 6, 0b1, 0, 0))
    native.push(c.OP_SERVED, 6, offset=4096, size=8, pid=0, served=(1, 0, 0, 8, 0b11))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.serve)
        with trio.fail_after(10):
            while not core.observed:
                await trio.sleep(0.001)
        s.terminate()
    assert core.calls == [("served", 5, 77, 0, 0, 6, 0b1, 0, 0), ("served", 6, 0, 4096, 1, 0, 0, 8, 0b11)]
    assert core.observed == [77]
    assert isinstance(core.borrower, KernelSession)  # the session is the core's borrower


async def test_a_lookup_c_answered_is_counted_and_entries_expire_after_each_take() -> None:
    native, core = FakeNative(), FakeCore()
    s = KernelSession(core, native)
    native.push(c.OP_LOOKED, 17)
    native.push(c.OP_LOOKED, 18)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.serve)
        with trio.fail_after(10):
            while core.expiries == 0:  # after the take, outside it
                await trio.sleep(0.001)
        s.terminate()
    assert core.calls == [("looked_up", 17), ("looked_up", 18)] and native.replies == {}


async def test_report_hands_the_core_what_c_served_before_c_signals_it() -> None:
    native, core = FakeNative(), FakeCore()
    s = KernelSession(core, native, opener=core)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.serve)
        await trio.sleep(0.01)
        native.push(c.OP_SERVED, 5, pid=0, served=(0, 1, 1, 0, 0), signal=False)
        native.push(c.OP_RELEASE, 5, fh=9, signal=False)
        assert core.calls == []
        s.report()  # as the core asks before a new plan
        assert core.calls == [("served", 5, 0, 0, 0, 1, 1, 0, 0), ("release", 9)]
        s.terminate()


async def test_readdir_forgets_the_entries_the_kernel_did_not_take() -> None:
    native, core = FakeNative(readdir_room=2), FakeCore()
    listing, released = await answer(native, core, (c.OP_READDIR, {"fh": 3, "offset": 0, "size": 4096}),
                                     (c.OP_RELEASEDIR, {"fh": 3}))
    assert listing == ("readdir", [(b"a", 101, 1), (b"bb", 102, 2)])
    assert core.forgotten == [(103, 1)]
    # The files the kernel took are published (it may read them without a LOOKUP).
    assert released == ("err", 0) and core.calls == [("publish", 101), ("publish", 102), ("releasedir", 3)]


async def test_readdir_builds_no_more_entries_than_the_buffer_can_hold() -> None:
    native, core = FakeNative(), FakeCore()
    (listing,) = await answer(native, core, (c.OP_READDIR, {"fh": 3, "offset": 0, "size": 200}))
    assert listing == ("readdir", [(b"a", 101, 1), (b"bb", 102, 2)])  # 200 // 160 + 1 built
    assert core.forgotten == []


async def test_forget_and_init_are_passed_on_and_the_end_ends_serving() -> None:
    native, core = FakeNative(), FakeCore()
    inits: list[int] = []
    native.push(c.OP_INIT, 0)
    native.push(c.OP_FORGET, 12, size=3)
    native.push(c.OP_FORGET, 13, size=1)
    await served(native, core, inits)
    assert inits == [1] and core.forgotten == [(12, 3), (13, 1)]


async def test_an_open_the_kernel_did_not_take_is_released_once_by_cs_report() -> None:
    native, core = FakeNative(take_opens=False), FakeCore()
    (opened,) = await answer(native, core, (c.OP_OPEN, {"ino": 5}))
    await served(native, core)
    assert opened == ("open", 9, True, False)
    assert core.calls.count(("release", 9)) == 1


async def test_handle_0_is_never_released() -> None:
    native, core = FakeNative(take_opens=False), FakeCore()
    core.handle = 0  # the daemon's filesystem reads by inode: no handle, no RELEASE
    native.gone = True
    await answer(native, core, (c.OP_OPEN, {"ino": 5}))
    native.gone, native.take_opens = False, False
    (opened,) = await answer(native, core, (c.OP_OPEN, {"ino": 6}))
    await served(native, core)
    assert opened == ("open", 0, True, False)
    assert not any(call[0] == "release" for call in core.calls)


async def test_an_answer_after_cs_deadline_is_counted_and_an_open_handle_released() -> None:
    native, core = FakeNative(), FakeCore()
    native.gone = True
    s = KernelSession(core, native, opener=core)
    await answer(native, core, (c.OP_OPEN, {"ino": 5}), (c.OP_GETATTR, {}), (c.OP_READDIR, {"fh": 3, "size": 4096}),
                 (c.OP_LOOKUP, {"name": b"x"}), session=s)
    assert s.late_replies == 4
    assert ("release", 9) in core.calls  # the kernel never saw handle 9: no RELEASE will come
    # Nor will FORGETs of the listing's entries or of the lookup's inode.
    assert sorted(core.forgotten) == [(5, 1), (101, 1), (102, 1), (103, 1)]


class FailingCore(FakeCore):
    def forget(self, inode: int, n: int) -> None:
        raise RuntimeError("a bug in forget")

    def expire_entries(self) -> None:
        raise KeyError("a bug in expiring")

    def served(self, inode: int, pid: int, offset: int, first: int, ram_bytes: int, ram_mask: int,
               disk_bytes: int, disk_mask: int) -> Coroutine[Any, Any, None] | None:
        raise FsError(errno.EBADF)


async def test_a_failing_report_is_logged_and_the_session_goes_on(caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "_logged_bugs", set())
    native, core = FakeNative(), FailingCore()
    native.push(c.OP_FORGET, 12, size=1)
    native.push(c.OP_SERVED, 5, served=(0, 1, 1, 0, 0))
    with caplog.at_level(logging.ERROR, logger=session.__name__):
        (attr,) = await answer(native, core, (c.OP_GETATTR, {"ino": 7}))
    assert attr == ("attr", attr_of(7), 12.5)
    # One per exception type: the forget's, the report's and the expiry's (once, after every take).
    assert len(caplog.records) == 3
