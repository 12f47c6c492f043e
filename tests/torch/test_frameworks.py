"""cube_torch under the frameworks people train with, over a real ai_prefetch mount.

Each case trains a tiny model for two epochs over 64 small files with the framework's own
loop and launcher (tests/framework_training.py): PyTorch Lightning on one CPU device and
with ``ddp_spawn`` on two CPU processes (gloo), Hugging Face Accelerate through
``Accelerator.prepare`` in one process and in two (``notebook_launcher``), and DeepSpeed's
own data loader (``deepspeed.initialize(training_data=...)``) in two ranks under torchrun.

Every case runs twice: once without cube_torch (the reference, reading the source folder
directly, so the daemon's cache stays cold) and once with ``import cube_torch`` reading
the mount.  Per rank and epoch it checks:

* the samples (index, crc32 of the bytes, size) equal the reference's, in order, and each
  epoch's samples over all ranks are the dataset's files, each once, with their real bytes;
* the ranks are one job: the same job name in every rank (torchrun's run id, else the
  name the ranks agreed on in the process group's store), and ``cubefs-fuse status``,
  taken by rank 0 while every rank is alive, shows that job with ranks 0..n-1, each with
  its own pid and a plan of its last epoch (as many files as the rank read in it);
* the daemon counted every rank's opens: after epoch 0 at most one per sample (opens made
  before the job's registration reached the daemon are not the job's), from epoch 1 exactly
  one per sample, with a hit rate >= 99 % (the bar of tests/torch/test_cube_torch_mount.py);
* each rank printed hit-rate lines, named ``[rank R]`` when the world size is > 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import REPO, Mount, force_unmount, free_port
from tests.torch_datasets import LINE

FILES = 64  # per case: 16 batches of 4, 8 per rank with two ranks
EPOCHS = 2
HIT_RATE_BAR = 0.99  # from epoch 1 on, as in test_cube_torch_mount.py
RUN_TIMEOUT = 300  # seconds for one training run (a few seconds to a minute on 2 loaded cores)


@dataclass(frozen=True)
class Case:
    name: str  # tests/framework_training.py's CASES key
    world: int
    torchrun: bool = False  # started by torchrun --standalone (else: python -m, the framework starts ranks)


CASES = [
    Case("lightning", 1),
    Case("lightning_ddp_spawn", 2),
    Case("accelerate", 1),
    Case("accelerate_notebook_launcher", 2),
    Case("deepspeed_torchrun", 2, torchrun=True),
]


@dataclass
class Volume:
    mount: Mount
    name: str
    files: dict[str, dict[str, bytes]]  # case -> file name -> bytes

    def client(self) -> ControlClient:
        return ControlClient(read_volume_config(self.name).control_socket, timeout=10)


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Volume]:
    """One ai_prefetch daemon; each case reads files of its own (a cold cache per case)."""
    base = tmp_path_factory.mktemp("frameworks")
    port = free_port()
    name = f"frameworks{port}"  # unique: cube_torch finds the daemon by /tmp/cube_torch.config.<name>
    m = Mount(base, base / "source", base / "mnt", base / "cache", base / "client.json", port,
              {"profile": "ai_prefetch", "volName": name, "memCacheSize": "64MiB"})
    for d in (m.source, m.mount_point):
        d.mkdir(parents=True)
    rng = np.random.default_rng(7)
    files: dict[str, dict[str, bytes]] = {}
    for case in CASES:
        files[case.name] = {}
        for i in range(FILES):
            rel = f"{case.name}/c{i % 4}/{i:03d}.bin"  # 2-16 KiB of noise each, JPEG-sized
            data = rng.bytes(int(rng.integers(2_000, 16_000)))
            (m.source / rel).parent.mkdir(parents=True, exist_ok=True)
            (m.source / rel).write_bytes(data)
            files[case.name][rel] = data
    try:
        m.mount()
        yield Volume(m, name, files)
        m.umount()
    finally:
        force_unmount(m)


def train(case: Case, volume: Volume, out: Path, cube_torch: bool) -> tuple[list[dict[str, Any]], str]:
    """One training run: each rank's record (by rank) and the run's standard output."""
    out.mkdir()
    names = sorted(volume.files[case.name])
    spec: dict[str, Any] = {"names": names, "out": str(out), "epochs": EPOCHS}
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUBE_TORCH_JOB", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                        "LOCAL_RANK", "VOL_NAME", "FRAMEWORK_TEST_CUBE_TORCH")}
    env["PYTHONPATH"] = str(REPO)
    if cube_torch:
        spec.update(root=str(volume.mount.mount_point), mount=str(volume.mount.mount_point),
                    baseline=volume.client().status()["hits"]["requests"])
        # The periodic line off: each rank prints at its epochs' ends and at exit only.
        env.update(FRAMEWORK_TEST_CUBE_TORCH="1", VOL_NAME=volume.name, CUBE_TORCH_METRICS_INTERVAL="3600")
    else:
        spec["root"] = str(volume.mount.source)
    if case.torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.world}"]
    else:
        launcher = [sys.executable]
    result = subprocess.run([*launcher, "-m", "tests.framework_training", case.name, json.dumps(spec)],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-6000:])
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(case.world)]
    assert sorted(p.name for p in out.iterdir()) == [f"rank{r}.json" for r in range(case.world)]
    return records, result.stdout


def check_samples(case: Case, volume: Volume, reference: list[dict[str, Any]], planned: list[dict[str, Any]]) -> None:
    names = sorted(volume.files[case.name])
    truth = [[i, zlib.crc32(volume.files[case.name][n]), len(volume.files[case.name][n])] for i, n in enumerate(names)]
    for rank in range(case.world):
        assert (reference[rank]["rank"], reference[rank]["world"]) == (rank, case.world)
        assert (planned[rank]["rank"], planned[rank]["world"]) == (rank, case.world)
        for epoch in range(EPOCHS):
            # Exactly the reference's samples, in the reference's order, per rank and epoch.
            assert planned[rank]["epochs"][epoch] == reference[rank]["epochs"][epoch], (rank, epoch)
    for epoch in range(EPOCHS):
        seen = sorted(s for record in planned for s in record["epochs"][epoch])
        assert seen == truth, epoch  # every file once per epoch over all ranks, with its real bytes
    orders = [tuple(s[0] for s in planned[0]["epochs"][e]) for e in range(EPOCHS)]
    assert orders[0] != orders[1], "the loader shuffles: a new order every epoch"


def check_one_job(case: Case, volume: Volume, planned: list[dict[str, Any]]) -> str:
    """Every rank ran as one job; rank 0's `cubefs-fuse status` shows its ranks and their plans."""
    job: str
    [job] = {record["job"] for record in planned}
    for rank, record in enumerate(planned):
        stats = record["stats"]
        assert (stats["job"], stats["rank"], stats["world_size"]) == (job, rank, case.world)
    if case.torchrun:
        [run_id] = {record["run_id"] for record in planned}
        assert run_id and run_id != "none" and job == re.sub(r"[^A-Za-z0-9_.:@-]", "_", run_id)[:128]
    else:  # the first rank to ask named the job after itself (one rank: this process)
        assert job in {f"{record['host']}-{record['pid']}" for record in planned}
    status = json.loads(planned[0]["status"])
    [report] = status
    rows = sorted((j for j in report["jobs"] if j["job"] == job), key=lambda j: j["rank"])
    assert [(j["rank"], j["pid"]) for j in rows] == [(r, planned[r]["pid"]) for r in range(case.world)]
    plans = {p["rank"]: p for p in report["plans"] if p["job"] == job}
    assert sorted(plans) == list(range(case.world)), "a plan per rank"
    for rank, plan in plans.items():
        # The rank's last epoch, one file per sample.  (How far the daemon matched its opens
        # to the plan depends on whether the plan arrived before them: not checked here.)
        assert (plan["epoch"], plan["samples"]) == (EPOCHS - 1, len(planned[rank]["epochs"][-1])), plan
    table = planned[0]["status_table"]
    if case.world > 1:
        ranks = ", ".join(str(r) for r in range(case.world))
        assert f"job {job}: {case.world} ranks ({ranks}), {case.world} planned," in table, table
    for rank in range(case.world):
        assert re.search(rf"{re.escape(job)}\s+{rank}\s+{planned[rank]['pid']}\s", table), table
    return job


