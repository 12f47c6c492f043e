"""The demo: a tiny CNN trains on a slow remote volume through cubefs-fuse with ai_prefetch.

A scratch directory of generated JPEGs (ImageNet-like sizes, class folders) is served by
tools/slowfs.py, which adds a fixed latency to every operation: the slow remote volume
(in production an NFS/CubeFS mount point).  cubefs-fuse mounts that remote with
``"profile": "ai_prefetch"`` (the real CLI, daemonized), and demo/train.py trains on the
mount with torchvision ``ImageFolder`` and a multi-worker DataLoader, with
``import cube_torch`` and ``VOL_NAME`` set: each epoch's file order goes to the daemon,
which fetches the files before the workers open them.  Printed: per-epoch samples/s and
loss, cube_torch's hit-rate lines, and what the daemon and the remote counted per epoch.
``--no-train`` instead reads the dataset twice with plain reader processes and checks
every byte.  Everything is unmounted and removed at the end, on errors and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from humanfriendly import format_size
from humanfriendly.tables import format_pretty_table

from tools.harness import (
    CacheDelta,
    DaemonMount,
    Dataset,
    HarnessError,
    PassResult,
    Readers,
    SlowRemote,
    cache_delta,
    make_class_images,
    remove_workdir,
    sigterm_as_interrupt,
)

# RAM and NVMe tier limits of the demo mount: both hold the whole ~40 MB dataset, so
# epochs after the first need nothing from the remote.
MEM_CACHE_SIZE = "256MiB"
DISK_CACHE_SIZE = "1GiB"
# Files read straight from the slow remote to show what one file costs there.
REMOTE_PROBE_FILES = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--files", type=int, default=400, help="JPEG files in the dataset (default: 400)")
    p.add_argument("--classes", type=int, default=10, help="class folders (default: 10)")
    p.add_argument("--file-kb", type=int, default=100, help="mean file size in KB (default: 100, as ImageNet's)")
    p.add_argument("--latency-ms", type=float, default=2.0,
                   help="delay the remote adds to every operation (default: 2 ms)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs (default: 3)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers; reader processes with --no-train (default: 2)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default: 32)")
    # 1 s: training takes only a few seconds on an idle machine, and the lines should show.
    p.add_argument("--metrics-interval", type=float, default=1.0,
                   help="CUBE_TORCH_METRICS_INTERVAL: seconds between hit-rate lines (default: 1)")
    p.add_argument("--no-cube-torch", action="store_true",
                   help="train without VOL_NAME (cube_torch imported but idle): the baseline without prefetch")
    p.add_argument("--no-train", action="store_true",
                   help="quick read-only mode: read every file twice with reader processes, check the bytes")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where to create the scratch directory (default: $TMPDIR); it is removed at the end")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (dataset, cache, logs)")
    args = p.parse_args(argv)
    if min(args.files, args.classes, args.file_kb, args.epochs, args.workers, args.batch_size) < 1:
        p.error("--files, --classes, --file-kb, --epochs, --workers and --batch-size must be at least 1")
    if args.latency_ms < 0 or args.metrics_interval <= 0:
        p.error("--latency-ms must be >= 0 and --metrics-interval > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr when piped
    workdir = Path(tempfile.mkdtemp(prefix="cubefs-demo-", dir=args.workdir))
    remote: SlowRemote | None = None
    mount: DaemonMount | None = None
    readers: Readers | None = None
    try:
        with sigterm_as_interrupt():
            started = time.perf_counter()
            dataset = make_class_images(workdir / "remote-disk", args.files, classes=args.classes,
                                        mean_bytes=args.file_kb * 1000)
            print(f"dataset: {len(dataset.files)} JPEG files, {format_size(dataset.total_bytes)} "
                  f"(mean {format_size(dataset.total_bytes // len(dataset.files))}) in {args.classes} class folders, "
                  f"made in {time.perf_counter() - started:.1f} s")
            remote = SlowRemote(dataset.root, workdir / "remote", latency_us=round(args.latency_ms * 1000),
                                log_file=workdir / "slowfs.log")
            print(f"$ python -m tools.slowfs {remote.data} {remote.mount_point} --latency-us={remote.latency_us}")
            remote.mount()
            per_file = _probe_remote(remote, dataset)
            print(f"  the remote volume: every operation takes {args.latency_ms:g} ms more; reading one file "
                  f"straight from it takes {per_file * 1000:.1f} ms (measured on {REMOTE_PROBE_FILES} files)")
            mount = DaemonMount(workdir, remote.mount_point, workdir / "nvme-cache", vol_name=f"demo-{os.getpid()}",
                                mem_cache_size=MEM_CACHE_SIZE, disk_cache_size=DISK_CACHE_SIZE,
                                profile="ai_prefetch", echo=True)
            print(f"  client config: {mount.config_path}: source {remote.mount_point}, "
                  f"\"profile\": \"ai_prefetch\", RAM {MEM_CACHE_SIZE}, NVMe {DISK_CACHE_SIZE} in {mount.cache_dir}")
            mount.mount()
            if args.no_train:
                readers = Readers(args.workers)
                _read_passes(dataset, mount, readers)
            else:
                _train(args, mount, remote)
            mount.umount()
            remote.cleanup()
            print("\ndemo finished")
            return 0
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        return 130
    except (HarnessError, OSError) as exc:  # OSError: e.g. the scratch disk is full
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C (or a SIGTERM) must not cut the clean-up short and leave mounts behind;
        # each step below is bounded by its own timeouts.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if readers is not None:
                readers.close()
            if mount is not None:
                mount.cleanup()  # first: cubefs-fuse reads from the slowfs mount below it
            if remote is not None:
                remote.cleanup()
            if args.keep:
                print(f"kept {workdir}", file=sys.stderr)
            else:
                remove_workdir(workdir, workdir / "mnt", workdir / "remote")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _probe_remote(remote: SlowRemote, dataset: Dataset) -> float:
    """Seconds to read one whole file straight from the remote (open, read, close)."""
    started = time.perf_counter()
    for name in dataset.files[:REMOTE_PROBE_FILES]:
        (remote.mount_point / name).read_bytes()
    return (time.perf_counter() - started) / min(REMOTE_PROBE_FILES, len(dataset.files))


# -- training ---------------------------------------------------------------------------


def _train(args: argparse.Namespace, mount: DaemonMount, remote: SlowRemote) -> None:
    # What a user adds to a training script: `import cube_torch` (in demo/train.py) and VOL_NAME.
    planned = not args.no_cube_torch
    if planned:
        os.environ["VOL_NAME"] = str(mount.config["volName"])
    else:
        os.environ.pop("VOL_NAME", None)  # cube_torch stays imported but plans nothing
    os.environ["CUBE_TORCH_METRICS_INTERVAL"] = f"{args.metrics_interval:g}"
    print(f"\n$ {'VOL_NAME=' + os.environ['VOL_NAME'] if planned else '(no VOL_NAME)'} "
          f"CUBE_TORCH_METRICS_INTERVAL={args.metrics_interval:g} python -m demo.train {mount.mount_point}"
          "   # run in this process", flush=True)
    started = time.perf_counter()
    import cube_torch
    from cube_torch import reporter
    from cube_torch.client import default_job
    from demo import train as training

    print(f"  torch, torchvision and cube_torch imported in {time.perf_counter() - started:.1f} s; a tiny CNN "
          f"trains on CPU: ImageFolder + RandomResizedCrop(64), {args.workers} DataLoader workers, "
          f"batch {args.batch_size}, {args.epochs} epochs", flush=True)
    job = default_job()  # the job name cube_torch registers (CUBE_TORCH_JOB, else host-pid)
    rows: list[tuple[Any, dict[str, float], dict[str, float]]] = []
    last = [mount.scrape()]
    unplanned: list[int] = []

    def on_epoch_end(result: Any) -> None:
        rows.append((result, last[0], mount.scrape()))
        last[0] = rows[-1][2]
        # The daemon's current plan for the job must be this epoch's: cube_torch sent it.
        if last[0].get(f'cubefs_fuse_plan_epoch{{rank="0",training_job="{job}"}}') != result.epoch:
            unplanned.append(result.epoch)

    try:
        training.train(mount.mount_point, epochs=args.epochs, workers=args.workers, batch_size=args.batch_size,
                       on_epoch_end=on_epoch_end)
    except HarnessError:
        raise
    except Exception as exc:  # a worker's OSError, a DataLoader timeout, ...: say what and where
        raise HarnessError(f"training failed: {type(exc).__name__}: {exc}{mount.log_tail()}") from None
    if planned:
        if unplanned:
            raise HarnessError(f"the daemon got no plan from cube_torch for epoch(s) {unplanned} "
                               "(see cube_torch's warning above)")
        reporter.stop()  # no more periodic lines: the last one follows
        print("cube_torch.report_once():", end=" ", flush=True)
        if cube_torch.report_once() is None:
            raise HarnessError("cube_torch.report_once(): the daemon has no counters for this job")
    _print_epochs(rows, job if planned else None)
    _print_cache(mount.scrape())
    _print_remote(remote.stats())


def _print_epochs(rows: list[tuple[Any, dict[str, float], dict[str, float]]], job: str | None) -> None:
    """Per epoch: the job's counters (``job``), else those of all processes."""
    print(f"\nper epoch, from the daemon's /metrics ({f'job {job!r}, rank 0' if job else 'all processes'}):")
    table = []
    for result, before, after in rows:
        def d(name: str, labels: str = "") -> float:
            key = f"{name}{{{labels}}}" if labels else name
            return after.get(key, 0.0) - before.get(key, 0.0)

        all_opens = int(d("cubefs_fuse_file_requests_total"))  # files read through the mount and the fast path
        if job is not None:
            labels = f'rank="0",training_job="{job}"'
            requests, hits = d("cubefs_fuse_job_requests_total", labels), d("cubefs_fuse_job_hits_total", labels)
            stall, opens = d("cubefs_fuse_job_stall_seconds_total", labels), f"{int(requests)} / {all_opens}"
        else:
            requests, hits = all_opens, d("cubefs_fuse_file_hits_total")
            stall, opens = d("cubefs_fuse_stall_seconds_total"), str(all_opens)
        table.append([
            result.epoch, f"{result.samples_per_s:,.0f}", f"{result.loss:.3f}", opens, int(hits),
            f"{100 * hits / requests:.1f} %" if requests else "-", f"{stall:.2f}",
            int(d("cubefs_fuse_prefetch_issued_total")),
            sum(int(v - before.get(k, 0.0)) for k, v in after.items()
                if k.startswith("cubefs_fuse_backend_operations_total{")),
            int(d("cubefs_fuse_backend_operations_total", 'op="read"')),
            format_size(int(d("cubefs_fuse_backend_read_bytes_total"))),
        ])
    print(format_pretty_table(table, ["epoch", "samples/s", "loss", "opens job/all" if job else "opens", "hits",
                                      "hit rate", "stall s", "prefetched", "remote ops", "remote reads",
                                      "from remote"]))
    print("(an open is a hit when none of its reads waited on the remote"
          + ("; 'all' also counts opens made before\n cube_torch had registered the job" if job else "")
          + "; stall s: time reads waited on the remote;\n prefetched: blocks fetched ahead of the readers; "
          "remote ops: everything the daemon asked the remote,\n stat and listings included; remote reads: "
          "block reads)")


