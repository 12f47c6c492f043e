"""The ai_prefetch service: datasets, jobs, plans and warmups over the filesystem core,
FUSE-free and HTTP-free (``control/routes.py`` turns requests into these calls and
:class:`~cubefs_fuse.errors.RequestError` kinds into statuses), and the filesystem's
AccessObserver, attributing every file request (a read from a file's start) to a job and
advancing its plan. Nothing leaks (docs/concurrency.md, "Jobs end"): a job whose process the
daemon can watch ends when it exits, one it cannot watch (and a plan for a job never
registered) after ``jobIdleTimeout`` seconds without a file request or a plan, and ending a job removes its loaders'
plans and its per-job metric series."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from cubefs_fuse.config import ClientConfig
from cubefs_fuse.errors import BadRequest, Forbidden, NoRoom, NotFound, TooLarge
from cubefs_fuse.fs.filesystem import OWNER_UNKNOWN, FileRequest, Filesystem
from cubefs_fuse.limits import PLAN_DTYPES
from cubefs_fuse.prefetch.datasets import Dataset, DatasetError, dataset_id, parse_dataset
from cubefs_fuse.prefetch.jobs import DataWait, HitCounters, JobKey, JobRegistry, JobSample
from cubefs_fuse.prefetch.scheduler import DEFAULT_LOADER, Plan, Scheduler
from cubefs_fuse.prefetch.warmup import Warmups
from cubefs_fuse.stats import AppReads, app_reads

# Registered file lists kept at once, by total bytes; the least recently used list that
# no plan refers to is dropped first.  2 GiB holds five 10-million-file lists.
MAX_DATASET_BYTES = 2 * 1024 * 1024 * 1024
# Arrays above this many elements are validated in a worker thread (~10 ms of numpy).
_BIG_ARRAY = 1_000_000
# How long a plan's answer waits for its first positions (the loader's first batches) to be
# in the cache: below cube_torch's own wait for the answer (PLAN_SUBMIT_WAIT, 1 s), so the
# loader starts with its first files local and never waits longer than it would anyway.
FIRST_WAIT = 0.9
# The idle check runs this often (at most every minute, at least 4 times per timeout),
# so an idle job outlives its timeout by at most a quarter of it.
MAX_REAP_INTERVAL = 60.0

log = logging.getLogger(__name__)


class PrefetchService:
    def __init__(self, nursery: trio.Nursery, fs: Filesystem, config: ClientConfig) -> None:
        self.fs = fs
        self.config = config
        self.started = time.time()
        self.datasets: OrderedDict[str, Dataset] = OrderedDict()
        self.jobs = JobRegistry()
        # Half of the RAM tier for the lookahead window; the rest keeps the resident set.
        self.scheduler = Scheduler(nursery, fs, window_bytes=max(1, config.mem_cache_size // 2))
        self.warmups = Warmups(nursery, fs)
        self._nursery = nursery
        self.idle_timeout = config.job_idle_timeout
        # (job, rank) -> the scope of the task that waits for its process to exit.
        self._watchers: dict[JobKey, trio.CancelScope] = {}
        # Plans of jobs never registered: their last activity (they end when idle).
        self._orphans: dict[JobKey, float] = {}
        self.ended = 0  # jobs ended (exit or idle), for status
        # What applications read, every path (the daemon adds the fast path and the sample
        # store once it has them): the count status and stats show.
        self.reads: Callable[[], AppReads] = lambda: app_reads(self.fs.statistics(), None, None)
        nursery.start_soon(self._reap_idle)

    # -- AccessObserver ----------------------------------------------------------------

    async def opened(self, pid: int, path: str) -> object:
        key = await self.jobs.resolve(pid)
        self._observe_open(key, path)
        return key

    def opened_now(self, pid: int, path: str) -> object:
        known, key = self.jobs.resolve_now(pid)
        if not known:
            return OWNER_UNKNOWN
        self._observe_open(key, path)
        return key

    def _observe_open(self, key: JobKey | None, path: str) -> None:
        if key is not None:
            self.jobs.touch(key)
            self.scheduler.observe_open(key, path)

    def released(self, f: FileRequest) -> None:
        key = f.owner if isinstance(f.owner, tuple) else None
        self.jobs.record(key, f.waited, f.stall)
        if key is not None:
            self.scheduler.observe_release(key, f.path, f.waited)  # the loader's own counters
            self.fs.blocks.unplan_file(f.path, f.version, f.keys)  # consumed: evict it before anything planned

    def job_samples(self) -> tuple[JobSample, ...]:
        samples = []
        for key, j in self.jobs.jobs.items():
            plans = self.scheduler.plans_of(key)
            samples.append(JobSample(j.name, j.rank, j.counters.requests, j.counters.hits, j.counters.misses,
                                     j.counters.stall_seconds, _combined(plans), len(plans), j.data_wait))
        return tuple(samples)

    # -- status ------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        await self.fs.settle()  # count the reads the FUSE session served
        cache = self.fs.cache.statistics()
        tiers = {"ram": {"used_bytes": cache.ram.used_bytes, "limit_bytes": cache.ram.limit_bytes,
                         "blocks": cache.ram.blocks}}
        if cache.disk is not None:
            tiers["disk"] = {"used_bytes": cache.disk.used_bytes, "limit_bytes": cache.disk.effective_limit_bytes,
                             "blocks": cache.disk.blocks}
        return {
            "pid": os.getpid(),
            "volume": self.config.vol_name, "mount_point": self.config.mount_point, "source": self.config.source,
            "uptime": time.time() - self.started, "cache": tiers,
            "hits": self._hits().as_dict(), "reads": self.reads().as_dict(), "datasets": len(self.datasets),
            "jobs": [{"job": j.name, "rank": j.rank, "pid": j.pid, **j.counters.as_dict(),
                      "loaders": len(self.scheduler.plans_of(key))}
                     for key, j in self.jobs.jobs.items()],
            "plans": self.scheduler.summaries(), "jobs_ended": self.ended,
            "counters": self._counters(),
        }

    def _hits(self) -> HitCounters:
        """Every file request of the mount and the fast path (``reads`` adds the sample cache)."""
        files = self.reads().files
        return HitCounters(files.requests, files.hits, files.misses, files.stall_seconds)

    def _counters(self) -> dict[str, Any]:
        """Monotonic counters for rate views (``cubefs-fuse stats``)."""
        fs, cache, backend = self.fs.statistics(), self.fs.cache.statistics(), self.fs.backend.statistics()
        files = self.reads().files  # as the file_* metrics: the mount's and the fast path's
        return {
            "lookups": fs.lookups, "reads": fs.reads, "read_bytes": fs.read_bytes,
            "bytes_by_source": fs.bytes_by_source, "file_requests": files.requests,
            "file_misses": files.misses, "stall_seconds": files.stall_seconds,
            "block_hits_ram": cache.hits_ram, "block_hits_disk": cache.hits_disk, "block_misses": cache.misses,
            "backend_operations": sum(backend.operations.values()), "backend_bytes": backend.bytes_read,
            "backend_errors": sum(backend.errors.values()),
            "prefetch_issued": cache.prefetch_issued, "prefetch_used": cache.prefetch_used,
            "prefetch_wasted": cache.prefetch_wasted,
        }

    async def stats(self, job: str | None) -> dict[str, Any]:
        """Hit counters per job (``since_last`` restarts at each call) and prefetch counters."""
        await self.fs.settle()  # count the reads the FUSE session served
        report = self.jobs.report(job)
        for entry in report["jobs"]:
            plans = [p.summary() for p in self.scheduler.plans_of((entry["job"], entry["rank"]))]
            entry["plans"] = plans  # one per loader, oldest first
            entry["plan"] = plans[-1] if plans else None  # the newest (what clients before loaders read)
        cache = self.fs.cache.statistics()
        report["prefetch"] = {"issued": cache.prefetch_issued, "completed": cache.prefetch_completed,
                              "failed": cache.prefetch_failed, "used": cache.prefetch_used,
                              "wasted": cache.prefetch_wasted}
        return report

    # -- datasets ----------------------------------------------------------------------

    async def register_dataset(self, body: bytes, columns: int) -> tuple[Dataset, bool]:
        """The dataset of a NUL-separated file list, and whether it was registered already."""
        known_id = await trio.to_thread.run_sync(dataset_id, body, columns)
        known = self.datasets.get(known_id)
        if known is not None:  # re-registration is free: no parse, no second copy
            self.datasets.move_to_end(known_id)
            return known, True
        try:
            dataset = await trio.to_thread.run_sync(parse_dataset, body, columns)
        except DatasetError as exc:
            raise BadRequest(str(exc)) from None
        already = dataset.id in self.datasets
        if not already:
            self._make_room(dataset.nbytes)
        self.datasets[dataset.id] = self.datasets.pop(dataset.id, dataset)
        return self.datasets[dataset.id], already

    def _make_room(self, nbytes: int) -> None:
        """Drop least recently used lists no plan refers to until ``nbytes`` fit the budget."""
        if nbytes > MAX_DATASET_BYTES:
            raise TooLarge(f"the file list needs {nbytes} bytes, over the limit of {MAX_DATASET_BYTES}")
        in_use = {plan.dataset.id for plan in self.scheduler.plans.values()}
        total = sum(d.nbytes for d in self.datasets.values())
        for old_id in list(self.datasets):
            if total + nbytes <= MAX_DATASET_BYTES:
                break
            if old_id not in in_use:
                total -= self.datasets.pop(old_id).nbytes
        if total + nbytes > MAX_DATASET_BYTES:
            raise NoRoom("registered file lists in use by plans fill the dataset memory budget")

    # -- jobs and plans ----------------------------------------------------------------

    async def register_job(self, job: str, rank: int, pid: int, *, caller_uid: int | None) -> None:
        """Attribute ``pid``'s opens to (job, rank); ``caller_uid`` must own it (None: trusted).

        pid 0 stands for callers in another pid namespace (a container without hostPID):
        their FUSE requests reach the daemon with pid 0 too.  They cannot be watched and
        end only when idle; other jobs end when their process exits.
        """
        key = (job, rank)
        pidfd: int | None = None
        if pid != 0:
            owner, pidfd = await trio.to_thread.run_sync(_inspect_process, pid)
            if owner is None:
                raise BadRequest(f"no process {pid}")
            if caller_uid is not None and caller_uid not in (0, owner):
                if pidfd is not None:
                    os.close(pidfd)
                raise Forbidden(f"process {pid} belongs to uid {owner}, not to you")
        old = self.jobs.jobs.get(key)
        self.jobs.register(job, rank, pid)
        self._orphans.pop(key, None)
        if old is not None and old.pid == pid and key in self._watchers and pidfd is not None:
            os.close(pidfd)  # already watched
            return
        scope = self._watchers.pop(key, None)
        if scope is not None:
            scope.cancel()
        if pidfd is not None:
            self._watchers[key] = scope = trio.CancelScope()
            self._nursery.start_soon(self._watch, key, pidfd, scope)

    async def report_reads(self, key: JobKey, files: int, *, caller_pid: int | None,
                           data_wait: DataWait | None = None) -> HitCounters:
        """The job's cube_torch reports the files its loaders have read (cumulative; reads
        the kernel's page cache answered reach no daemon otherwise).  Only the job's own
        processes may (``caller_pid`` resolves to ``key``; None: trusted), so no other user
        can dress up a job's hit rate.  The job's counters after the report."""
        if caller_pid is not None and await self.jobs.resolve(caller_pid) != key:
            raise Forbidden(f"only the processes of job {key[0]!r} rank {key[1]} report its reads")
        counters = self.jobs.report_reads(key, files, data_wait)
        if counters is None:
            raise NotFound(f"no job {key[0]!r} rank {key[1]} is registered")
        self.jobs.touch(key)  # reading, even if only from the page cache: not idle
        return counters

    async def _watch(self, key: JobKey, pidfd: int, scope: trio.CancelScope) -> None:
        """End ``key``'s job when the process behind ``pidfd`` exits."""
        try:
            with scope:
                await trio.lowlevel.wait_readable(pidfd)
                if self._watchers.get(key) is scope:
                    self.end_job(key, "its process exited")
        finally:
            os.close(pidfd)

    def end_job(self, key: JobKey, why: str) -> None:
        """Forget a job, cancel and remove its plan, stop watching it."""
        scope = self._watchers.pop(key, None)
        if scope is not None:
            scope.cancel()
        job = self.jobs.unregister(key)
        plans = self.scheduler.remove_job(key)
        self._orphans.pop(key, None)
        if job is not None or plans:
            self.ended += 1
            log.info("job %s rank %d ended: %s", key[0], key[1], why)

    async def _reap_idle(self) -> None:
        interval = min(MAX_REAP_INTERVAL, self.idle_timeout / 4)
        while True:
            await trio.sleep(interval)
            self.reap_idle()

    def reap_idle(self) -> None:
        """End unwatched jobs and orphan plans idle for ``jobIdleTimeout`` (O(jobs))."""
        deadline = trio.current_time() - self.idle_timeout
        for key, job in list(self.jobs.jobs.items()):
            if key not in self._watchers and job.last_active < deadline:
                self.end_job(key, f"no open or plan for {self.idle_timeout:.0f} s")
        for key, last in list(self._orphans.items()):
            if last < deadline:
                self.end_job(key, f"plan of an unregistered job unused for {self.idle_timeout:.0f} s")

    async def submit_plan(self, key: JobKey, epoch: int, dataset_ref: str, order_bytes: bytes, dtype: str,
                          loader: str = DEFAULT_LOADER, first: int = 0) -> int:
        """Plan the epoch of ``key``'s DataLoader ``loader``: ``order_bytes`` is an array of
        ``dtype`` sample indices; returns its length.  It replaces that loader's previous
        plan only; the job's other loaders keep theirs.

        ``first``: the positions the loader asks for as soon as it starts; the answer
        waits (at most ``FIRST_WAIT``) until they are in the cache."""
        if dtype not in PLAN_DTYPES:
            raise BadRequest(f"dtype must be one of {', '.join(PLAN_DTYPES)}")
        await self.fs.settle()  # the last epoch's reads count for its plan, not this one
        dataset = self.datasets.get(dataset_ref)
        if dataset is None:
            raise NotFound("unknown dataset id: register the file list first (POST /v1/datasets)")
        if not order_bytes or len(order_bytes) % PLAN_DTYPES[dtype]:
            raise BadRequest(f"the order must be a non-empty array of {dtype} ({len(order_bytes)} bytes given)")

        def validate() -> np.ndarray:
            order = np.frombuffer(order_bytes, dtype=dtype)
            low, high = int(order.min()), int(order.max())
            if low < 0 or high >= dataset.samples:
                raise BadRequest(f"sample indices must be in [0, {dataset.samples}), got [{low}, {high}]")
            return order.astype(np.int64)

        count = len(order_bytes) // PLAN_DTYPES[dtype]
        order = await trio.to_thread.run_sync(validate) if count > _BIG_ARRAY else validate()
        self.datasets.move_to_end(dataset.id)
        plan = self.scheduler.submit((key[0], key[1], loader), epoch, dataset, order, first)
        if key in self.jobs.jobs:
            self.jobs.touch(key)
        else:
            self._orphans[key] = trio.current_time()
        if plan.first_end:
            await self.scheduler.wait_first(plan, FIRST_WAIT)
        return count

    # -- cache -------------------------------------------------------------------------

    async def drop_cache(self) -> int:
        """Empty both tiers and the metadata cache; the bytes freed."""
        before = self.fs.cache.statistics()
        await self.fs.cache.clear()
        self.fs.meta.clear()
        return before.ram.used_bytes + (before.disk.used_bytes if before.disk else 0)


def _combined(plans: list[Plan]) -> dict[str, Any] | None:
    """A (job, rank)'s plans as one, for the per-job metrics: samples, cursors and lookahead
    summed over its loaders, the newest epoch."""
    if not plans:
        return None
    summaries = [p.summary() for p in plans]
    combined = {key: sum(s[key] for s in summaries)
                for key in ("samples", "cursor", "lookahead_files", "lookahead_bytes", "issued", "used")}
    combined["epoch"] = max(s["epoch"] for s in summaries)
    return combined


def _inspect_process(pid: int) -> tuple[int | None, int | None]:
    """(owner uid or None if there is no such process, a pidfd or None if unavailable).

    The pidfd is opened first: if the pid is reused after that, the pidfd (which names
    the process that had it) reports the exit and the job ends."""
    pidfd: int | None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return None, None
        pidfd = None  # no pidfd support: the job ends by idle time only
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        if pidfd is not None:
            os.close(pidfd)
        return None, None
    return owner, pidfd
