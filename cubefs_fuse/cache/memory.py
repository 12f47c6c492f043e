"""The RAM tier (a ``tier.Tier``): blocks under a byte limit that holds after every call,
held and evicted by a ``BlockIndex`` (cache/_index.c: plain LRU without plans; with plans,
Belady by the position at which a plan reads each block), which holds each block's bytes
object, size and path tag in one 52-byte record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cubefs_fuse.cache._index import BlockIndex
from cubefs_fuse.cache.shards import SHARDS
from cubefs_fuse.cache.tier import SCRATCH_FRACTION, Tier


@dataclass(frozen=True, slots=True)
class TierStatistics:
    used_bytes: int
    limit_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    inserts: int
    rejected: int  # blocks not stored (larger than the tier, or everything resident is needed sooner)
    planned_bytes: int  # bytes of blocks an active plan will read


class MemoryTier(Tier[TierStatistics]):
    """Blocks keyed by bytes; ``used_bytes <= limit_bytes`` after every call."""

    def __init__(self, limit_bytes: int, *, scratch_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        # key -> the block's bytes, its size and its file's path tag (for re-planning).
        self.index = BlockIndex(scratch_bytes if scratch_bytes is not None else limit_bytes // SCRATCH_FRACTION,
                                objects=True)
        self.on_evict: Callable[[bytes], None] | None = None
        self._hits = self._misses = self._evictions = self._inserts = self._rejected = 0
        # Blocks lent to the FUSE session, which serves reads from them without asking
        # (fs/session.py): key -> loans.  A lent block that leaves the tier stays counted
        # in used_bytes as a ghost (key -> (size, loans)) until its last loan is returned,
        # since its bytes stay in memory until then: the limit holds for what is lent too.
        self._loans: dict[bytes, int] = {}
        self._ghosts: dict[bytes, tuple[int, int]] = {}
        # Told when a lent block leaves the tier, so the borrower can be asked to let go.
        self.on_recall: Callable[[bytes], None] | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def get(self, key: bytes) -> bytes | None:
        data: bytes | None = self.index.get(key)  # type: ignore[assignment]  # the index's values are bytes
        if data is None:
            self._misses += 1
            return None
        self.index.touch(key)
        self._hits += 1
        return data

    def lend(self, key: bytes) -> bytes | None:
        """The block, lent until :meth:`give_back`; None if absent.  Neither touched nor
        counted: lending is no read (a listing lends every file it names), the borrower's
        reads are counted and touched by :meth:`count_hit`."""
        data: bytes | None = self.index.get(key)  # type: ignore[assignment]
        if data is not None:
            self._loans[key] = self._loans.get(key, 0) + 1
        return data

    def give_back(self, key: bytes) -> None:
        loans = self._loans.get(key)
        if loans is not None:
            if loans > 1:
                self._loans[key] = loans - 1
            else:
                del self._loans[key]
            return
        size, ghost_loans = self._ghosts.pop(key, (0, 0))
        if ghost_loans > 1:
            self._ghosts[key] = (size, ghost_loans - 1)
        else:
            self.used_bytes -= size

    def count_hit(self, key: bytes) -> None:
        """A read of a lent block, served by the borrower (touched if still in the tier)."""
        self._hits += 1
        self.index.touch(key)

    def _leave(self, key: bytes, size: int) -> None:
        """``key``'s block left the tier: its bytes stop counting unless they are lent."""
        loans = self._loans.pop(key, None)
        if loans is None:
            self.used_bytes -= size
            return
        _, earlier = self._ghosts.get(key, (size, 0))
        self._ghosts[key] = (size, earlier + loans)
        if self.on_recall is not None:
            self.on_recall(key)  # may give loans back at once (the ghost is in place for that)

    def put(self, key: bytes, data: bytes, *, next_use: int | None = None, tag: int = 0) -> bool:
        """Store a block (``next_use``: the plan position that reads it); False if not stored."""
        size = len(data)
        self.discard(key)
        if size > self.limit_bytes:
            self._rejected += 1
            return False
        # Evict before inserting, so the limit holds at every instant, not just on average.
        # A lent victim frees nothing (its bytes stay counted until given back), so the
        # room is asked for again until it is there; each round evicts at least one block.
        while victims := self.index.victims(size, self.limit_bytes - self.used_bytes, next_use):
            for victim in victims:
                self._evict(victim)
        if victims is None:
            self._rejected += 1
            return False
        self.index.add(key, size, next_use, value=data, tag=tag)
        self.used_bytes += size
        self._inserts += 1
        return True

    def _evict(self, key: bytes) -> None:
        self._leave(key, self.index.remove(key))
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)

    def discard(self, key: bytes) -> None:
        if key in self.index:
            self._leave(key, self.index.remove(key))

    def clear(self) -> None:
        for shard in range(SHARDS):
            self.clear_shard(shard)

    def clear_shard(self, shard: int) -> None:
        """Drop the blocks of one shard of the block map (``shards.SHARDS``): a caller on
        the trio thread clears the tier a shard at a time, with a checkpoint between, so
        no step does work proportional to the whole tier."""
        for key in self.index.shard_keys(shard):
            self.discard(key)

    def statistics(self) -> TierStatistics:
        return TierStatistics(self.used_bytes, self.limit_bytes, len(self.index), self._hits,
                              self._misses, self._evictions, self._inserts, self._rejected,
                              self.index.planned_bytes)
