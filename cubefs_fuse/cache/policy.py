"""Eviction that knows the future: least recently used, then furthest next use (Belady). A
block is *unplanned* (no active plan reads it: evicted first, oldest first) or *planned* at
position ``next_use`` (evicted after every unplanned block, the furthest first); a planned
block may displace only blocks needed later than itself, an unplanned one displaces planned
blocks only within ``scratch_bytes``, so a dataset larger than the tier keeps a stable
resident subset and the lookahead window is never evicted for something needed later. The
per-block state lives only in sharded dicts of bytes and ints (the orders are linked lists
threaded through them, the distinct ``next_use`` values sorted in chunks of ``array('q')``),
which the garbage collector never visits and which are never rebuilt whole
(docs/concurrency.md, "The trio thread does no work proportional to the cache or the
plan")."""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from cubefs_fuse.cache.shards import SHARDS


# Share of a tier that blocks no plan asks for may take from planned blocks (the block a
# reader is consuming right now, reads outside any plan).  1/32 keeps 97 % of the tier for
# the resident subset when the dataset is larger than the cache.
SCRATCH_FRACTION = 32

# Distinct next uses per chunk of _SortedInts: an insert or removal moves at most
# 2 x 1024 x 8 bytes (~0.3 us), and 10^6 distinct positions need ~1,000 chunks, so
# finding the chunk (a bisect over their maxima) stays a few probes.
USE_CHUNK = 1024

# Planned lists' ends are sharded by ``next_use & _MASK`` (like keys, by their first byte).
_MASK = SHARDS - 1
# Planned blocks unplan_all() unplans per call of unplan_some (any size works; the
# scheduler's own steps are UNPLAN_STEP).
UNPLAN_CHUNK = 1024


class _SortedInts:
    """A set of ints, sorted, in chunks of ``array('q')``: add, remove, descending walk.

    Arrays hold their values inline (no per-value object the collector would visit), and
    a chunk is edited in place, so nothing proportional to the set's size is ever copied.
    """

    __slots__ = ("_chunks", "_maxes")

    def __init__(self) -> None:
        self._chunks: list[array[int]] = []  # each sorted, non-empty; all of chunk i < all of chunk i+1
        self._maxes: list[int] = []  # the last value of each chunk

    def __len__(self) -> int:
        return sum(len(chunk) for chunk in self._chunks)

    def add(self, value: int) -> None:
        """Insert ``value`` (not present)."""
        if not self._chunks:
            self._chunks.append(array("q", (value,)))
            self._maxes.append(value)
            return
        i = min(bisect_left(self._maxes, value), len(self._maxes) - 1)
        chunk = self._chunks[i]
        chunk.insert(bisect_left(chunk, value), value)
        self._maxes[i] = chunk[-1]
        self._split_if_large(i)

    def remove(self, value: int) -> None:
        """Remove ``value`` (present)."""
        i = bisect_left(self._maxes, value)
        chunk = self._chunks[i]
        del chunk[bisect_left(chunk, value)]
        if not chunk:
            del self._chunks[i]
            del self._maxes[i]
            return
        self._maxes[i] = chunk[-1]
        if len(chunk) < USE_CHUNK // 4 and i + 1 < len(self._chunks):
            # Merge a small chunk into the next one, so that every chunk but the last
            # keeps >= USE_CHUNK / 4 values and the chunk list stays short.
            chunk.extend(self._chunks[i + 1])
            del self._chunks[i + 1]
            del self._maxes[i + 1]
            self._maxes[i] = chunk[-1]
            self._split_if_large(i)

    def _split_if_large(self, i: int) -> None:
        chunk = self._chunks[i]
        if len(chunk) > 2 * USE_CHUNK:
            self._chunks.insert(i + 1, chunk[USE_CHUNK:])
            del chunk[USE_CHUNK:]
            self._maxes[i : i + 1] = [chunk[-1], self._chunks[i + 1][-1]]

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def largest(self) -> int | None:
        return self._maxes[-1] if self._maxes else None

    def descending(self) -> Iterator[int]:
        """Largest first.  The set must not change while this is consumed."""
        for chunk in reversed(self._chunks):
            yield from reversed(chunk)


