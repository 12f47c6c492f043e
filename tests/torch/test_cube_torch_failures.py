"""cube_torch never hurts training: daemon absent, erroring, hanging, talking nonsense or
killed mid-epoch.  Each case trains 3 epochs with 2 real worker processes and checks:
the samples equal those of the same loader without cube_torch (same seed), exactly one
warning is logged, and nothing is left behind once the loader is garbage-collected (no
``cube_torch-*`` thread, no worker process).

"No stall" is shown causally rather than with a stopwatch: the fake daemons hold every
request until the test releases them, and training must have finished all its epochs
while the daemon had not answered anything.
"""

from __future__ import annotations

import gc
import http.server
import json
import os
import signal
import socketserver
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import cube_torch
from cube_torch import client as ct_client
from cube_torch import reporter
from cube_torch.client import JobIdentity, submitter
from cubefs_fuse import mounts
from cubefs_fuse.control.protocol import VolumeConfig, config_file_path
from tests.helpers import Mount, kill_for_good, wait_until
from tests.torch_datasets import ListDataset, keep

SEED = 77
EPOCHS = 3
FILES = 20


def children() -> set[int]:
    """Live child processes of this process (any thread's)."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            found.update(int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split())
        except OSError:
            pass
    return found


def cube_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cube_torch-")]


@pytest.fixture
def quick_exit(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[str]:
    """Background threads that give up quickly once idle, warnings re-armed, a fresh job."""
    reporter.stop()  # a reporter from an earlier test may sleep on a longer interval
    assert submitter.wait_idle(30)
    # Read at each wait: a plan thread left by an earlier test adopts it after its next plan.
    monkeypatch.setattr(ct_client, "IDLE_EXIT", 0.2)  # seconds: the plan thread's idle exit
    monkeypatch.setenv("CUBE_TORCH_METRICS_INTERVAL", "0.2")  # seconds: the reporter's tick
    monkeypatch.setattr(ct_client, "_warned", set())
    monkeypatch.setattr(submitter, "last_job", None)  # no daemon has accepted a plan of this test
    monkeypatch.setenv("CUBE_TORCH_JOB", f"{request.node.name[:60]}-{os.getpid()}".replace("[", "_").replace("]", ""))
    cube_torch.install()
    yield f"cf{os.getpid()}{abs(hash(request.node.name)) % 10**6}"  # a volume name nobody serves
    cube_torch.install()


def make_files(directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(FILES):
        path = directory / f"{i:02d}.txt"
        path.write_text(f"sample {i}")
        paths.append(str(path))
    return paths


def train(dataset: Dataset[Any], during: Callable[[int, int], None] = lambda epoch, step: None) -> list[Any]:
    """3 epochs, shuffled, 2 workers; ``during(epoch, step)`` runs after each batch."""
    torch.manual_seed(SEED)
    loader = DataLoader(dataset, batch_size=3, shuffle=True, num_workers=2, collate_fn=keep)
    samples = []
    for epoch in range(EPOCHS):
        for step, batch in enumerate(loader):
            samples.append(batch)
            during(epoch, step)
    return samples


def reference(dataset: Dataset[Any]) -> list[Any]:
    cube_torch.uninstall()
    try:
        return train(dataset)
    finally:
        cube_torch.install()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cube_torch" and r.levelname == "WARNING"]


def assert_nothing_left(children_before: set[int]) -> None:
    """After the loader is gone: cube_torch's threads exit and no worker survives."""
    gc.collect()
    wait_until(lambda: not cube_threads(), timeout=10, what=f"cube_torch threads to exit: {cube_threads()}")
    wait_until(lambda: children() <= children_before, timeout=10, what="worker processes to exit")


# -- no daemon -----------------------------------------------------------------------------------


def test_daemon_absent(quick_exit: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                       tmp_path: Path) -> None:
    monkeypatch.setenv("VOL_NAME", quick_exit)
    assert not os.path.exists(config_file_path(quick_exit))
    dataset = ListDataset(make_files(tmp_path / "data"))
    expected = reference(dataset)
    before, sent = children(), submitter.plans_sent
    assert train(dataset) == expected
    assert submitter.wait_idle(30)
    assert submitter.plans_sent == sent and cube_torch.stats() is None
    (warning,) = warnings_of(caplog)
    assert "no cubefs-fuse daemon serves this volume" in warning and quick_exit in warning
    assert "training continues" in warning and "Volumes served here: " in warning
    assert_nothing_left(before)


# -- a fake daemon that answers errors, nonsense or nothing ---------------------------------------


