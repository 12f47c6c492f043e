"""The processed-sample cache on real Redis: CachedDataset over an ImageFolder on a real mount.

The dataset is a folder of JPEGs served by an ``ai_prefetch`` cubefs-fuse mount (so
cube_torch plans the epochs and its fast path serves the workers' misses); the store is a
real ``redis-server`` or a real 3-master Redis Cluster started by the test
(tests/redis_servers.py).  The cached part is decoding + resizing (``base[i]`` is a PIL
image and its label); RandomCrop and a flip run after the cache.  Computes are counted
across the DataLoader worker processes (one line per ``base[i]`` in a file).
"""

from __future__ import annotations

import os
import pickle
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


import cube_torch
from cube_torch import client as ct_client
from cube_torch.samples.cache import RETRY_AFTER
from cube_torch.samples.redis_store import KEY_PREFIX, RedisClusterStore, RedisStore
from cube_torch.samples.store import StoreError
from tests.sample_pipeline import (  # noqa: F401  (worker_log: a fixture)
    assert_a_changed_file_is_recomputed, two_ranks_share, FILES, WORKERS, TTL, CountingFolder, computed, served_by_fast_path, DECODE_RESIZE, augment, sample_volume, loader, epochs, reference, assert_same, worker_log, warning_lines,
)
from tests.helpers import Mount, free_port
from tools.harness import drop_page_cache
from tests.redis_servers import RedisCluster, RedisServer, make_redis, redis_cluster, redis_server  # noqa: F401


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mount, str]]:
    yield from sample_volume(tmp_path_factory, {})


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    cube_torch.install()
    ct_client._warned.clear()
    yield


def cached(root: Path, counts: Path, store: str, name: str = "train-decoded-40") -> cube_torch.CachedDataset:
    return cube_torch.CachedDataset(CountingFolder(root, counts, DECODE_RESIZE), name=name, transform=augment,
                                    store=store)


def test_same_tensors_every_epoch_and_a_second_run_reuses(volume: tuple[Mount, str], redis_server: RedisServer,
                                                          tmp_path: Path) -> None:
    mount, _ = volume
    root = mount.mount_point / "train"
    want = reference(root, 3)
    counts = tmp_path / "computed"
    got = epochs(loader(cached(root, counts, redis_server.url)), 3)
    assert_same(got, want)
    assert sorted(computed(counts)) == list(range(FILES))  # epoch 0 computed each sample once; 1 and 2 none
    # The misses' files came through cube_torch's fast path (the daemon's data socket).
    assert served_by_fast_path(counts) > 0
    assert redis_server.keys() == FILES
    # The kernel forgets the mount's inodes (cubefs-fuse then numbers them anew): entries of
    # unchanged files stay valid all the same.
    assert drop_page_cache()
    time.sleep(3 * TTL)
    again = tmp_path / "computed-again"  # a second run: a new dataset object, new workers
    assert_same(epochs(loader(cached(root, again, redis_server.url)), 2), want[:2])
    assert computed(again) == []


def test_two_ranks_share_entries_on_a_cluster(volume: tuple[Mount, str], redis_cluster: RedisCluster,
                                              tmp_path: Path) -> None:
    mount, _ = volume
    root = mount.mount_point / "train"
    two_ranks_share(root, tmp_path, lambda counts, name: cached(root, counts, redis_cluster.url, name))
    per_node = [node.keys() for node in redis_cluster.nodes]
    assert sum(per_node) >= FILES and all(per_node), f"keys should spread over every master: {per_node}"


def test_a_changed_source_file_is_recomputed(volume: tuple[Mount, str], redis_server: RedisServer,
                                             tmp_path: Path) -> None:
    mount, _ = volume
    root = mount.mount_point / "train"
    counts = tmp_path / "computed"
    ds = cached(root, counts, redis_server.url, "changes")
    epochs(loader(ds), 1)
    assert len(computed(counts)) == FILES
    assert_a_changed_file_is_recomputed(mount, root, ds, counts)


def test_redis_down_warns_once_and_training_continues(volume: tuple[Mount, str], make_redis: Any,
                                                     tmp_path: Path, worker_log: Path) -> None:
    mount, _ = volume
    root = mount.mount_point / "train"
    server = make_redis()
    counts = tmp_path / "computed"
    dl = loader(cached(root, counts, server.url, "down"), persistent=True)
    want = reference(root, 3, persistent=True)
    got = epochs(dl, 1)
    server.stop()  # killed between epochs
    started = time.monotonic()
    got += epochs(dl, 2)
    elapsed = time.monotonic() - started
    assert_same(got, want)
    assert len(computed(counts)) == 3 * FILES  # after the kill every sample is computed again
    lines = warning_lines(worker_log)
    assert 1 <= len(lines) <= WORKERS, lines  # once per worker process, not per batch
    assert elapsed < RETRY_AFTER, "a dead store must be bypassed, not retried per batch"


