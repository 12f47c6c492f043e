"""Mounted: errors of the remote (a tools/slowfs mount with injected failures) reach the
application as their errno, are counted and logged once per file, and nothing else breaks."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from cubefs_fuse import mounts
from tests.helpers import SlowMount, metric

FAIL_OPEN = ("bad/eio.bin=EIO", "bad/eacces.bin=EACCES")  # the remote refuses to open these
FAIL_READ = ("bad/readfail.bin=EIO",)  # opens, then every read fails
REPEATS = 20
GOOD = 30


def _expect_errno(path: Path, code: int) -> None:
    with pytest.raises(OSError) as info:
        path.read_bytes()
    assert info.value.errno == code, f"{path}: {info.value!r}"


@pytest.fixture
def remote(make_slow_mount: Callable[..., SlowMount]) -> tuple[SlowMount, dict[str, bytes]]:
    s = make_slow_mount(fail=FAIL_OPEN, fail_read=FAIL_READ, blockSize="64KiB")
    rng = random.Random(7)
    good = {}
    (s.real / "good").mkdir()
    (s.real / "bad").mkdir()
    for i in range(GOOD):
        good[f"good/{i:02d}.bin"] = rng.randbytes(rng.randint(1, 200_000))
        (s.real / f"good/{i:02d}.bin").write_bytes(good[f"good/{i:02d}.bin"])
    for name in ("eio.bin", "eacces.bin", "readfail.bin", "gone.bin"):
        (s.real / "bad" / name).write_bytes(b"never served " * 100)
    s.mount.mount()
    return s, good


def _read_good(job: tuple[str, dict[str, bytes]]) -> list[str]:
    mount, good = job
    return [rel for rel, data in good.items() if Path(mount, rel).read_bytes() != data]


def test_backend_errors_reach_the_application_and_the_rest_is_served(
        remote: tuple[SlowMount, dict[str, bytes]]) -> None:
    s, good = remote
    m = s.mount
    # A file that vanishes at the source after the daemon cached its attributes (attrValid
    # is the default 30 s): the kernel and the daemon still know it, the remote does not.
    # Known by a listing: a lookup would have brought the small file whole (docs/contracts.md,
    # "The lean path") and its bytes would be served.
    assert "gone.bin" in os.listdir(m.path("bad"))
    assert m.path("bad/gone.bin").stat().st_size == 1300
    (s.real / "bad" / "gone.bin").unlink()
    cases = {"bad/eio.bin": errno.EIO, "bad/eacces.bin": errno.EACCES, "bad/readfail.bin": errno.EIO,
             "bad/gone.bin": errno.ENOENT}
    # Failing reads interleaved with good ones, while other processes read the good files.
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pending = pool.map_async(_read_good, [(str(m.mount_point), good)] * 2)
        for rel, code in cases.items():
            _expect_errno(m.path(rel), code)
            first_good = sorted(good)[len(rel) % GOOD]
            assert m.path(first_good).read_bytes() == good[first_good]
        assert pending.get(timeout=60) == [[], []]
    assert mounts.pid_alive(m.pid())
    # The daemon and the remote agree on every failure: each one the remote answered with
    # an error is counted once by the daemon, under the operation and errno name.
    remote_errors = s.slowfs.stats()["errors"]
    samples = m.scrape()
    eio = metric(samples, "cubefs_fuse_backend_errors_total", op="read", errno="EIO")
    eacces = metric(samples, "cubefs_fuse_backend_errors_total", op="read", errno="EACCES")
    enoent = metric(samples, "cubefs_fuse_backend_errors_total", op="read", errno="ENOENT")
    assert eio == remote_errors["open"]["EIO"] + remote_errors["read"]["EIO"] >= 2
    assert eacces == remote_errors["open"]["EACCES"] >= 1
    assert enoent >= 1  # the remote's lookup said ENOENT, so the daemon's open of it failed
    # Everything still reads correctly afterwards, in this process too.
    for rel, data in good.items():
        assert m.path(rel).read_bytes() == data
    m.umount()


def test_error_logged_once_per_file_and_counted_every_time(remote: tuple[SlowMount, dict[str, bytes]]) -> None:
    s, good = remote
    m = s.mount
    failing = {"bad/eio.bin": errno.EIO, "bad/eacces.bin": errno.EACCES, "bad/readfail.bin": errno.EIO}
    for _ in range(REPEATS):
        for rel, code in failing.items():
            _expect_errno(m.path(rel), code)
    samples = m.scrape()
    counted = sum(metric(samples, "cubefs_fuse_backend_errors_total", op="read", errno=name) for name in ("EIO", "EACCES"))
    # Every application read reached the remote again (errors are not cached) and was counted.
    assert counted >= REPEATS * len(failing)
    log = m.log()
    for rel in failing:
        lines = [line for line in log.splitlines() if repr(rel) in line and "failed" in line]
        assert len(lines) == 1, f"{rel} logged {len(lines)} times:\n" + "\n".join(lines[:5])
    assert m.path("good/00.bin").read_bytes() == good["good/00.bin"]
    m.umount()
