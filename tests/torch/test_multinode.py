"""Mounted: two daemons on one machine stand for two training nodes.

Both mount the same source directory (the shared remote volume) under different volume
names.  Rank r of a world-size-2 job runs in its own process with its own DataLoader
(2 workers, a shuffling ``DistributedSampler``), ``import cube_torch`` and ``VOL_NAME``
set to node r's volume, for two epochs.  The test then proves, from each daemon's own
counters, that node r fetched from the remote exactly the files rank r read (its shards
of both epochs) and none of the other rank's, and that each node reports the hit rate of
its rank: the control API's per-job stats, /metrics and the rank's cube_torch line agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from torch.utils.data import DistributedSampler

from cubefs_fuse import mounts
from cubefs_fuse.control.protocol import ControlClient
from tests.helpers import REPO, Mount, cli, metric, wait_until

WORLD = 2
EPOCHS = 2
FILES = 32
SEED = 11

RANK_SCRIPT = """
import json, os, sys
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
import cube_torch
from cube_torch import reporter
from cube_torch.client import submitter

class Files(Dataset):
    def __init__(self, paths):
        self.paths = paths
    def __len__(self):
        return len(self.paths)
    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return torch.tensor([i, len(f.read())])
    def train_data_list(self):
        return np.array(self.paths)

mount, names, seed, epochs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dataset = Files([os.path.join(mount, n) for n in names])
sampler = DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                             shuffle=True, seed=seed)
loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
read = []
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for batch in loader:
        read.extend(int(i) for i in batch[:, 0])
    assert submitter.wait_idle(60), "the plan was not submitted"
line = reporter.report_once()
print("RESULT " + json.dumps({"read": read, "line": line, "stats": cube_torch.stats()}))
"""


def _shard(rank: int, epoch: int) -> list[int]:
    """The indices rank ``rank`` reads in ``epoch`` (the same sampler the rank process uses)."""
    sampler: DistributedSampler[int] = DistributedSampler(range(FILES), num_replicas=WORLD, rank=rank,  # type: ignore[arg-type]
                                                          shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def _line_counts(line: str) -> dict[str, int]:
    """request/hit/miss counts of the sum_metrics part of a cube_torch hit-rate line."""
    total = line.split("sum_metrics:")[1]
    return {key: int(total.split(f"{key}:")[1].split()[0]) for key in ("request_count", "hit_count", "miss_count")}


def test_each_node_prefetches_only_its_ranks_shard(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    shared = tmp_path / "remote"  # the one remote volume both nodes mount
    shared.mkdir()
    rng = np.random.default_rng(SEED)
    names = [f"train/c{i % 4}/{i:03d}.bin" for i in range(FILES)]
    sizes = [int(s) for s in rng.integers(2_000, 40_000, FILES)]
    for name, size in zip(names, sizes):
        (shared / name).parent.mkdir(parents=True, exist_ok=True)
        (shared / name).write_bytes(rng.bytes(size))
    tag = uuid.uuid4().hex[:8]
    nodes = [make_mount(volName=f"node{r}-{tag}", source=str(shared), profile="ai_prefetch", memCacheSize="64MiB")
             for r in range(WORLD)]
    for node in nodes:
        node.mount()
    job = f"multinode-{tag}"

    procs = []
    for rank, node in enumerate(nodes):
        env = {**os.environ, "VOL_NAME": node.config()["volName"], "RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "CUBE_TORCH_JOB": job, "CUBE_TORCH_METRICS_INTERVAL": "3600"}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(node.mount_point), json.dumps(names), str(SEED), str(EPOCHS)],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-4000:]
        [result] = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(result)

    for rank, (node, result) in enumerate(zip(nodes, results)):
        shards = [_shard(rank, e) for e in range(EPOCHS)]
        assert sorted(result["read"]) == sorted(shards[0] + shards[1])  # the rank read its shards
        own = set(shards[0]) | set(shards[1])
        others = set(range(FILES)) - own
        assert others, "the seed must leave files only the other rank reads"

        # The rank's job ended with its process (plan and per-job series gone with it).
        socket_path = mounts.registered(str(node.mount_point))["controlSocket"]  # type: ignore[index]
        client = ControlClient(socket_path)
        wait_until(lambda: client.status()["jobs"] == [] and client.status()["jobs_ended"] == 1,
                   what=f"rank {rank}'s job to end")
        # Node r fetched from the remote exactly the bytes of the files rank r read, each once.
        samples = node.scrape()
        assert metric(samples, "cubefs_fuse_backend_read_bytes_total") == sum(sizes[i] for i in own)
        # File by file, from the daemon's cache: everything of its rank, nothing of the other's.
        for indices, expected in ((own, 100.0), (others, 0.0)):
            listing = node.base / f"check-{expected:.0f}.txt"
            listing.write_text("\n".join(names[i] for i in sorted(indices)))
            check = cli("warmup", str(node.mount_point), "-f", str(listing), "--check", "--json")
            assert check.returncode == 0, check.stderr
            report = json.loads(check.stdout)
            assert (report["files_total"], report["cached_percent"]) == (len(indices), expected)

        # The per-node hit rate: only this rank's job ran on this node, so the daemon's
        # totals are its counters.
        stats = client.stats()
        assert stats["jobs"] == []
        counters = stats["global"]["cumulative"]
        requests = sum(len(s) for s in shards)  # one open per sample read
        assert counters["requests"] == requests and counters["hits"] + counters["misses"] == requests
        # Files read again in epoch 1 were in RAM: their opens are hits whatever the timing.
        assert counters["hits"] >= len(set(shards[0]) & set(shards[1]))
        assert counters["hit_rate"] == counters["hits"] / requests
        # Opens through the mount and files the workers opened from the fast path, alike.
        assert metric(samples, "cubefs_fuse_file_requests_total") == requests
        assert metric(samples, "cubefs_fuse_file_hits_total") == counters["hits"]
        assert not any('training_job="' in key for key in samples), "no series of an ended job"
        # The rank's own report (cube_torch's line and stats()) comes from its node's daemon.
        assert _line_counts(result["line"]) == {"request_count": requests, "hit_count": counters["hits"],
                                                "miss_count": counters["misses"]}
        assert result["stats"]["rank"] == rank and result["stats"]["cumulative"]["requests"] == requests
        [status] = json.loads(cli("status", str(node.mount_point), "--json").stdout)
        assert status["jobs"] == [] and status["hits"]["hit_rate"] == counters["hit_rate"]
        print(f"node {rank}: {len(own)} files fetched of {FILES}, rank {rank} hit rate "
              f"{100 * counters['hit_rate']:.1f}% ({counters['hits']}/{requests})")
    for node in nodes:
        node.umount()
