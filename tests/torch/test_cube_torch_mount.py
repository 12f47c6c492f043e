"""cube_torch against a real daemon: real DataLoaders, real worker processes, a real mount.

One ``ai_prefetch`` mount per module holds tiny datasets of every supported kind.  Each
case runs the same loader twice with the same seed: once with cube_torch uninstalled
(the reference) and once installed, and checks per rank and epoch:

(a) **the files opened are exactly the submitted plan's files, as a multiset.**  What was
    submitted is captured on the wire (``ControlClient.register_dataset``/``submit_plan``
    wrapped in this process, where cube_torch's submitter thread runs) and confirmed by
    the daemon: ``GET /v1/status`` shows that (job, rank)'s plan with this epoch, this
    many samples and the content id of the captured file list.  What was opened is a
    reader trace: ``builtins.open`` is wrapped (workers are forked and inherit it), so
    every open under the mount by PIL, ElementTree, torchvision or our own loaders is
    recorded as (worker id, path) at the moment ``__getitem__`` opens it.  The daemon's
    side agrees: the job's request counter (one per application open it saw) grows by
    exactly the plan's length and the plan's ``used`` counter (opens it matched to a
    planned position) equals the plan's length.
(b) **each worker's opens follow the plan's order**: every worker's trace is a
    subsequence of the plan; with ``num_workers=0`` the trace *is* the plan.
(c) **the samples equal the reference's** (tensors, targets and bytes compared exactly).

Submission is asynchronous in production: a worker may open an epoch's first files
before the daemon has that epoch's plan (those reads are simply not prefetched).  To
make the daemon's counters exact, these tests make ``submit`` wait for the background
thread (``submitter.wait_idle``); what is submitted and how is unchanged.
"""

from __future__ import annotations

import builtins
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, get_worker_info

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets  # type: ignore[import-untyped]  # noqa: E402

import cube_torch
from cube_torch import client as ct_client
from cube_torch import fastpath
from cube_torch import reporter, waits
from cube_torch.prefetch import DevicePrefetcher
from cubefs_fuse.prefetch.datasets import parse_dataset
from cubefs_fuse.control.protocol import ControlClient, config_file_path, read_volume_config
from tests.helpers import REPO, Mount, force_unmount, free_port, metric, wait_until
from tests.torch_datasets import LINE, ListDataset, Wire, capture_wire, RepeatingBatchSampler, canon, keep, make_dataset, populate, read_bytes, wrap

SEED = 20240607

WORLD = 2  # DistributedSampler world size


# -- the volume: every dataset kind, generated once per module ---------------------------


@dataclass
class Volume:
    mount: Mount
    name: str

    @property
    def root(self) -> Path:
        return self.mount.mount_point

    def client(self) -> ControlClient:
        return ControlClient(read_volume_config(self.name).control_socket, timeout=10)


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Volume]:
    """One ai_prefetch daemon for the module (a mount costs ~1.5 s; cases only read)."""
    base = tmp_path_factory.mktemp("cube_torch_volume")
    port = free_port()
    name = f"ctmount{port}"  # unique: cube_torch finds the daemon by /tmp/cube_torch.config.<name>
    m = Mount(base, base / "source", base / "mnt", base / "cache", base / "client.json", port,
              {"profile": "ai_prefetch", "volName": name})
    for d in (m.source, m.mount_point):
        d.mkdir(parents=True)
    populate(m.source)
    try:
        m.mount()
        yield Volume(m, name)
        m.umount()
    finally:
        force_unmount(m)


# -- the reader trace --------------------------------------------------------------------

_trace_dir: str | None = None  # set while a module's trace is active; forked workers inherit it
_trace_prefix = ""
_real_open = builtins.open


def _record(file: Any) -> None:
    if _trace_dir is not None and isinstance(file, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(file))
        if path.startswith(_trace_prefix):
            info = get_worker_info()
            record = f"{info.id if info is not None else -1}\t{path[len(_trace_prefix):]}\n".encode()
            fd = os.open(os.path.join(_trace_dir, str(os.getpid())), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, record)  # one write per record: O_APPEND keeps lines whole
            finally:
                os.close(fd)


