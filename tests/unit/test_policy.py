"""PlannedLru (cache/policy.py): LRU without plans, Belady with them.

The randomized test drives PlannedLru and a deliberately naive reference model (lists
and sorts, no linked lists) with the same operations and checks that they choose the
same victims and the same eviction order, so the linked lists and the sorted next uses
cannot drift from the rules.  PlannedLru keeps its per-block state out of the garbage
collector's sight (docs/concurrency.md, "the trio thread does no work proportional to
the cache"): the tests check that too.
"""

from __future__ import annotations

import gc
import random

import pytest
from dataclasses import dataclass, field

from cubefs_fuse.cache.memory import MemoryTier
from cubefs_fuse.cache import policy
from cubefs_fuse.cache.policy import USE_CHUNK, PlannedLru, _SortedInts

SIZE = 10  # every block in these tests has the same size unless said otherwise


def k(i: int) -> bytes:
    return f"b{i}".encode()


def admit(p: PlannedLru, key: bytes, size: int, free: int, next_use: int | None) -> list[bytes] | None:
    """What MemoryTier.put does with the policy: evict the victims, then add."""
    victims = p.victims(size, free, next_use)
    if victims is not None:
        for v in victims:
            p.remove(v)
        p.add(key, size, next_use)
    return victims


def test_without_plans_it_is_lru() -> None:
    p = PlannedLru(scratch_bytes=0)
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
    p = PlannedLru(scratch_bytes=0)
    p.add(k(0), SIZE, next_use=100)  # planned, far in the future
    p.add(k(1), SIZE)  # unplanned, more recent than 0
    p.add(k(2), SIZE, next_use=5)
    p.add(k(3), SIZE)
    # Both unplanned first (oldest first), then the planned one needed furthest away.
    assert p.victims(3 * SIZE, 0, next_use=1) == [k(1), k(3), k(0)]


def test_planned_blocks_go_furthest_next_use_first() -> None:
    p = PlannedLru(scratch_bytes=0)
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
    p = PlannedLru(scratch_bytes=1000)
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
    p = PlannedLru(scratch_bytes=2 * SIZE)
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
    p = PlannedLru(scratch_bytes=0)
    p.add(k(0), SIZE)
    p.add(k(1), SIZE, next_use=3)
    p.add(k(2), SIZE)
    p.unplan(k(1))  # consumed: evicted before anything planned, after older unplanned blocks
    assert p.next_use(k(1)) is None
    assert p.victims(3 * SIZE, 0, None) == [k(0), k(2), k(1)]
    p.add(k(3), SIZE, next_use=1)
    p.unplan_all()
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
    """The rules of policy.py written as plainly as possible."""

    scratch: int
    unplanned: list[tuple[bytes, int]] = field(default_factory=list)  # oldest first
    planned: dict[bytes, tuple[int, int, int]] = field(default_factory=dict)  # key -> (next_use, serial, size)
    serial: int = 0

    def remove(self, key: bytes) -> None:
        self.unplanned = [(u, s) for u, s in self.unplanned if u != key]
        self.planned.pop(key, None)

    def add(self, key: bytes, size: int, next_use: int | None) -> None:
        self.remove(key)
        if next_use is None:
            self.unplanned.append((key, size))
        else:
            self.planned[key] = (next_use, self.serial, size)
            self.serial += 1

    def size_of(self, key: bytes) -> int | None:
        for u, s in self.unplanned:
            if u == key:
                return s
        entry = self.planned.get(key)
        return entry[2] if entry else None

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
            self.add(key, self.planned[key][2], None)

    def eviction_order(self) -> list[bytes]:
        """Planned keys: furthest next use first; among equals, the one planned first."""
        return [key for key, _ in sorted(self.planned.items(), key=lambda e: (-e[1][0], e[1][1]))]

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
        # Furthest next use first; among equals, the one planned first.
        for key in self.eviction_order():
            use, _, size = self.planned[key]
            if next_use is not None and use <= next_use:
                return None
            out.append(key)
            free += size
            if need <= free:
                return out
        return None


