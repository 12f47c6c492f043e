"""The processed-sample cache with its default store, the node's daemon, end to end.

``CachedDataset(base, name=...)`` with no ``store=``: the daemon of ``$VOL_NAME``'s
mount, a real ``cubefs-fuse mount`` subprocess with ``"profile": "ai_prefetch"`` that
also serves the dataset (a folder of JPEGs), plans cube_torch's epochs and serves the
workers' misses through the fast path.  The cached part is decoding + resizing
(``base[i]`` is a PIL image and its label); RandomCrop and a flip run after the cache.
Computes are counted across the DataLoader worker processes (one line per ``base[i]`` in
a file); hits are counted by the daemon (``cubefs-fuse status --json``'s samples
section).
"""

from __future__ import annotations

import json
import signal
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import ConcatDataset, Subset

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

import cube_torch
from cubefs_fuse import mounts
from cube_torch import client as ct_client
from cube_torch.samples.cache import RETRY_AFTER
from tests.sample_pipeline import (  # noqa: F401  (worker_log: a fixture)
    assert_a_changed_file_is_recomputed, two_ranks_share, wait_until_seen, SEED, FILES, CLASSES, WORKERS, BATCH, TTL, CountingFolder, computed, served_by_fast_path, DECODE_RESIZE, AUGMENT, augment, sample_volume, loader, epochs, reference, assert_same, worker_log, warning_lines, status, cache_counts,
)
from tests.helpers import Mount, cli, force_unmount, free_port, kill_for_good, wait_until
from tools.harness import drop_page_cache


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mount, str]]:
    yield from sample_volume(tmp_path_factory, {"sampleCacheMemSize": "16MiB", "sampleCacheDiskSize": "64MiB"})


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    cube_torch.install()
    ct_client._warned.clear()
    yield


def cached(root: Path, counts: Path, name: str) -> cube_torch.CachedDataset:
    """The dataset under test: no ``store=``, so the daemon of $VOL_NAME."""
    return cube_torch.CachedDataset(CountingFolder(root, counts, DECODE_RESIZE), name=name, transform=augment)


def settled(mount: Mount, name: str, entries: int) -> None:
    """Wait until the workers' background writers have stored ``entries`` entries."""
    wait_until(lambda: cache_counts(mount, name)["entries"] >= entries, what=f"{entries} entries in {name!r}")


def test_same_tensors_every_epoch_and_a_second_run_reuses(volume: tuple[Mount, str], tmp_path: Path) -> None:
    mount, _ = volume
    wait_until(lambda: status(mount)["loaded"], what="the sample store's start-up scan")
    root = mount.mount_point / "train"
    want = reference(root, 3)
    counts = tmp_path / "computed"
    name = "train-decoded-40"
    got = epochs(loader(cached(root, counts, name)), 3)
    assert_same(got, want)
    assert sorted(computed(counts)) == list(range(FILES))  # epoch 0 computed each sample once; 1 and 2 none
    # The misses' files came through cube_torch's fast path (the daemon's data socket).
    assert served_by_fast_path(counts) > 0
    settled(mount, name, FILES)
    first = cache_counts(mount, name)
    assert first["entries"] == FILES and first["hits"] >= 2 * FILES, first  # epochs 1 and 2: the daemon's hits
    # The kernel forgets the mount's inodes (cubefs-fuse then numbers them anew): entries of
    # unchanged files stay valid all the same.
    assert drop_page_cache()
    time.sleep(3 * TTL)
    again = tmp_path / "computed-again"  # a second run: a new dataset object, new workers
    assert_same(epochs(loader(cached(root, again, name)), 2), want[:2])
    assert computed(again) == []
    assert cache_counts(mount, name)["hits"] - first["hits"] == 2 * FILES

    # The daemon restarts (same disk cache directory): the entries come back from NVMe and
    # a third run still computes nothing.
    mount.umount()
    mount.mount()
    wait_until(lambda: status(mount)["loaded"], what="the sample store's start-up scan")
    assert cache_counts(mount, name)["entries"] == FILES
    after_restart = tmp_path / "computed-after-restart"
    assert_same(epochs(loader(cached(root, after_restart, name)), 1), want[:1])
    assert computed(after_restart) == []
    assert cache_counts(mount, name)["hits"] == FILES
    # Those entries were read from NVMe, each checked against the checksum its DataLoader
    # worker computed and sent with the put: every one held.
    assert status(mount)["corrupt"] == 0


