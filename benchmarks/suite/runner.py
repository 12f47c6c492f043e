"""The suite: dataset, emulator ceiling, one emulator per latency preset, every run, the report."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from humanfriendly import format_size
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from benchmarks.suite import daemon_cpu, report
from benchmarks.suite.cleanup import Registry, signals_ignored, signals_interrupt
from benchmarks.suite.presets import Preset, build_parser, resolve
from benchmarks.suite.remote import EMULATOR_THREADS, EMULATOR_TITLES, Remote, measure_ceiling
from benchmarks.suite.systems import DATASET_DIR, SYSTEMS, Context, RunSpec, System, describe
from tools.harness import Dataset, HarnessError, machine, make_class_images, remove_workdir

console = Console(stderr=True, soft_wrap=True)  # soft_wrap: log lines are not cut at 80 columns in files
SEED = 7  # the shuffle seed: every system reads the same order in the same epoch
# The sample-cache workload's files (its own photo-like JPEGs): ~1-2 s per baseline epoch on
# 2 cores, so the workload (making them, a warm-up and the epochs of two loaders) adds ~30 s
# per store (Redis, the daemon's).
SAMPLE_CACHE_FILES = 320


@dataclass(frozen=True)
class Planned:
    workload: str
    system: str
    latency_us: int | None
    workers: int
    cache_fraction: float | None
    drop_each_epoch: bool
    ram_fraction: float | None = None  # our RAM tier alone (the NVMe regime)


def plan(preset: Preset, systems: list[str]) -> list[Planned]:
    """Every run, in order.  Local runs once per (workload, workers): latency plays no role."""
    runs: list[Planned] = []
    if "raw_io" in preset.workloads:
        for workers in preset.raw_workers:
            if "local" in systems:
                runs.append(Planned("raw_io", "local", None, workers, None, False))
            for latency in preset.raw_latencies_us:
                runs += [Planned("raw_io", s, latency, workers, None, False) for s in systems if s != "local"]
    if "training" in preset.workloads:
        if "local" in systems:
            runs.append(Planned("training", "local", None, preset.train_workers, None, False))
        for latency in preset.train_latencies_us:
            runs += [Planned("training", s, latency, preset.train_workers, None, False)
                     for s in systems if s != "local"]
    if "cache" in preset.workloads:
        # The cache must be the only cache: the page cache is dropped before every epoch,
        # standing for a dataset much larger than RAM.  Local and raw remote have no cache
        # to size, so they run once.
        workers, latency = preset.cache_workers, preset.cache_latency_us
        if "local" in systems:
            runs.append(Planned("cache", "local", None, workers, None, True))
        if "remote" in systems:
            runs.append(Planned("cache", "remote", latency, workers, None, True))
        for fraction in preset.cache_fractions:
            runs += [Planned("cache", s, latency, workers, fraction, True)
                     for s in systems if SYSTEMS[s].caches]
    if "nvme" in preset.workloads:
        # The NVMe regime : the training loop, page cache dropped before every
        # epoch for every system, local included; disk caches hold the dataset, our RAM tier
        # a fraction of it.  The raw remote has no cache, so nothing to compare here.
        workers, latency, ram = preset.train_workers, preset.nvme_latency_us, preset.nvme_ram_fraction
        if "local" in systems:
            runs.append(Planned("nvme", "local", None, workers, None, True))
        runs += [Planned("nvme", s, latency, workers, None, True, ram) for s in systems if SYSTEMS[s].caches]
    return runs


# What fails one run (recorded in its ``error``), not the whole suite.
RUN_FAILURES = (HarnessError, OSError, RuntimeError, ValueError, AssertionError)


def _stop(system: System) -> str | None:
    """Stop the system; why it failed, if it did (the run's epochs stand: ``stop_error``)."""
    try:
        system.stop()
    except RUN_FAILURES as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class Suite:
    def __init__(self, preset: Preset, out: Path, workdir: Path, registry: Registry) -> None:
        self.preset = preset
        self.out = out
        self.workdir = workdir
        self.registry = registry
        self.started = time.time()
        self.results: dict[str, Any] = {
            "schema": report.SCHEMA, "preset": preset.to_json(), "started": _now(), "finished": "",
            "duration_s": 0.0, "interrupted": False, "machine": machine(),
            "load_average": {"start": list(os.getloadavg()), "end": []}, "dataset": {},
            "emulator": {"threads": EMULATOR_THREADS, "implementation": preset.emulator, "ceiling": None,
                         "presets": []},
            "systems": {}, "skipped": {}, "daemon_cpu": None, "large_file": None, "sample_cache": None, "sample_cache_daemon": None,
            "s3": None, "runs": [], "bars": [],
        }

    def run(self) -> None:
        preset = self.preset
        backing = self.workdir / "remote-disk"
        console.print(f"[bold]cubefs-fuse benchmark[/], preset {preset.name}: scratch {self.workdir}, "
                      f"results to {self.out}; load average {_la()}")
        started = time.perf_counter()
        dataset = make_class_images(backing / DATASET_DIR, preset.files, classes=preset.classes,
                                    mean_bytes=preset.mean_kb * 1000, seed=SEED)
        self.results["dataset"] = {"files": len(dataset.files), "bytes": dataset.total_bytes,
                                   "classes": preset.classes, "jpeg": dataset.jpeg}
        console.print(f"dataset: {len(dataset.files):,} JPEGs, {format_size(dataset.total_bytes)} "
                      f"in {preset.classes} class folders ({time.perf_counter() - started:.1f} s)")
        ctx = Context(self.workdir, backing, dataset, self.registry)

        systems: dict[str, System] = {}
        for name in preset.systems:
            system = SYSTEMS[name](ctx)
            why = system.unavailable()
            if why:
                self.results["skipped"][name] = why
                console.print(f"[yellow]skipping {name}[/]: {why}")
            else:
                systems[name] = system
                self.results["systems"][name] = describe(system)

        console.print("measuring the emulated remote's own ceiling (zero latency) ...")
        ceiling = measure_ceiling(backing, self.workdir / "remote-ceiling", DATASET_DIR, dataset.files,
                                  self.registry, preset.remote_cache_timeout_s, preset.emulator)
        self.results["emulator"]["ceiling"] = ceiling
        # What actually ran: "python" if the C emulator was asked for but could not be built.
        self.results["emulator"]["implementation"] = emulator = ceiling["emulator"]
        console.print(f"  emulator ceiling ({EMULATOR_TITLES[emulator]}): [bold]{ceiling['files_per_s']:,.0f} files/s[/] "
                      f"({ceiling['mb_per_s']:,.0f} MB/s, {ceiling['readers']} readers, "
                      f"{ceiling['ops_per_file']:.1f} ops/file) with zero latency")

        if "daemon_cpu" in preset.workloads and {"cubefs", "cubefs+ct"} & set(systems):
            self._daemon_cpu(dataset)

        if "large_file" in preset.workloads and {"cubefs", "cubefs+ct"} & set(systems):
            self._large_file()

        if "samples" in preset.workloads:
            self._sample_cache()

        if "s3" in preset.workloads:
            self._s3(ctx)

        remotes: dict[int, Remote] = {}
        if any(s.uses_remote for s in systems.values()):
            for latency in preset.latencies():
                remotes[latency] = Remote(backing, self.workdir / f"remote-{latency}us", latency_us=latency,
                                          bandwidth_mb_s=preset.bandwidth_mb_s, registry=self.registry,
                                          cache_timeout_s=preset.remote_cache_timeout_s,
                                          emulator=preset.emulator).start()
                console.print(f"  remote preset {latency} µs: slowfs pid {remotes[latency].pid} on "
                              f"{remotes[latency].mount_point}")

        runs = [p for p in plan(preset, list(systems)) if p.system in systems]
        from benchmarks.suite.workloads import RunResult, run_epochs  # imports torch: after the quick checks

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task("epochs", total=len(runs) * preset.epochs)
            for number, p in enumerate(runs, 1):
                label = (f"[{number}/{len(runs)}] {p.workload} {p.system} "
                         + report.config_label({"latency_us": p.latency_us, "workers": p.workers,
                                                "workload": p.workload, "cache_fraction": p.cache_fraction,
                                                "ram_fraction": p.ram_fraction}))
                progress.update(task, description=label)
                result = RunResult(p.workload, p.system, p.latency_us, p.workers, p.cache_fraction, p.drop_each_epoch,
                                   p.ram_fraction)
                system = systems[p.system]
                remote = remotes.get(p.latency_us) if p.latency_us is not None else None
                run_dir = self.workdir / f"run-{number:03d}"
                run_dir.mkdir()

                def on_epoch(record: Any, label: str = label) -> None:
                    progress.advance(task)
                    extra = f", hit rate {record.hit_rate:.2f}" if record.hit_rate is not None else ""
                    progress.console.print(f"  {label} epoch {record.epoch + 1}: {record.samples_per_s:,.0f} "
                                           f"files/s, {record.mb_per_s:,.1f} MB/s{extra}")

                try:
                    root = system.start(RunSpec(remote, p.cache_fraction, run_dir, p.ram_fraction))
                    try:
                        run_epochs(result, system, root, remote, files=dataset.files,
                                   total_bytes=dataset.total_bytes, epochs=preset.epochs, seed=SEED,
                                   on_epoch=on_epoch)
                    finally:
                        result.stop_error = _stop(system)
                        if result.stop_error:
                            progress.console.print(f"[yellow]  {label}: stopping failed:[/] {result.stop_error}")
                except RUN_FAILURES as exc:
                    result.error = f"{type(exc).__name__}: {exc}"
                    progress.console.print(f"[red]  {label} failed:[/] {result.error}")
                    progress.advance(task, preset.epochs - len(result.epochs))
                finally:
                    self.results["runs"].append(result.to_json())
                    shutil.rmtree(run_dir, ignore_errors=True)  # caches: the disk is shared
                self._write(partial=True)

        for latency, remote in remotes.items():
            stats = remote.raw_stats()
            delay = stats.get("delay", {})
            self.results["emulator"]["presets"].append({
                "latency_us": latency, "bandwidth_mb_s": preset.bandwidth_mb_s,
                "cache_timeout_s": preset.remote_cache_timeout_s,
                "measured_delay_us": float(delay.get("mean_us", 0.0)) if delay.get("count") else None,
                "delays": int(delay.get("count", 0)), "max_concurrent": int(stats.get("max_concurrent", 0)),
                "pid": remote.pid, "emulator": remote.emulator,
            })
            remote.stop()

    def _daemon_cpu(self, dataset: Dataset) -> None:
        """Our daemon's CPU per file over the local source (benchmarks/suite/daemon_cpu.py)."""
        console.print(f"daemon CPU per file: one reader, {len(dataset.files):,} files read through our mount of "
                      "the local source (no emulator, no latency) ...")
        workdir = self._scratch("daemon-cpu")

        def on_pass(figure: dict[str, Any]) -> None:
            console.print(f"  {daemon_cpu.PASS_TITLES[figure['kind']]}: [bold]{figure['cpu_us_per_file']:,.0f} µs[/] "
                          f"of daemon CPU per file (± {figure['resolution_us_per_file']:,.0f}), "
                          f"{figure['files_per_s']:,.0f} files/s")

        try:
            figures = daemon_cpu.measure(dataset, workdir, self.registry, ram_fraction=self.preset.nvme_ram_fraction,
                                         seed=SEED, on_pass=on_pass)
        finally:
            remove_workdir(workdir, workdir / "mnt")  # never through a live mount
        self._record("daemon_cpu", "daemon CPU per file", figures)

    def _large_file(self) -> None:
        """One large file read whole through our mount, cold and from NVMe, against a direct
        read of it (benchmarks/large_file.py, over a local source)."""
        from benchmarks import large_file

        console.print(f"one large file: {large_file.DEFAULT_MIB} MiB read whole with 1 MiB reads, direct and "
                      "through our mount (cold, NVMe tier) ...")
        workdir = self._scratch("large-file")

        def on_round(r: dict[str, Any]) -> None:
            console.print(f"  round {r['round'] + 1}: direct {r['direct_mb_s'][0]:,.0f} / {r['direct_mb_s'][1]:,.0f} "
                          f"MB/s, cold [bold]{r['cold_ratio']:.2f} ×[/], NVMe tier [bold]{r['nvme_ratio']:.2f} ×[/]")

        try:
            figures = large_file.measure(workdir, on_round=on_round)
        finally:
            remove_workdir(workdir, *workdir.glob("round-*/mnt"))  # never through a live mount
        self._record("large_file", "large file", figures)

    def _sample_cache(self) -> None:
        """The training loader with and without CachedDataset, with each store: a local
        redis-server, then the default store, a cubefs-fuse daemon mounted over the photos
        (benchmarks/sample_cache.py, on its own photo-like JPEGs, local: decoding is what
        the cache saves, not I/O)."""
        from benchmarks import sample_cache  # imports torch: after the quick checks

        files = min(SAMPLE_CACHE_FILES, self.preset.files)
        for store, key, title in (("redis", "sample_cache", "local redis-server"),
                                  ("daemon", "sample_cache_daemon", "the daemon store")):
            console.print(f"processed-sample cache: a training loader with and without CachedDataset ({title}), "
                          f"{files} files ...")
            workdir = self._scratch(f"sample-cache-{store}")

            def on_epoch(r: Any) -> None:
                console.print(f"  epoch {r.epoch}: {r.baseline:,.0f} samples/s without, {r.cached:,.0f} with the "
                              f"cache: [bold]{r.ratio:.2f} ×[/]")

            try:
                figures = sample_cache.measure(workdir, files=files, epochs=self.preset.epochs,
                                               workers=self.preset.train_workers, seed=SEED, store=store,
                                               on_epoch=on_epoch)
            finally:
                remove_workdir(workdir, workdir / "daemon" / "mnt")  # never through a live mount
            self._record(key, f"processed-sample cache ({title})", figures)

    def _scratch(self, name: str) -> Path:
        """A workload's own directory in the run's scratch directory (new)."""
        workdir = self.workdir / name
        workdir.mkdir()
        return workdir

    def _record(self, key: str, title: str, figures: dict[str, Any]) -> None:
        """Keep a workload's figures as results.json's ``key``, written at once; a failure said."""
        if figures["error"]:
            console.print(f"[red]  {title} failed:[/] {figures['error']}")
        self.results[key] = figures
        self._write(partial=True)

    def _s3(self, ctx: Context) -> None:
        """The S3 workload (benchmarks/suite/s3.py): its own runs, bars and section."""
        from benchmarks.suite import s3  # imports torch: after the quick checks

        console.print(f"S3 source: the dataset in a SeaweedFS bucket behind a {s3.DELAY_MS:g} ms proxy ...")
        self.results["s3"] = s3.run(ctx, epochs=self.preset.epochs, train_workers=self.preset.train_workers,
                                    seed=SEED, log=console.print)
        if self.results["s3"]["error"]:
            console.print(f"[red]  S3 workload failed:[/] {self.results['s3']['error']}")
        self._write(partial=True)

    def _write(self, *, partial: bool = False) -> None:
        self.results["finished"] = _now()
        self.results["duration_s"] = time.time() - self.started
        self.results["load_average"]["end"] = list(os.getloadavg())
        report.fill_ratios(self.results["runs"])
        ceiling = self.results["emulator"].get("ceiling") or {}
        self.results["bars"] = report.evaluate_bars(self.results["runs"], ceiling.get("files_per_s"),
                                                    self.results["daemon_cpu"], self.results["sample_cache"],
                                                    self.results["sample_cache_daemon"], self.results["large_file"])
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, ensure_ascii=False) + "\n")
        tmp.replace(self.out / "results.json")
        if not partial:
            text = report.markdown(self.results)
            if self.results["s3"]:
                from benchmarks.suite import s3

                text += "\n" + s3.markdown(self.results["s3"])
            (self.out / "results.md").write_text(text)
            self.results["plots"] = report.plot(self.results, self.out)

    def finish(self, *, interrupted: bool) -> None:
        self.results["interrupted"] = interrupted
        self._write()
        console.print(f"\nwrote {self.out / 'results.json'}, {self.out / 'results.md'} and "
                      f"{', '.join(self.results.get('plots', [])) or 'no plots'}")
        print(report.markdown(self.results))


