"""Every operator view counts what a cube_torch job reads, and they agree.

A real training loop: a ``CachedDataset`` (the daemon's sample store, the default) over an
ImageFolder on a real ``ai_prefetch`` mount, DataLoader workers with cube_torch's fast path
on (the default).  Epoch 0 computes every sample, its files coming through the fast path
(or the mount, where a batch's file was not ready); later epochs are served by the sample
cache and read no file.  After each epoch, while the job is still running, every view is
read and compared: ``/metrics``, ``cubefs-fuse status --json`` and its text, the per-job
counters and cube_torch's own hit-rate line; ``cubefs-fuse stats`` runs the whole time and
its lines must have seen the same requests (docs/metrics.md, "What a job reads").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cube_torch
from cube_torch import client as ct_client
from cube_torch import reporter
from tests.helpers import REPO, Mount, cli, metric, wait_until
from tests.sample_pipeline import (FILES, SEED, CountingFolder, DECODE_RESIZE, augment, computed, loader,
                                   sample_volume)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

PATHS = ("mount", "fastpath", "sample_cache")
EPOCHS = 3
# The stats command's interval: one line a second.
STATS_INTERVAL_S = 1.0


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mount, str]]:
    yield from sample_volume(tmp_path_factory, {"sampleCacheMemSize": "16MiB", "sampleCacheDiskSize": "64MiB"})


def status(mount: Mount) -> dict[str, Any]:
    result = cli("status", str(mount.mount_point), "--json")
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)[0]
    return report


def quiet(mount: Mount) -> dict[str, Any]:
    """The status once the counters stop moving: every worker's last fast-path batch is
    counted when its connection closes, and the sample puts drain in the background."""
    seen: list[dict[str, Any]] = []

    def settled() -> bool:
        report = status(mount)
        seen.append(report)
        return len(seen) > 1 and seen[-2]["reads"] == report["reads"] and seen[-2]["jobs"] == report["jobs"] \
            and all(c["entries"] == FILES for c in report["samples"]["caches"])

    # Settling takes a second or two (workers exit, writers drain); 60 s is for a loaded machine.
    wait_until(settled, timeout=60, what="the daemon's counters to settle")
    return seen[-1]


def line_counts(line: str) -> dict[str, int]:
    """request/hit/miss counts of the sum_metrics part of cube_torch's hit-rate line."""
    total = line.split("sum_metrics:")[1]
    return {key: int(total.split(f"{key}:")[1].split()[0]) for key in ("request_count", "hit_count", "miss_count")}


def check_views_agree(mount: Mount, report: dict[str, Any]) -> dict[str, Any]:
    """Every view against ``report``'s ``reads`` (status --json); the reads."""
    reads: dict[str, Any] = report["reads"]
    by_path = reads["by_path"]
    assert reads["requests"] == sum(by_path[p]["requests"] for p in PATHS)
    assert reads["hits"] + reads["misses"] == reads["requests"] and by_path["sample_cache"]["misses"] == 0
    # /metrics: the same count, path by path, and the file requests are its mount and fast path.
    samples = mount.scrape()
    for path in PATHS:
        assert metric(samples, "cubefs_fuse_app_requests_total", path=path, result="hit") == by_path[path]["hits"], path
        assert metric(samples, "cubefs_fuse_app_requests_total", path=path, result="miss") == by_path[path]["misses"]
        assert metric(samples, "cubefs_fuse_app_bytes_total", path=path) == by_path[path]["bytes"], path
    files = by_path["mount"]["requests"] + by_path["fastpath"]["requests"]
    assert metric(samples, "cubefs_fuse_file_requests_total") == report["counters"]["file_requests"] \
        == report["hits"]["requests"] == files
    assert metric(samples, "cubefs_fuse_file_misses_total") == report["hits"]["misses"] \
        == by_path["mount"]["misses"] + by_path["fastpath"]["misses"]
    assert metric(samples, "cubefs_fuse_fastpath_bytes_total") == by_path["fastpath"]["bytes"]
    assert metric(samples, "cubefs_fuse_read_bytes_total") == by_path["mount"]["bytes"]
    assert metric(samples, "cubefs_fuse_reads_total") >= by_path["mount"]["requests"]  # each began with a READ
    assert metric(samples, "cubefs_fuse_lookups_total") >= report["counters"]["lookups"] > 0
    # The sample cache's share is the hits of its one cache, as the cache's own series say.
    (cache,) = report["samples"]["caches"]
    assert by_path["sample_cache"]["requests"] == cache["hits"] == metric(
        samples, "cubefs_fuse_sample_cache_hits_total", sample_cache=cache["name"], owner=str(cache["owner"]))
    # The job (this process and its workers: the only reader of the mount) read every file.
    (job,) = report["jobs"]
    assert (job["requests"], job["misses"]) == (files, by_path["mount"]["misses"] + by_path["fastpath"]["misses"])
    assert metric(samples, "cubefs_fuse_job_requests_total", training_job=job["job"], rank=str(job["rank"])) == files
    # cube_torch's line: the job's file requests plus the samples its cache served.
    line = reporter.report_once()
    assert line is not None
    assert line_counts(line) == {"request_count": reads["requests"], "hit_count": reads["hits"],
                                 "miss_count": reads["misses"]}, line
    # status's text: the same line of counts.
    text = cli("status", str(mount.mount_point)).stdout
    expected = (f"requests {reads['requests']} (mount {by_path['mount']['requests']}, fast path "
                f"{by_path['fastpath']['requests']}, sample cache {by_path['sample_cache']['requests']})  "
                f"hits {reads['hits']}  misses {reads['misses']}  hit rate {100 * reads['hit_rate']:.2f}%")
    assert expected in text, text
    return reads


