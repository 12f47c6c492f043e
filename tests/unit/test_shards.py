"""ShardedDict (cache/shards.py): a dict split by the key's first byte, that behaves as one."""

from __future__ import annotations

import gc
import random

import pytest

from cubefs_fuse.cache.shards import SHARDS, ShardedDict


def test_it_behaves_as_a_dict() -> None:
    rng = random.Random(3)
    sharded: ShardedDict[int] = ShardedDict()
    plain: dict[bytes, int] = {}
    for _ in range(20_000):
        key = rng.randrange(3000).to_bytes(2, "little")  # the first byte spreads keys over shards
        op = rng.random()
        if op < 0.5:
            sharded[key] = plain[key] = rng.randrange(10**12)
        elif op < 0.7:
            assert sharded.pop(key, None) == plain.pop(key, None)
        elif op < 0.8 and key in plain:
            del sharded[key], plain[key]
        else:
            assert sharded.get(key) == plain.get(key)
            assert (key in sharded) == (key in plain)
        assert len(sharded) == len(plain)  # counted as it changes, not summed
    assert sorted(sharded) == sorted(plain)
    assert sorted(sharded.items()) == sorted(plain.items())
    assert sorted(sharded.values()) == sorted(plain.values())
    key = next(iter(plain))
    assert sharded[key] == plain[key] and sharded.pop(key) == plain.pop(key)
    with pytest.raises(KeyError):
        sharded.pop(key)
    with pytest.raises(KeyError):
        sharded[key]
    # Every shard was used, and none is tracked by the garbage collector (bytes -> int).
    assert all(sharded.shards) and len(sharded.shards) == SHARDS
    assert not any(gc.is_tracked(shard) for shard in sharded.shards)
    sharded.clear()
    assert len(sharded) == 0 and list(sharded) == []
