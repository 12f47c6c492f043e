"""The benchmark suite's bars (benchmarks.suite.report.evaluate_bars) on synthetic results:
each of The fast-path bars just above and just below its threshold, "not measured" when the
run lacks what it needs, and the schema check of the daemon-CPU figures.  The suite's real
end-to-end runs are in tests/torch/test_bench_suite.py."""

from __future__ import annotations

import statistics

from typing import Any

import pytest

from benchmarks.suite import report
from tools.harness import CPU_PARTS, CpuSnapshot, cpu_split

LOCAL_FILES_PER_S = 1000.0  # every synthetic local epoch: ratios are files/s / 1000
FILES = 100


def _epoch(i: int, files_per_s: float, hit_rate: float | None = None) -> dict[str, Any]:
    return {"epoch": i, "samples": FILES, "bytes": FILES * 110_000, "seconds": FILES / files_per_s,
            "samples_per_s": files_per_s, "mb_per_s": files_per_s * 0.11, "loss": None, "requests": None,
            "hits": None, "hit_rate": hit_rate, "stall_s": None, "prefetched_blocks": None, "ram_block_hits": None,
            "disk_block_hits": None, "daemon_cpu_s": None, "daemon_peak_rss_bytes": None, "remote_ops": None,
            "remote_reads": None, "remote_bytes": None, "remote_mean_delay_us": None, "remote_cpu_s": None,
            "ratio_to_local": None}


def _run(workload: str, system: str, ratios: list[float], *, latency_us: int | None = 2000, workers: int = 2,
         cache_fraction: float | None = None, ram_fraction: float | None = None,
         hit_rates: list[float] | None = None) -> dict[str, Any]:
    """A run whose epochs go at ``ratios`` × the local copy (files/s = ratio × 1000)."""
    drop = workload in ("cache", "nvme")
    return {"workload": workload, "system": system, "latency_us": None if system == "local" else latency_us,
            "workers": workers, "cache_fraction": cache_fraction, "drop_page_cache_each_epoch": drop,
            "ram_fraction": ram_fraction, "setup_s": 0.1, "warmup_s": 0.1, "error": None, "stop_error": None,
            "epochs": [_epoch(i, r * LOCAL_FILES_PER_S, (hit_rates or [None] * len(ratios))[i])  # type: ignore[list-item]
                       for i, r in enumerate(ratios)]}


def _with_locals(*runs: dict[str, Any]) -> list[dict[str, Any]]:
    """``runs`` plus the local run each compares with (every epoch at LOCAL_FILES_PER_S), ratios filled."""
    keys = {report.local_key(r) for r in runs}
    locals_ = [dict(_run(w, "local", [1.0, 1.0, 1.0], workers=n), drop_page_cache_each_epoch=d) for w, n, d in keys]
    out = locals_ + list(runs)
    report.fill_ratios(out)
    return out


def _cpu(**us_per_file: float) -> dict[str, Any]:
    passes = []
    for kind in report.CPU_KINDS:
        if kind in us_per_file:
            n = 5 if kind == "page_cache" else 1
            files = n * FILES
            passes.append({"kind": kind, "passes": n, "files": files, "bytes": files * 110_000, "seconds": 1.0,
                           "files_per_s": float(files), "daemon_cpu_s": us_per_file[kind] * files / 1e6,
                           "cpu_us_per_file": float(us_per_file[kind]),
                           "cpu_us_per_file_by_part": {"session": float(us_per_file[kind]) / 2, "trio": float(
                               us_per_file[kind]) / 2, "workers": 0.0, "other": 0.0},
                           "resolution_us_per_file": 10_000 / files,
                           "page_cache_dropped": kind != "page_cache", "fuse_reads": 0 if kind == "page_cache" else files,
                           "ram_hits": files if kind == "ram" else 0, "disk_hits": files if kind == "nvme" else 0,
                           "misses": files if kind == "cold" else 0})
    return {"readers": 1, "files": FILES, "mean_file_bytes": 110_000.0, "ram_fraction": 0.25,
            "ram_tier_bytes": 2_750_000, "disk_tier_bytes": 100_000_000, "profile": "ai_prefetch",
            "clock_tick_us": 10_000.0, "passes": passes, "error": None}


