"""The daemon's sample store (cubefs_fuse/samples/) on real files: budgets that hold,
eviction order with and without a plan, damaged files never served, restart, owners."""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Sized
from pathlib import Path

import numpy as np
import pytest
import trio

from cubefs_fuse.cache import holes
from cubefs_fuse.errors import BadRequest, Forbidden, NotFound
from cubefs_fuse.samples import files, index
from cubefs_fuse.samples.store import RAM_ENTRY_OVERHEAD, SampleStore

ME, OTHER = 1000, 1001
ADMINS = frozenset({0})


def entry(key: int, size: int = 1000) -> bytes:
    return bytes([key % 251]) * size + key.to_bytes(8, "little")


async def open_store(root: Path, mem: int, disk: int, **kwargs: object) -> SampleStore:
    async with trio.open_nursery() as nursery:
        store = await SampleStore.open(nursery, str(root), mem, disk, 0.0, admins=ADMINS, **kwargs)  # type: ignore[arg-type]
    assert store.loaded  # the nursery above waited for the load
    return store


def keys_of(data: list[bytes | None]) -> list[int | None]:
    return [None if d is None else int.from_bytes(d[-8:], "little") for d in data]


def located(store: SampleStore, owner: int, name: str, key: int) -> tuple[Path, int]:
    """The segment file holding an entry, and the entry's offset in it."""
    word = store._caches[(owner, name)].entries[key]
    assert index.charge_of(word)
    return Path(files.segment_path(store.root, owner, name, index.segment_of(word))), index.offset_of(word)


def on_disk(root: Path) -> int:
    """Bytes the entry files take (allocated, as the store charges them, without the dirent charge)."""
    total = 0
    for path in root.rglob("*"):
        if path.is_file():
            total += path.stat().st_blocks * 512
    return total


async def test_round_trip_in_both_tiers_and_misses(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 1 << 20, 1 << 20)
    assert await store.put_many(ME, "sweep", [(k, entry(k)) for k in range(5)]) == 5
    got = await store.get_many(ME, "sweep", [4, 0, 9, 2])
    assert keys_of(got) == [4, 0, None, 2]
    assert got[0] == entry(4)
    (stats,) = store.statistics().caches
    assert (stats.name, stats.owner, stats.entries, stats.hits, stats.misses) == ("sweep", ME, 5, 3, 1)
    assert stats.bytes == 5 * len(entry(0))
    # A put went to NVMe only; a get promoted what it read to RAM.
    assert store.statistics().disk_entries == 5 and store.statistics().ram_entries == 3
    (segment,) = (tmp_path / str(ME) / "sweep").iterdir()
    segment.unlink()  # NVMe lost: what RAM holds is still served, the rest is a miss
    assert keys_of(await store.get_many(ME, "sweep", [0, 1, 2, 3, 4])) == [0, None, 2, None, 4]


async def test_a_put_of_views_is_written_before_it_returns(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 1 << 20, 1 << 20)
    buffer = bytearray(entry(1) + entry(2, 3000))  # as a client lays entries out in its ring
    with memoryview(buffer) as whole:
        views = [(1, whole[:len(entry(1))]), (2, whole[len(entry(1)):])]
        assert await store.put_many(ME, "c", views) == 2
        for _, view in views:
            view.release()
    buffer[:] = bytes(len(buffer))  # the ring is the client's again
    assert await store.get_many(ME, "c", [1, 2]) == [entry(1), entry(2, 3000)]


