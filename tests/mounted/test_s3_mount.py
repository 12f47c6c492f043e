"""Mounted: an S3 bucket prefix (SeaweedFS, tests/s3_servers.py) through a real daemon and
FUSE mount: the tree and every byte, a read-only mount, an overwritten object seen new
after attrValid while a handle opened before reads its own version or ESTALE, never a
mix; the NVMe cache's index across a restart, with no read after it; a cold small
object's lookup and read in one request; warmup and status;
an ai_prefetch plan prefetching the objects before they are read; a bucket that throttles
(503 SlowDown through tools/s3_proxy.py) or goes away and comes back, with nothing but
reads ever reaching it, and the backend's metrics per operation kind."""

from __future__ import annotations

import errno
import json
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from cubefs_fuse.backends.s3 import INITIAL_BACKOFF
from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import Mount, cli, metric, wait_until
from tests.s3_servers import SeaweedS3, s3_env, s3_server  # noqa: F401 -- the fixtures
from tools.s3_proxy import S3Proxy

BS = 64 * 1024  # the mount's blockSize: small, so that multi-block objects stay cheap
TTL = 1.0  # attrValid and lookupValid: how long a changed object may still look unchanged

# key under the mounted prefix -> size: a block boundary, multi-block, one byte, empty.
OBJECTS = {
    "image 110k.jpg": 110_000,
    "cls1/multi.bin": 3 * BS + 7,
    "cls1/one": 1,
    "cls2/deep/block.bin": BS,
    "empty": 0,
}
# Overwritten while a handle is open on it, and never read before: eight blocks, so that
# most of them are still at the source when it changes (readahead takes two).
CHANGING = "cls1/changing.bin"