# -- --no-train: two read passes ----------------------------------------------------------


def _read_passes(dataset: Dataset, mount: DaemonMount, readers: Readers) -> None:
    rows: list[tuple[str, PassResult, CacheDelta]] = []
    for number, label in ((1, "1 (cold)"), (2, "2 (warm)")):
        before = mount.scrape()
        result = readers.read(mount.mount_point, dataset.files, seed=number, digests=dataset.digests)
        if result.mismatched:
            raise HarnessError(f"pass {number}: {len(result.mismatched)} files differ from the source, "
                               f"e.g. {result.mismatched[0]}")
        if result.files != len(dataset.files) or result.bytes != dataset.total_bytes:
            raise HarnessError(f"pass {number}: read {result.files} files / {result.bytes} bytes, "
                               f"expected {len(dataset.files)} / {dataset.total_bytes}")
        if number == 1:
            # Blocks go to NVMe behind the reads; wait so the statistics below are settled.
            mount.wait_for_disk_blocks(dataset.blocks)
        rows.append((label, result, cache_delta(before, mount.scrape())))
        print(f"pass {label}: {result.files} files in {result.seconds:.2f} s with {readers.workers} readers: "
              f"{result.files_per_s:,.0f} files/s, {result.mb_per_s:,.1f} MB/s, content verified", flush=True)
    print("\nwhat the daemon counted per pass (from its Prometheus /metrics):")
    table = [[label, f"{r.files_per_s:,.0f}", f"{r.mb_per_s:,.1f}", d.lookups, d.reads, d.ram_hits, d.disk_hits,
              d.misses, format_size(d.served_ram), format_size(d.served_disk), format_size(d.backend_bytes)]
             for label, r, d in rows]
    print(format_pretty_table(table, ["pass", "files/s", "MB/s", "lookups", "reads", "RAM hits", "NVMe hits",
                                      "misses", "from RAM", "from NVMe", "from remote"]))
    warm = rows[-1][2]
    if warm.reads == 0:
        print(f"pass 2: {warm.lookups} lookups reached the daemon and no reads: the kernel page cache served "
              "the data\n(the kernel keeps it across opens while a file's version is unchanged).")
    elif warm.misses == 0:
        print("pass 2: every read that reached the daemon was a cache hit; nothing came from the remote.")
    _print_cache(mount.scrape())


