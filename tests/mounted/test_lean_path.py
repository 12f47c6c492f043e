"""Mounted: the lean path (docs/contracts.md, "The lean path") through a real daemon.

A cold small file is one backend call (its lookup's stat_read) and still counts as a
miss; after a restart its lookup finds it on NVMe in the same call (an NVMe hit, the
source not read); the connection's readahead survives the kernel's INIT answer, so a
file of up to 1 MiB is one FUSE read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tests.helpers import Mount, metric

FILES = 40
SIZE = 110_000  # the ImageNet-like size, one block


def _fill(m: Mount) -> dict[str, bytes]:
    files = {}
    for i in range(FILES):
        name = f"d{i % 4}/img_{i:03d}.jpg"
        files[name] = os.urandom(SIZE)
        (m.source / name).parent.mkdir(exist_ok=True)
        (m.source / name).write_bytes(files[name])
    return files


def _read_all(m: Mount, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert m.path(name).read_bytes() == data


def _settled_scrape(m: Mount) -> dict[str, float]:
    return m.scrape()


def _drop_pages(m: Mount, files: dict[str, bytes]) -> None:
    """Out of the kernel's page cache, so that the next read reaches the daemon (a file the
    page cache serves whole is no request the daemon sees)."""
    for name in files:
        with open(m.path(name), "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_a_cold_small_file_is_one_backend_call_and_a_miss_then_an_nvme_hit_after_restart(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    files = _fill(m)
    m.mount()
    try:
        _read_all(m, files)
        s = _settled_scrape(m)
        # Every file: one stat (its lookup, which read it whole: that read is counted and
        # timed as a read of its own) and no other read; the 4 directories and the root (the
        # kernel's getattr at mount): at most one stat each.
        # (That the stat and the read are one worker call: tests/component/test_lean_path.py.)
        assert FILES + 4 <= metric(s, "cubefs_fuse_backend_operations_total", op="stat") <= FILES + 5
        assert metric(s, "cubefs_fuse_backend_operations_total", op="read") == FILES
        assert metric(s, "cubefs_fuse_backend_latency_seconds_count", op="read") == FILES
        assert metric(s, "cubefs_fuse_reads_total") == FILES  # one FUSE read per 110 KB file
        assert metric(s, "cubefs_fuse_file_requests_total") == FILES
        assert metric(s, "cubefs_fuse_file_misses_total") == FILES  # every one waited on the remote
        assert metric(s, "cubefs_fuse_file_hits_total") == 0
        _drop_pages(m, files)
        _read_all(m, files)  # RAM: hits, no backend call
        s2 = _settled_scrape(m)
        assert metric(s2, "cubefs_fuse_file_hits_total") == FILES
        assert metric(s2, "cubefs_fuse_backend_operations_total", op="read") == FILES
        m.umount()
        m.mount()  # RAM tier and metadata empty, NVMe kept
        _read_all(m, files)
        s3 = _settled_scrape(m)
        assert metric(s3, "cubefs_fuse_backend_operations_total", op="read") == 0  # the source is not read
        assert metric(s3, "cubefs_fuse_cache_hits_total", tier="disk") == FILES
        assert metric(s3, "cubefs_fuse_file_hits_total") == FILES
        assert metric(s3, "cubefs_fuse_cache_misses_total") == 0
    finally:
        m.umount()


def test_readahead_is_tuned_after_init_a_one_mib_file_is_one_fuse_read(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(blockSize="1MiB")
    data = os.urandom(1 << 20)
    (m.source / "big.bin").write_bytes(data)
    m.mount()
    try:
        minor = os.minor(os.stat(m.mount_point).st_dev)
        with open(f"/sys/class/bdi/0:{minor}/read_ahead_kb") as f:
            assert int(f.read()) == 1024
        assert m.path("big.bin").read_bytes() == data
        assert metric(m.scrape(), "cubefs_fuse_reads_total") == 1  # 128 KiB readahead: 8 reads
    finally:
        m.umount()
