"""DevicePrefetcher over real DataLoaders with real worker processes: on the CPU it hands
out the plain loader's batches in the plain loader's order (nested structures, a
DistributedSampler's ranks, persistent workers), raises the loader's errors at the step
that would have used the batch, names the stalled worker when a batch does not come in
time, leaves no worker process or thread behind when a loop leaves an epoch early, and
feeds a torch.compile'd model.  The CUDA tests run only where torch.cuda.is_available()."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from cube_torch import prefetch, reporter, waits
from cube_torch.batches import tensors
from cube_torch.prefetch import DataStalled, DevicePrefetcher, normalize
from tests.helpers import REPO, wait_until

WORKERS = 2
SEED = 20261129


@dataclasses.dataclass
class Boxes:
    coords: torch.Tensor
    source: str


class Nested(Dataset[Any]):
    """Samples with a tensor in every container a collate function makes, and non-tensors."""

    def __init__(self, n: int = 24, fail_at: int = -1, hang_at: int = -1) -> None:
        self.n, self.fail_at, self.hang_at = n, fail_at, hang_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is corrupt")
        if i == self.hang_at:
            time.sleep(60)  # a worker stuck on one sample (the test stops it long before)
        return {"image": torch.full((3, 2, 2), i, dtype=torch.uint8), "label": i,
                "extra": [torch.tensor([i, -i]), (f"id{i}", torch.tensor(i * 0.5))],
                "path": f"/data/{i}.jpg"}


def collate(samples: list[Any]) -> Any:
    """torch's default collate, plus a dataclass per batch (which default_collate cannot make)."""
    batch = torch.utils.data.default_collate(samples)
    return batch, Boxes(torch.stack([s["extra"][0] for s in samples]), "boxes")


def loader(dataset: Dataset[Any], **kwargs: Any) -> DataLoader[Any]:
    options: dict[str, Any] = {"batch_size": 4, "num_workers": WORKERS, "collate_fn": collate}
    options.update(kwargs)
    return DataLoader(dataset, **options)


