"""The tier protocol: what ``BlockCache`` asks of each of its tiers (RAM, ``memory.py``; NVMe,
``disk.py``) besides reading and storing, which differ by medium: membership, statistics,
and ranking blocks by plans. Both tiers hold their blocks in a ``BlockIndex``
(cache/_index.c: each block's size, path tag and value, and the plan-aware eviction
order; a plan re-ranks blocks by their files' tags, one shard per step), so the plan
methods are written once here and the tiers inherit them."""

from __future__ import annotations

from typing import Protocol, TypeVar

from cubefs_fuse.cache._index import BlockIndex

# Share of a tier that blocks no plan asks for may take from planned blocks (the block a
# reader is consuming right now, reads outside any plan).  1/32 keeps 97 % of the tier for
# the resident subset when the dataset is larger than the cache.
SCRATCH_FRACTION = 32

S_co = TypeVar("S_co", covariant=True)


class Tier(Protocol[S_co]):
    """A block tier; ``S_co``: its statistics' type."""

    index: BlockIndex  # key -> size, path tag (0: unknown), value; the eviction order

    def __contains__(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` (nothing counted, nothing touched).  One call of
        the index, which holds the GIL throughout, so a worker thread may ask too."""
        ...

    def statistics(self) -> S_co:
        ...

    def plan(self, key: bytes, next_use: int) -> None:
        """An active plan reads ``key`` at ``next_use``: eviction ranks it by that."""
        self.index.plan(key, next_use)

    def unplan(self, key: bytes) -> None:
        """No active plan reads ``key`` any more."""
        self.index.unplan(key)

    def tagged_shard(self, shard: int) -> tuple[list[bytes], list[int]]:
        """(keys, tags) of the blocks whose tag is known, in one shard (``shards.SHARDS``)."""
        return self.index.tagged_shard(shard)

    def unplan_some(self, count: int) -> bool:
        """Make up to ``count`` planned blocks unplanned; True if planned ones remain."""
        return self.index.unplan_some(count)
