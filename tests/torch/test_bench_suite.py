"""The benchmark suite's own pieces: emulator accuracy, results schema, cleanup on interrupt.

The benchmark itself does not run here (it takes minutes); these run the suite's smallest
configurations for real, as subprocesses through ``python -m benchmarks.suite``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.suite import report
from benchmarks.suite.cleanup import Registry, mounts_below, processes_naming
from benchmarks.suite.remote import Remote
from cubefs_fuse import mounts
from tests.emulator_checks import trimmed_mean
from tests.helpers import REPO, wait_until

pytestmark = pytest.mark.mounted

ROUNDS = 5  # measurement rounds before an accuracy test fails (see test_emulator_latency)
FILES = 16  # files of the latency test's tree


def _suite(*args: str, out: Path, workdir: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.suite", "--out", str(out), "--workdir", str(workdir), *args]


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    root = tmp_path / "backing"
    (root / "dataset" / "c0").mkdir(parents=True)
    for i in range(FILES):
        (root / "dataset" / "c0" / f"{i}.bin").write_bytes(os.urandom(4096))
    (root / "big.bin").write_bytes(os.urandom(4_000_000))
    return root


@pytest.mark.parametrize(("latency_us", "files_per_round"), [(300, 64), (2000, 16)])
def test_emulator_latency(tmp_path: Path, backing: Path, latency_us: int, files_per_round: int) -> None:
    """Through the suite's Remote, whole-file reads (open, read, close: every operation the
    systems pay) take each delayed operation's latency more than on a zero-latency twin,
    within 10 %, and the delays slowfs slept average the setting within 10 %."""
    registry = Registry(tmp_path)
    try:
        slow = Remote(backing, tmp_path / "slow", latency_us=latency_us, bandwidth_mb_s=0, registry=registry).start()
        fast = Remote(backing, tmp_path / "fast", latency_us=0, bandwidth_mb_s=0, registry=registry).start()
        names = [f"dataset/c0/{i % FILES}.bin" for i in range(files_per_round)]
        for name in names[:FILES]:  # warm up threads and slowfs's oversleep estimate
            (slow.mount_point / name).read_bytes()
            (fast.mount_point / name).read_bytes()
        seen = []
        for _ in range(ROUNDS):
            before = slow.stats()
            differences = []
            for name in names:
                start = time.perf_counter()
                (slow.mount_point / name).read_bytes()
                middle = time.perf_counter()
                (fast.mount_point / name).read_bytes()
                differences.append((middle - start) - (time.perf_counter() - middle))
            delta = slow.stats().minus(before)
            per_file_delays = delta.delays / len(names)
            added_per_op_us = trimmed_mean(differences) * 1e6 / per_file_delays
            seen.append(f"slept {delta.mean_delay_us:.0f} us, +{added_per_op_us:.0f} us per operation seen "
                        f"({per_file_delays:.1f} delayed operations per file)")
            if max(abs(delta.mean_delay_us - latency_us), abs(added_per_op_us - latency_us)) <= 0.1 * latency_us:
                break
        else:
            pytest.fail(f"set {latency_us} us; {ROUNDS} rounds: {'; '.join(seen)}")
        assert delta.delays >= 3 * len(names)  # lookup, open and read at least: latency is per operation
    finally:
        registry.cleanup()
    assert not mounts_below(tmp_path)
    print(f"\nemulator {latency_us} us: {seen[-1]}")


def test_emulator_bandwidth_cap_is_shared(tmp_path: Path, backing: Path) -> None:
    """Four concurrent readers together get the cap (within 10 %), not four times it."""
    cap_mb_s = 10.0  # 4 x 4 MB take ~1.6 s at 10 MB/s: long against per-request overheads
    readers = 4
    registry = Registry(tmp_path)
    try:
        remote = Remote(backing, tmp_path / "capped", latency_us=0, bandwidth_mb_s=cap_mb_s,
                        registry=registry).start()
        path = remote.mount_point / "big.bin"
        path.read_bytes()  # warm-up: threads started
        seen = []
        for _ in range(ROUNDS):
            barrier = threading.Barrier(readers + 1)
            sizes: list[int] = []

            def read() -> None:
                barrier.wait()
                sizes.append(len(path.read_bytes()))

            threads = [threading.Thread(target=read) for _ in range(readers)]
            for t in threads:
                t.start()
            barrier.wait()
            start = time.perf_counter()
            for t in threads:
                t.join()
            rate = sum(sizes) / (time.perf_counter() - start) / 1e6
            seen.append(f"{rate:.2f} MB/s")
            assert sizes == [4_000_000] * readers
            if abs(rate - cap_mb_s) <= 0.1 * cap_mb_s:
                break
        else:
            pytest.fail(f"cap {cap_mb_s} MB/s; {ROUNDS} rounds: {', '.join(seen)}")
        assert remote.raw_stats()["bandwidth_mb_s"] == cap_mb_s
    finally:
        registry.cleanup()


def test_results_schema_end_to_end(tmp_path: Path) -> None:
    """The smallest real run (local copy vs our mount with cube_torch, raw I/O, 1 worker,
    2 epochs, 300 us remote) writes a results.json that validates, a Markdown table and a plot."""
    out = tmp_path / "out"
    result = subprocess.run(
        _suite("--files", "20", "--classes", "2", "--mean-kb", "8", "--epochs", "2", "--workloads", "raw_io",
               "--systems", "local,cubefs+ct", "--raw-workers", "1", "--raw-latencies-us", "300",
               out=out, workdir=tmp_path / "w"),
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert report.validate(results) == []
    assert results["interrupted"] is False
    assert results["dataset"]["files"] == 20
    assert results["emulator"]["ceiling"]["files_per_s"] > 0
    assert [p["latency_us"] for p in results["emulator"]["presets"]] == [300]
    runs = {r["system"]: r for r in results["runs"]}
    assert sorted(runs) == ["cubefs+ct", "local"]
    assert all(r["error"] is None and len(r["epochs"]) == 2 for r in runs.values()), runs
    assert [e["ratio_to_local"] for e in runs["local"]["epochs"]] == [1.0, 1.0]
    ours = runs["cubefs+ct"]["epochs"]
    # Our daemon counted every file the loader opened, and the remote served the first epoch.
    assert [e["requests"] for e in ours] == [20, 20]
    assert ours[0]["remote_bytes"] >= results["dataset"]["bytes"]
    assert ours[1]["hit_rate"] == 1.0  # the cache holds the whole dataset
    assert ours[0]["daemon_peak_rss_bytes"] > 0
    assert ours[0]["remote_cpu_s"] is not None and ours[0]["remote_ops"] >= 3 * 20  # lookup, open, read per file
    assert runs["local"]["epochs"][0]["remote_ops"] is None
    markdown = (out / "results.md").read_text()
    assert "| 0.3 ms, 1 w | cubefs+ct |" in markdown and "## Bars (issue 5)" in markdown
    assert (out / "raw_io.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "w").iterdir())  # the scratch directory is gone
    # validate() is no rubber stamp: it catches a wrong type and a missing field.
    broken = copy.deepcopy(results)
    broken["runs"][0]["epochs"][0]["samples_per_s"] = "fast"
    del broken["runs"][1]["workers"]
    problems = report.validate(broken)
    assert any("samples_per_s" in p for p in problems) and any("workers" in p for p in problems), problems


def test_interrupt_mid_run_cleans_up(tmp_path: Path) -> None:
    """SIGINT while our mount is up mid-run: the suite exits 130, and no mount and no process
    it started (slowfs, cubefs-fuse daemon, DataLoader workers) is left."""
    workdir = tmp_path / "w"
    out = tmp_path / "out"
    proc = subprocess.Popen(
        _suite("--files", "100", "--classes", "2", "--mean-kb", "8", "--epochs", "3", "--workloads", "raw_io",
               "--systems", "local,cubefs", "--raw-workers", "2", "--raw-latencies-us", "2000",
               out=out, workdir=workdir),
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def ours_mounted() -> bool:
            assert proc.poll() is None, "the suite ended before our mount came up"
            return any(e.fstype.endswith("cubefs-fuse") or "cubefs-fuse" in e.source
                       for e in mounts.mount_table() if e.mount_point.startswith(str(workdir)))

        wait_until(ours_mounted, timeout=120, what="our mount inside the suite")
        assert processes_naming(workdir), "the suite's children should be running"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left_mounts = mounts_below(workdir)
        left_processes = processes_naming(workdir)
        Registry(workdir).cleanup()  # whatever the suite left, so that a failure here leaves nothing either
    assert proc.returncode == 130, stderr.decode()[-3000:]
    assert left_mounts == []
    assert left_processes == []
    assert b"interrupted" in stderr
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] is True
    # It really was mid-run: our run did not complete its epochs.
    assert not any(r["system"] == "cubefs" and len(r["epochs"]) == 3 for r in results["runs"])