def canon(batch: Any) -> Any:
    """A batch as plain values (tensors as lists, with dtype), comparable with ==."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", str(batch.dtype), batch.tolist())
    if isinstance(batch, dict):
        return {k: canon(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [canon(v) for v in batch])
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return (type(batch).__name__, {f.name: canon(getattr(batch, f.name)) for f in dataclasses.fields(batch)})
    return batch


def epochs(iterable: Any, count: int, start: Callable[[int], None] = lambda epoch: None) -> list[list[Any]]:
    result = []
    for epoch in range(count):
        start(epoch)
        result.append([canon(batch) for batch in iterable])
    return result


@pytest.fixture(autouse=True)
def own_waits(monkeypatch: pytest.MonkeyPatch) -> waits.WaitCounter:
    """The process's wait counter, fresh: other tests' reporter lines do not see these steps."""
    counter = waits.WaitCounter()
    monkeypatch.setattr(waits, "process", counter)
    monkeypatch.setattr(reporter, "_previous_waits", waits.DataWait())
    return counter


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cube_torch-prefetch"]


def test_the_same_batches_in_the_same_order_as_the_plain_loader() -> None:
    """Shuffled by a seeded generator, 2 epochs: every batch equal (nested structure,
    types, dtypes, non-tensors) and in the loader's order; len() is the loader's."""
    dataset = Nested()
    plain = epochs(loader(dataset, shuffle=True, generator=torch.Generator().manual_seed(SEED)), 2)
    wrapped = DevicePrefetcher(loader(dataset, shuffle=True, generator=torch.Generator().manual_seed(SEED)), "cpu",
                               depth=3)
    assert len(wrapped) == 6
    assert epochs(wrapped, 2) == plain
    assert plain[0] != plain[1], "the epochs are shuffled differently"
    first = next(iter(wrapped))
    assert isinstance(first[1], Boxes) and isinstance(first[0]["extra"][1], list)
    assert first[0]["path"][0].endswith(".jpg")
    assert wrapped.statistics().steps == 13  # 2 epochs of 6, and the one batch above


@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_sampler_ranks_keep_their_order_with_set_epoch(rank: int) -> None:
    dataset = Nested()
    reference: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=SEED)
    plain = epochs(loader(dataset, sampler=reference), 2, reference.set_epoch)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=SEED)
    assert epochs(DevicePrefetcher(loader(dataset, sampler=sampler), "cpu"), 2, sampler.set_epoch) == plain


def steps_until_error(iterable: Any) -> list[Any]:
    """Each step's batch labels, or the error the step raised (the loop goes on, as a
    DataLoader's does after a worker's exception)."""
    seen: list[Any] = []
    iterator = iter(iterable)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return seen
        except ValueError as exc:
            seen.append(str(exc).splitlines()[0] if "corrupt" in str(exc) else exc)
            continue
        seen.append(batch[0]["label"].tolist())


def test_a_loaders_error_surfaces_at_the_step_that_would_have_used_its_batch() -> None:
    """Sample 13 (batch 3) raises in a worker: the prefetcher, 4 batches ahead, has it
    long before step 3, and raises it at step 3, then goes on with batch 4."""
    dataset = Nested(fail_at=13)
    plain = steps_until_error(loader(dataset))
    assert isinstance(plain[3], str) and "ValueError" in plain[3], plain
    wrapped = DevicePrefetcher(loader(dataset), "cpu", depth=4)
    iterator = iter(wrapped)
    assert next(iterator)[0]["label"].tolist() == [0, 1, 2, 3]
    staged: Any = iterator  # its queue: what the prefetcher holds
    wait_until(lambda: staged._queue.full(), what="the prefetcher to hold 4 batches, the failed one among them")
    assert [next(iterator)[0]["label"].tolist() for _ in range(2)] == plain[1:3]  # still no error
    with pytest.raises(ValueError, match="sample 13 is corrupt"):
        next(iterator)
    assert [batch[0]["label"].tolist() for batch in iterator] == plain[4:]
    assert steps_until_error(wrapped) == plain


def test_a_hung_worker_raises_data_stalled_naming_it_and_is_stopped() -> None:
    """Sample 13 (batch 3, worker 1 of a sequential 2-worker loader) hangs: after 1 s the
    step raises DataStalled naming worker 1 and its pid, alive; both workers and the
    thread are gone soon after (torch joins each worker for up to 5 s, then kills it)."""
    before = children()
    iterator = iter(DevicePrefetcher(loader(Nested(hang_at=13)), "cpu", timeout=1.0))
    labels = [next(iterator)[0]["label"].tolist() for _ in range(3)]
    assert labels == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    workers = children() - before
    assert len(workers) == WORKERS
    started = time.monotonic()
    with pytest.raises(DataStalled) as raised:
        next(iterator)
    message = str(raised.value)
    assert time.monotonic() - started >= 1.0
    match = re.search(r"no batch within 1\.\d s \(batch 3 of the epoch, from 0\): the DataLoader is waiting for it "
                      r"from worker 1 \(pid (\d+), alive\), whose dataset or collate_fn has not returned", message)
    assert match, message
    assert int(match.group(1)) in workers and "workers: 0 (pid " in message and "\n" not in message
    assert isinstance(raised.value, TimeoutError)
    wait_until(lambda: not children() & workers, timeout=15, what="the stalled loader's workers to be stopped")
    wait_until(lambda: not prefetch_threads(), timeout=10, what="the prefetch thread to end")
    with pytest.raises(StopIteration):
        next(iterator)


class Gate(Dataset[Any]):
    """A dataset loaded in the main process that blocks on sample 2 until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 2:
            self.release.wait(30)
        return i


def test_a_stall_without_workers_says_where_the_loading_thread_is() -> None:
    dataset = Gate()
    iterator = iter(DevicePrefetcher(DataLoader(dataset, batch_size=2), "cpu", timeout=0.5))
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(DataStalled, match=r"loads batches in this process \(num_workers=0\) and has been at "
                                          r".*test_device_prefetch\.py:\d+ in __getitem__ "
                                          r"\(now in threading\.py:\d+ in wait\) for \d"):
        next(iterator)
    dataset.release.set()
    wait_until(lambda: not prefetch_threads(), timeout=10, what="the prefetch thread to end")


def test_leaving_an_epoch_early_stops_its_workers_and_thread() -> None:
    before = children()
    wrapped = DevicePrefetcher(loader(Nested(n=64)), "cpu", depth=2)
    for step, _ in enumerate(wrapped):
        if step == 1:
            assert len(children() - before) == WORKERS
            break
    # The loop's iterator is gone at the break: its workers are stopped as a plain loop's.
    wait_until(lambda: not children() - before, timeout=15, what="the workers to exit")
    wait_until(lambda: not prefetch_threads(), timeout=10, what="the prefetch thread to end")
    assert sum(1 for _ in wrapped) == 16  # and the next epoch is whole


