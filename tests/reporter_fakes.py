"""The daemon's counters of one job, faked for the reporter's tests: what GET /v1/stats
answers, and a fixture that points cube_torch's reporter at them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cube_torch import reporter, shared
from cube_torch.client import JobIdentity, submitter
from cubefs_fuse.control.protocol import VolumeConfig


class FakeControl:
    """The daemon's answer to GET /v1/stats of the job: ``requests`` file opens, all hits."""

    requests = 0
    reported: list[tuple[int, dict[str, float | int] | None]] = []

    def __init__(self, socket_path: str, timeout: float) -> None:
        pass

    def report_reads(self, job: str, rank: int, files: int,
                     data_wait: dict[str, float | int] | None = None) -> dict[str, Any]:
        """The daemon takes the job's read count (cumulative) and step waits; kept for the tests."""
        FakeControl.reported.append((files, data_wait))
        return {}

    def stats(self, job: str) -> dict[str, Any]:
        n = FakeControl.requests
        return {"jobs": [{"rank": 0, "cumulative": {"requests": n, "hits": n, "misses": 0, "stall_seconds": 0.0}}]}


@pytest.fixture
def daemon_counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeControl]]:
    """A job the (fake) daemon knows, no sample-cache hits yet, no line printed yet."""
    volume = VolumeConfig(prof=0, mount_point="/mnt/x", vol_name="v", local_ip="", control_socket="/nowhere", pid=1)
    monkeypatch.setattr(reporter, "read_volume_config", lambda name: volume)
    monkeypatch.setattr(reporter, "ControlClient", FakeControl)
    monkeypatch.setattr(submitter, "last_job", JobIdentity("job", 0, 1, "v"))
    monkeypatch.setattr(reporter, "_previous", {})
    monkeypatch.setattr(FakeControl, "requests", 0)
    monkeypatch.setattr(FakeControl, "reported", [])
    shared.forget()
    yield FakeControl
    shared.forget()
