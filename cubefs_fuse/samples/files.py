"""The sample store's NVMe files: one checksummed file per entry (worker threads only).

Layout, under ``<diskCacheDir>/samples/`` (the block cache's directory lock covers it)::

    tmp/                          entries being written (wiped at start-up)
    <owner uid>/<name>/<fan>/<key>   one file per entry: header, the name, the payload

``<fan>`` is the key modulo 256 in two hex digits, so no directory holds more than a
few thousand files.  A file is written to ``tmp/`` and renamed into place: it is
complete or absent.  Its header repeats the owner, the name and the key (a file moved or
copied elsewhere is never taken for another entry) and carries the xxh3-64 of all of it
and the payload, checked on every read: a torn or damaged file is deleted and answered
as a miss, never served.

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

from cubefs_fuse.cache.disk import ALLOCATION_UNIT
from cubefs_fuse.limits import MAX_NAME, MAX_SAMPLE_ENTRY_BYTES

# magic, format, name length, owner uid, key, payload length, xxh3-64 of header fields + name + payload
_HEADER = struct.Struct("<4sHHIqQQ")
_MAGIC = b"CFSM"
_FORMAT = 1
HEADER_BYTES = _HEADER.size
# Bytes one file costs in its directory: an ext4 entry for a name of up to 20 digits is
# 28 bytes, directory blocks are half full after splits on average, plus the htree's
# index; 128 bytes per file is a bound, so the directories' growth is charged as files
# arrive instead of measured.
DIRENT_CHARGE = 128
FANOUT = 256


def allocated_bytes(name: str, payload: int) -> int:
    """What one entry's file occupies on disk (and in its directory)."""
    size = HEADER_BYTES + len(name.encode()) + payload
    return -(-size // ALLOCATION_UNIT) * ALLOCATION_UNIT + DIRENT_CHARGE


def _digest(uid: int, name: bytes, key: int, payload: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(struct.pack("<IqQ", uid, key, len(payload)))
    h.update(name)
    h.update(payload)
    return h.intdigest()


def cache_dir(root: str, uid: int, name: str) -> str:
    return os.path.join(root, str(uid), name)


def entry_path(root: str, uid: int, name: str, key: int) -> str:
    return os.path.join(root, str(uid), name, f"{key % FANOUT:02x}", str(key))


@dataclass(frozen=True, slots=True)
class Found:
    """One entry file found at start-up."""

    uid: int
    name: str
    key: int
    payload: int  # bytes


@dataclass(frozen=True, slots=True)
class WriteResult:
    written: list[bool]  # per item: the file is in place
    errors: int
    skipped_full: int  # not written: the filesystem is at its free-space floor


def write_entries(root: str, uid: int, name: str, items: Sequence[tuple[int, bytes]],
                  unlink: Sequence[str], free_ratio: float) -> WriteResult:
    """Unlink ``unlink`` (evicted entries), then write each (key, payload) through tmp/."""
    remove_files(unlink)
    tmp_dir = os.path.join(root, "tmp")
    encoded = name.encode()
    written: list[bool] = []
    errors = skipped = 0
    floor_ok = _above_floor(tmp_dir, sum(len(p) for _, p in items), free_ratio)
    for key, payload in items:
        if not floor_ok:
            written.append(False)
            skipped += 1
            continue
        path = entry_path(root, uid, name, key)
        tmp = os.path.join(tmp_dir, secrets.token_hex(8))
        try:
            header = _HEADER.pack(_MAGIC, _FORMAT, len(encoded), uid, key, len(payload),
                                  _digest(uid, encoded, key, payload))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                total = len(header) + len(encoded) + len(payload)
                if os.writev(fd, [header, encoded, payload]) != total:
                    raise OSError(errno.ENOSPC, "short write")
            finally:
                os.close(fd)
            try:
                os.rename(tmp, path)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                os.rename(tmp, path)
            written.append(True)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            written.append(False)
            errors += 1
    return WriteResult(written, errors, skipped)


def _above_floor(directory: str, incoming: int, free_ratio: float) -> bool:
    """True if writing ``incoming`` bytes leaves the filesystem above its free-space floor."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize - incoming >= free_ratio * st.f_blocks * st.f_frsize


def read_entry(root: str, uid: int, name: str, key: int) -> bytes | None | bool:
    """The entry's payload; None if the file is gone; False if it is damaged (then deleted).

    The header is read first and checked against the file's size, then exactly the payload
    (one allocation of its size), then the checksum over both.
    """
    path = entry_path(root, uid, name, key)
    encoded = name.encode()
    payload: bytes | None = None
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_BYTES + len(encoded))
            length = _length(head, size, uid, encoded, key)
            if length is not None:
                data = f.read(length)
                if len(data) == length and _digest(uid, encoded, key, data) == _HEADER.unpack_from(head)[6]:
                    payload = data
    except FileNotFoundError:
        return None
    except OSError:
        pass
    if payload is None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    return payload


def _length(head: bytes, size: int, uid: int, name: bytes, key: int) -> int | None:
    """The payload length if the header names this entry and the file has the size it gives."""
    if len(head) != HEADER_BYTES + len(name):
        return None
    magic, fmt, name_len, f_uid, f_key, length, _ = _HEADER.unpack_from(head)
    if (magic != _MAGIC or fmt != _FORMAT or f_uid != uid or f_key != key or name_len != len(name)
            or head[HEADER_BYTES:] != name or length > MAX_SAMPLE_ENTRY_BYTES or size != len(head) + length):
        return None
    return int(length)


def remove_files(paths: Sequence[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


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


def prepare(root: str) -> None:
    """Create the layout; empty tmp/ (writes a crash interrupted)."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)  # entries are users' data: only the daemon reads them
    tmp_dir = os.path.join(root, "tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir, mode=0o700, exist_ok=True)


def scan(root: str) -> tuple[list[Found], int]:
    """Every entry file under ``root`` (headers checked, payloads not: reads check those),
    and how many files were deleted as junk (short, foreign or misplaced files)."""
    found: list[Found] = []
    junk = 0
    for uid_dir in _dirs(root):
        if not uid_dir.name.isdigit():
            continue
        uid = int(uid_dir.name)
        for name_dir in _dirs(uid_dir.path):
            name = name_dir.name
            encoded = name.encode()
            for fan in _dirs(name_dir.path):
                for entry in _files(fan.path):
                    key = _header_key(entry.path, uid, encoded, entry.name)
                    if key is None:
                        junk += 1
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                        continue
                    found.append(Found(uid, name, key[0], key[1]))
    return found, junk


def _header_key(path: str, uid: int, name: bytes, file_name: str) -> tuple[int, int] | None:
    """(key, payload length) if the file's header matches its place and its size."""
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(HEADER_BYTES + len(name))
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) < HEADER_BYTES:
        return None
    magic, fmt, name_len, f_uid, key, length, _ = _HEADER.unpack_from(head)
    if (magic != _MAGIC or fmt != _FORMAT or f_uid != uid or head[HEADER_BYTES:] != name or name_len != len(name)
            or file_name != str(key) or size != HEADER_BYTES + name_len + length or length > MAX_SAMPLE_ENTRY_BYTES):
        return None
    return key, length


def _dirs(path: str) -> Iterator[os.DirEntry[str]]:
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                yield entry


def _files(path: str) -> Iterator[os.DirEntry[str]]:
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=False):
                yield entry