async def test_ram_takes_what_nvme_does_not(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:  # a free-space floor no filesystem is above
        store = await SampleStore.open(nursery, str(tmp_path), 1 << 20, 1 << 20, 1.0, admins=ADMINS)
    assert await store.put_many(ME, "c", [(k, entry(k)) for k in range(3)]) == 3
    assert await store.put_many(ME, "c", [(k, entry(k)) for k in range(3, 5)]) == 2
    floor = [r.getMessage() for r in caplog.records if "free-space floor" in r.getMessage()]
    assert len(floor) == 1 and "RAM only" in floor[0]  # an operator is told, once
    stats = store.statistics()
    assert (stats.ram_entries, stats.disk_entries, stats.dropped) == (5, 0, 0)
    assert keys_of(await store.get_many(ME, "c", [0, 1, 2])) == [0, 1, 2]
    # The payloads may be views of a buffer reused once the put returns: RAM keeps copies.
    buffer = bytearray(entry(7))
    with memoryview(buffer) as view:
        assert await store.put_many(ME, "c", [(7, view)]) == 1
    buffer[:] = bytes(len(buffer))
    assert await store.get_many(ME, "c", [7]) == [entry(7)]


async def test_ram_budget_holds_and_evicts_least_recently_used_without_a_plan(tmp_path: Path) -> None:
    size = 1000
    cost = len(entry(0, size)) + RAM_ENTRY_OVERHEAD
    store = await open_store(tmp_path, 10 * cost, 0)  # RAM only: evicted means gone
    await store.put_many(ME, "c", [(k, entry(k, size)) for k in range(10)])
    await store.get_many(ME, "c", [0, 1])  # 0 and 1 are now the most recently used
    for k in range(10, 14):
        await store.put_many(ME, "c", [(k, entry(k, size))])
        assert store.ram_used <= store.mem_limit
    got = keys_of(await store.get_many(ME, "c", list(range(14))))
    # The four least recently used (2..5) made room; 0 and 1 survived thanks to the reads.
    assert got == [0, 1, None, None, None, None, 6, 7, 8, 9, 10, 11, 12, 13]
    (stats,) = store.statistics().caches
    assert stats.evictions == 4 and stats.entries == 10


async def test_with_a_plan_unplanned_go_first_then_the_furthest_next_use(tmp_path: Path) -> None:
    size = 1000
    cost = len(entry(0, size)) + RAM_ENTRY_OVERHEAD
    store = await open_store(tmp_path, 8 * cost, 0)
    await store.put_many(ME, "c", [(k, entry(k, size)) for k in range(8)])
    # The next epoch reads 7, 6, 5, 4, 3 then 100..: 0, 1, 2 are not in it.
    plan = np.array([7, 6, 5, 4, 3, 100, 101, 102], dtype="<i8").tobytes()
    assert await store.plan(ME, "c", plan) == 8
    # Three planned newcomers take the room of the three unplanned entries, LRU or not.
    await store.get_many(ME, "c", [0, 1, 2])  # recently used, yet not planned
    await store.put_many(ME, "c", [(k, entry(k, size)) for k in (100, 101, 102)])
    resident: set[int] = {k for k in (0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102) if k in store._caches[(ME, "c")].entries}
    assert resident == {3, 4, 5, 6, 7, 100, 101, 102}
    # A planned newcomer needed sooner than the furthest resident one displaces it (Belady)...
    await store.plan(ME, "c", np.array([7, 6, 5, 4, 3, 200, 100, 101, 102], dtype="<i8").tobytes())
    await store.put_many(ME, "c", [(200, entry(200, size))])
    resident = set(store._caches[(ME, "c")].entries)
    assert 200 in resident and 102 not in resident and {3, 4, 5, 6, 7, 100, 101} <= resident
    # ...and one needed later than everything resident is not admitted.
    await store.plan(ME, "c", np.array([7, 6, 5, 4, 3, 200, 100, 101, 300], dtype="<i8").tobytes())
    assert await store.put_many(ME, "c", [(300, entry(300, size))]) == 0
    assert 300 not in store._caches[(ME, "c")].entries
    assert store.ram_used <= store.mem_limit


async def test_the_plans_of_several_processes_are_read_side_by_side(tmp_path: Path) -> None:
    """Two ranks of a node plan their halves of an epoch: both halves stay planned (each
    key at its position in its own rank's order).  A rank's next plan replaces its own
    only; the plan of a process that is gone is dropped."""
    size = 1000
    cost = len(entry(0, size)) + RAM_ENTRY_OVERHEAD
    store = await open_store(tmp_path, 6 * cost, 0)
    rank0 = subprocess.Popen(["sleep", "60"])
    try:
        rank1 = os.getpid()
        await store.put_many(ME, "c", [(k, entry(k, size)) for k in range(6)])
        assert await store.plan(ME, "c", np.array([0, 1, 2], dtype="<i8").tobytes(), source=rank0.pid) == 3
        assert await store.plan(ME, "c", np.array([3, 4, 9], dtype="<i8").tobytes(), source=rank1) == 3
        cache = store._caches[(ME, "c")]
        assert cache.plan is not None and cache.plan.length == 6
        assert [store._next_use(cache, k) for k in (0, 1, 2, 3, 4, 5, 9)] == [0, 1, 2, 0, 1, None, 2]
        # Over budget: 5, planned by neither rank, goes first; both ranks' entries stay.
        await store.put_many(ME, "c", [(9, entry(9, size))])
        assert set(cache.entries) == {0, 1, 2, 3, 4, 9}
        # Rank 1's next epoch replaces its own order, not rank 0's.
        await store.plan(ME, "c", np.array([4, 3], dtype="<i8").tobytes(), source=rank1)
        assert [store._next_use(cache, k) for k in (0, 1, 2, 3, 4, 9)] == [0, 1, 2, 1, 0, None]
        # Rank 0 is gone (an earlier run): the next plan drops its order.
        rank0.kill()
        rank0.wait()
        await store.plan(ME, "c", np.array([9], dtype="<i8").tobytes(), source=rank1)
        assert [store._next_use(cache, k) for k in (0, 1, 2, 3, 4, 9)] == [None] * 5 + [0]
        assert cache.plan is not None and cache.plan.length == 1 and store.planned_keys == 1
    finally:
        rank0.kill()
        rank0.wait()


async def test_a_consumed_planned_entry_becomes_unplanned(tmp_path: Path) -> None:
    size = 1000
    cost = len(entry(0, size)) + RAM_ENTRY_OVERHEAD
    store = await open_store(tmp_path, 4 * cost, 0)
    await store.put_many(ME, "c", [(k, entry(k, size)) for k in range(4)])
    await store.plan(ME, "c", np.arange(4, dtype="<i8").tobytes())
    await store.get_many(ME, "c", [0])  # the epoch read 0: its next use is unknown now
    await store.plan(ME, "c", np.arange(8, dtype="<i8").tobytes())  # the next epoch: 0 is planned again
    await store.get_many(ME, "c", [0])
    await store.put_many(ME, "c", [(4, entry(4, size))])
    assert 0 not in store._caches[(ME, "c")].entries  # the consumed one went first, not 3 (furthest)
    assert {1, 2, 3, 4} == set(store._caches[(ME, "c")].entries)


async def test_disk_budget_holds_in_accounting_and_on_disk(tmp_path: Path) -> None:
    sizes = [100, 5000, 20_000, 70_000]
    one = files.allocated_bytes(70_000)
    limit = 12 * one
    store = await open_store(tmp_path, 0, limit)
    rng = np.random.default_rng(3)
    for k in range(60):
        await store.put_many(ME, "c", [(k, entry(k, int(rng.choice(sizes))))])
        assert store.disk_used <= limit
    entries = store.statistics().disk_entries
    assert 0 < entries < 60
    # The segments really take no more than what was charged for them (the charge includes a metadata bound).
    files_bytes = sum(p.stat().st_blocks * 512 for p in (tmp_path / str(ME) / "c").rglob("*") if p.is_file())
    assert files_bytes <= store.disk_used - entries * files.ENTRY_CHARGE
    assert files_bytes == store.disk_used - entries * files.ENTRY_CHARGE  # exact: every entry is 4 KiB-rounded


async def test_a_batch_is_one_segment_and_evicted_entries_are_punched_out_of_it(tmp_path: Path) -> None:
    one = files.allocated_bytes(20_000)
    store = await open_store(tmp_path, 0, 10 * one)
    await store.put_many(ME, "c", [(k, entry(k, 20_000)) for k in range(8)])
    segment = located(store, ME, "c", 0)[0]
    assert [p for p in tmp_path.joinpath(str(ME), "c").iterdir()] == [segment]  # one file for the batch
    assert {located(store, ME, "c", k)[0] for k in range(8)} == {segment}
    assert [located(store, ME, "c", k)[1] % files.ALIGN for k in range(8)] == [0] * 8
    full = segment.stat().st_blocks * 512
    assert full == 8 * files.span(len(entry(0, 20_000)))
    # Five more entries need the room of three: the three least recently used go, punched.
    await store.put_many(ME, "c", [(k, entry(k, 20_000)) for k in range(8, 13)])
    assert store.disk_used <= store.disk_limit
    assert keys_of(await store.get_many(ME, "c", list(range(13)))) == [None] * 3 + list(range(3, 13))
    assert segment.stat().st_blocks * 512 == full - 3 * files.span(len(entry(0, 20_000)))
    assert segment.stat().st_size >= full - files.ALIGN  # holes: the survivors stay where they were
    # Its last entries go: the segment goes with them.
    await store.put_many(ME, "c", [(k, entry(k, 20_000)) for k in range(13, 18)])
    assert not segment.exists()
    assert keys_of(await store.get_many(ME, "c", list(range(8, 18)))) == list(range(8, 18))
    assert store.statistics().disk_entries == 10 and on_disk(tmp_path) <= store.disk_used


async def test_without_hole_punching_each_entry_is_a_segment_of_its_own(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holes, "punch", lambda fd, offset, length: (_ for _ in ()).throw(OSError(95, "no")))
    one = files.allocated_bytes(20_000)
    store = await open_store(tmp_path, 0, 4 * one)
    assert store.segment_entries == 1  # the start-up probe found no hole punching
    await store.put_many(ME, "c", [(k, entry(k, 20_000)) for k in range(4)])
    assert len(list((tmp_path / str(ME) / "c").iterdir())) == 4
    await store.put_many(ME, "c", [(k, entry(k, 20_000)) for k in range(4, 6)])  # two go: unlinked
    assert len(list((tmp_path / str(ME) / "c").iterdir())) == 4
    assert on_disk(tmp_path) <= store.disk_used <= store.disk_limit
    assert keys_of(await store.get_many(ME, "c", list(range(6)))) == [None, None, 2, 3, 4, 5]


async def test_a_rewritten_key_frees_its_older_range(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 0, 1 << 22)
    await store.put_many(ME, "c", [(k, entry(k, 9000)) for k in range(4)])
    first = located(store, ME, "c", 1)[0]
    before = first.stat().st_blocks
    await store.put_many(ME, "c", [(1, entry(1, 500))])
    assert await store.get_many(ME, "c", [1]) == [entry(1, 500)]
    assert located(store, ME, "c", 1)[0] != first
    assert first.stat().st_blocks * 512 == before * 512 - files.span(len(entry(1, 9000)))
    assert store.disk_used == sum(files.allocated_bytes(len(entry(k, 9000 if k != 1 else 500))) for k in range(4))


async def test_a_damaged_or_torn_entry_is_never_served_and_counted(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 0, 1 << 22)  # no RAM tier: every get reads NVMe
    for k in range(3):  # a segment each
        await store.put_many(ME, "c", [(k, entry(k, 3000))])
    await store.put_many(ME, "c", [(k, entry(k, 3000)) for k in range(10, 14)])  # one segment
    path, offset = located(store, ME, "c", 1)
    with open(path, "r+b") as f:  # one flipped payload bit
        f.seek(files.payload_offset(offset) + 2000)
        bit = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([bit ^ 0x01]))
    torn, at = located(store, ME, "c", 2)
    torn.write_bytes(torn.read_bytes()[:files.payload_offset(at) + 3000 - 100])  # a write cut short in the payload
    shared, offset = located(store, ME, "c", 12)
    with open(shared, "r+b") as f:  # a damaged header inside a segment of four
        f.seek(offset)
        f.write(b"XXXX")
    blocks = shared.stat().st_blocks
    assert keys_of(await store.get_many(ME, "c", [0, 1, 2, 10, 11, 12, 13])) == [0, None, None, 10, 11, None, 13]
    assert store.statistics().corrupt == 3
    assert not path.exists() and not torn.exists()  # their only entries went: so did they
    assert shared.stat().st_blocks * 512 == blocks * 512 - files.span(len(entry(12, 3000)))  # punched
    assert keys_of(await store.get_many(ME, "c", [1, 12])) == [None, None]  # forgotten: no second read
    assert store.statistics().corrupt == 3 and store.statistics().disk_entries == 4
    assert keys_of(await store.get_many(ME, "c", [10, 11, 13])) == [10, 11, 13]


