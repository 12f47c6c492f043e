"""The benchmark suite's own pieces: results schema, cleanup on interrupt (its emulated
remote's accuracy is in tests/mounted/test_bench_emulator.py).

The benchmark itself does not run here (it takes minutes); these run the suite's smallest
configurations for real (DataLoaders over our mount), as subprocesses through
``python -m benchmarks.suite``.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.suite import report
from benchmarks.suite.cleanup import Registry, mounts_below, processes_naming
from cubefs_fuse import mounts
from tests.helpers import REPO, wait_until


def _suite(*args: str, out: Path, workdir: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.suite", "--out", str(out), "--workdir", str(workdir), *args]


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
    assert "| 0.3 ms, 1 w | cubefs+ct |" in markdown and "## Bars" in markdown
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
