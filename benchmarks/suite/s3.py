"""The S3 workload (``--workloads s3``, not in the default set: ~5 minutes on 2 cores):
the suite's dataset in a bucket of a local SeaweedFS (tests/s3_servers.py), read through
the delaying proxy (tools/s3_proxy_c, built here, its own process) at :data:`DELAY_MS` per
request, a remote object store's order of latency at ~0.1 ms of CPU per request.

* **training** (ImageFolder, ``train_workers`` workers, the suite's loop): the local copy;
  our mount of ``s3://`` with and without cube_torch; ``rclone mount --vfs-cache-mode
  full`` over the same bucket (an S3 remote), with the same cache budget and metadata
  timeout as the directory rows.
* **raw I/O** (8 workers, files read whole): our mount with cube_torch against the raw
  bucket, each DataLoader worker GETting the objects itself with obstore (the client
  library our backend uses), and rclone.
* **daemon CPU per cold object**: one reader reads every file once through a fresh
  daemon, page cache dropped, over the bucket (direct, no proxy: no latency to wait out)
  and over the local copy (the directory backend); the daemon's utime + stime per file.

SeaweedFS and the proxy run on the same cores as everything else: each epoch records
their CPU seconds (``server_cpu_s``, ``proxy_cpu_s``) beside the daemon's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.suite.cleanup import Registry, stop_process
from benchmarks.suite.systems import (METADATA_TIMEOUT_S, Context, Local, Ours, OursCubeTorch, Rclone, RunSpec,
                                      System, cache_budget, cpu_seconds, process_tree)
from tools.harness import DaemonMount, HarnessError, build_tool, free_port

DELAY_MS = 10  # per request, whole ms (the proxy's unit): a small GET from a cloud object store (10-50 ms)
BUCKET = "bench"
PREFIX = "dataset"  # the dataset's keys: PREFIX/class/file.jpg, as under the local copy
UPLOAD_THREADS = 8  # PUTs in flight while filling the bucket (SeaweedFS takes ~200/s on 2 cores)
RAW_WORKERS = 8  # the raw I/O bar's worker count
PROXY_BUILD = Path(__file__).resolve().parents[2] / "tools" / "s3_proxy_c" / "build.sh"
# The S3 bars (docs/benchmarks.md) and what they compare.
BARS = (
    ("training, epoch 1: cubefs+ct / local", "training", "cubefs+ct", "local", "first", 0.9),
    ("training, later epochs: cubefs+ct / local", "training", "cubefs+ct", "local", "later", 0.97),
    ("raw I/O 8 workers, epoch 1: cubefs+ct / raw bucket (obstore)", "raw_io", "cubefs+ct", "bucket", "first", 4.0),
    ("training, epoch 1: cubefs+ct / rclone", "training", "cubefs+ct", "rclone", "first", 1.0),
    ("training, later epochs: cubefs+ct / rclone", "training", "cubefs+ct", "rclone", "later", 1.0),
    ("raw I/O 8 workers, epoch 1: cubefs+ct / rclone", "raw_io", "cubefs+ct", "rclone", "first", 1.0),
)
CPU_BAR = 2.0  # daemon CPU per cold S3 object under twice the directory backend's


@dataclass
class Bucket:
    """The running SeaweedFS, the proxy process in front of it, and the dataset in a bucket."""

    server: Any  # tests.s3_servers.SeaweedS3
    proxy: subprocess.Popen[bytes]
    proxy_port: int

    @property
    def endpoint(self) -> str:
        """The delayed endpoint (through the proxy)."""
        return f"http://127.0.0.1:{self.proxy_port}"

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the server and of the proxy."""
        server = self.server.process
        return (cpu_seconds(process_tree(server.pid)) if server is not None else 0.0,
                cpu_seconds([self.proxy.pid]))