async def test_a_restart_reuses_the_entries_and_discards_torn_files(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 1 << 20, 1 << 22)
    await store.put_many(ME, "sweep", [(k, entry(k)) for k in range(20)])
    await store.put_many(OTHER, "sweep", [(7, b"other")])
    used = store.disk_used
    torn, offset = located(store, ME, "sweep", 19)  # the batch's last entry
    torn.write_bytes(torn.read_bytes()[:offset + 10])  # its write cut short
    (tmp_path / "tmp" / "partial").write_bytes(b"x" * 100)  # a removal a crash interrupted
    old = tmp_path / str(ME) / "sweep" / "2a"  # an entry file of the previous layout
    old.mkdir()
    (old / "42").write_bytes(b"CFSM" + b"\0" * 100)

    again = await open_store(tmp_path, 1 << 20, 1 << 22)
    assert keys_of(await again.get_many(ME, "sweep", list(range(20)))) == list(range(19)) + [None]
    assert await again.get_many(OTHER, "sweep", [7]) == [b"other"]
    stats = again.statistics()
    assert stats.startup_discarded == 2 and stats.disk_entries == 20
    assert again.disk_used == used - files.allocated_bytes(len(entry(19)))
    assert not (tmp_path / "tmp" / "partial").exists() and not old.exists()
    # New segments never reuse an id found at start-up.
    await again.put_many(ME, "sweep", [(19, entry(19))])
    assert located(again, ME, "sweep", 19)[0] != torn and torn.exists()
    assert keys_of(await again.get_many(ME, "sweep", [0, 19])) == [0, 19]
    # A smaller budget at the next start: the excess is evicted at load.
    small = await open_store(tmp_path, 0, 5 * files.allocated_bytes(len(entry(0))))
    assert small.disk_used <= small.disk_limit and small.statistics().disk_entries == 5


