"""DevicePrefetcher's logic without a DataLoader: a batch's tensors found and rebuilt in
every container a collate function makes, the wait histogram's percentiles and share,
the data_wait line next to the hit-rate line (the daemon's counts faked), and the
one-line errors for arguments the prefetcher cannot take."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

import cube_torch
from cube_torch import reporter, waits
from cube_torch.batches import map_tensors, tensors
from cube_torch.client import submitter
from cube_torch.prefetch import DevicePrefetcher, normalize
from tests.helpers import REPO
from tests.torch_datasets import LINE
from tests.reporter_fakes import FakeControl, daemon_counts  # noqa: F401  (the fixture)


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


@dataclasses.dataclass
class Sample:
    pixels: torch.Tensor
    meta: dict[str, Any]
    derived: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.derived = self.pixels * 2


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    name: str


class Labels(list[Any]):
    tag = "labels"


@pytest.fixture
def fresh_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[waits.WaitCounter]:
    counter = waits.WaitCounter()
    monkeypatch.setattr(waits, "process", counter)
    monkeypatch.setattr(reporter, "_previous_waits", waits.DataWait())
    yield counter


def nested_batch() -> Any:
    text = "a caption"
    return {
        "pair": Pair(torch.arange(3), 7),
        "sample": Sample(torch.ones(2), {"path": "/x.jpg", "ids": [torch.tensor([1, 2]), None]}),
        "frozen": Frozen(torch.zeros(1), "f"),
        "ordered": collections.OrderedDict([("b", torch.tensor(1.0)), ("a", text)]),
        "default": collections.defaultdict(list, {"k": torch.tensor([5])}),
        "labels": Labels([torch.tensor(3), 4]),
        "tuple": (torch.tensor([9]), (b"bytes", 1.5)),
    }


def test_map_tensors_rebuilds_every_container_with_its_type_and_leaves_the_rest() -> None:
    batch = nested_batch()
    seen: list[torch.Tensor] = []

    def plus_one(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t + 1

    mapped = map_tensors(batch, plus_one)
    assert [id(t) for t in seen] == [id(t) for t in tensors(batch)], "one visit per tensor, in tensors()' order"
    assert len(seen) == 9
    assert isinstance(mapped["pair"], Pair) and mapped["pair"].label == 7
    assert torch.equal(mapped["pair"].image, torch.arange(3) + 1)
    sample = mapped["sample"]
    assert isinstance(sample, Sample) and torch.equal(sample.derived, torch.full((2,), 3.0))  # init=False field too
    assert sample.meta["path"] == "/x.jpg" and sample.meta["ids"][1] is None
    assert torch.equal(sample.meta["ids"][0], torch.tensor([2, 3]))
    assert isinstance(mapped["frozen"], Frozen) and torch.equal(mapped["frozen"].x, torch.ones(1))
    assert type(mapped["ordered"]) is collections.OrderedDict and list(mapped["ordered"]) == ["b", "a"]
    assert mapped["ordered"]["a"] is batch["ordered"]["a"]
    assert type(mapped["default"]) is collections.defaultdict and mapped["default"]["missing"] == []
    assert type(mapped["labels"]) is Labels and mapped["labels"][1] == 4
    assert all(a is b for a, b in zip(mapped["tuple"][1], batch["tuple"][1]))  # non-tensors: the same objects
    # The original is untouched.
    assert torch.equal(batch["pair"].image, torch.arange(3)) and torch.equal(batch["sample"].pixels, torch.ones(2))


def test_a_prefetcher_on_the_cpu_hands_out_the_loaders_own_tensors(fresh_waits: waits.WaitCounter) -> None:
    """Tensors already on the target device are never copied: on the CPU, the very objects."""
    batches = [nested_batch() for _ in range(3)]
    handed = list(DevicePrefetcher(batches, "cpu", depth=2))
    assert len(handed) == 3
    for given, got in zip(batches, handed):
        assert [id(t) for t in tensors(given)] == [id(t) for t in tensors(got)]


# -- the wait histogram --------------------------------------------------------------------


def counted(values: list[float]) -> waits.DataWait:
    counter = waits.WaitCounter()
    for value in values:
        counter.add(value, value + 0.1)
    return counter.snapshot()


def test_a_bucket_holds_its_upper_edge_and_its_middle_is_within_the_stated_error() -> None:
    for index in (1, 2, 8, 100, 200):
        upper = waits.FIRST_EDGE * 2 ** (index / waits.STEPS_PER_DOUBLING)
        lower = waits.FIRST_EDGE * 2 ** ((index - 1) / waits.STEPS_PER_DOUBLING)
        assert waits.bucket(upper * 0.999999) == index and waits.bucket(lower * 1.000001) == index
        # Every value of the bucket reads within 4.5 % of itself.
        assert abs(waits.middle(index) / upper - 1) < 0.045 and abs(waits.middle(index) / lower - 1) < 0.045
    assert waits.bucket(0.0) == waits.bucket(-1.0) == waits.bucket(math.nan) == waits.bucket(1e-6) == 0
    assert waits.middle(0) == 0.0
    assert waits.bucket(1e9) == waits.BUCKETS - 1


def test_percentiles_are_nearest_rank_within_the_bucket_error() -> None:
    assert counted([]).percentile(50) == 0.0
    one_slow = counted([0.002] * 99 + [0.5])
    assert one_slow.percentile(50) == pytest.approx(0.002, rel=0.045)
    assert one_slow.percentile(99) == pytest.approx(0.002, rel=0.045)  # the 99th of 100 is still fast
    assert one_slow.percentile(100) == pytest.approx(0.5, rel=0.045)
    two_slow = counted([0.002] * 98 + [0.5] * 2)
    assert two_slow.percentile(99) == pytest.approx(0.5, rel=0.045)
    spread = counted([i / 1000 for i in range(1, 1001)])  # 1 ms .. 1 s
    assert spread.percentile(50) == pytest.approx(0.5, rel=0.045)
    assert spread.percentile(99) == pytest.approx(0.99, rel=0.045)
    assert counted([0.0] * 10).percentile(99) == 0.0  # ready batches wait nothing


def test_share_and_since_last() -> None:
    counter = waits.WaitCounter()
    counter.add(0.1, 0.4)
    first = counter.snapshot()
    assert first.share == pytest.approx(0.25)
    counter.add(0.0, 0.6)
    counter.add(0.3, 0.5)
    since = counter.snapshot().minus(first)
    assert since.steps == 2 and since.wait_seconds == pytest.approx(0.3) and since.share == pytest.approx(0.3 / 1.1)
    assert since.percentile(100) == pytest.approx(0.3, rel=0.045) and sum(since.buckets) == 2
    assert first.minus(counter.snapshot()) == first  # not an earlier snapshot: everything
    assert waits.DataWait().share == 0.0
    assert counter.snapshot().as_dict()["steps"] == 3


WAIT_LINE = re.compile(
    r"(?:\[rank \d+\] )?data_wait last_cycle:\(\[steps:(\d+) wait_p50_ms:(\d+\.\d{3}) wait_p99_ms:(\d+\.\d{3}) "
    r"wait_share:(\d+\.\d\d)%\]\)  sum:\(\[steps:(\d+) wait_p50_ms:(\d+\.\d{3}) wait_p99_ms:(\d+\.\d{3}) "
    r"wait_share:(\d+\.\d\d)%\]\)")


def test_the_wait_line_is_documented_and_never_read_as_a_hit_rate_line() -> None:
    since = counted([0.001] * 10)
    line = waits.format_line(since.as_dict(), counted([0.001] * 10 + [0.2] * 10).as_dict(), rank=2)
    match = WAIT_LINE.fullmatch(line)
    assert match and line.startswith("[rank 2] "), line
    assert match.group(1, 5) == ("10", "20")
    assert "last_cycle_metrics" not in line and not LINE.search(line)
    example = ("data_wait last_cycle:([steps:120 wait_p50_ms:0.031 wait_p99_ms:14.672 wait_share:0.84%])  "
               "sum:([steps:2400 wait_p50_ms:0.029 wait_p99_ms:16.000 wait_share:1.12%])")
    assert WAIT_LINE.fullmatch(example)
    assert example in (REPO / "docs" / "cube_torch.md").read_text()


# -- the wait line next to the hit-rate line ------------------------------------------------


def test_report_once_prints_the_wait_line_after_the_hit_rate_line(
        daemon_counts: type[FakeControl], fresh_waits: waits.WaitCounter,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    daemon_counts.requests = 8
    assert reporter.report_once() is not None
    assert capsys.readouterr().out.count("data_wait") == 0, "no prefetcher step: no wait line"
    for _ in range(4):
        fresh_waits.add(0.01, 0.1)
    line = reporter.report_once()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0] == line and LINE.fullmatch(out[0])
    match = WAIT_LINE.fullmatch(out[1])
    assert match and match.group(1, 4, 5) == ("4", "10.00", "4"), out[1]
    # The daemon was told the same waits with the reads, for its per-job export.
    files, wait = daemon_counts.reported[-1]
    assert wait is not None and wait["steps"] == 4 and wait["wait_seconds"] == pytest.approx(0.04)
    fresh_waits.add(0.0, 0.1)
    current = cube_torch.stats()
    assert current is not None
    assert current["data_wait"]["since_last"]["steps"] == 1 and current["data_wait"]["cumulative"]["steps"] == 5
    # At exit (unless_idle): nothing new since the previous report, so neither line.
    assert reporter.report_once(unless_idle=True) is None and capsys.readouterr().out == ""


def test_without_a_daemon_the_wait_line_is_printed_alone(fresh_waits: waits.WaitCounter,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(submitter, "last_job", None)
    fresh_waits.add(0.002, 0.01)
    assert reporter.report_once() is None and cube_torch.stats() is None
    (line,) = capsys.readouterr().out.splitlines()
    assert WAIT_LINE.fullmatch(line) and "wait_share:20.00%" in line
    # At exit, no step since that line: no line saying 0 steps.
    monkeypatch.setattr(reporter, "_exit_reported_pid", 0)
    monkeypatch.setattr(reporter, "stop", lambda: None)
    reporter._report_at_exit(os.getpid())
    assert capsys.readouterr().out == ""
    fresh_waits.add(0.001, 0.01)
    monkeypatch.setattr(reporter, "_exit_reported_pid", 0)
    reporter._report_at_exit(os.getpid())
    assert "last_cycle:([steps:1 " in capsys.readouterr().out


# -- arguments ------------------------------------------------------------------------------


def one_line_error(kind: type[Exception], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(kind) as raised:
        DevicePrefetcher(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message and raised.value.__cause__ is None
    return message


def test_arguments_it_cannot_take_are_one_line_errors() -> None:
    assert "depth is a number of batches, 1 or more, not 0" in one_line_error(ValueError, [], "cpu", depth=0)
    assert "not 1.5" in one_line_error(ValueError, [], "cpu", depth=1.5)
    assert "timeout is a number of seconds above 0" in one_line_error(ValueError, [], "cpu", timeout=-1)
    assert "not 'mps'" in one_line_error(ValueError, [], "mps")
    assert "is not a device" in one_line_error(ValueError, [], "gpu0")
    assert "needs an iterable loader" in one_line_error(TypeError, 3, "cpu")
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in one_line_error(ValueError, [], "cuda")
    with pytest.raises(TypeError, match="^generator has no len\\(\\), so neither has its DevicePrefetcher$"):
        len(DevicePrefetcher((x for x in range(3)), "cpu"))
    assert len(DevicePrefetcher([1, 2, 3], "cpu")) == 3


def test_normalize_per_channel_in_the_inputs_units_and_channels_last() -> None:
    images = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    norm = normalize([123.675, 116.28, 103.53], [58.395, 57.12, 57.375], channels_last=True)
    out = norm(images)
    mean = torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1)
    std = torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1)
    assert out.dtype == torch.float32 and torch.allclose(out, (images.float() - mean) / std)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert normalize([0.5], [2.0], dtype=torch.float64)(torch.ones(1, 2, 2)).dtype == torch.float64
    with pytest.raises(ValueError, match="one value per channel"):
        normalize([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="divide by zero"):
        normalize([1.0], [0.0])