def _traced_open(file: Any, *args: Any, **kwargs: Any) -> Any:
    """builtins.open, recording opens of files under the mount as (worker id, path)."""
    _record(file)
    return _real_open(file, *args, **kwargs)


class _TracedFastFile(fastpath.FastFile):
    """An open the fast path answered (it never reaches ``_traced_open``): recorded too."""

    def __init__(self, data: bytes, name: str) -> None:
        _record(name)
        super().__init__(data, name)


class Trace:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def take(self) -> dict[int, list[str]]:
        """Opens since the last call, per worker id (-1: the main process), in order."""
        opens: dict[int, list[str]] = {}
        for f in sorted(self.directory.iterdir()):
            for line in f.read_text().splitlines():
                worker, path = line.split("\t", 1)
                opens.setdefault(int(worker), []).append(path)
            f.unlink()
        return opens


@pytest.fixture(scope="module")
def trace(volume: Volume, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trace]:
    global _trace_dir, _trace_prefix
    directory = tmp_path_factory.mktemp("cube_torch_trace")
    _trace_dir, _trace_prefix = str(directory), str(volume.root) + "/"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", _traced_open)
        mp.setattr(fastpath, "FastFile", _TracedFastFile)
        yield Trace(directory)
    _trace_dir = None


# -- what cube_torch sends ---------------------------------------------------------------


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch, volume: Volume) -> Wire:
    """Captures the control traffic and makes each submission complete before the epoch's
    first sample is handed out (see the module doc)."""
    return capture_wire(monkeypatch)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch, volume: Volume, request: pytest.FixtureRequest) -> Iterator[str]:
    """VOL_NAME set, a job name per test (the daemon counts per job), warnings re-armed."""
    job = re.sub(r"[^A-Za-z0-9_.:@-]", "_", request.node.name)[:100] + f"-{os.getpid()}"
    monkeypatch.setenv("VOL_NAME", volume.name)
    monkeypatch.setenv("CUBE_TORCH_JOB", job)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(ct_client, "_warned", set())
    cube_torch.install()
    yield job
    cube_torch.install()


# -- loaders -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    dataset: str = "imagefolder"
    sampler: str = "sequential"  # sequential | random | generator | none | batch_sampler | distributed
    workers: int = 0
    wrapper: str = "plain"
    rank: int = 0
    persistent: bool = False
    epochs: int = 2
    fast: bool = True  # CUBE_TORCH_FAST_PATH on (the default) or off

    @property
    def id(self) -> str:
        parts = [self.dataset, self.wrapper, self.sampler + (str(self.rank) if self.sampler == "distributed" else ""),
                 f"w{self.workers}"]
        return "-".join(parts + (["persistent"] if self.persistent else []) + ([] if self.fast else ["nofast"]))


def build_loader(case: Case, dataset: Dataset[Any]) -> tuple[DataLoader[Any], Callable[[int], None]]:
    """The loader and what the training loop calls at each epoch's start."""
    torch.manual_seed(SEED)  # shuffle=True draws from the global RNG, like an unseeded script
    common: dict[str, Any] = {"num_workers": case.workers, "collate_fn": keep,
                              "persistent_workers": case.persistent}
    n = len(dataset)  # type: ignore[arg-type]
    if case.sampler == "sequential":
        return DataLoader(dataset, batch_size=4, **common), lambda epoch: None
    if case.sampler == "random":
        return DataLoader(dataset, batch_size=4, shuffle=True, **common), lambda epoch: None
    if case.sampler == "generator":
        generator = torch.Generator().manual_seed(SEED)
        sampler = RandomSampler(dataset, generator=generator)  # type: ignore[arg-type]
        return DataLoader(dataset, batch_size=3, sampler=sampler, **common), lambda epoch: None
    if case.sampler == "none":
        return DataLoader(dataset, batch_size=None, shuffle=True, **common), lambda epoch: None
    if case.sampler == "batch_sampler":
        return DataLoader(dataset, batch_sampler=RepeatingBatchSampler(n, SEED), **common), lambda epoch: None
    if case.sampler == "distributed":
        distributed: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=WORLD, rank=case.rank,
                                                                  shuffle=True, seed=SEED)
        return DataLoader(dataset, batch_size=3, sampler=distributed, **common), distributed.set_epoch
    raise AssertionError(case.sampler)


