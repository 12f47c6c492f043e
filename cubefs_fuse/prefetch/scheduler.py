"""Plan-driven prefetch: one lookahead window per (job, rank, loader) plan, ahead of its
read cursor. A plan is one DataLoader's epoch order (at most ``MAX_LOADERS`` per rank); its
cursor advances as the job's opens match its paths; a task per plan keeps the files from the
cursor up to its share of the byte budget (and ``MAX_WINDOW_FILES``) in flight or cached,
issuing positions in plan order, as many at once as the cache has fetch slots: each file
is stat'ed by its own backend call (never by listing a directory), a small one's bytes
coming with it (``FileBlocks.prefetch_file``), a larger one's blocks handed to
``BlockCache.prefetch``, at background priority, except the loader's next files (the
plan's ``first``), which are fetched as foreground reads. Positions of all plans
are on one clock (``origin + i``, ``Scheduler.now``) so that eviction compares loaders
fairly, a new plan for the same loader cancels the old one's task, and nothing here does
work proportional to the cache or the plan in one step (docs/concurrency.md; details in
docs/ai_prefetch.md, "Inside the daemon")."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from cubefs_fuse.cache.shards import SHARDS
from cubefs_fuse.fs.filesystem import Filesystem
from cubefs_fuse.errors import FsError
from cubefs_fuse.limits import MAX_LOADERS
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
# Size assumed for a file whose attributes are not cached before the plan's issues have
# stat'ed any (an ImageNet JPEG averages ~110 KB); after that, the mean of those it has: a
# dataset's files are alike, and the window's bytes overshoot their bound by one guess.
AVERAGE_FILE_GUESS = 128 * 1024
# Cached blocks re-ranked between two checkpoints.  A block costs ~8 us of trio-thread
# CPU (a policy move in each tier; 4 ms per 512 at the median, 2-core VM, 2026-11-30),
# and on a shared VM the same work now and then takes 5-7 times as long (a fixed loop's
# CPU time: p99 3.5 x its median, the worst 17 x): 512 made steps of 20-29 ms at 10^6
# blocks, 128 keep the worst near 8 ms, below the 20 ms a FUSE request may wait on the
# trio thread (docs/benchmarks.md, "Trio thread stalls"), for ~8,000 checkpoints more.
RERANK_STEP = 128
# Blocks gathered (a shard at a time) before their positions are computed in one worker
# call: 64k tags take ~5 ms of numpy there, and a 10^6-block cache needs 16 calls.
RERANK_BATCH = 65536
# How long a new plan's window waits for the re-ranking before it fills beside it.  A cache
# of up to ~5 x 10^4 blocks is re-ranked within it (~8 us a block, RERANK_STEP), so the
# window then fills with every block ranked, as if in sequence; a larger cache (10^6 blocks:
# 33-44 s on the 2-core VM under benchmarks.trio_stalls' load) would otherwise hold the window
# back that long while the loader reads unprefetched (docs/ai_prefetch.md, "Re-rank").
RERANK_HEAD_START = 0.5
# Plan positions indexed for matching opens per checkpoint of the plan's task (~5 us each
# for a one-file sample: ~1 ms per step), and at most per open (an open that arrives
# before the task first ran still finds the first positions; ~80 us at worst).
INDEX_STEP = 256
OPEN_INDEX_STEP = 16
# Planned blocks made unplanned per checkpoint once the last plan is gone (~2 us each).
UNPLAN_STEP = 1024
# Positions issued from RAM (no task; 25-45 us each on the 2-core VM, a few dict lookups and
# a key per block) between two checkpoints: 64 keep a step near 2-3 ms, far below the 20 ms
# a FUSE request may wait on the trio thread.
RESIDENT_STEP = 64
# A plan none of whose files was opened for this long takes no share of the window
# budget (its loader stopped early, or was dropped mid-epoch): the others' windows grow
# back.  A DataLoader's workers open files many times a second; a minute without one is
# a loader that is not being iterated.  Its next open makes it active again.
PLAN_IDLE = 60.0
# The budget shares are recomputed (O(plans)) at most this often, or when plans come or go.
SHARE_REFRESH = 0.5

PlanKey = tuple[str, int, str]  # (job, rank, loader)
DEFAULT_LOADER = "0"  # the loader of clients that name none (before loaders had plans of their own)


@dataclass
class PlanCounters:
    issued: int = 0  # files whose blocks were handed to the cache
    used: int = 0  # planned files opened by the job
    skipped: int = 0  # positions the reader passed without opening
    errors: int = 0
    requests: int = 0  # opens matched to this plan, counted at release (as the job's requests)
    hits: int = 0  # ... that never waited on the backend


@dataclass
class Plan:
    key: PlanKey
    epoch: int
    dataset: Dataset
    order: np.ndarray  # sample indices, int64
    origin: int = 0  # the shared eviction clock's value at position 0 (module doc)
    submitted: float = 0.0  # trio clock
    last_open: float = 0.0  # trio clock: the last open matched to this plan (or its submission)
    cursor: int = 0  # first position not yet consumed
    issued_upto: int = 0  # positions below this have been issued (or consumed)
    resident_run: int = 0  # positions issued from RAM without a task (a checkpoint every RESIDENT_STEP)
    indexed_upto: int = 0  # positions below this are in ``index``
    consumed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    index: dict[str, list[int]] = field(default_factory=dict)
    window_bytes: int = 0
    bytes_at: dict[int, int] = field(default_factory=dict)  # position -> bytes issued for it
    files_sized: int = 0  # files its positions' issues have stat'ed ...
    bytes_sized: int = 0  # ... and their bytes: the mean is the guess for a file not stat'ed yet
    wake: trio.Event = field(default_factory=trio.Event)
    first_end: int = 0  # positions below this are brought in before anything else (``wait_first``)
    depth: int = 0  # positions past the cursor fetched as foreground reads (``Scheduler.depth``)
    first_ready: trio.Event = field(default_factory=trio.Event)  # set once they are in (or failed)
    reranked: trio.Event = field(default_factory=trio.Event)  # set once the cache is ranked for it
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    counters: PlanCounters = field(default_factory=PlanCounters)
    open_paths: dict[str, int] = field(default_factory=dict)  # matched opens not yet released

    @property
    def length(self) -> int:
        return len(self.order)

    @property
    def job(self) -> JobKey:
        return self.key[0], self.key[1]

    @property
    def finished(self) -> bool:
        return self.cursor >= self.length

    def summary(self) -> dict[str, Any]:
        c = self.counters
        return {
            "job": self.key[0], "rank": self.key[1], "loader": self.key[2], "epoch": self.epoch,
            "dataset": self.dataset.id, "samples": self.length, "cursor": self.cursor,
            "lookahead_files": self.issued_upto - self.cursor, "lookahead_bytes": self.window_bytes,
            "issued": c.issued, "used": c.used, "skipped": c.skipped, "errors": c.errors,
            "requests": c.requests, "hits": c.hits, "hit_rate": c.hits / c.requests if c.requests else 0.0,
        }


class Scheduler:
    def __init__(self, nursery: trio.Nursery, fs: Filesystem, *, window_bytes: int) -> None:
        self._nursery = nursery
        self.fs = fs
        self.window_budget = window_bytes
        self.plans: dict[PlanKey, Plan] = {}
        self._by_job: dict[JobKey, dict[str, Plan]] = {}  # (job, rank) -> loader -> plan
        self._clock_floor = 0  # the shared clock of removed plans (module doc)
        self._share = window_bytes
        self._share_at = -float("inf")  # trio clock of the last share computation

    def submit(self, key: PlanKey, epoch: int, dataset: Dataset, order: np.ndarray, first: int = 0) -> Plan:
        """Start ``key``'s plan (replacing that loader's previous one).  ``first``: positions
        the loader asks for as soon as it starts (its workers' first batches); the plan's
        task brings them in before anything else and :meth:`wait_first` waits for them."""
        job, loader = (key[0], key[1]), key[2]
        loaders = self._by_job.setdefault(job, {})
        old = self.plans.get(key)
        if old is None and len(loaders) >= MAX_LOADERS:
            # Loaders that never say goodbye (dropped, recreated every evaluation) must not
            # grow the table: the one read least recently gives way, finished ones first.
            gone = min(loaders.values(), key=lambda p: (not p.finished, p.last_open))
            log.info("job %s rank %d: %d loaders have plans; dropping loader %s's (least recently read)",
                     job[0], job[1], MAX_LOADERS, gone.key[2])
            self._forget(gone)
        now = trio.current_time()
        plan = Plan(key, epoch, dataset, order, origin=self.now(), submitted=now, last_open=now,
                    consumed=np.zeros(len(order), dtype=bool),
                    first_end=max(0, min(first, len(order), MAX_WINDOW_FILES)),
                    depth=max(0, min(first, MAX_WINDOW_FILES)))
        if old is not None:
            self._forget(old)
        self.plans[key] = plan
        self._by_job.setdefault(job, {})[loader] = plan
        self._shares_changed()
        self._nursery.start_soon(self._run, plan)
        return plan

    def now(self) -> int:
        """The shared eviction clock: the furthest position any plan has read (O(plans))."""
        return max([self._clock_floor, *(p.origin + p.cursor for p in self.plans.values())])

    def _forget(self, plan: Plan) -> None:
        plan.scope.cancel()
        self._clock_floor = max(self._clock_floor, plan.origin + plan.cursor)
        if self.plans.get(plan.key) is plan:
            del self.plans[plan.key]
        loaders = self._by_job.get(plan.job)
        if loaders is not None and loaders.get(plan.key[2]) is plan:
            del loaders[plan.key[2]]
            if not loaders:
                del self._by_job[plan.job]
        self._shares_changed()

    def _shares_changed(self) -> None:
        """A plan came, went or finished: shares are recomputed, and windows that may grow
        again are woken (O(plans), at most once per plan and epoch)."""
        self._share_at = -float("inf")
        for plan in self.plans.values():
            plan.wake.set()

    def plans_of(self, job: JobKey) -> list[Plan]:
        """The live plans of a (job, rank), one per loader, in submission order."""
        return sorted(self._by_job.get(job, {}).values(), key=lambda p: p.submitted)

    def remove_job(self, job: JobKey) -> list[Plan]:
        """Cancel and forget every loader's plan of ``job`` (it ended).  Blocks only they
        planned become unplanned: all of them when no plan is left, else by re-ranking
        the cache for the plans that remain."""
        gone = self.plans_of(job)
        for plan in gone:
            self._forget(plan)
        if gone:
            if not self.plans:
                self._nursery.start_soon(self._unplan_all)
            else:
                self._nursery.start_soon(self._rerank_remaining)
        return gone

    async def _unplan_all(self) -> None:
        """No plan is left: every cached block is evicted by recency again (in steps)."""
        while not self.plans and self.fs.cache.unplan_some(UNPLAN_STEP):
            await trio.lowlevel.checkpoint()

    async def _rerank_remaining(self) -> None:
        try:
            await self._rerank(None)
        except Exception:
            log.exception("re-ranking the cache after a job ended failed; eviction continues")

    @staticmethod
    def _active(plan: Plan, now: float) -> bool:
        """Still being read: not finished, and a file of it was opened (or it arrived)
        within ``PLAN_IDLE``."""
        return not plan.finished and now - plan.last_open < PLAN_IDLE

    def share(self) -> int:
        """Each active plan's share of the window budget (module doc)."""
        now = trio.current_time()
        if now - self._share_at >= SHARE_REFRESH:
            active = sum(1 for p in self.plans.values() if self._active(p, now))
            self._share = max(1, self.window_budget // max(1, active))
            self._share_at = now
        return self._share

    def observe_open(self, key: JobKey, path: str) -> bool:
        """A process of ``key`` opened ``path``; True if it was a planned file.  Of the
        (job, rank)'s loaders, the plan that reads ``path`` nearest its cursor takes it."""
        loaders = self._by_job.get(key)
        if not loaders:
            return False
        best: Plan | None = None
        best_position = 0
        for plan in loaders.values():  # at most MAX_LOADERS
            if plan.indexed_upto < min(plan.length, plan.cursor + MATCH_AHEAD):
                # An open can arrive before the plan's task first ran (right after the submit
                # was answered): index a few positions now (the task indexes the rest).
                self._extend_index(plan, OPEN_INDEX_STEP)
            positions = plan.index.get(path)
            if positions and (best is None or abs(positions[0] - plan.cursor) < abs(best_position - best.cursor)):
                best, best_position = plan, positions[0]
        if best is None:
            return False
        plan, position = best, best_position
        positions = plan.index[path]
        positions.pop(0)
        if not positions:
            del plan.index[path]
        plan.open_paths[path] = plan.open_paths.get(path, 0) + 1
        plan.last_open = trio.current_time()
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

    def observe_release(self, key: JobKey, path: str, waited: bool) -> None:
        """A process of ``key`` released ``path``: a request of the plan its open matched."""
        for plan in self._by_job.get(key, {}).values():
            count = plan.open_paths.get(path)
            if count:
                if count == 1:
                    del plan.open_paths[path]
                else:
                    plan.open_paths[path] = count - 1
                plan.counters.requests += 1
                plan.counters.hits += not waited
                return

    def _advance(self, plan: Plan, position: int) -> None:
        # Positions far behind the newest read are taken as skipped (the reader will not
        # come back for them); readers interleave, so only a window's worth behind counts.
        floor = position - MAX_WINDOW_FILES
        before = plan.cursor
        while plan.cursor < plan.length and (plan.consumed[plan.cursor] or plan.cursor < floor):
            if not plan.consumed[plan.cursor]:
                plan.counters.skipped += 1
                plan.window_bytes -= plan.bytes_at.pop(plan.cursor, 0)
            plan.cursor += 1
        depth = self.depth(plan)
        if depth and plan.cursor > before:
            self._promote(plan, max(before + depth, plan.cursor), plan.cursor + depth)
        if plan.finished:
            self._shares_changed()  # its share goes to the others

    def depth(self, plan: Plan) -> int:
        """Positions past the cursor fetched as foreground reads (module doc): the loader's
        batches in progress, but no more than the cache has fetch slots: more would only
        queue, in order, ahead of other readers' foreground reads."""
        return min(plan.depth, self.fs.cache.slots.total)

    def _promote(self, plan: Plan, start: int, end: int) -> None:
        """The issued, unread positions from ``start`` to ``end`` came within the plan's
        depth: their prefetches still waiting for a prefetch slot wait as foreground reads.
        At most :meth:`depth` positions per call (O(1) per block), amortised one per open."""
        for position in range(start, min(end, plan.issued_upto, plan.length)):
            if plan.consumed[position]:
                continue
            for path in plan.dataset.sample_paths(int(plan.order[position])):
                self.fs.blocks.promote_file(path)

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
                    taken = trio.Event()
                    nursery.start_soon(self._issue_first, plan, nursery, taken)
                    await taken.wait()
                    nursery.start_soon(self._rerank_then, plan)
                    with trio.move_on_after(RERANK_HEAD_START):
                        await plan.reranked.wait()
                    await self._fill(plan)
            except Exception:
                log.exception("prefetch for job %s rank %d loader %s failed; reads continue unprefetched",
                              *plan.key)

    async def _rerank_then(self, plan: Plan) -> None:
        try:
            await self._rerank(plan)
        finally:
            plan.reranked.set()

    async def _rerank(self, plan: Plan | None) -> None:
        """Give every cached block the soonest position at which an active plan reads it
        (eviction keeps the ones needed soonest); blocks no active plan reads become
        unplanned.  ``plan``: the new plan that asks (None: a plan went away).

        The cache changes between steps: plan() and unplan() ignore blocks evicted since
        their shard was copied, and a block added since got its position (or none) from
        whoever added it.  The plans move on too (a large cache is re-ranked while the new
        window fills, ``RERANK_HEAD_START``): a position its plan has passed or consumed
        since the snapshot is left as it is (consumption unplanned it already), so that no
        block read meanwhile is protected again as if it were still ahead."""
        if plan is not None and self.plans.get(plan.key) is not plan:
            return  # replaced before it started
        cache = self.fs.cache
        # Each active plan's own positions, on the shared clock.  An idle plan (a loader
        # dropped or left mid-epoch) protects nothing any more: its blocks go unplanned.
        now = trio.current_time()
        live = [p for p in self.plans.values() if p is plan or self._active(p, now)]
        inverse: list[np.ndarray] = []  # one per live plan, in the first worker call

        def unread_inverse(p: Plan) -> np.ndarray:
            """Sample -> the shared-clock position at which ``p`` reads it next (-1: not
            again: passed, consumed, or not in its order), with ``p``'s cursor and
            consumed marks as of this first worker call.  Folding them in once leaves one
            numpy pass per plan and tag batch: each pass gives the GIL up and waits to get
            it back from a busy trio thread (docs/benchmarks.md, "Trio thread stalls")."""
            positions = p.dataset.inverse_of(p.order)
            listed = positions >= 0
            at = positions[listed]
            unread = at >= p.cursor
            unread[unread] = ~p.consumed[at[unread]]
            positions[listed] = np.where(unread, at + p.origin, -1)
            return positions

        def positions_of(tag_list: list[int]) -> tuple[list[int], list[int]]:
            """Each tag's soonest position, and which of ``live`` reads it there, as lists
            (converted here: 2 x 64k ints are a few ms the trio thread does not spend)."""
            if not live:
                return [-1] * len(tag_list), [0] * len(tag_list)
            tags = np.array(tag_list, dtype=np.uint64)
            if not inverse:
                inverse.extend(unread_inverse(p) for p in live)
            best = live[0].dataset.positions_of(tags, inverse[0])
            which = np.zeros(len(tags), dtype=np.int64)
            for i, (p, p_inverse) in enumerate(zip(live[1:], inverse[1:]), 1):
                at = p.dataset.positions_of(tags, p_inverse)
                sooner = (at >= 0) & ((best < 0) | (at < best))
                best = np.where(sooner, at, best)
                which[sooner] = i
            return best.tolist(), which.tolist()

        def passed(position: int, reader: Plan) -> bool:
            """``reader`` has read (or passed) ``position`` since the snapshot."""
            at = position - reader.origin
            return at < reader.cursor or bool(reader.consumed[at])

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
            positions, by = await trio.to_thread.run_sync(positions_of, tags)
            for start in range(0, len(keys), RERANK_STEP):
                end = start + RERANK_STEP
                for key, tag, position, reader in zip(keys[start:end], tags[start:end], positions[start:end],
                                                      by[start:end]):
                    if not tag:
                        continue  # a block whose file is unknown (after a crash scan) cannot be ranked
                    if position < 0:
                        cache.unplan(key)
                    elif not passed(position, live[reader]):
                        cache.plan(key, position)
                await trio.lowlevel.checkpoint()
            keys, tags = [], []

    async def _fill(self, plan: Plan) -> None:
        slots = self._issue_slots()
        async with trio.open_nursery() as nursery:
            while True:
                await self._index_ahead(plan)
                issued_any = False
                # Take positions nearest first while the window has files and bytes to
                # spare, each issued in a task of its own (_issue_slots).
                while (plan.issued_upto < plan.length and plan.issued_upto - plan.cursor < MAX_WINDOW_FILES
                       and plan.window_bytes < self.share()):
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

    def _issue_slots(self) -> trio.Semaphore:
        """How many positions of one plan are being issued at once: as many as the cache
        has fetch slots.  A small file's issue is its fetch (``FileBlocks.prefetch_file``),
        so the slots bound the fetches; fewer would leave prefetch slots idle while a
        high-latency remote answers (files/s = fetches in flight / latency per file)."""
        return trio.Semaphore(self.fs.cache.slots.total)

    async def _issue_first(self, plan: Plan, plan_nursery: trio.Nursery, taken: trio.Event) -> None:
        """Issue the first positions before the re-ranking and the window (the loader's
        workers are about to open them): ``taken`` is set once each is taken (the window
        then fills beside their issues, which may wait on the source: a small file's
        issue brings its bytes), and ``_signal_first`` starts once they are all issued."""
        try:
            if plan.first_end:
                slots = self._issue_slots()
                async with trio.open_nursery() as nursery:
                    while plan.issued_upto < plan.first_end and plan.window_bytes < self.share():
                        position = plan.issued_upto
                        plan.issued_upto += 1
                        await self._start_issue(nursery, plan, position, slots)
                    taken.set()
        finally:
            taken.set()
            plan_nursery.start_soon(self._signal_first, plan)

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
        stat corrects) and issue it in a task of its own once a slot is free; a position
        whose files are all in RAM already (every later epoch of a dataset the tier holds)
        is issued here, with no task: nothing is fetched for it."""
        if self._issue_resident(plan, position):
            plan.resident_run += 1
            if plan.resident_run % RESIDENT_STEP == 0:
                await trio.lowlevel.checkpoint()
            return
        estimate = self._estimate(plan, position)
        plan.bytes_at[position] = estimate
        plan.window_bytes += estimate
        await slots.acquire()
        nursery.start_soon(self._issue, plan, position, slots)

    def _issue_resident(self, plan: Plan, position: int) -> bool:
        """:meth:`_issue` for a position whose files are all in RAM (``FileBlocks.plan_if_resident``):
        ranked and counted into the window at their sizes.  False if one is not (the files
        checked before it stay ranked; the task that issues the position ranks them again)."""
        blocks, next_use = self.fs.blocks, plan.origin + position
        size = 0
        for path in plan.dataset.sample_paths(int(plan.order[position])):
            file_size = blocks.plan_if_resident(path, next_use)
            if file_size is None:
                return False  # the files checked before stay ranked: the task ranks them again
            size += file_size
        plan.counters.issued += 1
        plan.bytes_at[position] = size
        plan.window_bytes += size
        return True

    def _estimate(self, plan: Plan, position: int) -> int:
        """Bytes of a sample's files from cached metadata (a guess for files not stat'ed yet)."""
        guess = plan.bytes_sized // plan.files_sized if plan.files_sized else AVERAGE_FILE_GUESS
        total = 0
        for path in plan.dataset.sample_paths(int(plan.order[position])):
            attr = self.fs.meta.peek(path)
            total += attr.size if attr is not None else guess
        return total

    async def _issue(self, plan: Plan, position: int, slots: trio.Semaphore) -> None:
        """Hand the position's blocks to the cache (a file whose attributes are not cached
        is stat'ed here, a small one's bytes coming with its stat: ``FileBlocks.prefetch_file``);
        the window's byte count gets their real sizes."""
        try:
            size = 0
            for path in plan.dataset.sample_paths(int(plan.order[position])):
                # Within the depth when issued: a read on the loader's behalf (module doc).
                urgent = position < plan.cursor + self.depth(plan)
                file_size = await self.fs.blocks.prefetch_file(path, next_use=plan.origin + position, urgent=urgent)
                plan.files_sized += 1
                plan.bytes_sized += file_size
                size += file_size
            plan.counters.issued += 1
            estimate = plan.bytes_at.get(position)
            if estimate is not None:  # not consumed meanwhile
                plan.window_bytes += size - estimate
                plan.bytes_at[position] = size
                if size < estimate and plan.window_bytes < self.share():
                    plan.wake.set()  # the guess was too high: the window has room again
        except (OSError, FsError):
            plan.counters.errors += 1
        finally:
            slots.release()

    def summaries(self) -> list[dict[str, Any]]:
        return [plan.summary() for plan in self.plans.values()]
