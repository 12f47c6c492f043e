"""A training job reads on while its mount goes to a new daemon: handed over (``cubefs-fuse
upgrade``, control/handover.py), or after its daemon was SIGKILLed (the keeper starts one that
recovers the mount, control/keeper.py), with cube_torch installed: real DataLoader workers over
a slow source (slowfs, 2 ms per operation), the fast path as cube_torch uses it.

The upgrade or the kill comes in the middle of the first epoch (a kill once the NVMe tier has
written what was fetched: blocks still on their way to it die with the daemon); "kill
mid-miss" makes the source hang first, so that the daemon dies with the requests the workers
and the prefetch are waiting on (the kernel sends those again to the new daemon).  Every sample of both epochs must come
with its file's bytes (no failed read), cube_torch must send the new daemon the rest of
the epoch (the new daemon has the job and a plan without a new epoch starting), and the
second epoch must be served from the cache the old daemon filled: every file request a
hit, no read of the source.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import tests.torchvision_shim  # noqa: F401  (before torchvision: see the module)
from torchvision import datasets  # type: ignore[import-untyped]  # noqa: E402

import cube_torch
from cube_torch import client as ct_client
from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import Mount, cli, kill_daemon, nvme_written, wait_until, waits_on_fuse
from tests.torch_datasets import keep

CLASSES, PER_CLASS = 4, 40
FILE = 16 * 1024
# Seconds per training step (40 steps an epoch): the upgrade (a new daemon's start, ~2 s)
# and cube_torch's look at the volume file (every WATCH_EVERY) fit in the first epoch.
STEP = 0.15


def path_and_bytes(path: str) -> tuple[str, bytes]:
    with open(path, "rb") as f:
        return path, f.read()


def _kill(mount: Mount, source: Any = None) -> CompletedProcess[str]:
    """SIGKILL the daemon once its NVMe writes are done; returns when a new one serves.
    With ``source`` (the slowfs process), the source hangs first, as soon as the epoch's
    plan is sent: the daemon dies with the misses in flight that the prefetch and the
    workers were waiting on, once what it had fetched before the hang is on NVMe (nothing
    the loop has received is lost with it)."""
    old = mount.pid()
    if source is None:
        nvme_written(mount)
        kill_daemon(mount)
    else:
        fetched = source.stats()["ops"].get("read", 0)
        assert fetched < CLASSES * PER_CLASS, "the epoch's files were all fetched already: no miss to be in flight"
        print(f"\n{fetched} source reads when the source hung and the daemon was killed")
        source.hang()
        try:
            # The prefetch ahead of the workers waits on the source now.
            wait_until(lambda: waits_on_fuse(old), 30, "the daemon to ask the hung source")
            nvme_written(mount)  # the fetches before the hang: their write-behind is local
            kill_daemon(mount, after_death=source.resume)
        finally:
            source.resume()
    return CompletedProcess(["kill", str(old)], 0, f"killed {old}", "")


def _training_mount(make_slow_mount: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The slow mount of the dataset (mounted), cube_torch installed for its volume."""
    slow = make_slow_mount(latency_us=2000, profile="ai_prefetch")
    rng = random.Random(23)
    for c in range(CLASSES):
        for i in range(PER_CLASS):
            path = slow.real / f"class{c}" / f"{i:02d}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rng.randbytes(FILE))
    slow.mount.mount()
    monkeypatch.setenv("VOL_NAME", slow.mount.config()["volName"])
    monkeypatch.setenv("CUBE_TORCH_JOB", f"upgrade-{os.getpid()}")
    monkeypatch.setattr(ct_client, "_warned", set())
    cube_torch.install()
    return slow


