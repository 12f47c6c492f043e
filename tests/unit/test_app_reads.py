"""The one count of what applications read (stats.app_reads) and the ``stats`` line built on
it (docs/metrics.md, "What a job reads"); the live views' agreement during a cube_torch run
is tests/torch/test_views_agree.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cubefs_fuse.opscli import _STATS_HEADER, _reads, _stats_row
from cubefs_fuse.stats import app_reads


@dataclass(frozen=True)
class Mount:
    file_requests: int
    file_misses: int
    read_bytes: int
    stall_seconds: float


@dataclass(frozen=True)
class Fast:
    served_hits: int
    served_misses: int
    served_bytes: int
    served_stall: float


@dataclass(frozen=True)
class Samples:
    hits: int
    hit_bytes: int


def test_every_path_is_counted_and_the_sample_cache_never_misses() -> None:
    reads = app_reads(Mount(10, 3, 5000, 0.5), Fast(100, 2, 80_000, 0.25), Samples(900, 700_000))
    assert (reads.mount.requests, reads.mount.hits, reads.mount.misses) == (10, 7, 3)
    assert (reads.fastpath.requests, reads.fastpath.bytes) == (102, 80_000)
    assert (reads.sample_cache.requests, reads.sample_cache.misses) == (900, 0)
    total = reads.total
    assert (total.requests, total.hits, total.misses, total.bytes) == (1012, 1007, 5, 785_000)
    assert total.stall_seconds == 0.75
    # The file requests (file_* metrics, status's hits): mount and fast path only.
    assert (reads.files.requests, reads.files.misses) == (112, 5)
    report = reads.as_dict()
    assert report["requests"] == 1012 and report["hit_rate"] == 1007 / 1012
    assert set(report["by_path"]) == {"mount", "fastpath", "sample_cache"}


def test_a_daemon_without_fast_path_or_sample_store_counts_the_mount_alone() -> None:
    reads = app_reads(Mount(4, 1, 100, 0.0), None, None)
    assert reads.total == reads.mount == reads.files
    assert reads.fastpath.requests == reads.sample_cache.requests == 0


def _status(mount: int, fast: int, cached: int, misses: int, nbytes: int) -> dict[str, Any]:
    reads = app_reads(Mount(mount, misses, nbytes, 0.0), Fast(fast, 0, 0, 0.0), Samples(cached, 0))
    return {"reads": reads.as_dict(), "counters": {
        "lookups": mount, "reads": 2 * mount, "read_bytes": nbytes, "bytes_by_source": {"ram": nbytes, "disk": 0,
                                                                                         "backend": 0},
        "backend_operations": 0, "prefetch_issued": 0},
        "cache": {"ram": {"used_bytes": 2**30}, "disk": {"used_bytes": 0}}}


def test_the_stats_line_shows_every_path() -> None:
    """The fast path and the sample cache, which open nothing through the mount, still make
    requests, a hit rate and MiB/s (it showed 0 opens/s at the mount and no hit rate during training)."""
    before, after = _status(0, 0, 0, 0, 0), _status(0, 600, 400, 0, 0)
    fields = _stats_row(before, after, 2.0)
    header = _STATS_HEADER.replace("|", " ").split()
    row = dict(zip(header, fields))
    assert (row["req/s"], row["hit%"], row["mount"], row["fast"], row["sample"]) == ("500", "100.0", "0", "300", "200")
    assert row["look/s"] == "0"  # the mount saw nothing: said as it is


def test_an_older_daemon_without_reads_is_shown_as_the_mount() -> None:
    status = {"hits": {"requests": 8, "hits": 6, "misses": 2, "hit_rate": 0.75, "stall_seconds": 0.1},
              "counters": {"read_bytes": 4096}}
    reads = _reads(status)
    assert (reads["requests"], reads["hits"], reads["bytes"], reads["hit_rate"]) == (8, 6, 4096, 0.75)
    assert reads["by_path"]["mount"]["requests"] == 8 and reads["by_path"]["fastpath"]["requests"] == 0
