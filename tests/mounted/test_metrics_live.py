"""A live daemon's /metrics exposes exactly the metric table (cubefs_fuse/metrics.py), with
values that reflect what was just done; the table's documentation is checked in
tests/unit/test_metrics_docs.py."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import pytest

from cubefs_fuse.metrics import METRICS
from tests.helpers import Mount, write_tree

# The sample names each metric kind shows in the text exposition.
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def sample_names(scrape: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in scrape}


def test_live_daemon_exposes_exactly_the_metric_table(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(blockSize=8192)  # small blocks: the multi-block file exercises readahead
    files = {"a.bin": os.urandom(100), "dir/b.bin": os.urandom(5 * 8192 + 7), "gone.bin": b"x" * 10}
    write_tree(m.source, files)
    (m.source / "link").symlink_to("a.bin")
    m.mount()
    try:
        for rel in ("a.bin", "dir/b.bin"):
            assert m.path(rel).read_bytes() == files[rel]
        assert os.readlink(m.path("link")) == "a.bin"
        assert not m.path("missing").exists()
        assert sorted(os.listdir(m.mount_point)) == ["a.bin", "dir", "gone.bin", "link"]
        os.statvfs(m.mount_point)
        # A backend error: open while the file exists, then remove it at the source.
        fd = os.open(m.path("gone.bin"), os.O_RDONLY)
        try:
            (m.source / "gone.bin").unlink()
            with pytest.raises(OSError) as info:
                os.read(fd, 10)
            assert info.value.errno == errno.ENOENT
        finally:
            os.close(fd)

        scrape = m.scrape()
        exposed = sample_names(scrape)
        # Per-job metrics need "profile": "ai_prefetch" and a registered job (tests/mounted/test_prefetch_mount.py).
        expected = {name + suffix for name, spec in METRICS.items() if not spec.ai_prefetch
                    for suffix in SUFFIXES[spec.kind]}
        assert expected - exposed == set(), "metrics in METRICS missing from /metrics"
        ours = {name for name in exposed if name.startswith("cubefs_fuse_")}
        assert ours - expected == set(), "/metrics exposes cubefs_fuse_* names not in METRICS"

        # The values reflect what was just done.
        assert scrape["cubefs_fuse_lookups_total"] >= 3
        # The kernel may retry a failed page read, so the count can exceed one; the log may not.
        assert scrape['cubefs_fuse_backend_errors_total{errno="ENOENT",op="read"}'] >= 1
        assert m.log().count("backend read of 'gone.bin' failed") == 1
        assert scrape['cubefs_fuse_cache_misses_total'] >= 1
        assert scrape['cubefs_fuse_backend_read_bytes_total'] >= sum(len(files[r]) for r in ("a.bin", "dir/b.bin"))
        assert scrape['cubefs_fuse_backend_latency_seconds_count{op="read"}'] == sum(
            v for k, v in scrape.items() if k.startswith('cubefs_fuse_backend_operations_total{op="read"}'))
        assert scrape['cubefs_fuse_cache_used_bytes{tier="ram"}'] <= scrape['cubefs_fuse_cache_limit_bytes{tier="ram"}']
        for tier in ("ram", "disk"):
            assert f'cubefs_fuse_cache_hits_total{{tier="{tier}"}}' in scrape
    finally:
        m.umount()


def test_every_family_is_declared_from_the_start_with_process_and_info_metrics(
        make_mount: Callable[..., Mount]) -> None:
    """A fresh daemon declares families that have no sample yet (errors, per-job ones with
    ai_prefetch), exports the process_* metrics, and says what it is and what it serves."""
    import urllib.request

    from cubefs_fuse import __version__

    m = make_mount(profile="ai_prefetch")
    m.mount()
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read().decode()
        declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        for name, spec in METRICS.items():
            assert name in declared, name  # per-job families too: this mount has ai_prefetch
        assert not any(line.startswith("cubefs_fuse_backend_errors_total{") for line in text.splitlines())
        assert not any(line.startswith("cubefs_fuse_job_requests_total{") for line in text.splitlines())
        scrape = m.scrape()
        for name in ("process_resident_memory_bytes", "process_open_fds", "process_max_fds",
                     "process_start_time_seconds", "process_cpu_seconds_total"):
            assert scrape[name] > 0, name
        [build] = [k for k in scrape if k.startswith("cubefs_fuse_build_info{")]
        assert f'version="{__version__}"' in build and scrape[build] == 1
        [info] = [k for k in scrape if k.startswith("cubefs_fuse_mount_info{")]
        assert f'mount_point="{m.mount_point}"' in info and 'profile="ai_prefetch"' in info
        assert f'source="{m.source}"' in info and scrape[info] == 1
    finally:
        m.umount()


def test_without_ai_prefetch_the_per_job_families_are_not_declared(make_mount: Callable[..., Mount]) -> None:
    import urllib.request

    m = make_mount()
    m.mount()
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read().decode()
        declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        assert {name for name, spec in METRICS.items() if not spec.ai_prefetch} <= declared
        assert not {name for name, spec in METRICS.items() if spec.ai_prefetch} & declared
        assert 'profile="none"' in next(line for line in text.splitlines()
                                        if line.startswith("cubefs_fuse_mount_info{"))
    finally:
        m.umount()
