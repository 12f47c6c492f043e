"""The sample store's segment files (cubefs_fuse/samples/files.py) and the page cache.

Page-aligned payloads (the data connection's ring) are written and read with O_DIRECT:
the segment's pages never enter the page cache (checked with mincore).  Payloads that are
not aligned, and filesystems that refuse O_DIRECT, go through the page cache with the
same bytes on disk.  Entries of the previous format (2) are still scanned and read."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubefs_fuse.cache.segments import Release
from cubefs_fuse.samples import checksum, files
from tests.helpers import resident_pages

UID = 1000
SIZES = (150_528, 4096, 1, 0, 8192 + 17)  # an image, whole blocks, a byte, nothing, a partial last block


@pytest.fixture(autouse=True)
def fresh_flag(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(files, "_direct_refused", False)  # each test finds out for itself
    yield


def ring_views(sizes: tuple[int, ...]) -> list[tuple[int, memoryview]]:
    """Payloads at page boundaries of an anonymous shared mapping, as the ring's slots are."""
    slot = [-(-max(size, 1) // 4096) * 4096 for size in sizes]
    ring = mmap.mmap(-1, sum(slot))
    views = []
    offset = 0
    for key, (size, room) in enumerate(zip(sizes, slot)):
        ring[offset:offset + size] = bytes([key + 1]) * size
        views.append((key, memoryview(ring)[offset:offset + size]))
        offset += room
    return views


def wanted(views: list[tuple[int, memoryview]], segment: int = 0) -> list[tuple[int, int, int, int]]:
    offsets = files.layout([len(v) for _, v in views])
    return [(key, segment, offset, len(v)) for (key, v), offset in zip(views, offsets)]


def test_aligned_payloads_bypass_the_page_cache_both_ways(tmp_path: Path) -> None:
    views = ring_views(SIZES)
    result = files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0)
    assert result.written == [True] and not files._direct_refused
    segment = Path(files.segment_path(str(tmp_path), UID, "c", 0))
    assert segment.stat().st_size == sum(files.span(size) for size in SIZES)
    assert resident_pages(segment) == 0  # written straight from the ring to the disk
    got = files.read_entries(str(tmp_path), UID, "c", wanted(views))
    assert got == [bytes(v) for _, v in views]
    assert resident_pages(segment) == 0  # read the same way
    # A restart finds them all, each where its head block says.
    found, junk = files.scan(str(tmp_path))
    assert junk == 0
    assert sorted((f.key, f.payload, f.offset, f.span) for f in found) == sorted(
        (key, size, offset, files.span(size)) for (key, _, offset, size) in wanted(views))


def test_unaligned_payloads_are_written_through_the_page_cache_alike(tmp_path: Path) -> None:
    views = [(key, bytes([key + 1]) * size) for key, size in enumerate(SIZES)]  # bytes: not page-aligned
    aligned = tmp_path / "aligned"
    aligned.mkdir()
    assert files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0).written == [True]
    assert files.write_segments(str(aligned), UID, "c", [(0, ring_views(SIZES))], Release(), 0.0).written == [True]
    segment = Path(files.segment_path(str(tmp_path), UID, "c", 0))
    assert resident_pages(segment) > 0  # the page cache has them
    # The same bytes on disk either way (the format does not depend on the path).
    assert segment.read_bytes() == Path(files.segment_path(str(aligned), UID, "c", 0)).read_bytes()
    got = files.read_entries(str(tmp_path), UID, "c", wanted([(k, memoryview(v)) for k, v in views]))
    assert got == [v for _, v in views]