def read_all(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb", buffering=0) as f:
        chunks = []
        while chunk := f.read(BS // 2 + 1):  # reads straddle block boundaries
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_bucket_prefix_is_served_and_an_overwrite_seen_after_the_ttl(
        make_mount: Callable[..., Mount], s3_env: SeaweedS3) -> None:  # noqa: F811
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    rng = random.Random(31)
    contents = {key: rng.randbytes(size) for key, size in OBJECTS.items()}
    for key, data in contents.items():
        client.put_object(Bucket=bucket, Key=f"ds/{key}", Body=data)
    old = rng.randbytes(8 * BS + 5)
    client.put_object(Bucket=bucket, Key=f"ds/{CHANGING}", Body=old)
    client.put_object(Bucket=bucket, Key="elsewhere/x", Body=b"not under the prefix")
    m = make_mount(source=f"s3://{bucket}/ds", s3Endpoint=s3_env.endpoint, blockSize="64KiB",
                   memCacheSize="4MiB", diskCacheSize="16MiB", attrValid=TTL, lookupValid=TTL)
    m.mount()
    root = str(m.mount_point)

    # The tree: prefixes are directories, keys files, nothing from outside the prefix.
    seen = {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}
    assert seen == set(OBJECTS) | {CHANGING}
    assert sorted(os.listdir(root)) == ["cls1", "cls2", "empty", "image 110k.jpg"]
    for key, data in contents.items():
        assert read_all(os.path.join(root, key)) == data, key
        assert os.stat(os.path.join(root, key)).st_size == len(data)
    with open(m.path("cls1/multi.bin"), "rb") as f:
        for offset in (BS - 3, 2 * BS, 5, 3 * BS):
            f.seek(offset)
            assert f.read(100) == contents["cls1/multi.bin"][offset:offset + 100]
    with pytest.raises(OSError) as info:
        os.readlink(m.path("cls1/one"))
    assert info.value.errno == errno.EINVAL
    with pytest.raises(OSError) as info:
        open(m.path("cls1/one"), "wb")
    assert info.value.errno == errno.EROFS

    # An overwrite (same size: only the ETag tells) while a handle of the old version is open.
    new = bytes(b ^ 0xFF for b in old)
    handle = os.open(m.path(CHANGING), os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(handle, 4096, 0) == old[:4096]
        client.put_object(Bucket=bucket, Key=f"ds/{CHANGING}", Body=new)
        client.put_object(Bucket=bucket, Key="ds/cls2/added.txt", Body=b"added")
        time.sleep(TTL * 1.5)
        assert read_all(m.path(CHANGING)) == new  # a new open: the new version, whole
        assert sorted(os.listdir(m.path("cls2"))) == ["added.txt", "deep"]
        assert read_all(m.path("cls2/added.txt")) == b"added"
        stale = 0
        for offset in range(0, len(old), 4096):  # the old handle: its own bytes, or ESTALE
            try:
                chunk = os.pread(handle, 4096, offset)
            except OSError as exc:
                assert exc.errno == errno.ESTALE
                stale += 1
                continue
            assert chunk == old[offset:offset + 4096], offset
        assert stale > 0  # blocks still at the source were refused, not read from the new version
    finally:
        os.close(handle)
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_operations_total", op="read") > 0,
               what="the backend's reads counted")
    m.umount()


def test_after_a_restart_the_bucket_is_served_from_nvme_without_a_get(
        make_mount: Callable[..., Mount], s3_env: SeaweedS3) -> None:  # noqa: F811
    """The NVMe index across restarts over S3: a key's version (ETag hash, size, second)
    is the same to the next daemon, so every block is found on NVMe and none is read from
    the bucket (a cold lookup is still one ranged GET, whose bytes are dropped when the
    block is on NVMe: no read counted, nothing served from the backend)."""
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    rng = random.Random(5)
    contents = {f"c{i % 3}/img{i:03d}.jpg": rng.randbytes(rng.randrange(1, 3 * BS)) for i in range(30)}
    for key, data in contents.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    m = make_mount(source=f"s3://{bucket}", s3Endpoint=s3_env.endpoint, blockSize="64KiB",
                   memCacheSize="8MiB", diskCacheSize="8MiB")
    m.mount()
    for key, data in contents.items():
        assert read_all(m.path(key)) == data
    assert metric(m.scrape(), "cubefs_fuse_backend_operations_total", op="read") > 0
    m.umount()  # drains the NVMe writes and saves the index
    m.mount()
    for key, data in contents.items():
        assert read_all(m.path(key)) == data
    second = m.scrape()
    assert metric(second, "cubefs_fuse_backend_operations_total", op="read") == 0
    assert metric(second, "cubefs_fuse_cache_hits_total", tier="disk") > 0
    assert metric(second, "cubefs_fuse_served_bytes_total", source="backend") == 0
    m.umount()


def test_warmup_and_status_over_a_bucket(make_mount: Callable[..., Mount], s3_env: SeaweedS3) -> None:  # noqa: F811
    """The operator commands over an s3:// source: warmup brings a subtree in, each object
    fetched once, and reads are then served without a request; status names the source."""
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    rng = random.Random(9)
    contents = {f"{d}/f{i}": rng.randbytes(rng.randrange(1, 2 * BS)) for d in ("a", "b") for i in range(5)}
    for key, data in contents.items():
        client.put_object(Bucket=bucket, Key=f"p/{key}", Body=data)
    m = make_mount(source=f"s3://{bucket}/p", s3Endpoint=s3_env.endpoint, blockSize="64KiB",
                   memCacheSize="8MiB", diskCacheSize="8MiB")
    m.mount()
    warm = cli("warmup", str(m.mount_point), "a", "--json")
    assert warm.returncode == 0, warm.stderr
    report = json.loads(warm.stdout)
    sub = {k: v for k, v in contents.items() if k.startswith("a/")}
    assert (report["files_total"], report["errors"], report["bytes_total"]) == (5, 0, sum(map(len, sub.values())))
    fetched = metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total")
    assert fetched == sum(map(len, sub.values()))  # each object once
    for key, data in sub.items():
        assert read_all(m.path(key)) == data
    assert metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total") == fetched  # served from the cache
    status = cli("status", str(m.mount_point))
    assert status.returncode == 0 and f"s3://{bucket}/p" in status.stdout, status.stdout + status.stderr
    m.umount()


def test_an_ai_prefetch_plan_brings_a_bucket_in_before_it_is_read(
        make_mount: Callable[..., Mount], s3_env: SeaweedS3, tmp_path: Path) -> None:  # noqa: F811
    """ai_prefetch over an s3:// source: a job's plan (the file order cube_torch submits)
    prefetches the planned objects, and the reads that follow make no request."""
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    rng = random.Random(11)
    paths = [f"train/c{i % 4}/img{i:03d}.jpg" for i in range(24)]
    contents = {p: rng.randbytes(rng.randrange(1, 2 * BS)) for p in paths}
    for key, data in contents.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    m = make_mount(source=f"s3://{bucket}", s3Endpoint=s3_env.endpoint, blockSize="64KiB", memCacheSize="16MiB",
                   diskCacheSize="16MiB", profile="ai_prefetch", configDir=str(config_dir))
    m.mount()
    control = ControlClient(read_volume_config(m.config()["volName"], str(config_dir)).control_socket)
    dataset = control.register_dataset(paths)
    control.register_job("s3job", 0, os.getpid())
    order = list(range(len(paths)))
    rng.shuffle(order)
    control.submit_plan("s3job", 0, 1, dataset, b"".join(i.to_bytes(4, "little") for i in order), "<u4")
    total = sum(map(len, contents.values()))
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total") >= total, timeout=30,
               what="the plan's objects to be prefetched")
    for i in order:
        assert read_all(m.path(paths[i])) == contents[paths[i]]
    assert metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total") == total  # each object once, before its read
    m.umount()


# backendTimeout of the throttling test: short, so that the retries of a bucket that keeps
# throttling (up to 10 per request, waits from 50 ms up to 2 s) are cut by it and the
# reader's EIO comes within it.
THROTTLED_TIMEOUT = 2.0
# What a loaded 2-core machine may add to that deadline (a FUSE round trip, thread start).
SLACK = 2.0


def read_errno(path: Path) -> int:
    """The errno of reading ``path`` whole (0: it read)."""
    try:
        read_all(path)
    except OSError as exc:
        return exc.errno or -1
    return 0


def test_a_cold_small_object_is_one_request(make_mount: Callable[..., Mount], s3_env: SeaweedS3) -> None:  # noqa: F811
    """Through the recording proxy: a cold small object's lookup, open and read are one
    request (a GET of its first block, whose answer is also its attributes); a larger
    object's lookup is one GET whose answer carried no more than a block, then one GET per
    block it is read in."""
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    rng = random.Random(23)
    small, large = rng.randbytes(BS // 2), rng.randbytes(3 * BS + 1)
    client.put_object(Bucket=bucket, Key="d/small", Body=small)
    client.put_object(Bucket=bucket, Key="d/large", Body=large)
    with S3Proxy(s3_env.s3_port) as proxy:
        m = make_mount(source=f"s3://{bucket}", s3Endpoint=proxy.endpoint, blockSize="64KiB", memCacheSize="4MiB",
                       diskCacheSize="8MiB")
        m.mount()
        for _ in range(2):  # the second time from the cache: no request
            assert read_all(m.path("d/small")) == small  # never listed: the kernel looks it up
            assert read_all(m.path("d/large")) == large
        with proxy.lock:
            sent = [r for r in proxy.requests if r.path.split("?")[0].endswith(("/d/small", "/d/large"))]
        m.umount()
    assert [(r.method, r.path.rpartition("/")[2]) for r in sent if r.path.endswith("small")] == [("GET", "small")]
    on_large = [r for r in sent if r.path.endswith("large")]
    assert [r.method for r in on_large] == ["GET"] * (1 + 4), on_large  # the lookup, then 4 blocks
    assert on_large[0].range == f"bytes=0-{BS - 1}" and on_large[0].sent <= BS, on_large[0]


@pytest.mark.expected_daemon_errors(r"backend down: ")
def test_a_throttled_then_vanished_bucket_recovers_without_a_restart(
        make_mount: Callable[..., Mount], s3_env: SeaweedS3) -> None:  # noqa: F811
    """Through the faulting proxy, one daemon for the whole test: a few 503s are retried
    unseen; a bucket that keeps throttling costs the reader EIO within backendTimeout, with
    retries backing off meanwhile, while cached objects are still served; the daemon is up
    again once the bucket answers.  Then the bucket is deleted (reads fail) and created
    again with its objects: served again, by the same daemon.  Only GET and HEAD requests
    ever reached the bucket, and the backend's metrics count each operation kind."""
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    rng = random.Random(17)
    contents = {f"d/f{i}": rng.randbytes(2 * BS + 1 if i == 0 else 1000 + i) for i in range(6)}
    for key, data in contents.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    with S3Proxy(s3_env.s3_port) as proxy:
        m = make_mount(source=f"s3://{bucket}", s3Endpoint=proxy.endpoint, blockSize="64KiB", memCacheSize="4MiB",
                       diskCacheSize="8MiB", attrValid=TTL, lookupValid=TTL, backendTimeout=THROTTLED_TIMEOUT)
        m.mount()
        pid = m.pid()
        assert sorted(os.listdir(m.path("d"))) == sorted(os.path.basename(k) for k in contents)
        assert read_all(m.path("d/f0")) == contents["d/f0"]  # multi-block: ranged GETs ("read")

        proxy.fail_next(3)  # a short throttle: retried, the reader never knows
        assert read_all(m.path("d/f1")) == contents["d/f1"] and proxy.failed == 3

        proxy.fail_next(1_000_000)  # throttled for good
        failed_before, started = proxy.failed, time.monotonic()
        assert read_errno(m.path("d/f2")) == errno.EIO
        assert time.monotonic() - started < THROTTLED_TIMEOUT + SLACK
        with proxy.lock:
            tries = [r.at for r in proxy.requests[-(proxy.failed - failed_before):] if "f2" in r.path]
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        # Retried, never in a tight loop: each retry waits at least INITIAL_BACKOFF (then a
        # random time up to twice the previous wait); the first try of a second operation
        # (the kernel's own retry of the lookup) may follow a failure at once.
        assert len(tries) >= 3 and statistics.median(gaps) >= INITIAL_BACKOFF.total_seconds(), gaps
        wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_up") == 0, what="the backend to be down")
        proxy.fail_next(0)
        wait_until(lambda: metric(m.scrape(), "cubefs_fuse_backend_up") == 1, timeout=15,
                   what="a probe to find the bucket answering again")
        assert read_all(m.path("d/f2")) == contents["d/f2"]

        # The bucket goes away (deleted), then comes back with its objects (new versions).
        for key in contents:
            client.delete_object(Bucket=bucket, Key=key)
        client.delete_bucket(Bucket=bucket)
        # Once the cached attributes expire (TTL), the file is gone or unreadable.
        wait_until(lambda: read_errno(m.path("d/f3")) in (errno.ENOENT, errno.EIO), timeout=10,
                   what="the deleted bucket's file to fail")
        client.create_bucket(Bucket=bucket)
        for key, data in contents.items():
            client.put_object(Bucket=bucket, Key=key, Body=data[::-1])
        wait_until(lambda: read_errno(m.path("d/f3")) == 0, timeout=20, what="the bucket served again")
        for key, data in contents.items():
            assert read_all(m.path(key)) == data[::-1], key
        assert m.pid() == pid  # no restart

        samples = m.scrape()
        for op in ("stat", "listdir", "read"):
            assert metric(samples, "cubefs_fuse_backend_operations_total", op=op) > 0, op
            assert metric(samples, "cubefs_fuse_backend_latency_seconds_count", op=op) > 0, op
        assert sum(metric(samples, "cubefs_fuse_backend_errors_total", op=op, errno="EIO")
                   + metric(samples, "cubefs_fuse_backend_timeouts_total", op=op)
                   for op in ("stat", "read")) >= 1
        # Each version fetched once: f0-f2 before the bucket went away, every object after.
        first = sum(len(contents[f"d/f{i}"]) for i in range(3))
        assert metric(samples, "cubefs_fuse_backend_read_bytes_total") == first + sum(map(len, contents.values()))
        with pytest.raises(OSError) as info:
            open(m.path("d/new"), "wb")
        assert info.value.errno == errno.EROFS
        m.umount()
    assert {r.method for r in proxy.requests} <= {"GET", "HEAD"}, Counter(r.method for r in proxy.requests)
