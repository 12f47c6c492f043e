"""The segment engine under both NVMe stores (the block tier, ``cache/disk.py``; the sample
store, ``samples/store.py`` and ``samples/files.py``): entries packed at 4 KiB boundaries
into segment files, each located by one int (:class:`Fields`), counted in allocated bytes
against a limit by the one reservation rule (:class:`Budget`: a write reserves
``max(its bytes, what it frees)`` until its worker has freed its victims and written, so the
bytes on disk never exceed what is counted), freed by punching ranges or deleting a segment
with its last entry (:class:`LiveCounts`, :class:`Release`, :func:`free`), and found again
at start-up by a walk of the segments' headers that punches anything else as junk
(:func:`list_segments`, :func:`scan_segments`). What an entry's header holds, how entries
are written and read, and which limit applies are each store's own; the formats are in
docs/on-disk.md. The functions that touch files block: callers run them in worker threads."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

from cubefs_fuse.cache import holes
from cubefs_fuse.cache.holes import ALLOCATION_UNIT

log = logging.getLogger(__name__)

# Worker threads doing segment I/O at once, per store.  NVMe queues are deep; 8 threads
# keep a drive busy without starving the backend's threads of the GIL on a 2-core machine.
DISK_THREADS = 8

K = TypeVar("K")
I = TypeVar("I")  # noqa: E741 (what a store's parser tells about an entry besides its key and span)


def up(size: int) -> int:
    """``size`` rounded up to whole allocation units (where the next entry may start)."""
    return -(-size // ALLOCATION_UNIT) * ALLOCATION_UNIT


class Fields:
    """A location packed in one int (no object per entry for the garbage collector): fields
    of fixed widths from the lowest bit, each counted in its own unit (a field in
    allocation units holds 4096 times more in as many bits), and the segment id above them
    all, unbounded.  Each store declares its layout once; docs/on-disk.md describes both."""

    __slots__ = ("_shifts", "_masks", "_units", "segment_shift")

    def __init__(self, *fields: tuple[int, int]) -> None:
        """``fields``: (bits, unit) of each field, the lowest first."""
        shifts, shift = [], 0
        for bits, _ in fields:
            shifts.append(shift)
            shift += bits
        self._shifts = tuple(shifts)
        self._masks = tuple((1 << bits) - 1 for bits, _ in fields)
        self._units = tuple(unit for _, unit in fields)
        self.segment_shift = shift

    def pack(self, segment: int, *values: int) -> int:
        """The word of ``segment`` and the fields' ``values`` (in bytes; lowest field first),
        each a multiple of its unit that fits its field (see :meth:`fits`)."""
        word = segment << self.segment_shift
        for value, shift, unit in zip(values, self._shifts, self._units):
            word |= value // unit << shift
        return word

    def unpack(self, word: int) -> tuple[int, ...]:
        """(segment, field values lowest first) of a word."""
        return (word >> self.segment_shift, *((word >> shift & mask) * unit for shift, mask, unit
                                              in zip(self._shifts, self._masks, self._units)))

    def fits(self, *values: int) -> bool:
        """Whether the values (lowest field first) fit their fields: a damaged or foreign file
        could claim anything, what a store writes always fits."""
        return all(0 <= value and value % unit == 0 and value // unit <= mask
                   for value, mask, unit in zip(values, self._masks, self._units))

    def field(self, index: int) -> Callable[[int], int]:
        """A reader of one field's value (in bytes), for hot paths: one call, no tuple."""
        shift, mask, unit = self._shifts[index], self._masks[index], self._units[index]
        if unit == 1:
            return lambda word: word >> shift & mask
        return lambda word: (word >> shift & mask) * unit

    def segment(self, word: int) -> int:
        return word >> self.segment_shift