async def test_a_restart_walks_segments_past_holes_junk_and_older_copies(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 0, 1 << 22)
    await store.put_many(ME, "c", [(k, entry(k, 9000)) for k in range(6)])
    first, _ = located(store, ME, "c", 0)
    await store.put_many(ME, "c", [(k, entry(k, 5000)) for k in (1, 4)])  # their first ranges: holes
    second, _ = located(store, ME, "c", 1)
    _, offset = located(store, ME, "c", 2)
    with open(first, "r+b") as f:  # a damaged header between live entries
        f.seek(offset)
        f.write(b"junk")
    again = await open_store(tmp_path, 0, 1 << 22)
    expected = [entry(0, 9000), entry(1, 5000), None, entry(3, 9000), entry(4, 5000), entry(5, 9000)]
    assert await again.get_many(ME, "c", list(range(6))) == expected
    assert again.statistics().startup_discarded == 1  # the damaged entry's range, punched
    sizes = {0: 9000, 1: 5000, 3: 9000, 4: 5000, 5: 9000}
    assert again.disk_used == sum(files.allocated_bytes(len(entry(k, n))) for k, n in sizes.items())
    assert on_disk(tmp_path) <= again.disk_used - 5 * files.ENTRY_CHARGE
    # A newer segment holding the same keys (a crash between a rewrite and the older
    # value's punch): the newer copies win, the older segment, left empty, goes.
    newer = second.with_name(str(int(second.name) + 10))
    newer.write_bytes(second.read_bytes())
    third = await open_store(tmp_path, 0, 1 << 22)
    assert await third.get_many(ME, "c", list(range(6))) == expected
    assert third.statistics().startup_discarded == 2 and not second.exists() and newer.exists()
    assert located(third, ME, "c", 4)[0] == newer and third.disk_used == again.disk_used


