"""Per-block dicts split by the key's first byte, so that none is ever resized whole: a
CPython dict of 10^6 entries rebuilds its table in one 50-110 ms call on the trio thread,
while ``SHARDS`` shards of a hashed key hold ~4,000 entries each at 10^6 blocks (~0.2 ms a
resize). Keys must be non-empty bytes; keep keys and values atoms (``bytes``, ``int``,
``float``, ``bool``), which the garbage collector never tracks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar, overload

# 256 shards, one per value of the key's first byte: a 10^6-block cache has ~4,000 keys
# per shard (a resize or a copy of one shard takes ~0.2 ms); 10^7 keys, ~40,000 (~2 ms).
SHARDS = 256

V = TypeVar("V")
D = TypeVar("D")
_ABSENT: object = object()


class ShardedDict(Generic[V]):
    """bytes -> V, as ``SHARDS`` plain dicts (``shards[key[0]]``).  Insertion order is kept
    per shard only.  Change it through its methods (``len`` is counted as it changes)."""

    __slots__ = ("shards", "_len")

    def __init__(self) -> None:
        self.shards: list[dict[bytes, V]] = [{} for _ in range(SHARDS)]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: bytes) -> bool:
        return key in self.shards[key[0]]

    def __getitem__(self, key: bytes) -> V:
        return self.shards[key[0]][key]

    def __setitem__(self, key: bytes, value: V) -> None:
        shard = self.shards[key[0]]
        before = len(shard)
        shard[key] = value
        self._len += len(shard) - before

    def __delitem__(self, key: bytes) -> None:
        del self.shards[key[0]][key]
        self._len -= 1

    def __iter__(self) -> Iterator[bytes]:
        for shard in self.shards:
            yield from shard

    def get(self, key: bytes) -> V | None:
        return self.shards[key[0]].get(key)

    @overload
    def pop(self, key: bytes) -> V: ...
    @overload
    def pop(self, key: bytes, default: D) -> V | D: ...

    def pop(self, key: bytes, default: object = _ABSENT) -> object:
        """Remove ``key`` and return its value; with ``default``, that when absent."""
        shard = self.shards[key[0]]
        before = len(shard)
        value = shard.pop(key) if default is _ABSENT else shard.pop(key, default)
        self._len -= before - len(shard)
        return value

    def items(self) -> Iterator[tuple[bytes, V]]:
        for shard in self.shards:
            yield from shard.items()

    def values(self) -> Iterator[V]:
        for shard in self.shards:
            yield from shard.values()

    def clear(self) -> None:
        for shard in self.shards:
            shard.clear()
        self._len = 0

    def clear_shard(self, shard: int) -> None:
        """Empty one shard (callers clearing a large dict in steps)."""
        self._len -= len(self.shards[shard])
        self.shards[shard].clear()
