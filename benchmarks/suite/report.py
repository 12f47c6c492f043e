"""results.json, its schema check, the performance bars, results.md and the PNG plots."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tools.harness import CPU_PARTS

# 2: the fast-path bars added the nvme workload (runs' ram_fraction), epochs' ram/disk block hits,
# the daemon_cpu figures, each bar's issues and runs' stop_error.
SCHEMA = "cubefs-fuse-bench/2"
WORKLOAD_TITLES = {
    "raw_io": "(a) raw I/O: DataLoader reading bytes only",
    "training": "(b) training: ImageFolder + RandomResizedCrop + tiny CNN on CPU",
    "cache": "(c) cache smaller than the dataset (page cache dropped before every epoch)",
    "nvme": "(d) NVMe regime: training loop, our RAM tier 1/4 of the dataset, page cache dropped before every epoch",
}
OURS_PLANNED = "cubefs+ct"

# -- ratios to local --------------------------------------------------------------------------


def local_key(run: dict[str, Any]) -> tuple[str, int, bool]:
    """Runs that share this key compare against the same local run (latency is irrelevant there)."""
    return run["workload"], run["workers"], run["drop_page_cache_each_epoch"]


def fill_ratios(runs: list[dict[str, Any]]) -> None:
    """Set every epoch's ratio_to_local (samples/s over the local run's, same epoch)."""
    local = {local_key(r): r for r in runs if r["system"] == "local" and not r["error"]}
    for run in runs:
        reference = local.get(local_key(run))
        for i, epoch in enumerate(run["epochs"]):
            if reference is not None and i < len(reference["epochs"]):
                epoch["ratio_to_local"] = epoch["samples_per_s"] / reference["epochs"][i]["samples_per_s"]
            else:
                epoch["ratio_to_local"] = None


# -- schema ---------------------------------------------------------------------------------------

_EPOCH_FIELDS: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "samples": (int,), "bytes": (int,), "seconds": (float,), "samples_per_s": (float,),
    "mb_per_s": (float,), "loss": (float, type(None)), "requests": (int, type(None)), "hits": (int, type(None)),
    "hit_rate": (float, type(None)), "stall_s": (float, type(None)), "prefetched_blocks": (int, type(None)),
    "ram_block_hits": (int, type(None)), "disk_block_hits": (int, type(None)),
    "daemon_cpu_s": (float, type(None)), "daemon_peak_rss_bytes": (int, type(None)),
    "remote_ops": (int, type(None)), "remote_reads": (int, type(None)), "remote_bytes": (int, type(None)),
    "remote_mean_delay_us": (float, type(None)), "remote_cpu_s": (float, type(None)),
    "ratio_to_local": (float, type(None)),
}
_RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "workload": (str,), "system": (str,), "latency_us": (int, float, type(None)), "workers": (int,),
    "cache_fraction": (float, type(None)), "drop_page_cache_each_epoch": (bool,),
    "ram_fraction": (float, type(None)), "setup_s": (float,),
    "warmup_s": (float,), "epochs": (list,), "error": (str, type(None)), "stop_error": (str, type(None)),
}
_TOP_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,), "preset": (dict,), "started": (str,), "finished": (str,), "duration_s": (float,),
    "interrupted": (bool,), "machine": (dict,), "load_average": (dict,), "dataset": (dict,),
    "emulator": (dict,), "systems": (dict,), "skipped": (dict,), "daemon_cpu": (dict, type(None)),
    "runs": (list,), "bars": (list,),
}
# The processed-sample cache workload (benchmarks/sample_cache.py's measure); results.json's
# ``sample_cache`` (a local Redis) and ``sample_cache_daemon`` (the daemon store), each
# absent or None when not measured.
_SAMPLES_FIELDS: dict[str, tuple[type, ...]] = {
    "store": (str,), "workers": (int,), "files": (int,), "epochs": (list,), "error": (str, type(None)),
}
_SAMPLES_EPOCH_FIELDS: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "baseline_samples_per_s": (float,), "cached_samples_per_s": (float,), "ratio": (float,),
}
SAMPLES_FIRST_EPOCH_BAR = 0.9  # the cached loader's epoch 1 (filling the store) over the baseline's
SAMPLES_LATER_EPOCHS_BAR = 2.0  # its later epochs over the baseline's
_CPU_FIELDS: dict[str, tuple[type, ...]] = {
    "readers": (int,), "files": (int,), "mean_file_bytes": (float,), "ram_fraction": (float,),
    "ram_tier_bytes": (int,), "disk_tier_bytes": (int,), "profile": (str,), "clock_tick_us": (float,),
    "passes": (list,), "error": (str, type(None)),
}
_CPU_PASS_FIELDS: dict[str, tuple[type, ...]] = {
    "kind": (str,), "passes": (int,), "files": (int,), "bytes": (int,), "seconds": (float,),
    "files_per_s": (float,), "daemon_cpu_s": (float,), "cpu_us_per_file": (float,),
    "cpu_us_per_file_by_part": (dict,), "resolution_us_per_file": (float,), "page_cache_dropped": (bool,), "fuse_reads": (int,), "ram_hits": (int,),
    "disk_hits": (int,), "misses": (int,),
}
CPU_KINDS = ("cold", "page_cache", "nvme", "ram")  # benchmarks/suite/daemon_cpu.py's passes, in order
# The large-file workload (benchmarks/large_file.py's measure); results.json's ``large_file``,
# absent or None when not measured.
_LARGE_FILE_FIELDS: dict[str, tuple[type, ...]] = {
    "mib": (int,), "read_bytes": (int,), "ram_tier_bytes": (int,), "rounds": (list,),
    "nvme_ratio": (float, type(None)), "cold_ratio": (float, type(None)), "error": (str, type(None)),
}
_LARGE_FILE_ROUND_FIELDS: dict[str, tuple[type, ...]] = {
    "round": (int,), "direct_mb_s": (list,), "cold_mb_s": (float,), "cold_ratio": (float,),
    "cold_daemon_cpu_s": (float,), "nvme_mb_s": (float,), "nvme_ratio": (float,), "nvme_daemon_cpu_s": (float,),
    "nvme_reads": (int,), "nvme_native_reads": (int,),
}


def _check(obj: Any, fields: dict[str, tuple[type, ...]], where: str) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{where}: not an object"]
    problems = []
    for key, types in fields.items():
        if key not in obj:
            problems.append(f"{where}: missing {key!r}")
        elif isinstance(obj[key], bool) and bool not in types:
            problems.append(f"{where}.{key}: bool where {types} expected")
        elif not isinstance(obj[key], types):
            problems.append(f"{where}.{key}: {type(obj[key]).__name__}, expected {'/'.join(t.__name__ for t in types)}")
        elif isinstance(obj[key], float) and not math.isfinite(obj[key]):
            problems.append(f"{where}.{key}: not finite")
    return problems


def validate(results: Any) -> list[str]:
    """Everything wrong with a results.json object (empty: valid)."""
    problems = _check(results, _TOP_FIELDS, "results")
    if problems:
        return problems
    if results["schema"] != SCHEMA:
        problems.append(f"results.schema: {results['schema']!r}, expected {SCHEMA!r}")
    for i, run in enumerate(results["runs"]):
        where = f"runs[{i}]"
        problems += _check(run, _RUN_FIELDS, where)
        if problems:
            continue
        if run["system"] not in results["systems"]:
            problems.append(f"{where}.system: {run['system']!r} not described in 'systems'")
        for j, epoch in enumerate(run["epochs"]):
            problems += _check(epoch, _EPOCH_FIELDS, f"{where}.epochs[{j}]")
            if not problems:
                if epoch["epoch"] != j:
                    problems.append(f"{where}.epochs[{j}].epoch: {epoch['epoch']}")
                if epoch["hit_rate"] is not None and not 0 <= epoch["hit_rate"] <= 1:
                    problems.append(f"{where}.epochs[{j}].hit_rate out of [0, 1]")
                if epoch["samples"] != results["dataset"].get("files"):
                    problems.append(f"{where}.epochs[{j}].samples: {epoch['samples']} != dataset files")
    problems += _validate_cpu(results["daemon_cpu"], results["dataset"])
    large = results.get("large_file")
    if large is not None:
        problems += _check(large, _LARGE_FILE_FIELDS, "large_file")
        if not problems:
            for j, figures in enumerate(large["rounds"]):
                problems += _check(figures, _LARGE_FILE_ROUND_FIELDS, f"large_file.rounds[{j}]")
    for key in ("sample_cache", "sample_cache_daemon"):
        samples = results.get(key)
        if samples is not None:
            problems += _check(samples, _SAMPLES_FIELDS, key)
            if not problems:
                for j, epoch in enumerate(samples["epochs"]):
                    problems += _check(epoch, _SAMPLES_EPOCH_FIELDS, f"{key}.epochs[{j}]")
    for i, bar in enumerate(results["bars"]):
        problems += _check(bar, {"bar": (str,), "passed": (bool, type(None)), "measured": (str,), "issues": (str,)},
                           f"bars[{i}]")
    return problems


def _validate_cpu(cpu: dict[str, Any] | None, dataset: dict[str, Any]) -> list[str]:
    if cpu is None:
        return []
    problems = _check(cpu, _CPU_FIELDS, "daemon_cpu")
    if problems:
        return problems
    kinds = [p.get("kind") if isinstance(p, dict) else None for p in cpu["passes"]]
    if kinds != list(CPU_KINDS[: len(kinds)]) or (cpu["error"] is None and len(kinds) != len(CPU_KINDS)):
        problems.append(f"daemon_cpu.passes: kinds {kinds}, expected {list(CPU_KINDS)} (fewer only with an error)")
    for i, figure in enumerate(cpu["passes"]):
        where = f"daemon_cpu.passes[{i}]"
        found = _check(figure, _CPU_PASS_FIELDS, where)
        problems += found
        if found:
            continue
        if figure["passes"] < 1 or figure["files"] != figure["passes"] * dataset.get("files", -1):
            problems.append(f"{where}: {figure['files']} files in {figure['passes']} passes over the dataset")
        if min(figure["seconds"], figure["daemon_cpu_s"], figure["cpu_us_per_file"]) < 0:
            problems.append(f"{where}: negative time")
        parts = figure["cpu_us_per_file_by_part"]
        if sorted(parts) != sorted(CPU_PARTS) or not all(
                isinstance(v, float) and math.isfinite(v) and v >= 0 for v in parts.values()):
            problems.append(f"{where}.cpu_us_per_file_by_part: {parts!r}, expected "
                            f"non-negative seconds for each of {list(CPU_PARTS)}")
    return problems


# -- the performance bars ------------------------------------------------------------------------


def _find(runs: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for run in runs:
        if all(run.get(k) == v for k, v in match.items()) and not run["error"] and run["epochs"]:
            return run
    return None


def _fmt(values: Iterable[float | None], spec: str = ".2f") -> str:
    return " / ".join("-" if v is None else format(v, spec) for v in values)


def _bar(issues: str, text: str, passed: bool | None, measured: str) -> dict[str, Any]:
    return {"bar": text, "passed": passed, "measured": measured, "issues": issues}


def row_key(run: dict[str, Any]) -> tuple[Any, ...]:
    """Runs with this key are one row: the same workload configuration on different systems."""
    return run["workload"], run["latency_us"], run["workers"], run["cache_fraction"], run.get("ram_fraction")


def _later(run: dict[str, Any]) -> list[float | None]:
    return [e["ratio_to_local"] for e in run["epochs"][1:]]


# the native data plane's daemon CPU bars: µs of daemon CPU per ~110 KB file, one reader.
CPU_BARS_US = {"cold": 150.0, "page_cache": 10.0, "ram": 60.0, "nvme": 100.0}
_CPU_BAR_TEXT = {
    "cold": "daemon CPU per ~110 KB file, cold (local source, no latency) ≤ 150 µs",
    "page_cache": "daemon CPU per file, kernel page-cache hit ≤ 10 µs",
    "ram": "daemon CPU per file, RAM-tier hit (page cache dropped) ≤ 60 µs",
    "nvme": "daemon CPU per file, NVMe-tier hit (RAM tier smaller than the data, page cache dropped) ≤ 100 µs",
}
TRAINING_LATENCIES_US = (300, 2000)  # the fast path's training bars


def _cpu_bars(cpu: dict[str, Any] | None) -> list[dict[str, Any]]:
    figures = {f["kind"]: f for f in (cpu or {}).get("passes", [])}
    bars = []
    for kind, limit in CPU_BARS_US.items():
        f = figures.get(kind)
        if f is None:
            why = f"not measured ({cpu['error']})" if cpu and cpu.get("error") else "not measured"
            bars.append(_bar("28", _CPU_BAR_TEXT[kind], None, why))
            continue
        bars.append(_bar("28", _CPU_BAR_TEXT[kind], f["cpu_us_per_file"] <= limit,
                         f"{f['cpu_us_per_file']:,.0f} µs per file (± {f['resolution_us_per_file']:,.0f}: one clock "
                         f"tick over {f['files']:,} files), {f['files_per_s']:,.0f} files/s"))
    return bars


LARGE_FILE_BARS = {"nvme": 0.9, "cold": 0.6}  # × a direct read of the file (benchmarks/large_file.py)


def _large_file_bars(figures: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One large file read whole with 1 MiB reads, vs a direct read of the source: from the
    NVMe tier ≥ 0.9 ×, cold ≥ 0.6 × (the medians over the workload's rounds)."""
    bars = []
    for kind, bar in LARGE_FILE_BARS.items():
        where = "from the NVMe tier" if kind == "nvme" else "cold (local source)"
        text = f"one large file read whole with 1 MiB reads, {where}: ≥ {bar} × a direct read"
        ratio = figures.get(f"{kind}_ratio") if figures else None
        if ratio is None:
            why = f"not measured ({figures['error']})" if figures and figures.get("error") else "not measured"
            bars.append(_bar("28", text, None, why))
            continue
        assert figures is not None  # a ratio came from it
        per_round = ", ".join(f"{r[f'{kind}_ratio']:.2f}" for r in figures["rounds"])
        bars.append(_bar("28", text, ratio >= bar, f"{ratio:.2f} × (median of {per_round}; {figures['mib']} MiB)"))
    return bars


