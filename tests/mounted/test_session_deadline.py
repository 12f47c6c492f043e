"""Mounted: the C session answers EIO to a request Python leaves unanswered past its deadline.

The session (fs/_session.c) is driven directly, with no Python serving it, as a stalled
trio thread would leave it: a reader's stat gets EIO at the deadline instead of hanging,
and an answer that comes later finds the request gone (``_session.Gone``), which the
Python side (fs/session.py) counts instead of crashing on.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cubefs_fuse.attrs import Attr
from cubefs_fuse.fs import _session
from cubefs_fuse.fs.session import Request, attr_tuple
from tests.helpers import wait_until

DEADLINE = 0.5  # seconds; the watchdog ticks every 100 ms at this deadline


def _stat_in_child(path: Path) -> subprocess.Popen[bytes]:
    """A process that stats ``path`` and exits with the errno it got (0: none)."""
    return subprocess.Popen([sys.executable, "-c", f"import os, sys\ntry:\n    os.stat({str(path)!r})\n"
                             "except OSError as e:\n    sys.exit(e.errno)"])


def _session_on(tmp_path: Path) -> _session.Session:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    native = _session.Session(str(mnt), "ro,default_permissions,fsname=deadline-test", 1, 1.0, 1.0, DEADLINE)
    native.start()
    return native


def test_a_request_nobody_answers_gets_eio_at_the_deadline(tmp_path: Path) -> None:
    native = _session_on(tmp_path)
    try:
        started = time.monotonic()
        code = _stat_in_child(tmp_path / "mnt" / "name").wait(timeout=60)
        seconds = time.monotonic() - started
        assert code == errno.EIO, f"the stat ended with errno {code}"
        assert DEADLINE * 0.9 <= seconds < DEADLINE + 10, seconds
        assert native.expired >= 1
    finally:
        native.close()


def test_an_answer_after_the_deadline_finds_the_request_gone(tmp_path: Path) -> None:
    native = _session_on(tmp_path)
    try:
        child = _stat_in_child(tmp_path / "mnt" / "late")
        taken: list[Request] = []

        def asked() -> bool:
            taken.extend(r for r in native.take() if r[1] in (_session.OP_LOOKUP, _session.OP_GETATTR))
            return bool(taken)

        wait_until(asked, timeout=20, what="a LOOKUP or GETATTR reaching the session")
        request = taken[0]
        assert child.wait(timeout=30) == errno.EIO
        now = time.time_ns()
        attr = Attr(stat.S_IFREG | 0o444, 1, 0, 0, 0, 5, 1, 4096, now, now, now, 99)
        with pytest.raises(_session.Gone):
            native.reply_entry(request[0], attr_tuple(99, attr), 1.0)
        with pytest.raises(_session.Gone):  # and a made-up id too
            native.reply_err(12345, 0)
    finally:
        native.close()
    assert not os.path.ismount(tmp_path / "mnt")