def test_iter_alone_starts_nothing() -> None:
    """A framework that calls iter() only to check it can (Lightning) starts no epoch: no
    worker, no thread, no order drawn; the pass starts at its first next()."""
    before = children()
    wrapped = DevicePrefetcher(loader(Nested(), shuffle=True, generator=torch.Generator().manual_seed(SEED)), "cpu")
    unused = iter(wrapped)
    assert children() == before and not prefetch_threads()
    del unused
    plain = epochs(loader(Nested(), shuffle=True, generator=torch.Generator().manual_seed(SEED)), 1)
    assert epochs(wrapped, 1) == plain


def test_persistent_workers_survive_an_early_exit_and_the_next_epoch_is_the_plain_ones() -> None:
    """A DistributedSampler with set_epoch, as in training: each epoch's order depends on
    the epoch alone.  (A RandomSampler draws again from its generator when a loader takes
    its epoch's last index; a prefetcher that read further into an abandoned epoch than a
    plain loop leaves the generator elsewhere, as a larger prefetch_factor would.)"""
    def run(iterable: Any, sampler: DistributedSampler[Any]) -> list[Any]:
        seen = []
        sampler.set_epoch(0)
        for step, batch in enumerate(iterable):  # epoch 0, left after 2 batches
            seen.append(canon(batch))
            if step == 1:
                break
        sampler.set_epoch(1)
        seen.extend(canon(batch) for batch in iterable)  # epoch 1, whole
        return seen

    def make() -> tuple[DataLoader[Any], DistributedSampler[Any]]:
        dataset = Nested(n=48)
        sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=SEED)
        return loader(dataset, sampler=sampler, persistent_workers=True), sampler

    before = children()
    plain = run(*make())
    persistent, sampler = make()
    wrapped = DevicePrefetcher(persistent, "cpu")
    assert run(wrapped, sampler) == plain
    assert persistent._iterator is not None, "the persistent workers were kept"
    del wrapped, persistent, plain
    gc.collect()
    wait_until(lambda: not children() - before, timeout=15, what="the persistent workers to exit with their loader")