def run_epochs(loader: DataLoader[Any], start_epoch: Callable[[int], None], epochs: int,
               after_epoch: Callable[[int], None] = lambda epoch: None) -> list[Any]:
    samples = []
    for epoch in range(epochs):
        start_epoch(epoch)
        samples.append([canon(batch) for batch in loader])
        after_epoch(epoch)
    return samples


def is_subsequence(part: list[str], whole: list[str]) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


def job_requests(volume: Volume, job: str, rank: int) -> int:
    """The job's requests on the daemon, after this process has reported its loaders'
    reads (as every hit-rate line does): files the page cache served reach no daemon."""
    cube_torch.stats()
    for entry in volume.client().stats(job)["jobs"]:
        if entry["rank"] == rank:
            return int(entry["cumulative"]["requests"])
    return 0


def fast_files(volume: Volume) -> float:
    """Files the daemon served through the fast path so far (hits and misses)."""
    samples = volume.mount.scrape()
    return sum(metric(samples, "cubefs_fuse_fastpath_files_total", result=r) for r in ("hit", "miss"))


def fast_asks(volume: Volume) -> float:
    """Files workers asked the fast path for so far: served, or answered "read it through
    the mount" (a batch not ready within its bounded wait, as on a loaded machine)."""
    samples = volume.mount.scrape()
    return sum(metric(samples, "cubefs_fuse_fastpath_files_total", result=r) for r in ("hit", "miss", "mount"))


def daemon_plan(volume: Volume, job: str, rank: int) -> dict[str, Any]:
    plans: list[dict[str, Any]] = [p for p in volume.client().status()["plans"] if (p["job"], p["rank"]) == (job, rank)]
    assert len(plans) == 1, f"daemon plans for {job}/{rank}: {plans}"
    return plans[0]


