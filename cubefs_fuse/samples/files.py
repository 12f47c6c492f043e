"""The sample store's NVMe files (worker threads only): one segment file per put batch under
``<diskCacheDir>/samples/<owner uid>/<name>/<id>``, each entry a 4 KiB head block (header,
name) and its payload from the next 4 KiB boundary, checksummed and checked on every read,
written and read with ``O_DIRECT`` when the payload lies page-aligned in the connection's
ring (the page cache otherwise, same bytes on disk), freed by punching its range, and found
again at start-up by a scan of the segments' headers that punches anything else as junk; the
freeing and the scan are the segment engine's (``cache/segments.py``), the entry format and
the I/O this module's. The format is in docs/on-disk.md, "Sample store segments"."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import shutil
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cubefs_fuse.cache import holes
from cubefs_fuse.cache.holes import ALLOCATION_UNIT
from cubefs_fuse.cache.segments import Release, free, list_segments, scan_segments
from cubefs_fuse.cache.segments import up as up
from cubefs_fuse.limits import MAX_NAME, MAX_SAMPLE_ENTRY_BYTES
from cubefs_fuse.samples.checksum import entry_digest

# magic, format, name length, owner uid, key, payload length, xxh3-64 of header fields + name + payload
_HEADER = struct.Struct("<4sHHIqQQ")
_MAGIC = b"CFSM"
# The format written: 3, the payload in blocks of its own (see the module docstring).  2:
# the payload right after the header and name (read, not written).  1: one file per entry
# (removed at scan).
_FORMAT = 3
_PACKED = 2
HEADER_BYTES = _HEADER.size
# Entries start at multiples of the filesystem's allocation unit, so that punching an
# entry's range frees exactly its blocks and never touches a neighbour's; in format 3 the
# head block is one unit, so the payload starts at a boundary too.  4 KiB is also the
# largest direct-I/O alignment a block device asks for (512 or 4096 bytes), and the page
# size: an aligned payload in memory is a page-aligned one.
ALIGN = ALLOCATION_UNIT
# Sample cache names (SAMPLE_NAME_PATTERN) fit a head block with the header many times over.
assert HEADER_BYTES + MAX_NAME < ALIGN
# Bytes one entry costs beyond its blocks: its segment's metadata.  Once neighbours are
# punched, each live entry is an extent of its own; ext4 keeps 4 extents in the inode and
# needs a 4 KiB leaf block (340 extents) from the 5th on, so 1 KiB per entry pays for the
# leaves of any segment that needs one, plus the segment's directory entry (28 bytes,
# directory blocks half full after splits).  Charged as entries arrive, never measured.
ENTRY_CHARGE = 1024
_ZEROS = memoryview(bytes(ALIGN))


def span(payload: int) -> int:
    """The bytes one entry's range takes in its segment (ALIGN-rounded): its head block (the
    name is in it, up to MAX_NAME bytes) and its payload's blocks."""
    return ALIGN + up(payload)


def _span_of_format(fmt: int, name: bytes, payload: int) -> int:
    return span(payload) if fmt == _FORMAT else up(HEADER_BYTES + len(name) + payload)


def payload_offset(offset: int) -> int:
    """Where the payload of the (format 3) entry at ``offset`` starts in its segment."""
    return offset + ALIGN


def allocated_bytes(payload: int) -> int:
    """What one entry costs on disk: its range plus its metadata charge."""
    return span(payload) + ENTRY_CHARGE


def span_of(allocated: int) -> int:
    """An entry's range from what :func:`allocated_bytes` charged for it."""
    return allocated - ENTRY_CHARGE


def layout(sizes: Sequence[int]) -> list[int]:
    """Each entry's offset in a segment of entries of ``sizes`` payload bytes, in order."""
    offsets: list[int] = []
    offset = 0
    for size in sizes:
        offsets.append(offset)
        offset += span(size)
    return offsets


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
    span: int  # its range's bytes (its format's layout)

    @property
    def allocated(self) -> int:
        """What the entry costs on disk (as :func:`allocated_bytes` for an entry written now)."""
        return self.span + ENTRY_CHARGE


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: list[bool]  # per segment: every entry of it is in place
    errors: int  # entries not written for an I/O error
    skipped_full: int  # entries not written: the filesystem is at its free-space floor