def _bar(bars: list[dict[str, Any]], starts: str) -> dict[str, Any]:
    found = [b for b in bars if b["bar"].startswith(starts)]
    assert len(found) == 1, (starts, [b["bar"] for b in bars])
    return found[0]


@pytest.mark.parametrize(("kind", "starts", "limit"), [
    ("cold", "daemon CPU per ~110 KB file, cold", 150), ("page_cache", "daemon CPU per file, kernel page-cache", 10),
    ("ram", "daemon CPU per file, RAM-tier hit", 60), ("nvme", "daemon CPU per file, NVMe-tier hit", 100)])
def test_daemon_cpu_bars(kind: str, starts: str, limit: float) -> None:
    assert _bar(report.evaluate_bars([], None, _cpu(**{kind: limit})), starts)["passed"] is True
    assert _bar(report.evaluate_bars([], None, _cpu(**{kind: limit - 1})), starts)["passed"] is True
    above = _bar(report.evaluate_bars([], None, _cpu(**{kind: limit + 1})), starts)
    assert above["passed"] is False and f"{limit + 1:,.0f} µs per file" in above["measured"]
    assert _bar(report.evaluate_bars([], None, None), starts)["passed"] is None
    failed = dict(_cpu(), error="HarnessError: cubefs-fuse mount failed")
    missing = _bar(report.evaluate_bars([], None, failed), starts)
    assert missing["passed"] is None and "mount failed" in missing["measured"]


@pytest.mark.parametrize("latency_us", [300, 2000])
def test_training_bars_per_latency(latency_us: int) -> None:
    where = f"training with cube_torch, {latency_us / 1000:g} ms"

    def bars(ratios: list[float]) -> tuple[bool | None, bool | None]:
        runs = _with_locals(_run("training", "cubefs+ct", ratios, latency_us=latency_us))
        evaluated = report.evaluate_bars(runs)
        return (_bar(evaluated, f"{where}, cache ≥ dataset: epoch 1")["passed"],
                _bar(evaluated, f"{where}, cache ≥ dataset: later")["passed"])

    assert bars([0.90, 0.97, 0.98]) == (True, True)
    assert bars([0.89, 0.97, 0.98]) == (False, True)
    assert bars([0.91, 0.98, 0.96]) == (True, False)  # every later epoch counts
    other = 2000 if latency_us == 300 else 300
    evaluated = report.evaluate_bars(_with_locals(_run("training", "cubefs+ct", [1, 1, 1], latency_us=latency_us)))
    unmeasured = _bar(evaluated, f"training with cube_torch, {other / 1000:g} ms, cache ≥ dataset: epoch 1")
    assert unmeasured["passed"] is None and unmeasured["measured"].startswith("not measured")


def test_the_native_data_planes_stricter_bars_judge_the_same_rows() -> None:
    runs = _with_locals(_run("training", "cubefs+ct", [0.96, 0.985, 0.99], latency_us=300),
                        _run("training", "cubefs+ct", [0.93, 0.99, 0.99], latency_us=2000),
                        _run("training", "cubefs", [0.5, 0.99, 0.975], latency_us=300),
                        _run("nvme", "cubefs+ct", [0.5, 1.0, 0.99], ram_fraction=0.25))
    bars = report.evaluate_bars(runs)
    native = "native data plane: "
    assert _bar(bars, f"{native}training with cube_torch, 0.3 ms, cache ≥ dataset: epoch 1 ≥ 0.95")["passed"] is True
    assert _bar(bars, f"{native}training with cube_torch, 0.3 ms, cache ≥ dataset: later epochs ≥ 0.98")["passed"] is True
    strict = _bar(bars, f"{native}training with cube_torch, 2 ms, cache ≥ dataset: epoch 1 ≥ 0.95")
    assert strict["passed"] is False and strict["issues"] == "28"
    # The same figure meets the foundation's bar of 0.90.
    assert _bar(bars, "training with cube_torch, 2 ms, cache ≥ dataset: epoch 1 ≥ 0.90")["passed"] is True
    assert _bar(bars, f"{native}NVMe regime")["passed"] is False  # 0.99 < 1.0
    assert _bar(bars, "NVMe regime")["passed"] is True
    assert _bar(bars, f"{native}our mount without cube_torch")["passed"] is False  # 0.975 < 0.98
    assert _bar(bars, "our mount without cube_torch")["passed"] is True