class FakeDaemon:
    """A control socket that holds each request until ``release()``, then answers it
    with ``status`` (JSON error), with bytes that are not HTTP, or not at all."""

    def __init__(self, path: str, answer: int | str) -> None:
        self.path, self.answer = path, answer
        self.released = threading.Event()
        self.received = 0
        self.answered = 0
        self.requests: list[str] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                self.rfile.read(length)
                fake.received += 1
                fake.requests.append(f"{self.command} {self.path.split('?')[0]}")
                fake.released.wait()
                if fake.answer == "hang":
                    return  # close without a word
                if fake.answer == "garbage":
                    self.wfile.write(b"SPDY/9 lol\r\n\r\n")
                else:
                    body = json.dumps({"error": "injected by the test"}).encode()
                    self.send_response(int(fake.answer))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                fake.answered += 1

            do_GET = do_POST = handle_one

            def log_message(self, *args: Any) -> None:
                pass

        self.server = socketserver.ThreadingUnixStreamServer(path, Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-daemon", daemon=True)

    def __enter__(self) -> FakeDaemon:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        os.unlink(self.path)


def write_volume_config(vol_name: str, socket_path: str, mount_point: str) -> str:
    """What a daemon would write (docs/ai_prefetch.md), by hand: mode 0644, owned by us."""
    config = VolumeConfig(prof=0, mount_point=mount_point, vol_name=vol_name, local_ip="127.0.0.1",
                          control_socket=socket_path, pid=os.getpid())
    path = config_file_path(vol_name)
    with open(path, "w") as f:
        f.write(config.to_json())
    os.chmod(path, 0o644)
    return path


@pytest.mark.parametrize("answer", [500, 503, 400, 403, 404, "garbage", "hang"])
def test_fake_daemon_errors(answer: int | str, quick_exit: str, monkeypatch: pytest.MonkeyPatch,
                            caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    # Long enough that no request times out while the fake holds it (the hang case
    # instead times out fast, once released: it never answers).
    monkeypatch.setattr(ct_client, "REQUEST_TIMEOUT", 0.5 if answer == "hang" else 60.0)
    data = tmp_path / "volume"
    dataset = ListDataset(make_files(data))
    expected = reference(dataset)
    monkeypatch.setenv("VOL_NAME", quick_exit)
    config = write_volume_config(quick_exit, str(tmp_path / "control.sock"), str(data))
    try:
        with FakeDaemon(str(tmp_path / "control.sock"), answer) as fake:
            before = children()
            samples = train(dataset)
            # Training finished every epoch while the daemon held its first request unanswered.
            assert fake.received >= 1 and fake.answered == 0
            assert samples == expected
            fake.released.set()
            assert submitter.wait_idle(30)
            # Each epoch tried again (the daemon may have recovered); it warned once.
            assert fake.received >= EPOCHS if answer != "hang" else fake.received >= 1
            # One bounded synchronous job registration (JOB_REGISTRATION_TIMEOUT) before the first
            # index, then only file-list registrations: no plan is sent before a list id.
            assert fake.requests.count("POST /v1/jobs") <= 1
            assert all(r in ("POST /v1/datasets", "POST /v1/jobs") for r in fake.requests)
            (warning,) = warnings_of(caplog)
            assert "training continues" in warning
            if isinstance(answer, int):
                assert str(answer) in warning
            assert submitter.last_job is None and cube_torch.stats() is None  # no plan was accepted
            assert_nothing_left(before)
    finally:
        os.unlink(config)


def test_stats_is_none_when_the_daemon_talks_nonsense(quick_exit: str, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """``cube_torch.stats()`` (user code calls it) returns None, never raises."""
    config = write_volume_config(quick_exit, str(tmp_path / "control.sock"), str(tmp_path))
    monkeypatch.setattr(submitter, "last_job", JobIdentity("job", 0, 1, quick_exit))
    try:
        with FakeDaemon(str(tmp_path / "control.sock"), "garbage") as fake:
            fake.released.set()
            assert cube_torch.stats() is None
            assert cube_torch.report_once() is None
            assert fake.requests == ["GET /v1/stats", "GET /v1/stats"]
    finally:
        os.unlink(config)


# -- the real daemon, killed mid-epoch -------------------------------------------------------------


class SourceBacked(Dataset[bytes]):
    """Plans the mount's paths, reads the same files from the source directory: the data
    path does not depend on the daemon, so only cube_torch's side is under test."""

    def __init__(self, mount_point: Path, source: Path, names: list[str]) -> None:
        self.mounted = [str(mount_point / n) for n in names]
        self.source = [str(source / n) for n in names]

    def train_data_list(self) -> np.ndarray:
        return np.array(self.mounted)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> bytes:
        with open(self.source[i], "rb") as f:
            return f.read()


def test_daemon_killed_mid_epoch(make_mount: Callable[..., Mount], quick_exit: str, monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 during epoch 0.  The mount dies with it (its reads fail), so the data are read
    from the source; cube_torch's side must not notice beyond one warning: the same samples,
    every epoch, no hang, nothing left behind."""
    m = make_mount(profile="ai_prefetch")
    name = m.config()["volName"]
    names = [Path(p).name for p in make_files(m.source)]
    m.mount()
    monkeypatch.setenv("VOL_NAME", name)
    dataset = SourceBacked(m.mount_point, m.source, names)
    expected = reference(dataset)
    pid = m.pid()
    info = mounts.registered(str(m.mount_point)) or {}
    killed: list[int] = []

    def kill_after_first_batch(epoch: int, step: int) -> None:
        if (epoch, step) == (0, 0):
            assert submitter.wait_idle(30)  # epoch 0's plan reached the daemon ...
            assert submitter.plans_sent >= 1 and submitter.last_job is not None
            kill_for_good(info)  # ... which dies mid-epoch, with its keeper: the mount for good
            with pytest.raises(OSError):
                os.close(os.open(m.mount_point / names[1], os.O_RDONLY))  # the mount is dead
            killed.append(pid)

    before = children()
    try:
        sent = submitter.plans_sent
        assert train(dataset, kill_after_first_batch) == expected
        assert killed == [pid]
        assert submitter.wait_idle(30)
        assert submitter.plans_sent == sent + 1  # epochs 1 and 2 found nobody
        (warning,) = warnings_of(caplog)
        assert "training continues" in warning
        assert cube_torch.stats() is None  # the reporter's source is gone too: no line, no error
        assert_nothing_left(before)
    finally:
        config = config_file_path(name)
        if os.path.exists(config):
            os.unlink(config)  # a killed daemon cannot remove its own file