# The native data plane's bars over the same rows, stricter than the foundation's (its
# rows begin with NATIVE): training with cube_torch epoch 1 / later epochs, the NVMe regime
# with cube_torch, and the mount without cube_torch, all against the local copy.
NATIVE = "native data plane: "
NATIVE_TRAINING = (0.95, 0.98)
NATIVE_NVME = 1.0
NATIVE_PLAIN = 0.98


def _training_bars(runs: list[dict[str, Any]], first_bar: float = 0.90, later_bar: float = 0.97,
                   native: bool = False) -> list[dict[str, Any]]:
    bars = []
    for latency in TRAINING_LATENCIES_US:
        where = f"{NATIVE if native else ''}training with cube_torch, {latency / 1000:g} ms, cache ≥ dataset"
        text1 = f"{where}: epoch 1 ≥ {first_bar:.2f} × local"
        text2 = f"{where}: later epochs ≥ {later_bar:.2f} × local"
        # The foundation bars named 300 µs only; the native data plane's, both latencies.
        issues = "28" if native else "5, 12" if latency == 300 else "12"
        run = _find(runs, workload="training", system=OURS_PLANNED, latency_us=latency, cache_fraction=None)
        if run is None or run["epochs"][0]["ratio_to_local"] is None:
            why = "not measured" + ("" if run is not None else f" (no training run at {latency / 1000:g} ms)")
            bars += [_bar(issues, text1, None, why), _bar(issues, text2, None, why)]
            continue
        first = run["epochs"][0]["ratio_to_local"]
        bars.append(_bar(issues, text1, first >= first_bar, f"{first:.2f} × local"))
        later = _later(run)
        if not later or any(v is None for v in later):
            bars.append(_bar(issues, text2, None, "not measured (one epoch)" if not later else "not measured"))
        else:
            bars.append(_bar(issues, text2, min(v for v in later if v is not None) >= later_bar,
                             f"{_fmt(later)} × local (epochs 2..)"))
    return bars


