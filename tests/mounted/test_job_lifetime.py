"""Jobs end ("Jobs end", docs/concurrency.md): a job ends when its process exits, its plan
and per-job metric series go with it; a plan nobody registered a job for ends when idle.

Each training run is a short-lived subprocess that does what cube_torch does over the
control socket (register the dataset, register the job with its own pid through
SO_PEERCRED, submit a plan) and then reads a few planned files through the mount.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import REPO, Mount, cli, wait_until, write_tree

FILES = 32
RUNS = 100
# RSS may move by allocator noise (arenas, the metadata cache warming up); a leak of a
# job, a plan and its index per run would still be far below this, which is why the
# job, plan and series counts are the exact checks and RSS only the coarse one.
RSS_NOISE = 24 * 1024 * 1024

RUN = r"""
import array, os, sys
from cubefs_fuse.control.protocol import ControlClient
socket_path, mount_point, name, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
client = ControlClient(socket_path)
dataset = client.register_dataset(paths)
client.register_job(name, 0)  # no pid: the daemon takes ours from SO_PEERCRED
order = array.array("q", range(len(paths))).tobytes()
client.submit_plan(name, 0, 0, dataset, order, "<i8")
for path in paths[:4]:
    with open(os.path.join(mount_point, path), "rb") as f:
        f.read()
        # Out of the page cache again, so the next run's read reaches the daemon (a page-cache
        # hit is no request the daemon sees).
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
"""


def training_run(socket_path: str, mount_point: Path, name: str, paths: list[str]) -> None:
    subprocess.run([sys.executable, "-c", RUN, socket_path, str(mount_point), name, *paths],
                   check=True, cwd=REPO, timeout=60)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def status_json(m: Mount) -> dict[str, Any]:
    result = cli("status", str(m.mount_point), "--json", check=True)
    data = json.loads(result.stdout)
    status: dict[str, Any] = data[0] if isinstance(data, list) else data
    return status


def test_jobs_of_100_runs_end_with_their_processes(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    m = make_mount(profile="ai_prefetch", configDir=str(cfg))
    paths = [f"c{i % 4}/f{i}.bin" for i in range(FILES)]
    write_tree(m.source, {p: bytes([i]) * 5000 for i, p in enumerate(paths)})
    m.mount()
    socket_path = read_volume_config(m.config()["volName"], str(cfg)).control_socket
    client = ControlClient(socket_path)

    def settled(runs: int) -> bool:
        status = client.status()
        return bool(status["jobs"] == [] and status["plans"] == [] and status["jobs_ended"] == runs)

    training_run(socket_path, m.mount_point, "run0", paths)
    wait_until(lambda: settled(1), what="the first run's job to end")
    series_after_one = set(m.scrape())
    status_after_one = status_json(m)
    rss_after_one = rss(m.pid())
    assert not [s for s in series_after_one if 'training_job="' in s]  # per-job series left with the job

    for run in range(1, RUNS):
        training_run(socket_path, m.mount_point, f"run{run}", paths)
    wait_until(lambda: settled(RUNS), what="every run's job to end")

    assert set(m.scrape()) == series_after_one
    status = status_json(m)
    for key in ("jobs", "plans", "datasets"):
        assert status[key] == status_after_one[key], key
    assert status["hits"]["requests"] == RUNS * 4  # every run did read through the mount
    assert rss(m.pid()) - rss_after_one < RSS_NOISE


def test_a_plan_without_a_job_ends_when_idle(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    m = make_mount(profile="ai_prefetch", configDir=str(cfg), jobIdleTimeout=1)
    paths = [f"f{i}.bin" for i in range(8)]
    write_tree(m.source, {p: b"x" * 100 for p in paths})
    m.mount()
    client = ControlClient(read_volume_config(m.config()["volName"], str(cfg)).control_socket)
    dataset = client.register_dataset(paths)
    client.submit_plan("orphan", 0, 0, dataset, bytes(8 * len(paths)), "<i8")
    assert [p["job"] for p in client.status()["plans"]] == ["orphan"]
    wait_until(lambda: client.status()["plans"] == [], what="the idle plan to end")
    assert client.status()["jobs_ended"] == 1
