"""Mounted: ``cubefs-fuse upgrade`` hands a live mount to a new daemon (control/handover.py).

A reader reads every file of the mount in a loop, comparing each with the source, and
keeps one file open throughout; the mount is handed over under it ten times in a row.  No read may fail or
return other bytes, the file opened before stays readable, the new daemon serves what the
old one cached (from the NVMe tier, whose index it reads: no backend read), the pause is
reported, and the new daemon unmounts as any daemon does.  A new daemon that fails after
the old one has stopped (a metrics port taken since) leaves the old one serving, with no
failed read either; a new config that moved the mount point is refused before anything
stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from cubefs_fuse import mounts
from cubefs_fuse.control.keeper import keeper_socket_path
from tests.continuous_reads import FILES, Reader, fill
from tests.helpers import Mount, cli, free_port, metric, wait_until

UPGRADES = 10  # in a row, under one reader


def test_upgrades_in_a_row_hand_the_mount_over_and_no_read_fails(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    contents = fill(m)
    m.mount()
    held = open(m.path("d/f0"), "rb")  # noqa: SIM115 - open across the handovers
    pauses = []
    try:
        with Reader(m, contents).running() as reader:
            for _ in range(UPGRADES):
                old = m.pid()
                result = cli("upgrade", str(m.mount_point))
                assert result.returncode == 0, result.stderr + m.log()
                paused = re.search(r"readers paused (\d+) ms", result.stdout)
                assert paused and f"pid {old}" in result.stdout, result.stdout
                pauses.append(int(paused.group(1)))
                new = m.pid()
                assert new != old and f"pid {new}" in result.stdout
                assert mounts.wait_for_exit(old, timeout=30), "the old daemon did not exit"
                reads = reader.reads
                wait_until(lambda: reader.reads > reads, 30, "a read through the new daemon")
        assert reader.errors == [] and reader.reads > 3 * FILES
        held.seek(0)
        assert held.read() == contents["d/f0"]  # opened before, read after
    finally:
        held.close()
    # The new daemon serves what the old one cached: the NVMe tier's blocks, no backend read.
    for rel, data in contents.items():
        assert m.path(rel).read_bytes() == data
    assert metric(m.scrape(), "cubefs_fuse_backend_operations_total", op="read") == 0
    assert "loaded from index" in m.log()
    pauses.sort()
    print(f"{UPGRADES} handovers: readers paused {pauses[0]}-{pauses[-1]} ms (median {pauses[len(pauses) // 2]}), "
          f"the reader's longest wait {reader.longest_wait * 1000:.0f} ms")  # the note's figures (pytest -s)
    m.umount()
    assert mounts.find_mount(str(m.mount_point)) is None
    assert mounts.wait_for_exit(new, timeout=30)


@pytest.mark.expected_daemon_errors(r"cannot listen on")
def test_a_new_daemon_that_fails_leaves_the_old_one_serving(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    contents = fill(m)
    m.mount()
    old = m.pid()
    # The new daemon fails after the old one has stopped: the config names a metrics port
    # that another process has taken.
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen()
    try:
        config = json.loads(m.config_path.read_text())
        m.config_path.write_text(json.dumps({**config, "exporterPort": taken.getsockname()[1]}))
        with Reader(m, contents).running() as reader:
            result = cli("upgrade", str(m.mount_point))
            assert result.returncode != 0 and "cannot listen on" in result.stderr, result.stderr
            assert m.pid() == old  # the old daemon serves on
        assert reader.errors == []
    finally:
        taken.close()
    assert "serving the mount again" in m.log()
    assert metric(m.scrape(), "cubefs_fuse_backend_up") == 1  # its metrics port is its own again
    m.config_path.write_text(json.dumps(config))
    m.umount()


def test_an_upgrade_that_would_move_the_mount_or_has_no_daemon_is_refused(make_mount: Callable[..., Mount],
                                                                          tmp_path: Path) -> None:
    m = make_mount()
    fill(m)
    result = cli("upgrade", str(m.mount_point))
    assert result.returncode == 2 and "no cubefs-fuse daemon serves" in result.stderr
    m.mount()
    old = m.pid()
    config = json.loads(m.config_path.read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    m.config_path.write_text(json.dumps({**config, "mountPoint": str(elsewhere)}))
    result = cli("upgrade", str(m.mount_point))
    assert result.returncode == 2 and "an upgrade keeps the mount where it is" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback
    assert m.pid() == old and os.listdir(m.path("d"))
    m.config_path.write_text(json.dumps(config))
    control = mounts.registered(str(m.mount_point))["controlSocket"]  # type: ignore[index]
    # A daemon that takes no handovers: the new daemon the keeper starts says so, and ends.
    os.unlink(mounts.handover_socket_path(control))
    result = cli("upgrade", str(m.mount_point))
    assert result.returncode == 1 and "no running daemon to take the mount over from" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1
    assert m.pid() == old and os.listdir(m.path("d"))
    # A mount of a version before keepers: nobody to start a new daemon.
    os.unlink(keeper_socket_path(control))
    result = cli("upgrade", str(m.mount_point))
    assert result.returncode == 2 and "has no keeper" in result.stderr, result.stderr
    assert m.pid() == old
    m.umount()


def test_the_handover_socket_refuses_what_is_not_a_successor(make_mount: Callable[..., Mount]) -> None:
    """Only the daemon's uid (or root) may connect (mode 0600, and the peer's uid is
    checked); a request that is not one, too long, or of a format the daemon does not
    write is answered with the reason, and the daemon serves on as before."""
    m = make_mount()
    contents = fill(m)
    m.mount()
    path = mounts.handover_socket_path(mounts.registered(str(m.mount_point))["controlSocket"])  # type: ignore[index]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    def ask(data: bytes) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(path)
            # A peer refused by its credentials is answered before the daemon reads a byte,
            # and the connection closed: a send that comes after that close fails (EPIPE),
            # and the answer is still there to read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(data)
            return s.makefile("rb").readline().decode()

    assert "not a handover request" in ask(b"hello\n")
    assert "not a handover request" in ask(b"x" * 10_000)  # no newline within the limit
    answer = ask(json.dumps({"formats": [99], "version": "9.9"}).encode() + b"\n")
    assert "does not read" in answer and "unmount and mount again" in answer
    # Another uid, even with a way in (mode relaxed), is refused by its credentials.
    os.chmod(path, 0o666)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        try:
            os.setuid(65534)
            os._exit(0 if "may not take over" in ask(b'{"formats": [1]}\n') else 1)
        except BaseException:
            os._exit(2)
    assert os.waitpid(child, 0)[1] == 0
    assert m.path("d/f1").read_bytes() == contents["d/f1"]  # served on, by the same daemon
    m.umount()