async def test_a_restart_frees_an_entry_beyond_the_index_fields(tmp_path: Path) -> None:
    """The index packs an entry's offset in 40 bits: a segment this store never wrote with
    a valid entry past 1 TiB (sparse) is not indexed but freed, never served."""
    store = await open_store(tmp_path, 0, 1 << 22)
    await store.put_many(ME, "c", [(5, entry(5))])
    segment, offset = located(store, ME, "c", 5)
    data = segment.read_bytes()[offset:offset + files.span(len(entry(5)))]
    far = segment.with_name(str(int(segment.name) + 10))
    with open(far, "wb") as f:
        f.seek(1 << 40)
        f.write(data)
    segment.unlink()
    assert far.stat().st_blocks
    again = await open_store(tmp_path, 0, 1 << 22)
    assert await again.get_many(ME, "c", [5]) == [None]
    assert again.statistics().startup_discarded == 1 and again.statistics().disk_entries == again.disk_used == 0
    assert far.stat().st_blocks == 0  # its range punched


async def test_owners_namespaces_sharing_and_drop(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 1 << 20, 1 << 22, shared=frozenset({(ME, "public")}))
    await store.put_many(ME, "private", [(1, b"mine")])
    await store.put_many(ME, "public", [(1, b"for all")])
    await store.put_many(OTHER, "private", [(1, b"theirs")])
    # The same name is two caches: each user sees their own.
    assert await store.get_many(ME, "private", [1]) == [b"mine"]
    assert await store.get_many(OTHER, "private", [1]) == [b"theirs"]
    # Another user's cache: readable only when shared, never writable.
    with pytest.raises(Forbidden):
        await store.get_many(OTHER, f"~{ME}/private", [1])
    assert await store.get_many(OTHER, f"~{ME}/public", [1]) == [b"for all"]
    for op in ("put", "plan"):
        with pytest.raises(Forbidden):
            if op == "put":
                await store.put_many(OTHER, f"~{ME}/public", [(1, b"overwritten")])
            else:
                await store.plan(OTHER, f"~{ME}/public", b"\0" * 8)
    assert await store.get_many(ME, "public", [1]) == [b"for all"]
    # Root reads anything, writes only its own namespace; drops: owner or root only.
    assert await store.get_many(0, f"~{ME}/private", [1]) == [b"mine"]
    with pytest.raises(Forbidden):
        await store.drop(OTHER, f"~{ME}/public")
    for bad in ("", ".", "..", "a/b", "x" * 129, f"~{ME}/..", 7):
        with pytest.raises(BadRequest):
            await store.get_many(ME, bad, [1])
    assert await store.drop(0, f"~{ME}/private") == (1, 4)
    assert not (tmp_path / str(ME) / "private").exists()
    with pytest.raises(NotFound):
        await store.drop(ME, "private")
    assert await store.get_many(ME, "private", [1]) == [None]  # a new, empty cache
    assert store.statistics().disk_entries == 2


