"""Several DataLoaders in one job, each with its own plan, over a real mount of a slow remote.

The remote is tools/slowfs_c with 1 ms per operation; the daemon's RAM tier
(``memCacheSize``) is smaller than one epoch's bytes, as with real data.  Every loader
runs real worker processes and reads real JPEGs through torchvision's ``ImageFolder``.

* **Two domains zipped**: two loaders over two disjoint ImageFolders, iterated together
  (``zip``).  Both plans live side by side under the same (job, rank), each loader's
  reads advance its own plan, and each loader's epoch 0 is >= 95 % hits (when one plan
  replaced the other, the job's epoch 0 was ~67 %).
* **Train and val interleaved**: a val loader takes one batch every 2 train batches,
  starting a new val epoch whenever the last one ends, for three train epochs: each
  loader's epoch 0 is >= 95 % hits, and the val loader's later plans replace only its own.

``cubefs-fuse status`` shows the job with its loaders.  The figures each run measured are
printed (``pytest -s``).
"""

from __future__ import annotations

import io
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

import cube_torch
from benchmarks.suite.remote import SlowFSCProcess, slowfs_c_binary
from cube_torch import client as ct_client
from cube_torch.patch import loader_id
from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import REPO, Mount, force_unmount, free_port, metric, wait_until

LATENCY_US = 1000  # the remote: 1 ms per operation (a busy NFS server, a near object store)
SIDE = 128  # JPEG side: ~16 KB of noise each, like a small thumbnail
BATCH = 8
# The training step per batch (a GPU's forward and backward pass).  Without one the loop
# asks for files faster than one daemon on 2 shared cores fetches them cold (~500 files/s,
# docs/benchmarks.md), and every plan's window runs dry whatever it plans.
STEP_S = 0.05
PER_DOMAIN = 400  # files of each zipped domain, and of the train set
VAL = 200  # files of the val set: 50 batches of VAL_BATCH, one every 2 of a train epoch's 50
VAL_BATCH = 4
RAM = 2 * 1024 * 1024  # memCacheSize: below one epoch of any test's loaders (>= 3 MB)
SEED = 20261124


def write_domain(root: Path, classes: int, per_class: int, seed: int) -> int:
    """An ImageFolder tree of noise JPEGs (incompressible); its total bytes."""
    rng = random.Random(seed)
    total = 0
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            image = Image.frombytes("RGB", (SIDE, SIDE), rng.randbytes(SIDE * SIDE * 3))
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=90)
            (folder / f"{i:03d}.jpg").write_bytes(buffer.getvalue())
            total += len(buffer.getvalue())
    return total


@dataclass
class SlowVolume:
    mount: Mount
    real: Path  # the files behind the remote
    name: str

    def client(self) -> ControlClient:
        return ControlClient(read_volume_config(self.name).control_socket, timeout=10)


@pytest.fixture
def slow_volume(tmp_path: Path) -> Iterator[Callable[[dict[str, tuple[int, int]]], SlowVolume]]:
    """Factory: ``slow_volume({"a": (classes, per_class), ...})`` writes those ImageFolder
    trees behind a tools/slowfs_c remote and mounts it with ai_prefetch and a small RAM tier."""
    binary = slowfs_c_binary()
    assert binary is not None, "tools/slowfs_c could not be built (run scripts/setup.sh)"
    started: list[tuple[Mount, SlowFSCProcess]] = []

    def factory(domains: dict[str, tuple[int, int]]) -> SlowVolume:
        port = free_port()
        base = tmp_path / "v"
        name = f"loaders{port}"
        mount = Mount(base, base / "source", base / "mnt", base / "cache", base / "client.json", port,
                      {"profile": "ai_prefetch", "volName": name, "memCacheSize": RAM})
        real = base / "real"
        for d in (mount.source, mount.mount_point, real):
            d.mkdir(parents=True)
        total = sum(write_domain(real / domain, classes, per_class, SEED + n)
                    for n, (domain, (classes, per_class)) in enumerate(sorted(domains.items())))
        assert total > RAM, "an epoch of the loaders together must exceed the RAM tier"
        remote = SlowFSCProcess(binary, real, mount.source, latency_us=LATENCY_US, threads=64, cache_timeout=0,
                                bandwidth_mb_s=0)
        remote.start()
        started.append((mount, remote))
        mount.mount()
        return SlowVolume(mount, real, name)

    yield factory
    for mount, remote in started:
        force_unmount(mount)
        remote.stop()


@pytest.fixture
def planning(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[SlowVolume, str], None]]:
    """``planning(volume, job)``: cube_torch installed, pointed at the volume as ``job``."""

    def setup(volume: SlowVolume, job: str) -> None:
        monkeypatch.setenv("VOL_NAME", volume.name)
        monkeypatch.setenv("CUBE_TORCH_JOB", job)
        monkeypatch.setenv("CUBE_TORCH_METRICS_INTERVAL", "3600")
        monkeypatch.setattr(ct_client, "_warned", set())
        cube_torch.install()

    yield setup
    cube_torch.uninstall()


def loader_over(root: Path, seed: int, batch: int = BATCH) -> DataLoader[Any]:
    dataset = datasets.ImageFolder(str(root), transform=transforms.ToTensor())
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=1, generator=generator)


def plans_of(volume: SlowVolume, job: str) -> dict[str, dict[str, Any]]:
    """The daemon's live plans of ``job`` (rank 0), by loader id."""
    return {p["loader"]: p for p in volume.client().status()["plans"] if p["job"] == job and p["rank"] == 0}


