"""tools/slowfs_c: the C emulated remote (build, passthrough, latency, EROFS, statistics, shutdown).

It runs through :class:`benchmarks.suite.remote.SlowFSCProcess`, the way the benchmark
suite runs it, so these tests also hold the suite's glue to the binary's command line and
start-up report.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.suite.remote import SLOWFS_C_BUILD, RemoteStats, SlowFSCProcess
from cubefs_fuse import mounts
from tests.emulator_checks import check_latency, check_overlap, emulator_options, mount_dir
from tests.helpers import stat_tree, wait_until
from tools.slowfs import INODE_SHIFT, STATS_NAME, is_mounted

BLOCK = 128 * 1024  # the kernel's largest FUSE read without max_pages negotiation: boundary sizes


@pytest.fixture(scope="module")
def binary() -> Path:
    """The built binary.  A missing compiler or libfuse3-dev fails (scripts/setup.sh installs them)."""
    done = subprocess.run([str(SLOWFS_C_BUILD)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"tools/slowfs_c/build.sh failed (run scripts/setup.sh): {done.stderr}"
    path = Path(done.stdout.strip().splitlines()[-1])
    assert os.access(path, os.X_OK), path
    return path


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "a" / "b" / "c").mkdir(parents=True)
    (src / "empty").mkdir()
    files = {
        "zero.bin": b"",
        "one.bin": b"x",
        "a/block-1.bin": os.urandom(BLOCK - 1),
        "a/block.bin": os.urandom(BLOCK),
        "a/block+1.bin": os.urandom(BLOCK + 1),
        "a/b/multi.bin": os.urandom(3 * BLOCK + 12345),
        "a/b/c/deep.txt": b"deep\n",
        "a/b/c/eio.bin": b"e" * 100,
        "a/b/c/readfail.bin": b"r" * 100,
    }
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    os.chmod(src / "one.bin", 0o600)
    os.symlink("b/c/deep.txt", src / "a" / "link")
    os.symlink("/nonexistent/target", src / "dangling")
    return src


def _process(binary: Path, source: Path, mount_point: Path, **changes: float) -> SlowFSCProcess:
    return SlowFSCProcess(binary, source, mount_point, **emulator_options(**changes))


@pytest.fixture
def slowfs(binary: Path, tmp_path: Path, source: Path) -> Iterator[SlowFSCProcess]:
    fs = _process(binary, source, mount_dir(tmp_path, "mnt"))
    fs.argv += ["--fail=*/eio.bin=EIO", "--fail-read=*/readfail.bin=eio"]
    with fs:
        yield fs
    assert not is_mounted(fs.mount_point)


def test_build_is_idempotent(binary: Path) -> None:
    before = os.stat(binary)
    done = subprocess.run([str(SLOWFS_C_BUILD)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == binary
    after = os.stat(binary)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rebuilt


def test_passthrough_is_byte_identical(slowfs: SlowFSCProcess, source: Path) -> None:
    mnt = slowfs.mount_point
    seen, want = stat_tree(mnt), stat_tree(source)
    assert sorted(seen) == sorted(want)  # every name, nested; the stats file is not listed
    assert STATS_NAME not in os.listdir(mnt)
    for rel, b in want.items():
        a = seen[rel]
        assert (a.st_mode, a.st_size, a.st_uid, a.st_gid, a.st_mtime_ns, a.st_nlink) == \
            (b.st_mode, b.st_size, b.st_uid, b.st_gid, b.st_mtime_ns, b.st_nlink), rel
        # Inode numbers follow the source's: stable even after the kernel forgets them.
        assert a.st_ino == b.st_ino + INODE_SHIFT, rel
        if os.path.islink(source / rel):
            assert os.readlink(mnt / rel) == os.readlink(source / rel)
        elif os.path.isfile(source / rel) and not rel.endswith(("eio.bin", "readfail.bin")):
            data = (source / rel).read_bytes()
            assert (mnt / rel).read_bytes() == data, rel
            fd = os.open(mnt / rel, os.O_RDONLY)
            try:  # random offsets and sizes, across the 128 KiB read boundary and past EOF
                rng = random.Random(rel)
                for _ in range(20):
                    offset, size = rng.randrange(len(data) + 2), rng.choice((1, 4095, BLOCK - 1, BLOCK + 1))
                    assert os.pread(fd, size, offset) == data[offset : offset + size], (rel, offset, size)
            finally:
                os.close(fd)
    assert (mnt / "a" / "link").read_bytes() == b"deep\n"  # the kernel follows the symlink through us
    assert os.statvfs(mnt).f_blocks == os.statvfs(source).f_blocks
    # SOURCE changes show at once (cache timeout 0), like a remote without client caching.
    (source / "a" / "b" / "c" / "deep.txt").write_bytes(b"changed\n")
    assert (mnt / "a" / "link").read_bytes() == b"changed\n"
    (source / "one.bin").unlink()
    assert not (mnt / "one.bin").exists()


def test_read_only(slowfs: SlowFSCProcess) -> None:
    mnt = slowfs.mount_point
    for action in (lambda: open(mnt / "new", "wb"), lambda: open(mnt / "a" / "block.bin", "r+b"),
                   lambda: open(mnt / "a" / "block.bin", "ab"), lambda: os.mkdir(mnt / "d2"),
                   lambda: os.unlink(mnt / "zero.bin"), lambda: os.rmdir(mnt / "empty"),
                   lambda: os.rename(mnt / "zero.bin", mnt / "z"), lambda: os.symlink("x", mnt / "s"),
                   lambda: os.chmod(mnt / "zero.bin", 0o600), lambda: os.truncate(mnt / "one.bin", 0)):
        with pytest.raises(OSError) as info:
            action()
        assert info.value.errno == errno.EROFS
    assert (mnt / "one.bin").read_bytes() == b"x"


def test_statistics_count_operations(slowfs: SlowFSCProcess, source: Path) -> None:
    mnt = slowfs.mount_point
    raw = slowfs.stats()
    assert raw["implementation"] == "c" and raw["pid"] == slowfs.pid and raw["source"] == str(source)
    before = RemoteStats.of(raw)  # the fields the suite reads are there
    data = (source / "a" / "b" / "multi.bin").read_bytes()
    fd = os.open(mnt / "a" / "b" / "multi.bin", os.O_RDONLY)
    try:
        for offset in (0, 5000, len(data) - 1, len(data)):
            assert os.pread(fd, 4096, offset) == data[offset : offset + 4096]
    finally:
        os.close(fd)
    after = slowfs.stats()
    # direct_io: each pread is exactly one FUSE read (the one at EOF included), no readahead.
    assert after["ops"]["read"] - raw["ops"].get("read", 0) == 4
    assert after["bytes_read"] - raw["bytes_read"] == 4096 + 4096 + 1
    assert after["ops"]["open"] - raw["ops"].get("open", 0) == 1
    # lookups of a, b and multi.bin (entry timeout 0: every component is asked again)
    assert after["ops"]["lookup"] - raw["ops"].get("lookup", 0) >= 3
    wait_until(lambda: slowfs.stats()["ops"].get("release", 0) == raw["ops"].get("release", 0) + 1,
               what="release counted")
    delta = RemoteStats.of(slowfs.stats()).minus(before)
    assert delta.reads == 4 and delta.bytes == 4096 + 4096 + 1
    # Errors: a missing name, injected open and read errors; other files are still served.
    assert not (mnt / "a" / "missing").exists()
    for _ in range(3):
        with pytest.raises(OSError) as info:
            (mnt / "a" / "b" / "c" / "eio.bin").read_bytes()
        assert info.value.errno == errno.EIO
    with open(mnt / "a" / "b" / "c" / "readfail.bin", "rb", buffering=0) as f:
        with pytest.raises(OSError) as info:
            f.read(10)
        assert info.value.errno == errno.EIO
    assert (mnt / "a" / "b" / "c" / "deep.txt").read_bytes() == b"deep\n"
    final = slowfs.stats()
    assert final["errors"]["lookup"]["ENOENT"] >= 1
    assert final["errors"]["open"] == {"EIO": 3} and final["injected"]["open"] == 3
    assert final["errors"]["read"] == {"EIO": 1} and final["injected"]["read"] == 1
    # Reading the statistics file is no remote operation (but the kernel may getattr the root).
    first, second = slowfs.stats(), slowfs.stats()
    assert {k: v for k, v in first["ops"].items() if k != "getattr"} == \
        {k: v for k, v in second["ops"].items() if k != "getattr"}
    wait_until(lambda: slowfs.stats()["open_files"] == 0, what="every file released")
    assert json.loads((mnt / STATS_NAME).read_bytes())["max_concurrent"] >= 1


@pytest.mark.parametrize(("latency_us", "pairs"), [(300, 400), (2000, 100)])
def test_latency_matches_setting(binary: Path, tmp_path: Path, source: Path, latency_us: int, pairs: int) -> None:
    """Slept delay within 10 % of the setting, application-seen within 20 % (emulator_checks); reading
    the stats file adds at most the root's getattr per round."""
    with _process(binary, source, mount_dir(tmp_path, "slow"), latency_us=latency_us) as slow, \
            _process(binary, source, mount_dir(tmp_path, "fast")) as fast:
        check_latency(slow, fast, "a/block.bin", latency_us, pairs, name="slowfs-c", max_extra_delays=2)


