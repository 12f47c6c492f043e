"""ShardedDict (cache/shards.py): a dict split by a shard function of the key, that behaves
as one, with either shard function the daemon uses."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import pytest

from cubefs_fuse.cache.shards import SHARDS, ShardedDict, first_byte, low_byte


def _bytes_key(n: int) -> bytes:
    return n.to_bytes(2, "little")  # the first byte spreads keys over shards


def _int_key(n: int) -> int:
    return n - 1500  # negative keys too: a sample key is any int64


@pytest.mark.parametrize(("shard_of", "make_key"), [(first_byte, _bytes_key), (low_byte, _int_key)],
                         ids=["bytes-first-byte", "int-low-byte"])
def test_it_behaves_as_a_dict(shard_of: Callable[[Any], int], make_key: Callable[[int], Any]) -> None:
    rng = random.Random(3)
    sharded: ShardedDict[Any, int] = ShardedDict(shard_of)
    plain: dict[Any, int] = {}
    for _ in range(20_000):
        key = make_key(rng.randrange(3000))
        op = rng.random()
        if op < 0.5:
            sharded[key] = plain[key] = rng.randrange(10**12)
        elif op < 0.7:
            assert sharded.pop(key, None) == plain.pop(key, None)
        elif op < 0.8 and key in plain:
            del sharded[key], plain[key]
        else:
            assert sharded.get(key) == plain.get(key)
            assert sharded.get(key, -1) == plain.get(key, -1)
            assert (key in sharded) == (key in plain)
        assert len(sharded) == len(plain)
    assert sorted(sharded) == sorted(plain)
    assert sorted(sharded.items()) == sorted(plain.items())
    assert sorted(sharded.values()) == sorted(plain.values())
    key = next(iter(plain))
    assert sharded[key] == plain[key] and sharded.pop(key) == plain.pop(key)
    with pytest.raises(KeyError):
        sharded.pop(key)
    with pytest.raises(KeyError):
        sharded[key]
    # Every key is in the shard its function names, and a shard's lists are that shard.
    for index in range(SHARDS):
        keys, values = sharded.shard_lists(index)
        assert all(shard_of(k) == index for k in keys)
        assert values == [plain[k] for k in keys]
    # Every shard was used, and none is tracked by the garbage collector (atoms only).
    assert all(sharded.shards) and len(sharded.shards) == SHARDS
    assert not any(gc.is_tracked(shard) for shard in sharded.shards)
    sharded.clear_shard(0)
    assert len(sharded) == len(plain) - sum(1 for k in plain if shard_of(k) == 0)
    sharded.clear()
    assert len(sharded) == 0 and list(sharded) == []


def test_len_is_counted_as_it_changes() -> None:
    # len() (and so truth) is asked on hot paths: counted, not summed over the shards.
    sharded: ShardedDict[int, int] = ShardedDict(low_byte)
    assert not sharded
    for key in range(1000):
        sharded[key] = key
        sharded[key] = key + 1  # a rewrite adds nothing
    assert len(sharded) == 1000 and sharded
    assert sharded.pop(5) == 6 and sharded.pop(5, None) is None and len(sharded) == 999
    sharded.clear_shard(low_byte(7))
    assert len(sharded) == 999 - sum(1 for key in range(1000) if key != 5 and low_byte(key) == low_byte(7))