def _nvme_bar(runs: list[dict[str, Any]], bar: float = 0.90, native: bool = False) -> dict[str, Any]:
    text = (f"{NATIVE if native else ''}NVMe regime (dataset 4 × the RAM tier, page cache dropped every epoch): "
            f"later epochs with cube_torch ≥ {bar:.2f} × local")
    issues = "28" if native else "12"
    planned = _find(runs, workload="nvme", system=OURS_PLANNED)
    plain = _find(runs, workload="nvme", system="cubefs")
    without = ""
    if plain is not None and len(plain["epochs"]) > 1 and None not in _later(plain):
        without = f"; without cube_torch {_fmt(_later(plain))}"
    later = _later(planned) if planned is not None else []
    if planned is None or not later or any(v is None for v in later):
        return _bar(issues, text, None, "not measured" + (without and f" with cube_torch{without}"))
    ram = planned.get("ram_fraction")
    return _bar(issues, text, min(v for v in later if v is not None) >= bar,
                f"{_fmt(later)} × local (epochs 2..{f', RAM tier {ram:g} × dataset' if ram else ''}){without}")


def _raw_bars(runs: list[dict[str, Any]], ceiling_files_per_s: float | None) -> list[dict[str, Any]]:
    bars = []
    planned = _find(runs, workload="raw_io", system=OURS_PLANNED, latency_us=2000, workers=8)
    raw = _find(runs, workload="raw_io", system="remote", latency_us=2000, workers=8)
    text1 = "raw I/O, 8 workers, 2 ms: epoch 1 with cube_torch ≥ 10 × raw remote"
    text2 = "raw I/O, 8 workers, 2 ms: later epochs with cube_torch ≥ 0.25 × local files/s"
    if planned is None or raw is None:
        bars.append(_bar("5, 12", text1, None, "not measured"))
    else:
        factor = planned["epochs"][0]["samples_per_s"] / raw["epochs"][0]["samples_per_s"]
        ceiling = (f"; emulator ceiling {ceiling_files_per_s:,.0f} files/s, so at most "
                   f"{ceiling_files_per_s / raw['epochs'][0]['samples_per_s']:.1f} × is measurable here"
                   if ceiling_files_per_s else "")
        bars.append(_bar("5, 12", text1, factor >= 10, f"{factor:.1f} × raw remote "
                         f"({planned['epochs'][0]['samples_per_s']:,.0f} vs {raw['epochs'][0]['samples_per_s']:,.0f} files/s"
                         f"{ceiling})"))
    later = _later(planned) if planned is not None else []
    if not later or any(v is None for v in later):
        bars.append(_bar("5", text2, None, "not measured"))
    else:
        bars.append(_bar("5", text2, min(v for v in later if v is not None) >= 0.25, f"{_fmt(later)} × local (epochs 2..)"))
    return bars


