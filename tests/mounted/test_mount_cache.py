"""Mounted: cache limits under pressure, restart with a warm NVMe tier, changed source files."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import Mount, allocated_on_disk, metric, wait_until

KiB, MiB = 1024, 1024 * 1024
BS = 64 * KiB  # blockSize: small, so a few MiB hold ~100 blocks
RAM_LIMIT = 2 * MiB
DISK_LIMIT = 4 * MiB
READERS = 4
CHUNK = 32 * KiB  # read size: half a block, so every block is asked for twice per pass
TTL = 0.5  # attrValid/lookupValid of the changed-file tests, seconds


def write_dataset(root: Path, total: int, seed: int) -> dict[str, bytes]:
    """Files of ImageNet-like and multi-block sizes in class folders, ``total`` bytes or a bit more."""
    rng = random.Random(seed)
    sizes = [110_000, BS, 3 * BS + 17, 5_000, 200_000, BS - 1]
    contents: dict[str, bytes] = {}
    written = 0
    while written < total:
        rel = f"class{len(contents) % 5}/img{len(contents):04d}.bin"
        data = rng.randbytes(sizes[len(contents) % len(sizes)])
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        contents[rel] = data
        written += len(data)
    return contents


def _read_all(job: tuple[str, dict[str, bytes], int, int]) -> list[str]:
    """Read every file ``passes`` times in a shuffled order with O_DIRECT; the wrong ones."""
    mount, contents, seed, passes = job
    rng = random.Random(seed)
    wrong = []
    for _ in range(passes):
        names = sorted(contents)
        rng.shuffle(names)
        for rel in names:
            # O_DIRECT: every read reaches the daemon instead of the kernel page cache,
            # so the tiers see the full request stream and must evict under it.
            fd = os.open(os.path.join(mount, rel), os.O_RDONLY | os.O_DIRECT)
            try:
                data = b"".join(iter(lambda: os.read(fd, CHUNK), b""))
            finally:
                os.close(fd)
            if data != contents[rel]:
                wrong.append(rel)
    return wrong


def _read_in_processes(m: Mount, contents: dict[str, bytes], passes: int) -> None:
    jobs = [(str(m.mount_point), contents, seed, passes) for seed in range(READERS)]
    with multiprocessing.get_context("fork").Pool(READERS) as pool:
        wrong = [rel for result in pool.map(_read_all, jobs) for rel in result]
    assert not wrong, f"wrong content: {wrong[:10]}"


@contextlib.contextmanager
def tmpfs(path: Path) -> Iterator[Callable[[], int]]:
    """A private tmpfs on ``path``; yields a function giving its used bytes, read atomically
    (statvfs), which is the exact on-disk footprint of the cache at one instant."""
    path.mkdir(parents=True, exist_ok=True)
    # 64 MiB: far above the 4 MiB limit, so the free-space floor never interferes.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(path)], check=True)

    def used() -> int:
        st = os.statvfs(path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    try:
        yield used
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_limits_hold_while_several_processes_read(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(blockSize="64KiB", memCacheSize=RAM_LIMIT, diskCacheSize=DISK_LIMIT, diskFreeRatio=0)
    contents = write_dataset(m.source, 6 * MiB, seed=1)  # 3x the RAM limit, 1.5x the disk limit
    with tmpfs(m.cache_dir) as tmpfs_used:
        m.mount()
        try:
            # Files beside blocks/ and tmp/ (the lock, a format marker) are not cache content.
            other = sum(p.stat().st_blocks * 512 for p in m.cache_dir.iterdir() if p.is_file())
            samples = _read_and_sample(m, contents, lambda: tmpfs_used() - other)
        finally:
            m.umount()
    ram_max, disk_max, real_max, scan_max = (max(s[i] for s in samples) for i in range(4))
    assert len(samples) >= 10, "too few samples to say anything"
    assert ram_max <= RAM_LIMIT, f"RAM tier reported {ram_max} bytes"
    assert disk_max <= DISK_LIMIT, f"disk tier reported {disk_max} bytes"
    assert real_max <= DISK_LIMIT, f"disk cache files occupied {real_max} bytes"
    # The limits were reached (so they were tested), and eviction did the work.
    assert ram_max > RAM_LIMIT - 2 * BS and real_max > DISK_LIMIT - 2 * (BS + 4 * KiB)
    print(f"\n{len(samples)} samples: RAM max {ram_max / MiB:.3f} MiB, disk max {disk_max / MiB:.3f} MiB, "
          f"on disk max {real_max / MiB:.3f} MiB (file-by-file scans: {scan_max / MiB:.3f} MiB)")


def _read_and_sample(m: Mount, contents: dict[str, bytes], on_disk: Callable[[], int]) -> list[tuple[float, ...]]:
    """Read everything twice from several processes while sampling the tiers' sizes."""
    samples: list[tuple[float, ...]] = []
    stop = threading.Event()

    def sample() -> None:
        scraped = m.scrape()
        samples.append((metric(scraped, "cubefs_fuse_cache_used_bytes", tier="ram"),
                        metric(scraped, "cubefs_fuse_cache_used_bytes", tier="disk"),
                        on_disk(), allocated_on_disk(m.cache_dir)))

    def sample_until_stopped() -> None:
        while not stop.is_set():
            sample()

    sampler = threading.Thread(target=sample_until_stopped)
    sampler.start()
    try:
        _read_in_processes(m, contents, passes=2)
    finally:
        stop.set()
        sampler.join()
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_fetch_slots_busy", priority="prefetch") == 0,
               what="prefetches to settle")
    sample()
    final = m.scrape()
    assert metric(final, "cubefs_fuse_cache_evictions_total", tier="ram") > 0
    assert metric(final, "cubefs_fuse_cache_evictions_total", tier="disk") > 0
    assert metric(final, "cubefs_fuse_cache_hits_total", tier="disk") > 0  # evicted from RAM, found on NVMe
    return samples