def check_consistent(p: PlannedLru, ref: Reference) -> None:
    assert len(p) == len(ref.unplanned) + len(ref.planned)
    assert p.unplanned_bytes == sum(s for _, s in ref.unplanned)
    assert p.planned_bytes == sum(e[2] for e in ref.planned.values())
    for key, (use, _, _) in ref.planned.items():
        assert p.next_use(key) == use
    for key, _ in ref.unplanned:
        assert key in p and p.next_use(key) is None
    # The whole eviction order, not just the victims of one admission.
    assert p.order() == ref.order()
    # White box: each distinct next use has exactly one list, and the lists hold every key once.
    assert list(p._uses.descending()) == sorted({e[0] for e in ref.planned.values()}, reverse=True)
    lists = sum(map(len, p._heads)) + (p._lru_head is not None)
    assert sum(map(len, p._next)) == sum(map(len, p._prev)) == len(p) - lists


@pytest.mark.parametrize("chunk", [USE_CHUNK, 2])
def test_randomized_churn_matches_the_reference_model(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # With chunks of 2 next uses, the ~20 distinct ones resident split and merge chunks
    # all the time (the default size only does that past a thousand).
    monkeypatch.setattr(policy, "USE_CHUNK", chunk)
    rng = random.Random(20240601)  # fixed seed: a failure reproduces
    limit = 400  # bytes of the simulated tier; blocks are 5..40 bytes, so ~20 resident
    scratch = 45
    p, ref = PlannedLru(scratch), Reference(scratch)
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
            p.unplan_all()
            for key2 in ref.eviction_order():
                ref.unplan(key2)
        if step % 97 == 0:
            check_consistent(p, ref)
    check_consistent(p, ref)
    # The run exercised every branch: admissions, refusals and evictions.
    assert min(decisions.values()) > 100, decisions
    # Nothing left behind: the lists hold exactly the resident keys.
    assert sum(map(len, p._heads)) == sum(map(len, p._tails)) == len(p._uses)
    assert (p._lru_head is None) == (p._lru_tail is None) == (not ref.unplanned)


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
    assert tier.policy.victims(2 * SIZE, 0, next_use=0) == [k(2), k(1)]
    assert tier.put(k(8), b"x" * 2 * SIZE, next_use=0)
    assert k(0) in tier and k(8) in tier and tier.used_bytes == 3 * SIZE


# -- the sorted next uses and the collector ------------------------------------------------


def test_sorted_ints_matches_a_sorted_set(monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = 8  # small chunks: many splits and merges
    monkeypatch.setattr(policy, "USE_CHUNK", chunk)
    rng = random.Random(7)
    s, ref = _SortedInts(), set()
    for step in range(5_000):
        value = rng.randrange(-50, 300)
        if value in ref:
            s.remove(value)
            ref.discard(value)
        else:
            s.add(value)
            ref.add(value)
        if step % 50 == 0 or step > 4_900:
            assert list(s.descending()) == sorted(ref, reverse=True), f"step {step}"
            assert len(s) == len(ref)
            assert all(s._chunks) and s._maxes == [c[-1] for c in s._chunks]
            assert all(len(c) <= 2 * chunk for c in s._chunks)
            # Merges keep every chunk but the last at least a quarter full, so the chunk
            # list stays proportional to the values, not to their history.
            assert all(len(c) >= chunk // 4 for c in s._chunks[:-1])


def test_per_block_state_is_invisible_to_the_garbage_collector() -> None:
    # The point of the structure: a full collection must not visit a reference per
    # block, so every per-block container must be one CPython does not track.
    p = PlannedLru(scratch_bytes=0)
    blocks = 20_000
    for i in range(blocks):
        p.add(i.to_bytes(16, "little"), 4096, next_use=i // 4 if i % 3 else None)
    for i in range(0, blocks, 7):
        p.touch(i.to_bytes(16, "little"))
        p.plan((i + 1).to_bytes(16, "little"), blocks + i)
    for name in ("_size", "_use", "_next", "_prev", "_heads", "_tails"):
        shards = getattr(p, name)
        assert sum(map(len, shards)) > blocks // 10, name
        assert not any(gc.is_tracked(shard) for shard in shards), name
    # The sorted next uses: a few arrays (tracked, but they hold no references).
    assert len(p._uses) > blocks // 4 and len(p._uses._chunks) <= 4 * len(p._uses) // USE_CHUNK + 1
    assert all(not gc.get_referents(chunk) or gc.get_referents(chunk) == [type(chunk)]
               for chunk in p._uses._chunks)
