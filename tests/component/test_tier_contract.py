"""The block tiers' contract, one suite run over both (``MemoryTier`` and ``DiskTier``, the
``tier.Tier`` protocol): a stored block reads back as a hit and an absent one is a miss,
membership counts nothing, the limit holds after every put with the least recently read
block going first, plans keep what is read sooner (unplanned blocks go before planned ones,
then the furthest next use), a block nothing may make room for is rejected and counted, and
tags come back shard by shard. Each test asserts the tier's hit, miss, eviction and
rejection counts.  The sample store's two tiers (RAM, NVMe) share a contract too: its get
hits and misses, its put keeps what fits, and its budget holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
import pytest
import trio

from cubefs_fuse.cache import disk as disk_module
from cubefs_fuse.cache.disk import DiskTier, allocated_bytes
from cubefs_fuse.cache.holes import ALLOCATION_UNIT
from cubefs_fuse.cache.memory import MemoryTier
from cubefs_fuse.cache.shards import first_byte
from cubefs_fuse.samples import files
from cubefs_fuse.samples.store import RAM_ENTRY_OVERHEAD, SampleStore

# A payload that fills one allocation unit with the NVMe header: the RAM tier's limit and
# the NVMe tier's allocated bytes then both hold exactly CAPACITY blocks.
PAYLOAD = 4096 - 40
CAPACITY = 3
TIERS = ["ram", "nvme"]


class Subject:
    """One tier behind one interface: the contract's reads and writes, awaited alike."""

    def __init__(self, tier: MemoryTier | DiskTier) -> None:
        self.tier = tier

    async def put(self, key: bytes, *, next_use: int | None = None, tag: int = 0) -> bool:
        if isinstance(self.tier, DiskTier):
            return await self.tier.put(key, _data(key), next_use=next_use, tag=tag)
        return self.tier.put(key, _data(key), next_use=next_use, tag=tag)

    async def get(self, key: bytes) -> bytes | None:
        if isinstance(self.tier, DiskTier):
            return await self.tier.get(key)
        return self.tier.get(key)

    def counts(self) -> tuple[int, int, int, int, int]:
        """(hits, misses, evictions, inserts, rejected)."""
        s = self.tier.statistics()
        return s.hits, s.misses, s.evictions, s.inserts, s.rejected

    def holds(self) -> set[bytes]:
        return {key for key in map(_key, range(16)) if key in self.tier}

    def within_limit(self) -> bool:
        return self.tier.used_bytes <= self.tier.limit_bytes


def _key(n: int) -> bytes:
    return bytes([n * 37 % 256]) + n.to_bytes(15, "little")


def _data(key: bytes) -> bytes:
    return key[:1] * PAYLOAD


@asynccontextmanager
async def open_tier(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Subject]:
    if kind == "ram":
        yield Subject(MemoryTier(CAPACITY * PAYLOAD, scratch_bytes=0))
        return
    # Segments of 4 units need no extent-tree room (segment_slack), so the NVMe tier holds
    # exactly CAPACITY blocks, as the RAM tier does, however many it has written.
    monkeypatch.setattr(disk_module, "SEGMENT_BYTES", 4 * ALLOCATION_UNIT)
    disk = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    # Room for CAPACITY blocks beside what the empty tier counts (its directory).
    disk.limit_bytes = disk.used_bytes + CAPACITY * allocated_bytes(PAYLOAD)
    disk.index.scratch_bytes = 0  # as the RAM tier's: an unplanned block never displaces a planned one
    try:
        yield Subject(disk)
    finally:
        await disk.close()