def check_case(case: Case, volume: Volume, trace: Trace, wire: Wire, job: str,
               monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = wrap(make_dataset(case.dataset, volume.root), case.wrapper, volume.root)
    monkeypatch.setenv("RANK", str(case.rank))  # what torch.distributed would say on that rank
    monkeypatch.setenv("CUBE_TORCH_FAST_PATH", "1" if case.fast else "0")

    cube_torch.uninstall()
    sent_before = len(wire.plans)
    reference = run_epochs(*build_loader(case, dataset), case.epochs)
    trace.take()  # the reference's opens are not this check's business
    assert len(wire.plans) == sent_before, "cube_torch planned while uninstalled"
    cube_torch.install()

    seen_plans, registrations = len(wire.plans), wire.registrations
    before = [0]  # the job's request count at the epoch's start

    def verify(epoch: int) -> None:
        nonlocal seen_plans
        opened = trace.take()
        new = wire.plans[seen_plans:]
        seen_plans = len(wire.plans)
        assert len(new) == 1, f"epoch {epoch}: {len(new)} plans sent"
        plan = new[0]
        assert (plan.job, plan.rank, plan.epoch) == (job, case.rank, epoch)
        planned = wire.paths(plan)
        # The daemon holds this very list and plan (content-addressed id, length, epoch).
        assert parse_dataset(b"\0".join(p.encode() for p in wire.datasets[plan.dataset]), 1).id == plan.dataset
        on_daemon = daemon_plan(volume, job, case.rank)
        assert (on_daemon["epoch"], on_daemon["dataset"], on_daemon["samples"]) == (epoch, plan.dataset, len(planned))
        # (a) the files opened are the plan's files, as a multiset ...
        everything = [path for paths in opened.values() for path in paths]
        assert Counter(everything) == Counter(planned)
        # ... the job counts each of them once (cube_torch reports the files the page cache
        # served: the reference run left them all there) ...
        expected = before[0] + len(planned)
        wait_until(lambda: job_requests(volume, job, case.rank) >= expected, what="the daemon to count the reads")
        assert job_requests(volume, job, case.rank) == expected
        # ... and the daemon matched to the plan every read that reached it: all of them
        # when the fast path asks it for each file, else those the page cache did not serve.
        on_daemon = daemon_plan(volume, job, case.rank)
        assert on_daemon["used"] == on_daemon["requests"] <= len(planned)
        if case.fast and case.workers > 0:
            assert on_daemon["used"] == len(planned)
        before[0] = expected
        # (b) each worker opens its files in the plan's order.
        if case.workers == 0:
            assert list(opened) == [-1] and opened[-1] == planned
        else:
            assert set(opened) <= set(range(case.workers))
            for worker, paths in opened.items():
                assert is_subsequence(paths, planned), f"worker {worker} left the plan's order"

    loader, start_epoch = build_loader(case, dataset)
    assert isinstance(loader, DataLoader)
    fast_before = fast_files(volume)
    planned_run = run_epochs(loader, start_epoch, case.epochs, verify)
    # (c) the samples are those the loader yields without cube_torch.
    assert planned_run == reference
    # (d) the fast path served files exactly when it should: in workers, unless switched off.
    served = fast_files(volume) - fast_before
    if case.fast and case.workers > 0:
        assert served > 0, "the fast path served nothing"
    else:
        assert served == 0
    assert wire.registrations == registrations + 1, "the file list is registered once per dataset"


SAMPLER_CASES = [Case(sampler=s, workers=w, rank=r)
                 for s, ranks in (("sequential", (0,)), ("random", (0,)), ("generator", (0,)), ("none", (0,)),
                                  ("batch_sampler", (0,)), ("distributed", (0, 1)))
                 for r in ranks for w in (0, 1, 3)]
PERSISTENT_CASES = [Case(sampler=s, workers=w, rank=r, persistent=True, epochs=3)
                    for s, w, r in (("random", 3, 0), ("generator", 1, 0), ("distributed", 3, 1))]
# Every dataset kind under every wrapper; the sampler and worker count rotate.
_ROTATION = [("random", 1), ("batch_sampler", 3), ("generator", 0), ("none", 3), ("distributed", 1), ("sequential", 3)]
DATASET_CASES = [Case(dataset=d, wrapper=w, sampler=_ROTATION[(i + j) % 6][0], workers=_ROTATION[(i + j) % 6][1])
                 for i, d in enumerate(("imagefolder", "datasetfolder", "voc", "coco", "list1d", "list2d", "rows2d"))
                 for j, w in enumerate(("plain", "subset", "nested", "concat"))
                 if (d, w) != ("imagefolder", "plain")]  # that one is SAMPLER_CASES
# The fast path on (the default in every case above) and off, for the dataset kinds whose
# loading code it serves: torchvision's PIL loaders, and PIL + torch.load in a custom one.
FASTPATH_CASES = [Case(dataset=d, sampler="random", workers=2, fast=fast)
                  for d in ("imagefolder", "voc", "coco", "pilpt") for fast in (True, False)]


@pytest.mark.parametrize("case", SAMPLER_CASES + PERSISTENT_CASES + DATASET_CASES + FASTPATH_CASES,
                         ids=lambda c: c.id)
def test_plan_matches_reads_and_samples(case: Case, volume: Volume, trace: Trace, wire: Wire, fresh_state: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    check_case(case, volume, trace, wire, fresh_state, monkeypatch)


def test_distributed_ranks_split_the_epoch(volume: Volume, trace: Trace, wire: Wire, fresh_state: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 0 and 1 each submit their own order; together they cover the dataset."""
    for rank in range(WORLD):
        check_case(Case(sampler="distributed", workers=1, rank=rank), volume, trace, wire, fresh_state, monkeypatch)
    for epoch in range(2):
        per_rank = [wire.paths(p) for p in wire.plans if p.epoch == epoch]
        assert len(per_rank) == WORLD
        assert not set(per_rank[0]) & set(per_rank[1])
        assert len(set(per_rank[0]) | set(per_rank[1])) == 24  # the ImageFolder's files
    assert wire.paths(wire.plans[0]) != wire.paths(wire.plans[1]), "set_epoch must reshuffle"


def test_paths_outside_the_mount_are_ignored(volume: Volume, trace: Trace, wire: Wire, fresh_state: str,
                                             tmp_path: Path) -> None:
    """A list mixing the mount and a local directory: only the mount's files are planned."""
    local = tmp_path / "local.txt"
    local.write_text("local")
    inside = sorted(str(p) for p in (volume.root / "list1d").iterdir())[:5]
    loader = DataLoader(ListDataset([str(local), *inside, str(local)]), batch_size=2, collate_fn=keep)
    samples = [s for batch in loader for s in batch]
    assert samples[0] == samples[-1] == b"local"
    (plan,) = wire.plans
    assert wire.paths(plan) == [os.path.relpath(p, volume.root) for p in inside]


# -- hit rate on an emulated slow remote --------------------------------------------------


def test_hit_rate_from_epoch_one_on_slow_source(make_slow_mount: Callable[..., Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Source: a slowfs mount with 2 ms per operation.  The cache holds the dataset, so from
    epoch 1 on every open is a hit (>= 99 %) and no data is read from the remote again."""
    slow = make_slow_mount(latency_us=2000, profile="ai_prefetch")
    name = slow.mount.config()["volName"]  # unique per test: derived from the mount's free port
    rng = random.Random(11)
    for c in range(4):
        for i in range(10):  # 40 files of 16 KiB of noise (JPEG-sized, incompressible)
            path = slow.real / f"class{c}" / f"{i:02d}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rng.randbytes(16 * 1024))
    slow.mount.mount()
    monkeypatch.setenv("VOL_NAME", name)
    monkeypatch.setenv("CUBE_TORCH_JOB", f"hitrate-{os.getpid()}")
    monkeypatch.setattr(ct_client, "_warned", set())
    cube_torch.install()
    try:
        dataset = datasets.DatasetFolder(str(slow.mount.mount_point), loader=read_bytes, extensions=(".bin",))
        torch.manual_seed(SEED)
        loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=keep)
        control = ControlClient(read_volume_config(name).control_socket, timeout=10)
        counters, remote_reads = [], []
        for epoch in range(3):
            assert sum(len(batch) for batch in loader) == 40
            # Every open of this mount is ours: once the daemon's global count has them all, the
            # job's count is final.  (The very first opens of epoch 0 may precede the job's
            # registration, which happens in the background: the job may count fewer there.)
            wait_until(lambda: control.status()["hits"]["requests"] == 40 * (epoch + 1),
                       what="the daemon to count the epoch's opens")
            current = cube_torch.stats()
            assert current is not None
            counters.append((current["cumulative"]["requests"], current["cumulative"]["hits"]))
            remote_reads.append(slow.slowfs.stats()["ops"].get("read", 0))
        per_epoch = [counters[0]] + [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counters, counters[1:])]
        print(f"\nper-job hit rate per epoch (2 ms remote, 40 files): "
              f"{[f'{100 * h / max(r, 1):.1f}% of {r}' for r, h in per_epoch]}")
        for requests, hits in per_epoch[1:]:
            assert requests == 40 and hits / requests >= 0.99, per_epoch
        assert remote_reads[2] == remote_reads[0], "epochs 1-2 read data from the remote"
    finally:
        if slow.mount.mounted:
            slow.mount.umount()  # a clean unmount: the daemon removes its config file itself
    assert not os.path.exists(config_file_path(name))


# -- the hit-rate line ---------------------------------------------------------------------

def test_hit_rate_lines_every_interval(volume: Volume, fresh_state: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """With CUBE_TORCH_METRICS_INTERVAL=0.3 the main process prints the line (and logs it)
    from the daemon's counters of this job, no more often than the interval."""
    interval = 0.3  # seconds: three lines within a second
    monkeypatch.setenv("CUBE_TORCH_METRICS_INTERVAL", str(interval))
    caplog.set_level("INFO", logger="cube_torch")
    reporter.stop()  # a reporter left by an earlier test may sleep on the default interval
    dataset = make_dataset("imagefolder", volume.root)
    loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=keep)
    assert sum(len(b) for b in loader) == 24
    records: list[Any] = []

    def lines() -> int:
        records[:] = [r for r in caplog.records if r.name == "cube_torch" and "last_cycle_metrics" in r.getMessage()]
        return len(records)

    def daemon_count() -> int:  # GET /v1/status does not reset the since-last counters
        return sum(j["requests"] for j in volume.client().status()["jobs"] if j["job"] == fresh_state)

    def complete() -> bool:  # three lines, the last one showing the job's count on the daemon
        last = LINE.fullmatch(records[-1].getMessage()) if lines() >= 3 else None
        return last is not None and int(last.group(6)) == daemon_count() > 0

    wait_until(complete, timeout=15, what="three hit-rate lines, the last with the job's count")
    printed = [line for line in capsys.readouterr().out.splitlines() if "last_cycle_metrics" in line]
    assert len(printed) >= 3
    for line in printed + [r.getMessage() for r in records]:
        match = LINE.fullmatch(line)
        assert match, line
        requests, hits, misses = (int(match.group(i)) for i in (6, 7, 8))
        assert requests == hits + misses
    gaps = [b.created - a.created for a, b in zip(records, records[1:])]
    # Event.wait never returns early (10 % for clock reads); the one epoch's end line comes
    # on top of the periodic ones and may follow one of them closely.
    assert sum(gap < 0.9 * interval for gap in gaps) <= 1, gaps
    del loader
    reporter.stop()


SHORT_JOB = """
import sys
import tests.torchvision_shim
import cube_torch
from torch.utils.data import DataLoader
from tests.torch_datasets import keep, make_dataset
from pathlib import Path

loader = DataLoader(make_dataset("imagefolder", Path(sys.argv[1])), batch_size=4, shuffle=True, num_workers=2,
                    collate_fn=keep)
for epoch in range(2):
    print(f"EPOCH {epoch} {sum(len(b) for b in loader)}", flush=True)
"""


def test_a_short_job_prints_a_line_per_epoch_and_at_exit(volume: Volume, fresh_state: str) -> None:
    """A job far shorter than the default interval (30 s) still prints: at the end of each
    epoch and once at exit, the last line counting every open of the job.  The exit line is
    left out when nothing was read since the epoch's line (which then has the final count):
    a line never says last_cycle request_count:0 at exit."""
    env = {k: v for k, v in os.environ.items() if k != "CUBE_TORCH_METRICS_INTERVAL"}
    result = subprocess.run([sys.executable, "-c", SHORT_JOB, str(volume.root)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout.splitlines()
    assert [line for line in out if line.startswith("EPOCH")] == ["EPOCH 0 24", "EPOCH 1 24"]
    lines = [LINE.fullmatch(line) for line in out if "last_cycle_metrics" in line]
    assert all(lines) and len(lines) >= 2, out  # one per epoch (printed by the reporter thread), then exit
    assert int(lines[-1].group(6)) == 48  # type: ignore[union-attr]  # sum_metrics: both epochs' opens
    assert all(int(m.group(1)) > 0 for m in lines), out  # type: ignore[union-attr]  # each line says something new
    before_second = out.index("EPOCH 1 24")
    assert any("last_cycle_metrics" in line for line in out[:before_second]), "no line at the end of epoch 0"


def test_a_device_prefetcher_keeps_each_epochs_plan_and_every_files_count(
        volume: Volume, wire: Wire, fresh_state: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """DevicePrefetcher (on the CPU) over a shuffled 2-worker loader: each epoch is planned
    once, with its own epoch number (the prefetcher iterates the loader as a plain loop
    does), the samples and their order are the plain loader's, the daemon counts every
    file of every epoch for the job, and the data_wait line follows the hit-rate line."""
    monkeypatch.setattr(waits, "process", waits.WaitCounter())
    monkeypatch.setattr(reporter, "_previous_waits", waits.DataWait())
    dataset = make_dataset("imagefolder", volume.root)

    def shuffled() -> DataLoader[Any]:
        torch.manual_seed(SEED)
        return DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=keep)

    cube_torch.uninstall()
    reference = run_epochs(shuffled(), lambda epoch: None, 2)
    cube_torch.install()
    prefetcher = DevicePrefetcher(shuffled(), "cpu")
    plans, samples, requests = len(wire.plans), [], []
    for epoch in range(2):
        samples.append([canon(batch) for batch in prefetcher])
        wait_until(lambda: job_requests(volume, fresh_state, 0) >= 24 * (epoch + 1), what="the epoch's opens")
        requests.append(job_requests(volume, fresh_state, 0))
    assert samples == reference
    assert [p.epoch for p in wire.plans[plans:]] == [0, 1]
    assert requests == [24, 48]
    reporter.stop()  # its epoch-end lines are printed; now one line of our own
    capsys.readouterr()
    line = cube_torch.report_once()
    out = capsys.readouterr().out.splitlines()
    match = LINE.fullmatch(line or "")
    assert match and int(match.group(6)) == 48 and out[0] == line, out
    assert out[1].startswith("data_wait last_cycle:([steps:") and "sum:([steps:12 " in out[1], out
    current = cube_torch.stats()
    assert current is not None and current["data_wait"]["cumulative"]["steps"] == 12
    # The daemon exports what the job reported, next to its hit counters.
    scrape = volume.mount.scrape()
    labels = {"training_job": fresh_state, "rank": "0"}
    assert metric(scrape, "cubefs_fuse_job_steps_total", **labels) == 12
    waited = metric(scrape, "cubefs_fuse_job_data_wait_seconds_total", **labels)
    lasted = metric(scrape, "cubefs_fuse_job_step_seconds_total", **labels)
    assert 0 < waited <= lasted, (waited, lasted)
    assert metric(scrape, "cubefs_fuse_job_data_wait_p99_seconds", **labels) >= \
        metric(scrape, "cubefs_fuse_job_data_wait_p50_seconds", **labels)


# -- the fast path: loaders it cannot serve, and the plan before the first open ---------------


def test_a_loader_that_opens_files_from_c_reads_through_the_mount(volume: Volume, wire: Wire,
                                                                  fresh_state: str) -> None:
    """``os.open`` + ``mmap`` (as OpenCV reads) never see the fast path's bytes: the samples
    are read through the mount and equal the reference, the job counts exactly the files
    read (the batches' served files were never opened, so they are not requests), and the
    workers stop asking the daemon for that dataset."""
    dataset = make_dataset("clevel", volume.root)
    cube_torch.uninstall()
    reference = [canon(b) for b in DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=keep)]
    cube_torch.install()
    before, fast_before = job_requests(volume, fresh_state, 0), fast_files(volume)
    mount_before = metric(volume.mount.scrape(), "cubefs_fuse_fastpath_files_total", result="mount")
    loader = DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=keep, persistent_workers=True)
    for _ in range(3):
        assert [canon(b) for b in loader] == reference
    expected = before + 3 * len(dataset)  # type: ignore[arg-type]
    wait_until(lambda: job_requests(volume, fresh_state, 0) >= expected, what="the daemon to count the opens")
    assert job_requests(volume, fresh_state, 0) == expected
    assert fast_files(volume) == fast_before
    # Each worker asked for its first two batches only (USELESS_BATCHES), then stopped.
    batches = metric(volume.mount.scrape(), "cubefs_fuse_fastpath_batches_total")
    assert metric(volume.mount.scrape(), "cubefs_fuse_fastpath_files_total", result="mount") == mount_before
    assert batches > 0
    del loader


def test_persistent_workers_started_before_vol_name_use_the_fast_path(volume: Volume, fresh_state: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers forked while ``VOL_NAME`` was unset (a warm-up pass, or a script that sets it
    after the loader exists) follow the main process's ``VOL_NAME`` as of each epoch's start:
    served from the fast path once it is set, through the mount again once it is unset or
    ``CUBE_TORCH_FAST_PATH=0`` is set in the main process."""
    dataset = make_dataset("list1d", volume.root)
    cube_torch.uninstall()
    reference = [canon(b) for b in DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=keep)]
    cube_torch.install()
    monkeypatch.delenv("VOL_NAME")
    loader = DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=keep, persistent_workers=True)
    start = fast_asks(volume)
    assert [canon(b) for b in loader] == reference  # forks the workers, without VOL_NAME
    assert fast_asks(volume) == start
    monkeypatch.setenv("VOL_NAME", volume.name)
    assert [canon(b) for b in loader] == reference
    asked = fast_asks(volume) - start  # each file once (served, or late under load and read through the mount)
    assert asked == len(dataset), f"the workers asked the fast path for {asked} of {len(dataset)} files"  # type: ignore[arg-type]
    monkeypatch.setenv("CUBE_TORCH_FAST_PATH", "0")
    assert [canon(b) for b in loader] == reference
    monkeypatch.delenv("CUBE_TORCH_FAST_PATH")
    monkeypatch.delenv("VOL_NAME")
    assert [canon(b) for b in loader] == reference
    assert fast_asks(volume) - start == asked, "the workers asked the fast path after it was switched off"
    del loader


class PlanWitness(Dataset[tuple[int, int]]):
    """Each sample is (index, the epoch of this job's plan on the daemon when a worker loaded
    it): the first opens of an epoch must find that epoch's plan there."""

    def __init__(self, root: Path, job: str, socket_path: str) -> None:
        self.inner = make_dataset("list1d", root)
        self.job, self.socket_path = job, socket_path

    def train_data_list(self) -> np.ndarray:
        return self.inner.train_data_list()  # type: ignore[attr-defined, no-any-return]

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.inner[i]
        plans = [p for p in ControlClient(self.socket_path, timeout=10).status()["plans"] if p["job"] == self.job]
        return i, plans[0]["epoch"] if plans else -1


def test_the_plan_is_at_the_daemon_before_an_epochs_first_open(volume: Volume, fresh_state: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The epoch's plan is submitted synchronously (bounded: PLAN_SUBMIT_WAIT) before the
    loader hands out the first index: every sample of every epoch, the very first ones of
    4 workers included, is loaded with that epoch's plan already on the daemon, even when
    the submission takes 0.3 s (a busy daemon; within the 1 s bound)."""
    submit_plan = ControlClient.submit_plan

    def slow_submit(self: ControlClient, *args: Any, **kwargs: Any) -> dict[str, Any]:
        time.sleep(0.3)  # the emulated slowness, not a wait for a condition
        return submit_plan(self, *args, **kwargs)

    monkeypatch.setattr(ControlClient, "submit_plan", slow_submit)
    dataset = PlanWitness(volume.root, fresh_state, read_volume_config(volume.name).control_socket)
    loader = DataLoader(dataset, batch_size=2, shuffle=True, num_workers=4, collate_fn=keep)
    for epoch in range(3):
        seen = [plan_epoch for batch in loader for _, plan_epoch in batch]
        assert seen == [epoch] * len(dataset), f"epoch {epoch}: plans seen {seen}"
