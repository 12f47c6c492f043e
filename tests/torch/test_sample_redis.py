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

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


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