def write_segments(root: str, uid: int, name: str,
                   segments: Sequence[tuple[int, Sequence[tuple[int, bytes | memoryview]]]],
                   release: Release, free_ratio: float, digests: Mapping[int, int] | None = None) -> WriteResult:
    """Free what ``release`` names (evicted entries), then write each
    (segment id, [(key, payload), ...]) as one new segment, its entries laid out as
    :func:`layout` says.  A segment is written whole or removed.  ``digests``: checksums
    the client sent (key -> :func:`~cubefs_fuse.samples.checksum.entry_digest`), stored as
    given (a wrong one makes its entry fail the read's check: a miss, never served);
    the others are computed here."""
    free(release)
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
            _write_segment(path, uid, encoded, items, digests or {})
            written.append(True)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            written.append(False)
            errors += len(items)
    return WriteResult(written, errors, skipped)


def _head(uid: int, name: bytes, key: int, payload: bytes | memoryview, digest: int | None) -> bytes:
    """An entry's header and name (its head block without the zeros); ``digest``: the
    checksum its client sent with the put (None: computed here, a read of the payload)."""
    if digest is None:
        digest = entry_digest(uid, name, key, payload)
    return _HEADER.pack(_MAGIC, _FORMAT, len(name), uid, key, len(payload), digest) + name


def _write_segment(path: str, uid: int, name: bytes, items: Sequence[tuple[int, bytes | memoryview]],
                   digests: Mapping[int, int]) -> None:
    """Create the segment and write its entries: without the page cache when every payload
    is page-aligned in memory and the filesystem allows it (see the module docstring),
    else through it."""
    global _direct_refused
    direct = not _direct_refused and all(_aligned(payload) for _, payload in items)
    fd = _create(path, direct)
    if fd is None:  # the filesystem has no O_DIRECT (tmpfs): never asked again
        _direct_refused, direct = True, False
        fd = _create(path, False)
        assert fd is not None
    try:
        if direct:
            try:
                _write_direct(fd, uid, name, items, digests)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            # The filesystem refused a direct write of aligned blocks: the segment again,
            # through the page cache, and so from now on.
            _direct_refused = True
            os.ftruncate(fd, 0)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.lseek(fd, 0, os.SEEK_SET)
        for key, payload in items:
            _write_buffered(fd, uid, name, key, payload, digests.get(key))
    finally:
        os.close(fd)