def stats_rows(out: str) -> list[dict[str, str]]:
    """``cubefs-fuse stats`` lines as {column: value} (the header repeats every 20 lines; the
    two 'RAM'/'disk' groups are told apart by position)."""
    lines = out.strip().splitlines()
    header = lines[0].replace("|", " ").split()
    return [dict(zip([f"{i}:{name}" for i, name in enumerate(header)], line.replace("|", " ").split()))
            for line in lines if line != lines[0] and re.match(r"\d\d:\d\d:\d\d ", line)]


def test_every_view_counts_what_a_cube_torch_job_reads(volume: tuple[Mount, str], tmp_path: Path) -> None:
    mount, _ = volume
    wait_until(lambda: status(mount)["samples"]["loaded"], what="the sample store's start-up scan")
    cube_torch.install()
    ct_client._warned.clear()
    counts = tmp_path / "computed"
    dataset = cube_torch.CachedDataset(CountingFolder(mount.mount_point / "train", counts, DECODE_RESIZE),
                                       name=f"views-{os.getpid()}", transform=augment)
    dl = loader(dataset)
    # Run as a background job of a non-interactive shell (`.ci/run &`), this process has
    # SIGINT ignored, and a child would inherit that (Python then never raises
    # KeyboardInterrupt): a handler here makes the child's disposition the default again.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stats = subprocess.Popen([sys.executable, "-m", "cubefs_fuse", "stats", str(mount.mount_point),
                                  "-i", str(STATS_INTERVAL_S)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=REPO)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stats.stdout is not None
    # Its first line comes one interval after its first status call: every request from
    # here on falls into one of its lines.
    header = stats.stdout.readline()
    try:
        history = []
        for epoch in range(EPOCHS):
            torch.manual_seed(SEED + epoch)
            assert sum(len(y) for _, y in dl) == FILES
            reads = check_views_agree(mount, quiet(mount))
            history.append(reads)
            files = reads["by_path"]["mount"]["requests"] + reads["by_path"]["fastpath"]["requests"]
            # Epoch 0 read each sample's file once (computed), the later ones none: the cache served them.
            assert sorted(computed(counts)) == list(range(FILES))
            assert files == FILES, reads
            assert reads["by_path"]["sample_cache"]["requests"] == epoch * FILES, reads
        assert history[0]["by_path"]["fastpath"]["requests"] > 0  # the fast path served epoch 0's files
        # Two more lines after the last counts (each line's interval then holds them
        # whole), then stop (Ctrl-C, as an operator would).
        time.sleep(2 * STATS_INTERVAL_S + 0.5)
    finally:
        stats.send_signal(signal.SIGINT)
        try:
            out, err = stats.communicate(timeout=60)
        finally:
            if stats.poll() is None:  # it did not stop: no process left behind for later tests
                stats.kill()
                stats.communicate()
    assert stats.returncode == 0, err
    rows = stats_rows(header + out)
    total = history[-1]
    assert rows, out
    # Each line: its requests/s are its paths' requests/s, each of the four figures rounded to
    # a whole number (half a request/s each way: less than 2 between them).
    for row in rows:
        req, mount_, fast, sample = (float(row[k]) for k in ("1:req/s", "4:mount", "5:fast", "6:sample"))
        assert abs(req - (mount_ + fast + sample)) < 2, row
        if req == 0:
            assert row["2:hit%"] == "-", row
    # The lines saw the fast path and the sample cache at work, and all the requests: the sum
    # of each line's requests/s times STATS_INTERVAL_S, give or take each figure's rounding
    # (half a request/s) and the status call each line's interval also holds (a few per cent
    # of a second on a loaded machine: 10 % allowed).
    assert any(float(r["5:fast"]) > 0 for r in rows) and any(float(r["6:sample"]) > 0 for r in rows), out
    seen = sum(float(r["1:req/s"]) for r in rows) * STATS_INTERVAL_S
    assert abs(seen - total["requests"]) <= 0.5 * len(rows) + 0.1 * total["requests"], (seen, total, out)
