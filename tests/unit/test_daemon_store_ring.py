"""DaemonStore's entries written in place: slots of the writer connection's ring.

The daemon's side is a fake channel here (a ring and a log of the requests, answering as
the daemon does: a put copies its items out of the ring); the real daemon is in
tests/torch/test_sample_daemon.py and tests/torch/test_daemon_store_workers.py.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from cube_torch.samples.daemon_store import REFRESH_AFTER, SLOT_ALIGN, DaemonStore, RingSlot
from cubefs_fuse.samples.checksum import entry_digest

RING = 1000


class FakeChannel:
    """A data connection: its ring, and the daemon's answers (puts stored in ``stored``)."""

    uid: int | None = None  # what the hello answered (None: a daemon that does not say)

    def __init__(self, stored: dict[int, bytes], log: list[dict[str, Any]]) -> None:
        self.size = RING
        self.ring = bytearray(RING)
        self.stored = stored
        self.log = log
        self.closed = False

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert not self.closed
        self.log.append(request)
        if request["op"] == "sample_put":
            for key, offset, size, *_digest in request["items"]:
                self.stored[key] = bytes(self.ring[offset:offset + size])
            return {"stored": len(request["items"])}
        if request["op"] == "sample_plan":
            count = request["count"]
            keys = np.frombuffer(bytes(self.ring[:count * 8]), dtype="<i8")
            self.ring[:count] = bytes([int(k) % 2 for k in keys])  # the answer over the keys' start
            return {"planned": count, "held": count}
        raise AssertionError(request)

    def close(self) -> None:
        self.closed = True


class RingStore(DaemonStore):
    """A DaemonStore whose connections are FakeChannels (of RING bytes, so slots start at
    multiples of 100 instead of a page: the same rule at the ring's scale)."""

    slot_align = 100

    def __init__(self) -> None:
        super().__init__("vol")
        self.stored: dict[int, bytes] = {}
        self.log: list[dict[str, Any]] = []
        self.channels: list[FakeChannel] = []

    def _open_channel(self) -> Any:
        channel = FakeChannel(self.stored, self.log)
        self.channels.append(channel)
        return channel


@pytest.fixture
def store() -> RingStore:
    return RingStore()


def entry(key: int, size: int) -> bytes:
    return bytes([key % 251]) * size


def test_a_slot_is_sent_as_it_lies_and_freed_once_answered(store: RingStore) -> None:
    assert store.write_entry([b"abc"], 3) is None  # not connected yet: the caller keeps bytes
    store.put_many("c", [(1, entry(1, 100))])  # bytes: copied into the ring (connects)
    assert store.stored == {1: entry(1, 100)}
    slot = store.write_entry([b"head", memoryview(entry(2, 96))], 100)
    assert isinstance(slot, RingSlot) and slot.offset == 0 and len(slot) == 100  # the ring was free again
    second = store.write_entry([entry(3, 50)], 50)
    assert second is not None and second.offset == 100
    store.put_many("c", [(2, slot), (3, second)])
    assert store.stored[2] == b"head" + entry(2, 96) and store.stored[3] == entry(3, 50)
    assert store.log[-1]["items"] == [[2, 0, 100], [3, 100, 50]]
    assert not slot.live and not second.live and not store._slots
    with pytest.raises(ValueError, match="parts for a buffer"):
        store.write_entry([b"abc"], 4)


def test_a_slot_written_for_its_key_carries_the_entrys_checksum(store: RingStore) -> None:
    """With the uid the daemon answered the hello with, a slot written for (name, key) has
    the entry's checksum as the daemon stores it, and a put of that key in that cache
    sends it; a put under another key or name, another user's cache, or a daemon that
    did not say the uid: no checksum (the daemon computes it)."""
    store.put_many("c", [(0, b"x")])  # connects
    channel = store.channels[-1]
    assert store.write_entry([b"ab"], 2, name="c", key=1).digest is None  # type: ignore[union-attr]  # no uid said
    channel.uid = 1234
    written = [store.write_entry([entry(k, 50)], 50, name=name, key=k)
               for k, name in ((2, "c"), (3, "c"), (4, "c"), (5, "~7/c"))]
    slots = [slot for slot in written if slot is not None]
    assert len(slots) == len(written)
    assert slots[0].digest == entry_digest(1234, b"c", 2, entry(2, 50))
    assert slots[3].digest is None  # another user's cache: never put anyway
    store.put_many("c", [(2, slots[0]), (30, slots[1])])
    store.put_many("d", [(4, slots[2])])
    assert [item[3:] for item in store.log[-2]["items"]] == [[slots[0].digest], []]
    assert store.log[-1]["items"][0][3:] == []
    assert store.stored[30] == entry(3, 50)


