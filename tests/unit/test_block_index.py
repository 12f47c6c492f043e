"""BlockIndex (cache/_index.c): a tier's blocks and their eviction order: LRU without
plans, Belady with them.

The randomized test drives BlockIndex and a deliberately naive reference model (lists and
sorts, no heap, no linked lists) with the same operations and checks that they choose the
same victims and the same eviction order, and that every internal invariant holds
(``check()``), so the C heap, lists and hash tables cannot drift from the rules.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field

import pytest

from cubefs_fuse.cache._index import BlockIndex
from cubefs_fuse.cache.memory import MemoryTier

SIZE = 10  # every block in these tests has the same size unless said otherwise


def k(i: int) -> bytes:
    """Key number ``i``: 16 bytes, ordered as ``i`` (equal next uses go in key order)."""
    return i.to_bytes(16, "big")


def admit(p: BlockIndex, key: bytes, size: int, free: int, next_use: int | None) -> list[bytes] | None:
    """What MemoryTier.put does with the index: evict the victims, then add."""
    victims = p.victims(size, free, next_use)
    if victims is not None:
        for v in victims:
            p.remove(v)
        p.add(key, size, next_use)
    return victims


def test_without_plans_it_is_lru() -> None:
    p = BlockIndex(scratch_bytes=0)
    for i in range(4):
        p.add(k(i), SIZE)
    p.touch(k(0))  # 0 becomes the most recently used: 1 is now the oldest
    assert p.victims(SIZE, 0, None) == [k(1)]
    assert p.victims(2 * SIZE, 0, None) == [k(1), k(2)]
    assert p.victims(4 * SIZE, 0, None) == [k(1), k(2), k(3), k(0)]
    assert p.victims(SIZE, SIZE, None) == []  # it fits: nothing to evict
    assert p.victims(5 * SIZE, 0, None) is None  # not enough even with everything gone
    assert len(p) == 4 and p.unplanned_bytes == 4 * SIZE and p.planned_bytes == 0


def test_unplanned_blocks_go_before_planned_ones() -> None:
    p = BlockIndex(scratch_bytes=0)
    p.add(k(0), SIZE, next_use=100)  # planned, far in the future
    p.add(k(1), SIZE)  # unplanned, more recent than 0
    p.add(k(2), SIZE, next_use=5)
    p.add(k(3), SIZE)
    # Both unplanned first (oldest first), then the planned one needed furthest away.
    assert p.victims(3 * SIZE, 0, next_use=1) == [k(1), k(3), k(0)]


def test_planned_blocks_go_furthest_next_use_first() -> None:
    p = BlockIndex(scratch_bytes=0)
    for i, use in enumerate((40, 10, 30, 20)):
        p.add(k(i), SIZE, next_use=use)
    assert p.victims(SIZE, 0, next_use=0) == [k(0)]
    assert p.victims(3 * SIZE, 0, next_use=0) == [k(0), k(2), k(3)]
    # victims() removes nothing: the same question gets the same answer.
    assert p.victims(3 * SIZE, 0, next_use=0) == [k(0), k(2), k(3)]
    p.plan(k(1), 50)  # re-planning moves a block
    assert p.victims(SIZE, 0, next_use=0) == [k(1)]
    assert p.next_use(k(1)) == 50 and p.next_use(k(0)) == 40


def test_planned_newcomer_never_displaces_blocks_needed_sooner() -> None:
    p = BlockIndex(scratch_bytes=1000)
    for i, use in enumerate((10, 20, 30)):
        p.add(k(i), SIZE, next_use=use)
    assert p.victims(SIZE, 0, next_use=35) is None  # needed after everything resident
    assert p.victims(SIZE, 0, next_use=30) is None  # ties are not displaced either
    assert p.victims(SIZE, 0, next_use=25) == [k(2)]
    assert p.victims(2 * SIZE, 0, next_use=25) is None  # only 30 is later than 25
    assert p.victims(2 * SIZE, 0, next_use=15) == [k(2), k(1)]
    # A refusal leaves the heap intact: the same entries are still found.
    assert p.victims(3 * SIZE, 0, next_use=0) == [k(2), k(1), k(0)]


def test_unplanned_newcomer_limited_by_scratch() -> None:
    p = BlockIndex(scratch_bytes=2 * SIZE)
    for i, use in enumerate((10, 20, 30)):
        p.add(k(i), SIZE, next_use=use)
    # Within the scratch room an unplanned block may take the furthest planned block.
    assert p.victims(SIZE, 0, None) == [k(2)]
    assert p.victims(2 * SIZE, 0, None) == [k(2), k(1)]
    assert p.victims(3 * SIZE, 0, None) is None  # over the scratch room
    # With unplanned blocks resident, those go first and count toward the newcomer's room.
    p.add(k(9), SIZE)
    assert p.victims(2 * SIZE, 0, None) == [k(9), k(2)]
    assert p.victims(3 * SIZE, 0, None) is None


def test_unplan_makes_a_block_the_most_recent_unplanned() -> None:
    p = BlockIndex(scratch_bytes=0)
    p.add(k(0), SIZE)
    p.add(k(1), SIZE, next_use=3)
    p.add(k(2), SIZE)
    p.unplan(k(1))  # consumed: evicted before anything planned, after older unplanned blocks
    assert p.next_use(k(1)) is None
    assert p.victims(3 * SIZE, 0, None) == [k(0), k(2), k(1)]
    p.add(k(3), SIZE, next_use=1)
    assert not p.unplan_some(100)
    assert p.planned_bytes == 0 and p.unplanned_bytes == 4 * SIZE
    assert p.victims(SIZE, 0, next_use=0) == [k(0)]


def test_memory_tier_keeps_its_limit_and_refuses_later_needed_blocks() -> None:
    tier = MemoryTier(3 * SIZE, scratch_bytes=0)
    for i, use in enumerate((1, 2, 3)):
        assert tier.put(k(i), b"x" * SIZE, next_use=use)
    assert not tier.put(k(9), b"x" * SIZE, next_use=7)  # needed after everything resident
    assert tier.statistics().rejected == 1 and k(9) not in tier
    assert tier.put(k(8), b"x" * SIZE, next_use=0)  # needed first: displaces position 3
    assert k(2) not in tier and k(8) in tier and tier.used_bytes == 3 * SIZE
    assert not tier.put(k(7), b"x" * SIZE)  # unplanned, no scratch room
    tier.unplan(k(0))  # consumed
    assert tier.put(k(7), b"x" * SIZE)  # takes the consumed block's room
    assert k(0) not in tier and tier.used_bytes <= tier.limit_bytes
    assert tier.statistics().planned_bytes == 2 * SIZE


# -- randomized comparison with a reference model ------------------------------------------


@dataclass
class Reference:
    """The rules of cache/_index.c written as plainly as possible."""

    scratch: int
    unplanned: list[tuple[bytes, int]] = field(default_factory=list)  # oldest first
    planned: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> (next_use, size)

    def remove(self, key: bytes) -> None:
        self.unplanned = [(u, s) for u, s in self.unplanned if u != key]
        self.planned.pop(key, None)

    def add(self, key: bytes, size: int, next_use: int | None) -> None:
        self.remove(key)
        if next_use is None:
            self.unplanned.append((key, size))
        else:
            self.planned[key] = (next_use, size)

    def size_of(self, key: bytes) -> int | None:
        for u, s in self.unplanned:
            if u == key:
                return s
        entry = self.planned.get(key)
        return entry[1] if entry else None

    def touch(self, key: bytes) -> None:
        size = self.size_of(key)
        if key not in self.planned and size is not None:
            self.add(key, size, None)

    def plan(self, key: bytes, next_use: int) -> None:
        size = self.size_of(key)
        if size is None or (key in self.planned and self.planned[key][0] == next_use):
            return
        self.add(key, size, next_use)

    def unplan(self, key: bytes) -> None:
        if key in self.planned:
            self.add(key, self.planned[key][1], None)

    def eviction_order(self) -> list[bytes]:
        """Planned keys: furthest next use first; among equals, in key order."""
        return sorted(self.planned, key=lambda key: (-self.planned[key][0], key))

    def order(self) -> list[bytes]:
        return [key for key, _ in self.unplanned] + self.eviction_order()

    def victims(self, need: int, free: int, next_use: int | None) -> list[bytes] | None:
        out: list[bytes] = []
        if need <= free:
            return out
        for key, size in self.unplanned:
            out.append(key)
            free += size
            if need <= free:
                return out
        if next_use is None and need > self.scratch:
            return None
        # Furthest next use first; among equals, in key order.
        for key in self.eviction_order():
            use, size = self.planned[key]
            if next_use is not None and use <= next_use:
                return None
            out.append(key)
            free += size
            if need <= free:
                return out
        return None


def check_consistent(p: BlockIndex, ref: Reference) -> None:
    assert len(p) == len(ref.unplanned) + len(ref.planned)
    assert p.unplanned_bytes == sum(s for _, s in ref.unplanned)
    assert p.planned_bytes == sum(e[1] for e in ref.planned.values())
    for key, (use, _) in ref.planned.items():
        assert p.next_use(key) == use
    for key, _ in ref.unplanned:
        assert key in p and p.next_use(key) is None
    # The whole eviction order, not just the victims of one admission.
    assert p.order() == ref.order()
    p.check()  # white box: lists, heap positions and order, tables, counts


def test_randomized_churn_matches_the_reference_model() -> None:
    rng = random.Random(20240601)  # fixed seed: a failure reproduces
    limit = 400  # bytes of the simulated tier; blocks are 5..40 bytes, so ~20 resident
    scratch = 45
    p, ref = BlockIndex(scratch), Reference(scratch)
    used = 0
    decisions = {"admitted": 0, "refused": 0, "evicted": 0}
    for step in range(20_000):
        key = k(rng.randrange(60))  # 60 keys for ~20 slots: constant eviction pressure
        op = rng.random()
        if op < 0.45:
            size = rng.randrange(5, 41)
            next_use = rng.randrange(50) if rng.random() < 0.7 else None
            # A put replaces an existing block first (as MemoryTier.put does).
            if key in p:
                assert ref.size_of(key) is not None
                used -= p.remove(key)
                ref.remove(key)
            expected = ref.victims(size, limit - used, next_use)
            got = p.victims(size, limit - used, next_use)
            assert got == expected, f"step {step}"
            if got is None:
                decisions["refused"] += 1
                continue
            for v in got:
                used -= p.remove(v)
                ref.remove(v)
            decisions["evicted"] += len(got)
            p.add(key, size, next_use)
            ref.add(key, size, next_use)
            used += size
            decisions["admitted"] += 1
            assert used <= limit
        elif op < 0.6:
            p.touch(key)
            ref.touch(key)
        elif op < 0.8:
            use = rng.randrange(50)
            p.plan(key, use)
            ref.plan(key, use)
        elif op < 0.9:
            p.unplan(key)
            ref.unplan(key)
        elif op < 0.985:
            used -= p.remove(key)
            ref.remove(key)
        elif op < 0.995:
            count = rng.randrange(1, 8)
            assert p.unplan_some(count) == (len(ref.planned) > count)
            for key2 in ref.eviction_order()[:count]:  # the furthest next use first
                ref.unplan(key2)
        else:
            while p.unplan_some(5):
                pass
            for key2 in ref.eviction_order():
                ref.unplan(key2)
        if step % 97 == 0:
            check_consistent(p, ref)
    check_consistent(p, ref)
    # The run exercised every branch: admissions, refusals and evictions.
    assert min(decisions.values()) > 100, decisions


def test_a_block_replanned_to_an_earlier_position_is_evicted_once() -> None:
    # Regression: heap entries were matched to blocks by next_use alone, so a block
    # planned at 12, then 5, 7 and 12 again had two "live" entries and was returned twice
    # as a victim; MemoryTier then failed with KeyError evicting it the second time.
    tier = MemoryTier(3 * SIZE, scratch_bytes=0)
    for i in range(3):
        assert tier.put(k(i), b"x" * SIZE, next_use=10 + i)
    tier.plan(k(2), 5)
    tier.plan(k(2), 7)
    tier.plan(k(2), 12)
    assert tier.index.victims(2 * SIZE, 0, next_use=0) == [k(2), k(1)]
    assert tier.put(k(8), b"x" * 2 * SIZE, next_use=0)
    assert k(0) in tier and k(8) in tier and tier.used_bytes == 3 * SIZE


# -- the records, the tables and the collector ---------------------------------------------


def test_keys_values_and_tags_come_back_whole_through_growth_and_deletion() -> None:
    # Random 16-byte keys over every shard: each table grows many times, and removals in
    # a full table exercise the backward shift (an entry moved into the hole must still
    # be found, one that must stay must not move).
    rng = random.Random(5)
    p = BlockIndex(0, objects=True)
    model: dict[bytes, tuple[bytes, int]] = {}
    for step in range(60_000):
        if model and rng.random() < 0.35:
            key = rng.choice(list(model)) if step % 50 == 0 else next(iter(model))
            value, tag = model.pop(key)
            assert p.get(key) is value and p.tag(key) == tag
            assert p.remove(key) == len(value)
        else:
            key = rng.randbytes(16)
            value, tag = rng.randbytes(rng.randrange(1, 40)), rng.getrandbits(64)
            model[key] = (value, tag)
            p.add(key, len(value), rng.randrange(100) if rng.random() < 0.5 else None, value=value, tag=tag)
        if step % 5_000 == 0:
            p.check()
    p.check()
    assert len(p) == len(model)
    assert all(p.get(key) is value and p.tag(key) == tag for key, (value, tag) in model.items())
    assert all(rng.randbytes(16) not in p for _ in range(1000))
    listed = [key for shard in range(256) for key in p.shard_keys(shard)]
    assert sorted(listed) == sorted(model)
    tagged = [p.tagged_shard(shard) for shard in range(256)]
    assert {key: tag for keys, tags in tagged for key, tag in zip(keys, tags)} == \
        {key: tag for key, (_, tag) in model.items() if tag}
    assert all(key[0] == shard for shard in range(256) for key in p.shard_keys(shard))


def test_values_are_held_until_removed_and_ints_keep_64_bits() -> None:
    import sys
    data = bytes(range(50)) * 3
    before = sys.getrefcount(data)
    p = BlockIndex(0, objects=True)
    p.add(k(1), len(data), value=data)
    p.add(k(2), len(data), 7, value=data)
    assert sys.getrefcount(data) == before + 2
    p.add(k(1), 1, value=b"x")  # replaced: the old value is let go
    assert sys.getrefcount(data) == before + 1
    popped = p.pop(k(2))
    assert popped is data and k(2) not in p
    del popped
    assert sys.getrefcount(data) == before
    assert p.pop(k(2), "gone") == "gone" and p.get(k(3)) is None
    p.add(k(4), 1, value=data)
    del p  # the index's end lets go of what it holds
    assert sys.getrefcount(data) == before
    words = BlockIndex(0)
    words.add(k(1), 4096, value=2**64 - 1, tag=2**64 - 1)
    assert words.get(k(1)) == 2**64 - 1 and words.tag(k(1)) == 2**64 - 1 and words.size_of(k(1)) == 4096
    words.set_tag(k(1), 5)
    assert words.tag(k(1)) == 5 and words.tag(k(2)) == 0


def test_bad_keys_values_and_arguments_are_refused_with_the_index_unchanged() -> None:
    p = BlockIndex(0, objects=True)
    p.add(k(1), 5, value=b"12345")
    with pytest.raises(ValueError, match="16 bytes, not 3"):
        p.add(b"abc", 1, value=b"x")
    with pytest.raises(TypeError, match="a key is bytes"):
        p.touch("not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a value of this index is bytes"):
        p.add(k(2), 1, value=3)
    with pytest.raises(TypeError, match="next_use is an int or None"):
        p.add(k(2), 1, "soon", value=b"x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="larger than an index holds"):
        p.add(k(2), 2**32, value=b"x")
    with pytest.raises(ValueError, match="a shard is 0 to 255"):
        p.shard_keys(256)
    with pytest.raises(ValueError, match="key_bytes is 1 to 16"):
        BlockIndex(0, key_bytes=17)
    with pytest.raises(TypeError, match="a value of this index is an int"):
        BlockIndex(0).add(k(1), 1, value=b"x")
    assert len(p) == 1 and p.get(k(1)) == b"12345"
    p.check()
    short = BlockIndex(0, key_bytes=12)  # the sample store's (key, cache id) names
    short.add(b"0123456789ab", 3)
    assert short.order() == [b"0123456789ab"] and b"0123456789ab" in short


def test_a_block_costs_the_index_at_most_64_bytes_and_nothing_the_collector_walks() -> None:
    # The record is 52 bytes and the tables at most 4 / 0.375 per block; a per-block
    # Python object anywhere would show in the collector's count.
    p = BlockIndex(0, objects=True)
    blocks = 200_000
    one = b"x"
    gc.collect()
    objects = len(gc.get_objects())
    for i in range(blocks):
        p.add(i.to_bytes(8, "little") + bytes(8), 1, next_use=i // 4 if i % 3 else None, value=one, tag=i)
    assert len(gc.get_objects()) - objects < 10 and not gc.is_tracked(p)
    assert p.memory() / blocks <= 64
    p.check()


def test_tables_give_their_buckets_back_as_the_index_shrinks() -> None:
    rng = random.Random(11)
    p = BlockIndex(0)
    keys = [rng.randbytes(16) for _ in range(100_000)]
    for key in keys:
        p.add(key, 1)
    full = p.memory()
    for key in keys[:95_000]:
        assert p.remove(key) == 1
    p.check()
    # The records stay allocated for reuse; the tables shrank with the keys: at most 8
    # buckets of 4 bytes per key left (a table is halved when under 1/8 full).
    records = (100_000 + 4095) // 4096 * 4096 * 48
    assert p.memory() - records <= 32 * len(p) < (full - records) / 4
    assert all(key in p for key in keys[95_000:]) and not any(key in p for key in keys[:1000])
    for key in keys[95_000:]:
        p.remove(key)
    assert len(p) == 0 and p.memory() == records
    p.check()