def _plain_training_bar(runs: list[dict[str, Any]], bar: float = 0.95, native: bool = False) -> dict[str, Any]:
    text = f"{NATIVE if native else ''}our mount without cube_torch (FUSE path only), training, later epochs ≥ {bar:.2f} × local"
    issues = "28" if native else "12"
    measured, ratios = [], []
    for run in runs:
        if run["workload"] == "training" and run["system"] == "cubefs" and not run["error"] and len(run["epochs"]) > 1:
            later = _later(run)
            if None not in later:
                ratios += [v for v in later if v is not None]
                measured.append(f"{config_label(run)}: {_fmt(later)}")
    if not ratios:
        return _bar(issues, text, None, "not measured")
    return _bar(issues, text, min(ratios) >= bar, "; ".join(measured) + " × local (epochs 2..)")


def _cache_bars(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    bars = []
    planned = _find(runs, workload="cache", system=OURS_PLANNED, cache_fraction=0.5)
    plain = _find(runs, workload="cache", system="cubefs", cache_fraction=0.5)
    text1 = "cache = 0.5 × dataset: hit rate ≥ 0.45 every epoch with cube_torch"
    text2 = "cache = 0.5 × dataset: cube_torch ≥ 1.5 × our mount without it (all epochs)"
    if planned is None:
        bars.append(_bar("5", text1, None, "not measured"))
    else:
        rates = [e["hit_rate"] for e in planned["epochs"]]
        ok = all(r is not None and r >= 0.45 for r in rates)
        bars.append(_bar("5", text1, ok, f"hit rate per epoch {_fmt(rates)}"))
    if planned is None or plain is None:
        bars.append(_bar("5", text2, None, "not measured"))
    else:
        factor = _throughput(planned) / _throughput(plain)
        per_epoch = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(planned["epochs"], plain["epochs"])]
        bars.append(_bar("5", text2, factor >= 1.5, f"{factor:.2f} × over all epochs (per epoch {_fmt(per_epoch)})"))
    return bars


