"""The datasets, samplers, file tree and control-traffic capture the cube_torch tests share (tests/unit/test_cube_torch_unit.py
without a daemon, tests/torch/ over a real mount): every dataset kind cube_torch supports,
built over a tree that :func:`populate` writes."""

from __future__ import annotations

import json
import os
import random
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import ConcatDataset, Dataset, Subset

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

from cube_torch.client import PlanRequest, submitter  # noqa: E402
from cubefs_fuse.control.protocol import ControlClient  # noqa: E402

IMAGE = 8  # JPEG side in pixels: tiny, collatable, still decoded by PIL


# -- the tree: every dataset kind ----------------------------------------------------------


def write_jpeg(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    Image.new("RGB", (IMAGE, IMAGE), (rng.randrange(256), rng.randrange(256), rng.randrange(256))).save(path)


def populate(root: Path) -> None:
    """ImageFolder (24), DatasetFolder (20), VOC (12 x image + XML), COCO (12 + JSON),
    a 1-D list (20) and a 2-D list (12 x image + caption)."""
    for c, name in enumerate(("cat", "dog")):
        for i in range(12):
            write_jpeg(root / "imagefolder" / name / f"{i:02d}.jpg", 100 * c + i)
    for c, name in enumerate(("a", "b")):
        folder = root / "datasetfolder" / name
        folder.mkdir(parents=True)
        for i in range(10):
            (folder / f"{i:02d}.bin").write_bytes(bytes([c, i]) * (i + 1))
    voc = root / "voc" / "VOCdevkit" / "VOC2012"
    names = [f"2012_{i:06d}" for i in range(12)]
    for i, name in enumerate(names):
        write_jpeg(voc / "JPEGImages" / f"{name}.jpg", 1000 + i)
        (voc / "Annotations").mkdir(parents=True, exist_ok=True)
        (voc / "Annotations" / f"{name}.xml").write_text(
            f"<annotation><filename>{name}.jpg</filename><object><name>obj{i % 3}</name>"
            f"<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>{i + 2}</xmax><ymax>5</ymax></bndbox>"
            "</object></annotation>")
    (voc / "ImageSets" / "Main").mkdir(parents=True)
    (voc / "ImageSets" / "Main" / "train.txt").write_text("\n".join(names) + "\n")
    # COCO: image ids that are neither contiguous nor in file-name order, so that a mapping
    # from the sample index (or the id) straight to a file name would read the wrong file.
    ids = random.Random(3).sample(range(100, 999), 12)
    images = [{"id": image_id, "file_name": f"img_{k:02d}.jpg", "width": IMAGE, "height": IMAGE}
              for k, image_id in enumerate(ids)]
    for k in range(12):
        write_jpeg(root / "coco" / "images" / f"img_{k:02d}.jpg", 2000 + k)
    annotations = [{"id": n + 1, "image_id": image_id, "category_id": 1, "bbox": [0, 0, 2, 2], "area": 4,
                    "iscrowd": 0} for n, image_id in enumerate(ids)]
    (root / "coco" / "annotations.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}]}))
    for i in range(20):
        path = root / "list1d" / f"{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"sample {i}\n")
    for i in range(12):
        write_jpeg(root / "list2d" / "img" / f"{i:02d}.jpg", 3000 + i)
        (root / "list2d" / "cap").mkdir(parents=True, exist_ok=True)
        (root / "list2d" / "cap" / f"{i:02d}.txt").write_text(f"caption {i}")
    # Images read with PIL and captions (token tensors) with torch.load.
    import torch

    for i in range(12):
        write_jpeg(root / "listpt" / "img" / f"{i:02d}.jpg", 4000 + i)
        (root / "listpt" / "cap").mkdir(parents=True, exist_ok=True)
        torch.save(torch.arange(i, i + 5 + i), root / "listpt" / "cap" / f"{i:02d}.pt")


# -- datasets ------------------------------------------------------------------------------


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class ListDataset(Dataset[bytes]):
    """A custom dataset: ``train_data_list()`` is a 1-D array of paths."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def train_data_list(self) -> np.ndarray:
        return np.array(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> bytes:
        return read_bytes(self.paths[i])


class PairDataset(Dataset[tuple[bytes, str]]):
    """A custom dataset: ``train_data_list()`` is a 2-D array (images, captions)."""

    def __init__(self, images: list[str], captions: list[str]) -> None:
        self.images, self.captions = images, captions

    def train_data_list(self) -> np.ndarray:
        return np.array([self.images, self.captions])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[bytes, str]:
        return read_bytes(self.images[i]), read_bytes(self.captions[i]).decode()


class RowsDataset(PairDataset):
    """``train_data_list()`` as N rows of (image, caption): os.PathLike and bytes paths."""

    def train_data_list(self) -> list[tuple[Path, bytes]]:  # type: ignore[override]
        return [(Path(image), os.fsencode(caption)) for image, caption in zip(self.images, self.captions)]


class PilTorchDataset(PairDataset):
    """``train_data_list()`` of (image, caption): images opened by PIL from their path,
    captions by ``torch.load`` from theirs (the loading code a fast path must serve)."""

    def __getitem__(self, i: int) -> Any:
        import torch
        from PIL import Image

        with Image.open(self.images[i]) as image:
            pixels = transforms.PILToTensor()(image.convert("RGB"))
        return pixels, torch.load(self.captions[i])


class CLevelDataset(ListDataset):
    """A loader that opens its files from C, as OpenCV does: ``os.open`` and ``mmap``."""

    def __getitem__(self, i: int) -> bytes:
        import mmap

        fd = os.open(self.paths[i], os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
                return bytes(mapped)
        finally:
            os.close(fd)


def make_dataset(kind: str, root: Path) -> Dataset[Any]:
    to_tensor = transforms.PILToTensor()
    vision: Dataset[Any]  # torchvision's datasets (untyped)
    if kind == "imagefolder":
        vision = datasets.ImageFolder(str(root / "imagefolder"), transform=to_tensor)
        return vision
    if kind == "datasetfolder":
        vision = datasets.DatasetFolder(str(root / "datasetfolder"), loader=read_bytes, extensions=(".bin",))
        return vision
    if kind == "voc":
        vision = datasets.VOCDetection(str(root / "voc"), year="2012", image_set="train", transform=to_tensor)
        return vision
    if kind == "coco":
        vision = datasets.CocoDetection(str(root / "coco" / "images"), str(root / "coco" / "annotations.json"),
                                        transform=to_tensor)
        return vision
    if kind == "list1d":
        return ListDataset(sorted(str(p) for p in (root / "list1d").iterdir()))
    if kind == "pilpt":
        return PilTorchDataset(sorted(str(p) for p in (root / "listpt" / "img").iterdir()),
                               sorted(str(p) for p in (root / "listpt" / "cap").iterdir()))
    if kind == "clevel":
        return CLevelDataset(sorted(str(p) for p in (root / "imagefolder" / "cat").iterdir()))
    if kind in ("list2d", "rows2d"):
        pair = PairDataset if kind == "list2d" else RowsDataset
        return pair(sorted(str(p) for p in (root / "list2d" / "img").iterdir()),
                    sorted(str(p) for p in (root / "list2d" / "cap").iterdir()))
    raise AssertionError(kind)


def wrap(dataset: Dataset[Any], wrapper: str, root: Path) -> Dataset[Any]:
    n = len(dataset)  # type: ignore[arg-type]
    if wrapper == "plain":
        return dataset
    if wrapper == "subset":
        return Subset(dataset, random.Random(5).sample(range(n), n - 3))
    if wrapper == "nested":  # a reversed view, then a pick with a repeated index
        inner = Subset(dataset, list(range(n - 1, -1, -1)))
        return Subset(inner, [0, 2, 2, 5, 1, 7, 3, 8, 4, 6])
    if wrapper == "concat":
        return ConcatDataset([dataset, make_dataset("list1d", root)])
    raise AssertionError(wrapper)


# -- loaders and samples ---------------------------------------------------------------------


def keep(batch: Any) -> Any:
    """collate_fn: the samples as they are (VOC/COCO targets do not collate)."""
    return batch


class RepeatingBatchSampler:
    """A custom batch_sampler: uneven batches, some indices twice, a new draw each epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.rng = n, random.Random(seed)
        self.sizes = [3, 1, 4, 2, 5]

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[list[int]]:
        for size in self.sizes:
            batch = [self.rng.randrange(self.n) for _ in range(size)]
            if size > 2:
                batch[-1] = batch[0]  # the same sample twice in one batch
            yield batch


def canon(obj: Any) -> Any:
    """A comparable, exact form of a sample (tensors, images, nested targets)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype), obj.numpy().tobytes())
    if isinstance(obj, Image.Image):
        return ("image", obj.size, obj.mode, obj.tobytes())
    if isinstance(obj, dict):
        return ("dict", tuple((k, canon(obj[k])) for k in sorted(obj)))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(canon(x) for x in obj))
    return obj


# -- the hit-rate line cube_torch prints ------------------------------------------------------

# A distributed job's line starts with "[rank R] " (non-capturing: the groups stay 1-10).
LINE = re.compile(
    r"(?:\[rank \d+\] )?user memory last_cycle_metrics:\(\[request_count:(\d+) hit_count:(\d+) miss_count:(\d+) "
    r"hit_rate:(\d+\.\d\d)% miss_rate:(\d+\.\d\d)% \]\)  "
    r"sum_metrics:\(\[request_count:(\d+) hit_count:(\d+) miss_count:(\d+) "
    r"hit_rate:(\d+\.\d\d)% miss_rate:(\d+\.\d\d)%\]\)")


# -- what cube_torch sends --------------------------------------------------------------------


@dataclass
class SentPlan:
    job: str
    rank: int
    epoch: int
    dataset: str
    order: np.ndarray


@dataclass
class Wire:
    """Every dataset list and plan cube_torch sent, as sent."""

    datasets: dict[str, list[str]] = field(default_factory=dict)
    registrations: int = 0
    plans: list[SentPlan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def paths(self, plan: SentPlan) -> list[str]:
        listed = self.datasets[plan.dataset]
        return [listed[i] for i in plan.order.tolist()]


def capture_wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    """Wrap this process's ControlClient (where cube_torch's submitter thread runs) so that
    every dataset list and plan it sends is captured, and make each submission complete
    before the epoch's first sample is handed out (the daemon's counters are then exact)."""
    captured = Wire()
    register, submit_plan = ControlClient.register_dataset, ControlClient.submit_plan

    def register_dataset(self: ControlClient, paths: list[str], columns: int = 1) -> str:
        dataset_id = register(self, paths, columns)
        with captured.lock:
            captured.datasets[dataset_id] = list(paths)
            captured.registrations += 1
        return dataset_id

    def plan(self: ControlClient, job: str, rank: int, epoch: int, dataset: str, order: bytes,
             dtype: str, loader: str | None = None, first: int = 0) -> dict[str, Any]:
        result = submit_plan(self, job, rank, epoch, dataset, order, dtype, loader, first)
        with captured.lock:
            captured.plans.append(SentPlan(job, rank, epoch, dataset, np.frombuffer(order, dtype=dtype).copy()))
        return result

    monkeypatch.setattr(ControlClient, "register_dataset", register_dataset)
    monkeypatch.setattr(ControlClient, "submit_plan", plan)
    asynchronous = submitter.submit

    def synchronous(request: PlanRequest) -> None:
        asynchronous(request)
        assert submitter.wait_idle(30), "cube_torch's submitter did not finish"

    monkeypatch.setattr(submitter, "submit", synchronous)
    return captured
