"""What the processed-sample cache's mounted torch tests share (tests/torch/test_sample_*.py).

The pipeline under test: an ImageFolder whose ``base[i]`` (decode + resize: the cached,
deterministic part) is counted per computed index across the DataLoader's worker
processes, RandomCrop and a flip after the cache; a volume of small JPEGs served by a
real ``ai_prefetch`` mount with ``$VOL_NAME`` set; loaders and epochs seeded so that the
same pipeline without the cache gives the same tensors.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

from cube_torch import fastpath
from tests.helpers import Mount, cli, force_unmount, free_port, wait_until

SEED = 1234
FILES, CLASSES = 24, 3
SIDE, CROP = 40, 32  # resized (cached) side, random crop after the cache
WORKERS, BATCH = 2, 4
TTL = 0.2  # the mount's attrValid/lookupValid: a changed source file is seen this soon


class CountingFolder(datasets.ImageFolder):  # type: ignore[misc]
    """An ImageFolder that appends each computed index to a file (workers are processes),
    and whether cube_torch's fast path had the batch's files served (its open hook active)."""

    def __init__(self, root: Path, counts: Path, transform: Any) -> None:
        super().__init__(str(root), transform=transform)
        self.counts = str(counts)

    def __getitem__(self, index: int) -> Any:
        fd = os.open(self.counts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{index} {int(builtins.open is fastpath._hooked_open)}\n".encode())
        finally:
            os.close(fd)
        return super().__getitem__(index)


def computed(counts: Path) -> list[int]:
    return [int(line.split()[0]) for line in counts.read_text().splitlines()] if counts.exists() else []


def served_by_fast_path(counts: Path) -> int:
    return sum(int(line.split()[1]) for line in counts.read_text().splitlines())


DECODE_RESIZE = transforms.Resize((SIDE, SIDE))
AUGMENT = transforms.Compose([transforms.RandomCrop(CROP), transforms.RandomHorizontalFlip(), transforms.ToTensor()])


def augment(sample: Any) -> Any:
    image, label = sample
    return AUGMENT(image), label


def sample_images() -> dict[str, bytes]:
    """The volume's files: FILES JPEGs of noise (of FILES different heights) in CLASSES class
    folders under ``train/``, by path."""
    rng = np.random.default_rng(7)
    images = {}
    for i in range(FILES):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(48 + i, 56, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
        images[f"train/class{i % CLASSES}/img{i:03d}.jpg"] = out.getvalue()
    return images


def sample_volume(tmp_path_factory: pytest.TempPathFactory, config: dict[str, Any]) -> Iterator[tuple[Mount, str]]:
    """A module's volume: :func:`sample_images`, mounted with
    ``"profile": "ai_prefetch"`` plus ``config``, ``VOL_NAME`` set while it is mounted."""
    base = tmp_path_factory.mktemp("sample_cache_volume")
    port = free_port()
    name = f"samples{port}"
    m = Mount(base, base / "source", base / "mnt", base / "cache", base / "client.json", port,
              {"profile": "ai_prefetch", "volName": name, "attrValid": TTL, "lookupValid": TTL, **config})
    for d in (m.source, m.mount_point):
        d.mkdir(parents=True)
    for path, data in sample_images().items():
        (m.source / path).parent.mkdir(parents=True, exist_ok=True)
        (m.source / path).write_bytes(data)
    os.environ["VOL_NAME"] = name
    try:
        m.mount()
        yield m, name
        m.umount()
    finally:
        os.environ.pop("VOL_NAME", None)
        force_unmount(m)


def status(mount: Mount) -> dict[str, Any]:
    """The daemon's samples section of ``cubefs-fuse status --json``."""
    result = cli("status", str(mount.mount_point), "--json")
    assert result.returncode == 0, result.stderr
    samples: dict[str, Any] = json.loads(result.stdout)[0]["samples"]
    return samples


def cache_counts(mount: Mount, name: str) -> dict[str, int]:
    """Entries, hits and misses of one of this uid's sample caches, as the daemon counts them."""
    for cache in status(mount)["caches"]:
        if cache["name"] == name and cache["owner"] == os.geteuid():
            return {k: int(cache[k]) for k in ("entries", "hits", "misses")}
    return {"entries": 0, "hits": 0, "misses": 0}


def loader(dataset: Any, *, sampler: Any = None, persistent: bool = False) -> DataLoader[Any]:
    g = torch.Generator()
    g.manual_seed(SEED)
    return DataLoader(dataset, batch_size=BATCH, shuffle=sampler is None, sampler=sampler, num_workers=WORKERS,
                      generator=g, persistent_workers=persistent)