def test_a_loader_without_len_and_an_iterable_dataset() -> None:
    class Stream(IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            info = torch.utils.data.get_worker_info()
            start = info.id if info is not None else 0
            step = info.num_workers if info is not None else 1
            return iter([torch.tensor([i]) for i in range(start, 10, step)])

    plain = [b.tolist() for b in DataLoader(Stream(), batch_size=None, num_workers=WORKERS)]
    wrapped = DevicePrefetcher(DataLoader(Stream(), batch_size=None, num_workers=WORKERS), "cpu")
    with pytest.raises(TypeError, match="has no len"):
        len(wrapped)
    assert [b.tolist() for b in wrapped] == plain


def test_a_transform_runs_ahead_on_the_batch() -> None:
    norm = normalize([128.0] * 3, [64.0] * 3, channels_last=True)
    wrapped = DevicePrefetcher(loader(Nested(n=8)), "cpu", transform=lambda batch: (norm(batch[0]["image"]), batch[1]))
    images = [images for images, _ in wrapped]
    assert len(images) == 2 and images[0].is_contiguous(memory_format=torch.channels_last)
    assert images[1][0, 0, 0, 0].item() == pytest.approx((4 - 128) / 64)


def test_waits_are_counted_for_the_process(own_waits: waits.WaitCounter) -> None:
    """A slow dataset (20 ms a sample, 2 workers) and a fast step: most of the step is
    waiting, and the process's counter (the reporter's) has every step."""

    class Slow(Nested):
        def __getitem__(self, i: int) -> Any:
            time.sleep(0.02)
            return super().__getitem__(i)

    wrapped = DevicePrefetcher(loader(Slow(n=16)), "cpu")
    assert sum(1 for _ in wrapped) == 4
    mine, process = wrapped.statistics(), own_waits.snapshot()
    assert mine == process and mine.steps == 4
    assert mine.share > 0.5 and mine.percentile(99) > 0.01, mine.as_dict()


def test_a_compiled_model_takes_the_prefetched_batches() -> None:
    """torch.compile (dynamo tracing, with the eager backend: inductor's code generation
    needs a C++ compiler and minutes on this CPU) over 2 epochs of prefetched batches:
    the outputs are the uncompiled model's."""
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    compiled = torch.compile(model, backend="eager")
    batches = DevicePrefetcher(loader(Nested(n=16)), "cpu",
                               transform=lambda batch: normalize([0.0] * 3, [255.0] * 3)(batch[0]["image"]))
    for _ in range(2):
        for images in batches:
            assert torch.equal(compiled(images), model(images))


LIGHTNING = """
import tests.torchvision_shim  # before Lightning, which imports torchvision
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
import cube_torch

dataset = TensorDataset(torch.randn(32, 4), torch.arange(32))
handed = set()

def record(batch):  # the prefetcher's transform: which tensors it hands out
    handed.update(t.data_ptr() for t in batch)
    return batch

class Model(pl.LightningModule):
    def __init__(self, prefetch):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.prefetch, self.seen = prefetch, []

    def train_dataloader(self):
        loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(7))
        return cube_torch.DevicePrefetcher(loader, self.device, transform=record) if self.prefetch else loader

    def training_step(self, batch, index):
        x, y = batch
        if self.prefetch:  # on the device, and not copied again by Lightning
            assert x.device == self.device and x.data_ptr() in handed and y.data_ptr() in handed
        self.seen.append(y.tolist())
        return self.layer(x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit(prefetch):
    model = Model(prefetch)
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(model)
    return model.seen

plain, prefetched = fit(False), fit(True)
assert len(plain) == 8 and prefetched == plain, (prefetched, plain)
print("OK", len(plain))
"""

ACCELERATE = """
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
import cube_torch

accelerator = Accelerator(cpu=True)
dataset = TensorDataset(torch.arange(32.0).view(16, 2), torch.arange(16))

def loader(**options):
    return accelerator.prepare_data_loader(DataLoader(dataset, batch_size=4, num_workers=2), **options)

plain = [y.tolist() for _, y in loader()]
as_is = cube_torch.DevicePrefetcher(loader(), accelerator.device)
unplaced = cube_torch.DevicePrefetcher(loader(device_placement=False), accelerator.device)
for wrapped in (as_is, unplaced):
    got = [(x.device, y.tolist()) for x, y in wrapped]
    assert [y for _, y in got] == plain and {d for d, _ in got} == {accelerator.device}, got
    assert len(wrapped) == len(plain)
print("OK", len(plain))
"""


@pytest.mark.parametrize("script", [LIGHTNING, ACCELERATE], ids=["lightning", "accelerate"])
def test_the_documented_framework_recipes(script: str) -> None:
    """Lightning: the prefetcher returned by train_dataloader(), 2 epochs, each batch the
    one it handed out (Lightning's own transfer copies nothing again), the batches of
    Lightning with the plain loader in their order.  Accelerate: its prepared loader wrapped as it is and prepared without
    device placement, the same batches.  On the CPU, in a subprocess (the frameworks'
    own warnings are theirs)."""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# -- CUDA (only where there is one) -----------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@cuda
def test_cuda_batches_equal_the_plain_loaders_and_are_on_the_device() -> None:
    dataset = Nested()
    plain = epochs(loader(dataset, shuffle=True, generator=torch.Generator().manual_seed(SEED)), 2)
    wrapped = DevicePrefetcher(loader(dataset, shuffle=True, generator=torch.Generator().manual_seed(SEED),
                                      pin_memory=True), "cuda", depth=2)
    seen: list[list[Any]] = []
    for _ in range(2):
        epoch = []
        for batch in wrapped:
            assert all(t.device.type == "cuda" for t in tensors(batch))
            epoch.append(canon(batch))  # .tolist() on the consumer's stream, after its wait
        seen.append(epoch)
    assert seen == plain


@cuda
def test_cuda_transform_and_tensors_already_on_the_device_are_not_copied() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    resident = [torch.arange(6, device=device) for _ in range(3)]
    handed = list(DevicePrefetcher(resident, device))
    assert [t.data_ptr() for t in handed] == [t.data_ptr() for t in resident]
    norm = normalize([128.0] * 3, [64.0] * 3, channels_last=True)
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    (out,) = list(DevicePrefetcher([images], "cuda", transform=norm))
    assert out.device == device and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out.cpu(), (images.float() - 128) / 64)


@cuda
def test_cuda_consumer_stream_waits_for_the_copy() -> None:
    """A large batch on a busy consumer stream: the values read there are the copy's."""
    batches = [torch.full((4096, 1024), float(i)) for i in range(4)]
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        sums = [batch.sum().item() for batch in DevicePrefetcher(batches, "cuda", depth=2)]
    assert sums == [4096 * 1024 * float(i) for i in range(4)]


def test_the_cuda_path_is_refused_clearly_without_cuda() -> None:
    if torch.cuda.is_available():
        assert prefetch.resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(ValueError, match="pass device='cpu'"):
            DevicePrefetcher(loader(Nested()), "cuda")
