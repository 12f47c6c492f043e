"""The tier protocol: what ``BlockCache`` asks of each of its tiers (RAM, ``memory.py``; NVMe,
``disk.py``) besides reading and storing, which differ by medium: membership, statistics,
and ranking blocks by plans. Both tiers evict by a ``policy.PlannedLru`` and keep each
block's path tag in a ``ShardedDict`` (a plan re-ranks blocks by their files' tags, one
shard per step), so the plan methods are written once here and the tiers inherit them."""

from __future__ import annotations

from typing import Protocol, TypeVar

from cubefs_fuse.cache.policy import PlannedLru
from cubefs_fuse.cache.shards import ShardedDict

S_co = TypeVar("S_co", covariant=True)


class Tier(Protocol[S_co]):
    """A block tier; ``S_co``: its statistics' type."""

    policy: PlannedLru
    tags: ShardedDict[bytes, int]  # key -> the file's path tag (absent: unknown)

    def __contains__(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` (nothing counted, nothing touched).  Only reads a
        dict, so a worker thread may ask too."""
        ...

    def statistics(self) -> S_co:
        ...

    def plan(self, key: bytes, next_use: int) -> None:
        """An active plan reads ``key`` at ``next_use``: eviction ranks it by that."""
        self.policy.plan(key, next_use)

    def unplan(self, key: bytes) -> None:
        """No active plan reads ``key`` any more."""
        self.policy.unplan(key)

    def tagged_shard(self, shard: int) -> tuple[list[bytes], list[int]]:
        """(keys, tags) of the blocks whose tag is known, in one shard (``shards.SHARDS``)."""
        return self.tags.shard_lists(shard)

    def unplan_some(self, count: int) -> bool:
        """Make up to ``count`` planned blocks unplanned; True if planned ones remain."""
        return self.policy.unplan_some(count)