def test_two_ranks_share_entries(volume: tuple[Mount, str], tmp_path: Path) -> None:
    mount, _ = volume
    wait_until(lambda: status(mount)["loaded"], what="the sample store's start-up scan")
    root = mount.mount_point / "train"
    hits_after_0 = 0

    def after_epoch_0(name: str) -> None:
        nonlocal hits_after_0
        settled(mount, name, FILES)  # both ranks' writes are in before epoch 1 reads them
        hits_after_0 = cache_counts(mount, name)["hits"]

    name = two_ranks_share(root, tmp_path, lambda counts, name: cached(root, counts, name), after_epoch_0)
    # The daemon served every sample of epoch 1, to both ranks.
    assert cache_counts(mount, name)["hits"] - hits_after_0 == FILES


def test_a_changed_source_file_is_recomputed(volume: tuple[Mount, str], tmp_path: Path) -> None:
    mount, _ = volume
    root = mount.mount_point / "train"
    counts = tmp_path / "computed"
    ds = cached(root, counts, "changes")
    epochs(loader(ds), 1)
    assert len(computed(counts)) == FILES
    settled(mount, "changes", FILES)
    assert_a_changed_file_is_recomputed(mount, root, ds, counts)


def fast_path_requests(mount: Mount) -> tuple[float, float]:
    """Batches the workers asked the daemon to resolve over the fast path, and their files."""
    scraped = mount.scrape()
    return (scraped.get("cubefs_fuse_fastpath_batches_total", 0.0),
            sum(v for k, v in scraped.items() if k.startswith("cubefs_fuse_fastpath_files_total")))


def test_a_subset_of_a_cached_dataset_asks_the_fast_path_for_its_misses_only(volume: tuple[Mount, str],
                                                                             tmp_path: Path) -> None:
    """Through a Subset too, the fast path serves the files of a batch's misses only: once
    every sample is cached, an epoch asks the daemon for no file at all."""
    mount, _ = volume
    root = mount.mount_point / "train"
    counts = tmp_path / "computed"
    picked = list(range(1, FILES, 2))
    subset = Subset(cached(root, counts, "subset"), picked)
    plain = datasets.ImageFolder(str(root), transform=transforms.Compose([DECODE_RESIZE, AUGMENT]))
    want = epochs(loader(Subset(plain, picked)), 2)
    dl = loader(subset)
    got = epochs(dl, 1)
    assert sorted(computed(counts)) == picked and served_by_fast_path(counts) > 0  # misses: through the fast path
    settled(mount, "subset", len(picked))
    before = fast_path_requests(mount)
    torch.manual_seed(SEED + 1)  # epoch 1, seeded as the reference's
    got.append([(x.clone(), y.clone()) for x, y in dl])
    assert_same(got, want)
    assert sorted(computed(counts)) == picked  # every sample a hit
    assert fast_path_requests(mount) == before, "hits must not make the daemon resolve their files"


def plan_lengths(mount: Mount) -> dict[int, int]:
    """The daemon's prefetch plans of this process's job, by epoch: their lengths (files)."""
    result = cli("status", str(mount.mount_point), "--json")
    assert result.returncode == 0, result.stderr
    plans = json.loads(result.stdout)[0]["plans"]
    return {int(p["epoch"]): int(p["samples"]) for p in plans if p["job"] == ct_client.default_job()}


def test_the_daemon_is_not_asked_to_prefetch_the_files_of_cached_samples(volume: tuple[Mount, str],
                                                                         tmp_path: Path) -> None:
    """The store answers the epoch's key order with what it holds: those samples read no
    file, so the file plan sent for prefetch leaves them out (all of them held: one sample
    stays, the daemon takes no empty plan)."""
    mount, _ = volume
    root = mount.mount_point / "train"
    counts = tmp_path / "computed"
    ds = cached(root, counts, f"held-{time.monotonic_ns()}")
    dl = loader(ds, persistent=True)
    want = reference(root, 3, persistent=True)
    got = epochs(dl, 1)
    assert plan_lengths(mount).get(0) == FILES  # nothing held yet: every sample's files
    settled(mount, ds.name, FILES)
    torch.manual_seed(SEED + 1)
    got.append([(x.clone(), y.clone()) for x, y in dl])
    assert plan_lengths(mount).get(1) == 1
    assert_same(got, want[:2])
    # A changed source file: its sample is held (stale), its file read on demand, correctly.
    target = ds.base.samples[5][0]
    source = mount.source / os.path.relpath(target, mount.mount_point)
    Image.fromarray(np.full((30, 30, 3), 90, dtype=np.uint8)).save(source, format="JPEG")
    wait_until_seen(target, source)
    want = reference(root, 3, persistent=True)
    torch.manual_seed(SEED + 2)
    got.append([(x.clone(), y.clone()) for x, y in dl])
    assert_same(got[2:], want[2:])
    assert sorted(computed(counts)) == sorted([*range(FILES), 5])


def invert(sample: Any) -> Any:
    """A transform after the cache that changes the cached tensor in place."""
    image, label = sample
    return image.bitwise_not_(), label


