"""Jobs, the processes that belong to them, and per-job hit accounting. A training job
registers its main process per rank; a FUSE request's pid is attributed to a job by walking
its ancestry in ``/proc/<pid>/status`` (in a worker thread, cached ``RESOLVE_TTL`` seconds
so a reused pid is not credited for long), since DataLoader workers are its children. A
request is one read of a regular file from its start that reaches the daemon (or one file
the fast path served), a hit if that read did not wait on the backend.  A file the kernel's
page cache serves whole reaches no daemon: the job's own cube_torch reports how many files
its loaders read, and a job's requests are the larger of the two counts (``JobReads``).
The daemon's own prefetch never counts, and when a job ends is the service's decision
(prefetch/service.py)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

# Cached pid -> job attributions expire after this many seconds (pid reuse safety).
RESOLVE_TTL = 10.0
# Bound on cached attributions (each a few dozen bytes); cleared wholesale when full.
MAX_RESOLVED = 65536
# Ancestors walked from a reading thread up to a registered process (thread -> worker ->
# launcher -> trainer is 4; 16 leaves room for wrappers such as torchrun and shells).
MAX_ANCESTRY = 16

JobKey = tuple[str, int]  # (job, rank)


@dataclass
class HitCounters:
    requests: int = 0
    hits: int = 0
    misses: int = 0
    stall_seconds: float = 0.0

    def record(self, waited: bool, stall: float) -> None:
        self.requests += 1
        if waited:
            self.misses += 1
            self.stall_seconds += stall
        else:
            self.hits += 1

    def minus(self, other: HitCounters) -> HitCounters:
        return HitCounters(self.requests - other.requests, self.hits - other.hits,
                           self.misses - other.misses, self.stall_seconds - other.stall_seconds)

    def add(self, other: HitCounters) -> None:
        self.requests += other.requests
        self.hits += other.hits
        self.misses += other.misses
        self.stall_seconds += other.stall_seconds

    def copy(self) -> HitCounters:
        return HitCounters(self.requests, self.hits, self.misses, self.stall_seconds)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hit_rate"] = self.hits / self.requests if self.requests else 0.0
        return data


@dataclass
class JobReads:
    """One job's file requests from two witnesses.  The daemon counts the reads it answers
    (``seen``; a miss is one that waited on the source, and every miss reaches the daemon);
    the job's cube_torch reports how many files its loaders have read (``reported``), reads
    the kernel's page cache answered included, which reach no daemon.  Each count misses
    what the other sees (a job without cube_torch reports nothing; cube_torch counts a batch
    only once the loop has it), so the requests are the larger of the two."""

    seen: HitCounters = field(default_factory=HitCounters)
    reported: int = 0

    def counters(self) -> HitCounters:
        requests = max(self.seen.requests, self.reported)
        return HitCounters(requests, requests - self.seen.misses, self.seen.misses, self.seen.stall_seconds)


@dataclass(frozen=True, slots=True)
class DataWait:
    """How long the job's training steps waited for their batches (cube_torch's
    DevicePrefetcher measures it in the training process and reports it with the reads):
    steps, seconds waited and seconds of step time in all, and the waits' p50 and p99."""

    steps: int = 0
    wait_seconds: float = 0.0
    step_seconds: float = 0.0
    p50_seconds: float = 0.0
    p99_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class JobSample:
    """One job's counters and plan summary, for the metrics exporter."""

    job: str
    rank: int
    requests: int
    hits: int
    misses: int
    stall_seconds: float
    plan: dict[str, Any] | None  # its loaders' plans combined (prefetch/service.py), None without one
    loaders: int = 0  # DataLoaders with a plan
    data_wait: DataWait | None = None  # None until the job's cube_torch reports one


@dataclass
class Job:
    name: str
    rank: int
    pid: int
    registered_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=trio.current_time)  # last file request or plan (trio clock)
    reads: JobReads = field(default_factory=JobReads)
    last_reported: HitCounters = field(default_factory=HitCounters)  # counters at the last stats call
    data_wait: DataWait | None = None  # the newest its cube_torch reported (cumulative)

    @property
    def counters(self) -> HitCounters:
        return self.reads.counters()


