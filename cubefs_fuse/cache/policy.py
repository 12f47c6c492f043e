"""Eviction that knows the future: least recently used, then furthest next use (Belady).

Every block in a tier is either

* **unplanned** — no active plan will read it (again): ordered by recency, evicted
  first, oldest first (plain LRU when no plan is active); or
* **planned** — an active plan reads it at position ``next_use``: evicted only after
  every unplanned block, the furthest ``next_use`` first.

Admission follows Belady too: a planned block may displace a planned block needed
later than itself, never one needed sooner; an unplanned block may displace planned
ones only while unplanned blocks hold less than ``scratch_bytes`` (room for the block
a reader is consuming right now).  So when the dataset is larger than the tier, the
planned blocks already resident stay resident epoch after epoch (a stable subset)
instead of being flushed by every miss, and the lookahead window, whose blocks are
needed soonest, is never evicted to make room for anything needed later.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import count, islice


# Share of a tier that blocks no plan asks for may take from planned blocks (the block a
# reader is consuming right now, reads outside any plan).  1/32 keeps 97 % of the tier for
# the resident subset when the dataset is larger than the cache.
SCRATCH_FRACTION = 32


class PlannedLru:
    def __init__(self, scratch_bytes: int) -> None:
        self.scratch_bytes = scratch_bytes
        self._unplanned: OrderedDict[bytes, int] = OrderedDict()  # key -> size, oldest first
        self._planned: dict[bytes, tuple[int, int, int]] = {}  # key -> (next_use, size, serial)
        # (-next_use, serial, key); an entry is live only if its serial is the key's current
        # one (a key re-planned at the same position must not be found twice).
        self._heap: list[tuple[int, int, bytes]] = []
        self._serial = count()
        self.unplanned_bytes = 0
        self.planned_bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._unplanned or key in self._planned

    def __len__(self) -> int:
        return len(self._unplanned) + len(self._planned)

    def next_use(self, key: bytes) -> int | None:
        entry = self._planned.get(key)
        return entry[0] if entry is not None else None

    def add(self, key: bytes, size: int, next_use: int | None = None) -> None:
        self.remove(key)
        if next_use is None:
            self._unplanned[key] = size
            self.unplanned_bytes += size
        else:
            serial = next(self._serial)
            self._planned[key] = (next_use, size, serial)
            self.planned_bytes += size
            heapq.heappush(self._heap, (-next_use, serial, key))

    def remove(self, key: bytes) -> int:
        """Forget a key; its size (0 if absent)."""
        size = self._unplanned.pop(key, None)
        if size is not None:
            self.unplanned_bytes -= size
            return size
        entry = self._planned.pop(key, None)
        if entry is not None:
            self.planned_bytes -= entry[1]
            self._compact()
            return entry[1]
        return 0

    def touch(self, key: bytes) -> None:
        """A read: an unplanned block becomes the most recently used."""
        if key in self._unplanned:
            self._unplanned.move_to_end(key)

    def plan(self, key: bytes, next_use: int) -> None:
        """A plan will read ``key`` at ``next_use`` (re-planning moves it)."""
        if key in self._unplanned:
            size = self._unplanned.pop(key)
            self.unplanned_bytes -= size
        elif key in self._planned:
            if self._planned[key][0] == next_use:
                return
            size = self._planned.pop(key)[1]
            self.planned_bytes -= size
        else:
            return
        self.add(key, size, next_use)

    def unplan(self, key: bytes) -> None:
        """No plan reads ``key`` any more (consumed, or its plan was replaced)."""
        entry = self._planned.pop(key, None)
        if entry is not None:
            self.planned_bytes -= entry[1]
            self._unplanned[key] = entry[1]
            self.unplanned_bytes += entry[1]
            self._compact()

    def order(self) -> list[bytes]:
        """Every key, first to be evicted first (unplanned by age, then furthest next use)."""
        planned = sorted(self._planned.items(), key=lambda item: -item[1][0])
        return list(self._unplanned) + [key for key, _ in planned]

    def unplan_all(self) -> None:
        for key in list(self._planned):
            self.unplan(key)

    def unplan_some(self, count: int) -> bool:
        """Unplan up to ``count`` blocks (O(count): the first ones are always planned ones,
        since unplanning removes them); True if planned blocks remain."""
        for key in list(islice(self._planned, count)):
            self.unplan(key)
        return bool(self._planned)

    def victims(self, need: int, free: int, next_use: int | None) -> list[bytes] | None:
        """Keys to evict so that ``need`` bytes fit beside ``free``; None: do not admit.

        Nothing is removed: the caller removes the victims it acts on.
        """
        victims: list[bytes] = []
        if need <= free:
            return victims
        for key, size in self._unplanned.items():
            victims.append(key)
            free += size
            if need <= free:
                return victims
        if next_use is None and need > self.scratch_bytes:
            return None  # an unplanned block displaces planned ones only within the scratch room
        popped: list[tuple[int, int, bytes]] = []
        admitted = False
        while self._heap:
            entry = heapq.heappop(self._heap)
            neg_use, serial, key = entry
            planned = self._planned.get(key)
            if planned is None or planned[2] != serial:
                continue  # stale
            popped.append(entry)
            if next_use is not None and -neg_use <= next_use:
                break  # everything left is needed no later than the newcomer
            victims.append(key)
            free += planned[1]
            if need <= free:
                admitted = True
                break
        # Live entries go back, so that this stays a query (entries of victims the caller
        # then removes turn stale and are compacted away).
        for entry in popped:
            heapq.heappush(self._heap, entry)
        return victims if admitted else None

    def _compact(self) -> None:
        # Drop stale heap entries once they outnumber live ones (amortised O(1) per change).
        if len(self._heap) > 2 * len(self._planned) + 64:
            self._heap = [e for e in self._heap if self._planned.get(e[2], (0, 0, -1))[2] == e[1]]
            heapq.heapify(self._heap)
