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

from benchmarks.sample_cache import FILLS
from benchmarks.suite import report
from benchmarks.suite.cleanup import Registry, mounts_below, processes_naming
from cubefs_fuse import mounts
from tests.helpers import REPO, wait_until


def _suite(*args: str, out: Path, workdir: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.suite", "--out", str(out), "--workdir", str(workdir), *args]


def test_results_schema_end_to_end(tmp_path: Path) -> None:
    """The smallest real run (local copy vs our mount with cube_torch, raw I/O with 1 worker
    and the NVMe regime, 2 epochs, 300 us remote, the daemon's CPU per file and the
    processed-sample cache on a local Redis) writes a
    results.json that validates, Markdown tables and plots."""
    out = tmp_path / "out"
    result = subprocess.run(
        _suite("--files", "20", "--classes", "2", "--mean-kb", "8", "--epochs", "2",
               "--workloads", "raw_io,nvme,daemon_cpu,samples", "--systems", "local,cubefs+ct", "--raw-workers", "1",
               "--raw-latencies-us", "300", "--nvme-latency-us", "300", out=out, workdir=tmp_path / "w"),
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert report.validate(results) == []
    assert results["interrupted"] is False
    assert results["dataset"]["files"] == 20
    assert results["emulator"]["ceiling"]["files_per_s"] > 0
    assert [p["latency_us"] for p in results["emulator"]["presets"]] == [300]
    assert [(r["workload"], r["system"]) for r in results["runs"]] == [
        ("raw_io", "local"), ("raw_io", "cubefs+ct"), ("nvme", "local"), ("nvme", "cubefs+ct")]
    runs = {r["system"]: r for r in results["runs"] if r["workload"] == "raw_io"}
    assert all(r["error"] is None and r["stop_error"] is None and len(r["epochs"]) == 2 for r in runs.values()), runs
    assert [e["ratio_to_local"] for e in runs["local"]["epochs"]] == [1.0, 1.0]
    ours = runs["cubefs+ct"]["epochs"]
    # Our daemon counted every file the loader opened, and the remote served the first epoch.
    assert [e["requests"] for e in ours] == [20, 20]
    assert ours[0]["remote_bytes"] >= results["dataset"]["bytes"]
    assert ours[1]["hit_rate"] == 1.0  # the cache holds the whole dataset
    # The persistent worker, forked by the warm-up before VOL_NAME was set, used the fast path.
    assert [e["fast_path_files"] for e in ours] == [20, 20]
    assert ours[0]["daemon_peak_rss_bytes"] > 0
    assert ours[0]["remote_cpu_s"] is not None and ours[0]["remote_ops"] >= 3 * 20  # lookup, open, read per file
    assert runs["local"]["epochs"][0]["remote_ops"] is None
    # The NVMe regime: the training loop with the page cache dropped before every epoch for
    # both; our RAM tier a quarter of the dataset, so epoch 2 comes from NVMe, not the remote.
    nvme = {r["system"]: r for r in results["runs"] if r["workload"] == "nvme"}
    assert all(r["error"] is None and r["drop_page_cache_each_epoch"] for r in nvme.values()), nvme
    assert (nvme["local"]["ram_fraction"], nvme["cubefs+ct"]["ram_fraction"]) == (None, 0.25)
    assert nvme["local"]["epochs"][0]["loss"] is not None  # the training loop, not raw reads
    second = nvme["cubefs+ct"]["epochs"][1]
    assert second["requests"] == 20 and second["hit_rate"] == 1.0 and second["remote_reads"] == 0
    # Every file's block from a tier (cube_torch's prefetch may lift NVMe blocks into RAM first).
    assert second["ram_block_hits"] + second["disk_block_hits"] >= 20
    # The daemon's CPU per file: cold, page-cache hit (no FUSE read), NVMe-tier hit (no miss),
    # RAM-tier hit (every block from RAM).
    cpu = results["daemon_cpu"]
    assert cpu["error"] is None and cpu["readers"] == 1 and cpu["clock_tick_us"] > 0
    figures = {f["kind"]: f for f in cpu["passes"]}
    assert list(figures) == ["cold", "page_cache", "nvme", "ram"]
    assert figures["cold"]["misses"] >= 20 and figures["cold"]["page_cache_dropped"]
    assert figures["page_cache"]["fuse_reads"] == 0 and not figures["page_cache"]["page_cache_dropped"]
    assert figures["page_cache"]["files"] == figures["page_cache"]["passes"] * 20
    assert figures["nvme"]["misses"] == 0 and figures["nvme"]["disk_hits"] >= 20
    assert figures["ram"]["misses"] == 0 and figures["ram"]["ram_hits"] >= 20 and figures["ram"]["page_cache_dropped"]
    assert all(f["files_per_s"] > 0 and f["cpu_us_per_file"] >= 0 for f in figures.values())
    # By part (the C session's threads, trio, its workers, the rest): each thread's ticks, so
    # about the whole (a few ticks apart at most: each thread is rounded on its own).
    for f in figures.values():
        assert set(f["cpu_us_per_file_by_part"]) == {"session", "trio", "workers", "other"}
        tick_per_file = cpu["clock_tick_us"] / f["files"]
        assert abs(sum(f["cpu_us_per_file_by_part"].values()) - f["cpu_us_per_file"]) <= 16 * tick_per_file, f
    bars = {b["bar"]: b for b in results["bars"]}
    assert all(b["passed"] is not None for text, b in bars.items() if text.startswith("daemon CPU per")), bars
    assert sum(text.startswith("daemon CPU per") for text in bars) == 4
    assert next(b for text, b in bars.items() if text.startswith("NVMe regime"))["passed"] is not None
    markdown = (out / "results.md").read_text()
    assert "| 0.3 ms, 1 w | cubefs+ct |" in markdown and "## Bars" in markdown
    assert "| 0.3 ms, 2 w, RAM 0.25 | cubefs+ct |" in markdown
    assert "## Daemon CPU per file" in markdown and "Clock-tick caveat" in markdown
    assert "| kernel page-cache hit | no | 5 × 20 |" in markdown
    # The processed-sample cache: the loader with and without CachedDataset on a local Redis
    # and with the daemon store.
    for key in ("sample_cache", "sample_cache_daemon"):
        samples = results[key]
        assert samples["error"] is None and samples["files"] == 20 and [e["epoch"] for e in samples["epochs"]] == [1, 2]
        assert all(e["baseline_samples_per_s"] > 0 and e["cached_samples_per_s"] > 0 for e in samples["epochs"])
        # Epoch 1 is the median of the fills, each a fresh cache's first epoch.
        assert len(samples["fills"]) == FILLS and samples["epochs"][0]["ratio"] == sorted(samples["fills"])[FILLS // 2]
    assert sum(text.startswith("processed-sample cache") for text in bars) == 4
    assert all(b["passed"] is not None for text, b in bars.items() if text.startswith("processed-sample cache"))
    assert "## (e) processed-sample cache" in markdown and "store: daemon" in markdown
    for plot in ("raw_io.png", "nvme.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "w").iterdir())  # the scratch directory is gone
    # validate() is no rubber stamp: it catches a wrong type and a missing field.
    broken = copy.deepcopy(results)
    broken["runs"][0]["epochs"][0]["samples_per_s"] = "fast"
    del broken["runs"][1]["workers"]
    del broken["daemon_cpu"]["passes"][1]["cpu_us_per_file"]
    problems = report.validate(broken)
    assert any("samples_per_s" in p for p in problems) and any("workers" in p for p in problems), problems
    assert any("daemon_cpu.passes[1]" in p for p in problems), problems


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