def test_nvme_regime_bar_with_and_without_cube_torch() -> None:
    starts = "NVMe regime"

    def bar(planned: list[float], plain: list[float]) -> dict[str, Any]:
        runs = _with_locals(_run("nvme", "cubefs+ct", planned, ram_fraction=0.25),
                            _run("nvme", "cubefs", plain, ram_fraction=0.25))
        return _bar(report.evaluate_bars(runs), starts)

    assert bar([0.5, 0.90, 0.95], [0.4, 0.5, 0.6])["passed"] is True  # epoch 1 is not part of it
    low = bar([0.95, 0.95, 0.89], [0.4, 0.5, 0.6])
    assert low["passed"] is False and "0.95 / 0.89" in low["measured"]
    assert "without cube_torch 0.50 / 0.60" in low["measured"]  # reported, not judged
    # A system that failed to stop after its epochs still measured them; a failed run did not.
    runs = _with_locals(dict(_run("nvme", "cubefs+ct", [0.5, 0.95, 0.95]), stop_error="HarnessError: umount failed"))
    assert _bar(report.evaluate_bars(runs), starts)["passed"] is True
    runs = _with_locals(dict(_run("nvme", "cubefs+ct", [0.5, 0.95, 0.95]), error="HarnessError: epoch 3 read 9 samples"))
    assert _bar(report.evaluate_bars(runs), starts)["passed"] is None
    only_plain = _bar(report.evaluate_bars(_with_locals(_run("nvme", "cubefs", [0.4, 0.5, 0.6]))), starts)
    assert only_plain["passed"] is None and "without cube_torch 0.50 / 0.60" in only_plain["measured"]


def test_raw_io_ten_times_the_raw_remote() -> None:
    def bar(factor: float) -> dict[str, Any]:
        runs = _with_locals(_run("raw_io", "remote", [0.05, 0.05], workers=8),
                            _run("raw_io", "cubefs+ct", [0.05 * factor, 0.5], workers=8))
        return _bar(report.evaluate_bars(runs, 8000.0), "raw I/O, 8 workers, 2 ms: epoch 1")

    assert bar(10.0)["passed"] is True
    below = bar(9.9)
    assert below["passed"] is False and "9.9 × raw remote" in below["measured"] and "ceiling 8,000" in below["measured"]
    assert bar(10.0)["issues"] == "5, 12"


def test_fuse_path_training_bar_takes_every_latency() -> None:
    starts = "our mount without cube_torch"

    def bar(at_300: list[float], at_2000: list[float]) -> bool | None:
        runs = _with_locals(_run("training", "cubefs", at_300, latency_us=300),
                            _run("training", "cubefs", at_2000, latency_us=2000))
        passed: bool | None = _bar(report.evaluate_bars(runs), starts)["passed"]
        return passed

    assert bar([0.3, 0.95, 1.0], [0.2, 0.96, 0.97]) is True
    assert bar([0.3, 0.95, 1.0], [0.2, 0.96, 0.94]) is False
    assert _bar(report.evaluate_bars([]), starts)["passed"] is None


