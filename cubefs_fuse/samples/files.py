"""The sample store's NVMe files: checksummed entries packed in segment files (worker threads only).

Layout, under ``<diskCacheDir>/samples/`` (the block cache's directory lock covers it)::

    tmp/                             caches being removed (wiped at start-up)
    <owner uid>/<name>/<segment>     one segment per put batch: its entries, each at a 4 KiB boundary

A segment is named by a decimal id, unique in the store (never reused while the daemon
runs, and above every id found at start-up).  One put batch is one segment: one file
created per batch instead of one per entry (on ext4 an inode allocation cost 20-150 us
of the daemon's CPU, more as deleted inodes pile up in the directory's group: a quarter
of its put cost), written with one ``writev`` per entry.  Each entry
starts at an :data:`ALIGN` boundary: a header (magic, format, name length, owner, key,
payload length, the xxh3-64 of those fields, the name and the payload), the name, the
payload, zeros up to the next boundary.  The header repeats the owner, the name and the
key, so bytes found elsewhere are never taken for another entry, and the checksum is
checked on every read: a damaged entry is answered as a miss, never served (the store
then frees it).

**Freeing an entry** (evicted, rewritten, damaged): its 4 KiB-aligned range is punched
(``fallocate(PUNCH_HOLE | KEEP_SIZE)``: its blocks go back to the filesystem, the other
entries of the segment stay where they are); the store counts each segment's live
entries and unlinks the segment when the last one goes.  On a filesystem that cannot
punch holes (:func:`prepare` finds out) the store puts one entry per segment, so that
unlinking frees every entry.

Segments are written in place, not renamed into place: a crash mid-write leaves a
segment whose unfinished entries fail the start-up scan (their header, or a payload that
runs past the end of the file) or the read's checksum.  The start-up :func:`scan` walks
each segment from its start: ``SEEK_DATA`` skips punched ranges, a valid header is an
entry (its payload is checked when it is read), anything else is junk, skipped
:data:`ALIGN` bytes at a time and punched.  Files of the previous layout (one file per
entry under ``<name>/<key % 256>/``) are removed as junk.

Every function here blocks (file I/O): the store calls them through ``trio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from cubefs_fuse.cache import holes
from cubefs_fuse.cache.holes import ALLOCATION_UNIT
from cubefs_fuse.limits import MAX_SAMPLE_ENTRY_BYTES

# magic, format, name length, owner uid, key, payload length, xxh3-64 of header fields + name + payload
_HEADER = struct.Struct("<4sHHIqQQ")
_MAGIC = b"CFSM"
_FORMAT = 2  # 1: one file per entry (removed at scan)
HEADER_BYTES = _HEADER.size
# Entries start at multiples of the filesystem's allocation unit, so that punching an
# entry's range frees exactly its blocks and never touches a neighbour's.
ALIGN = ALLOCATION_UNIT
# Bytes one entry costs beyond its blocks: its segment's metadata.  Once neighbours are
# punched, each live entry is an extent of its own; ext4 keeps 4 extents in the inode and
# needs a 4 KiB leaf block (340 extents) from the 5th on, so 1 KiB per entry pays for the
# leaves of any segment that needs one, plus the segment's directory entry (28 bytes,
# directory blocks half full after splits).  Charged as entries arrive, never measured.
ENTRY_CHARGE = 1024
_ZEROS = bytes(ALIGN)


def span(name: str, payload: int) -> int:
    """The bytes one entry's range takes in its segment (ALIGN-rounded)."""
    size = HEADER_BYTES + len(name.encode()) + payload
    return -(-size // ALIGN) * ALIGN


def allocated_bytes(name: str, payload: int) -> int:
    """What one entry costs on disk: its range plus its metadata charge."""
    return span(name, payload) + ENTRY_CHARGE


def span_of(allocated: int) -> int:
    """An entry's range from what :func:`allocated_bytes` charged for it."""
    return allocated - ENTRY_CHARGE


def layout(name: str, sizes: Sequence[int]) -> list[int]:
    """Each entry's offset in a segment of entries of ``sizes`` payload bytes, in order."""
    offsets: list[int] = []
    offset = 0
    for size in sizes:
        offsets.append(offset)
        offset += span(name, size)
    return offsets


def _digest(uid: int, name: bytes, key: int, payload: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(struct.pack("<IqQ", uid, key, len(payload)))
    h.update(name)
    h.update(payload)
    return h.intdigest()


def cache_dir(root: str, uid: int, name: str) -> str:
    return os.path.join(root, str(uid), name)


def segment_path(root: str, uid: int, name: str, segment: int) -> str:
    return os.path.join(root, str(uid), name, str(segment))


@dataclass(frozen=True, slots=True)
class Found:
    """One entry found at start-up."""

    uid: int
    name: str
    key: int
    payload: int  # bytes
    segment: int
    offset: int


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: list[bool]  # per segment: every entry of it is in place
    errors: int  # entries not written for an I/O error
    skipped_full: int  # entries not written: the filesystem is at its free-space floor


def release(punches: Sequence[tuple[str, int, int]], unlink: Sequence[str]) -> None:
    """Punch each (segment path, offset, length) range, then unlink each segment.

    A segment already gone (its cache was dropped) is skipped; a range that cannot be
    punched stays allocated until its segment goes (a failing disk: nothing to do here).
    """
    by_path: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in punches:
        by_path.setdefault(path, []).append((offset, length))
    for path, ranges in by_path.items():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            for offset, length in ranges:
                with contextlib.suppress(OSError):
                    holes.punch(fd, offset, length)
        finally:
            os.close(fd)
    for path in unlink:
        with contextlib.suppress(OSError):
            os.unlink(path)


def write_segments(root: str, uid: int, name: str,
                   segments: Sequence[tuple[int, Sequence[tuple[int, bytes | memoryview]]]],
                   punches: Sequence[tuple[str, int, int]], unlink: Sequence[str], free_ratio: float) -> WriteResult:
    """Free what ``punches`` and ``unlink`` name (evicted entries), then write each
    (segment id, [(key, payload), ...]) as one new segment, its entries laid out as
    :func:`layout` says.  A segment is written whole or removed."""
    release(punches, unlink)
    encoded = name.encode()
    written: list[bool] = []
    errors = skipped = 0
    floor_ok = _above_floor(root, sum(len(p) for _, items in segments for _, p in items), free_ratio)
    for segment, items in segments:
        if not floor_ok:
            written.append(False)
            skipped += len(items)
            continue
        path = segment_path(root, uid, name, segment)
        try:
            _write_segment(path, _iovecs(uid, encoded, items))
            written.append(True)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            written.append(False)
            errors += len(items)
    return WriteResult(written, errors, skipped)


def _iovecs(uid: int, name: bytes, items: Sequence[tuple[int, bytes | memoryview]]) -> list[list[bytes | memoryview]]:
    """Per entry: its header, name, payload and padding to the next ALIGN boundary (none after the last)."""
    out: list[list[bytes | memoryview]] = []
    zeros = memoryview(_ZEROS)
    for i, (key, payload) in enumerate(items):
        one: list[bytes | memoryview] = [
            _HEADER.pack(_MAGIC, _FORMAT, len(name), uid, key, len(payload), _digest(uid, name, key, payload)),
            name, payload]
        pad = -(HEADER_BYTES + len(name) + len(payload)) % ALIGN
        if pad and i + 1 < len(items):
            one.append(zeros[:pad])
        out.append(one)
    return out


def _write_segment(path: str, entries: list[list[bytes | memoryview]]) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:  # the cache's first segment: its directory is made once
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, flags, 0o600)
    try:
        # One writev per entry, not one for the batch: measured on the daemon's 6.18 kernel
        # (ext4, a VM), a multi-megabyte writev cost 2-3x the system time of the same bytes
        # in per-entry calls (its page-cache copy), and a call costs ~2 us.
        for entry in entries:
            if os.writev(fd, entry) != sum(len(b) for b in entry):
                raise OSError(errno.ENOSPC, "short write")
    finally:
        os.close(fd)


def _above_floor(directory: str, incoming: int, free_ratio: float) -> bool:
    """True if writing ``incoming`` bytes leaves the filesystem above its free-space floor."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize - incoming >= free_ratio * st.f_blocks * st.f_frsize


def read_entries(root: str, uid: int, name: str,
                 wanted: Sequence[tuple[int, int, int]]) -> list[bytes | None | bool]:
    """Each (key, segment, offset)'s payload; None if its segment is gone; False if the
    bytes there are not that entry, whole and intact (damaged, or freed meanwhile).

    The header is read first and checked against the segment's size, then exactly the
    payload (one allocation of its size), then the checksum over both.  One segment is
    open at a time (consecutive entries of one segment share it), as one file was before
    segments: a thread never holds more than one descriptor.  Nothing is changed here:
    the store frees what is damaged.
    """
    encoded = name.encode()
    out: list[bytes | None | bool] = []
    current: tuple[int, int, int] | None = None  # segment, fd, size
    try:
        for key, segment, offset in wanted:
            if current is None or current[0] != segment:
                if current is not None:
                    os.close(current[1])
                    current = None
                try:
                    fd = os.open(segment_path(root, uid, name, segment), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    out.append(None)
                    continue
                try:
                    current = (segment, fd, os.fstat(fd).st_size)
                except OSError:
                    os.close(fd)
                    out.append(False)
                    continue
            out.append(_read_one(current[1], current[2], uid, encoded, key, offset))
    finally:
        if current is not None:
            os.close(current[1])
    return out


def _read_one(fd: int, size: int, uid: int, name: bytes, key: int, offset: int) -> bytes | bool:
    try:
        head = os.pread(fd, HEADER_BYTES + len(name), offset)
        length = _length(head, uid, name)
        if length is None or _HEADER.unpack_from(head)[4] != key or offset + len(head) + length > size:
            return False
        data = os.pread(fd, length, offset + len(head))
    except OSError:
        return False
    if len(data) != length or _digest(uid, name, key, data) != _HEADER.unpack_from(head)[6]:
        return False
    return data


def _length(head: bytes, uid: int, name: bytes) -> int | None:
    """The payload length if ``head`` is an entry header of this owner and name."""
    if len(head) != HEADER_BYTES + len(name):
        return None
    magic, fmt, name_len, f_uid, _, length, _ = _HEADER.unpack_from(head)
    if (magic != _MAGIC or fmt != _FORMAT or f_uid != uid or name_len != len(name)
            or head[HEADER_BYTES:] != name or length > MAX_SAMPLE_ENTRY_BYTES):
        return None
    return int(length)


def remove_cache(root: str, uid: int, name: str) -> None:
    """Remove a cache's directory: renamed into tmp/ first (at once, so a new cache of the
    same name starts in a fresh directory), then deleted."""
    doomed = os.path.join(root, "tmp", "drop-" + secrets.token_hex(8))
    try:
        os.rename(cache_dir(root, uid, name), doomed)
    except FileNotFoundError:
        return
    except OSError:
        doomed = cache_dir(root, uid, name)
    shutil.rmtree(doomed, ignore_errors=True)


def prepare(root: str) -> bool:
    """Create the layout; empty tmp/ (removals a crash interrupted).  Whether the
    filesystem punches holes (else the store puts one entry per segment)."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)  # entries are users' data: only the daemon reads them
    tmp_dir = os.path.join(root, "tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir, mode=0o700, exist_ok=True)
    try:
        return holes.can_punch(tmp_dir)
    except OSError:  # any other failure of the probe: the layout that needs no punching, safe anywhere
        return False


def scan(root: str) -> tuple[list[Found], int]:
    """Every entry under ``root`` (headers checked, payloads not: reads check those), and
    how many pieces were discarded as junk: ranges that hold no valid entry (punched),
    older copies of a key (punched), segments left with no entry and stray or old-layout
    files (deleted)."""
    found: list[Found] = []
    junk = 0
    for uid_dir in _entries(root):
        if not uid_dir.name.isdigit() or not uid_dir.is_dir(follow_symlinks=False):
            continue
        uid = int(uid_dir.name)
        for name_dir in _entries(uid_dir.path):
            if name_dir.is_dir(follow_symlinks=False):
                entries, discarded = _scan_cache(name_dir.path, uid, name_dir.name)
                found += entries
                junk += discarded
    return found, junk


def _scan_cache(directory: str, uid: int, name: str) -> tuple[list[Found], int]:
    encoded = name.encode()
    junk = 0
    segments: list[int] = []
    for item in _entries(directory):
        if item.is_file(follow_symlinks=False) and item.name.isdigit() and str(int(item.name)) == item.name:
            segments.append(int(item.name))
        elif item.is_dir(follow_symlinks=False):  # the previous layout's <key % 256>/ directories
            junk += sum(len(files) for _, _, files in os.walk(item.path))
            shutil.rmtree(item.path, ignore_errors=True)
        else:
            junk += 1
            with contextlib.suppress(OSError):
                os.unlink(item.path)
    latest: dict[int, Found] = {}  # key -> its entry in the newest segment (a rewrite's)
    live: dict[int, int] = {}
    for segment in sorted(segments):
        path = os.path.join(directory, str(segment))
        entries, discarded = _scan_segment(path, uid, encoded)
        junk += discarded
        live[segment] = len(entries)
        for key, offset, length in entries:
            older = latest.get(key)
            if older is not None:  # the older value's range outlived a crash: it goes
                junk += 1
                live[older.segment] -= 1
                release([(os.path.join(directory, str(older.segment)), older.offset, span(name, older.payload))], [])
            latest[key] = Found(uid, name, key, length, segment, offset)
    for segment, count in live.items():
        if not count:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, str(segment)))
    return list(latest.values()), junk