# -- shared ---------------------------------------------------------------------------------


def _print_cache(metrics: dict[str, float]) -> None:
    def value(name: str, label: str = "") -> int:
        return int(metrics.get(f"{name}{{{label}}}" if label else name, 0))

    print("\ncache now:")
    for tier, title in (("ram", "RAM "), ("disk", "NVMe")):
        label = f'tier="{tier}"'
        print(f"  {title}: {format_size(value('cubefs_fuse_cache_used_bytes', label), binary=True)} used of "
              f"{format_size(value('cubefs_fuse_cache_limit_bytes', label), binary=True)} limit, "
              f"{value('cubefs_fuse_cache_blocks', label)} blocks, "
              f"{value('cubefs_fuse_cache_evictions_total', label)} evictions")
    print(f"  prefetched blocks: {value('cubefs_fuse_prefetch_issued_total')} issued, "
          f"{value('cubefs_fuse_prefetch_used_total')} then read, "
          f"{value('cubefs_fuse_prefetch_wasted_total')} wasted; "
          f"checksum failures: {value('cubefs_fuse_checksum_failures_total')}, backend errors: "
          f"{int(sum(v for k, v in metrics.items() if k.startswith('cubefs_fuse_backend_errors_total')))}")


def _print_remote(stats: dict[str, Any]) -> None:
    ops: dict[str, int] = stats.get("ops", {})
    delay: dict[str, Any] = stats.get("delay", {})
    print(f"  the remote (slowfs, its own counters) served {sum(ops.values())} operations in all "
          f"({', '.join(f'{k} {v}' for k, v in sorted(ops.items()))}), {format_size(int(stats.get('bytes_read', 0)))} "
          f"read, each delayed {float(delay.get('mean_us', 0)) / 1000:.2f} ms on average")