def _row_label(run: dict[str, Any]) -> str:
    return f"{run['workload']} {config_label(run)}"


def _versus(runs: list[dict[str, Any]], other: str, *, strict: bool) -> tuple[int, list[str]]:
    """(epochs compared, those where cube_torch was not ahead of ``other``), same rows.

    ``strict``: ahead means faster; otherwise at least as fast (never slower).
    """
    ours = {row_key(r): r for r in runs if r["system"] == OURS_PLANNED and not r["error"]}
    rows = 0
    behind: list[str] = []
    for run in runs:
        mine = ours.get(row_key(run))
        if run["system"] != other or run["error"] or mine is None:
            continue
        for a, b in zip(mine["epochs"], run["epochs"]):
            rows += 1
            x, y = a["samples_per_s"], b["samples_per_s"]
            if x < y or (strict and x == y):
                behind.append(f"{_row_label(run)} epoch {a['epoch'] + 1}: {x:,.0f} vs {y:,.0f} files/s ({x / y:.2f} ×)")
    return rows, behind


def _fast_path_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Does cube_torch's fast path still beat the native data plane (the same runs with it
    off)?  It is kept only where a row says so."""
    text = "cube_torch's fast path vs the native data plane (fast path off), same rows: where it still wins"
    rows, behind = _versus(runs, "cubefs+ct-nofp", strict=True)
    if not rows:
        return _bar("28", text, None, "not measured (run with --systems including cubefs+ct-nofp)")
    wins = rows - len(behind)
    return _bar("28", text, wins > 0, f"ahead on {wins} of {rows} epochs"
                + (f"; not ahead: {'; '.join(behind)}" if behind else ""))


def _versus_bars(runs: list[dict[str, Any]], systems_run: set[str]) -> list[dict[str, Any]]:
    bars = [_fast_path_row(runs)]
    rows, behind = _versus(runs, "cubefs", strict=False)
    text = "with cube_torch vs without (our mount), every row and epoch: never slower"
    if not rows:
        bars.append(_bar("12", text, None, "not measured (no row has both)"))
    else:
        bars.append(_bar("12", text, not behind, f"at least as fast on {rows - len(behind)} of {rows} epochs"
                         + (f"; slower: {'; '.join(behind)}" if behind else "")))
    for peer, title in (("rclone", "rclone's VFS cache"), ("juicefs", "JuiceFS")):
        rows, behind = _versus(runs, peer, strict=True)
        text = f"with cube_torch vs {title}, same runs: ahead on every row and epoch"
        issues = "5, 12" if peer == "rclone" else "12"  # the foundation bars named rclone only
        if not rows:
            why = f"{peer} not run" if peer not in systems_run else f"no row has both {peer} and {OURS_PLANNED}"
            bars.append(_bar(issues, text, None, f"not measured ({why})"))
        else:
            bars.append(_bar(issues, text, not behind, f"ahead on {rows - len(behind)} of {rows} epochs"
                             + (f"; behind: {'; '.join(behind)}" if behind else "")))
    return bars


def evaluate_bars(runs: list[dict[str, Any]], ceiling_files_per_s: float | None = None,
                  daemon_cpu: dict[str, Any] | None = None,
                  sample_cache: dict[str, Any] | None = None,
                  sample_cache_daemon: dict[str, Any] | None = None,
                  large_file: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Where the run stands against each performance bars (passed None: not measured).

    The fast-path bars come first; of the foundation's, those it restates (training at 300 µs, raw
    I/O epoch 1 ≥ 10 × the raw remote, ahead of rclone) are kept once, marked "5, 12",
    and those it does not mention (raw I/O later epochs, the cache 0.5 bars) follow.
    ``ceiling_files_per_s``: the emulator's own zero-latency ceiling, quoted next to
    epoch-1 figures so that a bar the emulator itself prevents is recognisable.
    ``daemon_cpu``: results.json's daemon_cpu object (None: not measured); ``sample_cache``:
    its sample_cache object (a local Redis; None: not measured); ``sample_cache_daemon``: the
    same with the daemon store; ``large_file``: its large_file object (None: not measured).
    """
    systems_run = {r["system"] for r in runs}
    raw = _raw_bars(runs, ceiling_files_per_s)
    return (_cpu_bars(daemon_cpu) + _large_file_bars(large_file)
            + _training_bars(runs, *NATIVE_TRAINING, native=True)
            + [_nvme_bar(runs, NATIVE_NVME, native=True), _plain_training_bar(runs, NATIVE_PLAIN, native=True)]
            + _training_bars(runs) + [_nvme_bar(runs), raw[0], _plain_training_bar(runs)]
            + _versus_bars(runs, systems_run) + raw[1:] + _cache_bars(runs)
            + _samples_bars(sample_cache, "local Redis") + _samples_bars(sample_cache_daemon, "daemon store"))