def test_a_filesystem_without_o_direct_gets_page_cache_writes_and_reads(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real_open, real_fcntl = os.open, fcntl.fcntl
    refused: list[str] = []

    def no_direct_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            refused.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    def no_direct_fcntl(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            refused.append("fcntl")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(os, "open", no_direct_open)
    monkeypatch.setattr(fcntl, "fcntl", no_direct_fcntl)
    views = ring_views(SIZES)
    assert files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0).written == [True]
    assert refused == ["open"] and files._direct_refused  # asked once, then never again
    assert files.write_segments(str(tmp_path), UID, "c", [(1, views)], Release(), 0.0).written == [True]
    assert files.read_entries(str(tmp_path), UID, "c", wanted(views, 1)) == [bytes(v) for _, v in views]
    assert refused == ["open"]
    assert resident_pages(Path(files.segment_path(str(tmp_path), UID, "c", 1))) > 0


def test_a_direct_write_the_filesystem_refuses_is_written_again_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_writev = os.writev
    calls: list[bool] = []

    def refusing_writev(fd: int, buffers: list[bytes | memoryview]) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        calls.append(direct)
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", refusing_writev)
    views = ring_views(SIZES)
    assert files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0).written == [True]
    assert calls[0] and not any(calls[1:]) and files._direct_refused
    assert files.read_entries(str(tmp_path), UID, "c", wanted(views)) == [bytes(v) for _, v in views]


def test_entries_of_the_previous_format_are_scanned_read_and_freed(tmp_path: Path) -> None:
    """Format 2: the payload right after the header and name, the next entry at the next
    4 KiB boundary (what earlier versions wrote)."""
    name = b"c"
    payloads = {7: b"\x07" * 5000, 8: b"\x08" * 100}
    blob = b""
    offsets = {}
    for key, payload in payloads.items():
        offsets[key] = len(blob)
        h = checksum.entry_digest(UID, name, key, payload)
        head = struct.pack("<4sHHIqQQ", b"CFSM", 2, len(name), UID, key, len(payload), h) + name
        raw = head + payload
        blob += raw + bytes(-len(raw) % files.ALIGN)
    segment = Path(files.segment_path(str(tmp_path), UID, "c", 3))
    segment.parent.mkdir(parents=True)
    segment.write_bytes(blob)
    found, junk = files.scan(str(tmp_path))
    assert junk == 0
    spans = {f.key: (f.offset, f.payload, f.span) for f in found}
    assert spans == {7: (0, 5000, 8192), 8: (8192, 100, 4096)}
    got = files.read_entries(str(tmp_path), UID, "c", [(k, 3, offsets[k], len(p)) for k, p in payloads.items()])
    assert got == list(payloads.values())
    # Damage in a format-2 payload is caught as before.
    with open(segment, "r+b") as f:
        f.seek(offsets[7] + files.HEADER_BYTES + len(name) + 10)
        f.write(b"\x00")
    assert files.read_entries(str(tmp_path), UID, "c", [(7, 3, 0, 5000)]) == [False]


def test_a_damaged_direct_entry_is_never_served(tmp_path: Path) -> None:
    views = ring_views((150_528, 20_000))
    files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0)
    segment = Path(files.segment_path(str(tmp_path), UID, "c", 0))
    want = wanted(views)
    with open(segment, "r+b") as f:  # one flipped payload bit of the first entry
        f.seek(files.payload_offset(want[0][2]) + 100_000)
        bit = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([bit ^ 0x10]))
    os.truncate(segment, files.payload_offset(want[1][2]) + 10_000)  # the second one torn
    assert files.read_entries(str(tmp_path), UID, "c", want) == [False, False]
    # Asked for another size than it has (rewritten meanwhile): the careful read answers.
    views2 = ring_views((3000,))
    files.write_segments(str(tmp_path), UID, "c", [(1, views2)], Release(), 0.0)
    assert files.read_entries(str(tmp_path), UID, "c", [(0, 1, 0, 9000)]) == [bytes(views2[0][1])]


def targets_in(sizes: tuple[int, ...], keep: bool) -> tuple[mmap.mmap, list[files.Target]]:
    """A ring-like shared mapping (page-aligned) with one block-rounded target per entry."""
    ring = mmap.mmap(-1, sum(files.up(max(size, 1)) for size in sizes))
    targets, offset = [], 0
    with memoryview(ring) as whole:
        for size in sizes:
            targets.append(files.Target(whole[offset:offset + files.up(size)], keep))
            offset += files.up(max(size, 1))
    return ring, targets


