"""Mounted: the FUSE requests a kernel page-cache hit costs the daemon (docs/contracts.md,
"The kernel page cache"), counted by the kernel itself.

Once a file's pages and its dentry and attributes are cached, an open/read/close reaches
the daemon as no request at all: no LOOKUP or GETATTR (entry and attribute timeouts), no
OPEN or RELEASE (the first OPEN is answered ``ENOSYS``: the kernel's ``no_open`` mode for
the connection, pages kept across opens), no READ, no FLUSH (answered ``ENOSYS`` once,
which the kernel remembers too), no GETXATTR.  Python's ``open()`` adds one IOCTL (its
``isatty`` check, ``TCGETS``), which the C session answers ``ENOTTY`` without Python; the
kernel forwards every ioctl of a FUSE file, so that one is the reader's, not avoidable here.

The counts come from the kernel's ``fuse:fuse_request_send`` tracepoint in a private
tracefs instance filtered on this mount's connection, so concurrent tracing elsewhere does
not disturb them.  A kernel without the tracepoint (older kernels) skips these tests.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import Mount

FILES = 24
SIZE = 8192  # two pages: small enough that nothing evicts them during the test


@contextmanager
def _tracefs() -> Iterator[Path]:
    """The tracefs root: the system's, or a private mount removed afterwards."""
    for candidate in (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing")):
        if (candidate / "instances").is_dir():
            yield candidate
            return
    mount_point = Path(tempfile.mkdtemp(prefix="cubefs-tracefs-"))
    try:
        if subprocess.run(["mount", "-t", "tracefs", "nodev", str(mount_point)], capture_output=True).returncode:
            pytest.skip("tracefs cannot be mounted here")
        try:
            yield mount_point
        finally:
            subprocess.run(["umount", str(mount_point)], check=False)
    finally:
        mount_point.rmdir()


@contextmanager
def _counting(m: Mount) -> Iterator[collections.Counter[str]]:
    """Counts, by opcode name, the requests the kernel sends to ``m``'s daemon in the block."""
    connection = os.minor(os.stat(m.mount_point).st_dev)
    with _tracefs() as root:
        if not (root / "events" / "fuse" / "fuse_request_send").is_dir():
            pytest.skip("this kernel has no fuse:fuse_request_send tracepoint")
        instance = root / "instances" / f"cubefs-requests-{os.getpid()}-{connection}"
        instance.mkdir()
        try:
            event = instance / "events" / "fuse" / "fuse_request_send"
            (event / "filter").write_text(f"connection == {connection}\n")
            (instance / "buffer_size_kb").write_text("1024\n")  # ~10,000 events: far above the test's
            counts: collections.Counter[str] = collections.Counter()
            (event / "enable").write_text("1\n")
            try:
                yield counts
            finally:
                (event / "enable").write_text("0\n")
            trace = (instance / "trace").read_text()
            assert "LOST" not in trace, "the trace buffer overflowed"
            counts.update(re.findall(r"\(FUSE_(\w+)\)", trace))
        finally:
            instance.rmdir()


def _fill(m: Mount) -> dict[str, bytes]:
    files = {}
    for i in range(FILES):
        name = f"c{i % 3}/img_{i:03d}.jpg"
        (m.source / name).parent.mkdir(exist_ok=True)
        files[name] = os.urandom(SIZE)
        (m.source / name).write_bytes(files[name])
    return files


def _os_read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        while chunk := os.read(fd, 1 << 16):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def test_a_page_cache_hit_costs_the_daemon_no_request(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    files = _fill(m)
    m.mount()
    try:
        for name, data in files.items():  # cold: lookups, reads, the connection's one FLUSH
            assert _os_read(m.path(name)) == data
        with _counting(m) as counts:
            for name, data in files.items():
                assert _os_read(m.path(name)) == data
        assert dict(counts) == {}
    finally:
        m.umount()


def test_pythons_open_adds_only_its_isatty_ioctl(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    files = _fill(m)
    m.mount()
    try:
        for name, data in files.items():
            assert m.path(name).read_bytes() == data
        with _counting(m) as counts:
            for name, data in files.items():
                with open(m.path(name), "rb") as f:  # as a DataLoader's image loader opens
                    assert f.read() == data
        ioctls = counts.pop("IOCTL", 0)
        assert dict(counts) == {}
        assert ioctls <= FILES  # Python < 3.14: one TCGETS per open; later: none
    finally:
        m.umount()


def test_the_first_open_and_close_turn_open_and_flush_off_for_the_connection(
        make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    files = _fill(m)
    m.mount()
    try:
        with _counting(m) as counts:
            for name, data in files.items():
                assert _os_read(m.path(name)) == data
        # Each answered ENOSYS: the kernel never sends another (nor a RELEASE: no_open).
        assert counts["FLUSH"] == 1 and counts["OPEN"] == 1 and counts["RELEASE"] == 0
        assert counts["LOOKUP"] >= FILES and counts["READ"] >= FILES  # the cold files were read
    finally:
        m.umount()
