"""DiskTier's free-space floor against a really full filesystem (an 8 MiB tmpfs), and the
NVMe stores on a filesystem that cannot punch holes (a ramfs): the rest of DiskTier is in
tests/unit/test_disk_tier.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from cubefs_fuse.cache import holes
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.errors import ConfigError
from cubefs_fuse.samples import files
from tests.helpers import Mount, allocated_on_disk, block_key, block_payload, metric, write_tree


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs, so the free-space floor is exercised against a full filesystem."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"cannot mount a tmpfs: {result.stderr.strip()}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A real ramfs: it stores files but has no fallocate (EOPNOTSUPP), so no holes."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    assert result.returncode == 0, f"cannot mount a ramfs: {result.stderr.strip()}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


async def test_without_hole_punching_the_block_tier_refuses_and_the_sample_store_falls_back(ramfs: Path) -> None:
    assert not holes.can_punch(str(ramfs))
    with pytest.raises(ConfigError, match="diskCacheDir.*cannot punch holes"):
        await DiskTier.open(str(ramfs / "cache"), 1 << 20, 0.0)
    assert os.listdir(ramfs / "cache" / "segments") == []  # the probe is gone
    assert files.prepare(str(ramfs / "cache" / "samples")) is False  # one entry per segment
    assert os.listdir(ramfs / "cache" / "samples" / "tmp") == []


async def test_free_space_floor(small_fs: Path) -> None:
    free_ratio = 0.25
    directory = small_fs / "cache"
    # The byte limit (100 MiB) is far above the filesystem (8 MiB): only the floor limits.
    tier = await DiskTier.open(str(directory), 100 * 1024 * 1024, free_ratio)
    st = os.statvfs(small_fs)
    floor = int(free_ratio * st.f_blocks * st.f_frsize)
    block = 64 * 1024
    for i in range(200):  # 200 x 68 KiB = 13.3 MiB, well past what the filesystem holds
        await tier.put(block_key(i), block_payload(i, block))
        st = os.statvfs(small_fs)
        assert st.f_bavail * st.f_frsize >= floor, f"floor broken after put {i}"
        assert tier.used_bytes <= tier.effective_limit_bytes
        # On disk: the entries and no more than the overhead counted with them (the
        # directory's growth and the segments' extent trees are bounded, not measured).
        assert 0 <= tier.used_bytes - allocated_on_disk(directory) <= tier.statistics().directory_bytes
    stats = tier.statistics()
    assert stats.effective_limit_bytes < stats.limit_bytes
    assert stats.evictions > 0  # a full cache keeps taking new blocks by evicting old ones
    assert block_key(199) in tier and await tier.get(block_key(199)) == block_payload(199, block)
    # The cache used most of what the floor allows (not just a token amount).
    assert tier.used_bytes > (8 * 1024 * 1024 - floor) // 2

    # Concurrent writers (as the block cache's write-behind issues them): the floor still
    # holds whenever a writer looks, with other writes and unlinks in flight.
    lowest = st.f_bavail * st.f_frsize

    async def writer(w: int) -> None:
        nonlocal lowest
        for j in range(10):
            i = 1000 + w * 100 + j
            await tier.put(block_key(i), block_payload(i, block * (1 + j % 3)))
            now = os.statvfs(small_fs)
            lowest = min(lowest, now.f_bavail * now.f_frsize)
            assert tier.used_bytes <= tier.limit_bytes

    async with trio.open_nursery() as nursery:
        for w in range(24):
            nursery.start_soon(writer, w)
    assert lowest >= floor, f"free space fell to {lowest} below the floor {floor}"
    assert 0 <= tier.used_bytes - allocated_on_disk(directory) <= tier.statistics().directory_bytes
    await tier.close()


def test_a_mount_whose_cache_disk_is_nearly_full_says_so(small_fs: Path, make_mount: Callable[..., Mount]) -> None:
    """The floor, not diskCacheSize, limits the NVMe tier of a mount on a nearly full disk: the
    daemon logs it once at start with the numbers, and the lowered limit is what it reports,
    while files are still served (from the remote and RAM)."""
    (small_fs / "filler").write_bytes(b"\0" * (5 * 1024 * 1024))  # 5 of 8 MiB used: ~37 % free
    m = make_mount(diskCacheDir=str(small_fs / "cache"), diskCacheSize="64MiB", diskFreeRatio=0.5)
    files = write_tree(m.source, {"d/f.bin": os.urandom(50_000)})
    m.mount()
    try:
        assert m.path("d/f.bin").read_bytes() == files["d/f.bin"]
        assert "keeps diskFreeRatio 0.50 free, which leaves the NVMe tier 0 of its 67108864 bytes" in m.log()
        assert metric(m.scrape(), "cubefs_fuse_cache_limit_bytes", tier="disk") == 0
    finally:
        m.umount()