def _la() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args: argparse.Namespace = parser.parse_args(argv)
    try:
        preset = resolve(args)
    except ValueError as exc:
        parser.error(str(exc))
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        console.print("benchmark needs /dev/fuse (and root, to drop the page cache)")
        return 2
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="cubefs-bench-", dir=args.workdir)).resolve()
    registry = Registry(workdir)
    suite = Suite(preset, args.out.resolve(), workdir, registry)
    code = 0
    interrupted = False
    try:
        with signals_interrupt():
            suite.run()
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted: cleaning up[/]")
        interrupted, code = True, 130
    except (HarnessError, OSError) as exc:
        console.print(f"[red]benchmark failed:[/] {exc}")
        code = 1
    finally:
        with signals_ignored():
            registry.cleanup()
            if args.keep:
                console.print(f"kept {workdir}")
            else:
                remove_workdir(workdir, *[Path(m) for m in _mount_points(workdir)])
    try:
        with signals_ignored():
            suite.finish(interrupted=interrupted)
    except OSError as exc:
        console.print(f"[red]could not write the results:[/] {exc}")
        return code or 1
    return code


def _mount_points(workdir: Path) -> list[str]:
    from benchmarks.suite.cleanup import mounts_below

    return mounts_below(workdir) if workdir.exists() else []


if __name__ == "__main__":
    sys.exit(main())
