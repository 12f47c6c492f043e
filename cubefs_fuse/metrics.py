"""Prometheus metrics: every name in one table (``METRICS``, which docs/metrics.md documents
and a test keeps in step), values pulled from ``statistics()``. Components count with plain
integers on the trio thread; at scrape time the exporter thread asks the trio thread
(``trio.from_thread.run``) for one consistent snapshot, taken once every read served so far
is counted, and turns it into metric families, so the FUSE hot path never takes a lock or calls into prometheus_client."""

from __future__ import annotations

import errno
import logging
import os
import platform
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from cubefs_fuse import __version__
from cubefs_fuse.backends.base import BackendStatistics
from cubefs_fuse.cache.blockcache import BlockCacheStatistics
from cubefs_fuse.fs.filesystem import FilesystemStatistics
from cubefs_fuse.errors import ConfigError
from cubefs_fuse.fs.metadata import MetadataStatistics
from cubefs_fuse.prefetch.batches import BatchStatistics
from cubefs_fuse.prefetch.jobs import JobSample
from cubefs_fuse.samples.store import SampleStoreStatistics
from cubefs_fuse.stats import app_reads

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()
    ai_prefetch: bool = False  # exposed only with "profile": "ai_prefetch" (per job: once a job registered)


METRICS: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        MetricSpec("cubefs_fuse_build_info", "gauge", "Always 1: the daemon's version and Python.", ("version", "python")),
        MetricSpec("cubefs_fuse_mount_info", "gauge", "Always 1: what this daemon serves (join on it for per-volume views).",
                   ("volume", "mount_point", "source", "profile")),
        # What applications read, whichever path served it (stats.app_reads; docs/metrics.md,
        # "What a job reads"): the count every operator view shows.
        MetricSpec("cubefs_fuse_app_requests_total", "counter",
                   "What applications read: one request per file opened through the mount or handed to a worker by the "
                   "fast path, and per sample the sample cache served instead of its files; by path and result "
                   "(hit: nothing waited on the remote).", ("path", "result")),
        MetricSpec("cubefs_fuse_app_bytes_total", "counter",
                   "Bytes applications got from the daemon, by path (mount: READs that reached it; fastpath: files "
                   "in the rings, per open; sample_cache: entries served).", ("path",)),
        MetricSpec("cubefs_fuse_reads_total", "counter", "Read requests through the mount that reached the daemon (FUSE READs)."),
        MetricSpec("cubefs_fuse_read_bytes_total", "counter", "Bytes returned to applications through the mount (FUSE READs)."),
        MetricSpec("cubefs_fuse_native_reads_total", "counter",
                   "Read requests the C FUSE session served from blocks lent to it (RAM, or NVMe for one-block files), without Python (part of reads_total)."),
        MetricSpec("cubefs_fuse_lookups_total", "counter",
                   "Name lookups through the mount that reached the daemon (the kernel opens a name it looked up "
                   "without asking again while the entry's timeout runs: see app_requests_total for files read)."),
        MetricSpec("cubefs_fuse_native_lookups_total", "counter",
                   "Lookups the C FUSE session answered from entries Python published, without Python (part of lookups_total)."),
        MetricSpec("cubefs_fuse_cache_hits_total", "counter", "Block reads served by a cache tier.", ("tier",)),
        MetricSpec("cubefs_fuse_cache_misses_total", "counter", "Block reads that waited on the backend."),
        MetricSpec("cubefs_fuse_served_bytes_total", "counter", "Bytes returned to applications through the mount, by the tier that held them (ram, disk, backend).",
                   ("source",)),
        MetricSpec("cubefs_fuse_cache_used_bytes", "gauge", "Bytes held by a cache tier (disk: allocated bytes).", ("tier",)),
        MetricSpec("cubefs_fuse_cache_limit_bytes", "gauge", "Configured byte limit of a cache tier (disk: after the free-space floor).", ("tier",)),
        MetricSpec("cubefs_fuse_cache_blocks", "gauge", "Blocks held by a cache tier.", ("tier",)),
        MetricSpec("cubefs_fuse_cache_evictions_total", "counter", "Blocks evicted from a cache tier to make room.", ("tier",)),
        MetricSpec("cubefs_fuse_checksum_failures_total", "counter", "Disk blocks whose checksum did not match (discarded and refetched)."),
        MetricSpec("cubefs_fuse_disk_write_errors_total", "counter", "Disk tier block writes that failed."),
        MetricSpec("cubefs_fuse_disk_writes_skipped_total", "counter", "Blocks not written to disk because too many writes were pending."),
        MetricSpec("cubefs_fuse_disk_pending_write_bytes", "gauge",
                   "Bytes fetched and waiting to be written to the disk tier (lost if the daemon dies now)."),
        MetricSpec("cubefs_fuse_disk_startup_seconds", "gauge", "Seconds the disk tier took to load its block list at start-up."),
        MetricSpec("cubefs_fuse_disk_startup_discarded_files", "gauge",
                   "Files the disk tier deleted at start-up (partial writes, junk, blocks shorter than a header)."),
        MetricSpec("cubefs_fuse_stale_reads_total", "counter", "Reads refused (ESTALE) because the file changed at the source while open."),
        MetricSpec("cubefs_fuse_prefetch_issued_total", "counter", "Blocks the daemon started fetching ahead of readers."),
        MetricSpec("cubefs_fuse_prefetch_completed_total", "counter", "Prefetched blocks that arrived."),
        MetricSpec("cubefs_fuse_prefetch_failed_total", "counter", "Prefetches that failed."),
        MetricSpec("cubefs_fuse_fetch_slots_busy", "gauge", "Backend fetch slots in use.", ("priority",)),
        MetricSpec("cubefs_fuse_fetch_slots_waiting", "gauge", "Fetches waiting for a backend slot.", ("priority",)),
        MetricSpec("cubefs_fuse_backend_operations_total", "counter", "Operations sent to the backend (the remote volume).", ("op",)),
        MetricSpec("cubefs_fuse_backend_errors_total", "counter", "Backend operations that failed, by errno name.", ("op", "errno")),
        MetricSpec("cubefs_fuse_backend_read_bytes_total", "counter", "Bytes read from the backend."),
        MetricSpec("cubefs_fuse_backend_latency_seconds", "histogram", "Backend operation latency.", ("op",)),
        MetricSpec("cubefs_fuse_backend_timeouts_total", "counter", "Backend operations that got no answer within backendTimeout (the caller got EIO).", ("op",)),
        MetricSpec("cubefs_fuse_backend_failed_fast_total", "counter", "Backend operations refused at once with EIO because the backend was down.", ("op",)),
        MetricSpec("cubefs_fuse_backend_up", "gauge", "1 while the backend answers, 0 while it is down (after a timeout, until a probe answers)."),
        MetricSpec("cubefs_fuse_backend_reconnects_total", "counter", "Times the source root was reopened (the remote came back at the same path)."),
        MetricSpec("cubefs_fuse_backend_threads_abandoned", "gauge", "Worker threads still inside a backend operation whose caller timed out."),
        MetricSpec("cubefs_fuse_metadata_cache_hits_total", "counter", "Metadata answered from the daemon's cache.", ("kind",)),
        MetricSpec("cubefs_fuse_metadata_cache_misses_total", "counter", "Metadata fetched from the backend.", ("kind",)),
        MetricSpec("cubefs_fuse_inodes", "gauge", "Inodes the daemon holds: the kernel's, and those a published entry may hand it again."),
        MetricSpec("cubefs_fuse_retired_inodes", "gauge", "Inodes of old file versions (changed at the source) the kernel still holds."),
        MetricSpec("cubefs_fuse_file_version_changes_total", "counter", "Files found changed at the source while the kernel held the old version's inode; each version got its own inode."),
        MetricSpec("cubefs_fuse_stale_if_error_total", "counter",
                   "Requests answered from the last validated metadata while the backend was down, for files the cache "
                   "holds whole and their directories (staleIfError), by FUSE operation.", ("op",)),
        MetricSpec("cubefs_fuse_file_requests_total", "counter",
                   "Files applications read: reads from a file's start that reached the daemon through the mount "
                   "(a file the kernel's page cache serves whole is not seen) and files the fast path served, "
                   "one request each (app_requests_total adds the sample cache)."),
        MetricSpec("cubefs_fuse_file_hits_total", "counter", "File requests whose first read did not wait on the backend."),
        MetricSpec("cubefs_fuse_file_misses_total", "counter", "File requests whose first read waited on the backend."),
        MetricSpec("cubefs_fuse_stall_seconds_total", "counter", "Seconds application reads waited on the backend."),
        MetricSpec("cubefs_fuse_prefetch_used_total", "counter", "Prefetched blocks that an application read."),
        MetricSpec("cubefs_fuse_prefetch_wasted_total", "counter", "Prefetched blocks evicted or refused before any read."),
        MetricSpec("cubefs_fuse_job_requests_total", "counter", "File requests of a registered job's processes.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_hits_total", "counter", "File requests of a job served without waiting on the backend.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_misses_total", "counter", "File requests of a job that waited on the backend.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_stall_seconds_total", "counter", "Seconds a job's reads waited on the backend.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_steps_total", "counter",
                   "Training steps of a job fed by cube_torch's DevicePrefetcher (as its cube_torch reported them).",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_data_wait_seconds_total", "counter",
                   "Seconds those steps waited for their batch.", ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_step_seconds_total", "counter",
                   "Seconds those steps lasted in all (the waits' share of step time is the ratio of the two rates).",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_data_wait_p50_seconds", "gauge",
                   "Median wait of a step for its batch, over the job's steps so far.", ("training_job", "rank"),
                   ai_prefetch=True),
        MetricSpec("cubefs_fuse_job_data_wait_p99_seconds", "gauge",
                   "99th percentile of a step's wait for its batch, over the job's steps so far.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_fastpath_batches_total", "counter", "Batches cube_torch's workers resolved over the data socket (the fast path).",
                   ai_prefetch=True),
        MetricSpec("cubefs_fuse_fastpath_files_total", "counter",
                   "Files of fast-path batches: served from the cache (hit), served after waiting on the backend (miss), or sent back to read through the mount (mount).",
                   ("result",), ai_prefetch=True),
        MetricSpec("cubefs_fuse_fastpath_bytes_total", "counter", "Bytes served through the fast path's shared-memory rings.",
                   ai_prefetch=True),
        MetricSpec("cubefs_fuse_fastpath_connections", "gauge", "Open data-socket connections (one per DataLoader worker using the fast path).",
                   ai_prefetch=True),
        MetricSpec("cubefs_fuse_plan_samples", "gauge", "Samples in the current epoch plans of the job's loaders.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_plan_position", "gauge", "The plans' read cursors, summed over the job's loaders.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_plan_epoch", "gauge", "The newest epoch of the job's plans.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_plan_lookahead_files", "gauge", "Samples issued for prefetch ahead of the cursors.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_plan_lookahead_bytes", "gauge", "Bytes issued for prefetch ahead of the cursors.",
                   ("training_job", "rank"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_plan_loaders", "gauge", "DataLoaders of the job with a plan of their own.",
                   ("training_job", "rank"), ai_prefetch=True),
        # The processed-sample cache's daemon store: one label set per cache (at most
        # MAX_SAMPLE_CACHES, 256), its name and its owner's uid.
        MetricSpec("cubefs_fuse_sample_cache_entries", "gauge", "Entries a sample cache holds (in RAM, on NVMe or both).",
                   ("sample_cache", "owner"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_cache_bytes", "gauge", "Bytes of a sample cache's entries, per tier (disk: allocated bytes).",
                   ("sample_cache", "owner", "tier"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_cache_hits_total", "counter", "Sample gets answered with an entry.",
                   ("sample_cache", "owner"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_cache_misses_total", "counter", "Sample gets answered without an entry.",
                   ("sample_cache", "owner"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_cache_puts_total", "counter", "Entries put into a sample cache.",
                   ("sample_cache", "owner"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_cache_evictions_total", "counter", "Entries of a sample cache evicted to make room.",
                   ("sample_cache", "owner"), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_store_used_bytes", "gauge", "Bytes the sample store holds, per tier (disk: allocated bytes).",
                   ("tier",), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_store_limit_bytes", "gauge", "The sample store's budget per tier (sampleCacheMemSize, sampleCacheDiskSize).",
                   ("tier",), ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_store_corrupt_total", "counter", "Sample entry files found damaged on a read (deleted, answered as misses).",
                   ai_prefetch=True),
        MetricSpec("cubefs_fuse_sample_store_dropped_total", "counter",
                   "Entries a put could not keep (no room in either tier, NVMe index still loading, free-space floor).",
                   ai_prefetch=True),
    )
}


@dataclass(frozen=True, slots=True)
class MountInfo:
    """What a daemon serves: the labels of ``cubefs_fuse_mount_info``."""

    volume: str
    mount_point: str
    source: str
    profile: str  # "" or "ai_prefetch"


@dataclass(frozen=True, slots=True)
class Snapshot:
    fs: FilesystemStatistics
    cache: BlockCacheStatistics
    backend: BackendStatistics
    meta: MetadataStatistics
    jobs: tuple[JobSample, ...] = ()
    mount: MountInfo | None = None
    fastpath: BatchStatistics | None = None  # ai_prefetch only
    fastpath_connections: int = 0
    samples: SampleStoreStatistics | None = None  # the processed-sample cache's store (ai_prefetch)


class _Families:
    """Builds a family per spec on first use, so every emitted name is in METRICS."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}

    def add(self, name: str, value: float, *labels: str) -> None:
        self.declare(name).add_metric(list(labels), value)  # type: ignore[attr-defined]

    def declare(self, name: str) -> Metric:
        """The family of ``name`` (created without samples if new)."""
        family = self.families.get(name)
        if family is None:
            spec = METRICS[name]
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = self.families[name] = cls(name, spec.help, labels=list(spec.labels))
        return family


def families(s: Snapshot) -> Iterator[Metric]:
    """Every family of :data:`METRICS`, also those without a sample yet (an alert on a
    counter that is still zero must see the family, not its absence); the per-job ones
    only with the ai_prefetch profile."""
    f = _Families()
    f.add("cubefs_fuse_build_info", 1, __version__, platform.python_version())
    if s.mount is not None:
        where = s.mount
        f.add("cubefs_fuse_mount_info", 1, where.volume, where.mount_point, where.source, where.profile or "none")
    # Every path's series from the start (0 where this daemon does not serve it), so a sum
    # over paths or a per-path panel never changes shape when training starts.
    reads = app_reads(s.fs, s.fastpath, s.samples)
    for path, counts in reads.by_path().items():
        f.add("cubefs_fuse_app_requests_total", counts.hits, path, "hit")
        if path != "sample_cache":  # a sample the cache lacks is read from its files: no request of its own
            f.add("cubefs_fuse_app_requests_total", counts.misses, path, "miss")
        f.add("cubefs_fuse_app_bytes_total", counts.bytes, path)
    f.add("cubefs_fuse_reads_total", s.fs.reads)
    f.add("cubefs_fuse_read_bytes_total", s.fs.read_bytes)
    f.add("cubefs_fuse_native_reads_total", s.fs.native_reads)
    f.add("cubefs_fuse_lookups_total", s.fs.lookups)
    f.add("cubefs_fuse_native_lookups_total", s.fs.native_lookups)
    f.add("cubefs_fuse_inodes", s.fs.inodes)
    f.add("cubefs_fuse_retired_inodes", s.fs.retired_inodes)
    f.add("cubefs_fuse_file_version_changes_total", s.fs.version_changes)
    for op, n in s.fs.stale_if_error.items():
        f.add("cubefs_fuse_stale_if_error_total", n, op)
    c = s.cache
    f.add("cubefs_fuse_cache_hits_total", c.hits_ram, "ram")
    f.add("cubefs_fuse_cache_hits_total", c.hits_disk, "disk")
    f.add("cubefs_fuse_cache_misses_total", c.misses)
    for source, value in s.fs.bytes_by_source.items():
        f.add("cubefs_fuse_served_bytes_total", value, source)
    tiers: list[tuple[str, Any]] = [("ram", c.ram)] + ([("disk", c.disk)] if c.disk is not None else [])
    for tier, t in tiers:
        f.add("cubefs_fuse_cache_used_bytes", t.used_bytes, tier)
        f.add("cubefs_fuse_cache_limit_bytes", getattr(t, "effective_limit_bytes", t.limit_bytes), tier)
        f.add("cubefs_fuse_cache_blocks", t.blocks, tier)
        f.add("cubefs_fuse_cache_evictions_total", t.evictions, tier)
    d = c.disk
    f.add("cubefs_fuse_checksum_failures_total", d.checksum_failures if d else 0)
    f.add("cubefs_fuse_disk_write_errors_total", d.write_errors if d else 0)
    f.add("cubefs_fuse_disk_startup_seconds", d.startup_seconds if d else 0.0)
    f.add("cubefs_fuse_disk_startup_discarded_files", d.startup_discarded if d else 0)
    f.add("cubefs_fuse_disk_writes_skipped_total", c.disk_writes_skipped)
    f.add("cubefs_fuse_disk_pending_write_bytes", c.pending_disk_bytes)
    f.add("cubefs_fuse_stale_reads_total", s.fs.stale_reads)
    f.add("cubefs_fuse_prefetch_issued_total", c.prefetch_issued)
    f.add("cubefs_fuse_prefetch_completed_total", c.prefetch_completed)
    f.add("cubefs_fuse_prefetch_failed_total", c.prefetch_failed)
    f.add("cubefs_fuse_fetch_slots_busy", c.slots.busy_foreground, "foreground")
    f.add("cubefs_fuse_fetch_slots_busy", c.slots.busy_background, "prefetch")
    f.add("cubefs_fuse_fetch_slots_waiting", c.slots.waiting_foreground, "foreground")
    f.add("cubefs_fuse_fetch_slots_waiting", c.slots.waiting_background, "prefetch")
    b = s.backend
    for op, n in sorted(b.operations.items()):
        f.add("cubefs_fuse_backend_operations_total", n, op)
    for (op, code), n in sorted(b.errors.items()):
        f.add("cubefs_fuse_backend_errors_total", n, op, _errno_name(code))
    f.add("cubefs_fuse_backend_read_bytes_total", b.bytes_read)
    for op, n in sorted(b.timeouts.items()):
        f.add("cubefs_fuse_backend_timeouts_total", n, op)
    for op, n in sorted(b.failed_fast.items()):
        f.add("cubefs_fuse_backend_failed_fast_total", n, op)
    f.add("cubefs_fuse_backend_up", 1 if b.up else 0)
    f.add("cubefs_fuse_backend_reconnects_total", b.reconnects)
    f.add("cubefs_fuse_backend_threads_abandoned", b.threads_abandoned)
    m = s.meta
    f.add("cubefs_fuse_metadata_cache_hits_total", m.attr_hits, "attr")
    f.add("cubefs_fuse_metadata_cache_hits_total", m.negative_hits, "negative")
    f.add("cubefs_fuse_metadata_cache_hits_total", m.listing_hits, "listing")
    f.add("cubefs_fuse_metadata_cache_misses_total", m.attr_misses, "attr")
    f.add("cubefs_fuse_metadata_cache_misses_total", m.listing_misses, "listing")
    # File requests: the files of app_requests_total (reads through the mount and files
    # cube_torch's workers opened from the fast path's rings), without the sample cache.
    files = reads.files
    f.add("cubefs_fuse_file_requests_total", files.requests)
    f.add("cubefs_fuse_file_hits_total", files.hits)
    f.add("cubefs_fuse_file_misses_total", files.misses)
    f.add("cubefs_fuse_stall_seconds_total", files.stall_seconds)
    f.add("cubefs_fuse_prefetch_used_total", c.prefetch_used)
    f.add("cubefs_fuse_prefetch_wasted_total", c.prefetch_wasted)
    if s.fastpath is not None:
        f.add("cubefs_fuse_fastpath_batches_total", s.fastpath.batches)
        f.add("cubefs_fuse_fastpath_files_total", s.fastpath.served_hits, "hit")
        f.add("cubefs_fuse_fastpath_files_total", s.fastpath.served_misses, "miss")
        f.add("cubefs_fuse_fastpath_files_total", s.fastpath.to_mount, "mount")
        f.add("cubefs_fuse_fastpath_bytes_total", s.fastpath.served_bytes)
        f.add("cubefs_fuse_fastpath_connections", s.fastpath_connections)
    for j in s.jobs:
        labels = (j.job, str(j.rank))
        f.add("cubefs_fuse_job_requests_total", j.requests, *labels)
        f.add("cubefs_fuse_job_hits_total", j.hits, *labels)
        f.add("cubefs_fuse_job_misses_total", j.misses, *labels)
        f.add("cubefs_fuse_job_stall_seconds_total", j.stall_seconds, *labels)
        if j.data_wait is not None:
            f.add("cubefs_fuse_job_steps_total", j.data_wait.steps, *labels)
            f.add("cubefs_fuse_job_data_wait_seconds_total", j.data_wait.wait_seconds, *labels)
            f.add("cubefs_fuse_job_step_seconds_total", j.data_wait.step_seconds, *labels)
            f.add("cubefs_fuse_job_data_wait_p50_seconds", j.data_wait.p50_seconds, *labels)
            f.add("cubefs_fuse_job_data_wait_p99_seconds", j.data_wait.p99_seconds, *labels)
        if j.plan is not None:
            f.add("cubefs_fuse_plan_samples", j.plan["samples"], *labels)
            f.add("cubefs_fuse_plan_position", j.plan["cursor"], *labels)
            f.add("cubefs_fuse_plan_epoch", j.plan["epoch"], *labels)
            f.add("cubefs_fuse_plan_lookahead_files", j.plan["lookahead_files"], *labels)
            f.add("cubefs_fuse_plan_lookahead_bytes", j.plan["lookahead_bytes"], *labels)
            f.add("cubefs_fuse_plan_loaders", j.loaders, *labels)
    if s.samples is not None:
        _sample_families(f, s.samples)
    ai_prefetch = s.mount is not None and s.mount.profile == "ai_prefetch"
    for spec in METRICS.values():
        if spec.kind != "histogram" and spec.name not in f.families and (ai_prefetch or not spec.ai_prefetch):
            f.declare(spec.name)
    yield from f.families.values()
    spec = METRICS["cubefs_fuse_backend_latency_seconds"]
    histogram = HistogramMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    for op, snap in sorted(b.latency.items()):
        buckets = [(repr(bound), count) for bound, count in zip(snap.bounds, snap.cumulative_counts)]
        buckets.append(("+Inf", snap.count))
        histogram.add_metric([op], buckets, snap.total)
    yield histogram


def _sample_families(f: _Families, s: SampleStoreStatistics) -> None:
    for tier, used, limit in (("ram", s.ram_used_bytes, s.ram_limit_bytes), ("disk", s.disk_used_bytes, s.disk_limit_bytes)):
        f.add("cubefs_fuse_sample_store_used_bytes", used, tier)
        f.add("cubefs_fuse_sample_store_limit_bytes", limit, tier)
    f.add("cubefs_fuse_sample_store_corrupt_total", s.corrupt)
    f.add("cubefs_fuse_sample_store_dropped_total", s.dropped)
    for c in s.caches:
        labels = (c.name, str(c.owner))
        f.add("cubefs_fuse_sample_cache_entries", c.entries, *labels)
        f.add("cubefs_fuse_sample_cache_bytes", c.ram_bytes, *labels, "ram")
        f.add("cubefs_fuse_sample_cache_bytes", c.disk_bytes, *labels, "disk")
        f.add("cubefs_fuse_sample_cache_hits_total", c.hits, *labels)
        f.add("cubefs_fuse_sample_cache_misses_total", c.misses, *labels)
        f.add("cubefs_fuse_sample_cache_puts_total", c.stored, *labels)
        f.add("cubefs_fuse_sample_cache_evictions_total", c.evictions, *labels)


def _errno_name(code: int) -> str:
    return errno.errorcode.get(code, str(code))


class DaemonCollector(Collector):
    """Collects from the daemon's components by running ``snapshot`` on the trio thread."""

    def __init__(self, snapshot: Callable[[], Awaitable[Snapshot]], trio_token: trio.lowlevel.TrioToken) -> None:
        self._snapshot = snapshot
        self._token = trio_token

    def collect(self) -> Iterator[Metric]:
        try:
            snap = trio.from_thread.run(self._snapshot, trio_token=self._token)
        except trio.RunFinishedError:
            return
        yield from families(snap)


def start_exporter(addr: str, port: int, collector: Collector) -> Callable[[], None]:
    """Serve ``/metrics`` on ``addr:port`` in a thread; returns the function that stops it."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    # process_* (CPU, resident memory, open and maximum descriptors, start time): memory
    # against its limit, descriptors against LimitNOFILE, and restarts become visible.
    ProcessCollector(registry=registry)
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:  # port in use, address not local: the user's config to fix
        raise ConfigError(f"key 'exporterPort': cannot listen on {addr}:{port}: {exc.strerror or exc}") from None
    log.info("Prometheus metrics on http://%s:%d/metrics (pid %d)", addr, port, os.getpid())

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
