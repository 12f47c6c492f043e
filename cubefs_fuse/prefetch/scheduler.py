"""Plan-driven prefetch: one lookahead window per (job, rank), ahead of its read cursor.

A plan is an epoch's sample order over a registered dataset.  Its cursor is the first
position not yet read; it advances as the daemon sees the job's processes open the
plan's files.  A task per plan keeps the files from the cursor up to a byte budget
(and ``MAX_WINDOW_FILES``) in flight or cached, nearest first: the files of each
chunk of positions are stat'ed in parallel (never by listing a directory, one round trip
per entry in series), then their blocks are handed, in plan order, to
``BlockCache.prefetch`` (background priority, bounded by the cache's prefetch slots, so
foreground reads always go first).  A new plan for the same (job, rank) cancels the
old one's task; its outstanding prefetches finish but nothing new is issued.  A plan
whose job ended is removed (``remove``); once no plan is left, every cached block
becomes unplanned again (plain LRU).

Nothing here does work proportional to the cache or the plan on the trio thread in one
go: re-ranking the cached blocks walks the cache shard by shard (``cache.tags``) with a
checkpoint every ``RERANK_STEP`` blocks, the numpy work runs in worker threads, and the
open path's position index grows ``OPEN_INDEX_STEP`` positions per open at most (the
plan's task extends it ``INDEX_STEP`` positions per checkpoint).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from cubefs_fuse.cache.tags import SHARDS
from cubefs_fuse.fs.filesystem import Filesystem
from cubefs_fuse.errors import FsError
from cubefs_fuse.prefetch.datasets import Dataset
from cubefs_fuse.prefetch.jobs import JobKey

log = logging.getLogger(__name__)

# Files the window may hold ahead of the cursor.  DataLoader workers read up to
# num_workers x prefetch_factor x batch_size samples ahead (8 x 2 x 256 = 4096 for a
# large job), so the window must cover that; its bytes are bounded separately.
MAX_WINDOW_FILES = 4096
# Positions ahead of the cursor indexed for matching opens (path -> position).  Larger
# than the window so that a reader that runs ahead of the prefetch is still recognised
# and the window jumps forward to it instead of prefetching what was already read.
MATCH_AHEAD = 4 * MAX_WINDOW_FILES
# Concurrent files being stat'ed and issued by one plan's window task.
ISSUE_CONCURRENCY = 32
# Size assumed for a file whose attributes are not cached (an ImageNet JPEG averages ~110 KB).
AVERAGE_FILE_GUESS = 128 * 1024
# Cached blocks re-ranked between two checkpoints.  A block costs ~2-4 us (a policy move
# in each tier), so 512 keep one step near 1-2 ms, far below the 20 ms a FUSE request
# may wait on the trio thread (docs/benchmarks.md, "Trio thread stalls").
RERANK_STEP = 512
# Blocks gathered (a shard at a time) before their positions are computed in one worker
# call: 64k tags take ~5 ms of numpy there, and a 10^6-block cache needs 16 calls.
RERANK_BATCH = 65536
# Plan positions indexed for matching opens per checkpoint of the plan's task (~5 us each
# for a one-file sample: ~1 ms per step), and at most per open (an open that arrives
# before the task first ran still finds the first positions; ~80 us at worst).
INDEX_STEP = 256
OPEN_INDEX_STEP = 16
# Planned blocks made unplanned per checkpoint once the last plan is gone (~2 us each).
UNPLAN_STEP = 1024
# Positions whose files the window stats together, in parallel, before it hands their
# blocks to the cache in plan order (nearest first) with their real sizes counted.  Small,
# so the data of one chunk is issued after a few round trips, while the previous chunk's
# fetches are still running.
META_CHUNK = 32
# Backend stats in flight while a chunk is stat'ed: with the prefetch's 16 fetch slots,
# 8 of the default 32 backend threads stay free for foreground reads.  At 1 ms per round
# trip that is ~8,000 stats/s, far above the cold files/s the daemon's CPU can fetch.
META_CONCURRENCY = 8
# The same for a plan's first positions: the loader waits for them and no prefetch is in
# flight yet, so twice as many.
FIRST_META_CONCURRENCY = 16


@dataclass
class PlanCounters:
    issued: int = 0  # files whose blocks were handed to the cache
    used: int = 0  # planned files opened by the job
    skipped: int = 0  # positions the reader passed without opening
    errors: int = 0


@dataclass
class Plan:
    key: JobKey
    epoch: int
    dataset: Dataset
    order: np.ndarray  # sample indices, int64
    cursor: int = 0  # first position not yet consumed
    issued_upto: int = 0  # positions below this have been issued (or consumed)
    warmed_upto: int = 0  # positions below this have had their files stat'ed
    indexed_upto: int = 0  # positions below this are in ``index``
    consumed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    index: dict[str, list[int]] = field(default_factory=dict)
    window_bytes: int = 0
    bytes_at: dict[int, int] = field(default_factory=dict)  # position -> bytes issued for it
    wake: trio.Event = field(default_factory=trio.Event)
    first_end: int = 0  # positions below this are brought in before anything else (``wait_first``)
    first_ready: trio.Event = field(default_factory=trio.Event)  # set once they are in (or failed)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    counters: PlanCounters = field(default_factory=PlanCounters)

    @property
    def length(self) -> int:
        return len(self.order)

    def summary(self) -> dict[str, Any]:
        return {
            "job": self.key[0], "rank": self.key[1], "epoch": self.epoch, "dataset": self.dataset.id,
            "samples": self.length, "cursor": self.cursor, "lookahead_files": self.issued_upto - self.cursor,
            "lookahead_bytes": self.window_bytes, "issued": self.counters.issued, "used": self.counters.used,
            "skipped": self.counters.skipped, "errors": self.counters.errors,
        }


class Scheduler:
    def __init__(self, nursery: trio.Nursery, fs: Filesystem, *, window_bytes: int) -> None:
        self._nursery = nursery
        self.fs = fs
        self.window_budget = window_bytes
        self.plans: dict[JobKey, Plan] = {}

    def submit(self, key: JobKey, epoch: int, dataset: Dataset, order: np.ndarray, first: int = 0) -> Plan:
        """Start ``key``'s plan (replacing its previous one).  ``first``: positions the
        loader asks for as soon as it starts (its workers' first batches); the plan's task
        brings them in before anything else and :meth:`wait_first` waits for them."""
        old = self.plans.get(key)
        if old is not None:
            old.scope.cancel()
        plan = Plan(key, epoch, dataset, order, consumed=np.zeros(len(order), dtype=bool),
                    first_end=max(0, min(first, len(order), MAX_WINDOW_FILES)))
        self.plans[key] = plan
        self._nursery.start_soon(self._run, plan)
        return plan

    def remove(self, key: JobKey) -> Plan | None:
        """Cancel and forget ``key``'s plan (its job ended); the last one unplans the cache."""
        plan = self.plans.pop(key, None)
        if plan is None:
            return None
        plan.scope.cancel()
        if not self.plans:
            self._nursery.start_soon(self._unplan_all)
        return plan

    async def _unplan_all(self) -> None:
        """No plan is left: every cached block is evicted by recency again (in steps)."""
        while not self.plans and self.fs.cache.unplan_some(UNPLAN_STEP):
            await trio.lowlevel.checkpoint()

    def observe_open(self, key: JobKey, path: str) -> bool:
        """A process of ``key`` opened ``path``; True if it was a planned file."""
        plan = self.plans.get(key)
        if plan is None:
            return False
        if plan.indexed_upto < min(plan.length, plan.cursor + MATCH_AHEAD):
            # An open can arrive before the plan's task first ran (right after the submit
            # was answered): index a few positions now (the task indexes the rest).
            self._extend_index(plan, OPEN_INDEX_STEP)
        positions = plan.index.get(path)
        if not positions:
            return False
        position = positions.pop(0)
        if not positions:
            del plan.index[path]
        if plan.consumed[position]:
            return True
        plan.consumed[position] = True
        plan.counters.used += 1
        plan.window_bytes -= plan.bytes_at.pop(position, 0)
        if position >= plan.issued_upto:
            # The reader is ahead of the window: never prefetch what it has passed.
            plan.issued_upto = position + 1
        self._advance(plan, position)
        plan.wake.set()
        return True

    def _advance(self, plan: Plan, position: int) -> None:
        # Positions far behind the newest read are taken as skipped (the reader will not
        # come back for them); readers interleave, so only a window's worth behind counts.
        floor = position - MAX_WINDOW_FILES
        while plan.cursor < plan.length and (plan.consumed[plan.cursor] or plan.cursor < floor):
            if not plan.consumed[plan.cursor]:
                plan.counters.skipped += 1
                plan.window_bytes -= plan.bytes_at.pop(plan.cursor, 0)
            plan.cursor += 1

    def _extend_index(self, plan: Plan, most: int) -> bool:
        """Index up to ``most`` more positions toward ``MATCH_AHEAD`` past the cursor;
        True if more remain."""
        target = min(plan.length, plan.cursor + MATCH_AHEAD)
        start = max(plan.indexed_upto, plan.cursor)
        end = min(target, start + most)
        dataset = plan.dataset
        for position in range(start, end):
            for path in dataset.sample_paths(int(plan.order[position])):
                plan.index.setdefault(path, []).append(position)
        plan.indexed_upto = max(plan.indexed_upto, end)
        return plan.indexed_upto < target

    async def _index_ahead(self, plan: Plan) -> None:
        while self._extend_index(plan, INDEX_STEP):
            await trio.lowlevel.checkpoint()

    async def wait_first(self, plan: Plan, timeout: float) -> bool:
        """Wait until the plan's first positions are in the cache (or failed), at most
        ``timeout`` seconds; True if they are."""
        with trio.move_on_after(timeout):
            await plan.first_ready.wait()
        return plan.first_ready.is_set()

    async def _run(self, plan: Plan) -> None:
        with plan.scope:
            try:
                async with trio.open_nursery() as nursery:
                    try:
                        await self._issue_first(plan)
                    finally:
                        nursery.start_soon(self._signal_first, plan)
                    await self._rerank(plan)
                    await self._fill(plan)
            except Exception:
                log.exception("prefetch for job %s rank %d failed; reads continue unprefetched", *plan.key)

    async def _rerank(self, plan: Plan) -> None:
        """Give every cached block of the plan's files its position (eviction keeps the
        ones needed soonest); with no other plan active, the rest become unplanned.

        The cache changes between steps: plan() and unplan() ignore blocks evicted since
        their shard was copied, and a block added since got its position (or none) from
        whoever added it."""
        cache = self.fs.cache
        inverse: list[np.ndarray] = []  # computed once, in the first worker call

        def positions_of(tags: np.ndarray) -> np.ndarray:
            if not inverse:
                inverse.append(plan.dataset.inverse_of(plan.order))
            return plan.dataset.positions_of(tags, inverse[0])

        keys: list[bytes] = []
        tags: list[int] = []
        gathered = 0  # keys copied since the last checkpoint
        for shard in range(SHARDS):
            shard_keys, shard_tags = cache.tagged_shard(shard)
            keys += shard_keys
            tags += shard_tags
            gathered += len(shard_keys)
            if len(keys) < RERANK_BATCH and shard < SHARDS - 1:
                if gathered >= RERANK_STEP:
                    # A checkpoint per copied RERANK_STEP keys, not per shard: on a busy
                    # loop each one waits a scheduling round, and 256 of them for an
                    # empty cache would hold a cold epoch's window back by ~0.5 s.
                    gathered = 0
                    await trio.lowlevel.checkpoint()
                continue
            if not keys:
                continue
            tag_array = np.array(tags, dtype=np.uint64)
            positions = (await trio.to_thread.run_sync(positions_of, tag_array)).tolist()
            for start in range(0, len(keys), RERANK_STEP):
                alone = len(self.plans) == 1
                for key, tag, position in zip(keys[start : start + RERANK_STEP], tags[start : start + RERANK_STEP],
                                              positions[start : start + RERANK_STEP]):
                    if not tag:
                        continue  # a block whose file is unknown (after a crash scan) cannot be ranked
                    if position >= 0:
                        cache.plan(key, position)
                    elif alone:
                        cache.unplan(key)
                await trio.lowlevel.checkpoint()
            keys, tags = [], []

    async def _fill(self, plan: Plan) -> None:
        slots = trio.Semaphore(ISSUE_CONCURRENCY)
        async with trio.open_nursery() as nursery:
            while True:
                await self._index_ahead(plan)
                issued_any = False
                # Take positions nearest first while the window has files and bytes to
                # spare: each chunk's files stat'ed in parallel, then issued in order.
                while (plan.issued_upto < plan.length and plan.issued_upto - plan.cursor < MAX_WINDOW_FILES
                       and plan.window_bytes < self.window_budget):
                    if plan.warmed_upto <= plan.issued_upto:
                        end = min(plan.length, plan.issued_upto + META_CHUNK)
                        await self._warm_metadata(plan, plan.issued_upto, end, META_CONCURRENCY)
                        continue  # the reader may have moved meanwhile
                    position = plan.issued_upto
                    plan.issued_upto += 1
                    if plan.consumed[position] or position < plan.cursor:
                        continue
                    await self._start_issue(nursery, plan, position, slots)
                    issued_any = True
                if plan.issued_upto >= plan.length and not issued_any:
                    return
                plan.wake = trio.Event()
                await plan.wake.wait()

    async def _issue_first(self, plan: Plan) -> None:
        """Issue the first positions before the re-ranking and the window (the loader's
        workers are about to open them): their files stat'ed all at once, then their
        blocks handed to the cache."""
        if not plan.first_end:
            return
        await self._warm_metadata(plan, 0, plan.first_end, FIRST_META_CONCURRENCY)
        slots = trio.Semaphore(ISSUE_CONCURRENCY)
        async with trio.open_nursery() as nursery:
            while plan.issued_upto < plan.first_end and plan.window_bytes < self.window_budget:
                position = plan.issued_upto
                plan.issued_upto += 1
                await self._start_issue(nursery, plan, position, slots)

    async def _signal_first(self, plan: Plan) -> None:
        """Set ``first_ready`` once the first positions' blocks have landed (or failed),
        while the window goes on issuing what follows them."""
        try:
            for position in range(min(plan.issued_upto, plan.first_end)):
                for path in plan.dataset.sample_paths(int(plan.order[position])):
                    await self.fs.blocks.settled(path)
        finally:
            plan.first_ready.set()

    async def _start_issue(self, nursery: trio.Nursery, plan: Plan, position: int, slots: trio.Semaphore) -> None:
        """Count ``position`` into the window (its size as cached, else a guess that its
        stat corrects) and issue it in a task of its own once a slot is free."""
        estimate = self._estimate(plan, position)
        plan.bytes_at[position] = estimate
        plan.window_bytes += estimate
        await slots.acquire()
        nursery.start_soon(self._issue, plan, position, slots)

    async def _warm_metadata(self, plan: Plan, start: int, end: int, concurrency: int) -> None:
        """Stat the files of positions ``start`` to ``end`` that are not cached, in parallel
        (``MetadataCache.warm``)."""
        paths: dict[str, None] = {}
        for position in range(start, end):
            for path in plan.dataset.sample_paths(int(plan.order[position])):
                paths[path] = None
        await self.fs.meta.warm(paths, concurrency)
        plan.warmed_upto = max(plan.warmed_upto, end)

    def _estimate(self, plan: Plan, position: int) -> int:
        """Bytes of a sample's files from cached metadata (a guess for files not stat'ed yet)."""
        total = 0
        for path in plan.dataset.sample_paths(int(plan.order[position])):
            attr = self.fs.meta.peek(path)
            total += attr.size if attr is not None else AVERAGE_FILE_GUESS
        return total

    async def _issue(self, plan: Plan, position: int, slots: trio.Semaphore) -> None:
        """Hand the position's blocks to the cache (its files' attributes are cached, else
        stat'ed here); the window's byte count gets their real sizes."""
        try:
            size = 0
            for path in plan.dataset.sample_paths(int(plan.order[position])):
                size += await self.fs.blocks.prefetch_file(path, next_use=position)
            plan.counters.issued += 1
            estimate = plan.bytes_at.get(position)
            if estimate is not None:  # not consumed meanwhile
                plan.window_bytes += size - estimate
                plan.bytes_at[position] = size
                if size < estimate and plan.window_bytes < self.window_budget:
                    plan.wake.set()  # the guess was too high: the window has room again
        except (OSError, FsError):
            plan.counters.errors += 1
        finally:
            slots.release()

    def summaries(self) -> list[dict[str, Any]]:
        return [plan.summary() for plan in self.plans.values()]