def test_slots_start_at_page_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real rings: each slot at a multiple of 4096 bytes, where the daemon can write it to
    disk without the page cache (O_DIRECT)."""
    assert SLOT_ALIGN == 4096
    monkeypatch.setattr(RingStore, "slot_align", SLOT_ALIGN)
    monkeypatch.setattr(FakeChannel, "__init__", _big_ring)
    store = RingStore()
    store.put_many("c", [(0, b"x")])
    slots = [store.write_entry([entry(k, size)], size) for k, size in enumerate((100, 5000, 4096, 1))]
    assert [s.offset for s in slots if s is not None] == [0, 4096, 12288, 16384]
    store.put_many("c", [(k, s) for k, s in enumerate(slots) if s is not None])
    assert [len(store.stored[k]) for k in range(4)] == [100, 5000, 4096, 1]


def _big_ring(self: FakeChannel, stored: dict[int, bytes], log: list[dict[str, Any]]) -> None:
    self.size = 64 * 1024
    self.ring = bytearray(self.size)
    self.stored, self.log, self.closed = stored, log, False


def test_slots_wrap_around_and_a_full_ring_falls_back(store: RingStore) -> None:
    store.put_many("c", [(0, b"x")])
    a, b, c = (store.write_entry([entry(k, 300)], 300) for k in range(3))
    assert [s.offset for s in (a, b, c) if s is not None] == [0, 300, 600]
    assert store.write_entry([entry(9, 200)], 200) is None  # 100 bytes left at the end, none at the start
    assert a is not None and b is not None and c is not None
    store.release(a)  # dropped by the cache: its bytes are free
    d = store.write_entry([entry(4, 250)], 250)
    assert d is not None and d.offset == 0  # wrapped, before the oldest live slot
    assert store.write_entry([entry(5, 100)], 100) is None  # 50 bytes between d and b
    store.put_many("c", [(1, b), (2, c), (3, d)])
    assert {k: store.stored[k] for k in (1, 2, 3)} == {1: entry(1, 300), 2: entry(2, 300), 3: entry(4, 250)}
    assert store.write_entry([entry(6, RING)], RING) is not None and store.write_entry([b"x"], RING + 1) is None


def test_slots_start_over_as_soon_as_the_start_is_free(store: RingStore) -> None:
    """The ring's first pages are reused rather than the whole ring swept (a first touch of
    a page is a page fault on both sides)."""
    store.put_many("c", [(0, b"x")])
    a, b = store.write_entry([entry(1, 300)], 300), store.write_entry([entry(2, 300)], 300)
    assert a is not None and b is not None and b.offset == 300
    store.release(a)
    c = store.write_entry([entry(3, 200)], 200)
    assert c is not None and c.offset == 0
    d = store.write_entry([entry(4, 100)], 100)
    assert d is not None and d.offset == 200  # after the newest, before the oldest
    assert store.write_entry([entry(5, 1)], 1) is None  # the start is full up to b: no jumping over it


def test_bytes_and_slots_mix_and_a_full_ring_sends_what_it_has(store: RingStore) -> None:
    store.put_many("c", [(0, b"x")])
    slot = store.write_entry([entry(1, 600)], 600)
    assert slot is not None
    store.put_many("c", [(1, slot), (2, entry(2, 300)), (3, entry(3, 500)), (4, entry(4, 2 * RING))])
    assert [r["items"] for r in store.log[1:]] == [[[1, 0, 600], [2, 600, 300]], [[3, 0, 500]]]
    assert 4 not in store.stored and store.stored[3] == entry(3, 500)  # larger than the ring: dropped
    assert not store._slots


def test_slots_of_a_replaced_ring_are_dropped(store: RingStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.put_many("c", [(0, b"x")])
    slot = store.write_entry([entry(1, 10)], 10)
    assert slot is not None
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + REFRESH_AFTER / 2)
    assert store.write_entry([entry(2, 10)], 10) is None  # the ring is about to be replaced: bytes instead
    monkeypatch.setattr(time, "monotonic", lambda: now + REFRESH_AFTER + 1)
    store.put_many("c", [(1, slot), (2, entry(2, 10))])  # idle too long: a new connection, the old slot lost
    assert len(store.channels) == 2 and store.channels[0].closed
    assert 1 not in store.stored and store.stored[2] == entry(2, 10)
    assert not slot.live


def test_a_plan_never_touches_the_slots(store: RingStore) -> None:
    store.put_many("c", [(0, b"x")])
    slot = store.write_entry([entry(7, 64)], 64)
    assert slot is not None
    held = store.plan_held("c", list(range(40)))
    assert held is not None and held.tolist() == [k % 2 == 1 for k in range(40)]
    assert len(store.channels) == 2 and store.channels[1].closed  # its own, closed after
    store.put_many("c", [(7, slot)])
    assert store.stored[7] == entry(7, 64)


def test_reads_and_close_drop_the_slots(store: RingStore) -> None:
    store.put_many("c", [(0, b"x")])
    slot = store.write_entry([entry(1, 10)], 10)
    assert slot is not None
    store.close()
    assert not slot.live and store.channels[0].closed
    store.put_many("c", [(1, slot)])
    assert 1 not in store.stored