def epochs(dl: DataLoader[Any], n: int, sampler: Any = None) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    out = []
    for epoch in range(n):
        if sampler is not None:
            sampler.set_epoch(epoch)
        torch.manual_seed(SEED + epoch)
        out.append([(x.clone(), y.clone()) for x, y in dl])
    return out


def reference(root: Path, n: int, sampler: Any = None, persistent: bool = False
              ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The same pipeline without the cache (same seeds, same worker setup)."""
    plain = datasets.ImageFolder(str(root), transform=transforms.Compose([DECODE_RESIZE, AUGMENT]))
    return epochs(loader(plain, sampler=sampler, persistent=persistent), n, sampler)



def assert_same(got: list[list[tuple[torch.Tensor, torch.Tensor]]],
                want: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    assert len(got) == len(want)
    for epoch, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), epoch
        for (gx, gy), (wx, wy) in zip(g, w):
            assert torch.equal(gx, wx) and torch.equal(gy, wy), f"epoch {epoch} differs"


def two_ranks_share(root: Path, tmp_path: Path, cached: Callable[[Path, str], Any],
                    after_epoch_0: Callable[[str], None] = lambda name: None) -> str:
    """Two DistributedSampler ranks, each its own CachedDataset (``cached(counts, name)``)
    on one store under one name, two epochs: each rank's samples are the unwrapped
    pipeline's; in epoch 1 every sample is a hit, half of them the other rank's; every
    sample was computed once.  ``after_epoch_0(name)`` runs between the epochs (a store
    whose writes must be in first).  Returns the cache's name."""
    # A DistributedSampler takes only len() of its dataset: a range stands for it (its
    # annotation asks for a Dataset).
    indices: Any = range(FILES)
    samplers: list[DistributedSampler[Any]] = [
        DistributedSampler(indices, num_replicas=2, rank=r, shuffle=True, seed=SEED) for r in (0, 1)]
    want = [reference(root, 2, DistributedSampler(indices, num_replicas=2, rank=r, shuffle=True, seed=SEED))
            for r in (0, 1)]
    counts = [tmp_path / "rank0", tmp_path / "rank1"]
    name = f"ranks-{time.monotonic_ns()}"
    loaders = [loader(cached(counts[r], name), sampler=samplers[r]) for r in (0, 1)]
    got: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = [[], []]
    seen: list[list[set[int]]] = [[], []]
    for epoch in range(2):
        for r in (0, 1):
            samplers[r].set_epoch(epoch)
            seen[r].append(set(samplers[r]))
            before = len(computed(counts[r]))
            torch.manual_seed(SEED + epoch)
            got[r].append([(x.clone(), y.clone()) for x, y in loaders[r]])
            if epoch == 1:
                assert len(computed(counts[r])) == before  # every sample a hit, half of them the other rank's
        if epoch == 0:
            after_epoch_0(name)
    for r in (0, 1):
        assert_same(got[r], want[r])
        assert seen[r][1] & seen[1 - r][0], "the ranks' second epochs should reuse the other rank's samples"
    assert sorted(computed(counts[0]) + computed(counts[1])) == list(range(FILES))
    return name


def assert_a_changed_file_is_recomputed(mount: Mount, root: Path, ds: Any, counts: Path) -> None:
    """``ds`` (a CachedDataset over ``root`` in ``mount``, its computations counted in
    ``counts``) has stored every sample: sample 5's source file is replaced; the next
    epoch computes that sample alone, and gives the new image, not the cached old one."""
    target = ds.base.samples[5][0]
    source = mount.source / os.path.relpath(target, mount.mount_point)
    Image.fromarray(np.full((30, 30, 3), 200, dtype=np.uint8)).save(source, format="JPEG")
    wait_until_seen(target, source)
    counts.unlink()
    got = epochs(loader(ds), 1)
    assert computed(counts) == [5]
    assert_same(got, reference(root, 1))


@pytest.fixture
def worker_log(tmp_path: Path) -> Iterator[Path]:
    """cube_torch's log lines of this process and its (forked) workers, in a file."""
    path = tmp_path / "cube_torch.log"
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("cube_torch")
    logger.addHandler(handler)
    yield path
    logger.removeHandler(handler)
    handler.close()


def warning_lines(log: Path) -> list[str]:
    text = log.read_text() if log.exists() else ""
    return [line for line in text.splitlines() if "sample cache" in line and "store failed" in line]


def wait_until_seen(mounted: str | Path, source: Path) -> None:
    """Wait until the mount shows ``source``'s new version (size and mtime), which it does
    once the old attributes expire (``attrValid``, TTL)."""
    def seen() -> bool:
        got, want = os.stat(mounted), source.stat()
        return got.st_size == want.st_size and got.st_mtime_ns == want.st_mtime_ns

    wait_until(seen, what=f"the mount to show the new {source.name}")
