"""The RAM tier: blocks in a dict, least recently used evicted first, a byte limit that holds."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierStatistics:
    used_bytes: int
    limit_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    inserts: int
    rejected: int  # blocks not stored (larger than the tier, or the tier is full of pinned work)


class MemoryTier:
    """Blocks keyed by bytes; ``used_bytes <= limit_bytes`` after every call."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._hits = self._misses = self._evictions = self._inserts = self._rejected = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> bytes | None:
        data = self._blocks.get(key)
        if data is None:
            self._misses += 1
            return None
        self._blocks.move_to_end(key)
        self._hits += 1
        return data

    def put(self, key: bytes, data: bytes) -> None:
        size = len(data)
        old = self._blocks.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old)
        if size > self.limit_bytes:
            self._rejected += 1
            return
        # Evict before inserting, so the limit holds at every instant, not just on average.
        while self.used_bytes + size > self.limit_bytes:
            _, victim = self._blocks.popitem(last=False)
            self.used_bytes -= len(victim)
            self._evictions += 1
        self._blocks[key] = data
        self.used_bytes += size
        self._inserts += 1

    def discard(self, key: bytes) -> None:
        data = self._blocks.pop(key, None)
        if data is not None:
            self.used_bytes -= len(data)

    def clear(self) -> None:
        self._blocks.clear()
        self.used_bytes = 0

    def statistics(self) -> TierStatistics:
        return TierStatistics(self.used_bytes, self.limit_bytes, len(self._blocks), self._hits,
                              self._misses, self._evictions, self._inserts, self._rejected)
