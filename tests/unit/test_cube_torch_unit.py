"""cube_torch without a daemon: the patch, the exact epoch order, the index -> files mapping,
the config-file checks and the hit-rate line.  Real DataLoaders (with real worker
processes where it matters); plans are captured at ``submitter.submit`` instead of sent.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (ConcatDataset, DataLoader, Dataset, DistributedSampler, IterableDataset,
                              RandomSampler, Sampler)

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

import cube_torch
from cube_torch import client as ct_client
from cube_torch import patch, progress, reporter
from cube_torch.client import PlanRequest, _collect, _file_order
from cube_torch.files import Unsupported, relative_to_mount, sample_files
from cubefs_fuse.control.protocol import PROTOCOL_VERSION, ProtocolError, read_volume_config
from tests.helpers import REPO, free_port, owned_by_another_user, write_volume_config
from tests.torch_datasets import (LINE, ListDataset, PairDataset, RepeatingBatchSampler, canon, keep, make_dataset,
                                  populate, wrap)


# -- torchvision on CPU torch --------------------------------------------------------------


def test_torchvision_datasets_and_transforms_work_with_the_shim(tmp_path: Path) -> None:
    from PIL import Image

    assert tests.torchvision_shim.LIBRARY is not None or hasattr(torch.ops.torchvision, "nms")
    for c, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        for i in range(3):
            Image.new("RGB", (10, 6), (80 * c, 40 * i, 7)).save(tmp_path / name / f"{i}.jpg")
    pipeline = transforms.Compose([transforms.Resize((4, 4)), transforms.ToTensor(),
                                   transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    folder = datasets.ImageFolder(str(tmp_path), transform=pipeline)
    assert folder.classes == ["a", "b"] and len(folder) == 6
    image, label = folder[4]
    assert image.shape == (3, 4, 4) and image.dtype == torch.float32 and label == 1
    assert -1.0 <= float(image.min()) <= float(image.max()) <= 1.0
    batch, labels = next(iter(DataLoader(folder, batch_size=6)))
    assert batch.shape == (6, 3, 4, 4) and labels.tolist() == [0, 0, 0, 1, 1, 1]


# -- the patch -------------------------------------------------------------------------------


class Indices(Dataset[int]):
    """Sample i is i: what the loader yields is the order it consumed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[PlanRequest]]:
    """Plans cube_torch would send (the daemon is not involved here)."""
    captured: list[PlanRequest] = []
    monkeypatch.setattr(ct_client.submitter, "submit", captured.append)  # the one patch.py imported
    monkeypatch.setattr(reporter, "ensure_running", lambda still_needed: None)
    monkeypatch.setattr(ct_client, "_warned", set())
    monkeypatch.setenv("VOL_NAME", "unit-test-volume")
    monkeypatch.setenv("RANK", "0")
    cube_torch.install()
    yield captured
    cube_torch.install()


def test_install_is_idempotent_reversible_and_keeps_the_class() -> None:
    from torch.utils.data import DataLoader as TorchDataLoader

    assert cube_torch.installed()
    original_iter = TorchDataLoader.__iter__
    assert cube_torch.install() is False  # already installed by the import
    patched = TorchDataLoader.__dict__["_index_sampler"]
    assert cube_torch.uninstall() is True
    restored = TorchDataLoader.__dict__["_index_sampler"]
    assert restored is not patched and not cube_torch.installed()
    assert cube_torch.uninstall() is False
    assert cube_torch.install() is True and cube_torch.install() is False
    loader = TorchDataLoader(Indices(4))
    assert type(loader) is TorchDataLoader and isinstance(loader, DataLoader)
    assert TorchDataLoader.__iter__ is original_iter  # only the one property is replaced
    assert isinstance(loader._index_sampler, patch.PlannedSampler)
    cube_torch.uninstall()
    assert TorchDataLoader.__dict__["_index_sampler"] is restored
    assert not isinstance(loader._index_sampler, patch.PlannedSampler)
    cube_torch.install()


class InfiniteSampler(Sampler[int]):
    def __iter__(self) -> Iterator[int]:
        while True:
            yield 0


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(5))