class Budget:
    """A store's allocated bytes on NVMe, the rule that keeps its limit true on disk.

    ``used`` counts what is stored plus what is in flight; ``in_flight`` is the part that
    writes and frees in progress hold.  A write :meth:`reserve` s ``max(need, freed)`` —
    its own bytes or the ranges of the victims its worker frees before writing, whichever is
    more, since the two are never on disk together — and :meth:`settle` s once the worker
    returned, keeping what it stored.  A range freed without a write stays counted until its
    worker has punched it (:meth:`free`).  So a concurrent write never reuses space that is
    still allocated, and the filesystem never holds more than ``used``."""

    __slots__ = ("used", "in_flight")

    def __init__(self) -> None:
        self.used = 0
        self.in_flight = 0

    def reserve(self, need: int, freed: int) -> int:
        """Hold ``need`` bytes for a write whose victims, counted in ``used`` until now, free
        ``freed``; the bytes reserved, to :meth:`settle` later."""
        reserved = max(need, freed)
        self.used += reserved - freed
        self.in_flight += reserved
        return reserved

    def settle(self, reserved: int, kept: int) -> None:
        """A reservation ended: its worker freed what it was to free and stored ``kept``
        bytes (0 where the write failed or there was none)."""
        self.used += kept - reserved
        self.in_flight -= reserved

    async def free(self, release: Release, freed: int, limiter: trio.CapacityLimiter) -> None:
        """Free ``release`` in a worker thread; its ``freed`` bytes stay counted until then."""
        reserved = self.reserve(0, freed)
        try:
            if release:
                await trio.to_thread.run_sync(free, release, limiter=limiter)
        finally:
            self.settle(reserved, 0)


@dataclass(slots=True)
class Release:
    """Space to free, gathered on the trio thread and freed by a worker (:func:`free`):
    (segment path, offset, length) ranges to punch, segment paths to delete."""

    punches: list[tuple[str, int, int]] = field(default_factory=list)
    unlinks: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.punches or self.unlinks)


class LiveCounts:
    """Entries per segment, so that a segment is deleted whole with its last entry (one
    unlink, where punching would leave an empty file) unless it is still appended to."""

    __slots__ = ("live", "active")

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.active: int | None = None  # the segment being appended to, if any

    def add(self, segment: int, count: int = 1) -> None:
        self.live[segment] = self.live.get(segment, 0) + count

    def leave(self, segment: int, path: str, offset: int, length: int, release: Release) -> bool:
        """One entry of ``segment`` (file ``path``) leaves: its range goes to ``release`` to be
        punched, or, if it was the last and the segment is not appended to, the segment to
        be deleted; whether the segment went."""
        left = self.live[segment] - 1
        if left or segment == self.active:
            self.live[segment] = left
            release.punches.append((path, offset, length))
            return False
        del self.live[segment]
        release.unlinks.append(path)
        return True

    def drop(self, segment: int, path: str, release: Release) -> None:
        """A segment without entries goes (``release`` deletes its file)."""
        del self.live[segment]
        release.unlinks.append(path)


def free(release: Release) -> None:
    """Delete the segments of ``release``, then punch its ranges, each segment opened once
    (a range in a segment deleted or already gone is skipped).  Errors are logged and the
    space counted free: a range that could not be punched is at worst a few KiB the
    accounting does not see until its segment goes (a failing disk: nothing to do here)."""
    gone = set(release.unlinks)
    for path in release.unlinks:
        try:
            unlink_quietly(path)
        except OSError as exc:
            log.warning("could not delete segment %s: %s", path, exc)
    by_path: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in release.punches:
        if path not in gone:
            by_path.setdefault(path, []).append((offset, length))
    for path, ranges in by_path.items():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # deleted meanwhile (a dropped sample cache): its ranges went with it
        except OSError as exc:
            log.warning("could not open segment %s to free ranges: %s", path, exc)
            continue
        try:
            for offset, length in ranges:
                holes.punch(fd, offset, length)
        except OSError as exc:
            log.warning("could not free a range of segment %s: %s", path, exc)
        finally:
            os.close(fd)


def unlink_quietly(path: str) -> int:
    """1 if ``path`` was unlinked, 0 if it was gone already."""
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def remove_junk(path: str) -> int:
    """Delete a file or tree a store does not know (an older layout, a stray file); how many
    files went."""
    if os.path.isdir(path) and not os.path.islink(path):
        count = sum(len(files) for _, _, files in os.walk(path))
        shutil.rmtree(path, ignore_errors=True)
        return count
    try:
        return unlink_quietly(path)
    except OSError:
        return 0


