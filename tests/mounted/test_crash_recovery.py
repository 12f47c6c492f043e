"""Mounted: a daemon that dies without unmounting (SIGKILL, as the OOM killer sends) is
replaced by its keeper (control/keeper.py) on the same kernel connection: readers pause,
none fails.

A reader reads every file of the mount in a loop and keeps one file open; the daemon is
killed ten times in a row under it (and upgraded once in between, so that a daemon that
took the mount over is recovered too).  No read may fail or return other bytes, the file
opened before stays readable, each new daemon serves what the dead one cached (NVMe
blocks found by the rescan: no backend read), and the last one unmounts as any daemon
does.  A daemon killed while a read waits on the source: the kernel sends that read again
to the new daemon (FUSE_NOTIFY_RESEND), whose answer the reader gets.  A mount whose
daemon cannot be started again is given up after a few tries: readers get ENOTCONN,
never a wait without end.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse import mounts
from cubefs_fuse.control.keeper import RECOVERY_BACKOFF
from tests.continuous_reads import FILES, Reader, fill
from tests.helpers import Mount, cli, kill_daemon, metric, nvme_written, wait_until, waits_on_fuse

KILLS = 10  # in a row, under one reader
UPGRADE_AT = 5  # the daemon upgraded before this kill: its successor is recovered next


def standbys(keeper: int, serving: int) -> list[int]:
    """The keeper's standby daemons: its children started to recover the mount (--recover)
    other than the one ``serving`` it."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"\nPPid:\t{keeper}\n" in status and b"--recover" in cmdline and int(entry) != serving:
                found.append(int(entry))
    return sorted(found)


def _pauses(log: str) -> list[int]:
    return [int(ms) for ms in re.findall(r"recovered the mount after daemon pid \d+ died .*readers paused (\d+) ms",
                                         log)]


@pytest.mark.expected_daemon_errors()
def test_a_daemon_killed_ten_times_is_recovered_and_no_read_fails(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    contents = fill(m)
    m.mount()
    keeper = mounts.registered(str(m.mount_point))["keeper"]  # type: ignore[index]
    held = open(m.path("d/f0"), "rb")  # noqa: SIM115 - open across the crashes
    try:
        with Reader(m, contents).running() as reader:
            for i in range(KILLS):
                if i == UPGRADE_AT:
                    assert cli("upgrade", str(m.mount_point)).returncode == 0, m.log()
                # The NVMe tier has every block (the reader read each file twice, writes
                # drained) before the daemon dies: the next one must not fetch any again.
                nvme_written(m)
                # The keeper keeps a daemon started in advance: it is the one that recovers.
                wait_until(lambda: len(standbys(keeper, m.pid())) == 1, 30, "a standby daemon")
                [standby] = standbys(keeper, m.pid())
                wait_until(lambda: f"standby daemon pid {standby} ready" in m.log(), 30, "the standby's start")
                new = kill_daemon(m)
                assert new == standby
                reads = reader.reads
                wait_until(lambda: reader.reads > reads + FILES, 30, "reads through the recovered daemon")
                assert metric(m.scrape(), "cubefs_fuse_backend_operations_total", op="read") == 0, \
                    f"daemon {new} read from the source what its predecessor had cached"
        assert reader.errors == [] and reader.reads > KILLS * FILES
        held.seek(0)
        assert held.read() == contents["d/f0"]  # opened before the first crash, read after the last
    finally:
        held.close()
    assert mounts.registered(str(m.mount_point))["keeper"] == keeper  # type: ignore[index]  # one keeper throughout
    pauses = sorted(_pauses(m.log()))
    assert len(pauses) == KILLS
    print(f"{KILLS} crashes: readers paused {pauses[0]}-{pauses[-1]} ms (median {pauses[len(pauses) // 2]}), "
          f"the reader's longest wait {reader.longest_wait * 1000:.0f} ms")  # the note's figures (pytest -s)
    last = m.pid()
    waiting = standbys(keeper, last)
    m.umount()
    assert mounts.find_mount(str(m.mount_point)) is None
    assert mounts.wait_for_exit(last, timeout=30) and mounts.wait_for_exit(keeper, timeout=30)
    assert all(mounts.wait_for_exit(pid, timeout=30) for pid in waiting)  # the standby ends with its keeper


@pytest.mark.parametrize("waiting", ["lookup", "read"])
def test_a_request_in_flight_when_the_daemon_dies_is_answered_by_the_next(make_slow_mount: Callable[..., Any],
                                                                          waiting: str) -> None:
    """``lookup``: the first open of a small file (whose LOOKUP reads it whole: one round
    trip); ``read``: a read far into a large file already looked up."""
    slow = make_slow_mount(backendTimeout=60)
    m = slow.mount
    size, offset = (300_000, 0) if waiting == "lookup" else (64 << 20, 48 << 20)
    data = os.urandom(size)
    (slow.real / "cold.bin").write_bytes(data)
    m.mount()
    if waiting == "read":
        os.stat(m.path("cold.bin"))
    got: list[bytes | BaseException] = []

    def read() -> None:
        try:
            with open(m.path("cold.bin"), "rb", buffering=0) as f:
                got.append(os.pread(f.fileno(), 1 << 20, offset))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            got.append(exc)

    slow.slowfs.hang()  # the source answers nothing: the daemon's request to it waits
    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        old = m.pid()
        # The daemon has the request: one of its threads waits on the source for it.
        wait_until(lambda: waits_on_fuse(old), 30, "the daemon to ask the hung source")
        assert reader.is_alive() and not got, got
        kill_daemon(m, after_death=slow.slowfs.resume)
    finally:
        slow.slowfs.resume()
    reader.join(timeout=60)
    assert got, "the request the dead daemon had read was never answered"
    assert got[0] == data[offset:offset + (1 << 20)], got[0] if isinstance(got[0], BaseException) else "other bytes"
    assert m.pid() != old
    assert "recovered the mount after daemon pid" in m.log()
    m.umount()


@pytest.mark.expected_daemon_errors(r"cannot recover the mount|daemon failed|cannot be used")
def test_a_mount_whose_daemon_cannot_come_back_is_given_up_not_hung(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    (m.source / "f").write_bytes(b"x" * 5000)
    m.mount()
    info = mounts.registered(str(m.mount_point))
    assert info is not None and m.path("f").read_bytes() == b"x" * 5000
    good = m.config_path.read_text()
    m.config_path.write_text(json.dumps({**json.loads(good), "memCacheSize": "lots"}))  # every new daemon fails
    started = time.monotonic()
    os.kill(info["pid"], signal.SIGKILL)
    assert mounts.wait_for_exit(info["keeper"], timeout=60), "the keeper did not give up"
    assert time.monotonic() - started < sum(RECOVERY_BACKOFF) + 30
    (m.source / "g").write_bytes(b"y")
    with pytest.raises(OSError) as failed:
        m.path("g").read_bytes()  # not in the kernel's caches: a request, which nobody will answer
    assert failed.value.errno == errno.ENOTCONN  # an error at once, not a wait
    log = m.log()
    assert "cannot recover the mount" in log and "memCacheSize" in log, log[-3000:]
    m.config_path.write_text(good)
    assert cli("umount", "--lazy", str(m.mount_point)).returncode == 0
    m.mounted = False