def test_a_transform_changing_the_sample_in_place_does_not_change_the_stored_entry(
        volume: tuple[Mount, str], tmp_path: Path) -> None:
    """The cached part ends in PILToTensor (the CHW view of an HWC image: reordered as it is
    copied straight into the connection's ring); the transform after the cache inverts
    that very tensor in place.  The entry is the value as computed: every
    epoch, hits included, equals the pipeline without the cache."""
    mount, _ = volume
    root = mount.mount_point / "train"
    counts = tmp_path / "computed"
    to_tensor = transforms.Compose([DECODE_RESIZE, transforms.PILToTensor()])
    ds = cube_torch.CachedDataset(CountingFolder(root, counts, to_tensor), name=f"inplace-{time.monotonic_ns()}",
                                  transform=invert)
    plain = datasets.ImageFolder(str(root), transform=transforms.Compose([to_tensor, torch.bitwise_not]))
    want = epochs(loader(plain, persistent=True), 2)
    dl = loader(ds, persistent=True)
    got = epochs(dl, 1)
    settled(mount, ds.name, FILES)
    torch.manual_seed(SEED + 1)
    got.append([(x.clone(), y.clone()) for x, y in dl])
    assert_same(got, want)
    assert sorted(computed(counts)) == list(range(FILES)) and cache_counts(mount, ds.name)["hits"] == FILES


def planned_keys(mount: Mount, name: str) -> int:
    """The keys of the daemon's current plan of one of this uid's caches."""
    for cache in status(mount)["caches"]:
        if cache["name"] == name and cache["owner"] == os.geteuid():
            return int(cache["planned"])
    return 0


def test_a_concat_dataset_of_cached_datasets_plans_each_and_reads_no_file_of_its_hits(
        volume: tuple[Mount, str], tmp_path: Path) -> None:
    """A ConcatDataset of two CachedDatasets (one through a Subset): each cache gets the
    epoch's order of its own keys; once they are held, the file plan leaves their files
    out, every batch is served by the store (the fetcher hands each part its share of the
    batch: hits ask the fast path for no file) and the tensors are those of the same
    pipeline without the cache."""
    mount, _ = volume
    root = mount.mount_point / "train"
    counts_a, counts_b = tmp_path / "computed-a", tmp_path / "computed-b"
    stamp = time.monotonic_ns()
    picked = list(range(0, FILES, 3))
    a = cached(root, counts_a, f"concat-a-{stamp}")
    b = cached(root, counts_b, f"concat-b-{stamp}")
    concat: ConcatDataset[Any] = ConcatDataset([a, Subset(b, picked)])
    plain = datasets.ImageFolder(str(root), transform=transforms.Compose([DECODE_RESIZE, AUGMENT]))
    want = epochs(loader(ConcatDataset([plain, Subset(plain, picked)]), persistent=True), 2)
    dl = loader(concat, persistent=True)
    got = epochs(dl, 1)
    assert planned_keys(mount, a.name) == FILES and planned_keys(mount, b.name) == len(picked)
    assert plan_lengths(mount).get(0) == FILES + len(picked)  # nothing held yet: every sample's files
    assert sorted(computed(counts_a)) == list(range(FILES)) and sorted(computed(counts_b)) == picked
    settled(mount, a.name, FILES)
    settled(mount, b.name, len(picked))
    before = fast_path_requests(mount)
    torch.manual_seed(SEED + 1)
    got.append([(x.clone(), y.clone()) for x, y in dl])
    assert_same(got, want)
    assert plan_lengths(mount).get(1) == 1  # every sample held: one stays (no empty plan)
    assert sorted(computed(counts_a)) == list(range(FILES)) and sorted(computed(counts_b)) == picked
    assert fast_path_requests(mount) == before, "hits must not make the daemon resolve their files"
    assert cache_counts(mount, a.name)["hits"] == FILES and cache_counts(mount, b.name)["hits"] == len(picked)


def photo_mount(tmp_path: Path, vol: str, config: dict[str, str], sizes: list[tuple[int, int]], *, seed: int,
                pattern: str) -> Mount:
    """An ``ai_prefetch`` mount (not mounted yet) of its own, volume ``vol`` with ``config``,
    whose source holds ``train/class<k>/<pattern>`` random RGB JPEGs of ``sizes`` (h, w)."""
    m = Mount(tmp_path, tmp_path / "source", tmp_path / "mnt", tmp_path / "cache", tmp_path / "client.json",
              free_port(), {"profile": "ai_prefetch", "volName": vol, **config})
    m.source.mkdir()
    m.mount_point.mkdir()
    rng = np.random.default_rng(seed)
    for i, (height, width) in enumerate(sizes):
        folder = m.source / "train" / f"class{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)).save(
            folder / pattern.format(i))
    return m


