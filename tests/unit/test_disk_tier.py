"""DiskTier on real files: limits (accounting and on-disk), corruption, restart from the
index and from a scan, and the directory lock.  The free-space floor, which needs a small
filesystem of its own (a tmpfs, so root), is in tests/mounted/test_disk_tier_full_fs.py."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio

from cubefs_fuse.cache.disk import HEADER_BYTES, DiskTier, allocated_bytes
from cubefs_fuse.errors import ConfigError
from tests.helpers import allocated_on_disk, block_key as key, block_payload as payload

# The tier accounts in 4 KiB allocation units (ext4/xfs); the limits below are counted in them.
PAGE = 4096


def block_path(directory: Path, k: bytes) -> Path:
    """Where a block lives (the layout documented in cubefs_fuse/cache/disk.py)."""
    return directory / "blocks" / k.hex()[:2] / k.hex()


async def test_put_get_roundtrip(tmp_path: Path) -> None:
    tier = await DiskTier.open(str(tmp_path), 10 * 1024 * 1024, 0.0)
    sizes = [0, 1, PAGE - HEADER_BYTES, PAGE - HEADER_BYTES + 1, 1 << 20]
    for i, size in enumerate(sizes):
        assert await tier.put(key(i), payload(i, size))
    for i, size in enumerate(sizes):
        assert await tier.get(key(i)) == payload(i, size)
    assert await tier.get(key(99)) is None
    stats = tier.statistics()
    assert stats.blocks == len(sizes) and stats.hits == len(sizes) and stats.misses == 1
    assert stats.directory_bytes > 0  # blocks/, tmp/ and the fan-out blocks/00
    assert stats.used_bytes == sum(allocated_bytes(s) for s in sizes) + stats.directory_bytes
    assert stats.used_bytes == allocated_on_disk(tmp_path)
    await tier.close()


async def test_limit_holds_sequential_and_concurrent(tmp_path: Path) -> None:
    limit = 64 * PAGE
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    rng = random.Random(7)
    # Sequential: after every put the accounting and the filesystem agree and stay in bounds.
    for i in range(300):
        size = rng.choice([0, rng.randrange(1, 3 * PAGE), rng.randrange(3 * PAGE, 12 * PAGE)])
        assert await tier.put(key(i), payload(i, size))
        on_disk = allocated_on_disk(tmp_path)
        assert tier.used_bytes <= limit
        assert on_disk <= limit
        assert on_disk == tier.used_bytes  # nothing in flight: they must match exactly
    assert tier.statistics().evictions > 0

    # Concurrent: 40 writers race; each samples the filesystem after each of its puts,
    # with the tier's disk workers paused: a walk while other writers' threads unlink and
    # write counts an evicted file and its replacement both (a diagnosis that tracked the
    # bytes under a lock at every write and unlink found the tier at most at its limit
    # while such a walk read above it, once in ~200 runs), so it is taken in one state.
    peak = 0

    async def writer(w: int) -> None:
        nonlocal peak
        for j in range(15):
            i = 1000 + w * 100 + j
            await tier.put(key(i), payload(i, rng.randrange(0, 10 * PAGE)))
            assert tier.used_bytes <= limit
            async with tier.io_paused():
                on_disk = allocated_on_disk(tmp_path)
            assert on_disk <= limit
            peak = max(peak, on_disk)

    async with trio.open_nursery() as nursery:
        for w in range(40):
            nursery.start_soon(writer, w)
    assert allocated_on_disk(tmp_path) == tier.used_bytes <= limit
    assert peak > limit // 2  # the check ran against a well-filled cache, not an empty one
    await tier.close()


async def test_limit_shrunk_between_runs(tmp_path: Path) -> None:
    tier = await DiskTier.open(str(tmp_path), 40 * PAGE, 0.0)
    for i in range(40):
        await tier.put(key(i), payload(i, 100))
    await tier.close()
    tier = await DiskTier.open(str(tmp_path), 10 * PAGE, 0.0)
    assert tier.used_bytes <= 10 * PAGE and tier.used_bytes == allocated_on_disk(tmp_path)
    kept = tier.statistics().blocks
    assert kept == (10 * PAGE - tier.statistics().directory_bytes) // PAGE
    # The most recently written blocks are the ones kept.
    assert all(key(i) in tier for i in range(40 - kept, 40))
    assert await tier.get(key(39)) == payload(39, 100)
    await tier.close()


def _flip_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 5] ^= 0xFF
    path.write_bytes(raw)


def _truncate_header(path: Path) -> None:
    os.truncate(path, HEADER_BYTES - 10)


def _truncate_payload(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def _extend_payload(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


def _huge_length(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:12] = ((1 << 32) - 1).to_bytes(4, "little")  # the header's payload length: 4 GiB
    path.write_bytes(raw)


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate_header, _truncate_payload, _extend_payload,
                                    _huge_length, "wrong_key"])
async def test_corrupted_block_is_discarded(tmp_path: Path, damage: object) -> None:
    tier = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    good, other = key(1), key(2)
    await tier.put(good, payload(1, 5000))
    await tier.put(other, payload(2, 5000))
    path = block_path(tmp_path, good)
    if damage == "wrong_key":
        # A well-formed block file under the wrong name (its header holds another key).
        path.write_bytes(block_path(tmp_path, other).read_bytes())
    else:
        assert callable(damage)
        damage(path)
    assert await tier.get(good) is None
    stats = tier.statistics()
    assert stats.checksum_failures == 1
    assert not path.exists()
    assert good not in tier
    assert stats.blocks == 1 and tier.used_bytes == allocated_bytes(5000) + stats.directory_bytes
    assert tier.used_bytes == allocated_on_disk(tmp_path)
    assert await tier.get(other) == payload(2, 5000)  # the neighbour is untouched
    # Once discarded, the key is an ordinary miss and can be stored again.
    assert await tier.get(good) is None and tier.statistics().checksum_failures == 1
    assert await tier.put(good, payload(1, 5000))
    assert await tier.get(good) == payload(1, 5000)
    await tier.close()


async def _fill(directory: Path, n: int) -> dict[bytes, bytes]:
    tier = await DiskTier.open(str(directory), 1 << 24, 0.0)
    blocks = {key(i): payload(i, i * 37 % 9000) for i in range(n)}
    for k, data in blocks.items():
        await tier.put(k, data)
    await tier.close()
    return blocks


async def _check_reopened(directory: Path, blocks: dict[bytes, bytes], source: str) -> DiskTier:
    tier = await DiskTier.open(str(directory), 1 << 24, 0.0)
    stats = tier.statistics()
    assert stats.startup_source == source
    assert stats.blocks == len(blocks)
    assert stats.used_bytes == sum(allocated_bytes(len(d)) for d in blocks.values()) + stats.directory_bytes
    assert stats.used_bytes == allocated_on_disk(directory)
    for k, data in blocks.items():
        assert k in tier
        assert await tier.get(k) == data
    assert tier.statistics().checksum_failures == 0
    return tier


async def test_restart_from_index_then_from_scan(tmp_path: Path) -> None:
    blocks = await _fill(tmp_path, 120)
    assert (tmp_path / "index.bin").exists()
    tier = await _check_reopened(tmp_path, blocks, "index")
    # The index is consumed at start-up, so a crash from now on cannot trust it.
    assert not (tmp_path / "index.bin").exists()
    tier.release()  # a crash: no index written
    assert not (tmp_path / "index.bin").exists()

    # Leftovers of a crash: a half-written block in tmp/ and junk among the blocks.
    (tmp_path / "tmp" / "77").write_bytes(b"partial")
    junk = tmp_path / "blocks" / "00" / "not-a-key"
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(b"junk")
    short = tmp_path / "blocks" / "00" / ("00" + "ff" * 15)  # a key's name, shorter than a header
    short.write_bytes(b"x" * (HEADER_BYTES - 1))
    tier = await _check_reopened(tmp_path, blocks, "scan")
    assert not junk.exists() and not short.exists()
    assert os.listdir(tmp_path / "tmp") == []
    assert tier.statistics().startup_discarded == 3  # the partial write, the junk, the short block
    await tier.close()
    tier = await _check_reopened(tmp_path, blocks, "index")
    await tier.close()


async def test_damaged_index_falls_back_to_scan(tmp_path: Path) -> None:
    blocks = await _fill(tmp_path, 30)
    index = tmp_path / "index.bin"
    raw = bytearray(index.read_bytes())
    raw[-1] ^= 0x01
    index.write_bytes(raw)
    tier = await _check_reopened(tmp_path, blocks, "scan")
    await tier.close()


async def test_second_open_fails_naming_the_pid(tmp_path: Path) -> None:
    first = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    with pytest.raises(ConfigError, match=rf"diskCacheDir.*pid {os.getpid()}\b"):
        await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    await first.put(key(1), b"still mine")  # the failed open disturbed nothing
    await first.close()
    second = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)  # free once the owner closed it
    assert await second.get(key(1)) == b"still mine"
    second.release()


def spread_key(i: int) -> bytes:
    """Key ``i`` in fan-out directory ``i % 256`` (real keys are hashes: spread evenly)."""
    return bytes([i % 256]) + i.to_bytes(15, "big")


async def test_fanout_directories_are_counted_and_removed(tmp_path: Path) -> None:
    # 200 blocks of one page each in 200 fan-outs: without its directories counted the
    # tier would hold 64 blocks and 64 fan-outs (4 KiB each on ext4), twice its limit.
    limit = 64 * PAGE
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    for i in range(200):
        assert await tier.put(spread_key(i), payload(i, 100))
        stats = tier.statistics()
        assert stats.used_bytes == allocated_on_disk(tmp_path) <= limit
    fanouts = [d for d in (tmp_path / "blocks").iterdir()]
    assert len(fanouts) == stats.blocks  # one block per fan-out: emptied ones were removed
    assert stats.directory_bytes == sum(os.lstat(p).st_blocks * 512 for p in
                                        [tmp_path / "blocks", tmp_path / "tmp", *fanouts])
    await tier.clear()
    assert list((tmp_path / "blocks").iterdir()) == []
    assert tier.used_bytes == allocated_on_disk(tmp_path)
    await tier.close()
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    assert tier.used_bytes == allocated_on_disk(tmp_path) == tier.statistics().directory_bytes
    await tier.close()


async def test_fanout_limit_holds_under_concurrent_writers(tmp_path: Path) -> None:
    limit = 96 * PAGE
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    rng = random.Random(11)

    async def writer(w: int) -> None:
        for j in range(20):
            i = w * 1000 + j
            await tier.put(spread_key(rng.randrange(1 << 20)), payload(i, rng.randrange(0, 3 * PAGE)))
            assert tier.used_bytes <= limit
            async with tier.io_paused():
                assert allocated_on_disk(tmp_path) <= limit

    async with trio.open_nursery() as nursery:
        for w in range(30):
            nursery.start_soon(writer, w)
    assert allocated_on_disk(tmp_path) == tier.used_bytes <= limit
    await tier.close()