def settle(volume: SlowVolume, opens: int) -> None:
    """Wait until the daemon has counted ``opens`` file requests (releases arrive after reads)."""
    wait_until(lambda: volume.client().status()["hits"]["requests"] >= opens, timeout=20,
               what=f"the daemon to count {opens} opens")


def rate(plan: dict[str, Any]) -> float:
    return plan["hits"] / plan["requests"] if plan["requests"] else 0.0


def status_text(volume: SlowVolume) -> str:
    done = subprocess.run([sys.executable, "-m", "cubefs_fuse", "status", str(volume.mount.mount_point)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_two_zipped_domains_keep_their_own_plans(slow_volume: Callable[..., SlowVolume],
                                                 planning: Callable[[SlowVolume, str], None]) -> None:
    volume = slow_volume({"a": (4, PER_DOMAIN // 4), "b": (4, PER_DOMAIN // 4)})
    job = f"zipped-{os.getpid()}"
    planning(volume, job)
    first, second = loader_over(volume.mount.mount_point / "a", 1), loader_over(volume.mount.mount_point / "b", 2)
    samples = 0
    for x, y in zip(first, second):
        samples += len(x[0]) + len(y[0])
        time.sleep(STEP_S)
    assert samples == 2 * PER_DOMAIN
    settle(volume, 2 * PER_DOMAIN)
    plans = plans_of(volume, job)
    ids = {loader_id(first), loader_id(second)}
    assert len(ids) == 2 and set(plans) == ids, (ids, plans)
    job_counts = next(j for j in volume.client().status()["jobs"] if j["job"] == job)
    print(f"\nzipped domains, epoch 0 (RAM {RAM >> 20} MiB, 1 ms remote): job {job_counts['hits']}/"
          f"{job_counts['requests']} hits = {100 * job_counts['hit_rate']:.1f} %; per loader " +
          ", ".join(f"{k}: {p['hits']}/{p['requests']} = {100 * rate(p):.1f} %" for k, p in sorted(plans.items())))
    # The workers' batches came through the fast path (FUSE-free): its opens, too, went to
    # the loader whose plan reads them.
    scrape = volume.mount.scrape()
    served = sum(metric(scrape, "cubefs_fuse_fastpath_files_total", result=r) for r in ("hit", "miss"))
    assert served >= PER_DOMAIN, served
    for p in plans.values():
        assert p["requests"] == p["used"] == p["cursor"] == p["samples"] == PER_DOMAIN, p
        assert rate(p) >= 0.95, plans
    text = status_text(volume)
    print(text)
    assert f"job {job}: 1 rank (0), 1 planned, 2 loaders, requests {2 * PER_DOMAIN}," in text, text
    for i in ids:  # a row per loader: its requests, hit rate, epoch, progress, lookahead and id
        row = rf"^\s+{PER_DOMAIN}\s+{100 * rate(plans[i]):.2f}%\s+0\s+{PER_DOMAIN}/{PER_DOMAIN}\s.*\s{i}\s*$"
        assert re.search(row, text, re.M), text


def test_train_and_val_interleaved(slow_volume: Callable[..., SlowVolume],
                                   planning: Callable[[SlowVolume, str], None]) -> None:
    """A val batch (of 4) every 2 train batches, a new val epoch whenever the last one
    ended, for 3 train epochs: val's epoch 0 spans train epochs 0 and 1.  Each loader's
    first plan is read at the end of its epoch; the val loader's later plans replace
    only its own, never train's."""
    volume = slow_volume({"train": (4, PER_DOMAIN // 4), "val": (4, VAL // 4)})
    job = f"trainval-{os.getpid()}"
    planning(volume, job)
    train = loader_over(volume.mount.mount_point / "train", 3)
    val = loader_over(volume.mount.mount_point / "val", 4, batch=VAL_BATCH)
    ids = {"train": loader_id(train), "val": loader_id(val)}
    val_iter = iter(val)
    opens = 0
    ended: dict[str, dict[str, Any]] = {}  # each loader's first plan, read when its epoch ended
    for epoch in range(3):
        for step, (x, _) in enumerate(train):
            opens += len(x)
            time.sleep(STEP_S)
            if step % 2 == 1:
                try:
                    batch = next(val_iter)
                except StopIteration:
                    if "val" not in ended:
                        settle(volume, opens)
                        ended["val"] = plans_of(volume, job)[ids["val"]]
                    val_iter = iter(val)
                    batch = next(val_iter)
                opens += len(batch[0])
        if epoch == 0:
            settle(volume, opens)
            ended["train"] = plans_of(volume, job)[ids["train"]]
            job_counts = next(j for j in volume.client().status()["jobs"] if j["job"] == job)
    settle(volume, opens)
    now = plans_of(volume, job)
    print(f"\ntrain + val interleaved (RAM {RAM >> 20} MiB, 1 ms remote): the job in train's epoch 0 "
          f"{job_counts['hits']}/{job_counts['requests']} = {100 * job_counts['hit_rate']:.1f} %; epoch 0 per loader: " +
          ", ".join(f"{name} {p['hits']}/{p['requests']} = {100 * rate(p):.1f} %" for name, p in ended.items()))
    assert ended["train"]["epoch"] == 0 and ended["train"]["requests"] == PER_DOMAIN, ended
    assert ended["val"]["epoch"] == 0 and ended["val"]["requests"] == VAL, ended
    for p in ended.values():
        assert rate(p) >= 0.95, ended
    # 3 train epochs took 75 val batches: val is in its epoch 1, train in its epoch 2.
    assert set(now) == set(ids.values()), now
    assert now[ids["train"]]["epoch"] == 2 and now[ids["val"]]["epoch"] == 1, now