def test_cube_torch_never_slower_lists_every_slower_row() -> None:
    starts = "with cube_torch vs without"
    same = _with_locals(_run("raw_io", "cubefs", [0.1, 0.5, 0.5], workers=8),
                        _run("raw_io", "cubefs+ct", [0.2, 0.5, 0.6], workers=8),
                        _run("cache", "cubefs", [0.1, 0.2, 0.2], workers=4, cache_fraction=0.5),
                        _run("cache", "cubefs+ct", [0.3, 0.4, 0.4], workers=4, cache_fraction=0.5))
    ok = _bar(report.evaluate_bars(same), starts)
    assert ok["passed"] is True and "6 of 6 epochs" in ok["measured"]  # equal is not slower
    slower = _with_locals(_run("raw_io", "cubefs", [0.1, 0.57, 0.5], workers=8),
                          _run("raw_io", "cubefs+ct", [0.2, 0.43, 0.5], workers=8),
                          # another cache fraction: not the same row, not compared
                          _run("cache", "cubefs", [0.9, 0.9, 0.9], workers=4, cache_fraction=0.25),
                          _run("cache", "cubefs+ct", [0.3, 0.4, 0.4], workers=4, cache_fraction=0.5))
    bar = _bar(report.evaluate_bars(slower), starts)
    assert bar["passed"] is False
    assert "2 of 3 epochs" in bar["measured"] and "raw_io 2 ms, 8 w epoch 2: 430 vs 570 files/s" in bar["measured"]
    assert _bar(report.evaluate_bars(_with_locals(_run("raw_io", "cubefs", [0.1]))), starts)["passed"] is None


@pytest.mark.parametrize(("peer", "title"), [("rclone", "rclone's VFS cache"), ("juicefs", "JuiceFS")])
def test_ahead_of_each_peer_on_every_row(peer: str, title: str) -> None:
    starts = f"with cube_torch vs {title}"
    rows = [_run("training", "cubefs+ct", [0.6, 0.9, 0.9], latency_us=300),
            _run("nvme", "cubefs+ct", [0.5, 0.9, 0.9], ram_fraction=0.25)]
    ahead = _with_locals(*rows, _run("training", peer, [0.5, 0.89, 0.5], latency_us=300),
                         _run("nvme", peer, [0.4, 0.5, 0.89], ram_fraction=0.25))
    bar = _bar(report.evaluate_bars(ahead), starts)
    assert bar["passed"] is True and "ahead on 6 of 6 epochs" in bar["measured"]
    tied = _with_locals(*rows, _run("nvme", peer, [0.4, 0.9, 0.5], ram_fraction=0.25))
    bar = _bar(report.evaluate_bars(tied), starts)
    assert bar["passed"] is False and "nvme 2 ms, 2 w, RAM 0.25 epoch 2" in bar["measured"]  # a tie is not ahead
    absent = _bar(report.evaluate_bars(_with_locals(*rows)), starts)
    assert absent["passed"] is None and f"{peer} not run" in absent["measured"]


def test_the_fast_path_row_says_where_it_still_wins_over_the_native_plane() -> None:
    starts = "cube_torch's fast path vs the native data plane"
    rows = [_run("training", "cubefs+ct", [0.6, 0.9, 0.9], latency_us=300)]
    wins = _with_locals(*rows, _run("training", "cubefs+ct-nofp", [0.5, 0.9, 0.95], latency_us=300))
    row = _bar(report.evaluate_bars(wins), starts)
    assert row["passed"] is True and "ahead on 1 of 3 epochs" in row["measured"]
    assert "training 0.3 ms, 2 w epoch 3: 900 vs 950 files/s" in row["measured"]
    never = _with_locals(*rows, _run("training", "cubefs+ct-nofp", [0.6, 0.95, 0.9], latency_us=300))
    assert _bar(report.evaluate_bars(never), starts)["passed"] is False  # nowhere: the fast path goes
    absent = _bar(report.evaluate_bars(_with_locals(*rows)), starts)
    assert absent["passed"] is None and "cubefs+ct-nofp" in absent["measured"]