def test_latency_overlaps_across_threads(binary: Path, tmp_path: Path, source: Path) -> None:
    """32 readers wait out their delays together; libfuse's default of 10 threads would not."""
    with _process(binary, source, mount_dir(tmp_path, "slow"), latency_us=20_000) as slow:
        check_overlap(slow, "a/b/c/deep.txt", readers=32, reads_each=3)


def test_a_signal_inherited_as_ignored_still_ends_it(binary: Path, tmp_path: Path, source: Path) -> None:
    """A background job of a non-interactive shell (``cmd &`` in a script, as a CI runner may
    start the tests) has SIGINT ignored, and so has everything it starts.  libfuse's own
    handlers leave an ignored signal ignored: the daemon outlived its SIGINT with the mount
    live, every time.  slowfs-c takes the exit signals itself, whatever it inherited."""
    mnt = mount_dir(tmp_path, "mnt")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous = signal.signal(sig, signal.SIG_IGN)  # inherited by the daemon started now
        try:
            fs = _process(binary, source, mnt, latency_us=2000).start()
        finally:
            signal.signal(sig, previous)
        assert fs.proc is not None
        try:
            fs.proc.send_signal(sig)
            assert fs.proc.wait(10) == 0
        finally:
            fs.stop()
        assert not is_mounted(mnt)


