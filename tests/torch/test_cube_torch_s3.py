"""cube_torch over an ``s3://`` source: a real SeaweedFS bucket (tests/s3_servers.py), a
real daemon and FUSE mount, real DataLoader worker processes.

* An ImageFolder over the mount, trained for 2 epochs with 2 workers, ``import cube_torch``
  and ``VOL_NAME`` set: the bucket sits behind the delaying proxy (tools/s3_proxy.py,
  10 ms per request, a remote object store's order of latency), which records every
  request.  The daemon fetches the objects in the order of the plan cube_torch submitted
  (the order of the GETs at the proxy), before the workers open them (the daemon counts
  the epoch's opens as hits, none of their reads waiting on the bucket, all but at most
  the workers' first batches), each object once (epoch 2 sends the bucket nothing), and
  every sample's bytes are the object's.
* The processed-sample cache (``CachedDataset``, the daemon's store) over such a mount:
  the same tensors as the pipeline without it, each sample computed once, its files
  fetched from the bucket once.
"""

from __future__ import annotations

import io
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

import cube_torch
from tests.helpers import Mount, metric, wait_until
from tests.s3_servers import SeaweedS3, s3_env, s3_server  # noqa: F401 -- the fixtures
from tests.sample_pipeline import (DECODE_RESIZE, TTL, CountingFolder, assert_same, augment, cache_counts, computed,
                                   epochs, loader, reference, sample_images, status)
from tests.torch_datasets import capture_wire, keep
from tools.s3_proxy import S3Proxy

IMAGES, CLASSES = 96, 4
DELAY = 0.010  # seconds the proxy adds to every request: a remote object store's order
# Seconds of work per sample in the workers (decode and augmentation of a real image):
# the time during which the daemon's prefetch runs ahead of the readers.
STEP = 0.010
# The first batch of each worker is asked for as soon as the plan is submitted, before
# its objects can have come (2 workers x batch of 4): those may wait on the bucket.
EARLY = 2 * 4
# Spearman's rank correlation between the plan's order and the order of the GETs the
# bucket saw: 1 is the same order, ~0 an unrelated one (a listing's, a random one); the
# daemon's concurrent fetches (prefetchThreads) only swap neighbours.
MIN_ORDER_CORRELATION = 0.8


