"""The ai_prefetch service: control API handlers over datasets, jobs, plans and the cache.

It is also the filesystem's AccessObserver: every application open is attributed to
a job (for per-job hit rates) and advances that job's plan cursor.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from cubefs_fuse import __version__
from cubefs_fuse.attrs import Attr
from cubefs_fuse.config import ClientConfig
from cubefs_fuse.control.server import ApiError, ControlServer, Request, Response
from cubefs_fuse.fs.filesystem import Filesystem, OpenFile
from cubefs_fuse.errors import FsError
from cubefs_fuse.metrics import JobSample
from cubefs_fuse.prefetch.datasets import Dataset, DatasetError, dataset_id, parse_dataset
from cubefs_fuse.prefetch.jobs import JobKey, JobRegistry
from cubefs_fuse.prefetch.scheduler import Scheduler
from cubefs_fuse.control.protocol import MAX_DATASET_BODY, MAX_NAME, MAX_PLAN_BODY, PLAN_DTYPES, PROTOCOL_VERSION

log = logging.getLogger(__name__)

# Registered file lists kept at once, by total bytes; the least recently used list that
# no plan refers to is dropped first.  2 GiB holds five 10-million-file lists.
MAX_DATASET_BYTES = 2 * 1024 * 1024 * 1024
# Arrays above this many elements are validated in a worker thread (~10 ms of numpy).
_BIG_ARRAY = 1_000_000
# Warmup tasks remembered for progress queries.
MAX_WARMUPS = 64
# Files a warmup fetches at once (each at prefetch priority, behind application reads).
WARMUP_CONCURRENCY = 16
# Paths per warmup request (a subtree counts as one path).
MAX_WARMUP_PATHS = 100_000
_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,%d}" % MAX_NAME)


@dataclass
class Warmup:
    id: int
    paths: list[str]
    check_only: bool
    files_total: int = 0
    files_done: int = 0
    files_cached: int = 0  # --check: files whose blocks are all cached
    bytes_total: int = 0
    bytes_done: int = 0
    bytes_cached: int = 0
    errors: int = 0
    done: bool = False
    started: float = field(default_factory=time.time)
    finished: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id, "paths": self.paths[:10], "check": self.check_only, "done": self.done,
            "files_total": self.files_total, "files_done": self.files_done, "files_cached": self.files_cached,
            "bytes_total": self.bytes_total, "bytes_done": self.bytes_done, "bytes_cached": self.bytes_cached,
            "cached_percent": 100.0 * self.bytes_cached / self.bytes_total if self.bytes_total else 100.0,
            "errors": self.errors, "elapsed": (self.finished or time.time()) - self.started,
        }


def _name(query: dict[str, str], key: str) -> str:
    value = query.get(key)
    if value is None or not _NAME.fullmatch(value):
        raise ApiError(400, f"query parameter {key!r} must be 1-{MAX_NAME} of [A-Za-z0-9_.:@-]")
    return value


def _int(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"{key!r} must be an integer in [{low}, {high}]")
    return value


def _relative_path(value: Any) -> str:
    """A path inside the volume: relative, normalised, no NUL; '' for the root."""
    if not isinstance(value, str) or "\0" in value or len(value.encode()) > 4096:
        raise ApiError(400, "paths must be strings without NUL bytes, at most 4096 bytes")
    if value.startswith("/"):
        raise ApiError(400, f"path {value!r} is absolute: give it relative to the volume root")
    parts = [p for p in value.split("/") if p]
    if any(p in (".", "..") for p in parts) or (value and "/".join(parts) != value.rstrip("/")):
        raise ApiError(400, f"path {value!r} is not normalised ('.', '..' and '//' are refused)")
    return "/".join(parts)


class PrefetchService:
    def __init__(self, nursery: trio.Nursery, fs: Filesystem, config: ClientConfig) -> None:
        self._nursery = nursery
        self.fs = fs
        self.config = config
        self.started = time.time()
        self.datasets: OrderedDict[str, Dataset] = OrderedDict()
        self.jobs = JobRegistry()
        # Half of the RAM tier for the lookahead window; the rest keeps the resident set.
        self.scheduler = Scheduler(nursery, fs, window_bytes=max(1, config.mem_cache_size // 2))
        self.warmups: OrderedDict[int, Warmup] = OrderedDict()
        self._next_warmup = 1

    # -- AccessObserver ----------------------------------------------------------------

    def opened(self, pid: int, path: str) -> object:
        key = self.jobs.resolve(pid)
        if key is not None:
            self.scheduler.observe_open(key, path)
        return key

    def released(self, f: OpenFile) -> None:
        key = f.owner if isinstance(f.owner, tuple) else None
        self.jobs.record(key, f.waited, f.stall)
        if key is not None:
            self.fs.unplan_file(f.path, f.version)  # consumed: evict it before anything planned

    def job_samples(self) -> tuple[JobSample, ...]:
        plans = {(p["job"], p["rank"]): p for p in self.scheduler.summaries()}
        return tuple(JobSample(j.name, j.rank, j.counters.requests, j.counters.hits, j.counters.misses,
                               j.counters.stall_seconds, plans.get((j.name, j.rank)))
                     for j in self.jobs.jobs.values())

    # -- routes ------------------------------------------------------------------------

    def install(self, server: ControlServer) -> None:
        server.route("GET", "/v1/status", self.status)
        server.route("POST", "/v1/datasets", self.register_dataset, max_body=MAX_DATASET_BODY)
        server.route("POST", "/v1/jobs", self.register_job)
        server.route("POST", "/v1/plans", self.submit_plan, max_body=MAX_PLAN_BODY)
        server.route("GET", "/v1/stats", self.stats)
        server.route("POST", "/v1/warmup", self.start_warmup)
        server.route("GET", "/v1/warmup", self.warmup_progress)
        server.route("POST", "/v1/cache/drop", self.drop_cache)

    async def status(self, request: Request) -> Response:
        cache = self.fs.cache.statistics()
        tiers = {"ram": {"used_bytes": cache.ram.used_bytes, "limit_bytes": cache.ram.limit_bytes,
                         "blocks": cache.ram.blocks}}
        if cache.disk is not None:
            tiers["disk"] = {"used_bytes": cache.disk.used_bytes, "limit_bytes": cache.disk.effective_limit_bytes,
                             "blocks": cache.disk.blocks}
        return Response.json({
            "version": __version__, "protocol_version": PROTOCOL_VERSION, "pid": os.getpid(),
            "volume": self.config.vol_name, "mount_point": self.config.mount_point, "source": self.config.source,
            "uptime": time.time() - self.started, "cache": tiers,
            "hits": self.jobs.total.as_dict(), "datasets": len(self.datasets),
            "jobs": [{"job": j.name, "rank": j.rank, "pid": j.pid, **j.counters.as_dict()}
                     for j in self.jobs.jobs.values()],
            "plans": self.scheduler.summaries(),
            "counters": self._counters(),
        })

    def _counters(self) -> dict[str, Any]:
        """Monotonic counters for rate views (``cubefs-fuse stats``)."""
        fs, cache, backend = self.fs.statistics(), self.fs.cache.statistics(), self.fs.backend.statistics()
        return {
            "opens": fs.opens, "reads": fs.reads, "read_bytes": fs.read_bytes,
            "bytes_by_source": fs.bytes_by_source, "file_requests": fs.file_requests,
            "file_misses": fs.file_misses, "stall_seconds": fs.stall_seconds,
            "block_hits_ram": cache.hits_ram, "block_hits_disk": cache.hits_disk, "block_misses": cache.misses,
            "backend_operations": sum(backend.operations.values()), "backend_bytes": backend.bytes_read,
            "backend_errors": sum(backend.errors.values()),
            "prefetch_issued": cache.prefetch_issued, "prefetch_used": cache.prefetch_used,
            "prefetch_wasted": cache.prefetch_wasted,
        }

    async def register_dataset(self, request: Request) -> Response:
        columns = _int(request.query.get("columns", "1"), "columns", 1, 16)
        known_id = await trio.to_thread.run_sync(dataset_id, request.body, columns)
        if known_id in self.datasets:  # re-registration is free: no parse, no second copy
            self.datasets.move_to_end(known_id)
            known_dataset = self.datasets[known_id]
            return Response.json({"dataset": known_id, "files": known_dataset.files,
                                  "samples": known_dataset.samples, "columns": columns, "known": True})
        try:
            dataset = await trio.to_thread.run_sync(parse_dataset, request.body, columns)
        except DatasetError as exc:
            raise ApiError(400, str(exc)) from None
        known = dataset.id in self.datasets
        if not known:
            self._make_room(dataset.nbytes)
        self.datasets[dataset.id] = self.datasets.pop(dataset.id, dataset)
        return Response.json({"dataset": dataset.id, "files": dataset.files, "samples": dataset.samples,
                              "columns": columns, "known": known})

    def _make_room(self, nbytes: int) -> None:
        if nbytes > MAX_DATASET_BYTES:
            raise ApiError(413, f"the file list needs {nbytes} bytes, over the limit of {MAX_DATASET_BYTES}")
        in_use = {plan.dataset.id for plan in self.scheduler.plans.values()}
        total = sum(d.nbytes for d in self.datasets.values())
        for old_id in list(self.datasets):
            if total + nbytes <= MAX_DATASET_BYTES:
                break
            if old_id not in in_use:
                total -= self.datasets.pop(old_id).nbytes
        if total + nbytes > MAX_DATASET_BYTES:
            raise ApiError(507, "registered file lists in use by plans fill the dataset memory budget")

    async def register_job(self, request: Request) -> Response:
        body = request.json()
        job = body.get("job")
        if not isinstance(job, str) or not _NAME.fullmatch(job):
            raise ApiError(400, f"'job' must be 1-{MAX_NAME} of [A-Za-z0-9_.:@-]")
        rank = _int(body.get("rank", 0), "rank", 0, 1 << 20)
        if "pid" not in body and request.peer.transport == "unix" and request.peer.pid == 0:
            # The caller lives in another pid namespace (a container without hostPID): its
            # FUSE requests reach us with pid 0 too, so the job is attributed by that.
            self.jobs.register(job, rank, 0)
            return Response.json({"job": job, "rank": rank, "pid": 0, "attribution": "pid-namespace"})
        pid = _int(body.get("pid", request.peer.pid), "pid", 1, 1 << 22)
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            raise ApiError(400, f"no process {pid}") from None
        if request.peer.transport == "unix" and request.peer.uid not in (0, owner):
            raise ApiError(403, f"process {pid} belongs to uid {owner}, not to you")
        self.jobs.register(job, rank, pid)
        return Response.json({"job": job, "rank": rank, "pid": pid})

    async def submit_plan(self, request: Request) -> Response:
        q = request.query
        job = _name(q, "job")
        rank = _int(q.get("rank", "0"), "rank", 0, 1 << 20)
        epoch = _int(q.get("epoch", "0"), "epoch", 0, 1 << 40)
        dtype = q.get("dtype", "<i8")
        if dtype not in PLAN_DTYPES:
            raise ApiError(400, f"dtype must be one of {', '.join(PLAN_DTYPES)}")
        dataset = self.datasets.get(q.get("dataset", ""))
        if dataset is None:
            raise ApiError(404, "unknown dataset id: register the file list first (POST /v1/datasets)")
        body = request.body
        if not body or len(body) % PLAN_DTYPES[dtype]:
            raise ApiError(400, f"the order must be a non-empty array of {dtype} ({len(body)} bytes given)")

        def validate() -> np.ndarray:
            order = np.frombuffer(body, dtype=dtype)
            low, high = int(order.min()), int(order.max())
            if low < 0 or high >= dataset.samples:
                raise ApiError(400, f"sample indices must be in [0, {dataset.samples}), got [{low}, {high}]")
            return order.astype(np.int64)

        count = len(body) // PLAN_DTYPES[dtype]
        order = await trio.to_thread.run_sync(validate) if count > _BIG_ARRAY else validate()
        self.datasets.move_to_end(dataset.id)
        key: JobKey = (job, rank)
        self.scheduler.submit(key, epoch, dataset, order)
        return Response.json({"job": job, "rank": rank, "epoch": epoch, "samples": count})

    async def stats(self, request: Request) -> Response:
        job = request.query.get("job")
        report = self.jobs.report(job)
        plans = {(p["job"], p["rank"]): p for p in self.scheduler.summaries()}
        for entry in report["jobs"]:
            entry["plan"] = plans.get((entry["job"], entry["rank"]))
        cache = self.fs.cache.statistics()
        report["prefetch"] = {"issued": cache.prefetch_issued, "completed": cache.prefetch_completed,
                              "failed": cache.prefetch_failed, "used": cache.prefetch_used,
                              "wasted": cache.prefetch_wasted}
        return Response.json(report)

    async def drop_cache(self, request: Request) -> Response:
        before = self.fs.cache.statistics()
        await self.fs.cache.clear()
        self.fs.meta.clear()
        freed = before.ram.used_bytes + (before.disk.used_bytes if before.disk else 0)
        return Response.json({"dropped_bytes": freed})

    # -- warmup ------------------------------------------------------------------------

    async def start_warmup(self, request: Request) -> Response:
        body = request.json()
        paths = body.get("paths")
        if not isinstance(paths, list) or not paths or len(paths) > MAX_WARMUP_PATHS:
            raise ApiError(400, f"'paths' must be a list of 1-{MAX_WARMUP_PATHS} relative paths")
        clean = [_relative_path(p) for p in paths]
        warmup = Warmup(self._next_warmup, clean, bool(body.get("check", False)))
        self._next_warmup += 1
        self.warmups[warmup.id] = warmup
        while len(self.warmups) > MAX_WARMUPS:
            self.warmups.popitem(last=False)
        self._nursery.start_soon(self._run_warmup, warmup)
        return Response.json(warmup.summary(), 202)

    async def warmup_progress(self, request: Request) -> Response:
        warmup_id = _int(request.query.get("id", ""), "id", 1, 1 << 62)
        warmup = self.warmups.get(warmup_id)
        if warmup is None:
            raise ApiError(404, f"no warmup {warmup_id}")
        return Response.json(warmup.summary())

    async def _run_warmup(self, warmup: Warmup) -> None:
        try:
            files: list[tuple[str, Attr]] = []
            for path in warmup.paths:
                await self._collect(path, files, warmup)
            warmup.files_total = len(files)
            warmup.bytes_total = sum(attr.size for _, attr in files)
            slots = trio.Semaphore(WARMUP_CONCURRENCY)
            async with trio.open_nursery() as nursery:
                for path, attr in files:
                    await slots.acquire()
                    nursery.start_soon(self._warm_one, path, attr, warmup, slots)
        except Exception:
            log.exception("warmup %d failed", warmup.id)
            warmup.errors += 1
        finally:
            warmup.done = True
            warmup.finished = time.time()

    async def _warm_one(self, path: str, attr: Attr, warmup: Warmup, slots: trio.Semaphore) -> None:
        try:
            if self.fs.cached_fraction(path, attr) == 1.0:
                warmup.files_cached += 1
                warmup.bytes_cached += attr.size
            elif not warmup.check_only:
                await self.fs.warm_file(path)
                warmup.files_cached += 1
                warmup.bytes_cached += attr.size
        except (OSError, FsError):
            warmup.errors += 1
        finally:
            warmup.files_done += 1
            warmup.bytes_done += attr.size
            slots.release()

    async def _collect(self, path: str, out: list[tuple[str, Attr]], warmup: Warmup) -> None:
        try:
            attr = await self.fs.meta.stat(path)
        except (OSError, FsError):
            warmup.errors += 1
            return
        if attr.is_file:
            out.append((path, attr))
        elif attr.is_dir:
            try:
                entries = await self.fs.meta.listdir(path)
            except (OSError, FsError):
                warmup.errors += 1
                return
            for name, child in sorted(entries):
                child_path = f"{path}/{name}" if path else name
                if child.is_dir:
                    await self._collect(child_path, out, warmup)
                elif child.is_file:
                    out.append((child_path, child))