def test_restart_serves_from_disk_without_backend_reads(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(blockSize="64KiB", memCacheSize=8 * MiB, diskCacheSize=8 * MiB, diskFreeRatio=0)
    contents = write_dataset(m.source, 2 * MiB, seed=2)  # fits the disk tier whole
    m.mount()
    _read_in_processes(m, contents, passes=1)
    first = m.scrape()
    assert metric(first, "cubefs_fuse_backend_operations_total", op="read") > 0
    m.umount()  # drains the NVMe writes and saves the index
    m.mount()
    _read_in_processes(m, contents, passes=1)
    second = m.scrape()
    assert metric(second, "cubefs_fuse_backend_operations_total", op="read") == 0
    assert metric(second, "cubefs_fuse_cache_misses_total") == 0
    assert metric(second, "cubefs_fuse_cache_hits_total", tier="disk") > 0
    assert metric(second, "cubefs_fuse_served_bytes_total", source="backend") == 0
    m.umount()


def _read(path: Path) -> tuple[bytes, int]:
    """One application read: open, fstat, read to EOF; (content, size the kernel reports)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return f.read(), size


def _version(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


@pytest.mark.parametrize("new_size", ["same", "larger", "smaller"])
def test_changed_file_is_served_new_after_ttl_never_mixed(make_mount: Callable[..., Mount], new_size: str) -> None:
    m = make_mount(blockSize="64KiB", attrValid=TTL, lookupValid=TTL)
    rng = random.Random(new_size)
    old = rng.randbytes(4 * BS + 100)
    new = rng.randbytes({"same": len(old), "larger": 6 * BS + 1, "smaller": 2 * BS + 5}[new_size])
    source = m.source / "data" / "file.bin"
    source.parent.mkdir()
    source.write_bytes(old)
    m.mount()
    mounted = m.path("data/file.bin")
    os.listdir(m.path("data"))  # the daemon caches the listing, the kernel the attributes
    assert _read(mounted) == (old, len(old))
    before = _version(source)
    with open(source, "r+b") as f:  # rewritten in place: same inode, and for "same" the same size
        f.write(new)
        f.truncate(len(new))
    assert _version(source) != before, "precondition: the rewrite must change the file's version"
    # Let the cached listing age, then list again: the daemon answers from its cache, so the
    # kernel gets the old attributes (old size) with a fresh timeout that outlives the
    # daemon's.  The daemon must not let that stale size cut or pad the new content.
    time.sleep(TTL * 0.7)
    hits = metric(m.scrape(), "cubefs_fuse_metadata_cache_hits_total", kind="listing")
    os.listdir(m.path("data"))
    assert metric(m.scrape(), "cubefs_fuse_metadata_cache_hits_total", kind="listing") > hits
    seen: list[str] = []

    def served_new() -> bool:
        data, size = _read(mounted)
        assert data in (old, new), f"mixed content: {len(data)} bytes after {seen}"
        assert size == len(data), f"fstat says {size} bytes, read returned {len(data)}"
        seen.append("new" if data == new else "old")
        return data == new

    wait_until(served_new, timeout=10 * TTL, what="the new version")
    for _ in range(3):
        assert served_new(), "went back to the old version"
    m.umount()


def test_rewrite_under_an_open_handle_gives_old_bytes_or_estale(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(blockSize="64KiB", attrValid=TTL, lookupValid=TTL)
    blocks = 8
    old = random.Random(1).randbytes(blocks * BS)
    new = random.Random(2).randbytes(blocks * BS)
    source = m.source / "file.bin"
    source.write_bytes(old)
    m.mount()
    # O_DIRECT, so every read below is answered by the daemon, not by the page cache.
    fd = os.open(m.path("file.bin"), os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, BS, 0) == old[:BS]  # block 0 cached, the handle bound to the old version
        before = _version(source)
        with open(source, "r+b") as f:
            f.write(new)
        assert _version(source) != before, "precondition: the rewrite must change the file's version"
        outcomes = []
        for offset, length in [(0, BS), (BS // 2, BS), (7 * BS, BS), (5 * BS - 10, 20), (3 * BS, 2 * BS), (0, blocks * BS)]:
            try:
                data = os.pread(fd, length, offset)
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
                outcomes.append("ESTALE")
            else:
                assert data == old[offset : offset + length], f"pread({length}, {offset}) is not the old content"
                outcomes.append("old")
    finally:
        os.close(fd)
    # Block 0 was cached; block 7 was never fetched, so it can only come from the new file.
    assert outcomes[0] == "old" and outcomes[2] == "ESTALE", outcomes
    assert metric(m.scrape(), "cubefs_fuse_stale_reads_total") >= 1
    # A new open sees the new version once the kernel's entry for the path has run out (at
    # most the attribute TTL); until then an open reaches the old inode, whose blocks not
    # cached answer ESTALE, as the old handle's did (docs/contracts.md).
    def new_version() -> bool:
        try:
            return _read(m.path("file.bin"))[0] == new
        except OSError as exc:
            assert exc.errno == errno.ESTALE, exc
            return False

    wait_until(new_version, timeout=10 * TTL, what="the new version")
    m.umount()
