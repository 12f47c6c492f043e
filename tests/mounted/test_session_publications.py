"""Mounted: the C session answers opens and reads of a published inode, and only then.

The session (fs/_session.c) is driven directly by a small server thread standing in for
fs/session.py, on a mount without ``default_permissions`` and with hour-long kernel
timeouts, so the kernel asks nothing before an OPEN and every OPEN reaches the session:
what decides who answers it is the publication alone.  A published inode's OPEN is
answered in C (reported as OP_OPENED) while the publication is valid, complete, not
withdrawn and not ended by ``invalidate_all``; otherwise Python answers it.  With
``direct_io`` every read reaches the session, so whether C or Python served it shows in the
bytes.  A publication replaced while a handle reads it is freed by that handle's release,
and the release's report names it.
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
        self.c_opens: list[int] = []  # handles of OP_OPENED reports
        self.releases: list[tuple[int, object, int]] = []  # (fh, served, freed)
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
            native.reply_open(rid, 100 + self.python_opens, False, True, False)
        elif op == _session.OP_READ:
            native.reply_buf(rid, PYTHON[r[4]:r[4] + r[5]])
        elif op == _session.OP_OPENED:
            self.c_opens.append(fh)
        elif op == _session.OP_RELEASE:
            self.releases.append((fh, r[11], r[12]))
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
    """Open, read and close ``path``; return once the session reported the release (the
    kernel sends RELEASE after close() returns)."""
    released = len(server.releases)
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)
        wait_until(lambda: len(server.releases) > released, 10, "the release reported")


def publish(native: _session.Session, id: int, valid_for: float = 3600.0, block: bytes | None = DATA) -> int:
    return native.publish(INODE, id, valid_for, False, True, len(DATA), 4096, [block])


def test_a_published_inode_is_opened_and_read_in_c_while_the_publication_is_good(
        served: tuple[_session.Session, Server, Path]) -> None:
    native, server, f = served
    assert read(f, server) == PYTHON and server.python_opens == 1  # nothing published yet
    assert publish(native, 1, valid_for=1.0) == 0
    assert read(f, server) == DATA and server.python_opens == 1 and native.native_opens == 1
    c_fh = server.c_opens[0]
    assert c_fh >= 1 << 62  # C's own handle numbers
    assert server.releases[1] == (c_fh, (1, len(DATA), 1, 1, 0, 0, 0), 0)  # one READ of block 0 from RAM
    time.sleep(1.2)
    assert read(f, server) == PYTHON and server.python_opens == 2  # expired
    publish(native, 2)
    assert read(f, server) == DATA
    assert native.withdraw(INODE) == 2  # no handle reads it: freed now
    assert read(f, server) == PYTHON and server.python_opens == 3
    publish(native, 3)
    native.invalidate_all()  # the metadata cache was emptied
    assert read(f, server) == PYTHON and server.python_opens == 4
    publish(native, 4, block=None)  # a block not held: the open goes to Python, which lends it all
    assert read(f, server) == PYTHON and server.python_opens == 5
    assert native.native_opens == 2


def test_a_publication_replaced_under_an_open_handle_is_freed_by_its_release(
        served: tuple[_session.Session, Server, Path]) -> None:
    native, server, f = served
    publish(native, 1)
    fd = os.open(f, os.O_RDONLY)
    try:
        assert publish(native, 2) == 0  # the open handle still reads publication 1
        assert os.read(fd, 100) == DATA
    finally:
        os.close(fd)
    wait_until(lambda: bool(server.releases), 10, "the release reported")
    assert server.releases[0][2] == 1  # freed with the handle's release, for Python to take back
    assert read(f, server) == DATA and native.withdraw(INODE) == 2
