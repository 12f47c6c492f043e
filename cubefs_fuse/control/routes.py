"""The control API's routes: HTTP requests in, :class:`PrefetchService` calls, JSON out.
Everything a client sends is checked here (names, integers, paths, body sizes) before the
service sees it; the service's :class:`~cubefs_fuse.errors.RequestError` kinds become
statuses in ``server.py``, and routes and bodies are documented in docs/ai_prefetch.md."""

from __future__ import annotations

import re
from typing import Any

from cubefs_fuse import __version__
from cubefs_fuse.control.protocol import PROTOCOL_VERSION
from cubefs_fuse.control.server import ControlServer, Request, Response
from cubefs_fuse.errors import BadRequest, Forbidden, NotFound
from cubefs_fuse.limits import (DIGITS, MAX_DATASET_BODY, MAX_DATASET_FILES, MAX_NAME, MAX_PATH_BYTES,
                                MAX_PLAN_BODY, MAX_WARMUP_PATHS)
from cubefs_fuse.prefetch.jobs import DataWait
from cubefs_fuse.prefetch.scheduler import DEFAULT_LOADER
from cubefs_fuse.prefetch.service import PrefetchService
from cubefs_fuse.samples.store import SampleStore

_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,%d}" % MAX_NAME)
_MAX_RANK = 1 << 20
_MAX_PID = 1 << 22  # PID_MAX_LIMIT on 64-bit Linux
_MAX_EPOCH = 1 << 40
_MAX_SECONDS = 1e12  # a cumulative count of seconds: ~30,000 years, and NaN or infinity fail the check
_MAX_FILES_READ = 1 << 53  # a cumulative count of files: any real job's fits, and a JSON parser that reads numbers as doubles keeps it exact


def _name(query: dict[str, str], key: str) -> str:
    value = query.get(key)
    if value is None or not _NAME.fullmatch(value):
        raise BadRequest(f"query parameter {key!r} must be 1-{MAX_NAME} of [A-Za-z0-9_.:@-]")
    return value




