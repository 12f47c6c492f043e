"""The workloads: a real DataLoader over a system's view of the dataset, epoch by epoch.

* raw I/O: a dataset whose ``__getitem__`` only reads the file's bytes (returns their
  count), batches of :data:`RAW_BATCH`, N workers, shuffled epochs.
* training: torchvision ``ImageFolder`` over the JPEGs, decode + RandomResizedCrop(64)
  + flip + normalise in the workers, a tiny CNN trained on CPU in this process.
* nvme (the NVMe regime): the training loop, with the page cache dropped
  before every epoch and our RAM tier a fraction of the dataset (the runner sets both).

Worker processes are persistent and started by a warm-up pass of dummy samples (index
:data:`WARMUP`, no I/O) before the first timed epoch: forking workers costs the same on
every system and is not what this benchmark measures.  Each epoch is timed from
``iter(loader)`` (which is when cube_torch plans it) to the last batch.  The same seed
gives every system the same shuffled order.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import cube_torch
from cube_torch import fastpath
from tools import torchvision_shim
from benchmarks.suite.remote import Remote, RemoteStats
from benchmarks.suite.systems import OursCubeTorch, System
from tools.harness import HarnessError, drop_page_cache
from demo.train import tiny_cnn  # the demo's model: one definition

# More workers than cores is what the 1/4/8-worker workload means to do on a small machine.
warnings.filterwarnings("ignore", message=".*worker processes in total.*")
torchvision_shim.install()  # before the first torchvision import (see its docstring)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

WARMUP = -1  # the sample index of the warm-up pass: answered without any I/O
RAW_BATCH = 16  # files per batch of the raw I/O loader: ~1.8 MB, a typical image batch
TRAIN_BATCH = 32  # samples per training batch (the demo's)
IMAGE_SIZE = 64  # RandomResizedCrop output side: a small net on CPU, as in the demo
# RandomResizedCrop keeps 50-100 % of each image's area (as demo/train.py).
CROP_SCALE = (0.5, 1.0)
LEARNING_RATE = 3e-3  # Adam, as demo/train.py
# Intra-op threads of the training process, as demo/train.py: the tiny CNN stands for a step
# that runs on an accelerator, and torch's default (one thread per core) makes the step's
# threads spin on the cores the DataLoader workers and the file system need.  Measured on
# the 2-core VM: with 2 threads the step cost 730-1,520 µs of CPU per sample from one epoch
# to the next (the same work), with 1 thread 380-480 µs, and every system ran ~25 % slower.
TORCH_THREADS = 1
# Seconds one batch may take before the run fails (a hung mount must not hang the suite).
BATCH_TIMEOUT_S = 300.0


# -- datasets and sampler -------------------------------------------------------------------


class FileBytes(Dataset[int]):
    """Sample i is file i's size, read whole from disk: I/O and nothing else."""

    def __init__(self, root: Path, files: list[str]) -> None:
        self.paths = [os.path.join(root, name) for name in files]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> int:
        if index == WARMUP:
            return 0
        with open(self.paths[index], "rb") as f:
            return len(f.read())

    def train_data_list(self) -> np.ndarray:
        """The file of every sample, for cube_torch (its contract for custom datasets)."""
        return np.asarray(self.paths)


def _warmup_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2 * IMAGE_SIZE, 2 * IMAGE_SIZE), (128, 64, 32)).save(out, "JPEG")
    return out.getvalue()


class BenchImageFolder(datasets.ImageFolder):  # type: ignore[misc]
    """torchvision's ImageFolder, plus the warm-up sample: an in-memory JPEG through the same
    decode and transforms, so the workers' one-time start-up (codec import) is paid then."""

    def __getitem__(self, index: int) -> Any:
        if index == WARMUP:
            from PIL import Image

            image = Image.open(io.BytesIO(_warmup_jpeg())).convert("RGB")
            return self.transform(image), 0
        return super().__getitem__(index)


class EpochSampler(Sampler[int]):
    """A seeded shuffle per epoch; epoch -1 is the warm-up (``warmup`` dummy samples)."""

    def __init__(self, samples: int, seed: int, warmup: int) -> None:
        self.samples = samples
        self.seed = seed
        self.warmup = warmup
        self.epoch = -1  # read by cube_torch as the epoch number (like DistributedSampler)

    def __len__(self) -> int:
        return self.warmup if self.epoch < 0 else self.samples

    def __iter__(self) -> Any:
        if self.epoch < 0:
            return iter([WARMUP] * self.warmup)
        generator = torch.Generator().manual_seed(self.seed * 1_000 + self.epoch)
        return iter(torch.randperm(self.samples, generator=generator).tolist())


