"""MetadataCache: attribute and negative-lookup TTLs (virtual clock), listings filling
attributes, bounds, and errors that are not cached."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from cubefs_fuse.errors import FsError
from cubefs_fuse.fs.metadata import MetadataCache
from tests.fakes import FakeBackend

ATTR_TTL = 10.0  # seconds (virtual); deliberately different from LOOKUP_TTL
LOOKUP_TTL = 2.0


def make(backend: FakeBackend, *, attr_ttl: float = ATTR_TTL, lookup_ttl: float = LOOKUP_TTL,
         max_entries: int = 1000) -> MetadataCache:
    return MetadataCache(backend, attr_ttl=attr_ttl, lookup_ttl=lookup_ttl, max_entries=max_entries)


async def test_attr_ttl(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("a", b"one")
    meta = make(backend)
    assert (await meta.stat("a")).size == 3
    backend.write("a", b"changed")  # the source changes; the cache may not know yet
    await trio.sleep(ATTR_TTL - 0.1)
    assert (await meta.stat("a")).size == 3
    assert meta.peek("a") is not None
    assert backend.operations["stat"] == 1
    await trio.sleep(0.2)  # past the TTL
    assert meta.peek("a") is None
    attr = await meta.stat("a")
    assert attr.size == 7 and attr.version == backend.version("a")
    assert backend.operations["stat"] == 2
    stats = meta.statistics()
    assert (stats.attr_hits, stats.attr_misses) == (1, 2)


async def test_hit_answers_only_what_stat_would_answer_from_the_cache(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("a", b"one")
    meta = make(backend)
    assert meta.hit("a") is None  # never stated: a miss is stat's to count and fetch
    attr = await meta.stat("a")
    assert meta.hit("a") is attr  # the cached object itself (fs/inodes.py compares by identity first)
    with pytest.raises(FsError):
        await meta.stat("gone")
    assert meta.hit("gone") is None  # a cached absence: stat raises ENOENT and counts it
    await trio.sleep(ATTR_TTL + 0.1)
    assert meta.hit("a") is None  # expired
    stats = meta.statistics()
    assert (stats.attr_hits, stats.attr_misses, stats.negative_hits) == (1, 2, 0)
    assert backend.operations["stat"] == 2


async def test_negative_lookup_ttl(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("present", b"x")
    meta = make(backend)
    await meta.stat("present")
    for _ in range(2):
        with pytest.raises(FsError) as info:
            await meta.stat("missing")
        assert info.value.errno == errno.ENOENT
    assert backend.operations["stat"] == 2  # the second miss was answered from the cache
    assert meta.statistics().negative_hits == 1

    backend.write("missing", b"now here")
    await trio.sleep(LOOKUP_TTL - 0.1)
    with pytest.raises(FsError):
        await meta.stat("missing")  # still negatively cached
    await trio.sleep(0.2)
    assert (await meta.stat("missing")).size == 8
    # The negative TTL expired, the (longer) attribute TTL of the other file did not.
    await meta.stat("present")
    assert backend.operations["stat"] == 3


async def test_zero_ttls_cache_nothing(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("d/a", b"x")
    meta = make(backend, attr_ttl=0.0, lookup_ttl=0.0)
    for _ in range(3):
        await meta.stat("d/a")
        with pytest.raises(FsError):
            await meta.stat("nope")
        await meta.listdir("d")
    assert backend.operations["stat"] == 6 and backend.operations["listdir"] == 3
    assert meta.statistics().attr_entries == 0


async def test_negative_not_cached_without_lookup_ttl(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    meta = make(backend, lookup_ttl=0.0)
    for _ in range(2):
        with pytest.raises(FsError):
            await meta.stat("nope")
    backend.write("nope", b"x")
    assert (await meta.stat("nope")).size == 1  # found at once: the miss was never cached
    assert backend.operations["stat"] == 3


async def test_listdir_fills_attrs(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    names = [f"img{i}.jpg" for i in range(5)]
    for name in names:
        backend.write(f"train/cls/{name}", name.encode())
    backend.mkdir("train/cls/sub")
    backend.symlink("train/cls/link", "img0.jpg")
    meta = make(backend)
    entries = await meta.listdir("train/cls")
    assert sorted(n for n, _ in entries) == sorted([*names, "sub", "link"])
    for name in names:
        attr = await meta.stat(f"train/cls/{name}")
        assert attr.size == len(name) and attr.is_file
    assert (await meta.stat("train/cls/sub")).is_dir
    assert (await meta.stat("train/cls/link")).is_symlink
    assert backend.operations["stat"] == 0  # every attribute came with the listing
    assert await meta.listdir("train/cls") == entries
    assert backend.operations["listdir"] == 1
    stats = meta.statistics()
    assert (stats.attr_hits, stats.listing_hits, stats.listing_misses) == (7, 1, 1)
    assert stats.listing_names == 7

    # The listing and the attributes it brought expire with the attribute TTL.
    backend.write("train/cls/new.jpg", b"n")
    await trio.sleep(ATTR_TTL + 0.1)
    assert "new.jpg" in [n for n, _ in await meta.listdir("train/cls")]
    assert backend.operations["listdir"] == 2


async def test_root_listing_paths(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("top", b"abc")
    meta = make(backend)
    assert [n for n, _ in await meta.listdir("")] == ["top"]
    assert (await meta.stat("top")).size == 3
    assert backend.operations["stat"] == 0  # cached as "top", not "/top"


async def test_bounded_entries(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    for i in range(5):
        backend.write(f"f{i}", b"x")
    meta = make(backend, max_entries=3)
    for i in range(5):
        await meta.stat(f"f{i}")
    assert meta.statistics().attr_entries == 3
    await meta.stat("f4")  # among the newest: cached
    assert backend.operations["stat"] == 5
    await meta.stat("f0")  # the oldest was dropped
    assert backend.operations["stat"] == 6
    # A directory larger than the bound is listed but its listing is not kept.
    for i in range(5):
        backend.write(f"big/g{i}", b"y")
    await meta.listdir("big")
    await meta.listdir("big")
    assert backend.operations["listdir"] == 2
    assert meta.statistics().attr_entries <= 3


async def test_errors_are_not_cached(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("locked", b"x")
    backend.fail("locked", errno.EACCES, ops=("stat",))
    meta = make(backend)
    for _ in range(2):
        with pytest.raises(OSError) as info:
            await meta.stat("locked")
        assert info.value.errno == errno.EACCES
    assert backend.operations["stat"] == 2
    backend.heal("locked")
    assert (await meta.stat("locked")).size == 1


async def test_fresh_stat_and_invalidate(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("a", b"1")
    meta = make(backend)
    await meta.stat("a")
    backend.write("a", b"22")
    assert (await meta.fresh_stat("a")).size == 2  # bypasses the cached attributes
    assert (await meta.stat("a")).size == 2  # and caches the fresh ones
    assert backend.operations["stat"] == 2
    backend.write("a", b"333")
    meta.invalidate("a")
    assert (await meta.stat("a")).size == 3
    assert backend.operations["stat"] == 3


async def test_concurrent_stats_of_one_path_make_one_backend_call(autojump_clock: trio.testing.MockClock) -> None:
    """Single flight: a window's stat and readers' lookups of the same file while its stat
    is in flight wait for that one (one HEAD over S3, one hop over a directory); a
    stat_read then brings no bytes of its own; a failed stat leaves each waiter to ask the
    backend itself; a fresh_stat never takes the answer of a stat begun before it."""
    backend = FakeBackend(latency=1.0)
    backend.write("a", b"one")
    meta = make(backend)
    answers: list[object] = []

    async def stat() -> None:
        answers.append((await meta.stat("a")).size)

    async def stat_read() -> None:
        answers.append(await meta.stat_read("a", 1 << 20, lambda attr: True))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(stat)
        await trio.sleep(0.5)
        nursery.start_soon(stat_read)
    read = [a for a in answers if isinstance(a, tuple)]
    assert sorted(a for a in answers if isinstance(a, int)) == [3] * 5
    assert len(read) == 1 and read[0][0].size == 3 and read[0][1] is None
    assert (backend.operations["stat"], backend.stat_reads) == (1, 0)
    assert meta.statistics().attr_misses == 1

    backend.write("b", b"two")
    backend.fail("b", errno.EIO, ops=("stat",))
    outcomes: list[object] = []

    async def stat_b() -> None:
        try:
            outcomes.append((await meta.stat("b")).size)
        except OSError as exc:
            outcomes.append(exc.errno)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stat_b)
        await trio.sleep(0.5)
        nursery.start_soon(stat_b)  # waits for the first, which fails: then asks itself
        await trio.sleep(0.6)
        backend.heal("b")
    assert outcomes == [errno.EIO, 3] and backend.operations["stat"] == 3

    backend.write("c", b"old")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(meta.stat, "c")  # in flight with the old attributes
        await trio.sleep(0.1)
        backend.write("c", b"changed")
        assert (await meta.fresh_stat("c")).size == 7
    assert backend.operations["stat"] == 5