def list_segments(directory: str, segment_id: Callable[[str], int | None]) -> tuple[dict[int, str], int]:
    """The segment files of ``directory`` (id -> path; ``segment_id``: a file name's id, None
    for a name that is no segment's), and how many files of anything else were deleted."""
    segments: dict[int, str] = {}
    junk = 0
    for entry in _entries(directory):
        segment = segment_id(entry.name)
        if segment is None or not entry.is_file(follow_symlinks=False):
            junk += remove_junk(entry.path)
        else:
            segments[segment] = entry.path
    return segments, junk


def _entries(path: str) -> Iterator[os.DirEntry[str]]:
    with contextlib.suppress(OSError), os.scandir(path) as it:
        yield from it


# A store's header parser for the start-up scan: given an open segment, an offset and the
# segment's size, the entry there as (key, its range's bytes, what else the store keeps of
# it), or None where no sound header of an entry that fits the file lies.
Parser = Callable[[int, int, int], tuple[K, int, I] | None]


@dataclass(frozen=True, slots=True)
class Found(Generic[I]):
    """One entry found by :func:`scan_segments`."""

    segment: int
    offset: int
    span: int  # its range's bytes
    info: I


@dataclass(slots=True)
class Scan(Generic[K, I]):
    """What :func:`scan_segments` found: the entries in write order (a key's newest copy
    only), the junk ranges it punched, and the older copies of keys it punched."""

    entries: OrderedDict[K, Found[I]]
    junk: int
    copies: int


def scan_segments(segments: dict[int, str], parse: Parser[K, I]) -> Scan[K, I]:
    """Walk the segments in id order (the order they were written in) and keep every sound
    entry; punch what is neither entry nor hole (a write cut short), and an older copy of a
    key (a crash between a rewrite and the older range's punch); delete the segments left
    without an entry.  A segment that cannot be read counts as junk (reads check every
    entry again)."""
    entries: OrderedDict[K, Found[I]] = OrderedDict()
    live: dict[int, int] = {}
    release = Release()
    junk = copies = 0
    for segment in sorted(segments):
        live[segment] = 0
        found, damaged = _scan_segment(segments[segment], parse)
        junk += damaged
        for offset, (key, span, info) in found:
            older = entries.pop(key, None)
            if older is not None:
                copies += 1
                live[older.segment] -= 1
                release.punches.append((segments[older.segment], older.offset, older.span))
            entries[key] = Found(segment, offset, span, info)
            live[segment] += 1
    release.unlinks += [segments[segment] for segment, count in live.items() if not count]
    free(release)
    return Scan(entries, junk, copies)


def _scan_segment(path: str, parse: Parser[K, I]) -> tuple[list[tuple[int, tuple[K, int, I]]], int]:
    """The sound entries of one segment ((offset, parsed)), and the junk ranges punched.  Only
    the data ranges are walked (``holes.data_ranges``): a hole (a punched entry, up to the
    end of the file when the last one went) is neither entry nor junk, and costs nothing."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("could not open segment %s at start-up: %s", path, exc)
        return [], 1
    found: list[tuple[int, tuple[K, int, I]]] = []
    junk = 0
    junk_from = -1  # start of the junk run being walked

    def end_junk(end: int) -> None:
        nonlocal junk_from, junk
        if junk_from >= 0 and end > junk_from:
            junk += 1
            with contextlib.suppress(OSError):
                holes.punch(fd, junk_from, end - junk_from)
        junk_from = -1

    try:
        size = os.fstat(fd).st_size
        offset = 0
        for data, hole in holes.data_ranges(fd):
            if hole <= offset:
                continue  # inside the entry just taken
            if data > offset:  # a hole up to ``data``: a junk run ends at it
                end_junk(offset)
                offset = data - data % ALLOCATION_UNIT
            while offset < min(hole, size):
                parsed = parse(fd, offset, size)
                if parsed is not None:
                    end_junk(offset)
                    found.append((offset, parsed))
                    offset += parsed[1]
                else:
                    if junk_from < 0:
                        junk_from = offset
                    offset += ALLOCATION_UNIT
        end_junk(up(size))
    except OSError as exc:
        log.warning("could not scan segment %s at start-up: %s", path, exc)
        junk += 1
    finally:
        os.close(fd)
    return found, junk
