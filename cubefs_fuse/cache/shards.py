"""The one sharded dict of the daemon: a map split over :data:`SHARDS` plain dicts by a shard
function of the key (a block key's first byte, :func:`first_byte`; a sample key's low byte,
:func:`low_byte`), so that none is ever resized whole: a CPython dict of 10^6 entries
rebuilds its table in one 50-110 ms call on the trio thread, while 256 shards hold ~4,000
entries each at 10^6 keys (~0.2 ms a resize), and a walk can take one shard per step with a
checkpoint between. Keep keys and values atoms (``bytes``, ``int``, ``float``, ``bool``),
which the garbage collector never tracks: a full collection then never walks a node-wide
cache on the trio thread."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

# 256 shards, one per value of a key's byte: a 10^6-key map has ~4,000 keys per shard (a
# resize or a copy of one shard takes ~0.2 ms); 10^7 keys, ~40,000 (~2 ms).
SHARDS = 256
SHARD = SHARDS - 1  # the mask of a byte's value

# The two shard functions, both C callables (no Python frame per access): a block key is an
# xxh3-128 digest, so its first byte is uniform; a sample key is the dataset's index, so its
# low byte spreads consecutive keys over every shard.
first_byte: Callable[[bytes], int] = operator.itemgetter(0)
low_byte: Callable[[int], int] = SHARD.__and__

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")
_ABSENT: object = object()


class ShardedDict(Generic[K, V]):
    """K -> V, as ``SHARDS`` plain dicts (``shards[shard_of(key)]``), behaving as one dict.
    Insertion order is kept per shard only.  Change it through its methods: ``len`` is
    counted as it changes (a hot path asks whether one is empty).  A hot path may read
    ``shards`` itself with the same shard function inlined: a method call costs ~40 ns
    more per lookup than a dict's own (measured on the daemon's VM)."""

    __slots__ = ("shards", "shard_of", "_len")

    def __init__(self, shard_of: Callable[[K], int]) -> None:
        self.shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]
        self.shard_of = shard_of
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: K) -> bool:
        return key in self.shards[self.shard_of(key)]

    def __getitem__(self, key: K) -> V:
        return self.shards[self.shard_of(key)][key]

    def __setitem__(self, key: K, value: V) -> None:
        shard = self.shards[self.shard_of(key)]
        before = len(shard)
        shard[key] = value
        self._len += len(shard) - before

    def __delitem__(self, key: K) -> None:
        del self.shards[self.shard_of(key)][key]
        self._len -= 1

    def __iter__(self) -> Iterator[K]:
        for shard in self.shards:
            yield from shard

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        return self.shards[self.shard_of(key)].get(key, default)

    @overload
    def pop(self, key: K) -> V: ...
    @overload
    def pop(self, key: K, default: D) -> V | D: ...

    def pop(self, key: K, default: object = _ABSENT) -> object:
        """Remove ``key`` and return its value; with ``default``, that when absent."""
        shard = self.shards[self.shard_of(key)]
        before = len(shard)
        value = shard.pop(key) if default is _ABSENT else shard.pop(key, default)
        self._len -= before - len(shard)
        return value

    def items(self) -> Iterator[tuple[K, V]]:
        for shard in self.shards:
            yield from shard.items()

    def values(self) -> Iterator[V]:
        for shard in self.shards:
            yield from shard.values()

    def shard_lists(self, index: int) -> tuple[list[K], list[V]]:
        """A copy of one shard as its keys and their values, two lists (no tuple per key: a
        million short-lived tuples would make the garbage collector stall the thread)."""
        shard = self.shards[index]
        return list(shard), list(shard.values())

    def clear(self) -> None:
        for shard in self.shards:
            shard.clear()
        self._len = 0

    def clear_shard(self, index: int) -> None:
        """Empty one shard (callers clearing a large map in steps)."""
        self._len -= len(self.shards[index])
        self.shards[index].clear()