def _samples_bars(figures: dict[str, Any] | None, store: str) -> list[dict[str, Any]]:
    """The processed-sample cache with ``store``: epoch 1 >= 0.9 x the loader without it,
    later epochs >= 2 x."""
    first = (f"processed-sample cache ({store}): epoch 1 >= {SAMPLES_FIRST_EPOCH_BAR:g} × the same loader "
             "without it")
    later = f"processed-sample cache ({store}): later epochs >= {SAMPLES_LATER_EPOCHS_BAR:g} × without it"
    epochs = figures["epochs"] if figures is not None else []
    if not epochs:
        why = "not measured" + (f" ({figures['error']})" if figures is not None and figures["error"] else "")
        return [_bar("15", first, None, why), _bar("15", later, None, why)]
    ratios = [e["ratio"] for e in epochs]
    fills = (figures.get("fills") or []) if figures is not None else []
    of_fills = (f"; the median of {len(fills)} fills of a fresh cache: " + ", ".join(f"{r:.2f}" for r in fills)
                if len(fills) > 1 else "")
    bars = [_bar("15", first, ratios[0] >= SAMPLES_FIRST_EPOCH_BAR,
                 f"{ratios[0]:.2f} × ({epochs[0]['baseline_samples_per_s']:,.0f} → "
                 f"{epochs[0]['cached_samples_per_s']:,.0f} samples/s{of_fills})")]
    if len(ratios) < 2:
        bars.append(_bar("15", later, None, "not measured (one epoch)"))
    else:
        bars.append(_bar("15", later, min(ratios[1:]) >= SAMPLES_LATER_EPOCHS_BAR,
                         "epochs 2+: " + ", ".join(f"{r:.2f} ×" for r in ratios[1:])))
    return bars


def _throughput(run: dict[str, Any]) -> float:
    return float(sum(e["samples"] for e in run["epochs"]) / sum(e["seconds"] for e in run["epochs"]))


# -- Markdown ---------------------------------------------------------------------------------------------


