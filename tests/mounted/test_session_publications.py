"""Mounted: the C session serves reads of an inode's lent blocks; files are opened by the
kernel alone (no_open) unless the session has an opener; answers carry their own timeouts.

The session (fs/_session.c) is driven directly by a small server thread standing in for
fs/session.py, on a mount without ``default_permissions``.  A published inode's READs of
lent blocks are answered in C and reported (OP_SERVED, with the reader's pid); any other
READ reaches Python.  The reads here use ``O_DIRECT``, so every one reaches the session
(no page cache) and whether C or Python served it shows in the bytes.  With ``no_open``
the first OPEN is answered ENOSYS by C and no OPEN or RELEASE reaches Python after it;
without it (an opener, as the remote emulator is) every OPEN reaches Python and the
releases of Python's handles are reported.  An entry or attributes are kept by the kernel
as long as the answer's ``valid_for`` says, at most the session's timeouts.  A published
entry answers the name's LOOKUPs in C until its deadline, each reported (OP_LOOKED).
"""

from __future__ import annotations

import errno
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cubefs_fuse import mounts
from cubefs_fuse.attrs import Attr
from cubefs_fuse.fs import _session
from cubefs_fuse.fs.session import Request, attr_tuple
from tests.helpers import wait_until

INODE = 2
DATA = b"from C"  # what a READ served by the session returns (the lent block)
PYTHON = b"Python"  # what a READ answered by the server thread returns (same length)
NOW = time.time_ns()
ATTR = Attr(stat.S_IFREG | 0o444, 1, 0, 0, 0, len(DATA), 1, 4096, NOW, NOW, NOW, 7)
DIR = Attr(stat.S_IFDIR | 0o555, 2, 0, 0, 0, 0, 1, 4096, NOW, NOW, NOW, 1)


class Server:
    """Answers what the session forwards, as fs/session.py would, and records the reports."""

    def __init__(self, native: _session.Session) -> None:
        self.native = native
        self.valid_for = 3600.0  # what LOOKUP and GETATTR answers say
        self.lookups = 0
        self.getattrs = 0
        self.python_opens = 0
        self.python_reads = 0
        self.served: list[tuple[int, int, int, object]] = []  # OP_SERVED: (ino, pid, offset, served)
        self.releases: list[int] = []  # handles of OP_RELEASE reports
        self.looked: list[int] = []  # inodes of OP_LOOKED reports
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.native.fileno()], [], [], 0.05)
            if ready:
                for r in self.native.take():
                    self._answer(r)

    def _answer(self, r: Request) -> None:
        rid, op, fh = r[0], r[1], r[3]
        native = self.native
        if op == _session.OP_LOOKUP:
            self.lookups += 1
            if r[10] == b"f":
                native.reply_entry(rid, attr_tuple(INODE, ATTR), self.valid_for)
            else:
                native.reply_err(rid, errno.ENOENT)
        elif op == _session.OP_GETATTR:
            self.getattrs += 1
            native.reply_attr(rid, attr_tuple(r[2], ATTR) if r[2] == INODE else attr_tuple(1, DIR), self.valid_for)
        elif op == _session.OP_OPEN:
            self.python_opens += 1
            native.reply_open(rid, 100 + self.python_opens, False, True)
        elif op == _session.OP_READ:
            self.python_reads += 1
            native.reply_buf(rid, PYTHON[r[4]:r[4] + r[5]])
        elif op == _session.OP_SERVED:
            self.served.append((r[2], r[7], r[4], r[11]))
        elif op == _session.OP_LOOKED:
            self.looked.append(r[2])
        elif op == _session.OP_RELEASE:
            self.releases.append(fh)
        elif r[0]:
            native.reply_err(rid, errno.ENOSYS)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


Served = tuple[_session.Session, Server, Path]


