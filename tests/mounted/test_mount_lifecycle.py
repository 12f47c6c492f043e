"""Mounted: the daemon's life -- signals, crashes and stale mounts, busy and lazy unmounts, foreground mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from cubefs_fuse import mounts
from tests.helpers import REPO, Mount, cli, kill_for_good, wait_until

CONTENT = b"survives restarts\n" * 1000


def _gone(m: Mount, pid: int) -> None:
    """The daemon ``pid`` has exited and left neither a mount nor a registry entry."""
    wait_until(lambda: not mounts.pid_alive(pid), timeout=30, what=f"daemon {pid} to exit")
    assert mounts.find_mount(str(m.mount_point)) is None
    assert mounts.registered(str(m.mount_point)) is None
    m.mounted = False


def _prepared(make_mount: Callable[..., Mount]) -> Mount:
    m = make_mount()
    (m.source / "file.bin").write_bytes(CONTENT)
    return m


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_detached_daemon_unmounts_cleanly(make_mount: Callable[..., Mount], signum: int) -> None:
    m = _prepared(make_mount)
    m.mount()
    assert m.path("file.bin").read_bytes() == CONTENT
    pid = m.pid()
    os.kill(pid, signum)
    _gone(m, pid)
    log = m.log()
    assert f"{signal.Signals(signum).name} received: unmounting" in log
    assert f"unmounted {m.mount_point}" in log
    assert "Traceback" not in log
    assert (m.cache_dir / "index.bin").exists()  # the clean path saved the block index
    assert not m.path("file.bin").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_foreground_logs_to_stderr_and_exits_zero_on_signal(make_mount: Callable[..., Mount], signum: int) -> None:
    m = _prepared(make_mount)
    m.config_path.write_text(json.dumps(m.config()))
    stderr_path = m.base / "stderr.txt"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "cubefs_fuse", "mount", "-c", str(m.config_path), "--foreground"],
                                stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, cwd=REPO)
    try:
        wait_until(lambda: proc.poll() is not None or mounts.registered(str(m.mount_point)) is not None,
                   timeout=60, what="the foreground daemon to mount")
        assert proc.poll() is None, stderr_path.read_text()
        info = mounts.registered(str(m.mount_point))
        assert info is not None and info["keeper"] == proc.pid  # no fork: this is the keeper, the daemon its child
        assert m.path("file.bin").read_bytes() == CONTENT
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _gone(m, proc.pid)
    err = stderr_path.read_text()
    assert f"mounted {m.source} on {m.mount_point}" in err
    assert f"{signal.Signals(signum).name} received: unmounting" in err
    assert f"unmounted {m.mount_point}" in err


def test_kill_9_leaves_a_stale_mount_that_the_next_mount_recovers(make_mount: Callable[..., Mount]) -> None:
    m = _prepared(make_mount)
    m.mount()
    assert m.path("file.bin").read_bytes() == CONTENT
    pid = m.pid()
    kill_for_good(mounts.registered(str(m.mount_point)) or {})
    assert mounts.find_mount(str(m.mount_point)) is not None
    assert mounts.is_stale(str(m.mount_point))  # ENOTCONN: the mount outlived its daemon
    result = cli("mount", "-c", str(m.config_path))
    assert result.returncode == 0, f"{result.stderr}\n{m.log()}"
    m.mounted = True
    assert "mount left by a dead daemon" in result.stderr
    assert m.pid() != pid
    assert m.path("file.bin").read_bytes() == CONTENT
    m.umount()
    assert mounts.find_mount(str(m.mount_point)) is None


def test_umount_of_a_busy_mount_fails_clearly_and_lazy_works(make_mount: Callable[..., Mount]) -> None:
    m = _prepared(make_mount)
    m.mount()
    pid = m.pid()
    fd = os.open(m.path("file.bin"), os.O_RDONLY)
    lazy: subprocess.Popen[str] | None = None
    try:
        busy = cli("umount", str(m.mount_point))
        assert busy.returncode == 1
        assert "busy" in busy.stderr.lower() and "--lazy" in busy.stderr, busy.stderr
        assert len(busy.stderr.strip().splitlines()) == 1 and "Traceback" not in busy.stderr
        assert mounts.find_mount(str(m.mount_point)) is not None
        assert os.pread(fd, 100, 0) == CONTENT[:100]  # still serving
        lazy = subprocess.Popen([sys.executable, "-m", "cubefs_fuse", "umount", "--lazy", str(m.mount_point)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        wait_until(lambda: mounts.find_mount(str(m.mount_point)) is None, what="the lazy detach")
        assert not m.path("file.bin").exists()  # gone from the namespace ...
        assert os.pread(fd, 100, 1000) == CONTENT[1000:1100]  # ... but the open file still works
        assert mounts.pid_alive(pid)
    finally:
        os.close(fd)
    # The last reference is gone: the daemon finishes and `umount --lazy` returns.
    out, err = lazy.communicate(timeout=60)
    assert lazy.returncode == 0, err
    assert "unmounted" in out
    _gone(m, pid)
