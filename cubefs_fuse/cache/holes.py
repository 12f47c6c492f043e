"""Sparse segment files, under the segment engine (``cache/segments.py``) of both NVMe
stores (``cache/disk.py``, ``samples/files.py``): the allocation unit, punching an entry's
range (``fallocate(PUNCH_HOLE | KEEP_SIZE)``: its blocks go back to the filesystem, the
other entries keep their offsets, the range reads as zeros), probing whether a filesystem
can (:func:`can_punch`; what to do when it cannot is each store's policy), and a segment's
data ranges (``SEEK_DATA``/``SEEK_HOLE``) for the start-up scan. Every function blocks:
callers run them in worker threads."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator

# Filesystem allocation unit used for accounting; 4 KiB is the block size of ext4/xfs on
# NVMe.  Entries start at multiples of it, so that punching an entry's range frees exactly
# its blocks and never touches a neighbour's.
ALLOCATION_UNIT = 4096

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate64  # off_t is 64-bit in fallocate64 on every glibc platform
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int

# The probe's name in the directory it checks.  A probe a crash left behind is truncated
# and reused by the next one (O_TRUNC, no O_EXCL), so it can never stop a start.
PROBE_NAME = ".punch-probe"


def punch(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes at ``offset`` (ALLOCATION_UNIT-aligned) of an open file; its
    size stays.  Raises ``OSError`` (``EOPNOTSUPP`` where the filesystem cannot)."""
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def can_punch(directory: str) -> bool:
    """Whether the filesystem of ``directory`` punches holes: a probe file there gets two
    units of zeros and its first unit punched (a range with data after it, as an entry
    among others), then goes.  ext4, xfs, btrfs and tmpfs can.  False only where the
    filesystem says it cannot (``EOPNOTSUPP``, or ``ENOSYS`` from a kernel without
    ``fallocate``); any other error (the probe could not be created or written) is raised."""
    probe = os.path.join(directory, PROBE_NAME)
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, bytes(2 * ALLOCATION_UNIT), 0)
        punch(fd, 0, ALLOCATION_UNIT)
        return True
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


def data_ranges(fd: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each range of data of an open file, in order: what lies between two
    ranges, and after the last up to the file's size, is a hole.  Two ``lseek`` calls a
    range (``SEEK_DATA``, then ``SEEK_HOLE``; ``ENXIO``: no data from there to the end),
    each made when the previous range has been consumed, so a caller may punch what lies
    before the range it is walking.  The ends come at the filesystem's granularity (a block
    on ext4, a page on tmpfs), which may be finer than ALLOCATION_UNIT; a filesystem that
    does not track holes reports the whole file as one range.  Moves the file offset."""
    offset = 0
    while True:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            return
        yield start, end
        offset = end
