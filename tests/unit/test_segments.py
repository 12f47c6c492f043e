"""The segment engine (cache/segments.py) on its own: location words round-trip and refuse
what does not fit, the budget's reservation rule (max(need, freed) until settled; freed
ranges counted until punched), a segment deleted with its last entry unless appended to,
and the start-up scan that keeps sound entries in write order and punches junk and older
copies of a key."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import trio

from cubefs_fuse.cache import segments
from cubefs_fuse.cache.holes import ALLOCATION_UNIT
from cubefs_fuse.cache.segments import Budget, Fields, LiveCounts, Release

UNIT = ALLOCATION_UNIT


def test_a_location_word_round_trips_and_refuses_what_does_not_fit() -> None:
    fields = Fields((16, UNIT), (40, 1))
    word = fields.pack(7, 3 * UNIT, 12345)
    assert fields.unpack(word) == (7, 3 * UNIT, 12345)
    assert fields.segment(word) == 7 and fields.field(0)(word) == 3 * UNIT and fields.field(1)(word) == 12345
    assert fields.fits(((1 << 16) - 1) * UNIT, (1 << 40) - 1)
    assert not fields.fits((1 << 16) * UNIT, 0)  # one unit too many
    assert not fields.fits(UNIT + 1, 0)  # not a whole unit
    assert not fields.fits(0, -1)


async def test_the_budget_holds_the_larger_of_a_write_and_what_it_frees(tmp_path: Path) -> None:
    budget = Budget()
    budget.used = 10 * UNIT  # stored
    reserved = budget.reserve(2 * UNIT, 5 * UNIT)  # a small write that evicts more
    assert reserved == 5 * UNIT and budget.used == 10 * UNIT and budget.in_flight == 5 * UNIT
    budget.settle(reserved, 2 * UNIT)
    assert budget.used == 7 * UNIT and budget.in_flight == 0
    reserved = budget.reserve(4 * UNIT, UNIT)  # a large write that evicts less
    assert budget.used == 10 * UNIT
    budget.settle(reserved, 0)  # its write failed: only the eviction stays done
    assert budget.used == 6 * UNIT and budget.in_flight == 0
    seen: list[int] = []
    victim = tmp_path / "segment"
    victim.write_bytes(bytes(2 * UNIT))
    release = Release(unlinks=[str(victim)])

    async def watch() -> None:
        seen.append(budget.used)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await budget.free(release, 2 * UNIT, trio.CapacityLimiter(1))
    assert seen == [6 * UNIT]  # counted while a worker frees it
    assert budget.used == 4 * UNIT and budget.in_flight == 0 and not victim.exists()


def test_a_segment_goes_with_its_last_entry_unless_appended_to() -> None:
    live = LiveCounts()
    live.add(1, 2)
    live.add(2)
    live.active = 2
    release = Release()
    assert not live.leave(1, "s1", 0, UNIT, release)
    assert live.leave(1, "s1", UNIT, UNIT, release)
    assert not live.leave(2, "s2", 0, UNIT, release)  # the active segment stays, empty
    assert release.punches == [("s1", 0, UNIT), ("s2", 0, UNIT)] and release.unlinks == ["s1"]
    assert live.live == {2: 0}


_ENTRY = struct.Struct("<4sIQ")  # magic, key, payload length: a toy format for the scan


def _entry(key: int, length: int) -> bytes:
    body = _ENTRY.pack(b"TEST", key, length) + b"p" * length
    return body + bytes(-len(body) % UNIT)


def _parse(fd: int, offset: int, size: int) -> tuple[int, int, int] | None:
    magic, key, length = _ENTRY.unpack(os.pread(fd, _ENTRY.size, offset).ljust(_ENTRY.size, b"\0"))
    span = segments.up(_ENTRY.size + length)
    return (key, span, length) if magic == b"TEST" and offset + span <= size else None


def test_the_scan_keeps_sound_entries_and_punches_junk_and_older_copies(tmp_path: Path) -> None:
    one, two, three = tmp_path / "1", tmp_path / "2", tmp_path / "3"
    one.write_bytes(_entry(1, 10) + b"junk".ljust(UNIT, b"j") + _entry(2, 5000))
    two.write_bytes(_entry(1, 20) + _entry(3, 1))  # key 1 rewritten: the older copy goes
    three.write_bytes(b"torn write".ljust(UNIT, b"\0"))  # nothing sound: the segment goes
    scan = segments.scan_segments({1: str(one), 2: str(two), 3: str(three)}, _parse)
    assert [(k, f.segment, f.offset, f.info) for k, f in scan.entries.items()] == [
        (2, 1, 2 * UNIT, 5000), (1, 2, 0, 20), (3, 2, UNIT, 1)]
    assert (scan.junk, scan.copies) == (2, 1)
    assert not three.exists()
    data = one.read_bytes()
    assert data[:2 * UNIT] == bytes(2 * UNIT)  # the older copy and the junk, punched
    assert data[2 * UNIT:2 * UNIT + 4] == b"TEST"
