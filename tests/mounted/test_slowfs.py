"""tools/slowfs: the emulated remote volume (latency, injected errors, statistics, cleanup)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubefs_fuse import mounts
from tests.emulator_checks import check_latency, check_overlap, mount_dir
from tests.helpers import REPO, wait_until
from tools.slowfs import INODE_SHIFT, STATS_NAME, SlowFSProcess, is_mounted


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "dir" / "sub").mkdir(parents=True)
    (src / "data.bin").write_bytes(os.urandom(300_000))
    (src / "dir" / "eio.bin").write_bytes(b"x" * 100)
    (src / "dir" / "eacces.bin").write_bytes(b"x" * 100)
    (src / "dir" / "enoent.bin").write_bytes(b"x" * 100)
    (src / "dir" / "sub" / "readfail.bin").write_bytes(b"y" * 100)
    (src / "dir" / "ok.txt").write_bytes(b"fine\n")
    os.symlink("ok.txt", src / "dir" / "link")
    return src


@pytest.fixture
def slowfs(tmp_path: Path, source: Path) -> Iterator[SlowFSProcess]:
    fs = SlowFSProcess(
        source, mount_dir(tmp_path, "mnt"),
        fail=["dir/eio.bin=EIO", "dir/eacces.bin=EACCES", "*/enoent.bin=2"],
        fail_read=["*/readfail.bin=EIO"],
    )
    with fs:
        yield fs
    assert not is_mounted(fs.mount_point)


def test_passthrough_content_and_metadata(slowfs: SlowFSProcess, source: Path) -> None:
    mnt = slowfs.mount_point
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(source)) == ["data.bin", "dir"]  # stats file hidden
    assert (mnt / "data.bin").read_bytes() == (source / "data.bin").read_bytes()
    assert (mnt / "dir" / "link").read_bytes() == b"fine\n"
    assert os.readlink(mnt / "dir" / "link") == "ok.txt"
    for rel in ("data.bin", "dir", "dir/link", "dir/ok.txt"):
        a, b = os.lstat(mnt / rel), os.lstat(source / rel)
        assert (a.st_mode, a.st_size, a.st_uid, a.st_gid, a.st_mtime_ns) == (b.st_mode, b.st_size, b.st_uid, b.st_gid, b.st_mtime_ns)
    # Inode numbers follow the source's, so they stay stable even after the kernel forgets them.
    assert os.stat(mnt / "data.bin").st_ino == os.stat(source / "data.bin").st_ino + INODE_SHIFT
    # Changes to SOURCE show at once (cache timeout 0), like a remote without client caching.
    (source / "dir" / "ok.txt").write_bytes(b"changed\n")
    assert (mnt / "dir" / "ok.txt").read_bytes() == b"changed\n"
    (source / "dir" / "ok.txt").unlink()
    assert not (mnt / "dir" / "ok.txt").exists()
    assert os.statvfs(mnt).f_blocks == os.statvfs(source).f_blocks


def test_read_only(slowfs: SlowFSProcess) -> None:
    mnt = slowfs.mount_point
    for action in (lambda: open(mnt / "new", "wb"), lambda: open(mnt / "data.bin", "r+b"),
                   lambda: os.mkdir(mnt / "d2"), lambda: os.unlink(mnt / "data.bin"),
                   lambda: os.chmod(mnt / "data.bin", 0o600)):
        with pytest.raises(OSError) as info:
            action()
        assert info.value.errno == errno.EROFS


def test_injected_errors_and_counts(slowfs: SlowFSProcess) -> None:
    mnt = slowfs.mount_point
    before = slowfs.stats()
    for name, code in (("eio.bin", errno.EIO), ("eacces.bin", errno.EACCES), ("enoent.bin", errno.ENOENT)):
        for _ in range(3):
            with pytest.raises(OSError) as info:
                (mnt / "dir" / name).read_bytes()
            assert info.value.errno == code, name
    # --fail-read: open works, every read fails.
    with open(mnt / "dir" / "sub" / "readfail.bin", "rb", buffering=0) as f:
        with pytest.raises(OSError) as info:
            f.read(10)
        assert info.value.errno == errno.EIO
    assert (mnt / "dir" / "ok.txt").read_bytes() == b"fine\n"  # other files still served
    after = slowfs.stats()
    assert after["injected"]["open"] - before["injected"].get("open", 0) == 9
    assert after["injected"]["read"] == 1
    assert after["errors"]["open"] == {"EIO": 3, "EACCES": 3, "ENOENT": 3}
    assert after["errors"]["read"] == {"EIO": 1}
    # Reading the stats file is no open/read (the kernel may getattr the root to check permissions).
    assert {op: n for op, n in slowfs.stats()["ops"].items() if op != "getattr"} == \
        {op: n for op, n in slowfs.stats()["ops"].items() if op != "getattr"}
    assert after["open_files"] == 0


def test_read_counts_and_bytes(slowfs: SlowFSProcess, source: Path) -> None:
    before = slowfs.stats()
    fd = os.open(slowfs.mount_point / "data.bin", os.O_RDONLY)
    try:
        for offset in (0, 5000, 299_999, 300_000):
            assert os.pread(fd, 4096, offset) == (source / "data.bin").read_bytes()[offset : offset + 4096]
    finally:
        os.close(fd)
    after = slowfs.stats()
    # direct_io: each pread is exactly one FUSE read (the one at EOF included), no readahead.
    assert after["ops"]["read"] - before["ops"].get("read", 0) == 4
    assert after["bytes_read"] - before["bytes_read"] == 4096 + 4096 + 1
    assert after["ops"]["open"] - before["ops"].get("open", 0) == 1
    wait_until(lambda: slowfs.stats()["ops"].get("release", 0) > before["ops"].get("release", 0), what="release")


@pytest.mark.parametrize(("latency_us", "pairs"), [(300, 400), (2000, 100)])
def test_latency_matches_setting(tmp_path: Path, source: Path, latency_us: int, pairs: int) -> None:
    """Slept delay within 10 % of the setting, application-seen within 20 % (emulator_checks)."""
    with SlowFSProcess(source, mount_dir(tmp_path, "slow"), latency_us=latency_us) as slow, \
            SlowFSProcess(source, mount_dir(tmp_path, "fast")) as fast:
        check_latency(slow, fast, "data.bin", latency_us, pairs, name="slowfs")


def test_latency_overlaps_across_threads(tmp_path: Path, source: Path) -> None:
    with SlowFSProcess(source, mount_dir(tmp_path, "slow"), latency_us=20_000) as slow:
        check_overlap(slow, "dir/ok.txt", readers=16, reads_each=5)


def test_stop_unmounts_and_kill_is_cleaned_up(tmp_path: Path, source: Path) -> None:
    mnt = mount_dir(tmp_path, "mnt")
    fs = SlowFSProcess(source, mnt).start()
    assert is_mounted(mnt)
    assert fs.stop() == 0  # SIGTERM: clean unmount, exit 0
    assert not is_mounted(mnt)
    fs = SlowFSProcess(source, mnt).start()
    os.kill(fs.pid, signal.SIGKILL)  # a crash leaves a dead mount ...
    assert fs.stop() == -signal.SIGKILL
    assert not is_mounted(mnt)  # ... that stop() detaches


def test_cli_detaches_and_reports_errors(tmp_path: Path, source: Path) -> None:
    mnt = mount_dir(tmp_path, "mnt")
    run = [sys.executable, "-m", "tools.slowfs"]
    bad = subprocess.run([*run, str(source), str(mnt), "--fail", "x=ENOPE"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "unknown errno 'ENOPE'" in bad.stderr
    missing = subprocess.run([*run, str(tmp_path / "nope"), str(mnt)], capture_output=True, text=True, cwd=REPO)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    result = subprocess.run([*run, str(source), str(mnt), "--latency-us", "100", "--log-file", str(tmp_path / "log")],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout)
    try:
        assert (mnt / STATS_NAME).exists()
        assert (mnt / "dir" / "ok.txt").read_bytes() == b"fine\n"
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
    wait_until(lambda: not mounts.pid_alive(pid), what="slowfs daemon exit")
    assert not is_mounted(mnt)
    assert "unmounted" in (tmp_path / "log").read_text()