def _create(path: str, direct: bool) -> int | None:
    """The new segment's descriptor (O_DIRECT if ``direct``); None where the filesystem
    refuses O_DIRECT."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    try:
        try:
            return os.open(path, flags, 0o600)
        except FileNotFoundError:  # the cache's first segment: its directory is made, once
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            return os.open(path, flags, 0o600)  # (gone again: a drop meanwhile; the batch's error)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            with contextlib.suppress(OSError):
                os.unlink(path)  # (created before the flag was refused, on some filesystems)
            return None
        raise


def _write_buffered(fd: int, uid: int, name: bytes, key: int, payload: bytes | memoryview, digest: int | None) -> None:
    """One entry at the descriptor's position: its head block, its payload, zeros up to the
    next ALIGN boundary.  One ``writev`` per entry, not one for the segment: measured on
    the daemon's 6.18 kernel (ext4, a VM), a multi-megabyte buffered writev cost 2-3x the
    system time of the same bytes in per-entry calls, and a call costs ~2 us."""
    head = _head(uid, name, key, payload, digest)
    pad = -len(payload) % ALIGN
    if os.writev(fd, [head, _ZEROS[:ALIGN - len(head)], payload, _ZEROS[:pad]]) != ALIGN + len(payload) + pad:
        raise OSError(errno.ENOSPC, "short write")


def _write_direct(fd: int, uid: int, name: bytes, items: Sequence[tuple[int, bytes | memoryview]],
                  digests: Mapping[int, int]) -> None:
    """The entries (page-aligned payloads) with O_DIRECT, DIRECT_CHUNK per ``writev``: every
    piece a whole number of aligned blocks, the head blocks and the payloads' last partial
    blocks copied into this thread's scratch blocks.  One call for a batch, not one per
    entry: each direct write is a request to the device, and in a VM every request costs
    an exit to the host (measured: ~27-38 us of CPU per 150 KB entry written one by one,
    ~5-8 us in one call for 32)."""
    for start in range(0, len(items), DIRECT_CHUNK):
        chunk = items[start:start + DIRECT_CHUNK]
        blocks = _scratch_blocks(len(chunk))
        iov: list[bytes | memoryview] = []
        total = 0
        for j, (key, payload) in enumerate(chunk):
            head = _head(uid, name, key, payload, digests.get(key))
            block, tail = blocks[2 * j * ALIGN:(2 * j + 1) * ALIGN], blocks[(2 * j + 1) * ALIGN:(2 * j + 2) * ALIGN]
            block[:len(head)] = head
            block[len(head):] = _ZEROS[len(head):]
            iov.append(block)
            size = len(payload)
            whole = size - size % ALIGN
            if whole:
                iov.append(memoryview(payload)[:whole])
            if whole < size:
                tail[:size - whole] = memoryview(payload)[whole:]
                tail[size - whole:] = _ZEROS[size - whole:]
                iov.append(tail)
            total += span(size)
        if os.writev(fd, iov) != total:
            raise OSError(errno.ENOSPC, "short write")


# Entries per direct writev: three pieces each, within Linux's IOV_MAX (1024), and a
# thread's scratch blocks (two per entry) stay at 1 MiB.
DIRECT_CHUNK = 64
_direct_refused = False  # the filesystem refused O_DIRECT once: page cache from then on
_scratch = threading.local()


def _scratch_blocks(entries: int) -> memoryview:
    """Two ALIGN-byte blocks per entry, of this thread's and page-aligned (an anonymous
    mapping), kept for its later writes: a fresh page costs a fault, and more in a VM."""
    blocks: memoryview | None = getattr(_scratch, "blocks", None)
    if blocks is None or len(blocks) < 2 * ALIGN * entries:
        blocks = _scratch.blocks = memoryview(mmap.mmap(-1, 2 * ALIGN * DIRECT_CHUNK))
    return blocks


def _aligned(payload: bytes | memoryview) -> bool:
    """Whether the payload's memory starts at a page (ALIGN) boundary."""
    return int(np.frombuffer(payload, dtype=np.uint8).ctypes.data) % ALIGN == 0