def _data_wait(value: Any) -> DataWait | None:
    """``data_wait`` of a read report: the job's steps and their waits, cumulative; absent
    or null: none."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("'data_wait' must be an object of steps and seconds")
    seconds = []
    for key in ("wait_seconds", "step_seconds", "p50_seconds", "p99_seconds"):
        number = value.get(key)
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < _MAX_SECONDS:
            raise BadRequest(f"'data_wait.{key}' must be a number of seconds, 0 or more")
        seconds.append(float(number))
    return DataWait(_int(value.get("steps"), "data_wait.steps", 0, _MAX_FILES_READ), *seconds)


def _int(value: Any, key: str, low: int, high: int) -> int:
    # A decimal integer as a query string or JSON string carries it (every bound here is below 10^19).
    if isinstance(value, str) and DIGITS.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{key!r} must be an integer in [{low}, {high}]")
    return value


def _relative_path(value: Any) -> str:
    """A path inside the volume: relative, normalised, no NUL, no trailing '/'; '' for the root."""
    if not isinstance(value, str) or "\0" in value or len(value.encode()) > MAX_PATH_BYTES:
        raise BadRequest(f"paths must be strings without NUL bytes, at most {MAX_PATH_BYTES} bytes")
    if value.startswith("/"):
        raise BadRequest(f"path {value!r} is absolute: give it relative to the volume root")
    parts = value.split("/") if value else []
    if any(p in ("", ".", "..") for p in parts):
        raise BadRequest(f"path {value!r} is not normalised ('.', '..', '//' and a trailing '/' are refused)")
    return value


relative_path = _relative_path  # the data socket (control/dataplane.py) checks its paths the same way


class Routes:
    """The ``/v1`` routes of one daemon, over its prefetch service."""

    def __init__(self, service: PrefetchService, *, ai_prefetch: bool = True,
                 samples: SampleStore | None = None) -> None:
        self.service = service
        self.ai_prefetch = ai_prefetch
        self.samples = samples  # the processed-sample cache's store (None: off)

    def install(self, server: ControlServer) -> None:
        server.route("GET", "/v1/status", self.status)
        if self.ai_prefetch:
            server.route("POST", "/v1/datasets", self.register_dataset, max_body=MAX_DATASET_BODY)
            server.route("POST", "/v1/jobs", self.register_job)
            server.route("POST", "/v1/jobs/reads", self.report_reads)
            server.route("POST", "/v1/plans", self.submit_plan, max_body=MAX_PLAN_BODY)
        else:  # known routes with a reason, not a bare 404
            for path in ("/v1/datasets", "/v1/jobs", "/v1/jobs/reads", "/v1/plans"):
                server.route("POST", path, self.needs_ai_prefetch)
        server.route("GET", "/v1/stats", self.stats)
        server.route("POST", "/v1/warmup", self.start_warmup)
        server.route("GET", "/v1/warmup", self.warmup_progress)
        server.route("POST", "/v1/cache/drop", self.drop_cache)
        server.route("POST", "/v1/samples/drop", self.drop_samples)

    async def status(self, request: Request) -> Response:
        return Response.json({"version": __version__, "protocol_version": PROTOCOL_VERSION,
                              "profile": "ai_prefetch" if self.ai_prefetch else "", **await self.service.status(),
                              "samples": self._sample_status(request)})

    def _sample_status(self, request: Request) -> dict[str, Any] | None:
        """The sample store's status as this caller may see it.  A cache's name can say what
        a user trains on, so a caller sees the rows of the caches it could read: its own and
        those shared with it (``sampleCacheShared``); an administrator (root, the daemon's
        uid) sees every row.  A TCP caller has no uid: shared caches only.  The store's
        totals are the node's and stay visible to all; ``hidden`` counts the rows left out."""
        if self.samples is None:
            return None
        status = self.samples.status()
        peer = request.peer
        if peer.transport == "unix" and peer.uid in self.samples.admins:
            status["hidden"] = 0
            return status
        uid = peer.uid if peer.transport == "unix" else None
        caches = status["caches"]
        status["caches"] = [c for c in caches if c["owner"] == uid or c["shared"]]
        status["hidden"] = len(caches) - len(status["caches"])
        return status

    async def needs_ai_prefetch(self, request: Request) -> Response:
        raise NotFound('this mount runs without "profile": "ai_prefetch": it keeps no datasets, jobs or plans')

    async def register_dataset(self, request: Request) -> Response:
        columns = _int(request.query.get("columns", "1"), "columns", 1, 16)
        dataset, known = await self.service.register_dataset(request.body, columns)
        return Response.json({"dataset": dataset.id, "files": dataset.files, "samples": dataset.samples,
                              "columns": columns, "known": known})

    async def register_job(self, request: Request) -> Response:
        body = request.json()
        job = body.get("job")
        if not isinstance(job, str) or not _NAME.fullmatch(job):
            raise BadRequest(f"'job' must be 1-{MAX_NAME} of [A-Za-z0-9_.:@-]")
        rank = _int(body.get("rank", 0), "rank", 0, _MAX_RANK)
        unix = request.peer.transport == "unix"
        if "pid" not in body and unix and request.peer.pid == 0:
            # The caller lives in another pid namespace (a container without hostPID).
            await self.service.register_job(job, rank, 0, caller_uid=request.peer.uid)
            return Response.json({"job": job, "rank": rank, "pid": 0, "attribution": "pid-namespace"})
        pid = _int(body.get("pid", request.peer.pid), "pid", 1, _MAX_PID)
        await self.service.register_job(job, rank, pid, caller_uid=request.peer.uid if unix else None)
        return Response.json({"job": job, "rank": rank, "pid": pid})

    async def report_reads(self, request: Request) -> Response:
        """``{"job", "rank", "files"}``: the files the job's loaders have read so far, from
        one of the job's own processes (the Unix socket's peer credentials say which)."""
        body = request.json()
        job = body.get("job")
        if not isinstance(job, str) or not _NAME.fullmatch(job):
            raise BadRequest(f"'job' must be 1-{MAX_NAME} of [A-Za-z0-9_.:@-]")
        rank = _int(body.get("rank", 0), "rank", 0, _MAX_RANK)
        files = _int(body.get("files"), "files", 0, _MAX_FILES_READ)
        wait = _data_wait(body.get("data_wait"))
        if request.peer.transport != "unix":
            raise Forbidden("a job reports its reads over the Unix socket (peer credentials say whose they are)")
        counters = await self.service.report_reads((job, rank), files, caller_pid=request.peer.pid, data_wait=wait)
        return Response.json({"job": job, "rank": rank, **counters.as_dict()})

    async def submit_plan(self, request: Request) -> Response:
        q = request.query
        job = _name(q, "job")
        rank = _int(q.get("rank", "0"), "rank", 0, _MAX_RANK)
        epoch = _int(q.get("epoch", "0"), "epoch", 0, _MAX_EPOCH)
        # Which DataLoader of the rank the plan is for (each keeps its own); clients that
        # name none are loader "0".
        loader = _name(q, "loader") if "loader" in q else DEFAULT_LOADER
        first = _int(q.get("first", "0"), "first", 0, MAX_DATASET_FILES)
        count = await self.service.submit_plan((job, rank), epoch, q.get("dataset", ""), request.body,
                                               q.get("dtype", "<i8"), loader, first)
        return Response.json({"job": job, "rank": rank, "loader": loader, "epoch": epoch, "samples": count})

    async def stats(self, request: Request) -> Response:
        return Response.json(await self.service.stats(request.query.get("job")))

    async def drop_cache(self, request: Request) -> Response:
        return Response.json({"dropped_bytes": await self.service.drop_cache()})

    async def drop_samples(self, request: Request) -> Response:
        """Destroy one sample cache: ``?name=NAME`` (the caller's) or ``?name=~UID/NAME``."""
        if self.samples is None:
            raise NotFound("this daemon keeps no sample cache (sampleCacheMemSize and sampleCacheDiskSize are 0, "
                           'or no "profile": "ai_prefetch")')
        if request.peer.transport != "unix":
            raise Forbidden("sample caches belong to uids: drop them over the Unix socket (peer credentials)")
        entries, size = await self.samples.drop(request.peer.uid, request.query.get("name", ""))
        return Response.json({"dropped_entries": entries, "dropped_bytes": size})

    async def start_warmup(self, request: Request) -> Response:
        body = request.json()
        paths = body.get("paths")
        if not isinstance(paths, list) or not paths or len(paths) > MAX_WARMUP_PATHS:
            raise BadRequest(f"'paths' must be a list of 1-{MAX_WARMUP_PATHS} relative paths")
        clean = [_relative_path(p) for p in paths]
        warmup = self.service.warmups.start(clean, bool(body.get("check", False)))
        return Response.json(warmup.summary(), 202)

    async def warmup_progress(self, request: Request) -> Response:
        warmup_id = _int(request.query.get("id", ""), "id", 1, 1 << 62)
        warmup = self.service.warmups.get(warmup_id)
        if warmup is None:
            raise NotFound(f"no warmup {warmup_id}")
        return Response.json(warmup.summary())