def test_issue_5_bars_that_issue_12_does_not_restate_stay() -> None:
    runs = _with_locals(_run("cache", "cubefs", [0.1, 0.1, 0.1], workers=4, cache_fraction=0.5),
                        _run("cache", "cubefs+ct", [0.2, 0.2, 0.14], workers=4, cache_fraction=0.5,
                             hit_rates=[0.5, 0.9, 0.44]))
    bars = report.evaluate_bars(runs)
    assert _bar(bars, "cache = 0.5 × dataset: hit rate")["passed"] is False  # 0.44 in epoch 3
    assert _bar(bars, "cache = 0.5 × dataset: cube_torch ≥ 1.5")["passed"] is True  # 0.54 / 0.3 = 1.8 ×
    assert _bar(bars, "raw I/O, 8 workers, 2 ms: later epochs")["issues"] == "5"
    assert all(b["issues"] in ("5", "12", "5, 12", "15", "28") for b in bars)
    # Every bar once: nothing superseded is left twice (18 with the fast-path row, the large file's 2,
    # the sample cache's 2 per store, and the native data plane's stricter 6 over the same rows).
    assert len({b["bar"] for b in bars}) == len(bars) == 30


def _results(cpu: dict[str, Any] | None) -> dict[str, Any]:
    runs = _with_locals(_run("nvme", "cubefs+ct", [0.5, 0.9, 0.9], ram_fraction=0.25))
    return {"schema": report.SCHEMA, "preset": {}, "started": "", "finished": "", "duration_s": 1.0,
            "interrupted": False, "machine": {}, "load_average": {}, "dataset": {"files": FILES},
            "emulator": {}, "systems": {"local": {}, "cubefs+ct": {}}, "skipped": {}, "daemon_cpu": cpu,
            "runs": runs, "bars": report.evaluate_bars(runs)}


def test_schema_checks_the_daemon_cpu_figures() -> None:
    assert report.validate(_results(_cpu(cold=200, page_cache=50, nvme=250, ram=40))) == []
    assert report.validate(_results(None)) == []  # not measured (workload left out)
    failed = dict(_cpu(cold=200), error="HarnessError: x")  # stopped after the first pass, with its reason
    assert report.validate(_results(failed)) == []
    problems = report.validate(_results(_cpu(cold=200, nvme=250)))  # a pass missing without an error
    assert any("daemon_cpu.passes: kinds" in p for p in problems), problems
    wrong = _cpu(cold=200, page_cache=50, nvme=250, ram=40)
    wrong["passes"][1]["files"] = FILES  # 5 passes cannot have read the dataset once
    wrong["passes"][2]["cpu_us_per_file"] = "fast"
    problems = report.validate(_results(wrong))
    assert any("passes[1]" in p and "5 passes" in p for p in problems), problems
    assert any("passes[2].cpu_us_per_file" in p for p in problems), problems
    parts = _cpu(cold=200, page_cache=50, nvme=250, ram=40)
    del parts["passes"][0]["cpu_us_per_file_by_part"]["workers"]  # a part missing
    parts["passes"][3]["cpu_us_per_file_by_part"]["trio"] = -5.0  # a part below zero
    problems = report.validate(_results(parts))
    assert any("passes[0].cpu_us_per_file_by_part" in p for p in problems), problems
    assert any("passes[3].cpu_us_per_file_by_part" in p for p in problems), problems
    table = report.cpu_table(_cpu(cold=200, page_cache=50, nvme=250, ram=40))
    assert "| of which C session / trio / workers / other |" in table.splitlines()[0]
    assert "| 125 / 125 / 0 / 0 |" in table  # the NVMe pass's parts, per file
    no_issue = _results(None)
    del no_issue["bars"][0]["issues"]
    assert any("bars[0]" in p and "issues" in p for p in report.validate(no_issue))


def _large(nvme: list[float], cold: list[float], error: str | None = None) -> dict[str, Any]:
    rounds = [{"round": i, "direct_mb_s": [1000.0, 1000.0], "cold_mb_s": 1000.0 * c, "cold_ratio": c,
               "cold_daemon_cpu_s": 1.5, "nvme_mb_s": 1000.0 * n, "nvme_ratio": n, "nvme_daemon_cpu_s": 0.5,
               "nvme_reads": 768, "nvme_native_reads": 768} for i, (n, c) in enumerate(zip(nvme, cold))]
    return {"mib": 768, "read_bytes": 1 << 20, "ram_tier_bytes": 256 << 20, "rounds": rounds,
            "nvme_ratio": statistics.median(nvme) if nvme else None,
            "cold_ratio": statistics.median(cold) if cold else None, "error": error}