def config_label(run: dict[str, Any]) -> str:
    parts = []
    if run["latency_us"] is not None:
        parts.append(f"{run['latency_us'] / 1000:g} ms")
    parts.append(f"{run['workers']} w")
    if run["workload"] == "cache":
        parts.append("cache -" if run["cache_fraction"] is None else f"cache {run['cache_fraction']:g}")
    if run.get("ram_fraction") is not None:
        parts.append(f"RAM {run['ram_fraction']:g}")
    return ", ".join(parts)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(runs: list[dict[str, Any]], workload: str, epochs: int) -> str:
    header = ["config", "system"]
    for e in range(epochs):
        header += [f"ep{e + 1} files/s", f"ep{e + 1} × local"]
    header += ["ep1 MB/s", "hit rate per epoch", "stall s per epoch", "daemon CPU s", "peak RSS MiB",
               "remote ops/file ep1", "remote CPU s ep1", "error"]
    blocks = workload == "nvme"  # where the tier that served the blocks is the point
    if blocks:
        header.insert(-1, "RAM / NVMe block hits per epoch")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for run in runs:
        if run["workload"] != workload:
            continue
        ep = run["epochs"]
        cells = [config_label(run), run["system"]]
        for e in range(epochs):
            cells += [_cell(ep[e]["samples_per_s"], ",.0f") if e < len(ep) else "-",
                      _cell(ep[e]["ratio_to_local"], ".2f") if e < len(ep) else "-"]
        cpu = [x["daemon_cpu_s"] for x in ep if x["daemon_cpu_s"] is not None]
        rss = [x["daemon_peak_rss_bytes"] for x in ep if x["daemon_peak_rss_bytes"] is not None]
        ops = ep[0]["remote_ops"] if ep and ep[0]["remote_ops"] is not None else None
        cells += [
            _cell(ep[0]["mb_per_s"], ",.1f") if ep else "-",
            _fmt([x["hit_rate"] for x in ep]) if any(x["hit_rate"] is not None for x in ep) else "-",
            _fmt([x["stall_s"] for x in ep], ".1f") if any(x["stall_s"] is not None for x in ep) else "-",
            f"{sum(cpu):.1f}" if cpu else "-",
            f"{max(rss) / 2**20:,.0f}" if rss else "-",
            f"{ops / ep[0]['samples']:.1f}" if ops is not None else "-",
            _cell(ep[0]["remote_cpu_s"], ".1f") if ep else "-",
            (run["error"] or (f"stopping: {run['stop_error']}" if run.get("stop_error") else "")).replace("|", "/")[:120],
        ]
        if blocks:
            cells.insert(-1, ", ".join(f"{x['ram_block_hits']} / {x['disk_block_hits']}" for x in ep
                                       if x.get("disk_block_hits") is not None) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    ds = results["dataset"]
    em = results["emulator"]
    preset = results["preset"]
    out = [f"# cubefs-fuse benchmark ({preset['name']} preset)", ""]
    out.append(f"- date: {results['started']} ({results['duration_s'] / 60:.1f} min"
               + (", **interrupted**" if results["interrupted"] else "") + ")")
    out.append(f"- machine: {m['cpus']}, {m['ram']} RAM, Linux {m['kernel']}, Python {m['python']}")
    la = results["load_average"]
    out.append(f"- load average (1/5/15 min): start {_fmt(la['start'])}, end {_fmt(la['end'])}")
    if not ds:
        return "\n".join(out + ["", "(stopped before the dataset existed: no results)", ""])
    out.append(f"- dataset: {ds['files']:,} JPEG files in {ds['classes']} class folders, "
               f"{ds['bytes'] / 1e6:,.1f} MB (mean {ds['bytes'] / ds['files'] / 1e3:,.0f} KB)")
    ceiling = em.get("ceiling") or {}
    if ceiling:
        program = "tools/slowfs_c (C)" if em.get("implementation") == "c" else "tools/slowfs.py (Python)"
        out.append(f"- emulated remote ({program}, {em['threads']} operations in flight): ceiling with zero "
                   f"latency {ceiling['files_per_s']:,.0f} files/s ({ceiling['mb_per_s']:,.0f} MB/s) with "
                   f"{ceiling['readers']} reader processes, {ceiling['ops_per_file']:.1f} operations per file")
    for p in em.get("presets", []):
        out.append(f"- remote preset {p['latency_us']:g} µs: measured mean delay {_cell(p.get('measured_delay_us'), ',.0f')} µs "
                   f"over {p.get('delays', 0):,} operations; bandwidth cap "
                   + (f"{p['bandwidth_mb_s']:g} MB/s" if p["bandwidth_mb_s"] else "none")
                   + f"; kernel entry/attribute cache {p.get('cache_timeout_s', 0):g} s")
    for name, info in results["systems"].items():
        out.append(f"- `{name}`: {info['title']}" + (f" ({info['version']})" if info.get("version") else ""))
    for name, why in results["skipped"].items():
        out.append(f"- `{name}` skipped: {why}")
    out += ["", "## Bars", "", "| issue | bar | measured | met |", "|---|---|---|---|"]
    for bar in results["bars"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[bar["passed"]]
        out.append(f"| {bar['issues']} | {bar['bar']} | {bar['measured']} | {met} |")
    if results.get("daemon_cpu") is not None:
        out += ["", "## Daemon CPU per file (one reader, local source, no latency)", "",
                cpu_table(results["daemon_cpu"])]
    if results.get("large_file") is not None:
        from benchmarks.large_file import table

        out += ["", "## One large file (local source, no latency)", "", table(results["large_file"])]
    stores = [results[k] for k in ("sample_cache", "sample_cache_daemon") if results.get(k) is not None]
    if stores:
        out += ["", "## (e) processed-sample cache: the training loader with and without CachedDataset"]
        for figures in stores:
            out += ["", samples_table(figures)]
    epochs = int(preset["epochs"])
    for workload, title in WORKLOAD_TITLES.items():
        if any(r["workload"] == workload for r in results["runs"]):
            out += ["", f"## {title}", "", markdown_table(results["runs"], workload, epochs)]
    out += ["", "Columns: files/s (= samples/s) per epoch and its ratio to the local copy's same epoch; "
            "hit rate and stall seconds from our daemon's /metrics (file requests: an open is a hit when none "
            "of its reads waited on the remote); daemon CPU: the daemon's user+system seconds over all epochs; "
            "peak RSS: its VmHWM; remote ops/file: operations the emulated remote served per file in epoch 1; "
            "remote CPU s: what the emulator itself spent in epoch 1 (on the same cores as everything else).",
            ""]
    return "\n".join(out)


def samples_table(figures: dict[str, Any]) -> str:
    """results.md's table of the sample-cache workload (benchmarks/sample_cache.py)."""
    lines = [f"{figures['files']} files, {figures['workers']} workers, store: {figures['store']}; decode + resize "
             "cached, random crop + flip after; baseline: the same pipeline without the cache, same run, "
             "epochs interleaved.", "",
             "| epoch | without, samples/s | with the cache, samples/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {e['epoch']} | {e['baseline_samples_per_s']:,.0f} | {e['cached_samples_per_s']:,.0f} | "
              f"{e['ratio']:.2f} |" for e in figures["epochs"]]
    fills = figures.get("fills") or []
    if len(fills) > 1:
        lines += ["", f"Epoch 1 is the median of {len(fills)} first epochs, each filling a fresh cache (ratios "
                  + ", ".join(f"{r:.2f}" for r in fills) + "); the later epochs read the last one."]
    cpu = figures.get("machine_cpu")
    if cpu:
        kinds = list(cpu["fills"])  # user, system, steal, idle (sample_cache.CPU_KINDS)
        lines += ["", "The whole machine's CPU per sample (us, all CPUs, /proc/stat; means over the fills and over "
                  "the baseline epochs they are compared with; steal: the host's time, on a VM its work for this "
                  "machine's virtual disk among it):", "",
                  "| epochs | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        lines += [f"| {key} | " + " | ".join(f"{cpu[key][k]:,.0f}" for k in kinds) + " |"
                  for key in ("fills", "baselines")]
    if figures["error"]:
        lines += ["", f"failed: {figures['error']}"]
    return "\n".join(lines)


def cpu_table(cpu: dict[str, Any]) -> str:
    """results.md's table of the daemon's CPU per file, with its clock-tick caveat."""
    header = ["pass", "page cache dropped", "passes × files", "files/s", "daemon CPU µs/file", "± µs/file (1 tick)",
              "of which C session / trio / workers / other", "ceiling files/s (1 / CPU)", "FUSE reads/file",
              "RAM hits", "NVMe hits", "misses"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    titles = {"cold": "cold (local source)", "page_cache": "kernel page-cache hit",
              "nvme": "NVMe-tier hit (remounted)", "ram": "RAM-tier hit (page cache dropped)"}
    for f in cpu["passes"]:
        per_pass = f["files"] // max(1, f["passes"])
        lines.append("| " + " | ".join([
            titles.get(f["kind"], f["kind"]), "yes" if f["page_cache_dropped"] else "no",
            f"{f['passes']} × {per_pass:,}", f"{f['files_per_s']:,.0f}", f"{f['cpu_us_per_file']:,.0f}",
            f"{f['resolution_us_per_file']:,.1f}",
            " / ".join(f"{f['cpu_us_per_file_by_part'][part]:,.0f}" for part in CPU_PARTS),
            f"{1e6 / f['cpu_us_per_file']:,.0f}" if f["cpu_us_per_file"] > 0 else "—",
            f"{f['fuse_reads'] / f['files']:.2f}", f"{f['ram_hits']:,}",
            f"{f['disk_hits']:,}", f"{f['misses']:,}"]) + " |")
    notes = ["", f"Our daemon (`\"profile\": \"{cpu.get('profile', '')}\"`), {cpu.get('readers', 1)} reader process, "
             f"every file of the dataset (mean {cpu.get('mean_file_bytes', 0) / 1e3:,.0f} KB) read whole in a shuffled "
             f"order straight from the dataset's directory (no emulator); RAM tier "
             f"{cpu.get('ram_fraction', 0):g} × the dataset, NVMe tier holding all of it (the RAM-tier pass: a second "
             "daemon whose RAM tier holds all of it). Daemon CPU: utime + stime of "
             "all its threads from `/proc/<pid>/stat` over the pass, per file. **Clock-tick caveat**: the kernel "
             f"reports that time in clock ticks of {cpu.get('clock_tick_us', 0) / 1000:g} ms, so each figure is "
             "uncertain by about one tick over the files read (the ± column); the page-cache pass is repeated to "
             "shrink it. The cold pass includes waiting for the NVMe write-behind to finish. The ceiling is one "
             "daemon core's files/s in that regime, whatever the node. By part, from each thread's "
             "`/proc/<pid>/task/<tid>/stat`: the C session's threads (`cfs-*`: reader threads, flusher, "
             "watchdog), the trio thread, trio's worker threads (the backend's calls, NVMe reads and "
             "writes), and the rest (other threads and threads that ended meanwhile)."]
    if cpu.get("error"):
        notes.append(f"**Failed**: {cpu['error']}")
    return "\n".join(lines + notes)


# -- plots ---------------------------------------------------------------------------------------------------


def plot(results: dict[str, Any], out_dir: Path) -> list[str]:
    """One PNG per workload: ratio to local, epoch 1 and later epochs, per system and config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    runs = [r for r in results["runs"] if r["epochs"] and not r["error"]]
    for workload, title in WORKLOAD_TITLES.items():
        selected = [r for r in runs if r["workload"] == workload]
        if not selected:
            continue
        configs = list(dict.fromkeys(config_label(r) for r in selected if r["system"] != "local"))
        systems = list(dict.fromkeys(r["system"] for r in selected if r["system"] != "local"))
        if not configs:
            continue
        panels: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [("epoch 1", lambda r: r["epochs"][0]["ratio_to_local"]),
                  ("later epochs (mean)", lambda r: _mean([e["ratio_to_local"] for e in r["epochs"][1:]]))]
        if workload == "cache":
            panels.append(("hit rate, mean over epochs", lambda r: _mean([e["hit_rate"] for e in r["epochs"]])))
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        width = 0.8 / max(1, len(systems))
        for ax, (label, value) in zip(axes[0], panels):
            for i, system in enumerate(systems):
                ys = []
                for config in configs:
                    run = next((r for r in selected if r["system"] == system and config_label(r) == config), None)
                    v = value(run) if run is not None else None
                    ys.append(v if v is not None else math.nan)
                xs = [c + (i - (len(systems) - 1) / 2) * width for c in range(len(configs))]
                ax.bar(xs, ys, width, label=system)
            if label != "hit rate, mean over epochs":
                ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
                ax.set_ylabel("files/s ÷ local copy")
                ax.set_yscale("log")
            else:
                ax.set_ylim(0, 1.05)
                ax.set_ylabel("hit rate")
            ax.set_title(label)
            ax.set_xticks(range(len(configs)), configs, rotation=20, fontsize=8)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