def test_daemon_killed_mid_training_warns_once_and_training_continues(tmp_path: Path, worker_log: Path) -> None:
    """The store's daemon is SIGKILLed in the middle of an epoch.  The images are read from
    the source folder itself here (a killed daemon takes its mount down, and reads of a dead
    mount fail: that is the mount's failure, not the sample cache's)."""
    name = f"killed{free_port()}"
    m = photo_mount(tmp_path, name, {"sampleCacheMemSize": "16MiB", "sampleCacheDiskSize": "64MiB"},
                    [(48, 50 + i) for i in range(FILES)], seed=11, pattern="i{}.jpg")
    root = m.source / "train"
    previous = os.environ.get("VOL_NAME")
    os.environ["VOL_NAME"] = name
    try:
        m.mount()
        wait_until(lambda: status(m)["loaded"], what="the sample store's start-up scan")
        counts = tmp_path / "computed"
        dl = loader(cached(root, counts, "killed"), persistent=True)
        want = reference(root, 3, persistent=True)
        got = epochs(dl, 1)
        settled(m, "killed", FILES)
        # Epoch 1, the daemon killed after its first batch.
        pid = m.pid()
        torch.manual_seed(SEED + 1)
        batches = []
        started = time.monotonic()
        for x, y in dl:
            batches.append((x.clone(), y.clone()))
            if len(batches) == 1:
                kill_for_good(mounts.registered(str(m.mount_point)) or {})
                wait_until(lambda: not Path(f"/proc/{pid}").exists(), what="the daemon's death")
        got.append(batches)
        torch.manual_seed(SEED + 2)
        got.append([(x.clone(), y.clone()) for x, y in dl])
        elapsed = time.monotonic() - started
        assert_same(got, want)
        # Epoch 0 computed every sample; after the kill the samples not already read ahead
        # from the store are computed again (epoch 2: all of them).
        assert len(computed(counts)) >= 2 * FILES
        lines = warning_lines(worker_log)
        # Once per process, not per batch: each worker's reads, and the main process's
        # epoch plan (sent to the store from cube_torch's background thread).
        assert 1 <= len(lines) <= WORKERS + 1, lines
        assert sum("(plan)" in line for line in lines) <= 1, lines
        assert elapsed < RETRY_AFTER, "a dead store must be bypassed, not retried per batch"
    finally:
        if previous is None:
            os.environ.pop("VOL_NAME", None)
        else:
            os.environ["VOL_NAME"] = previous
        force_unmount(m)


def test_the_epoch_plan_keeps_the_entries_needed_soonest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A RAM-only store holding about a third of the samples.  cube_torch sends each epoch's
    key order to the daemon, whose eviction then keeps the resident entries the reshuffled
    next epoch reads (and does not let the epoch's new puts push them out first): epoch 1
    hits about every entry resident after epoch 0.  The same run without the plan (LRU)
    loses resident entries to the new puts before they are read."""
    samples = 96
    vol = f"evict{free_port()}"
    # RAM for about a third of the samples (an entry: ~4.9 KB encoded, charged 256 bytes more).
    m = photo_mount(tmp_path, vol, {"sampleCacheMemSize": str(32 * 5300), "sampleCacheDiskSize": "0"},
                    [(48, 48)] * samples, seed=3, pattern="i{:03d}.jpg")
    monkeypatch.setenv("VOL_NAME", vol)
    try:
        m.mount()
        root = m.mount_point / "train"
        epoch1_hits: dict[str, int] = {}
        resident: dict[str, int] = {}
        for name, planned in (("lru", False), ("planned", True)):
            if not planned:
                monkeypatch.setattr(ct_client, "_plan_samples", lambda dataset, order: None)
            else:
                monkeypatch.undo()
                monkeypatch.setenv("VOL_NAME", vol)
                drop = cli("drop-cache", str(m.mount_point), "--samples", "lru")
                assert drop.returncode == 0, drop.stderr
            counts = tmp_path / f"computed-{name}"
            dl = loader(cached(root, counts, name))
            epochs(dl, 1)  # fills the store; the workers have written everything when they exit
            resident[name] = cache_counts(m, name)["entries"]
            before = cache_counts(m, name)["hits"]
            torch.manual_seed(SEED + 1)
            list(dl)  # a reshuffled epoch
            epoch1_hits[name] = cache_counts(m, name)["hits"] - before
        assert 20 <= resident["planned"] < samples / 2 and resident["lru"] == resident["planned"], resident
        # With the plan every entry resident after epoch 0 is read before it could be evicted
        # (a batch per worker of slack: the first gets may come before the plan arrives).
        assert epoch1_hits["planned"] >= resident["planned"] - WORKERS * BATCH, (epoch1_hits, resident)
        assert epoch1_hits["planned"] > epoch1_hits["lru"], (epoch1_hits, resident)
    finally:
        force_unmount(m)