async def test_puts_while_loading_are_dropped_and_gets_miss(tmp_path: Path) -> None:
    first = await open_store(tmp_path, 1 << 20, 1 << 22)
    await first.put_many(ME, "c", [(1, b"x")])
    store = SampleStore(str(tmp_path), 1 << 20, 1 << 22, 0.0, admins=ADMINS)  # not loaded yet
    assert await store.put_many(ME, "c", [(2, b"y")]) == 0
    assert await store.get_many(ME, "c", [1]) == [None]
    assert store.statistics().dropped == 1
    assert len(list((tmp_path / str(ME) / "c").iterdir())) == 1  # the first store's segment, untouched


async def test_accounting_stays_exact_under_concurrent_puts_gets_and_a_drop(tmp_path: Path) -> None:
    one = files.allocated_bytes(20_000)
    store = await open_store(tmp_path, 30 * (20_000 + RAM_ENTRY_OVERHEAD), 40 * one)
    rng = np.random.default_rng(11)
    halfway = trio.Event()
    done = trio.Event()
    dropped: list[tuple[int, int]] = []

    async def writer(name: str, start: int) -> None:
        for i in range(30):
            if i == 10 and name == "a":
                halfway.set()
            if i == 20 and name == "a":
                await done.wait()  # its last puts make "a" anew (those during the drop were dropped)
            keys = [int(k) for k in rng.integers(start, start + 200, 8)]
            await store.put_many(ME, name, [(k, entry(k, int(rng.integers(1, 20_000)))) for k in keys])
            await store.get_many(ME, name, keys[:4])
            assert store.disk_used <= store.disk_limit and store.ram_used <= store.mem_limit

    async def dropper() -> None:
        await halfway.wait()  # mid-way: every writer is still putting, "a" too (it makes "a" anew)
        dropped.append(await store.drop(ME, "a"))
        done.set()

    async with trio.open_nursery() as nursery:
        for name, start in (("a", 0), ("b", 1000), ("c", 2000)):
            nursery.start_soon(writer, name, start)
        nursery.start_soon(dropper)
    assert dropped and dropped[0][0] > 0
    stats = store.statistics()
    caches = {c.name: c for c in stats.caches}
    assert set(caches) == {"a", "b", "c"}
    entries = [(c, k, w) for c in store._caches.values() for k, w in c.entries.items()]
    assert all(k in c.entries for c in store._caches.values() for k in c.ram)  # a RAM copy is of an entry
    assert store.ram_used == sum(len(data) + RAM_ENTRY_OVERHEAD for c in store._caches.values() for _, data in c.ram.items())
    assert store.disk_used == sum(index.charge_of(w) for _, _, w in entries)
    assert stats.disk_entries == sum(1 for _, _, w in entries if index.charge_of(w))
    segments = {Path(files.segment_path(store.root, c.owner, c.name, s)): n
                for c in store._caches.values() for s, n in c.segments.live.items()}
    assert sum(segments.values()) == stats.disk_entries
    assert all(n == sum(1 for _, _, w in entries if index.charge_of(w) and index.segment_of(w) == int(p.name))
               for p, n in segments.items())
    # Every counted segment exists, no segment is uncounted, and they take no more than charged.
    assert {p for p in tmp_path.rglob("*") if p.is_file()} == set(segments)
    assert on_disk(tmp_path) <= store.disk_used
    assert sum(c.disk_bytes for c in caches.values()) == store.disk_used