def test_nothing_planned_without_vol_name_and_vol_name_read_at_epoch_start(
        plans: list[PlanRequest], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VOL_NAME")
    loader = DataLoader(Indices(6), batch_size=2, shuffle=True, collate_fn=keep)
    list(loader)
    assert plans == []
    monkeypatch.setenv("VOL_NAME", "set-after-import")  # users set it after `import cube_torch`
    consumed = [i for batch in loader for i in batch]
    assert len(plans) == 1 and plans[0].vol_name == "set-after-import"
    assert plans[0].order.tolist() == consumed


def test_iterable_and_infinite_are_skipped_with_one_info_line(
        plans: list[PlanRequest], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cube_torch")
    for _ in range(2):
        assert [int(x) for x in DataLoader(Stream(), batch_size=None)] == [0, 1, 2, 3, 4]
        it = iter(DataLoader(Indices(3), sampler=InfiniteSampler(), batch_size=None))
        assert [int(next(it)) for _ in range(4)] == [0, 0, 0, 0]
    assert plans == []
    messages = [r.getMessage() for r in caplog.records if r.name == "cube_torch"]
    assert sum("IterableDataset" in m for m in messages) == 1
    assert sum("no length" in m for m in messages) == 1
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "cube_torch")


def _loader(kind: str, n: int, workers: int, rank: int = 0) -> tuple[DataLoader[Any], Any]:
    common: dict[str, Any] = {"num_workers": workers, "collate_fn": keep,
                              "persistent_workers": kind == "persistent"}
    dataset = Indices(n)
    if kind in ("random", "persistent"):
        return DataLoader(dataset, batch_size=3, shuffle=True, **common), None
    if kind == "generator":
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(9))
        return DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True, **common), None
    if kind == "none":
        return DataLoader(dataset, batch_size=None, shuffle=True, **common), None
    if kind == "batch_sampler":
        return DataLoader(dataset, batch_sampler=RepeatingBatchSampler(n, 9), **common), None
    if kind == "replacement":  # draws more samples than the dataset has, with repeats
        sampler = RandomSampler(dataset, replacement=True, num_samples=2 * n)
        return DataLoader(dataset, batch_size=5, sampler=sampler, **common), None
    if kind == "distributed":
        distributed: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=4)
        return DataLoader(dataset, batch_size=3, sampler=distributed, **common), distributed
    raise AssertionError(kind)


def _consume(kind: str, workers: int, rank: int = 0, epochs: int = 3) -> list[list[int]]:
    torch.manual_seed(1234)
    loader, distributed = _loader(kind, 17, workers, rank)
    out = []
    for epoch in range(epochs):
        if distributed is not None:
            distributed.set_epoch(epoch)
        out.append([int(i) for batch in loader for i in (batch if isinstance(batch, list) else [batch])])
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["random", "persistent", "generator", "none", "batch_sampler", "replacement",
                                  "distributed"])