def test_shutdown_on_signals_and_detached_mode(binary: Path, tmp_path: Path, source: Path) -> None:
    mnt = mount_dir(tmp_path, "mnt")
    for sig in (signal.SIGTERM, signal.SIGINT):
        fs = _process(binary, source, mnt, latency_us=2000).start()
        assert is_mounted(mnt)
        held = os.open(mnt / "a" / "block.bin", os.O_RDONLY)  # an open file does not keep it mounted
        try:
            assert fs.proc is not None
            fs.proc.send_signal(sig)
            assert fs.proc.wait(10) == 0  # a clean exit, not death by the signal
        finally:
            with contextlib.suppress(OSError):  # ENOTCONN: the flush finds the daemon gone; the fd is closed
                os.close(held)
            fs.stop()  # (nothing when it exited; one that did not is not left behind with its mount)
        assert not is_mounted(mnt)
    # A crash leaves a dead mount that stop() detaches.
    fs = _process(binary, source, mnt).start()
    os.kill(fs.pid, signal.SIGKILL)
    assert fs.stop() == -signal.SIGKILL
    assert not is_mounted(mnt)
    # Without --foreground it detaches, returns once the mount is live and prints the pid.
    bad = subprocess.run([str(binary), str(source), str(mnt), "--fail", "x=ENOPE"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown errno 'ENOPE'" in bad.stderr
    missing = subprocess.run([str(binary), str(tmp_path / "nope"), str(mnt)], capture_output=True, text=True)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    log = tmp_path / "log"
    result = subprocess.run([str(binary), str(source), str(mnt), "--latency-us", "100", "--log-file", str(log)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout)
    try:
        assert (mnt / "a" / "b" / "c" / "deep.txt").read_bytes() == b"deep\n"
        assert json.loads((mnt / STATS_NAME).read_bytes())["pid"] == pid
    finally:
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not is_mounted(mnt), what="the detached daemon's unmount")
    wait_until(lambda: not mounts.pid_alive(pid), what="the detached daemon's exit")
    assert "unmounted" in log.read_text()