async def test_plans_are_bounded_node_wide_the_least_recently_planned_go(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from cubefs_fuse.samples import store as store_module

    monkeypatch.setattr(store_module, "MAX_SAMPLE_PLANNED_KEYS", 10)
    store = await open_store(tmp_path, 1 << 20, 0)
    await store.put_many(ME, "first", [(k, entry(k)) for k in range(6)])
    await store.plan(ME, "first", np.arange(6, dtype="<i8").tobytes())
    first = store._caches[(ME, "first")]
    assert store.ram_policy.next_use(store_module._PK.pack(3, first.id)) == 3
    await store.plan(OTHER, "second", np.arange(4, dtype="<i8").tobytes())  # 6 + 4 fit
    assert store.planned_keys == 10
    await store.plan(ME, "third", np.arange(5, dtype="<i8").tobytes())  # the oldest plan goes
    planned = {c.name: c.planned for c in store.statistics().caches}
    assert planned == {"first": 0, "second": 4, "third": 5} and store.planned_keys == 9
    assert store.ram_policy.next_use(store_module._PK.pack(3, first.id)) is None  # its entries are unplanned
    await store.drop(ME, "third")
    assert store.planned_keys == 4


async def test_a_new_value_that_finds_no_room_on_nvme_takes_the_old_file_with_it(tmp_path: Path) -> None:
    one = files.allocated_bytes(4000)
    store = await open_store(tmp_path, 0, 3 * one)
    await store.put_many(ME, "c", [(1, entry(1, 4000))])
    await store.plan(ME, "c", np.array([2, 3, 1], dtype="<i8").tobytes())
    await store.put_many(ME, "c", [(2, entry(2, 4000)), (3, entry(3, 4000))])
    # A new, larger value of 1 would need more than its own room; 2 and 3 are needed sooner.
    assert await store.put_many(ME, "c", [(1, entry(1, 9000))]) == 0
    assert keys_of(await store.get_many(ME, "c", [1])) == [None]  # never the old value
    assert len(list((tmp_path / str(ME) / "c").iterdir())) == 1  # the one of 2 and 3: 1's went with its value
    assert store.disk_used == 2 * one and store.statistics().disk_entries == 2


async def test_one_caches_policy_keys_spread_over_every_shard(tmp_path: Path) -> None:
    """The policies' hash tables are split by a key's first byte so that none is ever
    rebuilt whole: one cache's consecutive keys must land in every shard, not one."""
    store = await open_store(tmp_path, 1 << 20, 4 << 20)
    assert await store.put_many(ME, "sweep", [(k, entry(k, 100)) for k in range(512)]) == 512
    used = [len(keys) for keys in map(store.disk_policy.shard_keys, range(256)) if keys]
    assert len(used) == 256 and max(used) == 2


async def test_many_entries_make_no_gc_tracked_object_and_no_large_dict(tmp_path: Path) -> None:
    """A node-wide cache holds ~10^6 entries: none may be an object the garbage collector
    walks (a full collection would visit each on the trio thread), and no dict may hold a
    large share of them (a dict is rebuilt whole when it grows)."""
    count = 50_000
    store = await open_store(tmp_path, 1 << 30, 0)
    gc.collect()
    before = len(gc.get_objects())
    for start in range(0, count, 2048):
        batch = [(k, entry(k, 8)) for k in range(start, min(start + 2048, count))]
        assert await store.put_many(ME, "big", batch) == len(batch)
    del batch
    gc.collect()
    assert len(gc.get_objects()) - before < count // 100  # a few containers, nothing per entry
    cache = store._caches[(ME, "big")]
    assert len(cache.entries) == len(cache.ram) == store.ram_entries == count
    shards: list[Sized] = [*cache.entries.shards, *cache.ram.shards]
    assert not any(gc.is_tracked(shard) for shard in shards)
    assert len(store.ram_policy) == count and not gc.is_tracked(store.ram_policy)  # C records, no objects
    assert max(len(shard) for shard in shards) <= count // 100
    # Keys are int64: negative ones shard as well, and read back.
    assert await store.put_many(ME, "big", [(-1, entry(1)), (-(2**63), entry(2))]) == 2
    assert keys_of(await store.get_many(ME, "big", [-1, -(2**63), 7])) == [1, 2, 7]
    assert set(cache.entries) == set(cache.ram) == {*range(count), -1, -(2**63)}  # keys come back whole
    # A drop walks the shards in steps and leaves them empty.
    assert await store.drop(ME, "big") == (count + 2, 16 * count + 2 * 1008)
    assert not any(cache.entries.shards) and not any(cache.ram.shards) and store.ram_used == store.ram_entries == 0


def ring(size: int) -> tuple[object, memoryview]:
    import mmap
    memory = mmap.mmap(-1, size)
    return memory, memoryview(memory)


async def test_get_into_reads_nvme_entries_into_the_destination_at_block_boundaries(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 1 << 20, 1 << 20)
    assert await store.put_many(ME, "c", [(k, entry(k, 5000 + k)) for k in range(4)]) == 4
    assert keys_of(await store.get_many(ME, "c", [1])) == [1]  # 1 is in RAM now, the rest on NVMe only
    _, dest = ring(1 << 20)
    layout, copies = await store.get_into(ME, "c", [0, 1, 9, 2], dest)
    assert layout[2] is None and all(place is not None for i, place in enumerate(layout) if i != 2)
    # NVMe entries were read there, each at a 4 KiB boundary; the RAM one is handed back to copy.
    assert [offset for offset, _ in copies] == [layout[1][0]] and copies[0][1] == entry(1, 5001)  # type: ignore[index]
    for key in (0, 2):
        offset, length = layout[[0, 1, 9, 2].index(key)]  # type: ignore[misc]
        assert offset % files.ALIGN == 0 and bytes(dest[offset:offset + length]) == entry(key, 5000 + key)
    spans = sorted((o, o + (files.up(n) if i != 1 else n)) for i, (o, n) in enumerate(p for p in layout if p))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two overlap
    # What was read from NVMe entered RAM (a private copy, not the destination's bytes).
    dest[:] = bytes(len(dest))
    assert store.statistics().ram_entries == 3
    assert await store.get_many(ME, "c", [0, 2]) == [entry(0, 5000), entry(2, 5002)]
    (stats,) = store.statistics().caches
    assert (stats.hits, stats.misses) == (1 + 3 + 2, 1)


async def test_get_into_answers_the_prefix_that_fits(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 0, 1 << 20)  # NVMe only: every entry is read into the destination
    assert await store.put_many(ME, "c", [(k, entry(k, 6000)) for k in range(5)]) == 5
    _, dest = ring(5 * files.ALIGN)  # 6008 bytes take 2 blocks: two entries fit, not three
    layout, copies = await store.get_into(ME, "c", [3, 1, 4], dest)
    assert copies == [] and [p[0] for p in layout if p] == [0, 2 * files.ALIGN] and len(layout) == 2
    assert bytes(dest[:6008]) == entry(3, 6000)
    (stats,) = store.statistics().caches
    assert (stats.hits, stats.misses) == (2, 0)  # only what was answered is counted
    # An entry larger than the whole destination is a miss, never written past its end.
    _, small = ring(files.ALIGN)
    assert await store.get_into(ME, "c", [0], small) == ([None], [])


async def test_get_into_frees_an_entry_damaged_on_nvme(tmp_path: Path) -> None:
    store = await open_store(tmp_path, 0, 1 << 20)
    assert await store.put_many(ME, "c", [(1, entry(1, 9000))]) == 1
    segment, offset = located(store, ME, "c", 1)
    with open(segment, "r+b") as f:
        f.seek(files.payload_offset(offset) + 50)
        f.write(b"\xff")
    _, dest = ring(1 << 20)
    assert await store.get_into(ME, "c", [1], dest) == ([None], [])
    assert store.corrupt == 1 and store.statistics().disk_entries == 0