@pytest.mark.parametrize("kind", TIERS)
async def test_a_stored_block_is_a_hit_an_absent_one_a_miss(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_tier(kind, tmp_path, monkeypatch) as t:
        a, b = _key(0), _key(1)
        assert await t.put(a)
        assert a in t.tier and b not in t.tier  # membership counts nothing
        assert t.counts() == (0, 0, 0, 1, 0)
        assert await t.get(a) == _data(a)
        assert await t.get(b) is None
        assert await t.get(a) == _data(a)
        assert t.counts() == (2, 1, 0, 1, 0)


@pytest.mark.parametrize("kind", TIERS)
async def test_the_limit_holds_and_the_least_recently_read_goes_first(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_tier(kind, tmp_path, monkeypatch) as t:
        keys = [_key(n) for n in range(5)]
        for key in keys[:3]:
            assert await t.put(key) and t.within_limit()
        assert await t.get(keys[0]) == _data(keys[0])  # read: now the most recent
        assert await t.put(keys[3]) and t.within_limit()
        assert t.holds() == {keys[0], keys[2], keys[3]}  # keys[1] was the least recently read
        assert await t.put(keys[4]) and t.within_limit()
        assert t.holds() == {keys[0], keys[3], keys[4]}
        assert await t.get(keys[1]) is None and await t.get(keys[2]) is None
        assert t.counts() == (1, 2, 2, 5, 0)


@pytest.mark.parametrize("kind", TIERS)
async def test_plans_keep_what_is_read_sooner(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_tier(kind, tmp_path, monkeypatch) as t:
        a, b, c, d, e, f, g = (_key(n) for n in range(7))
        for key in (a, b, c):
            assert await t.put(key, tag=first_byte(key) + 1)
        t.tier.plan(a, 10)
        t.tier.plan(b, 5)
        assert await t.put(d)  # the one unplanned block goes first
        assert t.holds() == {a, b, d}
        assert await t.put(e, next_use=7)  # unplanned before planned
        assert t.holds() == {a, b, e}
        assert await t.put(f, next_use=1)  # then the furthest next use
        assert t.holds() == {b, e, f}
        assert not await t.put(g)  # every resident block is read sooner than an unplanned one
        assert not await t.put(g, next_use=9)  # and sooner than at 9
        assert t.holds() == {b, e, f} and t.within_limit()
        assert t.counts() == (0, 0, 3, 6, 2)
        assert not t.tier.unplan_some(16)  # none planned any more: the next block takes room again
        assert await t.put(g)
        assert len(t.holds()) == CAPACITY and g in t.tier
        assert t.counts() == (0, 0, 4, 7, 2)


@pytest.mark.parametrize("kind", TIERS)
async def test_tags_come_back_shard_by_shard_and_unplan_is_no_read(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_tier(kind, tmp_path, monkeypatch) as t:
        keys = [_key(n) for n in range(3)]
        for key in keys:
            assert await t.put(key, next_use=first_byte(key), tag=first_byte(key) + 1)
        for key in keys:
            shard_keys, tags = t.tier.tagged_shard(first_byte(key))
            assert dict(zip(shard_keys, tags))[key] == first_byte(key) + 1
            t.tier.unplan(key)
        assert t.counts() == (0, 0, 0, 3, 0)


@pytest.mark.parametrize("kind", TIERS)
async def test_a_block_larger_than_the_tier_is_rejected(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_tier(kind, tmp_path, monkeypatch) as t:
        assert await t.put(_key(0))
        big = _key(9)
        data = b"x" * (CAPACITY + 1) * 4096
        stored = (await t.tier.put(big, data) if isinstance(t.tier, DiskTier) else t.tier.put(big, data))
        assert not stored and big not in t.tier and _key(0) in t.tier
        assert await t.get(big) is None
        assert t.counts() == (0, 1, 0, 1, 1)


# -- the sample store's two tiers -----------------------------------------------------------

SAMPLE = 10_000  # bytes of a sample: any size works, this one spans three allocation units
SAMPLE_TIERS = ["ram", "nvme"]
UID = 1000  # the caller: any uid, the store scopes names by it


async def _open_store(kind: str, tmp_path: Path, nursery: trio.Nursery) -> SampleStore:
    """A store whose one tier holds 3 samples of SAMPLE bytes (the other tier off)."""
    if kind == "ram":
        return await SampleStore.open(nursery, str(tmp_path), 3 * (SAMPLE + RAM_ENTRY_OVERHEAD), 0, 0.0)
    store = await SampleStore.open(nursery, str(tmp_path), 0, 3 * files.allocated_bytes(SAMPLE), 0.0)
    while not store.loaded:  # its (empty) NVMe scan, in the background
        await trio.sleep(0.01)
    return store


def _sample(key: int) -> bytes:
    return bytes([key % 251]) * SAMPLE


@pytest.mark.parametrize("kind", SAMPLE_TIERS)
async def test_a_sample_tier_hits_misses_and_keeps_its_budget(kind: str, tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        store = await _open_store(kind, tmp_path, nursery)
        assert await store.put_many(UID, "c", [(k, _sample(k)) for k in range(3)]) == 3
        assert await store.get_many(UID, "c", [0, 1, 2, 3]) == [_sample(0), _sample(1), _sample(2), None]
        stats = store.statistics()
        (cache,) = stats.caches
        assert (cache.hits, cache.misses, cache.evictions) == (3, 1, 0)
        assert await store.put_many(UID, "c", [(k, _sample(k)) for k in range(3, 5)]) == 2
        assert (await store.get_many(UID, "c", list(range(5)))).count(None) == 2  # two went to make room
        stats = store.statistics()
        (cache,) = stats.caches
        assert (cache.hits, cache.misses, cache.evictions) == (6, 3, 2)
        assert stats.ram_used_bytes <= stats.ram_limit_bytes and stats.disk_used_bytes <= stats.disk_limit_bytes
        assert cache.entries == 3
        nursery.cancel_scope.cancel()
