"""cache/holes.py on real files, on the two filesystems at hand: ext4 (tmp_path) and a
tmpfs (/dev/shm).  A filesystem that really cannot punch (a ramfs, mounted: root) is in
tests/mounted/test_disk_tier_full_fs.py."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubefs_fuse.cache import holes
from cubefs_fuse.cache.holes import ALLOCATION_UNIT as UNIT


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on (the longest mount point above it)."""
    best, kind = "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mount_point, fs_type = fields[4], fields[fields.index("-") + 1]
            if (str(path) + "/").startswith(mount_point.rstrip("/") + "/") and len(mount_point) > len(best):
                best, kind = mount_point, fs_type
    return kind


@pytest.fixture(params=["ext4", "tmpfs"])
def directory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "ext4":
        path = tmp_path
        if filesystem_type(path) != "ext4":
            pytest.skip(f"tmp_path is on {filesystem_type(path)}, not ext4")
        yield path
        return
    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_type(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir=shm) as name:
        yield Path(name)


def make_file(path: Path, units: int) -> int:
    """A file of ``units`` allocation units, each filled with a nonzero byte of its own."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"".join(bytes([1 + i % 255]) * UNIT for i in range(units)))
    os.fsync(fd)  # ext4 delays allocation: extents (and SEEK_DATA's answers) once written
    return fd


def test_punch_frees_a_range_in_place(directory: Path) -> None:
    fd = make_file(directory / "seg", 4)
    try:
        before = os.fstat(fd).st_blocks
        holes.punch(fd, UNIT, 2 * UNIT)
        st = os.fstat(fd)
        assert st.st_size == 4 * UNIT  # the size and the other units stay
        assert (before - st.st_blocks) * 512 == 2 * UNIT  # exactly the two units went back
        assert os.pread(fd, 4 * UNIT, 0) == bytes([1]) * UNIT + bytes(2 * UNIT) + bytes([4]) * UNIT
    finally:
        os.close(fd)


def test_punch_reports_the_errno(directory: Path) -> None:
    fd = os.open(directory / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as raised:
            holes.punch(fd, 0, UNIT)  # a read-only descriptor: fallocate says EBADF
        assert raised.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_data_ranges_of_a_file_with_holes(directory: Path) -> None:
    fd = make_file(directory / "seg", 8)
    try:
        assert list(holes.data_ranges(fd)) == [(0, 8 * UNIT)]
        holes.punch(fd, UNIT, UNIT)
        holes.punch(fd, 3 * UNIT, 2 * UNIT)
        holes.punch(fd, 7 * UNIT, UNIT)  # a hole up to the end: no range, no error (ENXIO)
        assert list(holes.data_ranges(fd)) == [(0, UNIT), (2 * UNIT, 3 * UNIT), (5 * UNIT, 7 * UNIT)]
        holes.punch(fd, 0, 8 * UNIT)
        assert list(holes.data_ranges(fd)) == []
    finally:
        os.close(fd)


def test_data_ranges_of_empty_and_sparse_files(directory: Path) -> None:
    fd = os.open(directory / "empty", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert list(holes.data_ranges(fd)) == []
        os.ftruncate(fd, 64 * UNIT)  # all hole
        assert list(holes.data_ranges(fd)) == []
        os.pwrite(fd, b"x", 40 * UNIT + 5)  # data in the middle: its unit
        os.fsync(fd)
        assert list(holes.data_ranges(fd)) == [(40 * UNIT, 41 * UNIT)]
    finally:
        os.close(fd)


def test_data_ranges_are_looked_up_as_they_are_consumed(directory: Path) -> None:
    # A scan punches what lies before the range it is walking: the next range is found
    # from where the previous one ended, after those punches.
    fd = make_file(directory / "seg", 6)
    try:
        holes.punch(fd, UNIT, UNIT)
        ranges = holes.data_ranges(fd)
        assert next(ranges) == (0, UNIT)
        holes.punch(fd, 0, UNIT)  # behind: changes nothing ahead
        holes.punch(fd, 3 * UNIT, UNIT)  # ahead: seen
        assert list(ranges) == [(2 * UNIT, 3 * UNIT), (4 * UNIT, 6 * UNIT)]
    finally:
        os.close(fd)


def test_data_ranges_raise_other_errors() -> None:
    with pytest.raises(OSError) as raised:
        list(holes.data_ranges(-1))  # not taken for the end of the data
    assert raised.value.errno == errno.EBADF


def test_can_punch_probes_and_leaves_nothing(directory: Path) -> None:
    assert holes.can_punch(str(directory))
    assert os.listdir(directory) == []
    # A probe a crash left behind is reused, not a reason to fail.
    (directory / holes.PROBE_NAME).write_bytes(b"left by a crash")
    assert holes.can_punch(str(directory))
    assert os.listdir(directory) == []


def test_can_punch_says_no_only_when_the_filesystem_cannot(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(code: int) -> None:
        def punch(fd: int, offset: int, length: int) -> None:
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(holes, "punch", punch)

    for code in (errno.EOPNOTSUPP, errno.ENOSYS):
        refused(code)
        assert not holes.can_punch(str(directory))
        assert os.listdir(directory) == []
    refused(errno.EIO)  # not an answer about the filesystem: the caller hears of it
    with pytest.raises(OSError) as raised:
        holes.can_punch(str(directory))
    assert raised.value.errno == errno.EIO and os.listdir(directory) == []
    with pytest.raises(FileNotFoundError):
        holes.can_punch(str(directory / "missing"))