@pytest.fixture
def make_session(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Mount a session (2 readers; ``no_open`` and timeouts as asked) served by a Server."""
    made: list[tuple[_session.Session, Server, Path]] = []

    def make(no_open: bool = True, timeout: float = 3600.0) -> Served:
        mnt = tmp_path / f"mnt{len(made)}"
        mnt.mkdir()
        native = _session.Session(str(mnt), "ro,fsname=publication-test", 2, timeout, timeout, 0.0, no_open)
        native.start()
        made.append((native, Server(native), mnt))
        return native, made[-1][1], mnt / "f"

    try:
        yield make
    finally:
        for native, server, mnt in made:
            server.stop()
            native.close()
            assert not os.path.ismount(mnt)


def read(path: Path, server: Server) -> bytes:
    """Open (O_DIRECT: every read reaches the session), read and close ``path``; return once
    what the session answered is reported (a READ it served; the RELEASE of a handle Python
    gave, which the kernel sends after close() returns)."""
    served, opens = len(server.served), server.python_opens
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        data = os.read(fd, 100)
    finally:
        os.close(fd)
    if data == DATA:
        wait_until(lambda: len(server.served) > served, 10, "the read reported")
    if server.python_opens > opens:
        wait_until(lambda: 100 + server.python_opens in server.releases, 10, "the release reported")
    return data


def publish(native: _session.Session, block: bytes | None = DATA) -> None:
    native.publish(INODE, len(DATA), 4096, [block])


def test_reads_of_lent_blocks_are_served_in_c_and_no_open_reaches_python(make_session: Callable[..., Served]) -> None:
    native, server, f = make_session()
    assert read(f, server) == PYTHON and server.python_reads == 1  # nothing published
    publish(native)
    assert read(f, server) == DATA
    assert server.served == [(INODE, os.getpid(), 0, (0, len(DATA), 1, 0, 0))]  # block 0 from RAM, by us
    native.withdraw(INODE)
    assert read(f, server) == PYTHON and server.python_reads == 2
    publish(native, block=None)  # a block not held: Python reads it
    assert read(f, server) == PYTHON and server.python_reads == 3
    assert native.lend(INODE, 0, DATA)  # what a read brought: lent on
    assert read(f, server) == DATA and server.python_reads == 3
    assert native.lend(INODE, 0, None)  # the block left the RAM tier
    assert read(f, server) == PYTHON and server.python_reads == 4
    assert not native.lend(INODE, 1, DATA) and not native.lend(INODE + 1, 0, DATA)  # no such block, inode
    # The first OPEN was answered ENOSYS in C: the kernel opened every file itself since.
    assert server.python_opens == 0 and server.releases == []


def test_a_publication_replaced_under_an_open_file_serves_its_next_read_from_the_new_blocks(
        make_session: Callable[..., Served]) -> None:
    native, server, f = make_session()
    publish(native)
    fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.read(fd, 100) == DATA
        publish(native, block=b"from 2")  # reads are by inode: the open file reads what is lent now
        assert os.pread(fd, 100, 0) == b"from 2"
        native.withdraw(INODE)
        assert os.pread(fd, 100, 0) == PYTHON
    finally:
        os.close(fd)
    assert server.python_opens == 0 and server.releases == []


def test_with_an_opener_every_open_reaches_python_and_its_handles_releases_are_reported(
        make_session: Callable[..., Served]) -> None:
    native, server, f = make_session(no_open=False)
    assert read(f, server) == PYTHON and server.python_opens == 1  # the handle's direct_io: Python read it
    publish(native)
    assert read(f, server) == DATA and server.python_opens == 2  # lent: C reads, Python still opens
    assert sorted(server.releases) == [101, 102]


def test_the_kernel_keeps_an_entry_as_long_as_its_answer_says_at_most_the_sessions_timeout(
        make_session: Callable[..., Served]) -> None:
    _, server, f = make_session()
    os.stat(f)
    os.stat(f)
    assert server.lookups == 1  # an hour: the second walk asked nothing
    _, untrusted, f2 = make_session()
    untrusted.valid_for = 0.0  # what the core says of attributes it no longer trusts
    for _ in range(3):
        os.stat(f2)
    assert untrusted.lookups == 3  # each walk asked again
    _, capped, f3 = make_session(timeout=0.0)  # the session's cap wins over an hour's answer
    for _ in range(3):
        os.stat(f3)
    assert capped.lookups == 3 and capped.valid_for == 3600.0


def test_a_published_entry_answers_lookups_in_c_until_its_deadline_each_reported(
        make_session: Callable[..., Served]) -> None:
    native, server, f = make_session(timeout=0.0)  # the kernel keeps no entry: every stat looks up
    native.publish_entry(1, b"f", attr_tuple(INODE, ATTR), time.monotonic_ns() + 3600 * 10**9)
    for _ in range(3):
        assert os.stat(f).st_ino == INODE
    assert server.lookups == 0  # all three answered in C ...
    wait_until(lambda: server.looked == [INODE] * 3, 10, "the lookups reported")  # ... and counted
    with pytest.raises(FileNotFoundError):
        os.stat(f.parent / "g")  # no entry for it: Python's answer
    assert server.lookups == 1
    assert not native.withdraw_entry(1, b"f", 1)  # another publication's deadline: left alone
    deadline = time.monotonic_ns() + 10**9 // 5
    native.publish_entry(1, b"f", attr_tuple(INODE, ATTR), deadline)  # replaces it
    os.stat(f)
    assert server.lookups == 1
    # Past the deadline, Python answers (and says how long: an hour, capped at 0 here).
    wait_until(lambda: os.stat(f) is not None and server.lookups == 2, 10, "a LOOKUP past the entry's deadline")
    assert time.monotonic_ns() >= deadline
    hour = time.monotonic_ns() + 3600 * 10**9
    native.publish_entry(1, b"f", attr_tuple(INODE, ATTR), hour)
    os.stat(f)
    assert server.lookups == 2
    assert native.withdraw_entry(1, b"f", hour)  # its deadline's: no answer from it once this returns
    os.stat(f)
    assert server.lookups == 3
    native.publish_entry(1, b"f", attr_tuple(INODE, ATTR), hour + 1)
    assert native.withdraw_entry(1, b"f", 0)  # the file changed: whichever deadline it was published with
    os.stat(f)
    assert server.lookups == 4
    with pytest.raises(ValueError):
        native.publish_entry(1, b"a/b", attr_tuple(INODE, ATTR), deadline)  # no name with a slash


def test_a_paused_session_hands_its_connection_to_a_new_one_and_readers_only_wait(
        make_session: Callable[..., Served]) -> None:
    """A handover at the session's level: the first session pauses (its readers stop, the
    kernel queues what comes), is idle once its server has answered what it was given, and
    detaches (a descriptor and the kernel's INIT); a second session adopts them on the same
    mount.  A reader reading all along, and a file kept open across, see no error: reads
    wait while nobody reads the connection and go on once the new session serves."""
    native, server, f = make_session()
    held = os.open(f, os.O_RDONLY | os.O_DIRECT)
    errors: list[object] = []
    reads = [0]
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
                try:
                    data = os.read(fd, 100)
                finally:
                    os.close(fd)
                if data != PYTHON:
                    errors.append(data)
            except OSError as exc:
                errors.append(exc)
            reads[0] += 1

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    adopted: _session.Session | None = None
    try:
        wait_until(lambda: reads[0] >= 5, 10, "reads through the first session")
        native.pause()
        wait_until(lambda: native.busy == 0, 10, "the first session's requests answered")
        server.stop()
        with pytest.raises(RuntimeError):
            native.start()  # a paused session does not start again: it detaches
        fd, init = native.detach()
        assert init[4:8] == (26).to_bytes(4, "little")  # the kernel's FUSE_INIT, as it came
        # What is not an INIT, or one libfuse refuses (protocol major 1), is not adopted,
        # and the failed session leaves the mount alone.
        major_1 = init[:40] + (1).to_bytes(4, "little") + init[44:]
        for bad, error in ((b"\0" * 40, ValueError), (major_1, ValueError)):
            with pytest.raises(error):
                _session.Session(str(f.parent), "ro,fsname=publication-test", 2, 3600.0, 3600.0, 0.0, True, fd, bad)
            assert mounts.find_mount(str(f.parent)) is not None  # (a stat would wait: nobody serves now)
        paused = reads[0]
        # Nobody reads the connection now: no read completes.  (What is checked is an
        # absence, so it is watched for a while rather than waited for.)
        time.sleep(0.3)
        assert reads[0] <= paused + 1
        adopted = _session.Session(str(f.parent), "ro,fsname=publication-test", 2, 3600.0, 3600.0, 0.0, True,
                                   fd, init)
        os.close(fd)  # the session keeps its own duplicate
        adopted.start()
        new_server = Server(adopted)
        wait_until(lambda: reads[0] >= paused + 5, 10, "reads through the adopted session")
        stop.set()
        thread.join(timeout=10)
        assert errors == []
        assert os.pread(held, 100, 0) == PYTHON  # a file opened before the handover reads on
        new_server.stop()
    finally:
        stop.set()
        os.close(held)
        if adopted is not None:
            adopted.close()  # unmounts: the adopted session owns the mount now
    assert not os.path.ismount(f.parent)