def test_redis_full_warns_once_and_training_continues(volume: tuple[Mount, str], make_redis: Any,
                                                     tmp_path: Path, worker_log: Path) -> None:
    mount, _ = volume
    root = mount.mount_point / "train"
    server = make_redis("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    filler = RedisStore(server.url)  # fill it up to its limit first: big values, then small ones to the brim
    for size in (64 << 10, 64):
        with pytest.raises(StoreError, match="maxmemory-policy allkeys-lru"):
            for k in range(100_000):
                filler.put_many("filler", [(k + (size << 20), os.urandom(size))])
    counts = tmp_path / "computed"
    got = epochs(loader(cached(root, counts, server.url, "full"), persistent=True), 2)
    assert_same(got, reference(root, 2, persistent=True))
    # Hardly anything could be stored (Redis frees a little memory now and then, e.g. client
    # buffers, and takes one write whenever it is below maxmemory at that moment).
    assert len(computed(counts)) > 1.5 * FILES
    lines = warning_lines(worker_log)
    assert 1 <= len(lines) <= WORKERS and all("full" in line for line in lines), lines


def test_redis_store_contract(redis_server: RedisServer, redis_cluster: RedisCluster) -> None:
    for store in (RedisStore(redis_server.url), RedisClusterStore(redis_cluster.url)):
        assert store.get_many("c", [1, 2]) == [None, None]
        store.put_many("c", [(1, b"one"), (2, b"\x00two")])
        assert store.get_many("c", [2, 3, 1]) == [b"\x00two", None, b"one"]
        assert store.get_many("c", []) == []
        store.plan("c", [1, 2])
        store.close()
    assert re.fullmatch(re.escape(KEY_PREFIX) + r"c:\d", f"{KEY_PREFIX}c:1")
    dead = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(StoreError):
        dead.get_many("c", [1])
    assert time.monotonic() - started < 10
    with pytest.raises(StoreError):
        RedisClusterStore(f"redis+cluster://127.0.0.1:{free_port()}").get_many("c", [1])


def redis_py_version() -> str:
    from importlib.metadata import version

    return version("redis")


def test_a_batch_of_sets_goes_in_one_sendmsg_and_survives_what_a_server_does(make_redis: Any) -> None:
    """SetWriter: a batch larger than IOV_MAX buffers (and than the socket's buffer) is
    written whole, its answers read later (by the next put, a settle, or a get); a
    connection the server closed while idle is replaced and the batch sent again; an error
    answer (full) raises and leaves no half-read answers behind."""
    from tests.redis_servers import cli

    server = make_redis("--maxmemory", "64mb", "--maxmemory-policy", "noeviction")
    store = RedisStore(server.url)
    many = [(k, os.urandom(64 + k % 300)) for k in range(700)]  # 1,401 buffers: two sendmsg calls at least
    big = [(10_000 + k, os.urandom(3 << 20)) for k in range(4)]  # 12 MB: many partial sends
    store.put_many("lean", many)
    assert store._sets is not None and store._sets.unread == len(many)  # sent, answers not read yet
    store.put_many("lean", big)  # (reads the first batch's answers first)
    assert store._sets.unread == len(big)
    store.settle()
    assert store._sets.unread == 0
    assert store.get_many("lean", [k for k, _ in many + big]) == [v for _, v in many + big]
    # redis-py still names itself (CLIENT SETINFO; Redis 7.0 lists no lib-name), with the
    # version resolved once per process tree, not per connection.
    from cube_torch.samples.redis_store import _identity

    options = store._connected().connection_pool.connection_kwargs
    identity = _identity()
    assert all(options[k] is v for k, v in identity.items())
    assert redis_py_version() in repr(identity)
    cli(server.port, "CLIENT", "KILL", "TYPE", "normal")  # what a server's idle timeout does
    store.put_many("lean", [(1, b"after a kill")])
    assert store.get_many("lean", [1]) == [b"after a kill"]
    with pytest.raises(StoreError, match="maxmemory-policy allkeys-lru"):
        for round_ in range(100):
            store.put_many("full", [(round_ * 8 + k, os.urandom(1 << 20)) for k in range(8)])
    cli(server.port, "CONFIG", "SET", "maxmemory", "0")
    store.put_many("lean", [(2, b"the connection is clean")])
    assert store.get_many("lean", [2, 1]) == [b"the connection is clean", b"after a kill"]
    store.close()


# A fresh interpreter makes a cache (which preloads the store's client, as before a
# DataLoader forks its workers), then a forked child connects, writes and reads, and prints
# the modules that imported.
_FORKED_IMPORTS = """
import json, os, sys
from cube_torch.samples.cache import SampleCache
from cube_torch.samples.redis_store import RedisStore
SampleCache("imports", sys.argv[1])
store = RedisStore(sys.argv[1])
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    before = set(sys.modules)
    store.prepare()
    store.put_many("imports", [(1, b"x" * 150_000)])
    assert store.get_many("imports", [1, 2]) == [b"x" * 150_000, None]
    store.close()
    os.write(write, json.dumps(sorted(set(sys.modules) - before)).encode())
    os._exit(0)
os.close(write)
print(os.read(read, 1 << 20).decode())
os.waitpid(pid, 0)
"""


def test_a_forked_worker_imports_nothing_to_connect_read_and_write(make_redis: Any) -> None:
    """Making a cache imports what a connection needs, before DataLoader workers fork: a
    fresh worker's first client, PING, SETs and MGET import no module (each lazy import
    cost a fresh worker ~1-2 ms of CPU, every epoch: idna, secrets, hmac)."""
    import json
    import subprocess
    import sys

    server = make_redis()
    result = subprocess.run([sys.executable, "-c", _FORKED_IMPORTS, server.url], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_a_connection_that_is_no_plain_socket_sends_buffer_by_buffer() -> None:
    """TLS (an SSLSocket cannot sendmsg): redis-py's send_packed_command, the same bytes;
    the answers are read by the next send or a settle."""
    from cube_torch.samples.redis_store import SetWriter

    class TlsLike:
        _sock = object()

        def __init__(self) -> None:
            self.sent: list[bytes] = []
            self.answers = 0

        def connect(self) -> None:
            pass

        def can_read(self) -> bool:
            return False

        def send_packed_command(self, buffers: list[bytes | memoryview]) -> None:
            self.sent += [bytes(b) for b in buffers]

        def read_response(self) -> bytes:
            self.answers += 1
            return b"OK"

    class Pool:
        def __init__(self) -> None:
            self.connection = TlsLike()

        def get_connection(self) -> TlsLike:
            return self.connection

        def release(self, connection: TlsLike) -> None:
            pass

    pool = Pool()
    writer = SetWriter(pool)
    writer.send("n", [(1, b"ab"), (2, bytearray(b"\r\n"))])
    connection = pool.connection
    assert b"".join(connection.sent) == (b"*3\r\n$3\r\nSET\r\n$21\r\ncube_torch:sample:n:1\r\n$2\r\nab\r\n"
                                         b"*3\r\n$3\r\nSET\r\n$21\r\ncube_torch:sample:n:2\r\n$2\r\n\r\n\r\n")
    assert connection.answers == 0 and writer.unread == 2
    writer.send("n", [(3, b"c")])
    assert connection.answers == 2 and writer.unread == 1
    writer.close()
    assert connection.answers == 3 and writer.unread == 0


def test_entry_buffers_are_reused_after_a_put(redis_server: RedisServer) -> None:
    """write_entry copies an entry into a buffer of the store's; put_many (or release)
    frees it for the next entry of the same size, up to POOL_BYTES kept."""
    from cube_torch.samples import redis_store

    store = RedisStore(redis_server.url)
    first = [store.write_entry([b"x" * 100, memoryview(b"y" * 50)], 150) for _ in range(3)]
    assert all(bytes(b) == b"x" * 100 + b"y" * 50 for b in first)
    store.put_many("pool", list(enumerate(first)))
    again = [store.write_entry([b"z" * 150], 150) for _ in range(3)]
    assert {id(b) for b in again} == {id(b) for b in first}  # the same memory, rewritten
    assert store.get_many("pool", [0, 1, 2]) == [b"x" * 100 + b"y" * 50] * 3  # (stored as they were sent)
    store.put_many("pool", [(9, b"plain bytes are sent, never kept")])
    assert all(len(free) <= 3 for free in store._free.values())
    huge = [store.write_entry([b"h" * (1 << 20)], 1 << 20) for _ in range(redis_store.POOL_BYTES // (1 << 20) + 4)]
    for buffer in huge:
        store.release(buffer)
    assert store._free_bytes <= redis_store.POOL_BYTES
    assert pickle.loads(pickle.dumps(store))._free == {}  # a worker's copy starts with none
    store.close()