def _status_fields(pid: int) -> tuple[int, int] | None:
    """(tgid, ppid) of a thread or process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return None
    tgid = ppid = -1
    for line in text.splitlines():
        if line.startswith(b"Tgid:"):
            tgid = int(line.split()[1])
        elif line.startswith(b"PPid:"):
            ppid = int(line.split()[1])
            break  # PPid follows Tgid in /proc/<pid>/status
    return (tgid, ppid) if tgid > 0 else None


def _registered_ancestor(pid: int, registered: frozenset[int]) -> int | None:
    """The registered pid among ``pid``, its thread group leader and its ancestors, if any
    (reads /proc: run in a worker thread)."""
    current = pid
    for _ in range(MAX_ANCESTRY):
        if current in registered:
            return current
        fields = _status_fields(current)
        if fields is None:
            return None
        tgid, ppid = fields
        if tgid in registered:
            return tgid
        if ppid <= 1:
            return None
        current = ppid
    return None


class JobRegistry:
    def __init__(self) -> None:
        self.jobs: dict[JobKey, Job] = {}
        self._by_pid: dict[int, JobKey] = {}
        self._resolved: dict[int, tuple[float, JobKey | None]] = {}
        self.total = HitCounters()
        self._total_reported = HitCounters()

    def register(self, name: str, rank: int, pid: int) -> Job:
        key = (name, rank)
        job = self.jobs.get(key)
        if job is None or job.pid != pid:
            old = self.jobs.get(key)
            job = Job(name, rank, pid)
            if old is not None:
                job.reads, job.last_reported, job.data_wait = old.reads, old.last_reported, old.data_wait
                self._by_pid.pop(old.pid, None)
            self.jobs[key] = job
        self._by_pid[pid] = key
        self._resolved.clear()
        return job

    def resolve_now(self, pid: int) -> tuple[bool, JobKey | None]:
        """(True, what :meth:`resolve` answers) if that needs no /proc read; else (False, None)."""
        if pid == 0:
            # Requests from another pid namespace: the job registered from there, if any
            # (with several such jobs the latest registration wins; hostPID avoids that).
            return True, self._by_pid.get(0)
        cached = self._resolved.get(pid)
        if cached is not None and cached[0] > time.monotonic():
            return True, cached[1]
        if pid in self._by_pid:
            found = self._by_pid[pid]
            self._remember(pid, found)
            return True, found
        return False, None

    async def resolve(self, pid: int) -> JobKey | None:
        """The (job, rank) a thread/process belongs to, or None; /proc is read in a thread."""
        known, found = self.resolve_now(pid)
        if known:
            return found
        registered = frozenset(self._by_pid)  # O(jobs): a handful
        owner = await trio.to_thread.run_sync(_registered_ancestor, pid, registered)
        found = self._by_pid.get(owner) if owner is not None else None
        self._remember(pid, found)
        return found

    def _remember(self, pid: int, found: JobKey | None) -> None:
        if len(self._resolved) >= MAX_RESOLVED:
            self._resolved.clear()
        self._resolved[pid] = (time.monotonic() + RESOLVE_TTL, found)

    def touch(self, key: JobKey) -> None:
        job = self.jobs.get(key)
        if job is not None:
            job.last_active = trio.current_time()

    def unregister(self, key: JobKey) -> Job | None:
        """Forget a job (its process exited, or it was idle too long); its counters stay
        in the totals.  The job, or None if it was not registered."""
        job = self.jobs.pop(key, None)
        if job is None:
            return None
        if self._by_pid.get(job.pid) == key:
            del self._by_pid[job.pid]
        self._resolved.clear()  # cached attributions may name it
        return job

    def record(self, key: JobKey | None, waited: bool, stall: float) -> None:
        job = self.jobs.get(key) if key is not None else None
        if job is None:
            self.total.record(waited, stall)
            return
        # What the job's counters gain (JobReads.counters), added to the total without
        # building them twice: a request only if the daemon's count passes the job's
        # report (a read the job had reported adds none); a miss is always one.
        reads = job.reads
        gained = 1 if reads.seen.requests >= reads.reported else 0
        reads.seen.record(waited, stall)
        total = self.total
        total.requests += gained
        if waited:
            total.misses += 1
            total.hits += gained - 1
            total.stall_seconds += stall
        else:
            total.hits += gained

    def report_reads(self, key: JobKey, files: int, data_wait: DataWait | None = None) -> HitCounters | None:
        """The job's cube_torch says its loaders have read ``files`` files so far (a
        cumulative count: an older or repeated report changes nothing), and how long its
        steps waited for their batches (cumulative too: kept unless it counts fewer steps
        than the one kept).  The job's counters, None if it is not registered."""
        job = self.jobs.get(key)
        if job is None:
            return None
        if data_wait is not None and (job.data_wait is None or data_wait.steps >= job.data_wait.steps):
            job.data_wait = data_wait
        before = job.counters
        job.reads.reported = max(job.reads.reported, files)
        after = job.counters
        self.total.add(after.minus(before))
        return after

    def report(self, name: str | None) -> dict[str, Any]:
        """Cumulative and since-last-call counters, per job (or one job) and in total."""
        jobs = []
        for job in self.jobs.values():
            if name is not None and job.name != name:
                continue
            cumulative = job.counters
            since = cumulative.minus(job.last_reported)
            job.last_reported = cumulative
            jobs.append({"job": job.name, "rank": job.rank, "pid": job.pid,
                         "cumulative": cumulative.as_dict(), "since_last": since.as_dict()})
        since_total = self.total.minus(self._total_reported)
        if name is None:
            self._total_reported = self.total.copy()
        return {"jobs": jobs, "global": {"cumulative": self.total.as_dict(), "since_last": since_total.as_dict()}}