@pytest.mark.parametrize("keep", [False, True])
def test_entries_are_read_straight_into_their_targets(tmp_path: Path, keep: bool) -> None:
    views = ring_views(SIZES)
    files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0)
    segment = Path(files.segment_path(str(tmp_path), UID, "c", 0))
    ring, targets = targets_in(SIZES, keep)
    got = files.read_entries(str(tmp_path), UID, "c", wanted(views), targets)
    # Kept: a private copy of each; else True: the payload is in the target only.
    assert got == ([bytes(v) for _, v in views] if keep else [True] * len(SIZES))
    for (_, view), target in zip(views, targets):
        assert target.memory[:len(view)] == view
    assert resident_pages(segment) == 0  # O_DIRECT: no page-cache memory either
    for target in targets:
        target.memory.release()
    ring.close()


def test_a_damaged_entry_read_into_a_target_is_never_served(tmp_path: Path) -> None:
    views = ring_views((150_528, 20_000))
    files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0)
    segment = Path(files.segment_path(str(tmp_path), UID, "c", 0))
    want = wanted(views)
    with open(segment, "r+b") as f:
        f.seek(files.payload_offset(want[0][2]) + 100_000)
        bit = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([bit ^ 0x10]))
    os.truncate(segment, files.payload_offset(want[1][2]) + 10_000)
    for keep in (False, True):
        _, targets = targets_in((150_528, 20_000), keep)
        assert files.read_entries(str(tmp_path), UID, "c", want, targets) == [False, False]


@pytest.mark.parametrize("keep", [False, True])
def test_bytes_changed_in_the_target_during_a_read_are_no_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  keep: bool) -> None:
    """The target is a client's ring, which the client can write while the daemon reads into
    it: a checksum that fails there must not free the entry (a reader could make the daemon
    drop another user's shared entries) nor be kept.  The careful read from the file into
    private memory decides, and the intact entry is answered."""
    views = ring_views((150_528,))
    files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0)
    real_preadv = os.preadv
    scribbled: list[int] = []

    def scribbling_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        got = real_preadv(fd, buffers, offset)
        if len(buffers) == 2:  # the direct read: head block (private), then the target's blocks
            buffers[1][:64] = b"\xee" * 64  # the client writes into its ring meanwhile
            scribbled.append(offset)
        return got

    monkeypatch.setattr(os, "preadv", scribbling_preadv)
    _, targets = targets_in((150_528,), keep)
    got = files.read_entries(str(tmp_path), UID, "c", wanted(views), targets)
    assert scribbled == [0]
    assert got == [bytes(views[0][1]) if keep else True]
    assert targets[0].memory[:150_528] == views[0][1]  # the careful read put the intact entry back


def test_a_head_block_changed_in_the_target_cannot_forge_an_entry(tmp_path: Path) -> None:
    """The checksum is only believed from private memory: the head block is read into the
    thread's scratch, never into the target, so a target cannot supply one."""
    views = ring_views((9000,))
    files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0)
    _, targets = targets_in((9000,), True)
    real_preadv = os.preadv
    seen: list[list[int]] = []

    def recording_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        seen.append([len(b) for b in buffers])
        return real_preadv(fd, buffers, offset)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "preadv", recording_preadv)
        assert files.read_entries(str(tmp_path), UID, "c", wanted(views), targets) == [bytes(views[0][1])]
    assert seen == [[files.ALIGN, files.up(9000)]]
    assert len(targets[0].memory) == files.up(9000)  # the target holds the payload's blocks, no head block


def test_an_empty_entry_is_read_by_a_thread_that_never_read_before(tmp_path: Path) -> None:
    """The thread's scratch is made by the first read it does, whatever that entry's size."""
    import threading
    views = ring_views((0,))
    files.write_segments(str(tmp_path), UID, "c", [(0, views)], Release(), 0.0)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(files.read_entries(str(tmp_path), UID, "c", wanted(views))))
    reader.start()
    reader.join()
    assert got == [[b""]]