def test_large_file_bars_take_the_median_round() -> None:
    nvme_bar = "one large file read whole with 1 MiB reads, from the NVMe tier"
    cold_bar = "one large file read whole with 1 MiB reads, cold"
    bars = report.evaluate_bars([], None, None, None, None, _large([0.95, 0.85, 0.92], [0.5, 0.7, 0.65]))
    assert _bar(bars, nvme_bar)["passed"] is True and "0.92 ×" in _bar(bars, nvme_bar)["measured"]
    assert _bar(bars, cold_bar)["passed"] is True  # median 0.65
    bars = report.evaluate_bars([], None, None, None, None, _large([0.89, 0.95], [0.59, 0.6]))
    assert _bar(bars, nvme_bar)["passed"] is True and _bar(bars, cold_bar)["passed"] is False  # 0.92, 0.595
    failed = report.evaluate_bars([], None, None, None, None, _large([], [], error="HarnessError: no root"))
    assert _bar(failed, nvme_bar)["passed"] is None and "no root" in _bar(failed, nvme_bar)["measured"]
    assert _bar(report.evaluate_bars([]), cold_bar)["passed"] is None
    results = _results(None)
    results["large_file"] = _large([0.9], [0.6])
    assert report.validate(results) == []
    results["large_file"]["rounds"][0]["nvme_reads"] = "all"
    assert any("large_file.rounds[0].nvme_reads" in p for p in report.validate(results))


def _samples(ratios: list[float], error: str | None = None) -> dict[str, Any]:
    return {"store": "redis (local redis-server, allkeys-lru)", "workers": 2, "files": FILES, "error": error,
            "epochs": [{"epoch": i + 1, "baseline_samples_per_s": 100.0, "cached_samples_per_s": 100.0 * r,
                        "ratio": r} for i, r in enumerate(ratios)]}


@pytest.mark.parametrize(("ratios", "first", "later"), [
    ([0.9, 2.0, 2.0], True, True), ([0.89, 5.0, 5.0], False, True), ([1.2, 2.5, 1.99], True, False)])
def test_sample_cache_bars(ratios: list[float], first: bool, later: bool) -> None:
    bars = report.evaluate_bars([], None, None, _samples(ratios))
    assert _bar(bars, "processed-sample cache (local Redis): epoch 1")["passed"] is first
    assert _bar(bars, "processed-sample cache (local Redis): later")["passed"] is later
    assert _bar(bars, "processed-sample cache (daemon store): epoch 1")["passed"] is None  # not measured
    # The daemon store's row has bars of its own, judged on its own figures.
    both = report.evaluate_bars([], None, None, _samples([5.0, 5.0, 5.0]), _samples(ratios))
    assert _bar(both, "processed-sample cache (local Redis): epoch 1")["passed"] is True
    assert _bar(both, "processed-sample cache (daemon store): epoch 1")["passed"] is first
    assert _bar(both, "processed-sample cache (daemon store): later")["passed"] is later
    for figures in (None, _samples([], "HarnessError: redis-server is not installed")):
        missing = report.evaluate_bars([], None, None, figures)
        assert _bar(missing, "processed-sample cache (local Redis): epoch 1")["passed"] is None
    assert "redis-server is not installed" in _bar(missing, "processed-sample cache (local Redis): later")["measured"]


def test_sample_cache_epoch_1_names_its_fills() -> None:
    """Epoch 1 is the median of several fresh caches' first epochs: the bar says which."""
    figures = {**_samples([0.91, 3.0]), "fills": [0.84, 0.91, 0.95]}
    bar = _bar(report.evaluate_bars([], None, None, figures), "processed-sample cache (local Redis): epoch 1")
    assert bar["passed"] is True
    assert "median of 3 fills" in bar["measured"] and "0.84, 0.91, 0.95" in bar["measured"]
    assert "(ratios 0.84, 0.91, 0.95)" in report.samples_table(figures)