def _above_floor(directory: str, incoming: int, free_ratio: float) -> bool:
    """True if writing ``incoming`` bytes leaves the filesystem above its free-space floor."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize - incoming >= free_ratio * st.f_blocks * st.f_frsize


def read_entries(root: str, uid: int, name: str, wanted: Sequence[tuple[int, int, int, int]],
                 into: Sequence[Target | None] | None = None) -> list[bytes | None | bool]:
    """Each (key, segment, offset, expected size)'s payload; None if its segment is gone;
    False if the bytes there are not that entry, whole and intact (damaged, or freed
    meanwhile).

    With ``into``, an entry given a :class:`Target` is read into its memory instead (see
    :func:`_read_into`): True once its payload is there and checked, or its private copy
    (bytes, checked, also in the target's memory) where the target asks to keep one.

    A format-3 entry of the expected size (up to :data:`DIRECT_READ_MAX`) is one read of
    its range without the page cache (``O_DIRECT``, one request to the device: see
    :func:`_read_into`), into its target or, without one, into this thread's scratch
    memory and copied out.  Else, or where that read finds anything amiss, the careful
    read: the header first, checked against the segment's size, then exactly the payload
    (one allocation of its size).  The checksum is checked either way.  One
    segment is open at a time (consecutive entries of one segment share it), as one file
    was before segments: a thread never holds more than one descriptor.  Nothing is
    changed here: the store frees what is damaged.
    """
    encoded = name.encode()
    out: list[bytes | None | bool] = []
    current: tuple[int, int, int] | None = None  # segment, fd, size
    direct = False  # whether the current descriptor reads with O_DIRECT
    try:
        for key, segment, offset, expected in wanted:
            if current is None or current[0] != segment:
                if current is not None:
                    os.close(current[1])
                    current = None
                try:
                    fd = os.open(segment_path(root, uid, name, segment), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    out.append(None)
                    continue
                direct = False
                try:
                    current = (segment, fd, os.fstat(fd).st_size)
                except OSError:
                    os.close(fd)
                    out.append(False)
                    continue
            fd, size = current[1], current[2]
            target = into[len(out)] if into is not None else None
            if not _direct_refused and span(expected) <= DIRECT_READ_MAX:
                if not direct:
                    direct = _set_direct(fd, True)
                if direct:
                    # Without a target: into this thread's scratch, a copy kept from it.
                    into_memory = target if target is not None else Target(_read_scratch(up(expected)), True)
                    data = _read_into(fd, uid, encoded, key, offset, expected, into_memory)
                    if data is not None:
                        out.append(data)
                        continue
            if direct:  # the careful read, through the page cache
                direct = not _set_direct(fd, False)
            data = _read_one(fd, size, uid, encoded, key, offset)
            if target is not None and isinstance(data, bytes):
                if len(data) > len(target.memory):
                    data = False  # (cannot be: the target was sized for the expected payload)
                else:
                    target.memory[:len(data)] = data
                    data = data if target.keep else True
            out.append(data)
    finally:
        if current is not None:
            os.close(current[1])
    return out


# Entries up to this span are read with O_DIRECT into a thread's scratch memory (which
# grows to it: at most DISK_THREADS x 4 MiB in the daemon); larger ones through the page cache.
DIRECT_READ_MAX = 4 << 20


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for an open descriptor; whether it is now as asked."""
    global _direct_refused
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
        return True
    except OSError as exc:
        if on and exc.errno == errno.EINVAL:  # the filesystem has no O_DIRECT
            _direct_refused = True
        return False


@dataclass(frozen=True, slots=True)
class Target:
    """Where :func:`read_entries` puts one entry's payload: ``memory`` of at least the
    expected payload rounded up to :data:`ALIGN` (page-aligned, for a direct read; any
    memory will do for the careful read), which the reader may change meanwhile (a
    client's ring); ``keep``: also return a private copy (for the store's RAM tier)."""

    memory: memoryview
    keep: bool


def _read_into(fd: int, uid: int, name: bytes, key: int, offset: int, expected: int,
               target: Target) -> bytes | bool | None:
    """The format-3 entry of ``expected`` payload bytes at ``offset``, read with O_DIRECT in
    one request: its head block into this thread's scratch block, its payload's blocks
    straight into ``target.memory`` (no copy, no fresh memory).  True (or the private copy,
    if kept) once the checksum holds; None to read it the careful way: another format or
    size, a refused read, or a checksum that fails.

    The target's memory is the client's to change at any time, so a checksum is only ever
    believed from private memory: the header (with the checksum) comes into this thread's
    scratch, not the ring, and a kept copy is checked after it was copied.  A failure seen
    in the ring is never a verdict (a client could make the store free another user's
    shared entries): the careful read, from the file into private memory, decides."""
    global _direct_refused
    payload = target.memory[:up(expected)]
    if len(payload) != up(expected) or not _aligned(payload):
        return None
    block = _head_scratch()
    try:
        got = os.preadv(fd, [block, payload] if expected else [block], offset)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            _direct_refused = True
        return None
    if got < ALIGN + expected:
        return None
    head = bytes(block[:HEADER_BYTES + len(name)])
    if _parse(head, uid, name) != (_FORMAT, expected) or _HEADER.unpack_from(head)[4] != key:
        return None
    digest = _HEADER.unpack_from(head)[6]
    if target.keep:
        data = bytes(payload[:expected])
        return data if entry_digest(uid, name, key, data) == digest else None
    return True if entry_digest(uid, name, key, payload[:expected]) == digest else None


def _head_scratch() -> memoryview:
    """This thread's page-aligned block for head blocks read with O_DIRECT (kept)."""
    block: memoryview | None = getattr(_scratch, "head", None)
    if block is None:
        block = _scratch.head = memoryview(mmap.mmap(-1, ALIGN))
    return block


def _read_scratch(size: int) -> memoryview:
    """This thread's page-aligned read buffer of at least ``size`` bytes (kept for its
    later reads, grown in steps of 1 MiB)."""
    buffer: memoryview | None = getattr(_scratch, "read", None)
    if buffer is None or len(buffer) < size:
        buffer = _scratch.read = memoryview(mmap.mmap(-1, -(-max(size, 1) // (1 << 20)) * (1 << 20)))  # (never 0)
    return buffer


def _read_one(fd: int, size: int, uid: int, name: bytes, key: int, offset: int) -> bytes | bool:
    try:
        head = os.pread(fd, HEADER_BYTES + len(name), offset)
        parsed = _parse(head, uid, name)
        if parsed is None or _HEADER.unpack_from(head)[4] != key:
            return False
        start, length = _payload(offset, parsed[0], name), parsed[1]
        if start + length > size:
            return False
        data = os.pread(fd, length, start)
    except OSError:
        return False
    if len(data) != length or entry_digest(uid, name, key, data) != _HEADER.unpack_from(head)[6]:
        return False
    return data


def _parse(head: bytes, uid: int, name: bytes) -> tuple[int, int] | None:
    """(format, payload length) if ``head`` is an entry header of this owner and name."""
    if len(head) != HEADER_BYTES + len(name):
        return None
    magic, fmt, name_len, f_uid, _, length, _ = _HEADER.unpack_from(head)
    if (magic != _MAGIC or fmt not in (_FORMAT, _PACKED) or f_uid != uid or name_len != len(name)
            or head[HEADER_BYTES:] != name or length > MAX_SAMPLE_ENTRY_BYTES):
        return None
    return int(fmt), int(length)


def _payload(offset: int, fmt: int, name: bytes) -> int:
    """Where the payload of an entry of format ``fmt`` at ``offset`` starts."""
    return payload_offset(offset) if fmt == _FORMAT else offset + HEADER_BYTES + len(name)


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
    head_bytes = HEADER_BYTES + len(encoded)

    def parse(fd: int, offset: int, size: int) -> tuple[int, int, int] | None:
        """(key, span, payload length) of a valid header whose payload lies in the segment."""
        head = os.pread(fd, head_bytes, offset)
        parsed = _parse(head, uid, encoded)
        if parsed is None or _payload(offset, parsed[0], encoded) + parsed[1] > size:
            return None
        return _HEADER.unpack_from(head)[4], _span_of_format(parsed[0], encoded, parsed[1]), parsed[1]

    # Anything but a segment (the previous layout's <key % 256>/ directories, stray files) goes.
    names, junk = list_segments(directory, _segment_id)
    scan = scan_segments(names, parse)
    found = [Found(uid, name, key, f.info, f.segment, f.offset, f.span) for key, f in scan.entries.items()]
    return found, junk + scan.junk + scan.copies


def _segment_id(name: str) -> int | None:
    """A segment's id from its file name (decimal, as written), else None."""
    return int(name) if name.isascii() and name.isdigit() and str(int(name)) == name else None


def _entries(path: str) -> Iterator[os.DirEntry[str]]:
    with contextlib.suppress(OSError), os.scandir(path) as it:
        yield from it
