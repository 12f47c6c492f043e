"""Path tags of cached blocks, sharded by the key's first byte so that a plan's re-ranking
can walk them one shard per step (walking a million blocks at once would stall the trio
thread for ~0.5 s, and a dict cannot be iterated piecewise while the cache keeps changing
it)."""

from __future__ import annotations

from collections.abc import Iterator

from cubefs_fuse.cache.shards import SHARDS as SHARDS  # re-exported: a walk takes SHARDS steps


class TagIndex:
    """key -> path tag (the xxh3-64 of the block's file path; 0: unknown)."""

    __slots__ = ("_shards", "_len")

    def __init__(self) -> None:
        self._shards: list[dict[bytes, int]] = [{} for _ in range(SHARDS)]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: bytes) -> bool:
        return key in self._shards[key[0]]

    def get(self, key: bytes, default: int = 0) -> int:
        return self._shards[key[0]].get(key, default)

    def set(self, key: bytes, tag: int) -> None:
        shard = self._shards[key[0]]
        if key not in shard:
            self._len += 1
        shard[key] = tag

    def pop(self, key: bytes) -> None:
        if self._shards[key[0]].pop(key, None) is not None:
            self._len -= 1

    def clear(self) -> None:
        for shard in self._shards:
            shard.clear()
        self._len = 0

    def shard(self, index: int) -> tuple[list[bytes], list[int]]:
        """A copy of one shard: its keys and their tags, as two lists (no tuple per block:
        a million short-lived tuples would make the garbage collector stall the thread)."""
        shard = self._shards[index]
        return list(shard), list(shard.values())

    def items(self) -> Iterator[tuple[bytes, int]]:
        for shard in self._shards:
            yield from shard.items()