def jpeg(rng: np.random.Generator, side: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def read_object(path: str) -> bytes:
    """ImageFolder's loader: the file's bytes (with cube_torch's fast path, as the daemon
    served them to the worker)."""
    with open(path, "rb") as f:
        return f.read()


def decode(data: bytes) -> tuple[bytes, torch.Tensor]:
    """The sample: the bytes read and the decoded image, after a training step's worth of work."""
    time.sleep(STEP)  # the work the prefetch overlaps with, not a wait for a condition
    with Image.open(io.BytesIO(data)) as image:
        return data, transforms.PILToTensor()(image.convert("RGB"))


def object_gets(proxy: S3Proxy, bucket: str, start: int, end: int | None = None) -> list[str]:
    """Keys of the object GETs the bucket saw among requests [start, end), in order of arrival
    (a listing is a GET of the bucket itself, with a query)."""
    prefix = f"/{bucket}/"
    return [r.path[len(prefix):] for r in proxy.requests[start:end]
            if r.method == "GET" and r.path.startswith(prefix) and len(r.path) > len(prefix) and "?" not in r.path]


def spearman(first: list[str], second: list[str]) -> float:
    """Rank correlation of two orders of the same items."""
    n = len(first)
    rank = {item: i for i, item in enumerate(second)}
    return 1 - 6 * sum((i - rank[item]) ** 2 for i, item in enumerate(first)) / (n * (n * n - 1))


def test_imagefolder_over_a_bucket_is_prefetched_in_plan_order(
        make_mount: Callable[..., Mount], s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    rng = np.random.default_rng(31)
    objects = {f"ds/train/c{i % CLASSES}/img{i:03d}.jpg": jpeg(rng, 24 + i % 16) for i in range(IMAGES)}
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    with S3Proxy(s3_env.s3_port, delay=DELAY) as proxy:
        m = make_mount(source=f"s3://{bucket}/ds", s3Endpoint=proxy.endpoint, profile="ai_prefetch",
                       memCacheSize="16MiB", diskCacheSize="16MiB")
        m.mount()
        wire = capture_wire(monkeypatch)
        monkeypatch.setenv("VOL_NAME", m.config()["volName"])
        monkeypatch.setenv("CUBE_TORCH_JOB", f"s3-imagefolder-{os.getpid()}")
        cube_torch.install()
        dataset = datasets.ImageFolder(str(m.path("train")), loader=read_object, transform=decode)
        assert len(dataset) == IMAGES and dataset.classes == [f"c{k}" for k in range(CLASSES)]
        train = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=keep,
                           generator=torch.Generator().manual_seed(5))
        label = {f"ds/train/{dataset.classes[t]}/{os.path.basename(p)}": t for p, t in dataset.samples}
        seen: list[tuple[int, int, int]] = []  # per epoch: (file requests, hits, first request at the proxy)
        for epoch in range(2):
            before = m.scrape()
            first_request = len(proxy.requests)
            got = [sample for batch in train for sample in batch]
            # Every object once, its bytes exactly, with its class's label.
            by_bytes = {data: key for key, data in objects.items()}
            assert Counter(by_bytes[data] for (data, _), _ in got) == Counter(objects.keys())
            for (data, pixels), target in got:
                assert target == label[by_bytes[data]] and pixels.shape == (3, *Image.open(io.BytesIO(data)).size)
            wait_until(lambda: metric(m.scrape(), "cubefs_fuse_file_requests_total")
                       - metric(before, "cubefs_fuse_file_requests_total") >= IMAGES,
                       what="the daemon to count the epoch's opens")
            after = m.scrape()
            seen.append((int(metric(after, "cubefs_fuse_file_requests_total")
                             - metric(before, "cubefs_fuse_file_requests_total")),
                         int(metric(after, "cubefs_fuse_file_hits_total") - metric(before, "cubefs_fuse_file_hits_total")),
                         first_request))
        (requests0, hits0, start0), (requests1, hits1, start1) = seen
        plans = [p for p in wire.plans if p.job == f"s3-imagefolder-{os.getpid()}"]
        assert [p.epoch for p in plans] == [0, 1]
        planned = ["ds/" + path for path in wire.paths(plans[0])]
        fetched = object_gets(proxy, bucket, start0, start1)
        # Epoch 1: each planned object fetched once, in the plan's order, ahead of its open.
        assert sorted(fetched) == sorted(objects)
        assert spearman(fetched, planned) >= MIN_ORDER_CORRELATION, (fetched, planned)
        assert requests0 == IMAGES and hits0 >= IMAGES - EARLY, seen
        assert metric(m.scrape(), "cubefs_fuse_prefetch_issued_total") >= IMAGES - EARLY
        # Epoch 2: all from the cache; the bucket saw no request at all.
        assert (requests1, hits1) == (IMAGES, IMAGES), seen
        assert proxy.requests[start1:] == []
        m.umount()
    assert {r.method for r in proxy.requests} <= {"GET", "HEAD"}


def test_the_sample_cache_over_a_bucket(make_mount: Callable[..., Mount], s3_env: SeaweedS3,  # noqa: F811
                                        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CachedDataset (the daemon's store) over an ImageFolder of a bucket, 2 epochs with 2
    workers: the tensors of the same pipeline without the cache, each sample computed once
    (epoch 2 all hits in the daemon's store), each object fetched from the bucket once."""
    bucket = s3_env.new_bucket()
    client = s3_env.client()
    images = sample_images()
    for key, data in images.items():
        client.put_object(Bucket=bucket, Key=f"data/{key}", Body=data)
    m = make_mount(source=f"s3://{bucket}/data", s3Endpoint=s3_env.endpoint, profile="ai_prefetch",
                   attrValid=TTL, lookupValid=TTL, sampleCacheMemSize="16MiB", sampleCacheDiskSize="64MiB")
    m.mount()
    monkeypatch.setenv("VOL_NAME", m.config()["volName"])
    cube_torch.install()
    wait_until(lambda: bool(status(m)["loaded"]), what="the sample store's start-up scan")
    root = m.path("train")
    counts = tmp_path / "computed"
    name = f"s3-decoded-{os.getpid()}"
    cached: Any = cube_torch.CachedDataset(CountingFolder(root, counts, DECODE_RESIZE), name=name, transform=augment)
    got = epochs(loader(cached), 2)
    assert sorted(computed(counts)) == list(range(len(images)))  # epoch 1 computed each sample once, 2 none
    assert metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total") == sum(map(len, images.values()))
    assert cache_counts(m, name)["hits"] >= len(images)
    assert_same(got, reference(root, 2))
    m.umount()