def test_plan_is_the_consumed_order(kind: str, workers: int, plans: list[PlanRequest],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each epoch's plan is exactly the index order the loader then consumes, and the
    samples are those of the same loader without cube_torch (same RNG draws)."""
    if kind == "persistent" and workers == 0:
        workers = 1  # persistent_workers needs workers
    for rank in ((0, 1) if kind == "distributed" else (0,)):
        monkeypatch.setenv("RANK", str(rank))
        cube_torch.uninstall()
        reference = _consume(kind, workers, rank)
        assert plans == []
        cube_torch.install()
        consumed = _consume(kind, workers, rank)
        assert consumed == reference
        assert [p.order.tolist() for p in plans] == consumed
        assert [(p.epoch, p.rank, p.vol_name) for p in plans] == [(e, rank, "unit-test-volume") for e in range(3)]
        assert all(p.order.dtype == np.int64 for p in plans)
        if kind != "generator":  # the global-RNG samplers must draw anew each epoch
            assert consumed[0] != consumed[1]
        plans.clear()


@pytest.mark.parametrize(("kind", "workers", "first"), [
    ("random", 0, 3),  # no workers: the first batch
    ("random", 2, 12),  # each worker's first prefetch_factor (2) batches of 3
    ("none", 2, 4),  # batch_size=None: one sample per "batch"
    ("batch_sampler", 2, 3 + 1 + 4 + 2),  # uneven batches: the first four, as drawn
])
def test_plan_names_the_samples_the_loader_asks_for_at_once(kind: str, workers: int, first: int,
                                                             plans: list[PlanRequest]) -> None:
    """The daemon answers the plan once these samples' files are local: each worker's
    first ``prefetch_factor`` batches, which it asks for as soon as it starts."""
    _consume(kind, workers, epochs=1)
    assert [p.first for p in plans] == [first]


@pytest.mark.parametrize("workers", [0, 2])
def test_files_count_once_the_loop_has_their_batch(workers: int, plans: list[PlanRequest]) -> None:
    """What cube_torch reports as read (the daemon cannot see page-cache hits): the files of
    the batches the loop has; with workers, all of the epoch's once the loader has asked
    for its last batch (then early by at most the batches in flight); a loop left early
    counts what it received; a held sample (a CachedDataset's) reads no file."""
    progress.forget()
    loader = DataLoader(Indices(17), batch_size=3, num_workers=workers, collate_fn=keep)
    in_flight = 0 if workers == 0 else 2 * 2  # batches: workers x prefetch_factor
    received: list[int] = []  # samples, in the order the loop gets them
    counted: list[tuple[int, int]] = []  # (reported, files of what the loop has)
    key = ("", "", 0)
    for batch in loader:
        reads = plans[-1].reads
        assert reads is not None
        key = reads.key
        if not received:  # the background thread's part: two files a sample; sample 0 is held
            reads.set_files(np.where(np.asarray(plans[-1].order) == 0, 0, 2))
        received += batch
        counted.append((progress.files_read(key), sum(2 for i in received if i != 0)))
    for i, (reported, files) in enumerate(counted):
        ahead = sum(2 for j in plans[-1].order[:3 * (i + 1 + in_flight)] if j != 0)
        assert files <= reported <= ahead, (i, reported, files)
    if workers == 0:
        assert [r for r, _ in counted] == [f for _, f in counted]
    assert progress.files_read(key) == 32  # 16 samples of two files: exact after the epoch
    # A loop that leaves after two batches counts the six samples it received.
    for i, batch in enumerate(loader):
        reads = plans[-1].reads
        assert reads is not None
        if i == 0:
            reads.set_files(np.full(17, 2))
        if i == 1:
            break
    del batch
    assert progress.files_read(key) == 32 + 12
    progress.forget()


def test_loader_built_inline_is_planned(plans: list[PlanRequest]) -> None:
    """``for batch in DataLoader(...)``: the loader object is dropped as soon as its
    iterator exists; the epoch is planned all the same."""
    torch.manual_seed(3)
    consumed = [i for batch in DataLoader(Indices(9), batch_size=2, shuffle=True, collate_fn=keep) for i in batch]
    assert len(plans) == 1 and plans[0].order.tolist() == consumed and plans[0].epoch == 0


def test_each_loader_plans_under_its_own_id(plans: list[PlanRequest]) -> None:
    """Two loaders iterated together (zipped) and one built inline: each has its own id,
    kept from epoch to epoch, so the daemon keeps one plan per loader."""
    train, val = (DataLoader(Indices(n), batch_size=2, shuffle=True, collate_fn=keep) for n in (8, 6))
    for epoch in range(2):
        for _ in zip(train, val):
            pass
    by_loader: dict[str, list[int]] = {}
    for p in plans:
        by_loader.setdefault(p.loader, []).append(p.epoch)
    assert patch.loader_id(train) != patch.loader_id(val)
    assert by_loader == {patch.loader_id(train): [0, 1], patch.loader_id(val): [0, 1]}
    plans.clear()
    list(DataLoader(Indices(4), batch_size=2, collate_fn=keep))
    (inline,) = plans
    assert inline.loader not in by_loader and patch.loader_id(train) == patch.loader_id(train)


def test_a_full_queue_drops_the_same_loaders_older_plan_first() -> None:
    submitter = ct_client.Submitter()  # no thread: requests are queued by hand
    queued = [PlanRequest("v", None, np.arange(2), epoch, 0, "job", loader=loader)
              for epoch, loader in enumerate(("0", "1", "0", "2"))]
    for request in queued:
        submitter._queue.put_nowait(request)
    assert submitter._supersede(PlanRequest("v", None, np.arange(2), 9, 0, "job", loader="1")) is queued[1]
    assert submitter._supersede(PlanRequest("v", None, np.arange(2), 9, 0, "job", loader="7")) is queued[0]
    assert list(submitter._queue.queue) == [queued[2], queued[3]]


def test_planned_sampler_survives_copy() -> None:
    import copy

    sampler = DataLoader(Indices(4), batch_size=2)._index_sampler
    assert isinstance(sampler, patch.PlannedSampler)
    assert list(copy.copy(sampler).inner) == list(sampler.inner) == [[0, 1], [2, 3]]


def test_partially_consumed_epoch_still_plans_the_whole_epoch(plans: list[PlanRequest]) -> None:
    """A training loop that breaks early: the plan is the whole epoch the sampler drew."""
    torch.manual_seed(5)
    loader = DataLoader(Indices(12), batch_size=2, shuffle=True, num_workers=2, collate_fn=keep)
    first = []
    for batch in loader:
        first.extend(batch)
        if len(first) == 4:
            break
    assert len(plans) == 1 and len(plans[0].order) == 12 and plans[0].order.tolist()[:4] == first
    assert sorted(plans[0].order.tolist()) == list(range(12))


# -- index -> files ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cube_torch_tree")
    populate(root)
    return root


def opened_by(dataset: Dataset[Any], index: int, monkeypatch: pytest.MonkeyPatch, under: Path) -> list[str]:
    """The files ``dataset[index]`` really opens (an oracle independent of cube_torch)."""
    seen: list[str] = []
    real_open = builtins.open

    def tracing(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(str(under) + "/"):
            seen.append(os.path.abspath(file))
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", tracing)
        dataset[index]
    return seen


@pytest.mark.parametrize("wrapper", ["plain", "subset", "nested", "concat"])
@pytest.mark.parametrize("kind", ["imagefolder", "datasetfolder", "voc", "coco", "list1d", "list2d"])
def test_sample_files_are_the_files_getitem_opens(kind: str, wrapper: str, tree: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = wrap(make_dataset(kind, tree), wrapper, tree)
    files = sample_files(dataset)
    for i in range(len(dataset)):  # type: ignore[arg-type]
        assert [os.path.abspath(p) for p in files(i)] == opened_by(dataset, i, monkeypatch, tree), (kind, i)


def test_voc_maps_image_and_annotation_and_coco_maps_ids(tree: Path) -> None:
    voc = make_dataset("voc", tree)
    assert [Path(p).name for p in sample_files(voc)(3)] == ["2012_000003.jpg", "2012_000003.xml"]
    coco = make_dataset("coco", tree)
    files = sample_files(coco)
    names = json.loads((tree / "coco" / "annotations.json").read_text())["images"]
    by_id = {image["id"]: image["file_name"] for image in names}
    for i in range(len(coco)):  # type: ignore[arg-type]
        assert files(i) == [os.path.join(str(tree / "coco" / "images"), by_id[coco.ids[i]])]  # type: ignore[attr-defined]
    assert files(0) != [str(tree / "coco" / "images" / "img_00.jpg")]  # ids are not file order


def test_train_data_list_shapes_and_unsupported(tree: Path) -> None:
    pair = PairDataset(["i0", "i1"], ["c0", "c1"])
    assert sample_files(pair)(1) == ["i1", "c1"]
    assert sample_files(ListDataset(["x", "y"]))(1) == ["y"]

    class Cube(ListDataset):
        def train_data_list(self) -> np.ndarray:
            return np.zeros((2, 2, 2))

    with pytest.raises(Unsupported, match="3-D"):
        sample_files(Cube([]))
    with pytest.raises(Unsupported, match="train_data_list"):
        sample_files(Indices(3))


@pytest.mark.parametrize("listed", [
    np.array([["i0", "i1", "i2"], ["c0", "c1", "c2"]]),  # (k, N)
    np.array([["i0", "c0"], ["i1", "c1"], ["i2", "c2"]]),  # (N, k): the form that raised IndexError
    [["i0", "i1", "i2"], ["c0", "c1", "c2"]],  # k lists
    [(Path("i0"), b"c0"), (Path("i1"), b"c1"), (Path("i2"), b"c2")],  # N rows, PathLike and bytes
    np.array([[b"i0", b"c0"], [b"i1", b"c1"], [b"i2", b"c2"]]),  # a bytes array
])
def test_train_data_list_accepts_k_by_n_and_n_by_k_of_any_path_type(listed: Any) -> None:
    class Listed(Indices):
        def train_data_list(self) -> Any:
            return listed

    files = sample_files(Listed(3))
    assert [files(i) for i in range(3)] == [["i0", "c0"], ["i1", "c1"], ["i2", "c2"]]


@pytest.mark.parametrize(("listed", "expected"), [
    (["a", "b"], "lists 2 samples but the dataset has 3"),
    (np.array([["a", "b"], ["c", "d"]]), "lists 2 samples but the dataset has 3"),
    ([1, 2, 3], "holds a int, not a path"),
    ([["a"], ["b", "c"], ["d"]], "holds a list, not a path"),  # ragged rows
])
def test_train_data_list_mistakes_name_the_accepted_shapes(listed: Any, expected: str) -> None:
    class Listed(Indices):
        def train_data_list(self) -> Any:
            return listed

    with pytest.raises(Unsupported, match=expected) as exc:
        sample_files(Listed(3))
    assert "(k, N) array" in str(exc.value) and "(N, k) array" in str(exc.value)
    with pytest.raises(Unsupported):
        sample_files(ConcatDataset([ListDataset(["a"]), Indices(2)]))


def test_collect_ignores_paths_outside_the_mount_and_file_order() -> None:
    mount = "/mnt/vol"
    paths = [["/mnt/vol/a", "/elsewhere/x"], ["/mnt/volume2/b"], ["/mnt/vol/d/c", "/mnt/vol/d/e"], [],
             ["/mnt/vol/../etc/passwd"]]
    collected = _collect(lambda i: paths[i], len(paths), mount)
    assert collected.paths == ["a", "d/c", "d/e"]
    assert collected.offsets.tolist() == [0, 1, 1, 3, 3, 3]
    assert relative_to_mount("/mnt/vol", mount) is None and relative_to_mount("/mnt/vol/", mount) is None
    rng = random.Random(2)
    counts = [rng.choice([0, 1, 1, 2, 3]) for _ in range(200)]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    samples = np.array([rng.randrange(200) for _ in range(500)], dtype=np.int64)
    expected = [f for s in samples.tolist() for f in range(int(offsets[s]), int(offsets[s + 1]))]
    assert _file_order(offsets, samples).tolist() == expected
    assert _file_order(np.zeros(3, dtype=np.int64), np.array([0, 1])).tolist() == []


# -- the per-volume config file --------------------------------------------------------------


def test_config_file_is_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_volume_config(tmp_path, "good", 0o644)
    assert read_volume_config("good", str(tmp_path)).control_socket == "/run/x.sock"
    write_volume_config(tmp_path, "world", 0o646)
    write_volume_config(tmp_path, "group", 0o664)
    write_volume_config(tmp_path, "version", 0o644, protocol_version=PROTOCOL_VERSION + 1)
    (tmp_path / "cube_torch.config.link").symlink_to(tmp_path / "cube_torch.config.good")
    for name, reason in (("world", "writable"), ("group", "writable"), ("version", "protocol"),
                         ("link", "cannot open"), ("absent", "no daemon")):
        with pytest.raises(ProtocolError, match=reason):
            read_volume_config(name, str(tmp_path))
    owner = owned_by_another_user(write_volume_config(tmp_path, "owned", 0o644), monkeypatch)
    with pytest.raises(ProtocolError, match=f"owned by uid {owner}"):
        read_volume_config("owned", str(tmp_path))


# -- the hit-rate line -----------------------------------------------------------------------


def test_documented_line_is_what_format_line_writes() -> None:
    example = ("user memory last_cycle_metrics:([request_count:4801 hit_count:4801 miss_count:0 hit_rate:100.00% "
               "miss_rate:0.00% ])  sum_metrics:([request_count:295154 hit_count:295001 miss_count:153 "
               "hit_rate:99.95% miss_rate:0.05%])")
    # The user guide documents exactly this line (CubeFS's format, which log parsers rely on).
    assert example in (REPO / "docs" / "cube_torch.md").read_text()
    assert LINE.fullmatch(example)
    assert reporter.format_line({"requests": 4801, "hits": 4801, "misses": 0},
                                {"requests": 295154, "hits": 295001, "misses": 153}) == example
    idle = reporter.format_line({"requests": 0, "hits": 0, "misses": 0}, {"requests": 0, "hits": 0, "misses": 0})
    assert LINE.fullmatch(idle) and "hit_rate:0.00% miss_rate:0.00% ]" in idle


def test_metrics_interval_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBE_TORCH_METRICS_INTERVAL", raising=False)
    assert reporter.interval() == 30.0
    for value, expected in (("5", 5.0), ("0.25", 0.25), ("0", 30.0), ("-1", 30.0), ("soon", 30.0)):
        monkeypatch.setenv("CUBE_TORCH_METRICS_INTERVAL", value)
        assert reporter.interval() == expected


def test_samples_compare_exactly() -> None:
    """The comparison used throughout is exact (a changed pixel or label is a difference)."""
    a = [(torch.zeros(2, 2, dtype=torch.uint8), 1)]
    b = [(torch.zeros(2, 2, dtype=torch.uint8), 1)]
    assert canon(a) == canon(b)
    b[0][0][1, 1] = 1
    assert canon(a) != canon(b)
    assert canon([(torch.zeros(1), 1)]) != canon([(torch.zeros(1), 2)])


NO_TORCH = """
import sys
from importlib.machinery import PathFinder

class NoTorch(PathFinder):  # what a Python without torch installed finds: nothing
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == "torch" else PathFinder.find_spec(name, path, target)

sys.meta_path = [NoTorch if finder is PathFinder else finder for finder in sys.meta_path]
import cube_torch
"""


def test_without_torch_the_import_says_what_to_install() -> None:
    result = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: cube_torch needs PyTorch, which is not installed") and "[torch]" in last
    assert "ModuleNotFoundError" not in result.stderr


# -- one job per distributed run -------------------------------------------------------------


def _clean_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("CUBE_TORCH_JOB", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)


def test_job_name_from_the_environment_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_launcher_env(monkeypatch)
    assert ct_client.default_job() == f"{socket.gethostname()}-{os.getpid()}"
    assert (ct_client.rank(), ct_client.world_size()) == (0, 1)
    # A rendezvous without a process group (ranks that only set DistributedSampler's
    # arguments): the address and port, plus the launcher's pid (a port is reused by the next run).
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ct_client.default_job() == f"{socket.gethostname()}-{os.getpid()}", "one rank: not distributed"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (ct_client.rank(), ct_client.world_size()) == (1, 2)
    first = ct_client.default_job()
    assert first == f"10.0.0.7:29500@{socket.gethostname()}-{os.getppid()}"
    monkeypatch.setattr(os, "getppid", lambda: 1)  # the next run's launcher, same port
    assert ct_client.default_job() != first
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id: not a run id
    assert ct_client.default_job() == f"10.0.0.7:29500@{socket.gethostname()}-1"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run/42")
    assert ct_client.default_job() == "run_42"
    monkeypatch.setenv("CUBE_TORCH_JOB", "mine")
    assert ct_client.default_job() == "mine"


RANKS_SCRIPT = """
import json, os, sys
import torch.distributed as dist
import torch.multiprocessing as mp

def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from cube_torch import client
    first = client.default_job()
    assert client.default_job() == first  # asked again: the same (kept per process group)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"job": first, "pid": os.getpid(), "rank": client.rank(), "world": client.world_size()}, f)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2, start_method="fork")
"""


def test_ranks_of_a_process_group_are_one_job_and_each_run_another(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of two ranks (torch.multiprocessing, gloo), one after the other on the same
    MASTER_PORT: within a run both ranks get one name (that of the rank that asked first);
    the second run gets another."""
    _clean_launcher_env(monkeypatch)
    port = free_port()
    runs = []
    for run in range(2):
        out = tmp_path / str(run)
        out.mkdir()
        result = subprocess.run([sys.executable, "-c", RANKS_SCRIPT, str(port), str(out)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
        assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
        [job] = {r["job"] for r in ranks}
        assert job in {f"{socket.gethostname()}-{r['pid']}" for r in ranks}
        runs.append(job)
    assert runs[0] != runs[1]


def test_a_distributed_line_names_its_rank() -> None:
    since = {"requests": 10, "hits": 9, "misses": 1}
    total = {"requests": 20, "hits": 19, "misses": 1}
    plain = reporter.format_line(since, total)
    ranked = reporter.format_line(since, total, rank=3)
    assert ranked == "[rank 3] " + plain  # CubeFS's line, unchanged, after the prefix
    assert LINE.fullmatch(plain) and LINE.fullmatch(ranked)
    assert LINE.fullmatch(ranked).group(6) == "20"  # type: ignore[union-attr]  # the groups did not move


def test_since_last_is_this_processes_own() -> None:
    """The ranks of one job share the daemon's since-last counters (any stats call restarts
    them): each process computes its own from the cumulative counters."""
    first = {"requests": 10, "hits": 8, "misses": 2, "stall_seconds": 0.5, "hit_rate": 0.8}
    later = {"requests": 30, "hits": 27, "misses": 3, "stall_seconds": 0.75, "hit_rate": 0.9}
    assert reporter._since(None, first) == first
    since = reporter._since(first, later)
    assert since == {"requests": 20, "hits": 19, "misses": 1, "stall_seconds": 0.25, "hit_rate": 0.95}
    assert reporter._since(later, first) == first  # fewer than before: the daemon restarted


def test_the_published_volume_reaches_forked_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the main process publishes at an epoch's start is what a child forked before it
    reads (the page is shared), and takes precedence over the child's own copy of the
    environment; the switch or an overlong name publish "off"."""
    from cube_torch import fastpath

    fastpath.install()  # idempotent: maps the page in this (the main) process
    monkeypatch.delenv("VOL_NAME", raising=False)
    monkeypatch.delenv(fastpath.ENV_SWITCH, raising=False)
    read, write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: forked before anything was published
        try:
            os.close(read)
            os.read(go_read, 1)
            os.write(write, f"{fastpath.volume_name()}|{fastpath.enabled()}".encode())
            os.read(go_read, 1)
            os.write(write, f"{fastpath.volume_name()}|{fastpath.enabled()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        fastpath.publish("vol-after-fork")
        os.write(go_write, b"x")
        assert os.read(read, 200) == b"vol-after-fork|True"
        monkeypatch.setenv(fastpath.ENV_SWITCH, "0")
        fastpath.publish("vol-after-fork")
        os.write(go_write, b"x")
        assert os.read(read, 200) == b"|False"
    finally:
        os.waitpid(pid, 0)
        for fd in (read, go_read, go_write):
            os.close(fd)
        monkeypatch.delenv(fastpath.ENV_SWITCH)
        fastpath.publish("x" * (fastpath.MAX_PUBLISHED_NAME + 1))
        assert fastpath.volume_name() == ""
        fastpath.unpublish()
        monkeypatch.setenv("VOL_NAME", "from-env")
        assert fastpath.volume_name() == "from-env"
