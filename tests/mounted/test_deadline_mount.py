"""Mounted: a hung or vanished remote (docs/concurrency.md, "Never stuck"), through real mounts.

The remote is tools/slowfs: ``hang()`` stops it answering (SIGSTOP), ``resume()`` answers
again; ``stop()`` and a new slowfs on the same path are a remote that went away and came
back.  Readers run as child processes, each waited for with a deadline, so a reader that
hangs fails the test instead of hanging the session.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cubefs_fuse import mounts
from tests.helpers import REPO, Mount, SlowMount, cli, metric, wait_until, write_tree
from tools.slowfs import SlowFSProcess

# backendTimeout of these mounts: short, so that a test waits seconds, not the default 30.
TIMEOUT = 2.0
# How much later than the deadline a reader may get its answer on a loaded 2-core machine
# (process start-up included); the reader would wait forever without the deadline.
SLACK = 30.0

READER = """
import errno, hashlib, os, sys
try:
    os.stat(sys.argv[1])  # the lookup a reader's stat makes
    fd = os.open(sys.argv[1], os.O_RDONLY)
    try:
        # The size of the version opened: a stat's may be the kernel's cached attributes of
        # an older one (a file changed at the source: a new inode, found at the open).
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read must reach the daemon
        data = b""
        while len(data) < size:
            chunk = os.pread(fd, size - len(data), len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    print("ok", hashlib.sha256(data).hexdigest())
except OSError as exc:
    print("err", errno.errorcode.get(exc.errno, exc.errno))
"""


def start_reader(path: Path) -> subprocess.Popen[str]:
    """A child process that reads ``path`` whole: prints ``ok <sha256>`` or ``err <ERRNO>``."""
    return subprocess.Popen([sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def outcome(reader: subprocess.Popen[str], timeout: float = TIMEOUT + SLACK) -> str:
    try:
        out, err = reader.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        reader.kill()
        raise AssertionError(f"the reader got no answer within {timeout:.0f} s") from None
    assert reader.returncode == 0, err
    return out.strip()


def read(path: Path) -> str:
    return outcome(start_reader(path))


def ok(data: bytes) -> str:
    return f"ok {hashlib.sha256(data).hexdigest()}"


def backend_ops(m: Mount) -> float:
    return sum(v for k, v in m.scrape().items() if k.startswith("cubefs_fuse_backend_operations_total"))


def prepared(make_slow_mount: Callable[..., SlowMount], sizes: dict[str, int] | None = None,
             **config: object) -> tuple[SlowMount, dict[str, bytes]]:
    """A mount (``config`` added) of d/a.bin, d/b.bin and d/c.bin, 300,000 random bytes each
    (``sizes``: {name: size} instead), their attributes cached by a listing."""
    s = make_slow_mount(backendTimeout=TIMEOUT, **config)
    sizes = sizes or dict.fromkeys(("a", "b", "c"), 300_000)
    files = write_tree(s.real, {f"d/{name}.bin": os.urandom(size) for name, size in sizes.items()})
    s.mount.mount()
    assert sorted(os.listdir(s.mount.path("d"))) == sorted(f"{name}.bin" for name in sizes)  # attributes cached
    return s, files


@pytest.mark.expected_daemon_errors(r"backend down: read of 'd/a\.bin' got no answer within 2 s")
def test_hung_remote_gives_eio_within_the_deadline_fails_fast_and_recovers(
        make_slow_mount: Callable[..., SlowMount]) -> None:
    s, files = prepared(make_slow_mount)
    m = s.mount
    s.slowfs.hang()
    try:
        assert read(m.path("d/a.bin")) == "err EIO"  # waited for the deadline
        samples = m.scrape()
        assert metric(samples, "cubefs_fuse_backend_up") == 0
        assert metric(samples, "cubefs_fuse_backend_timeouts_total", op="read") >= 1
        assert read(m.path("d/b.bin")) == "err EIO"  # fails fast: the backend is down
        assert metric(m.scrape(), "cubefs_fuse_backend_failed_fast_total", op="read") >= 1
        assert 1 <= metric(m.scrape(), "cubefs_fuse_backend_threads_abandoned") <= 64 + 1
        assert "backend down: read of 'd/a.bin' got no answer within 2 s" in m.log()
    finally:
        s.slowfs.resume()
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_up") == 1, timeout=SLACK, what="the probe")
    assert read(m.path("d/b.bin")) == ok(files["d/b.bin"])
    assert read(m.path("d/a.bin")) == ok(files["d/a.bin"])
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_threads_abandoned") == 0, timeout=SLACK,
               what="the abandoned threads to return")
    assert "backend up again" in m.log()
    m.umount()


def test_cached_file_is_served_within_its_ttl_while_the_remote_hangs(
        make_slow_mount: Callable[..., SlowMount]) -> None:
    s, files = prepared(make_slow_mount)  # attrValid, lookupValid: 30 s (defaults)
    m = s.mount
    assert read(m.path("d/c.bin")) == ok(files["d/c.bin"])  # now in the RAM tier
    before = m.scrape()
    s.slowfs.hang()
    try:
        assert read(m.path("d/c.bin")) == ok(files["d/c.bin"])
        after = m.scrape()
        assert backend_ops(m) == sum(v for k, v in before.items()
                                     if k.startswith("cubefs_fuse_backend_operations_total"))
        # The read reached the daemon (not the page cache) and the RAM tier served it.
        assert (metric(after, "cubefs_fuse_served_bytes_total", source="ram")
                - metric(before, "cubefs_fuse_served_bytes_total", source="ram")) >= len(files["d/c.bin"])
        assert metric(after, "cubefs_fuse_backend_up") == 1  # nothing asked the remote
    finally:
        s.slowfs.resume()
    m.umount()


@pytest.mark.expected_daemon_errors(r"backend down: read of 'd/a\.bin' got no answer within 2 s")
@pytest.mark.parametrize("how", ["cubefs-fuse umount", "fusermount3 -u", "cubefs-fuse umount --lazy, reader waiting",
                                 "SIGTERM, reader waiting"])
def test_umount_works_with_a_hung_remote_and_the_daemon_exits(
        make_slow_mount: Callable[..., SlowMount], how: str) -> None:
    s, _ = prepared(make_slow_mount)
    m = s.mount
    pid = m.pid()
    s.slowfs.hang()
    try:
        reader = start_reader(m.path("d/a.bin"))
        if how.endswith("reader waiting"):
            wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_operations_total", op="read") >= 1,
                       timeout=SLACK, what="the reader's read to reach the backend")
        if how.startswith("SIGTERM"):
            # The daemon fails the waiting read at once and unmounts (lazily: the file is open).
            os.kill(pid, signal.SIGTERM)
            assert outcome(reader) in ("err EIO", "err ENOTCONN")
        elif how.startswith("cubefs-fuse umount --lazy"):
            # Detach while the reader waits on the remote: it gets EIO at the deadline, closes
            # its file, and the daemon, no longer referenced, exits.
            lazy = subprocess.Popen([sys.executable, "-m", "cubefs_fuse", "umount", "--lazy", str(m.mount_point)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
            assert outcome(reader) in ("err EIO", "err ENOTCONN")
            out, err = lazy.communicate(timeout=60)
            assert lazy.returncode == 0 and "unmounted" in out, err
        else:
            assert outcome(reader) == "err EIO"
            if how == "fusermount3 -u":
                subprocess.run(["fusermount3", "-u", str(m.mount_point)], check=True, capture_output=True)
            else:
                result = cli("umount", str(m.mount_point), timeout=60)
                assert result.returncode == 0, result.stderr
        wait_until(lambda: not mounts.pid_alive(pid), timeout=SLACK, what=f"daemon {pid} to exit")
        assert mounts.find_mount(str(m.mount_point)) is None and mounts.registered(str(m.mount_point)) is None
        m.mounted = False
        assert "unmounted" in m.log()
    finally:
        s.slowfs.resume()


@pytest.mark.expected_daemon_errors(r"backend down: ")  # the first operation to find the remote gone, or the probe
def test_remote_that_comes_back_at_the_same_path_is_reopened(make_slow_mount: Callable[..., SlowMount]) -> None:
    s, files = prepared(make_slow_mount)
    m = s.mount
    pid = m.pid()
    assert read(m.path("d/a.bin")) == ok(files["d/a.bin"])
    s.slowfs.stop()  # the remote goes away: its mount point is an empty directory now
    assert read(m.path("d/b.bin")) in ("err ENOTCONN", "err EIO")
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_up") == 0, timeout=SLACK, what="down")
    assert read(m.path("d/c.bin")) == "err EIO"  # not served from the empty mount-point directory
    s.slowfs = SlowFSProcess(s.real, m.source).start()  # ... and comes back at the same path
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_up") == 1, timeout=SLACK, what="the probe")
    assert metric(m.scrape(), "cubefs_fuse_backend_reconnects_total") == 1
    for name in ("b", "c", "a"):
        assert read(m.path(f"d/{name}.bin")) == ok(files[f"d/{name}.bin"])
    assert m.pid() == pid and "reopened" in m.log()
    m.umount()


# -- stale-if-error: cached files through an outage (docs/contracts.md, "Outages of the source") --

# attrValid and lookupValid of the stale-if-error mounts: short, so that the kernel's and the
# daemon's trust in the cached attributes runs out within the test, while the remote hangs.
TTL = 1.0
STALE_LOG = "cached files are served at the version last validated"


def outage_mount(make_slow_mount: Callable[..., SlowMount], **config: object) -> tuple[SlowMount, dict[str, bytes]]:
    """A mount whose cache holds d/a.bin (one block) and d/big.bin (three) whole, d/b.bin
    only by its attributes; then the remote hangs and every TTL runs out."""
    s, files = prepared(make_slow_mount, {"a": 300_000, "b": 300_000, "big": 5 << 19},
                        attrValid=TTL, lookupValid=TTL, **config)
    for name in ("d/a.bin", "d/big.bin"):
        assert read(s.mount.path(name)) == ok(files[name])
    s.slowfs.hang()
    time.sleep(2 * TTL)
    return s, files


@pytest.mark.expected_daemon_errors(r"backend down: ")
def test_cached_files_are_served_stale_while_the_remote_hangs_and_revalidated_after(
        make_slow_mount: Callable[..., SlowMount]) -> None:
    s, files = outage_mount(make_slow_mount)
    m = s.mount
    try:
        before = m.scrape()
        # The first request past the TTL waits the deadline, then is answered from the cache;
        # the reader drops its pages first, so the daemon serves every byte.
        assert read(m.path("d/a.bin")) == ok(files["d/a.bin"])
        assert read(m.path("d/big.bin")) == ok(files["d/big.bin"])
        samples = m.scrape()
        assert metric(samples, "cubefs_fuse_backend_up") == 0
        # Each file's LOOKUP, answered stale with a timeout of 0 (the kernel asks again at the next open).
        assert metric(samples, "cubefs_fuse_stale_if_error_total", op="lookup") >= 2
        assert (metric(samples, "cubefs_fuse_served_bytes_total", source="ram")
                - metric(before, "cubefs_fuse_served_bytes_total", source="ram")) >= len(files["d/big.bin"])
        assert sorted(os.listdir(m.path("d"))) == ["a.bin", "b.bin", "big.bin"]  # the kept listing
        # A file whose bytes were never read: EIO at once (the backend is down: no new deadline).
        start = time.monotonic()
        assert read(m.path("d/b.bin")) == "err EIO"
        assert time.monotonic() - start < TIMEOUT + SLACK
        assert metric(m.scrape(), "cubefs_fuse_backend_failed_fast_total", op="stat") >= 1
        # Changed at the source during the outage: the version last validated is still served.
        changed = (s.real / "d/a.bin").read_bytes()[::-1] + b"new"
        (s.real / "d/a.bin").write_bytes(changed)
        assert read(m.path("d/a.bin")) == ok(files["d/a.bin"])
        assert m.log().count(STALE_LOG) == 1  # one line per outage, not one per file
    finally:
        s.slowfs.resume()
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_up") == 1, timeout=SLACK, what="the probe")
    stale = {k: v for k, v in m.scrape().items() if k.startswith("cubefs_fuse_stale_if_error_total")}
    # The source's first answer revalidates: the new version, a new inode, new bytes.
    assert read(m.path("d/a.bin")) == ok(changed)
    assert read(m.path("d/big.bin")) == ok(files["d/big.bin"])
    assert read(m.path("d/b.bin")) == ok(files["d/b.bin"])
    assert {k: v for k, v in m.scrape().items() if k.startswith("cubefs_fuse_stale_if_error_total")} == stale
    assert metric(m.scrape(), "cubefs_fuse_file_version_changes_total") >= 1
    m.umount()


@pytest.mark.expected_daemon_errors(r"backend down: ")
def test_with_stale_if_error_off_a_cached_file_gets_eio_past_its_ttl(make_slow_mount: Callable[..., SlowMount]) -> None:
    s, files = outage_mount(make_slow_mount, staleIfError=False)
    m = s.mount
    try:
        assert read(m.path("d/a.bin")) == "err EIO"  # waited for the deadline
        assert read(m.path("d/big.bin")) == "err EIO"  # at once
        samples = m.scrape()
        assert metric(samples, "cubefs_fuse_backend_up") == 0
        assert sum(v for k, v in samples.items() if k.startswith("cubefs_fuse_stale_if_error_total")) == 0
        assert STALE_LOG not in m.log()
    finally:
        s.slowfs.resume()
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_up") == 1, timeout=SLACK, what="the probe")
    assert read(m.path("d/a.bin")) == ok(files["d/a.bin"])
    m.umount()
