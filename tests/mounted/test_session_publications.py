"""Mounted: the C session serves reads of an inode's lent blocks, and answers its opens
while it is vouched for, and only then.

The session (fs/_session.c) is driven directly by a small server thread standing in for
fs/session.py, on a mount without ``default_permissions`` and with hour-long kernel
timeouts, so the kernel asks nothing before an OPEN and every OPEN reaches the session:
what decides who answers it is the publication alone.  A published inode's READs of lent
blocks are answered in C and reported (OP_SERVED, with the reader's pid); its OPENs are
answered in C while the publication is vouched for, has every block lent and was not
ended by ``invalidate_all``; otherwise Python answers them.  With ``direct_io`` every read
reaches the session, so whether C or Python served it shows in the bytes.  Only the
releases of handles Python gave are reported.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubefs_fuse.attrs import Attr
from cubefs_fuse.fs import _session
from cubefs_fuse.fs.session import Request, attr_tuple
from tests.helpers import wait_until

INODE = 2
DATA = b"from C"  # what a READ served by the session returns (the lent block)
PYTHON = b"Python"  # what a READ answered by the server thread returns (same length)
NOW = time.time_ns()
ATTR = Attr(stat.S_IFREG | 0o444, 1, 0, 0, 0, len(DATA), 1, 4096, NOW, NOW, NOW, 7)


class Server:
    """Answers what the session forwards, as fs/session.py would, and records the reports."""

    def __init__(self, native: _session.Session) -> None:
        self.native = native
        self.python_opens = 0
        self.python_reads = 0
        self.served: list[tuple[int, int, int, object]] = []  # OP_SERVED: (ino, pid, offset, served)
        self.releases: list[int] = []  # handles of OP_RELEASE reports
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select
        while not self._stop.is_set():
            ready, _, _ = select.select([self.native.fileno()], [], [], 0.05)
            if ready:
                for r in self.native.take():
                    self._answer(r)

    def _answer(self, r: Request) -> None:
        rid, op, fh = r[0], r[1], r[3]
        native = self.native
        if op == _session.OP_LOOKUP:
            if r[10] == b"f":
                native.reply_entry(rid, attr_tuple(INODE, ATTR))
            else:
                native.reply_err(rid, errno.ENOENT)
        elif op == _session.OP_GETATTR:
            native.reply_attr(rid, attr_tuple(r[2], ATTR) if r[2] == INODE else attr_tuple(1, DIR))
        elif op == _session.OP_OPEN:
            self.python_opens += 1
            native.reply_open(rid, 100 + self.python_opens, False, True)
        elif op == _session.OP_READ:
            self.python_reads += 1
            native.reply_buf(rid, PYTHON[r[4]:r[4] + r[5]])
        elif op == _session.OP_SERVED:
            self.served.append((r[2], r[7], r[4], r[11]))
        elif op == _session.OP_RELEASE:
            self.releases.append(fh)
        elif r[0]:
            native.reply_err(rid, errno.ENOSYS)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


DIR = Attr(stat.S_IFDIR | 0o555, 2, 0, 0, 0, 0, 1, 4096, NOW, NOW, NOW, 1)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[_session.Session, Server, Path]]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    native = _session.Session(str(mnt), "ro,fsname=publication-test", 2, 3600.0, 3600.0, 0.0)
    native.start()
    server = Server(native)
    try:
        yield native, server, mnt / "f"
    finally:
        server.stop()
        native.close()
    assert not os.path.ismount(mnt)


def read(path: Path, server: Server) -> bytes:
    """Open, read and close ``path``; return once what the session answered is reported (a
    READ it served; the RELEASE of a handle Python gave, which the kernel sends after
    close() returns)."""
    served, opens = len(server.served), server.python_opens
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, 100)
    finally:
        os.close(fd)
    if data == DATA:
        wait_until(lambda: len(server.served) > served, 10, "the read reported")
    if server.python_opens > opens:
        wait_until(lambda: 100 + server.python_opens in server.releases, 10, "the release reported")
    return data


def publish(native: _session.Session, vouch_for: float = 3600.0, block: bytes | None = DATA) -> None:
    native.publish(INODE, vouch_for, False, True, len(DATA), 4096, [block])


def test_a_published_inode_is_opened_in_c_while_vouched_for_and_read_in_c_while_lent(
        served: tuple[_session.Session, Server, Path]) -> None:
    native, server, f = served
    assert read(f, server) == PYTHON and (server.python_opens, server.python_reads) == (1, 1)  # nothing published
    publish(native, vouch_for=1.0)
    assert read(f, server) == DATA and server.python_opens == 1 and native.native_opens == 1
    assert server.served == [(INODE, os.getpid(), 0, (0, len(DATA), 1, 0, 0))]  # block 0 from RAM, by us
    time.sleep(1.2)
    assert read(f, server) == DATA and server.python_opens == 2  # no longer vouched for: still lent
    publish(native)
    assert read(f, server) == DATA and server.python_opens == 2
    native.withdraw(INODE)
    assert read(f, server) == PYTHON and (server.python_opens, server.python_reads) == (3, 2)
    publish(native)
    native.invalidate_all()  # the metadata cache was emptied
    assert read(f, server) == DATA and server.python_opens == 4
    publish(native, block=None)  # a block not held: Python opens it, and reads it
    assert read(f, server) == PYTHON and (server.python_opens, server.python_reads) == (5, 3)
    assert native.lend(INODE, 0, DATA)  # what a read brought: lent on
    assert read(f, server) == DATA and server.python_opens == 5  # every block lent: C opens it again
    assert native.lend(INODE, 0, None)  # the block left the RAM tier
    assert read(f, server) == PYTHON and server.python_reads == 4
    assert not native.lend(INODE, 1, DATA) and not native.lend(INODE + 1, 0, DATA)  # no such block, inode
    assert native.native_opens == 3
    assert sorted(server.releases) == [101, 102, 103, 104, 105, 106]  # Python's handles only


def test_a_publication_replaced_under_an_open_file_serves_its_next_read_from_the_new_blocks(
        served: tuple[_session.Session, Server, Path]) -> None:
    native, server, f = served
    publish(native)
    fd = os.open(f, os.O_RDONLY)
    try:
        assert os.read(fd, 100) == DATA
        publish(native, block=b"from 2")  # reads are by inode: the open file reads what is lent now
        assert os.pread(fd, 100, 0) == b"from 2"
        native.withdraw(INODE)
        assert os.pread(fd, 100, 0) == PYTHON
    finally:
        os.close(fd)
    assert server.releases == []  # C answered the open: no handle of Python's