def test_sample_cache_table_shows_the_machines_cpu_per_sample() -> None:
    """The fills' and the baselines' CPU per sample by kind, as measured (none: no table)."""
    cpu = {"fills": {"user": 5828.1, "system": 781.2, "steal": 234.4, "idle": 437.5},
           "baselines": {"user": 5687.5, "system": 671.9, "steal": 31.2, "idle": 468.8}}
    table = report.samples_table({**_samples([0.89, 3.0]), "machine_cpu": cpu})
    assert "| epochs | user | system | steal | idle |" in table
    assert "| fills | 5,828 | 781 | 234 | 438 |" in table
    assert "| baselines | 5,688 | 672 | 31 | 469 |" in table
    assert "steal" not in report.samples_table({**_samples([0.89, 3.0]), "machine_cpu": None})


def test_the_s3_workloads_bars() -> None:
    """benchmarks/suite/s3.py's bars: epoch 1 and the mean of later epochs against the
    other system's, a failed run "not met", and the CPU bar lower-is-better."""
    from benchmarks.suite import s3

    def run(workload: str, system: str, rates: list[float], error: str | None = None) -> dict[str, Any]:
        return {"workload": workload, "system": system, "workers": 2, "error": error,
                "epochs": [{"samples_per_s": r} for r in rates]}

    out: dict[str, Any] = {"runs": [run("training", "local", [100, 200, 200]), run("training", "cubefs+ct", [95, 190, 200]),
                                    run("training", "rclone", [50, 200, 100]), run("raw_io", "cubefs+ct", [400, 900]),
                                    run("raw_io", "bucket", [101, 100]), run("raw_io", "rclone", [10], "HarnessError")],
                           "cpu": {"ratio": 2.5, "s3": {"cpu_us_per_file": 500.0}, "directory": {"cpu_us_per_file": 200.0}},
                           "delay_ms": 10, "error": None}
    got = {b["title"]: (None if b["ratio"] is None else round(b["ratio"], 3), b["met"]) for b in s3.bars(out)}
    assert got == {
        "training, epoch 1: cubefs+ct / local": (0.95, True),
        "training, later epochs: cubefs+ct / local": (0.975, True),
        "raw I/O 8 workers, epoch 1: cubefs+ct / raw bucket (obstore)": (3.96, False),
        "training, epoch 1: cubefs+ct / rclone": (1.9, True),
        "training, later epochs: cubefs+ct / rclone": (1.3, True),
        "raw I/O 8 workers, epoch 1: cubefs+ct / rclone": (None, False),
        "daemon CPU per cold object: s3 / directory backend": (2.5, False),
    }
    out["bars"] = s3.bars(out)
    assert "| raw I/O 8 workers, epoch 1: cubefs+ct / raw bucket (obstore) | 3.96 × | ≥ 4 × | **no** |" in s3.markdown(out)


def test_the_daemons_cpu_is_split_by_part_and_adds_up_to_the_total() -> None:
    """cpu_split: a thread counts what it used between the snapshots (all of it if it
    started in between); what a thread that ended in between used goes to ``other``, so the
    parts add up to the total's difference."""
    before = CpuSnapshot(10.0, {"1": ("trio", 4.0), "2": ("session", 1.0), "3": ("workers", 2.0),
                                "4": ("workers", 3.0)})
    # Thread 4 ended (0.5 s of the pass were its), thread 5 started (0.25 s).
    after = CpuSnapshot(12.5, {"1": ("trio", 5.0), "2": ("session", 1.5), "3": ("workers", 2.25),
                               "5": ("workers", 0.25)})
    parts = cpu_split(before, after)
    assert parts == {"session": 0.5, "trio": 1.0, "workers": 0.5, "other": 0.5}
    assert sum(parts.values()) == after.total - before.total
    assert list(parts) == list(CPU_PARTS)
    # Each thread's time rounded on its own may exceed the total: no part below zero.
    assert cpu_split(CpuSnapshot(1.0, {"1": ("trio", 1.0)}), CpuSnapshot(1.0, {"1": ("trio", 1.01)}))["other"] == 0.0
