"""MemoryTier: the byte limit holds after every call, LRU order, oversize blocks."""

from __future__ import annotations

import random

from cubefs_fuse.cache.memory import MemoryTier


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_limit_holds_after_every_put() -> None:
    limit = 1_000_000
    tier = MemoryTier(limit)
    rng = random.Random(1234)
    shadow: dict[bytes, int] = {}
    for i in range(3000):
        # Sizes from empty to the whole tier, keys reused so replacements happen too.
        size = rng.choice([0, 1, rng.randrange(1, 4096), rng.randrange(4096, 200_000), limit])
        k = key(rng.randrange(400))
        tier.put(k, bytes(size))
        shadow[k] = size
        assert tier.used_bytes <= limit
        stats = tier.statistics()
        # used_bytes is the sum of what is actually held, not a drifting counter.
        held = {kk: v for kk, v in shadow.items() if kk in tier}
        assert stats.used_bytes == sum(held.values())
        assert stats.blocks == len(held)
        assert k in tier  # a block no larger than the tier is always stored
    stats = tier.statistics()
    assert stats.evictions > 0 and stats.rejected == 0


def test_lru_order() -> None:
    tier = MemoryTier(3 * 100)
    for i in range(3):
        tier.put(key(i), bytes(100))
    assert tier.get(key(0)) is not None  # 0 is now the most recently used
    tier.put(key(3), bytes(100))  # evicts 1, the least recently used
    assert key(1) not in tier
    assert all(key(i) in tier for i in (0, 2, 3))
    tier.put(key(4), bytes(150))  # needs two victims: 2 then 0
    assert key(2) not in tier and key(0) not in tier
    assert key(3) in tier and key(4) in tier
    assert tier.used_bytes == 250
    assert tier.statistics().evictions == 3


def test_oversize_block_rejected_and_old_copy_dropped() -> None:
    tier = MemoryTier(1000)
    tier.put(key(0), bytes(500))
    tier.put(key(1), bytes(400))
    tier.put(key(2), bytes(1001))
    assert key(2) not in tier
    assert key(0) in tier and key(1) in tier  # nothing evicted for a block that cannot fit
    # Replacing a key with an oversize value must not leave the stale value behind.
    tier.put(key(0), bytes(5000))
    assert key(0) not in tier
    assert tier.used_bytes == 400
    stats = tier.statistics()
    assert stats.rejected == 2 and stats.evictions == 0


def test_hits_misses_discard_clear() -> None:
    tier = MemoryTier(1000)
    tier.put(key(0), b"abc")
    assert tier.get(key(0)) == b"abc"
    assert tier.get(key(1)) is None
    tier.discard(key(0))
    tier.discard(key(0))  # discarding an absent key is harmless
    assert tier.used_bytes == 0 and key(0) not in tier
    tier.put(key(2), b"x" * 10)
    tier.clear()
    stats = tier.statistics()
    assert (stats.used_bytes, stats.blocks, stats.hits, stats.misses) == (0, 0, 1, 1)


def test_lent_blocks_stay_counted_until_given_back_and_the_limit_holds() -> None:
    limit = 1_000_000
    tier = MemoryTier(limit)
    rng = random.Random(99)
    lent: list[tuple[bytes, int]] = []  # (key, size) of every loan not yet given back
    shadow: dict[bytes, int] = {}
    for _ in range(3000):
        k = key(rng.randrange(300))
        roll = rng.random()
        if roll < 0.5:
            size = rng.choice([1, rng.randrange(1, 4096), rng.randrange(4096, 150_000)])
            tier.put(k, bytes(size))
            shadow[k] = size
        elif roll < 0.8:
            data = tier.lend(k)
            if data is not None:
                lent.append((k, len(data)))
        elif lent:
            given, _ = lent.pop(rng.randrange(len(lent)))
            tier.give_back(given)
        # What is counted: the resident blocks, plus the lent ones that left the tier
        # (their bytes live until the loan ends): at most every loan on top, never past the limit.
        resident = sum(v for kk, v in shadow.items() if kk in tier)
        assert resident <= tier.used_bytes <= min(limit, resident + sum(size for _, size in lent))
    for k, _ in lent:
        tier.give_back(k)
    # Every loan back: nothing counted twice or lost.
    assert tier.used_bytes == sum(v for kk, v in shadow.items() if kk in tier)


def test_a_lent_block_evicted_frees_its_bytes_only_when_given_back() -> None:
    tier = MemoryTier(300)
    for i in range(3):
        tier.put(key(i), bytes(100))
    assert tier.lend(key(0)) is not None
    assert tier.put(key(3), bytes(100))  # evicts key 1: lend() touched key 0
    assert key(1) not in tier and tier.used_bytes == 300
    assert tier.put(key(4), bytes(100))  # key 2 goes; key 0 is lent, resident
    assert tier.put(key(5), bytes(100))  # now key 0 leaves the tier but stays counted
    assert key(0) not in tier and tier.used_bytes == 300
    assert tier.statistics().blocks == 2  # keys 4 and 5 resident, key 0's 100 bytes lent
    tier.give_back(key(0))
    assert tier.used_bytes == 200
    assert tier.put(key(6), bytes(100)) and tier.used_bytes == 300
