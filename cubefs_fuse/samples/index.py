"""The sample store's per-entry state as atoms in sharded dicts, because one object per
entry would make every full garbage collection walk a node-wide cache (~1.28M entries for
ImageNet) on the trio thread and one dict of 10^6 keys is rebuilt whole as it grows. Per
cache, ``IntShards[int]`` maps a key to its location word (size, NVMe charge, offset and
segment id packed in one int: docs/on-disk.md, "The sample store's index") and
``IntShards[bytes]`` to its RAM copy, each over :data:`SHARDS` dicts chosen by the key's low
byte and holding ``key >> 8``, since an int hashes to itself and keys sharing their low byte
would otherwise crowd 1/256 of a shard's slots."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar, overload

# 256 shards, one per value of the key's low byte: ~5,000 keys each for ImageNet's 1.28M
# (a resize or a copy of one shard ~0.2 ms); a chunked walk visits them one at a time.
SHARD_BITS = 8
SHARDS = 1 << SHARD_BITS
SHARD = SHARDS - 1  # a key's shard: key & SHARD, where it is held as key >> SHARD_BITS

# Field widths of the location word (module docstring): 40 bits hold 1 TiB, ~2^14 times
# the largest entry, charge or segment file this store writes.
FIELD_BITS = 40
FIELD = (1 << FIELD_BITS) - 1
_CHARGE = FIELD_BITS
_OFFSET = 2 * FIELD_BITS
_SEGMENT = 3 * FIELD_BITS

V = TypeVar("V")
D = TypeVar("D")
_ABSENT: object = object()


def located(size: int, charge: int, segment: int, offset: int) -> int:
    """The word of an entry of ``size`` bytes on NVMe (``charge`` > 0) at ``segment``/``offset``."""
    return size | charge << _CHARGE | offset << _OFFSET | segment << _SEGMENT


def fits(size: int, offset: int) -> bool:
    """Whether a size and an offset found on NVMe fit their fields (a damaged or foreign
    file could claim anything; what the store writes always fits)."""
    return 0 <= size <= FIELD and 0 <= offset <= FIELD


def size_of(word: int) -> int:
    return word & FIELD


def charge_of(word: int) -> int:
    """Bytes charged on NVMe (0: not there)."""
    return word >> _CHARGE & FIELD


def offset_of(word: int) -> int:
    return word >> _OFFSET & FIELD


def segment_of(word: int) -> int:
    return word >> _SEGMENT


def resized(word: int, size: int) -> int:
    """The word with a new value's size (its NVMe place, if any, kept: the old value is
    still there until a write replaces or frees it)."""
    return word & ~FIELD | size


def off_disk(word: int) -> int:
    """The word of the entry once it left NVMe: its size alone."""
    return word & FIELD


class IntShards(Generic[V]):
    """int -> V, as ``SHARDS`` plain dicts: a key's value is
    ``shards[key & SHARD][key >> SHARD_BITS]`` (hot paths index it themselves: a method
    call per access cost the store ~1 us per entry put).  Insertion order is kept per
    shard only."""

    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[dict[int, V]] = [{} for _ in range(SHARDS)]

    def __len__(self) -> int:  # 256 len() calls, ~5 us: statistics and drops only
        return sum(map(len, self.shards))

    def __contains__(self, key: int) -> bool:
        return key >> SHARD_BITS in self.shards[key & SHARD]

    def __getitem__(self, key: int) -> V:
        return self.shards[key & SHARD][key >> SHARD_BITS]

    def __setitem__(self, key: int, value: V) -> None:
        self.shards[key & SHARD][key >> SHARD_BITS] = value

    def __iter__(self) -> Iterator[int]:
        for low, shard in enumerate(self.shards):
            for inner in shard:
                yield inner << SHARD_BITS | low

    def get(self, key: int) -> V | None:
        return self.shards[key & SHARD].get(key >> SHARD_BITS)

    @overload
    def pop(self, key: int) -> V: ...
    @overload
    def pop(self, key: int, default: D) -> V | D: ...

    def pop(self, key: int, default: object = _ABSENT) -> object:
        """Remove ``key`` and return its value; with ``default``, that when absent."""
        shard, inner = self.shards[key & SHARD], key >> SHARD_BITS
        return shard.pop(inner) if default is _ABSENT else shard.pop(inner, default)

    def items(self) -> Iterator[tuple[int, V]]:
        for low, shard in enumerate(self.shards):
            for inner, value in shard.items():
                yield inner << SHARD_BITS | low, value