def _scan_segment(path: str, uid: int, name: bytes) -> tuple[list[tuple[int, int, int]], int]:
    """(key, offset, payload length) of each entry whose header is valid and whose payload
    lies inside the segment, and how many junk ranges were punched."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return [], 1
    entries: list[tuple[int, int, int]] = []
    junk = 0
    junk_from: int | None = None  # start of the junk run being skipped
    head_bytes = HEADER_BYTES + len(name)

    def end_junk(end: int) -> None:
        nonlocal junk_from, junk
        if junk_from is not None and end > junk_from:
            junk += 1
            with contextlib.suppress(OSError):
                holes.punch(fd, junk_from, end - junk_from)
        junk_from = None

    try:
        size = os.fstat(fd).st_size
        offset = 0
        for data, hole in holes.data_ranges(fd):
            if hole <= offset:
                continue  # inside the entry just taken
            if data > offset:  # a punched range: a junk run ends at it
                end_junk(offset)
                offset = data - data % ALIGN
            while offset < min(hole, size):
                head = os.pread(fd, head_bytes, offset)
                length = _length(head, uid, name)
                if length is not None and offset + head_bytes + length <= size:
                    end_junk(offset)
                    entries.append((_HEADER.unpack_from(head)[4], offset, length))
                    offset += -(-(head_bytes + length) // ALIGN) * ALIGN
                else:
                    if junk_from is None:
                        junk_from = offset
                    offset += ALIGN
        end_junk(-(-size // ALIGN) * ALIGN)
    except OSError:
        junk += 1
    finally:
        os.close(fd)
    return entries, junk


def _entries(path: str) -> Iterator[os.DirEntry[str]]:
    with contextlib.suppress(OSError), os.scandir(path) as it:
        yield from it
