"""The S3 backend over a real S3 server (SeaweedFS, tests/s3_servers.py): listings page by
page, stat of keys, prefixes and markers, ranged and whole-object reads, an overwritten
key as a new version (StaleVersion for the old one), retries of 503 SlowDown through a
faulting proxy (tools/s3_proxy.py), probes, statistics, nothing but reads, a bucket
that stops answering and comes back under DeadlineBackend, and the cache's layers over it."""

from __future__ import annotations

import errno
import random
import stat
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import trio

from cubefs_fuse.attrs import Attr
from cubefs_fuse.backends.deadline import DeadlineBackend
from cubefs_fuse.backends.s3 import S3Backend, S3Location
from cubefs_fuse.errors import StaleVersion
from cubefs_fuse.fs.inodes import ROOT_INODE
from tools.s3_proxy import Request, S3Proxy
from tests.s3_servers import SeaweedS3, s3_env, s3_server  # noqa: F401 -- the fixtures
from tests.stack import BLOCK, open_stack, stack_config

Make = Callable[..., S3Backend]


@pytest.fixture
def make_backend(s3_env: SeaweedS3) -> Iterator[Make]:
    made: list[S3Backend] = []

    def make(bucket: str, prefix: str = "", *, endpoint: str = "", **kwargs: Any) -> S3Backend:
        backend = S3Backend(S3Location(bucket, prefix, endpoint=endpoint or s3_env.endpoint), 4, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def put(server: SeaweedS3, bucket: str, objects: dict[str, bytes]) -> None:
    client = server.client()
    with ThreadPoolExecutor(8) as pool:  # a thousand PUTs in a few seconds
        list(pool.map(lambda item: client.put_object(Bucket=bucket, Key=item[0], Body=item[1]), objects.items()))


async def test_listing_pages_through_more_keys_than_a_page(s3_env: SeaweedS3, make_backend: Make) -> None:
    bucket = s3_env.new_bucket()
    files = {f"data/big/f{i:04d}": b"%d" % i for i in range(1003)}
    files.update({"data/big/sub/x": b"x", "data/big/zz/y": b"yy", "data/big/": b"", "outside/z": b"z"})
    put(s3_env, bucket, files)
    backend = make_backend(bucket, "data/", page_size=100)  # 11 pages
    entries = dict(await backend.listdir("big"))
    assert set(entries) == {f"f{i:04d}" for i in range(1003)} | {"sub", "zz"}  # the marker "big/" left out
    assert entries["f0999"].size == 3 and entries["f0999"].is_file
    assert entries["sub"].is_dir and entries["zz"].is_dir
    assert [name for name, _ in await backend.listdir("")] == ["big"]  # the prefix is the root
    assert backend.statistics().operations["listdir"] == 2


async def test_a_listing_past_its_limit_asks_for_no_further_page(s3_env: SeaweedS3, make_backend: Make) -> None:
    bucket = s3_env.new_bucket()
    put(s3_env, bucket, {f"d/f{i:03d}": b"x" for i in range(250)})
    backend = make_backend(bucket, page_size=100)
    with pytest.raises(OSError) as raised:
        await backend.listdir("d", limit=150)  # past it after the second page
    assert raised.value.errno == errno.E2BIG
    assert len(await backend.listdir("d", limit=250)) == 250
    stats = backend.statistics()
    assert stats.operations["listdir"] == 2 and not stats.errors


# Keys of the bounded-memory listing test, and its page size: 20 pages, so that holding
# them all would cost ~20 times one page.
MANY_KEYS, SMALL_PAGE = 2000, 100
# The listing's peak beyond its entries, in held pages: measured ~6 when it streams, ~25
# when it holds every page (2026-11-29): 12 tells the two apart with room either way.
PEAK_PAGES = 12


async def test_a_long_listing_holds_one_page_at_a_time(s3_env: SeaweedS3, make_backend: Make) -> None:
    """Listing a prefix of MANY_KEYS keys page by page: at its peak the listing held its
    entries and about one page of the answer, never all the pages (traced allocations of
    every thread: the listing runs in a worker thread)."""
    bucket = s3_env.new_bucket()
    put(s3_env, bucket, {f"many/k{i:05d}": b"" for i in range(MANY_KEYS)})
    backend = make_backend(bucket, page_size=SMALL_PAGE)
    assert len(await backend.listdir("many")) == MANY_KEYS  # connections, imports and caches warm
    tracemalloc.start()
    try:
        entries = await backend.listdir("many")
        held, peak = tracemalloc.get_traced_memory()
        pages = backend._pages("many/")
        page = next(pages)  # one page of the answer, as the listing holds it
        page_bytes = tracemalloc.get_traced_memory()[0] - held
        del page, pages
    finally:
        tracemalloc.stop()
    assert len(entries) == MANY_KEYS
    # Beyond the entries it returns, the listing's peak is one page held while the next one
    # is parsed (its XML text and parse tree: ~6 pages' worth measured, 25 with every page
    # held), far below the MANY_KEYS / SMALL_PAGE pages of the whole answer.
    assert peak - held < PEAK_PAGES * page_bytes, (peak - held, page_bytes, held)


async def test_stat_keys_prefixes_markers_and_missing(s3_env: SeaweedS3, make_backend: Make) -> None:
    bucket = s3_env.new_bucket()
    put(s3_env, bucket, {"a/file.bin": b"12345", "a/dir/inner": b"i", "a/marker/": b"", "a/both": b"key"})
    # After the key of the same name: SeaweedFS's filer, given both at once, may make
    # "a/both" a directory first and then lose the key (seen under load).
    put(s3_env, bucket, {"a/both/under": b"hidden"})
    backend = make_backend(bucket, "a")
    attr = await backend.stat("file.bin")
    assert attr.is_file and attr.size == 5 and stat.S_IMODE(attr.mode) == 0o444
    assert (await backend.stat("dir")).is_dir
    assert (await backend.stat("")).is_dir
    assert (await backend.stat("marker")).is_dir and await backend.listdir("marker") == []
    assert (await backend.stat("both")).is_file  # a key and a prefix of one name: the key
    assert dict(await backend.listdir(""))["both"].is_file
    for missing in ("nope", "dir/nope", "file.bin/x"):
        with pytest.raises(FileNotFoundError):
            await backend.stat(missing)
    assert backend.statistics().errors == {}  # a lookup of a missing name is no error
    with pytest.raises(FileNotFoundError):
        await backend.listdir("nope")  # a directory that vanished: counted, as the directory backend does
    assert backend.statistics().errors == {("listdir", errno.ENOENT): 1}
    # A listing's attributes and a HEAD's are one version (Last-Modified cut to seconds).
    assert dict(await backend.listdir(""))["file.bin"].version == attr.version
    with pytest.raises(OSError) as info:
        await backend.readlink("file.bin")
    assert info.value.errno == errno.EINVAL
    assert (await backend.statfs()).name_max == 255


async def test_ranged_reads_and_stat_read(s3_env: SeaweedS3, make_backend: Make) -> None:
    bucket = s3_env.new_bucket()
    data = random.Random(31).randbytes(3 * 65536 + 1234)
    put(s3_env, bucket, {"big.bin": data, "small.txt": b"small file"})
    backend = make_backend(bucket)
    attr = await backend.stat("big.bin")
    ranges = ((0, 65536), (65536, 65536), (3 * 65536, 1234), (100, 1), (5, 150_000))
    for offset, size in ranges:
        assert await backend.read_block("big.bin", attr.version, offset, size) == data[offset:offset + size]
    with pytest.raises(StaleVersion):  # past the end of this version, as a short read of a file
        await backend.read_block("big.bin", attr.version, 3 * 65536, 1235)
    small, whole = await backend.stat_read("small.txt", 65536, lambda a: True)  # one ranged GET
    assert whole == b"small file" and small.size == 10
    big, none = await backend.stat_read("big.bin", 65536, lambda a: True)  # larger than max_size
    assert none is None and big.version == attr.version
    reads = backend.statistics().operations["read"]
    _, unwanted = await backend.stat_read("small.txt", 65536, lambda a: False)
    assert unwanted is None and backend.statistics().operations["read"] == reads  # its bytes dropped, no read
    assert backend.statistics().bytes_read == sum(size for _, size in ranges) + len(b"small file")


async def test_a_cold_lookup_is_one_ranged_get(s3_env: SeaweedS3, make_backend: Make) -> None:
    """stat_read through the recording proxy: a small object's attributes and bytes come in
    one request (a GET of its first max_size bytes); a larger object's lookup is the same
    one request, whose answer is bounded by its Range and not kept; a lookup that does not
    want the bytes is one request too; an empty object is the GET's 416 and a HEAD; a
    prefix the GET's 404 and a LIST."""
    bucket = s3_env.new_bucket()
    size = 4096  # max_size of these lookups: the large object is five of it and a byte
    large = random.Random(3).randbytes(5 * size + 1)
    put(s3_env, bucket, {"small": b"s" * 100, "large": large, "empty": b"", "dir/inner": b"i"})
    with S3Proxy(s3_env.s3_port) as proxy:
        backend = make_backend(bucket, endpoint=proxy.endpoint)

        async def looked_up(path: str, wanted: bool = True) -> tuple[Attr, bytes | None, list[Request]]:
            before = len(proxy.requests)
            attr, data = await backend.stat_read(path, size, lambda a: wanted)
            with proxy.lock:
                return attr, data, proxy.requests[before:]

        attr, data, sent = await looked_up("small")
        assert data == b"s" * 100 and attr.size == 100
        assert [(r.method, r.range) for r in sent] == [("GET", f"bytes=0-{size - 1}")]
        assert backend.statistics().operations == {"stat": 1, "read": 1}
        assert backend.statistics().bytes_read == 100
        assert attr.version == (await backend.stat("small")).version  # the HEAD's attributes exactly

        attr, data, sent = await looked_up("large")
        assert data is None and attr.size == len(large)  # the total size, from Content-Range
        assert [(r.method, r.range) for r in sent] == [("GET", f"bytes=0-{size - 1}")]
        assert sent[0].sent <= size  # no more of it than max_size crossed the wire
        assert attr.version == (await backend.stat("large")).version
        assert await backend.read_block("large", attr.version, size, size) == large[size:2 * size]

        attr, data, sent = await looked_up("small", wanted=False)  # on NVMe already, or not wanted
        assert data is None and attr.size == 100 and [r.method for r in sent] == ["GET"]

        attr, data, sent = await looked_up("empty")
        assert data is None and attr.is_file and attr.size == 0
        assert [r.method for r in sent] == ["GET", "HEAD"]

        attr, data, sent = await looked_up("dir")
        assert data is None and attr.is_dir and [r.method for r in sent] == ["GET", "GET"]  # the LIST
        with pytest.raises(FileNotFoundError):
            await backend.stat_read("nope", size, lambda a: True)
        ops = backend.statistics().operations
        # One read part (the small object's bytes kept) and one read_block; the rest are stats.
        assert ops["read"] == 2 and backend.statistics().errors == {}


async def test_an_overwritten_key_is_a_new_version_and_old_reads_are_stale(s3_env: SeaweedS3, make_backend: Make) -> None:
    bucket = s3_env.new_bucket()
    put(s3_env, bucket, {"f": b"A" * 1000})
    backend = make_backend(bucket)
    old = await backend.stat("f")
    assert await backend.read_block("f", old.version, 0, 10) == b"A" * 10
    put(s3_env, bucket, {"f": b"B" * 1000})  # same size: only the ETag tells
    with pytest.raises(StaleVersion):
        await backend.read_block("f", old.version, 0, 10)  # If-Match: 412
    # A backend that never saw the old ETag (If-Match impossible) checks the answer's ETag.
    with pytest.raises(StaleVersion):
        await make_backend(bucket).read_block("f", old.version, 0, 10)
    new = await backend.stat("f")
    assert new.version != old.version and new.size == old.size
    assert await backend.read_block("f", new.version, 990, 10) == b"B" * 10
    attr, data = await backend.stat_read("f", 4096, lambda a: True)
    assert attr.version == new.version and data == b"B" * 1000


async def test_throttling_is_retried_and_only_reads_reach_the_bucket(s3_env: SeaweedS3, make_backend: Make) -> None:
    bucket = s3_env.new_bucket()
    put(s3_env, bucket, {"d/f": b"payload"})
    with S3Proxy(s3_env.s3_port) as proxy:
        backend = make_backend(bucket, endpoint=proxy.endpoint)
        proxy.fail_next(3)
        attr = await backend.stat("d/f")  # a HEAD: obstore's retries
        assert proxy.failed == 3
        proxy.fail_next(3)
        assert await backend.listdir("d") == [("f", attr)]  # a LIST: boto3's retries
        assert proxy.failed == 6
        proxy.fail_next(3)
        assert await backend.read_block("d/f", attr.version, 0, 7) == b"payload"
        assert proxy.failed == 9
        # Bounded: a bucket that keeps throttling is an EIO after the retries.
        few = make_backend(bucket, endpoint=proxy.endpoint, retries=2)
        proxy.fail_next(100)
        with pytest.raises(OSError) as info:
            await few.read_block("d/f", attr.version, 0, 7)
        assert info.value.errno == errno.EIO and proxy.failed == 12
        assert few.statistics().errors == {("read", errno.EIO): 1}
        # Within the request's time (backendTimeout): a listing under a bucket that keeps
        # throttling fails after a few spaced retries, not boto3's minute of them; a probe
        # tries once (the probe loop is its retry).
        short = make_backend(bucket, endpoint=proxy.endpoint, timeout=1.0)
        proxy.fail_next(1_000_000)
        sent, started = len(proxy.methods), time.monotonic()
        with pytest.raises(OSError) as info:
            await short.listdir("d")
        assert info.value.errno == errno.EIO and time.monotonic() - started < 1.0 + 2.0
        assert len(proxy.methods) - sent >= 3
        sent = len(proxy.methods)
        with pytest.raises(OSError):
            await short.probe()
        assert len(proxy.methods) == sent + 1
        proxy.fail_next(0)
        assert await few.probe() is False
    assert set(proxy.methods) <= {"GET", "HEAD"}  # nothing was ever written
    with pytest.raises(OSError):  # the proxy is gone: no answer
        await few.probe()


async def test_a_bucket_that_stops_answering_is_down_then_recovers(s3_env: SeaweedS3, make_backend: Make) -> None:
    """Under DeadlineBackend as the daemon runs it: EIO after the retries, a probe, down
    (fail fast), and up again at the first answer, with no restart."""
    bucket = s3_env.new_bucket()
    put(s3_env, bucket, {"f": b"data"})
    with S3Proxy(s3_env.s3_port) as proxy:
        inner = make_backend(bucket, endpoint=proxy.endpoint, retries=1)
        attr = await inner.stat("f")
        backend = DeadlineBackend(inner, 10.0, probe_interval=0.05)
        async with trio.open_nursery() as nursery:
            await nursery.start(backend.supervise)
            proxy.fail_next(1_000_000)  # every request throttled: the bucket is away
            with pytest.raises(OSError) as info:
                await backend.read_block("f", attr.version, 0, 4)
            assert info.value.errno == errno.EIO
            with trio.fail_after(10):
                while not backend.down:
                    await trio.sleep(0.02)
            sent = len(proxy.methods)
            with pytest.raises(OSError):
                await backend.stat("f")
            assert backend.statistics().failed_fast["stat"] == 1
            proxy.fail_next(0)  # back
            with trio.fail_after(10):
                while backend.down:
                    await trio.sleep(0.02)
            assert len(proxy.methods) > sent  # probes, and nothing else, reached it meanwhile
            assert await backend.read_block("f", attr.version, 0, 4) == b"data"
            nursery.cancel_scope.cancel()


async def test_the_cache_stack_over_a_bucket_reads_each_block_once(s3_env: SeaweedS3, make_backend: Make) -> None:
    """The daemon's layers (tests/stack.py) over the S3 backend: a small file comes with its
    lookup (stat_read: one ranged GET), a large one block by block, and a second read
    of either is served from the cache without a request; after the TTL an overwrite is a
    new inode with the new bytes, and the old inode still reads its own (cached) version."""
    bucket = s3_env.new_bucket()
    big = random.Random(7).randbytes(3 * BLOCK + 100)
    put(s3_env, bucket, {"d/small": b"s" * 100, "d/big": big})
    with S3Proxy(s3_env.s3_port) as proxy:
        backend = make_backend(bucket, endpoint=proxy.endpoint)
        async with open_stack(backend, stack_config(attr_valid=1.0, lookup_valid=1.0)) as stack:
            fs = stack.fs
            d = await fs.lookup(ROOT_INODE, "d")
            small = await fs.lookup(d.inode, "small")
            large = await fs.lookup(d.inode, "big")
            for entry, data in ((small, b"s" * 100), (large, big)):
                for _ in range(2):
                    assert bytes(await fs.read(entry.inode, 0, 0, len(data) + 10, pid=1)) == data
            ops = backend.statistics().operations
            assert ops["read"] == 1 + 4  # the small file's GET in its lookup, the big one's 4 blocks
            with proxy.lock:
                per_key = Counter((r.method, r.path.rpartition("/")[2]) for r in proxy.requests)
            # The cold small file's lookup and reads: one request.  The big one's: its lookup
            # (a GET whose bytes are not kept) and one GET per block.
            assert per_key[("GET", "small")] == 1 and per_key[("GET", "big")] == 1 + 4, per_key
            assert per_key[("HEAD", "small")] == per_key[("HEAD", "big")] == 0, per_key
            put(s3_env, bucket, {"d/small": b"S" * 50})
            await trio.sleep(1.5)
            fresh = await fs.lookup(d.inode, "small")
            assert fresh.inode != small.inode and fresh.attr.size == 50
            assert bytes(await fs.read(fresh.inode, 0, 0, 100, pid=1)) == b"S" * 50
            assert bytes(await fs.read(small.inode, 0, 0, 100, pid=1)) == b"s" * 100  # its version, from RAM
