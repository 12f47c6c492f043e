"""LocalDirBackend.listdir over a real directory: a listing larger than one chunk reads its
entries' attributes in parallel chunks and still answers exactly what one ``scandir`` +
``lstat`` per entry would (tests/mounted/test_cold_metadata.py shows the overlap on a slow
remote)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cubefs_fuse.attrs import Attr
from cubefs_fuse.backends.localdir import LISTDIR_CHUNK, LocalDirBackend


def serial_listing(directory: Path) -> dict[str, Attr]:
    return {e.name: Attr.from_stat(e.stat(follow_symlinks=False)) for e in os.scandir(directory)}


async def test_a_listing_in_parallel_chunks_is_the_serial_listing(tmp_path: Path) -> None:
    root = tmp_path / "source"
    big, small = root / "big", root / "small"
    big.mkdir(parents=True)
    small.mkdir()
    for i in range(3 * LISTDIR_CHUNK + 5):  # four chunks, the last one short
        (big / f"f{i:03d}").write_bytes(b"x" * i)
    (big / "sub").mkdir()
    os.symlink("f001", big / "link")  # served as a symlink, never followed
    os.symlink("/etc/passwd", big / "outside")
    (small / "only").write_bytes(b"1")
    backend = LocalDirBackend(str(root), 4)
    try:
        assert dict(await backend.listdir("big")) == serial_listing(big)
        assert dict(await backend.listdir("small")) == serial_listing(small)  # one chunk: in the scan's own call
        assert dict(await backend.listdir("")) == serial_listing(root)
        listed = dict(await backend.listdir("big"))
        assert listed["link"].is_symlink and listed["outside"].is_symlink and listed["sub"].is_dir
        assert backend.statistics().operations == {"listdir": 4}  # one operation per listing
    finally:
        backend.close()


async def test_a_listing_past_its_limit_stops_before_any_attribute_is_read(tmp_path: Path) -> None:
    """``limit``: a directory of more names raises E2BIG, counted as a listing but not as an
    error, with no entry stat'ed; one within it is listed whole."""
    root = tmp_path / "source"
    (root / "d").mkdir(parents=True)
    for i in range(5):
        (root / "d" / f"f{i}").write_bytes(b"x")
    backend = LocalDirBackend(str(root), 4)
    try:
        with pytest.raises(OSError) as raised:
            await backend.listdir("d", limit=4)
        assert raised.value.errno == errno.E2BIG
        assert len(await backend.listdir("d", limit=5)) == 5
        stats = backend.statistics()
        assert stats.operations == {"listdir": 2} and not stats.errors
    finally:
        backend.close()