def check_hit_rates(case: Case, planned: list[dict[str, Any]]) -> list[list[tuple[int, int]]]:
    """Per rank and epoch (requests, hits) from the daemon's counters of (job, rank)."""
    per_rank = []
    for rank, record in enumerate(planned):
        cumulative = [(c["requests"], c["hits"]) for c in record["counters"]]
        assert len(cumulative) == EPOCHS
        epochs = [cumulative[0]] + [(b[0] - a[0], b[1] - a[1]) for a, b in zip(cumulative, cumulative[1:])]
        reads = [len(e) for e in record["epochs"]]
        assert 0 < epochs[0][0] <= reads[0], (rank, epochs, reads)  # opens before registration are no job's
        for epoch in range(1, EPOCHS):
            requests, hits = epochs[epoch]
            assert requests == reads[epoch], (rank, epoch, epochs, reads)
            assert hits / requests >= HIT_RATE_BAR, (rank, epoch, epochs)
        per_rank.append(epochs)
    return per_rank


def check_lines(case: Case, stdout: str, planned: list[dict[str, Any]]) -> None:
    """Each rank printed its lines ([rank R] in front in a distributed job), from its own counters."""
    lines = [line for line in stdout.splitlines() if "last_cycle_metrics" in line]
    by_rank: dict[int, list[re.Match[str]]] = {}
    for line in lines:
        match = LINE.fullmatch(line)
        assert match, line
        prefix = re.match(r"\[rank (\d+)\] ", line)
        assert (prefix is not None) == (case.world > 1), line
        by_rank.setdefault(int(prefix.group(1)) if prefix else 0, []).append(match)
    assert sorted(by_rank) == list(range(case.world)), lines
    for rank, matches in by_rank.items():
        final = planned[rank]["counters"][-1]["requests"]
        # An epoch's line is printed while its last releases may still be on their way;
        # the exit line (printed last by each rank) counts them all.
        assert int(matches[-1].group(6)) == final, (rank, [m.group(0) for m in matches], final)
        assert all(int(m.group(6)) <= final for m in matches)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_framework_training_is_planned_per_rank(case: Case, volume: Volume, tmp_path: Path) -> None:
    reference, _ = train(case, volume, tmp_path / "reference", cube_torch=False)
    planned, stdout = train(case, volume, tmp_path / f"planned-{uuid.uuid4().hex[:6]}", cube_torch=True)
    check_samples(case, volume, reference, planned)
    job = check_one_job(case, volume, planned)
    per_rank = check_hit_rates(case, planned)
    check_lines(case, stdout, planned)
    rates = [[f"{100 * h / r:.1f}% of {r}" for r, h in epochs] for epochs in per_rank]
    print(f"\n{case.name}: job {job}, hit rate per rank and epoch: {rates}")