# -- measurement ------------------------------------------------------------------------------


@dataclass
class EpochRecord:
    epoch: int
    samples: int
    bytes: int
    seconds: float
    samples_per_s: float
    mb_per_s: float
    loss: float | None = None
    # Our daemon's counters over the epoch (None for the other systems).
    requests: int | None = None
    hits: int | None = None
    hit_rate: float | None = None
    stall_s: float | None = None
    prefetched_blocks: int | None = None
    # Files our daemon served through cube_torch's fast path (hits and misses), not FUSE.
    fast_path_files: int | None = None
    # Block lookups our daemon's RAM and NVMe tiers answered (None for the other systems).
    ram_block_hits: int | None = None
    disk_block_hits: int | None = None
    # The daemon process (ours, rclone, JuiceFS), None for local and raw remote.
    daemon_cpu_s: float | None = None
    daemon_peak_rss_bytes: int | None = None
    # What reached the emulated remote during the epoch (None for local).
    remote_ops: int | None = None
    remote_reads: int | None = None
    remote_bytes: int | None = None
    remote_mean_delay_us: float | None = None
    # CPU seconds the emulator itself spent: on this one machine it competes for the cores.
    remote_cpu_s: float | None = None
    ratio_to_local: float | None = None  # filled in by the report

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    workload: str
    system: str
    latency_us: float | None
    workers: int
    cache_fraction: float | None
    drop_page_cache_each_epoch: bool
    ram_fraction: float | None = None  # our RAM tier alone, as a fraction of the dataset (nvme)
    setup_s: float = 0.0  # dataset construction (listing) on the system
    warmup_s: float = 0.0  # starting the persistent workers
    epochs: list[EpochRecord] = field(default_factory=list)
    error: str | None = None
    # Stopping the system after the epochs failed (e.g. a daemon slow to exit): the
    # epochs still count, unlike with ``error``.
    stop_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["epochs"] = [e.to_json() for e in self.epochs]
        return out


def _counter(sample: dict[str, float] | None, name: str) -> float:
    return sample.get(name, 0.0) if sample is not None else 0.0


class Meter:
    """Snapshots of the daemon and the remote around one epoch."""

    def __init__(self, system: System, remote: Remote | None) -> None:
        self.system = system
        self.remote = remote

    def snapshot(self) -> tuple[dict[str, float] | None, float, RemoteStats | None, float]:
        pids = self.system.pids()
        remote = self.remote
        return (self.system.counters(), _cpu(pids), remote.stats() if remote is not None else None,
                _cpu([remote.pid]) if remote is not None else 0.0)

    def record(self, record: EpochRecord,
               before: tuple[dict[str, float] | None, float, RemoteStats | None, float]) -> None:
        counters, cpu, remote, remote_cpu = self.snapshot()
        if counters is not None:
            old = before[0]

            def d(name: str) -> float:
                return _counter(counters, name) - _counter(old, name)

            record.requests = int(d("cubefs_fuse_file_requests_total"))
            record.hits = int(d("cubefs_fuse_file_hits_total"))
            record.hit_rate = record.hits / record.requests if record.requests else None
            record.stall_s = d("cubefs_fuse_stall_seconds_total")
            record.prefetched_blocks = int(d("cubefs_fuse_prefetch_issued_total"))
            record.fast_path_files = int(d('cubefs_fuse_fastpath_files_total{result="hit"}')
                                         + d('cubefs_fuse_fastpath_files_total{result="miss"}'))
            record.ram_block_hits = int(d('cubefs_fuse_cache_hits_total{tier="ram"}'))
            record.disk_block_hits = int(d('cubefs_fuse_cache_hits_total{tier="disk"}'))
        pids = self.system.pids()
        if pids:
            record.daemon_cpu_s = cpu - before[1]
            from benchmarks.suite.systems import peak_rss_bytes

            record.daemon_peak_rss_bytes = peak_rss_bytes(pids)
        if remote is not None and before[2] is not None:
            delta = remote.minus(before[2])
            record.remote_ops, record.remote_reads, record.remote_bytes = delta.ops, delta.reads, delta.bytes
            record.remote_mean_delay_us = delta.mean_delay_us if delta.delays else None
            record.remote_cpu_s = remote_cpu - before[3]