@pytest.mark.parametrize("how", ["upgrade", "kill", "kill mid-miss"])
def test_training_reads_on_through_a_new_daemon_and_its_plan_follows(make_slow_mount: Callable[..., Any],
                                                                      monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    slow = _training_mount(make_slow_mount, monkeypatch)
    name = slow.mount.config()["volName"]
    old = slow.mount.pid()
    mount_point = slow.mount.mount_point
    try:
        dataset = datasets.DatasetFolder(str(mount_point), loader=path_and_bytes, extensions=(".bin",))
        torch.manual_seed(5)
        loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=keep)
        upgrade: list[CompletedProcess[str]] = []
        replans = ct_client.submitter.replans
        seen: list[str] = []
        for epoch in range(2):
            started = None
            if epoch == 0 and how == "kill mid-miss":
                plans = ct_client.submitter.plans_sent

                def kill_once_planned() -> None:
                    wait_until(lambda: ct_client.submitter.plans_sent > plans, 30, "epoch 0's plan")
                    upgrade.append(_kill(slow.mount, slow.slowfs))

                started = threading.Thread(target=kill_once_planned)
                started.start()
            for n, batch in enumerate(loader):
                for (path, data), _ in batch:
                    real = slow.real / Path(path).relative_to(mount_point)
                    assert data == real.read_bytes(), f"epoch {epoch}: {path} came with other bytes"
                    seen.append(path)
                time.sleep(STEP)  # the training step: the epoch outlasts the upgrade
                if epoch == 0 and n == 5 and how != "kill mid-miss":  # a few batches in: to a new daemon
                    started = threading.Thread(target=lambda: upgrade.append(
                        cli("upgrade", str(mount_point)) if how == "upgrade" else _kill(slow.mount)))
                    started.start()
            if started is not None:
                started.join(timeout=120)
                result = upgrade[0]
                assert result.returncode == 0, result.stderr + slow.mount.log()
                new = slow.mount.pid()
                assert new != old
                control = ControlClient(read_volume_config(name).control_socket, timeout=10)
                # The rest of epoch 0 reached the new daemon without a new epoch starting.
                assert ct_client.submitter.replans > replans
                jobs = control.status()["jobs"]
                assert [j["job"] for j in jobs] == [f"upgrade-{os.getpid()}"] and jobs[0]["loaders"] == 1, jobs
                remote_before = slow.slowfs.stats()["ops"].get("read", 0)
                hits_before = control.status()["hits"]
        assert len(seen) == 2 * CLASSES * PER_CLASS
        # Epoch 1, entirely on the new daemon: the cache the old one filled serves it.
        wait_until(lambda: control.status()["hits"]["requests"] - hits_before["requests"] >= CLASSES * PER_CLASS,
                   what="the new daemon to count epoch 1's file requests")
        hits = control.status()["hits"]
        assert hits["hits"] - hits_before["hits"] == hits["requests"] - hits_before["requests"], (hits_before, hits)
        assert slow.slowfs.stats()["ops"].get("read", 0) == remote_before, "epoch 1 read data from the source"
        print(f"\n{how} during epoch 0: {result.stdout.strip()}")
    finally:
        if slow.mount.mounted:
            slow.mount.umount()


DEATHS = 10  # in a row, while the job trains


def test_training_reads_on_through_ten_daemon_deaths_in_a_row(make_slow_mount: Callable[..., Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon is SIGKILLed ten times while epochs run, each time once the standby that
    recovers it is ready: every epoch gives every file once, with its bytes; the epoch after
    the last death is served from the cache the dead daemons filled (all hits, no source
    read), and the job's hit counts go on in the last daemon."""
    slow = _training_mount(make_slow_mount, monkeypatch)
    mount_point = slow.mount.mount_point
    deaths: list[CompletedProcess[str]] = []
    failure: list[BaseException] = []

    def kill_ten_times() -> None:
        try:
            while len(deaths) < DEATHS:
                # One standby per daemon so far (the first mount's, then one per recovery).
                wait_until(lambda: slow.mount.log().count("standby daemon pid") > len(deaths), 60, "a standby")
                deaths.append(_kill(slow.mount))
        except BaseException as exc:  # noqa: BLE001 - the main thread asserts it
            failure.append(exc)

    killer = threading.Thread(target=kill_ten_times)
    try:
        dataset = datasets.DatasetFolder(str(mount_point), loader=path_and_bytes, extensions=(".bin",))
        loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=keep)
        everything = sorted(path for path, _ in dataset.samples)
        killer.start()
        epochs, last_epoch_done = 0, False
        while not last_epoch_done:
            after_the_last = len(deaths) == DEATHS  # this epoch starts after the last death
            if after_the_last:
                control = ControlClient(read_volume_config(slow.mount.config()["volName"]).control_socket, timeout=10)
                remote_before = slow.slowfs.stats()["ops"].get("read", 0)
                hits_before = control.status()["hits"]
            seen = []
            for batch in loader:
                for (path, data), _ in batch:
                    real = slow.real / Path(path).relative_to(mount_point)
                    assert data == real.read_bytes(), f"epoch {epochs}: {path} came with other bytes"
                    seen.append(path)
                time.sleep(STEP / 3)
            assert sorted(seen) == everything, f"epoch {epochs}"
            epochs += 1
            last_epoch_done = after_the_last
            assert not failure, failure
        killer.join(timeout=60)
        wait_until(lambda: control.status()["hits"]["requests"] - hits_before["requests"] >= len(everything),
                   what="the last daemon to count the last epoch's file requests")
        hits = control.status()["hits"]
        assert hits["hits"] - hits_before["hits"] == hits["requests"] - hits_before["requests"], (hits_before, hits)
        assert slow.slowfs.stats()["ops"].get("read", 0) == remote_before, "the last epoch read from the source"
        pauses = sorted(int(ms) for ms in re.findall(r"died .*readers paused (\d+) ms", slow.mount.log()))
        assert len(pauses) == DEATHS
        print(f"\n{DEATHS} deaths over {epochs} epochs: readers paused {pauses[0]}-{pauses[-1]} ms "
              f"(median {pauses[len(pauses) // 2]})")
    finally:
        deaths.extend([CompletedProcess([], 0)] * DEATHS)  # the killer stops
        killer.join(timeout=60)
        if slow.mount.mounted:
            slow.mount.umount()
