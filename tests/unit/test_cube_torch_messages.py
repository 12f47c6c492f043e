"""The hit-rate line as a user reads it: sample-cache hits are hits of the job (also those
served in forked DataLoader workers), the exit line says something or nothing, and each
line is printed once whatever the user's logging setup.  The daemon's counts are faked."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cube_torch import reporter, shared
from cube_torch.client import PlanRequest, Submitter
from cube_torch.samples.dataset import CachedDataset
from tests.helpers import REPO
from tests.torch_datasets import LINE, keep
from tests.fakes import MemoryStore
from tests.reporter_fakes import FakeControl, daemon_counts  # noqa: F401  (the fixture)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")



def test_samples_served_by_a_cached_dataset_in_workers_are_hits_of_the_job(
        daemon_counts: type[FakeControl], capsys: pytest.CaptureFixture[str]) -> None:
    """Every sample comes from the cache (no file is opened: the daemon counts 0 requests):
    the line counts each as a request and a hit, also those served in forked workers."""
    store = MemoryStore()
    dataset = CachedDataset([torch.full((2,), float(i)) for i in range(12)], name="all-cached", store=store)
    assert len(dataset.__getitems__(list(range(12)))) == 12  # computed and stored in this process
    assert dataset.cache.flush(5)
    shared.forget()
    for _ in range(2):  # 2 epochs, 2 forked workers each: they inherit the filled store
        assert sum(len(b) for b in DataLoader(dataset, batch_size=3, num_workers=2, collate_fn=keep)) == 12
    line = reporter.report_once()
    assert line is not None and capsys.readouterr().out == line + "\n"
    match = LINE.fullmatch(line)
    assert match, line
    # last_cycle and sum: 24 requests, 24 hits, 100 %.
    assert match.group(1, 2, 3, 4) == ("24", "24", "0", "100.00"), line
    assert match.group(6, 7, 8, 9) == ("24", "24", "0", "100.00"), line
    daemon_counts.requests = 6  # then 6 file opens (hits) and 6 more samples from the cache
    shared.add_sample_hits(6)
    match = LINE.fullmatch(reporter.report_once() or "")
    assert match and match.group(1, 2, 6, 7) == ("12", "12", "36", "36")
    assert reporter.stats() is not None  # stats() says how many of the hits were samples
    assert reporter.with_sample_hits({"requests": 6, "hits": 5, "misses": 1}, 30)["sample_hits"] == 30


def test_a_training_after_another_in_the_process_counts_only_its_own_sample_hits(
        daemon_counts: type[FakeControl], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trainings one after the other in one process, each its own job: the line of the
    second counts the sample-cache hits since its first plan, not the first one's; its
    later epochs keep counting from that first plan."""
    plans = Submitter()
    monkeypatch.setattr(plans, "_run", lambda: None)  # queued, never sent: no daemon here

    def epoch(job: str, hits: int) -> None:
        plans.submit(PlanRequest("v", None, np.arange(hits), 0, 0, job))  # before its first sample
        shared.add_sample_hits(hits)  # as its CachedDataset serves them

    epoch("first", 10)
    epoch("job", 4)  # the fixture's job, the one the line reports
    match = LINE.fullmatch(reporter.report_once() or "")
    assert match and match.group(6, 7) == ("4", "4"), match
    epoch("job", 3)
    match = LINE.fullmatch(reporter.report_once() or "")
    assert match and match.group(1, 6) == ("3", "7"), match


def test_the_exit_line_is_left_out_when_nothing_was_read_since_the_last_line(
        daemon_counts: type[FakeControl], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(reporter, "_exit_reported_pid", 0)
    daemon_counts.requests = 48
    assert reporter.report_once() is not None  # an epoch's end line: everything so far
    capsys.readouterr()
    reporter._report_at_exit(os.getpid())
    assert capsys.readouterr().out == "", "an exit line of 'request_count:0 ... hit_rate:0.00%'"
    # Something read after the last line: the exit line says so.
    monkeypatch.setattr(reporter, "_exit_reported_pid", 0)
    daemon_counts.requests = 50
    reporter._report_at_exit(os.getpid())
    match = LINE.fullmatch(capsys.readouterr().out.strip())
    assert match and match.group(1, 4, 6) == ("2", "100.00", "50")


def test_an_exit_line_without_an_earlier_line_is_printed(daemon_counts: type[FakeControl],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(reporter, "_exit_reported_pid", 0)
    daemon_counts.requests = 7
    reporter._report_at_exit(os.getpid())
    assert "request_count:7 " in capsys.readouterr().out


# A job's line under a given logging setup, in a fresh interpreter (logging is process-wide).
PRINT_ONE_LINE = """
import logging, sys
from cube_torch import reporter
setup = sys.argv[1]
if setup == "basic-stdout":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
elif setup == "basic-stderr":
    logging.basicConfig(level=logging.INFO)
elif setup == "basic-warning":
    logging.basicConfig(level=logging.WARNING)
elif setup == "own-handler":
    handler = logging.StreamHandler(sys.stdout)
    logging.getLogger("cube_torch").addHandler(handler)
    logging.getLogger("cube_torch").setLevel(logging.INFO)
elif setup == "file":
    logging.basicConfig(level=logging.INFO, filename=sys.argv[2])
counts = {"requests": 5, "hits": 5, "misses": 0, "stall_seconds": 0.0}
reporter.stats = lambda timeout=5.0: {"job": "j", "rank": 0, "world_size": 1, "cumulative": counts,
                                      "since_last": counts, "plan": None}
reporter.report_once()
"""


@pytest.mark.parametrize("setup", ["none", "basic-stdout", "basic-stderr", "basic-warning", "own-handler", "file"])
def test_each_line_is_printed_once_whatever_the_logging_setup(setup: str, tmp_path: Path) -> None:
    log_file = tmp_path / "train.log"
    result = subprocess.run([sys.executable, "-c", PRINT_ONE_LINE, setup, str(log_file)], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = (result.stdout + result.stderr).count("last_cycle_metrics")
    assert shown == 1, (setup, result.stdout, result.stderr)
    if setup == "file":  # logged to the file and printed on the console, once each
        assert log_file.read_text().count("last_cycle_metrics") == 1
        assert "last_cycle_metrics" in result.stdout


def test_the_console_check_follows_handlers_levels_and_propagation() -> None:
    logger = logging.getLogger("cube_torch.test-console")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        assert not reporter._on_console(logger)
        handler = logging.StreamHandler(sys.stderr)
        logger.addHandler(handler)
        assert reporter._on_console(logger)
        handler.setLevel(logging.WARNING)
        assert not reporter._on_console(logger)
        logger.removeHandler(handler)
        logger.addHandler(logging.NullHandler())
        assert not reporter._on_console(logger)
    finally:
        logger.handlers.clear()