class PlannedLru:
    """Keys must be non-empty bytes: every per-block dict is split by the key's first byte
    (``shards.SHARDS``), so that none is ever rebuilt whole (see ``cache/shards.py``)."""

    def __init__(self, scratch_bytes: int) -> None:
        self.scratch_bytes = scratch_bytes
        # Per-block state, in shards of untracked dicts (bytes/int keys and values).
        self._size: list[dict[bytes, int]] = _shards()  # every key -> size
        self._use: list[dict[bytes, int]] = _shards()  # planned key -> next_use
        self._next: list[dict[bytes, bytes]] = _shards()  # key -> the key after it in its list (absent: last)
        self._prev: list[dict[bytes, bytes]] = _shards()  # key -> the key before it (absent: the first)
        # The unplanned list's ends, and each planned list's (sharded by next use & _MASK).
        self._lru_head: bytes | None = None
        self._lru_tail: bytes | None = None
        self._heads: list[dict[int, bytes]] = [{} for _ in range(SHARDS)]
        self._tails: list[dict[int, bytes]] = [{} for _ in range(SHARDS)]
        self._uses = _SortedInts()  # the next uses that have a list
        self.unplanned_bytes = 0
        self.planned_bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._size[key[0]]

    def __len__(self) -> int:
        return sum(map(len, self._size))

    def next_use(self, key: bytes) -> int | None:
        return self._use[key[0]].get(key)

    def add(self, key: bytes, size: int, next_use: int | None = None) -> None:
        self.remove(key)
        self._size[key[0]][key] = size
        if next_use is None:
            self.unplanned_bytes += size
        else:
            self._use[key[0]][key] = next_use
            self.planned_bytes += size
            if next_use not in self._tails[next_use & _MASK]:
                self._uses.add(next_use)
        self._append(next_use, key)

    def remove(self, key: bytes) -> int:
        """Forget a key; its size (0 if absent)."""
        size = self._size[key[0]].pop(key, None)
        if size is None:
            return 0
        use = self._use[key[0]].pop(key, None)
        if use is None:
            self.unplanned_bytes -= size
        else:
            self.planned_bytes -= size
        if self._unlink(use, key) and use is not None:
            self._uses.remove(use)
        return size

    def touch(self, key: bytes) -> None:
        """A read: an unplanned block becomes the most recently used."""
        # _unlink + _append of the unplanned list, inlined: this runs on every RAM hit.
        tail = self._lru_tail
        shard = key[0]
        if key == tail or key not in self._size[shard] or key in self._use[shard]:
            return
        assert tail is not None  # key is in the (non-empty) unplanned list
        prev, following = self._prev, self._next
        before = prev[shard].pop(key, None)
        after = following[shard].pop(key)  # key is not the tail: something follows it
        if before is None:
            self._lru_head = after
            del prev[after[0]][after]
        else:
            following[before[0]][before] = after
            prev[after[0]][after] = before
        following[tail[0]][tail] = key
        prev[shard][key] = tail
        self._lru_tail = key

    def plan(self, key: bytes, next_use: int) -> None:
        """A plan will read ``key`` at ``next_use`` (re-planning moves it)."""
        size = self._size[key[0]].get(key)
        if size is None or self._use[key[0]].get(key) == next_use:
            return
        self.add(key, size, next_use)

    def unplan(self, key: bytes) -> None:
        """No plan reads ``key`` any more (consumed, or its plan was replaced)."""
        if key in self._use[key[0]]:
            self.add(key, self._size[key[0]][key], None)

    def order(self) -> list[bytes]:
        """Every key, first to be evicted first (unplanned by age, then furthest next use)."""
        keys = list(self._walk(None))
        for use in self._uses.descending():
            keys += self._walk(use)
        return keys

    def unplan_all(self) -> None:
        while self.unplan_some(UNPLAN_CHUNK):
            pass

    def unplan_some(self, count: int) -> bool:
        """Unplan up to ``count`` blocks, in eviction order (the furthest next use first: the
        blocks the plan needed last become the oldest unplanned ones); O(count).  True if
        planned blocks remain."""
        for _ in range(count):
            use = self._uses.largest()
            if use is None:
                return False
            self.unplan(self._heads[use & _MASK][use])
        return bool(self._uses)

    def victims(self, need: int, free: int, next_use: int | None) -> list[bytes] | None:
        """Keys to evict so that ``need`` bytes fit beside ``free``; None: do not admit.

        Nothing is removed: the caller removes the victims it acts on.
        """
        victims: list[bytes] = []
        if need <= free:
            return victims
        size_of = self._size
        for key in self._walk(None):
            victims.append(key)
            free += size_of[key[0]][key]
            if need <= free:
                return victims
        if next_use is None and need > self.scratch_bytes:
            return None  # an unplanned block displaces planned ones only within the scratch room
        for use in self._uses.descending():
            if next_use is not None and use <= next_use:
                return None  # everything left is needed no later than the newcomer
            for key in self._walk(use):
                victims.append(key)
                free += size_of[key[0]][key]
                if need <= free:
                    return victims
        return None

    # -- the lists: unplanned (use None) and one per next use -----------------------------

    def _walk(self, use: int | None) -> Iterator[bytes]:
        key = self._lru_head if use is None else self._heads[use & _MASK].get(use)
        following = self._next
        while key is not None:
            yield key
            key = following[key[0]].get(key)

    def _append(self, use: int | None, key: bytes) -> None:
        if use is None:
            tail = self._lru_tail
            self._lru_tail = key
            if tail is None:
                self._lru_head = key
        else:
            tails = self._tails[use & _MASK]
            tail = tails.get(use)
            tails[use] = key
            if tail is None:
                self._heads[use & _MASK][use] = key
        if tail is not None:
            self._next[tail[0]][tail] = key
            self._prev[key[0]][key] = tail

    def _unlink(self, use: int | None, key: bytes) -> bool:
        """Take ``key`` out of its list; True if the list is now empty (and gone)."""
        before = self._prev[key[0]].pop(key, None)
        after = self._next[key[0]].pop(key, None)
        if before is None:  # key was the head
            if after is None:
                if use is None:
                    self._lru_head = self._lru_tail = None
                else:
                    del self._heads[use & _MASK][use], self._tails[use & _MASK][use]
                return True
            if use is None:
                self._lru_head = after
            else:
                self._heads[use & _MASK][use] = after
            del self._prev[after[0]][after]
        elif after is None:  # key was the tail
            if use is None:
                self._lru_tail = before
            else:
                self._tails[use & _MASK][use] = before
            del self._next[before[0]][before]
        else:
            self._next[before[0]][before] = after
            self._prev[after[0]][after] = before
        return False


def _shards() -> list[dict[bytes, Any]]:
    return [{} for _ in range(SHARDS)]