def start_bucket(ctx: Context, registry: Registry, log: Callable[[str], None]) -> Bucket:
    from tests.s3_servers import SeaweedS3

    try:
        proxy_path = build_tool(PROXY_BUILD)  # before the server: a missing compiler fails at once
    except HarnessError as exc:
        raise HarnessError(f"cannot build tools/s3_proxy_c: {exc}") from None

    server = SeaweedS3(ctx.workdir / "seaweedfs")
    release = registry.push("seaweedfs", server.stop)
    server.start()
    os.environ.update(server.environment())  # the daemons' credentials (the standard chain)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    started = time.perf_counter()

    def put(name: str) -> None:
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}", Body=(ctx.local_root / name).read_bytes())

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(put, ctx.dataset.files))
    log(f"  bucket filled: {len(ctx.dataset.files):,} objects in {time.perf_counter() - started:.1f} s")
    proxy = subprocess.Popen([str(proxy_path), "--target-port", str(server.s3_port), "--delay-ms", str(DELAY_MS)],
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    registry.push("s3 proxy", lambda: stop_process(proxy))
    assert proxy.stdout is not None
    line = proxy.stdout.readline().strip()  # the port, once it listens
    if not line.isdigit():
        release()
        raise HarnessError(f"the S3 proxy did not start (it printed {line!r})")
    return Bucket(server, proxy, int(line))


# -- the systems over the bucket --------------------------------------------------------------


def _s3_config(mount: DaemonMount, endpoint: str) -> None:
    mount.config["source"] = f"s3://{BUCKET}/{PREFIX}"
    mount.config["s3Endpoint"] = endpoint


class OnBucket:
    """A system that reads the bucket: through the proxy's endpoint, set by :func:`run`."""

    endpoint = ""


class OursS3(OnBucket, Ours):
    name, title = "cubefs", "cubefs-fuse over s3://"

    def start(self, spec: RunSpec) -> Path:
        memory, disk = cache_budget(self.ctx.dataset, spec.cache_fraction)
        self._runs += 1
        mount = DaemonMount(spec.run_dir, spec.run_dir / "unused", spec.run_dir / "cache",
                            vol_name=f"bench{os.getpid()}-s3-{self._runs}", mem_cache_size=memory,
                            disk_cache_size=disk, profile="ai_prefetch")
        _s3_config(mount, self.endpoint)
        self.mount = mount
        self._release = self.ctx.registry.push(f"cubefs-fuse {mount.mount_point}", mount.cleanup)
        mount.mount()
        return mount.mount_point


class OursS3CubeTorch(OursS3, OursCubeTorch):
    name, title, cube_torch = "cubefs+ct", "cubefs-fuse over s3:// + cube_torch", True


class RcloneS3(OnBucket, Rclone):
    title = "rclone VFS cache (full) over the bucket"

    def start(self, spec: RunSpec) -> Path:
        from tests.s3_servers import ACCESS_KEY, REGION, SECRET_KEY

        _, disk = cache_budget(self.ctx.dataset, spec.cache_fraction)
        config = spec.run_dir / "rclone.conf"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(f"[bucket]\ntype = s3\nprovider = Other\nendpoint = {self.endpoint}\n"
                          f"access_key_id = {ACCESS_KEY}\nsecret_access_key = {SECRET_KEY}\nregion = {REGION}\n"
                          "force_path_style = true\n")
        mount_point = spec.run_dir / "mnt"
        self._spawn(["rclone", "mount", f"bucket:{BUCKET}/{PREFIX}", str(mount_point), "--config", str(config),
                     "--read-only", "--vfs-cache-mode", "full", "--cache-dir", str(spec.run_dir / "rclone-cache"),
                     "--vfs-cache-max-size", str(disk), "--vfs-cache-poll-interval", "1s",  # as Rclone.start
                     "--attr-timeout", f"{METADATA_TIMEOUT_S}s", "--dir-cache-time", f"{METADATA_TIMEOUT_S}s",
                     "--log-level", "NOTICE"],
                    mount_point, spec.run_dir / "rclone.log",
                    # rclone 1.60 refuses to start with AWS_CA_BUNDLE set (LoadCustomCABundleError,
                    # whatever the endpoint's scheme); the endpoint is plain http: no CA needed.
                    env={k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"})
        return mount_point


class ObjectBytes:
    """A map-style dataset: sample i is object i's size, GET whole from the bucket by the
    worker itself with obstore: the raw bucket, no cache.  Each process makes its own
    store after the fork (obstore's runtime is not fork-safe)."""

    def __init__(self, endpoint: str, files: list[str]) -> None:
        self.endpoint, self.keys = endpoint, [f"{PREFIX}/{name}" for name in files]
        self._store: Any = None
        self._pid = 0

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> int:
        from benchmarks.suite.workloads import WARMUP

        if index == WARMUP:
            return 0
        import obstore
        from obstore.store import S3Store

        if self._pid != os.getpid():
            from tests.s3_servers import ACCESS_KEY, REGION, SECRET_KEY

            self._store = S3Store(BUCKET, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                                  secret_access_key=SECRET_KEY, region=REGION,
                                  client_options={"allow_http": True}, virtual_hosted_style_request=False)
            self._pid = os.getpid()
        return len(obstore.get(self._store, self.keys[index]).bytes())

    def train_data_list(self) -> np.ndarray:
        return np.asarray(self.keys)


class RawBucket(OnBucket, System):
    name, title = "bucket", "raw bucket (obstore in each worker, no cache)"

    def start(self, spec: RunSpec) -> Path:
        return self.ctx.local_root  # unused: :meth:`raw_dataset` reads the bucket

    def raw_dataset(self, files: list[str]) -> Any:
        return ObjectBytes(self.endpoint, files)


# -- the runs ---------------------------------------------------------------------------------


def _runs(train_workers: int) -> list[tuple[str, str, int]]:
    return ([("training", s, train_workers) for s in ("local", "cubefs", "cubefs+ct", "rclone")]
            + [("raw_io", s, RAW_WORKERS) for s in ("local", "cubefs+ct", "bucket", "rclone")])


def run(ctx: Context, *, epochs: int, train_workers: int, seed: int,
        log: Callable[[str], None]) -> dict[str, Any]:
    """Every run of the workload; results.json's ``s3`` object.  A run that fails is
    recorded with its error and the others go on."""
    from benchmarks.suite.workloads import RunResult, run_epochs  # imports torch

    out: dict[str, Any] = {"delay_ms": DELAY_MS, "bucket_objects": len(ctx.dataset.files), "runs": [],
                           "cpu": None, "bars": [], "error": None}
    bucket = start_bucket(ctx, ctx.registry, log)
    try:
        systems: dict[str, System] = {"local": Local(ctx), "cubefs": OursS3(ctx), "cubefs+ct": OursS3CubeTorch(ctx),
                                      "rclone": RcloneS3(ctx), "bucket": RawBucket(ctx)}
        for system in systems.values():
            if isinstance(system, OnBucket):
                system.endpoint = bucket.endpoint
        for number, (workload, name, workers) in enumerate(_runs(train_workers), 1):
            system = systems[name]
            why = system.unavailable()
            if why:
                out["runs"].append({"workload": workload, "system": name, "workers": workers, "error": why,
                                    "epochs": []})
                continue
            result = RunResult(workload, name, None if name == "local" else DELAY_MS * 1000, workers, None, False)
            run_dir = ctx.workdir / f"s3-run-{number:02d}"
            run_dir.mkdir()
            cpu = [bucket.cpu()]
            split: list[dict[str, float]] = []

            def on_epoch(record: Any, name: str = name, workload: str = workload) -> None:
                cpu.append(bucket.cpu())
                split.append({"server_cpu_s": cpu[-1][0] - cpu[-2][0], "proxy_cpu_s": cpu[-1][1] - cpu[-2][1]})
                log(f"  s3 {workload} {name} epoch {record.epoch + 1}: {record.samples_per_s:,.0f} files/s"
                    + (f", hit rate {record.hit_rate:.2f}" if record.hit_rate is not None else ""))

            try:
                root = system.start(RunSpec(None, None, run_dir))
                try:
                    run_epochs(result, system, root, None, files=ctx.dataset.files,
                               total_bytes=ctx.dataset.total_bytes, epochs=epochs, seed=seed, on_epoch=on_epoch)
                finally:
                    system.stop()
            except (HarnessError, OSError, RuntimeError, ValueError, AssertionError) as exc:
                result.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                log(f"  s3 {workload} {name} failed: {result.error}")
            finally:
                row = result.to_json()
                for record, extra in zip(row["epochs"], split):
                    record.update(extra)
                out["runs"].append(row)
                shutil.rmtree(run_dir, ignore_errors=True)
        out["cpu"] = cold_cpu(ctx, bucket, seed, log)
        out["bars"] = bars(out)
    except (HarnessError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        stop_process(bucket.proxy)
        bucket.server.stop()
    return out


def cold_cpu(ctx: Context, bucket: Bucket, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The daemon's CPU per file of one cold pass (one reader, page cache dropped, a fresh
    daemon) over the bucket without the proxy and over the local copy."""
    from benchmarks.read_throughput import mount_pass
    from tools.harness import Readers

    figures: dict[str, Any] = {}
    readers = Readers(1)
    try:
        for source in ("directory", "s3"):
            workdir = ctx.workdir / f"s3-cpu-{source}"
            memory, disk = cache_budget(ctx.dataset, None)
            mount = DaemonMount(workdir, ctx.local_root, workdir / "cache", vol_name=f"bench{os.getpid()}-cpu-{source}",
                                mem_cache_size=memory, disk_cache_size=disk, profile="ai_prefetch")
            if source == "s3":
                _s3_config(mount, bucket.server.endpoint)
            release = ctx.registry.push(f"cubefs-fuse {mount.mount_point}", mount.cleanup)
            try:
                mount.mount()
                row = mount_pass(readers, mount, ctx.dataset, f"cold {source}", seed=seed, drop=True, cold=True)
                mount.umount()
            finally:
                release()
            figures[source] = {"files": row.result.files, "daemon_cpu_s": row.cpu_s,
                               "cpu_us_per_file": (row.cpu_s or 0.0) / row.result.files * 1e6,
                               "files_per_s": row.result.files_per_s}
            log(f"  daemon CPU per cold file, {source} source: {figures[source]['cpu_us_per_file']:,.0f} µs")
    finally:
        readers.close()
    figures["ratio"] = figures["s3"]["cpu_us_per_file"] / figures["directory"]["cpu_us_per_file"]
    return figures


def _rate(out: dict[str, Any], workload: str, system: str, which: str) -> float | None:
    for run_ in out["runs"]:
        if (run_["workload"], run_["system"]) == (workload, system) and run_["epochs"] and not run_.get("error"):
            rates = [e["samples_per_s"] for e in run_["epochs"]]
            return rates[0] if which == "first" else (sum(rates[1:]) / len(rates[1:]) if rates[1:] else None)
    return None


def bars(out: dict[str, Any]) -> list[dict[str, Any]]:
    result = []
    for title, workload, ours, other, which, bar in BARS:
        a, b = _rate(out, workload, ours, which), _rate(out, workload, other, which)
        ratio = a / b if a is not None and b else None
        result.append({"title": title, "ratio": ratio, "bar": bar, "met": ratio is not None and ratio >= bar})
    cpu = out.get("cpu")
    if cpu:
        result.append({"title": "daemon CPU per cold object: s3 / directory backend", "ratio": cpu["ratio"],
                       "bar": CPU_BAR, "met": cpu["ratio"] < CPU_BAR, "lower_is_better": True})
    return result


def markdown(out: dict[str, Any]) -> str:
    """The workload's section of results.md."""
    lines = [f"## S3 source at {out['delay_ms']:g} ms per request", ""]
    if out.get("error"):
        lines += [f"failed: {out['error']}", ""]
    lines += ["| workload | system | workers | epoch 1 files/s | later epochs files/s | hit rate epoch 1 | "
              "daemon CPU s (epoch 1) | SeaweedFS CPU s (epoch 1) | proxy CPU s (epoch 1) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        if r.get("error") or not r["epochs"]:
            lines.append(f"| {r['workload']} | {r['system']} | {r['workers']} | failed: {r.get('error')} | | | | | |")
            continue
        e = r["epochs"]
        later = [x["samples_per_s"] for x in e[1:]]

        def f(v: Any, spec: str = ",.0f") -> str:
            return format(v, spec) if isinstance(v, (int, float)) else "–"

        lines.append(f"| {r['workload']} | {r['system']} | {r['workers']} | {f(e[0]['samples_per_s'])} | "
                     f"{' / '.join(f(v) for v in later) or '–'} | {f(e[0].get('hit_rate'), '.2f')} | "
                     f"{f(e[0].get('daemon_cpu_s'), '.1f')} | {f(e[0].get('server_cpu_s'), '.1f')} | "
                     f"{f(e[0].get('proxy_cpu_s'), '.1f')} |")
    cpu = out.get("cpu")
    if cpu:
        lines += ["", f"Daemon CPU per cold file: {cpu['s3']['cpu_us_per_file']:,.0f} µs over the bucket, "
                      f"{cpu['directory']['cpu_us_per_file']:,.0f} µs over the local copy "
                      f"({cpu['ratio']:.2f} ×)."]
    lines += ["", "| bar | ratio | needed | met |", "|---|---|---|---|"]
    for b in out["bars"]:
        ratio = f"{b['ratio']:.2f} ×" if b["ratio"] is not None else "–"
        need = f"< {b['bar']:g} ×" if b.get("lower_is_better") else f"≥ {b['bar']:g} ×"
        lines.append(f"| {b['title']} | {ratio} | {need} | {'yes' if b['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"
