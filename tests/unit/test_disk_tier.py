"""DiskTier on real files: limits (accounting and on-disk), corruption, restart from the
index and from a scan (after a crash, with damaged and junk leftovers, the old one-file-
per-block layout), eviction freeing space (punched ranges, deleted segments), and the
directory lock.  The free-space floor, which needs a small
filesystem of its own (a tmpfs, so root), is in tests/mounted/test_disk_tier_full_fs.py."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import trio

from cubefs_fuse.cache import holes
from cubefs_fuse.cache.disk import DIR_SLACK, HEADER_BYTES, SEGMENT_BYTES, LOCATION, DiskTier, allocated_bytes
from cubefs_fuse.errors import ConfigError
from tests.helpers import allocated_on_disk, block_key as key, block_payload as payload

# The tier accounts in 4 KiB allocation units (ext4/xfs); the limits below are counted in them.
PAGE = 4096


def entry_at(tier: DiskTier, directory: Path, k: bytes) -> tuple[Path, int, int]:
    """Where a block lives (the layout documented in cubefs_fuse/cache/disk.py): its
    segment file, offset and allocated size."""
    segment, size, offset = LOCATION.unpack(tier.index.get(k))  # type: ignore[arg-type]
    return directory / "segments" / f"{segment:08x}.seg", offset, size


def stored_bytes(tier: DiskTier) -> int:
    locations: list[int] = [tier.index.get(key) for key in tier.index.order()]  # type: ignore[misc]  # values are ints
    return sum(LOCATION.unpack(location)[1] for location in locations)


def check_accounting(tier: DiskTier, directory: Path) -> int:
    """With nothing in flight: the tier counts its entries and its overhead
    (``directory_bytes``: the directory as measured plus DIR_SLACK, the segments'
    extent-tree bounds) and the filesystem holds at least the entries and at most what
    is counted.  Returns the bytes on disk."""
    stats = tier.statistics()
    on_disk = allocated_on_disk(directory)
    assert stats.used_bytes == stored_bytes(tier) + stats.directory_bytes
    assert stored_bytes(tier) <= on_disk <= stats.used_bytes
    return on_disk


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
    assert stats.segments == 1 and len(os.listdir(tmp_path / "segments")) == 1  # packed into one file
    assert stats.directory_bytes >= DIR_SLACK
    assert stored_bytes(tier) == sum(allocated_bytes(s) for s in sizes)
    check_accounting(tier, tmp_path)
    await tier.close()


async def test_limit_holds_sequential_and_concurrent(tmp_path: Path) -> None:
    limit = 64 * PAGE
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    rng = random.Random(7)
    # Sequential: after every put the accounting and the filesystem agree and stay in bounds.
    for i in range(300):
        size = rng.choice([0, rng.randrange(1, 3 * PAGE), rng.randrange(3 * PAGE, 12 * PAGE)])
        assert await tier.put(key(i), payload(i, size))
        assert tier.used_bytes <= limit
        assert check_accounting(tier, tmp_path) <= limit  # nothing in flight
    assert tier.statistics().evictions > 0

    # Concurrent: 40 writers race; each samples the filesystem after each of its puts,
    # with the tier's disk workers paused: a walk while other writers' threads punch and
    # write counts a freed range and its replacement both, so it is taken in one state.
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
    assert check_accounting(tier, tmp_path) <= tier.used_bytes <= limit
    assert peak > limit // 2  # the check ran against a well-filled cache, not an empty one
    await tier.close()


async def test_limit_shrunk_between_runs(tmp_path: Path) -> None:
    tier = await DiskTier.open(str(tmp_path), 40 * PAGE, 0.0)
    for i in range(40):
        await tier.put(key(i), payload(i, 100))
    await tier.close()
    tier = await DiskTier.open(str(tmp_path), 10 * PAGE, 0.0)
    assert tier.used_bytes <= 10 * PAGE
    check_accounting(tier, tmp_path)
    kept = tier.statistics().blocks
    assert kept == (10 * PAGE - tier.statistics().directory_bytes) // PAGE
    # The most recently written blocks are the ones kept.
    assert all(key(i) in tier for i in range(40 - kept, 40))
    assert await tier.get(key(39)) == payload(39, 100)
    await tier.close()


def _flip_payload_byte(path: Path, offset: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset + HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(offset + HEADER_BYTES + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate_header(path: Path, offset: int, length: int) -> None:
    os.truncate(path, offset + HEADER_BYTES - 10)


def _truncate_payload(path: Path, offset: int, length: int) -> None:
    os.truncate(path, offset + HEADER_BYTES + length - 1)


def _zeroed(path: Path, offset: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(HEADER_BYTES + length))


def _huge_length(path: Path, offset: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset + 8)  # the header's payload length: 4 GiB (its own checksum no longer holds)
        f.write(((1 << 32) - 1).to_bytes(4, "little"))


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate_header, _truncate_payload, _zeroed,
                                    _huge_length, "wrong_key"])
async def test_corrupted_block_is_discarded(tmp_path: Path, damage: object) -> None:
    tier = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    good, other = key(1), key(2)
    await tier.put(other, payload(2, 5000))
    await tier.put(good, payload(1, 5000))  # the segment's last entry: truncating it spares the other
    path, offset, size = entry_at(tier, tmp_path, good)
    if damage == "wrong_key":
        # A well-formed entry in the wrong place (its header holds another key).
        other_path, other_offset, _ = entry_at(tier, tmp_path, other)
        with open(other_path, "rb") as f:
            f.seek(other_offset)
            raw = f.read(size)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(raw)
    else:
        assert callable(damage)
        damage(path, offset, 5000)
    assert await tier.get(good) is None
    stats = tier.statistics()
    assert stats.checksum_failures == 1
    assert good not in tier
    assert stats.blocks == 1 and stored_bytes(tier) == allocated_bytes(5000)
    check_accounting(tier, tmp_path)
    with open(path, "rb") as f:  # the damaged range was punched: a hole that reads as zeros
        if offset + size <= os.fstat(f.fileno()).st_size:
            assert os.lseek(f.fileno(), offset, os.SEEK_HOLE) == offset
    assert await tier.get(other) == payload(2, 5000)  # the neighbour is untouched
    # Once discarded, the key is an ordinary miss and can be stored again.
    assert await tier.get(good) is None and tier.statistics().checksum_failures == 1
    assert await tier.put(good, payload(1, 5000))
    assert await tier.get(good) == payload(1, 5000)
    await tier.close()


async def _fill(directory: Path, n: int, *, close: bool = True) -> dict[bytes, bytes]:
    tier = await DiskTier.open(str(directory), 1 << 24, 0.0)
    blocks = {key(i): payload(i, i * 37 % 9000) for i in range(n)}
    for k, data in blocks.items():
        await tier.put(k, data)
    if close:
        await tier.close()
    else:
        tier.release()  # a crash: no index
    return blocks


async def _check_reopened(directory: Path, blocks: dict[bytes, bytes], source: str) -> DiskTier:
    tier = await DiskTier.open(str(directory), 1 << 24, 0.0)
    stats = tier.statistics()
    assert stats.startup_source == source
    assert stats.blocks == len(blocks)
    assert stored_bytes(tier) == sum(allocated_bytes(len(d)) for d in blocks.values())
    check_accounting(tier, directory)
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

    # Leftovers of a crash: a torn entry at the end of a segment (a header whose payload
    # never made it), a segment of garbage, junk among the segments; and the layout of
    # old versions (one file per block in blocks/ab/, partial writes in tmp/).
    segments = sorted((tmp_path / "segments").iterdir())
    with open(segments[-1], "r+b") as f:
        end = -(-os.fstat(f.fileno()).st_size // PAGE) * PAGE
        f.seek(end)
        f.write(bytes(range(256)) * 16)  # a unit that is no header
    (tmp_path / "segments" / "ffffff00.seg").write_bytes(b"g" * 3 * PAGE)
    (tmp_path / "segments" / "not-a-segment").write_bytes(b"junk")
    (tmp_path / "blocks" / "00").mkdir(parents=True)
    (tmp_path / "blocks" / "00" / ("00" + "ff" * 15)).write_bytes(b"x" * 100)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "77").write_bytes(b"partial")
    tier = await _check_reopened(tmp_path, blocks, "scan")
    assert not (tmp_path / "blocks").exists() and not (tmp_path / "tmp").exists()
    assert not (tmp_path / "segments" / "not-a-segment").exists()
    assert not (tmp_path / "segments" / "ffffff00.seg").exists()  # nothing sound in it: deleted
    # The old layout's two files, the junk file, the torn unit and the garbage segment.
    assert tier.statistics().startup_discarded == 5
    await tier.close()
    tier = await _check_reopened(tmp_path, blocks, "index")
    await tier.close()


async def test_a_scan_takes_a_punched_last_entry_for_a_hole_not_junk(tmp_path: Path) -> None:
    # A segment's last entry freed (here: damaged, so its read punched it) leaves a hole up
    # to the end of the file, the size kept: after a crash the scan finds the entry before
    # it and no junk (the unit holding the end of the file is a hole like the rest).
    tier = await DiskTier.open(str(tmp_path), 1 << 24, 0.0)
    await tier.put(key(1), payload(1, 5000))
    await tier.put(key(2), payload(2, 3 * PAGE))  # spans 4 units, the file ends inside the 4th
    path, offset, size = entry_at(tier, tmp_path, key(2))
    with open(path, "r+b") as f:
        f.seek(offset + HEADER_BYTES + 10)
        f.write(b"\xff")
    assert await tier.get(key(2)) is None
    assert os.stat(path).st_size == offset + HEADER_BYTES + 3 * PAGE > offset + size - PAGE
    tier.release()  # a crash: no index
    tier = await DiskTier.open(str(tmp_path), 1 << 24, 0.0)
    stats = tier.statistics()
    assert (stats.startup_source, stats.blocks, stats.startup_discarded) == ("scan", 1, 0)
    assert await tier.get(key(1)) == payload(1, 5000)
    check_accounting(tier, tmp_path)
    await tier.close()


async def test_crash_between_writes_and_index(tmp_path: Path) -> None:
    # Blocks written, some evicted, then a crash (no index): a scan finds what is stored
    # and nothing that was evicted (its range was punched before the crash).
    limit = 48 * PAGE
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    for i in range(100):
        assert await tier.put(key(i), payload(i, 3000))
    kept = {k for k in (key(i) for i in range(100)) if k in tier}
    assert 0 < len(kept) < 100
    tier.release()
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    assert tier.statistics().startup_source == "scan"
    assert {k for k in (key(i) for i in range(100)) if k in tier} == kept
    check_accounting(tier, tmp_path)
    for i in range(100):
        if key(i) in kept:
            assert await tier.get(key(i)) == payload(i, 3000)
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


async def test_eviction_frees_space_and_deletes_empty_segments(tmp_path: Path) -> None:
    # Blocks of 1 MiB in a 6 MiB tier: 16 fill a segment, so eviction punches ranges of
    # the active segment; then blocks that start new segments seal it, and once its last
    # block is evicted the whole file goes.
    limit = 6 * 1024 * 1024
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    big = (1 << 20) - HEADER_BYTES  # one entry of exactly 1 MiB
    for i in range(40):
        assert await tier.put(key(i), payload(i, big))
        assert check_accounting(tier, tmp_path) <= limit
    stats = tier.statistics()
    assert stats.evictions == 40 - stats.blocks
    # 40 MiB went through; the first two segments (16 MiB each) have no block left.
    assert len(os.listdir(tmp_path / "segments")) == stats.segments == 1
    assert 40 * (1 << 20) > SEGMENT_BYTES * 2
    await tier.clear()
    assert os.listdir(tmp_path / "segments") == [] and tier.statistics().segments == 0
    assert check_accounting(tier, tmp_path) <= tier.used_bytes
    assert await tier.put(key(100), payload(100, 10))  # a new segment after the drop
    assert await tier.get(key(100)) == payload(100, 10)
    await tier.close()
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    assert tier.statistics().blocks == 1
    check_accounting(tier, tmp_path)
    await tier.close()


async def test_limit_holds_under_concurrent_writers_with_small_blocks(tmp_path: Path) -> None:
    limit = 96 * PAGE
    tier = await DiskTier.open(str(tmp_path), limit, 0.0)
    rng = random.Random(11)

    async def writer(w: int) -> None:
        for j in range(20):
            i = w * 1000 + j
            await tier.put(key(rng.randrange(1 << 20)), payload(i, rng.randrange(0, 3 * PAGE)))
            assert tier.used_bytes <= limit
            async with tier.io_paused():
                assert allocated_on_disk(tmp_path) <= limit

    async with trio.open_nursery() as nursery:
        for w in range(30):
            nursery.start_soon(writer, w)
    assert check_accounting(tier, tmp_path) <= tier.used_bytes <= limit
    await tier.close()


async def test_a_filesystem_that_cannot_punch_holes_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Evicted blocks are freed by punching their ranges: where that fails (EOPNOTSUPP) the
    # limit could not hold, so the directory is refused at start-up, naming the key.
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(holes, "punch", unsupported)
    with pytest.raises(ConfigError, match="diskCacheDir.*cannot punch holes"):
        await DiskTier.open(str(tmp_path), 1 << 20, 0.0)
    monkeypatch.undo()
    tier = await DiskTier.open(str(tmp_path), 1 << 20, 0.0)  # the lock was released
    assert os.listdir(tmp_path / "segments") == []  # the probe is gone
    tier.release()


async def test_large_segment_ids_survive_the_index(tmp_path: Path) -> None:
    # Segment ids only grow (one per ~16 MiB written over the cache's life): a location
    # with a large id still fits the index's u64 and comes back whole.
    tier = await DiskTier.open(str(tmp_path), 1 << 26, 0.0)
    tier._next_segment = (1 << 32) - 2
    big = SEGMENT_BYTES - 2 * PAGE  # two of them take two segments
    for i in range(3):
        assert await tier.put(key(i), payload(i, big if i < 2 else 100))
    assert tier.statistics().segments == 2
    await tier.close()
    tier = await DiskTier.open(str(tmp_path), 1 << 26, 0.0)
    assert tier.statistics().startup_source == "index" and tier.statistics().blocks == 3
    for i in range(3):
        assert await tier.get(key(i)) == payload(i, big if i < 2 else 100)
    check_accounting(tier, tmp_path)
    await tier.close()
