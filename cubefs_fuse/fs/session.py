"""The kernel's requests that reach Python, answered by the filesystem core.

The FUSE connection is the C extension's (``fs/_session.c``): its reader threads answer
what needs no decision (and the lookups and reads the core published to it) and queue the
rest; this module takes the queue when its eventfd is readable and turns each request into
one call of the core (``fs.filesystem``) and one reply, and each report of what C answered
(a read it served, a lookup it answered, the release of a handle Python gave) into one
call.  No logic lives here beyond type conversion: every exception becomes an errno
through ``errors.errno_of`` (one place), and an unexpected one (a bug) is also logged with
its traceback, once per exception type.

The core reads by inode, so files are opened by the kernel alone (its ``no_open`` mode: no
OPEN, no RELEASE, pages kept across opens); an implementation that opens a file per open
(the remote emulator, tools/slowfs.py) is mounted with an ``Opener``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, Protocol

import trio

from cubefs_fuse.attrs import Attr, FsStats
from cubefs_fuse.errors import FsError, errno_of
from cubefs_fuse.fs.filesystem import Borrower, LentBlock
from cubefs_fuse.fs import _session

log = logging.getLogger(__name__)

# Reader threads of the connection.  They answer hits themselves (an NVMe entry's read
# blocks one of them) and queue the rest for the trio thread, so a few keep the kernel's
# queue drained; the kernel's own queue (max_background 64, plus one synchronous request
# per blocked reader) holds the rest.
READER_THREADS = 4
# The smallest READDIRPLUS entry: fuse_direntplus's 128-byte entry_out and 24-byte dirent
# header plus a name padded to 8 bytes.  A reply of ``size`` bytes holds at most
# size // 160 + 1 entries, so no more are built (and counted as lookups) than can fit.
_MIN_DIRENTPLUS = 160
_logged_bugs: set[type[BaseException]] = set()
# While a handover drains the requests in flight, how often serve() looks whether they are
# all answered (answers do not wake it): 5 ms, against requests of ~0.1-100 ms.
DRAIN_POLL = 0.005

# What C packs into a struct stat: (ino, mode, nlink, uid, gid, rdev, size, blksize, blocks,
# atime_ns, mtime_ns, ctime_ns).
AttrTuple = tuple[int, int, int, int, int, int, int, int, int, int, int, int]
# What C served of a READ from lent blocks: (the READ's first block, the bytes from RAM and
# a mask of the blocks read there, the same from NVMe); mask bit i is block first + i.
Served = tuple[int, int, int, int, int]
# A detached connection: a /dev/fuse descriptor and the kernel's INIT request as it came.
Detached = tuple[int, bytes]
# A request or report C queued: (id, op, ino, fh, offset, size, flags, pid, uid, gid, name,
# served); served only in an OP_SERVED report.
Request = tuple[int, int, int, int, int, int, int, int, int, int, bytes, Served | None]


class Entry(Protocol):
    @property
    def inode(self) -> int: ...

    @property
    def attr(self) -> Attr: ...

    @property
    def valid_for(self) -> float:
        """Seconds the kernel may keep the entry and its attributes without asking again
        (at most the session's timeouts; 0: ask at the next use)."""
        ...


class Operations(Protocol):
    """What the session calls; ``fs.filesystem.Filesystem`` is the implementation (and
    tools/slowfs.py, the remote emulator, another)."""

    async def lookup(self, parent_inode: int, name: str) -> Entry: ...

    def lookup_now(self, parent_inode: int, name: str) -> Entry | None:
        """``lookup``'s answer if it needs no wait, else None (then ``lookup`` is awaited)."""
        ...

    def entry(self, parent_inode: int, name: str, path: str, attr: Attr) -> Entry:
        """A listing's entry handed to the kernel (READDIRPLUS): one more lookup of its inode."""
        ...

    def forget(self, inode: int, n: int) -> None: ...

    async def getattr(self, inode: int) -> Entry: ...

    def getattr_now(self, inode: int) -> Entry | None:
        """``getattr``'s answer if it needs no wait, else None (then ``getattr`` is awaited)."""
        ...

    async def readlink(self, inode: int) -> str: ...

    async def statfs(self) -> FsStats: ...

    async def opendir(self, inode: int) -> int: ...

    def readdir(self, fh: int, start: int) -> Iterator[tuple[int, str, str, Attr]]: ...

    def releasedir(self, fh: int) -> None: ...

    async def read(self, inode: int, fh: int, offset: int, size: int, pid: int) -> bytes | memoryview: ...

    def lend_to(self, borrower: Borrower) -> None: ...

    def looked_up(self, inode: int) -> None:
        """C answered a LOOKUP from an entry the implementation published (an OP_LOOKED
        report): one more lookup of ``inode`` for the kernel to FORGET."""
        ...

    def expire_entries(self) -> None:
        """Withdraw the published entries whose time is up (called after each take of the
        queue, never inside one: it takes the queue itself)."""
        ...

    def publish(self, inode: int) -> bool: ...

    def served(self, inode: int, pid: int, offset: int, first: int, ram_bytes: int, ram_mask: int,
               disk_bytes: int, disk_mask: int) -> Coroutine[Any, Any, None] | None:
        """A READ C served from lent blocks (an OP_SERVED report); returns what is left to
        do, which may wait (to run in a task), or None."""
        ...


class Opener(Protocol):
    """An implementation that opens files itself (a handle per open, released when the
    kernel closes it), so the kernel sends its OPENs and RELEASEs."""

    keep_cache: bool  # the kernel may keep an open file's pages across opens
    direct_io: bool  # every application read reaches ``read`` (no page cache)

    async def open(self, inode: int, flags: int, pid: int = 0) -> int:
        """A handle for the kernel (0: none, then no RELEASE comes)."""
        ...

    def release(self, fh: int) -> None: ...


def attr_tuple(inode: int, attr: Attr) -> AttrTuple:
    return (inode, attr.mode, attr.nlink, attr.uid, attr.gid, attr.rdev, attr.size, attr.blksize,
            attr.blocks, attr.atime_ns, attr.mtime_ns, attr.ctime_ns)


def mount(ops: Operations, mount_point: str, options: set[str], *, entry_timeout: float, attr_timeout: float,
          request_timeout: float = 0.0, on_init: Callable[[], object] | None = None,
          threads: int = READER_THREADS, opener: Opener | None = None,
          adopted: Detached | None = None) -> KernelSession:
    """Mount ``mount_point`` (OSError, with libfuse's reason, if it cannot) and return the
    session that serves it with ``ops``: run ``serve()``, then always ``close()`` (or
    ``detach()`` after a handover).  With ``adopted`` (what another session's ``detach()``
    gave) the session serves that connection, mounted there already, instead.


    ``entry_timeout``, ``attr_timeout``: the longest the kernel keeps an entry or
    attributes (each answer's ``valid_for`` may say less).  ``request_timeout``: a request
    Python has not answered after that many seconds is answered EIO by C (0: never), so a
    stalled trio thread cannot hang the mount's readers.  ``opener``: who opens files
    (None: nobody, the kernel's no_open mode)."""
    fd, init = adopted if adopted is not None else (-1, b"")
    native = _session.Session(mount_point, ",".join(sorted(options)), threads, entry_timeout, attr_timeout,
                              request_timeout, opener is None, fd, init)
    return KernelSession(ops, native, on_init=on_init, opener=opener)


class KernelSession:
    """One FUSE connection serving ``ops``: ``serve()`` answers requests until the mount
    goes away or ``terminate()`` is called; ``close()`` unmounts."""

    def __init__(self, ops: Operations, native: _session.Session, *, on_init: Callable[[], object] | None = None,
                 opener: Opener | None = None) -> None:
        self.ops = ops
        self.opener = opener
        self.on_init = on_init
        self._native = native
        self.late_replies = 0  # answers that came after C's deadline had answered EIO
        self._nursery: trio.Nursery | None = None
        self._ended = False  # the session's end was taken from the queue
        self._handing_over = False  # a handover was asked for
        self._paused = False  # ... and the readers have stopped: serve() ends once nothing is in flight
        ops.lend_to(self)

    def _late(self, r: Request) -> None:
        self.late_replies += 1
        if self.late_replies == 1:
            log.warning("request %d answered after the session's deadline (the reader got EIO): the daemon "
                        "was stalled; later ones are counted, not logged", r[1])

    async def serve(self) -> None:
        """Answer requests until the mount goes away, ``terminate()`` is called, or, after
        ``hand_over()``, every request given to Python is answered and every report taken."""
        native = self._native
        native.start()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while not self._ended:
                if self._handing_over:
                    if self._paused and native.busy == 0:
                        break
                    # Answers do not wake the eventfd: look again soon.
                    with trio.move_on_after(DRAIN_POLL):
                        await trio.lowlevel.wait_readable(native.fileno())
                else:
                    await trio.lowlevel.wait_readable(native.fileno())
                self._dispatch()
                if not self._ended:
                    self._expire_entries()

    async def hand_over(self) -> None:
        """Stop reading requests (the kernel queues new ones for the successor's session) and let
        ``serve()`` end once those in flight are answered; then ``detach()``."""
        self._handing_over = True  # serve() looks at the session every DRAIN_POLL from now on
        await trio.to_thread.run_sync(self._native.pause)  # joins the readers: not on the trio thread
        self._paused = True  # no request comes in any more: serve() ends once none is in flight

    def detach(self) -> Detached:
        """After a handover's ``serve()``: the connection (a /dev/fuse descriptor and the
        kernel's INIT) for the successor's session, which ``mount(..., adopted=)`` serves; this
        session is freed, the mount left in place."""
        return self._native.detach()

    def connection(self) -> Detached:
        """A duplicate of the /dev/fuse descriptor and the kernel's INIT, the session serving
        on: what the keeper holds for a recovery (control/keeper.py)."""
        return self._native.connection()

    def resend(self) -> None:
        """Have the kernel send again what it gave a reader and has no answer for (a daemon
        that died had read it); OSError on a kernel before 6.9."""
        self._native.resend()

    def _expire_entries(self) -> None:
        # Here, after a take and never inside one: expiring takes the queue itself.
        try:
            self.ops.expire_entries()
        except Exception as exc:  # noqa: BLE001 - a bug must not end the session
            _log_once(exc, "unexpected error expiring published entries")

    def _dispatch(self) -> None:
        """Take what C queued: reports and quick requests handled here, the rest in tasks."""
        assert self._nursery is not None
        for request in self._native.take():
            op = request[1]
            if op == _session.OP_EXIT:  # what is still queued is answered EIO by close()
                self._ended = True
                self._nursery.cancel_scope.cancel()
                return
            handler = self._sync.get(op)
            if handler is not None:
                handler(self, request)
            else:
                self._spawn(request)

    # -- the core's borrower (filesystem.Borrower) -------------------------------------

    def publish(self, inode: int, size: int, block_size: int, blocks: Sequence[LentBlock], /) -> None:
        self._native.publish(inode, size, block_size, blocks)

    def lend(self, inode: int, index: int, block: LentBlock, /) -> bool:
        return self._native.lend(inode, index, block)

    def withdraw(self, inode: int, /) -> None:
        self._native.withdraw(inode)

    def publish_entry(self, parent: int, name: str, inode: int, attr: Attr, expires_ns: int, /) -> None:
        self._native.publish_entry(parent, os.fsencode(name), attr_tuple(inode, attr), expires_ns)

    def withdraw_entry(self, parent: int, name: str, expires_ns: int, /) -> bool:
        return self._native.withdraw_entry(parent, os.fsencode(name), expires_ns)

    def report(self) -> None:
        if self._nursery is not None and not self._ended:
            self._dispatch()

    def terminate(self) -> None:
        """End ``serve()``: requests still in flight are answered EIO by ``close()``."""
        self._native.exit()

    def close(self) -> None:
        self._native.close()

    # -- requests answered on the spot (no await) ---------------------------------------

    def _forget(self, r: Request) -> None:
        try:
            self.ops.forget(r[2], r[5])
        except Exception as exc:  # noqa: BLE001 - a bug must not end the session; FORGET has no reply
            _log_bug(r, exc)

    def _init(self, _: Request) -> None:
        if self.on_init is not None:
            self.on_init()

    def _releasedir(self, r: Request) -> None:
        self._replying(r, self.ops.releasedir, r[3])

    def _release(self, r: Request) -> None:
        # C has answered the kernel: this is the report (no reply), of a handle the opener gave.
        assert self.opener is not None  # only an opener's handles are reported
        try:
            self.opener.release(r[3])
        except Exception as exc:  # noqa: BLE001 - a bug must not end the session
            _log_bug(r, exc)

    def _looked(self, r: Request) -> None:
        # C answered a LOOKUP from a published entry: the inode's lookup count goes up.
        try:
            self.ops.looked_up(r[2])
        except Exception as exc:  # noqa: BLE001 - a bug must not end the session
            _log_bug(r, exc)

    def _served(self, r: Request) -> None:
        # C served a READ from lent blocks: the core counts it.
        assert r[11] is not None  # every OP_SERVED report carries what was served
        try:
            rest = self.ops.served(r[2], r[7], r[4], *r[11])
        except Exception as exc:  # noqa: BLE001 - a bug must not end the session
            _log_bug(r, exc)
            return
        if rest is not None:
            assert self._nursery is not None  # reports come only while serve() runs
            self._nursery.start_soon(_run, rest)

    def _lookup(self, r: Request) -> None:
        # A warm lookup (the metadata cache answers) is answered in this step: no task.
        self._now_or_in_a_task(r, lambda: self.ops.lookup_now(r[2], os.fsdecode(r[10])), self._reply_entry)

    def _getattr(self, r: Request) -> None:
        self._now_or_in_a_task(r, lambda: self.ops.getattr_now(r[2]), self._reply_attr)

    def _now_or_in_a_task(self, r: Request, now: Callable[[], Entry | None],
                          reply: Callable[[Request, Entry], None]) -> None:
        """Answer ``r`` with ``now()``'s entry, or, if it would wait (None), in a task."""
        try:
            entry = now()
            if entry is not None:
                reply(r, entry)
                return
        except _session.Gone:
            self._late(r)
            return
        except Exception as exc:  # noqa: BLE001 - every failure is an errno for the kernel
            self._fail(r, exc)
            return
        self._spawn(r)

    def _reply_attr(self, r: Request, entry: Entry) -> None:
        self._native.reply_attr(r[0], attr_tuple(entry.inode, entry.attr), entry.valid_for)

    def _reply_entry(self, r: Request, entry: Entry) -> None:
        if entry.attr.is_file:
            self.ops.publish(entry.inode)  # before the answer: the READs that follow are C's where held
        try:
            self._native.reply_entry(r[0], attr_tuple(entry.inode, entry.attr), entry.valid_for)
        except _session.Gone:
            self.ops.forget(entry.inode, 1)  # answered EIO at its deadline: the kernel holds no lookup
            raise

    def _spawn(self, r: Request) -> None:
        assert self._nursery is not None  # requests are taken only while serve() runs
        self._nursery.start_soon(self._answer, r)

    def _readdir(self, r: Request) -> None:
        rid, _, ino, fh, offset, size = r[:6]
        ops = self.ops
        try:
            entries = []
            for next_id, name, path, attr in itertools.islice(ops.readdir(fh, offset), size // _MIN_DIRENTPLUS + 1):
                entry = ops.entry(ino, name, path, attr)
                entries.append((os.fsencode(name), attr_tuple(entry.inode, attr), next_id, entry.valid_for))
        except Exception as exc:  # noqa: BLE001 - every failure is an errno for the kernel
            self._fail(r, exc)
            return
        try:
            taken = self._native.reply_readdir(rid, entries)
        except _session.Gone:
            self._late(r)
            taken = 0
        for _, attr_t, _, _ in entries[taken:]:
            ops.forget(attr_t[0], 1)  # the kernel did not take this entry
        for _, attr_t, _, _ in entries[:taken]:
            if stat.S_ISREG(attr_t[1]):
                ops.publish(attr_t[0])  # the kernel may read it without a LOOKUP: let C serve what is held

    def _replying(self, r: Request, call: Callable[[int], None], arg: int) -> None:
        try:
            call(arg)
        except Exception as exc:  # noqa: BLE001
            self._fail(r, exc)
            return
        self._native.reply_err(r[0], 0)  # RELEASE and RELEASEDIR have no deadline in C

    _sync: dict[int, Callable[[KernelSession, Request], None]] = {
        _session.OP_LOOKUP: _lookup,  # answered here when warm, else in a task
        _session.OP_GETATTR: _getattr,
        _session.OP_FORGET: _forget,
        _session.OP_INIT: _init,
        _session.OP_RELEASEDIR: _releasedir,
        _session.OP_RELEASE: _release,
        _session.OP_SERVED: _served,
        _session.OP_LOOKED: _looked,
        _session.OP_READDIR: _readdir,
    }

    # -- requests that may wait on the source ------------------------------------------

    async def _answer(self, r: Request) -> None:
        rid, op, ino, fh, offset, size, flags, pid = r[:8]
        native, ops, opener = self._native, self.ops, self.opener
        opened: int | None = None  # an OPEN's handle, to release if its answer comes too late
        try:
            if op == _session.OP_READ:
                native.reply_buf(rid, await ops.read(ino, fh, offset, size, pid))
            elif op == _session.OP_LOOKUP:
                self._reply_entry(r, await ops.lookup(ino, os.fsdecode(r[10])))
            elif op == _session.OP_GETATTR:
                self._reply_attr(r, await ops.getattr(ino))
            elif op == _session.OP_OPEN and opener is not None:  # C sends OPENs only with an opener
                fh = await opener.open(ino, flags, pid)
                opened = fh or None  # handle 0 has no RELEASE
                # A RELEASE of fh comes from now on (C reports one if the kernel does not take the answer).
                native.reply_open(rid, fh, opener.keep_cache, opener.direct_io)
                opened = None
            elif op == _session.OP_OPENDIR:
                dh = await ops.opendir(ino)
                try:
                    took = native.reply_opendir(rid, dh)
                except _session.Gone:
                    took = False
                    self._late(r)
                if not took:  # interrupted, or too late: no RELEASEDIR will come
                    ops.releasedir(dh)
            elif op == _session.OP_READLINK:
                native.reply_readlink(rid, os.fsencode(await ops.readlink(ino)))
            elif op == _session.OP_STATFS:
                st = await ops.statfs()
                native.reply_statfs(rid, (st.block_size, st.fragment_size, st.blocks, st.blocks_free,
                                          st.blocks_available, st.files, st.files_free, st.files_free,
                                          st.name_max))
            else:
                raise FsError(errno.ENOSYS, f"request {op} is not served")
        except _session.Gone:
            self._late(r)
            if opened is not None and opener is not None:  # the kernel never saw this handle: no RELEASE will come
                opener.release(opened)
        except Exception as exc:  # noqa: BLE001
            if opened is not None and opener is not None:  # not answered with the handle: no RELEASE will come
                opener.release(opened)
            self._fail(r, exc)

    def _fail(self, r: Request, exc: Exception) -> None:
        if not isinstance(exc, (OSError, FsError)):
            _log_bug(r, exc)
        try:
            self._native.reply_err(r[0], errno_of(exc))
        except _session.Gone:
            self._late(r)


async def _run(work: Coroutine[Any, Any, None]) -> None:
    await work


def _log_bug(r: Request, exc: Exception) -> None:
    """An unexpected exception (a bug) in a request, logged as :func:`_log_once` logs."""
    _log_once(exc, "unexpected error in request %d (reported as EIO)", r[1])


def _log_once(exc: Exception, message: str, *args: object) -> None:
    """An unexpected exception (a bug), logged with its traceback once per exception type."""
    if type(exc) not in _logged_bugs:
        _logged_bugs.add(type(exc))
        log.error(message, *args, exc_info=exc)