def _cpu(pids: list[int]) -> float:
    from benchmarks.suite.systems import cpu_seconds

    return cpu_seconds(pids) if pids else 0.0


def _shutdown(loader: DataLoader[Any] | None) -> None:
    """Stop a loader's persistent workers now (not whenever it is collected)."""
    iterator: Any = getattr(loader, "_iterator", None) if loader is not None else None
    if iterator is not None:
        iterator._shutdown_workers()


def run_epochs(result: RunResult, system: System, root: Path, remote: Remote | None, *, files: list[str],
               total_bytes: int, epochs: int, seed: int,
               on_epoch: Callable[[EpochRecord], None]) -> None:
    """Run ``result.workload`` for ``epochs`` on ``root``; records go into ``result``."""
    planned = isinstance(system, OursCubeTorch)
    if planned:
        cube_torch.install()
    else:
        cube_torch.uninstall()  # "without cube_torch": not even the idle patch
    os.environ.pop("VOL_NAME", None)  # the warm-up pass must not be planned
    training = result.workload in ("training", "nvme")  # nvme: the same loop, other caches
    started = time.perf_counter()
    dataset: Dataset[Any]
    if training:
        dataset = BenchImageFolder(str(root), transform=transforms.Compose([
            transforms.RandomResizedCrop(IMAGE_SIZE, scale=CROP_SCALE),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5] * 3, [0.25] * 3),  # about the data's mean and spread
        ]))
        batch = TRAIN_BATCH
        samples = len(dataset.samples)
        classes = len(dataset.classes)
    else:
        raw = system.raw_dataset(files)
        dataset = raw if raw is not None else FileBytes(root, files)
        batch = RAW_BATCH
        samples = len(files)
        classes = 0
    if samples != len(files):
        raise HarnessError(f"{system.name}: the dataset lists {samples} files, expected {len(files)}")
    result.setup_s = time.perf_counter() - started
    workers = result.workers
    sampler = EpochSampler(samples, seed, warmup=workers * batch)  # one batch per worker
    torch.manual_seed(seed)
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers,
                                         persistent_workers=True, timeout=BATCH_TIMEOUT_S)
    model = tiny_cnn(classes) if training else None
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE) if model is not None else None
    meter = Meter(system, remote)
    threads = torch.get_num_threads()
    if training:
        torch.set_num_threads(TORCH_THREADS)
    try:
        started = time.perf_counter()
        for item in loader:
            if model is not None:  # the first forward/backward pass allocates: not in epoch 1
                images, _labels = item
                model(images).sum().backward()
                model.zero_grad()
        result.warmup_s = time.perf_counter() - started
        if planned:
            assert isinstance(system, OursCubeTorch)
            os.environ["VOL_NAME"] = system.vol_name
            if not system.fast_path:  # read in the workers, which the loader starts per epoch
                os.environ[fastpath.ENV_SWITCH] = "0"
        for epoch in range(epochs):
            sampler.epoch = epoch
            if epoch == 0 or result.drop_page_cache_each_epoch:
                drop_page_cache()
            before = meter.snapshot()
            count = nbytes = 0
            loss_sum = 0.0
            started = time.perf_counter()
            for item in loader:
                if model is not None and optimizer is not None:
                    images, labels = item
                    optimizer.zero_grad()
                    loss = nn.functional.cross_entropy(model(images), labels)
                    loss.backward()  # type: ignore[no-untyped-call]
                    optimizer.step()
                    count += len(labels)
                    loss_sum += float(loss.item()) * len(labels)
                else:
                    count += len(item)
                    nbytes += int(item.sum())
            seconds = time.perf_counter() - started
            if training:
                nbytes = total_bytes  # every file once (checked by the count below)
            if count != samples or nbytes != total_bytes:
                raise HarnessError(f"{system.name}: epoch {epoch} read {count} samples / {nbytes} bytes, "
                                   f"expected {samples} / {total_bytes}")
            record = EpochRecord(epoch, count, nbytes, seconds, count / seconds, nbytes / seconds / 1e6,
                                 loss=loss_sum / count if training else None)
            meter.record(record, before)
            result.epochs.append(record)
            on_epoch(record)
    finally:
        torch.set_num_threads(threads)
        os.environ.pop("VOL_NAME", None)
        os.environ.pop(fastpath.ENV_SWITCH, None)
        _shutdown(loader)
