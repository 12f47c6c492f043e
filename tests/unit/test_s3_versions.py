"""The S3 backend's mapping of objects to attributes and versions (backends/s3.py) and of
HTTP statuses to errno values (errors.py): no server needed."""

from __future__ import annotations

import errno
import stat
from datetime import datetime, timedelta, timezone

from cubefs_fuse.backends.s3 import etag_ino, object_attr, prefix_attr
from cubefs_fuse.errors import errno_of_http

WHEN = datetime(2026, 11, 29, 4, 30, 15, 250_000, tzinfo=timezone.utc)


def test_a_changed_etag_is_a_new_version_whatever_else_stays() -> None:
    one = object_attr(110_000, WHEN, '"5eb63bbbe01eeed093cb22bb8f5acdc3"')
    assert one.version == object_attr(110_000, WHEN, "5eb63bbbe01eeed093cb22bb8f5acdc3").version  # quotes or not
    assert one.version != object_attr(110_000, WHEN, '"0eb63bbbe01eeed093cb22bb8f5acdc3"').version
    assert one.version != object_attr(110_001, WHEN, '"5eb63bbbe01eeed093cb22bb8f5acdc3"').version
    assert 0 <= etag_ino('"5eb63bbbe01eeed093cb22bb8f5acdc3"') < 1 << 63  # packed as a signed int64


def test_last_modified_counts_in_whole_seconds() -> None:
    """HEAD answers carry seconds, listings milliseconds: one object, one version."""
    listed = object_attr(5, WHEN, '"e"')
    headed = object_attr(5, WHEN.replace(microsecond=0), '"e"')
    assert listed.version == headed.version and listed.mtime_ns == 1795926615 * 10**9
    assert object_attr(5, WHEN + timedelta(seconds=1), '"e"').version != listed.version


def test_files_and_directories_are_read_only() -> None:
    f = object_attr(1000, WHEN, '"e"')
    assert stat.S_ISREG(f.mode) and stat.S_IMODE(f.mode) == 0o444 and f.blocks == 2 and f.nlink == 1
    d = prefix_attr("train/", 10**18)
    assert stat.S_ISDIR(d.mode) and stat.S_IMODE(d.mode) == 0o555 and d.mtime_ns == 10**18 and d.nlink == 1


def test_http_statuses_map_to_errno() -> None:
    assert [errno_of_http(s) for s in (404, 403, 401, 416, 500, 503, 400, None)] == [
        errno.ENOENT, errno.EACCES, errno.EACCES, errno.EINVAL, errno.EIO, errno.EIO, errno.EIO, errno.EIO]
