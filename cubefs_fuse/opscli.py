"""Operator commands: status, warmup, drop-cache, stats.  All of them talk to the
control API of a running daemon (every mount has one; jobs and plans need
``"profile": "ai_prefetch"``), found through the runtime registry that every daemon
writes (``mounts.register``); ``status`` also lists mounts whose daemon is gone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from cubefs_fuse import mounts
from cubefs_fuse.control.protocol import ControlClient, ProtocolError, sample_cache_reference
from cubefs_fuse.limits import MAX_WARMUP_PATHS

# Seconds between progress polls of a warmup: smooth enough for a bar, cheap for the daemon.
POLL_SECONDS = 0.25


class OpsError(Exception):
    """A problem the operator can act on; one line (printed by cli.main), exit code 1."""


class UsageError(OpsError):
    """A mistake in the command line (a path outside the mount, a missing argument, a
    MOUNTPOINT that is no cubefs-fuse mount); one line, exit code 2 as for every command."""


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                run: Callable[[argparse.Namespace], int], **kwargs: Any) -> argparse.ArgumentParser:
    """Add the command ``name`` (``kwargs`` as for ``add_parser``): cli.main runs it as
    ``run(args)``."""
    parser = sub.add_parser(name, **kwargs)
    parser.set_defaults(run=run)
    return parser


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = add_command(sub, "status", cmd_status, help="show mounts, cache use, hit rates and jobs",
                         description="Show every cubefs-fuse mount (or one): volume, source, cache use per "
                         "tier, hit rate, active jobs with their hit rate and prefetch progress (per DataLoader "
                         "when a job's rank has several), uptime.")
    status.add_argument("mount_point", nargs="?", metavar="MOUNTPOINT")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    warmup = add_command(sub, "warmup", cmd_warmup, help="fetch files or subtrees into the cache (with progress)",
                         description="Bring files or whole subtrees of a mount into the cache, or with --check "
                         "report how much of them is cached without fetching anything.")
    warmup.add_argument("mount_point", metavar="MOUNTPOINT")
    warmup.add_argument("paths", nargs="*", metavar="PATH", help="files or directories (absolute under "
                        "MOUNTPOINT, or relative to it)")
    warmup.add_argument("-f", "--file", metavar="LIST", help="read paths from LIST, one per line ('-': stdin)")
    warmup.add_argument("--check", action="store_true", help="only report the cached percentage")
    warmup.add_argument("--json", action="store_true", help="print the final report as JSON, no progress bar")

    drop = add_command(sub, "drop-cache", cmd_drop, help="empty the RAM and NVMe cache of a mount, or one sample cache",
                       description="Drop every cached block (RAM and NVMe) and cached metadata of a mount; with "
                       "--samples NAME, destroy one processed-sample cache instead (its owner or root only).")
    drop.add_argument("mount_point", nargs="?", metavar="MOUNTPOINT",
                      help="the mount (with --samples: default the mount of $VOL_NAME, or the only live mount)")
    drop.add_argument("--samples", metavar="NAME", help="destroy the sample cache NAME (yours), or ~UID/NAME "
                      "(another user's: root only)")

    stats = add_command(sub, "stats", cmd_stats, help="a live view of a mount's activity (like 'juicefs stats')",
                        description="Print per-interval rates: what applications read by every path (mount, "
                        "fast path, sample cache) with its hit rate and MiB/s, the mount's lookups and reads, bytes "
                        "by source, backend operations, prefetch; Ctrl-C to stop.")
    stats.add_argument("mount_point", metavar="MOUNTPOINT")
    stats.add_argument("-i", "--interval", type=float, default=1.0, metavar="SECONDS", help="refresh (default 1)")
    stats.add_argument("-n", "--count", type=int, default=0, metavar="N", help="stop after N intervals (0: never)")


def _client(mount_point: str) -> tuple[dict[str, Any], ControlClient]:
    path = os.path.abspath(mount_point)
    info = mounts.registered(path)
    if info is None or not mounts.pid_alive(int(info.get("pid", 0))):
        entry = mounts.find_mount(path)
        if entry is not None and entry.fstype == f"fuse.{mounts.FUSE_SUBTYPE}":
            raise OpsError(f"{path} is a cubefs-fuse mount but its daemon is not running "
                           "(stale mount: 'cubefs-fuse umount --lazy' it, or mount again)")
        raise UsageError(f"{path} is not a cubefs-fuse mount (see 'cubefs-fuse status')")
    socket_path = info.get("controlSocket") or ""
    if not socket_path:
        raise OpsError(f"{path}: the daemon (pid {info['pid']}) runs without \"profile\": \"ai_prefetch\", "
                       "which opens the control API this command needs")
    return info, ControlClient(socket_path, timeout=10.0)


def _call(client: ControlClient, method: str, path: str, **kwargs: Any) -> Any:
    try:
        return client.request(method, path, **kwargs)
    except ProtocolError as exc:
        if exc.status == 403 and "allowed to use the control socket" in exc.message:
            raise OpsError(f"permission denied on the control socket {client.socket_path}: run as root or the "
                           "daemon's user, or list your uid in 'controlAllowUids'") from None
        raise OpsError(f"control API: {exc}") from None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    return (f"{days}d " if days else "") + time.strftime("%H:%M:%S", time.gmtime(rest))


# -- status ---------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    if args.mount_point:
        states = [mounts.MountState(os.path.abspath(args.mount_point), _client(args.mount_point)[0], "live")]
    else:
        states = mounts.survey()
    reports = [_report(state) for state in states]
    # A named mount whose control API does not answer fails (the Kubernetes liveness probe).
    code = 1 if args.mount_point and "error" in reports[0] else 0
    if args.json:
        print(json.dumps(reports, indent=2))
        return code
    # Piped output (grep, logs) has no terminal to fit: rich would cut it at 80 columns and
    # truncate job names; 256 columns hold a row with a MAX_NAME (128) job name whole.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 256)
    if not reports:
        console.print("no cubefs-fuse mounts on this node")
        return 0
    for report in reports:
        _print_status(console, report)
    return code


# What to do about a mount whose daemon is gone, by state (see mounts.survey).
HINTS = {
    "stale": "daemon is gone, the mount is dead (ENOTCONN): run 'cubefs-fuse umount --lazy {path}', or mount again",
    "leftover": "daemon is gone and not mounted; its files are left: run 'cubefs-fuse umount {path}' to remove them",
}


def _report(state: mounts.MountState) -> dict[str, Any]:
    info = state.info or {}
    report: dict[str, Any] = {"mount_point": state.mount_point, "state": state.state, "volume": info.get("volName"),
                              "source": info.get("source"), "pid": info.get("pid"), "keeper": info.get("keeper"),
                              "control_api": False}
    if state.state != "live":
        report["hint"] = HINTS[state.state].format(path=state.mount_point)
        return report
    if info.get("controlSocket"):
        try:
            report.update(ControlClient(info["controlSocket"], timeout=10.0).status())
            report["control_api"] = True
        except ProtocolError as exc:
            report["error"] = (f"permission denied on the control socket {info['controlSocket']}"
                               if exc.status == 403 else str(exc))
    return report


def _print_status(console: Console, r: dict[str, Any]) -> None:
    if r.get("state", "live") != "live":
        console.print(f"[bold]{r['mount_point']}[/bold]  [red]{r['state']}[/red]  volume {r['volume'] or '?'}  "
                      f"pid {r['pid'] or '?'}")
        console.print(f"  {r['hint']}")
        return
    keeper = f" (keeper {r['keeper']})" if r.get("keeper") else ""
    console.print(f"[bold]{r['mount_point']}[/bold]  volume {r['volume']}  source {r['source']}  pid {r['pid']}{keeper}")
    if not r["control_api"]:
        console.print("  " + (r.get("error") or 'control API off (set "profile": "ai_prefetch" for cache and job details)'))
        return
    console.print(f"  uptime {_duration(r['uptime'])}   version {r['version']}")
    tiers = Table(box=box.SIMPLE, show_header=True)
    for column in ("tier", "used", "limit", "use", "blocks"):
        tiers.add_column(column, justify="right" if column != "tier" else "left")
    for tier, t in r["cache"].items():
        use = 100.0 * t["used_bytes"] / t["limit_bytes"] if t["limit_bytes"] else 0.0
        tiers.add_row(tier, _size(t["used_bytes"]), _size(t["limit_bytes"]), f"{use:.1f}%", str(t["blocks"]))
    console.print(tiers)
    reads = _reads(r)
    paths = reads["by_path"]
    console.print(f"  requests {reads['requests']} (mount {paths['mount']['requests']}, fast path "
                  f"{paths['fastpath']['requests']}, sample cache {paths['sample_cache']['requests']})  "
                  f"hits {reads['hits']}  misses {reads['misses']}  hit rate {100 * reads['hit_rate']:.2f}%  "
                  f"stall {reads['stall_seconds']:.1f} s")
    if r.get("profile", "ai_prefetch") != "ai_prefetch":
        console.print('  jobs and plans: this mount runs without "profile": "ai_prefetch"')
        return
    plans: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in r.get("plans", []):
        plans.setdefault((p["job"], p["rank"]), []).append(p)
    if r.get("jobs"):
        jobs = Table(box=box.SIMPLE, show_header=True)
        # "loader" last: the columns before it read as they did before loaders had plans.
        for column in ("job", "rank", "pid", "requests", "hit rate", "epoch", "progress", "lookahead", "loader"):
            jobs.add_column(column)
        ordered = sorted(r["jobs"], key=lambda j: (j["job"], j["rank"]))  # a job's ranks together
        for j in ordered:
            mine = plans.get((j["job"], j["rank"]), [])
            # The (job, rank)'s row, with its plan when it has one loader; then one row per
            # loader when it has several (each DataLoader keeps its own plan).
            p = mine[0] if len(mine) == 1 else None
            loader = p.get("loader", "0") if p else (f"{len(mine)} loaders" if mine else "-")
            jobs.add_row(j["job"], str(j["rank"]), str(j["pid"]), str(j["requests"]),
                         f"{100 * j['hit_rate']:.2f}%", *_plan_cells(p), loader)
            if len(mine) > 1:
                for p in sorted(mine, key=lambda p: str(p.get("loader", ""))):
                    jobs.add_row("", "", "", str(p.get("requests", "-")),
                                 f"{100 * p['hit_rate']:.2f}%" if "hit_rate" in p else "-", *_plan_cells(p),
                                 str(p.get("loader", "0")))
        console.print(jobs)
        _print_distributed_jobs(console, ordered, plans)
    else:
        console.print("  no jobs registered")
    _print_samples(console, r.get("samples"))


def _print_samples(console: Console, samples: dict[str, Any] | None) -> None:
    """The processed-sample caches: one row each (name, owner, entries, bytes, hits, misses)."""
    if not samples:
        console.print("  sample caches: off (sampleCacheMemSize and sampleCacheDiskSize are 0)")
        return
    ram, disk = samples["ram"], samples["disk"]
    loading = "" if samples["loaded"] else ", loading its NVMe entries"
    console.print(f"  sample store: RAM {_size(ram['used_bytes'])} of {_size(ram['limit_bytes'])}, "
                  f"NVMe {_size(disk['used_bytes'])} of {_size(disk['limit_bytes'])}, "
                  f"{samples['corrupt']} damaged entries{loading}")
    hidden = samples.get("hidden", 0)
    others = f" ({hidden} other users' sample caches not shown)" if hidden else ""
    if not samples["caches"]:
        console.print(f"  no sample caches{others}")
        return
    table = Table(box=box.SIMPLE, show_header=True)
    for column in ("sample cache", "owner", "entries", "bytes", "hits", "misses", "hit rate"):
        table.add_column(column, justify="left" if column == "sample cache" else "right")
    for c in samples["caches"]:
        asked = c["hits"] + c["misses"]
        rate = f"{100 * c['hits'] / asked:.2f}%" if asked else "-"
        table.add_row(c["name"] + (" (shared)" if c["shared"] else ""), str(c["owner"]), str(c["entries"]),
                      _size(c["bytes"]), str(c["hits"]), str(c["misses"]), rate)
    console.print(table)
    if others:
        console.print(" " + others)


def _reads(status: dict[str, Any]) -> dict[str, Any]:
    """What applications read, by path (a status's ``reads``; docs/metrics.md, "What a job
    reads").  A daemon of an older version reports its file requests only (``hits``): they
    stand for the mount, the other paths at zero."""
    if "reads" in status:
        reads: dict[str, Any] = status["reads"]
        return reads
    hits = status["hits"]
    zero = {"requests": 0, "hits": 0, "misses": 0, "bytes": 0, "stall_seconds": 0.0}
    mount = {**zero, **{k: hits[k] for k in ("requests", "hits", "misses", "stall_seconds")},
             "bytes": status["counters"]["read_bytes"]}
    return {**mount, "hit_rate": hits["hit_rate"], "by_path": {"mount": mount, "fastpath": zero, "sample_cache": zero}}


def _plan_cells(p: dict[str, Any] | None) -> tuple[str, str, str]:
    """A plan's epoch, progress and lookahead columns ("-" without one)."""
    if p is None:
        return "-", "-", "-"
    return (str(p["epoch"]), f"{p['cursor']}/{p['samples']}",
            f"{p['lookahead_files']} files, {_size(p['lookahead_bytes'])}")


def _print_distributed_jobs(console: Console, jobs: list[dict[str, Any]],
                            plans: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    """One line per job of several ranks or loaders: its ranks, how many have a plan, its
    loaders, its hit rate."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        by_name.setdefault(j["job"], []).append(j)
    for name, ranks in by_name.items():
        loaders = sum(len(plans.get((name, j["rank"]), [])) for j in ranks)
        if len(ranks) < 2 and loaders < 2:
            continue
        requests, hits = sum(j["requests"] for j in ranks), sum(j["hits"] for j in ranks)
        planned = sum((name, j["rank"]) in plans for j in ranks)
        rate = 100 * hits / requests if requests else 0.0
        console.print(f"  job {name}: {len(ranks)} rank{'s' if len(ranks) > 1 else ''} "
                      f"({', '.join(str(j['rank']) for j in ranks)}), {planned} planned, "
                      f"{loaders} loader{'s' if loaders != 1 else ''}, requests {requests}, hit rate {rate:.2f}%")


# -- warmup ---------------------------------------------------------------------------


def _relative_paths(mount_point: str, paths: list[str]) -> list[str]:
    root = os.path.abspath(mount_point)
    out = []
    for raw in paths:
        path = raw.strip()
        if not path:
            continue
        if os.path.isabs(path):
            absolute = os.path.normpath(path)
            if absolute != root and not absolute.startswith(root + "/"):
                raise UsageError(f"{raw!r} is not under the mount point {root}")
            path = os.path.relpath(absolute, root)
        path = os.path.normpath(path)
        if path.startswith(".."):
            raise UsageError(f"{raw!r} leaves the mount point")
        out.append("" if path == "." else path)
    return out


def cmd_warmup(args: argparse.Namespace) -> int:
    raw = list(args.paths)
    if args.file:
        try:
            handle = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
            with handle:
                raw.extend(handle.read().splitlines())
        except OSError as exc:
            raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None
    paths = _relative_paths(args.mount_point, raw)
    if not paths:
        raise UsageError("give at least one PATH or -f LIST")
    if len(paths) > MAX_WARMUP_PATHS:
        raise UsageError(f"{len(paths)} paths: one warmup takes at most {MAX_WARMUP_PATHS}; split the list "
                         "or name their directories")
    _, client = _client(args.mount_point)
    started = _call(client, "POST", "warmup", body=json.dumps({"paths": paths, "check": args.check}).encode())
    report = _follow(client, int(started["id"]), quiet=args.json)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(warmup_summary(report, len(paths)))
        for failure in report.get("error_details", []):
            print(f"  {failure['path']}: {failure['error']}", file=sys.stderr)
        if report["errors"] > len(report.get("error_details", [])):
            print(f"  ... and {report['errors'] - len(report['error_details'])} more (see the daemon log)",
                  file=sys.stderr)
    return 0 if report["errors"] == 0 else 1


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def warmup_summary(report: dict[str, Any], paths: int) -> str:
    """The one-line result of a warmup (or ``--check``) of ``paths`` paths."""
    errors, elapsed = _count(report["errors"], "error"), f"{report['elapsed']:.1f} s"
    if not report["files_total"]:
        # Nothing was found to fetch: no share of nothing is "cached" (a percentage would say 100 %).
        return f"no files found under the {_count(paths, 'path')} given, {errors}, {elapsed}"
    verb = "cached" if report["check"] else "now cached"
    return (f"{report['files_cached']}/{_count(report['files_total'], 'file')}, {_size(report['bytes_cached'])} of "
            f"{_size(report['bytes_total'])} {verb} ({report['cached_percent']:.1f}%), {errors}, {elapsed}")


def _follow(client: ControlClient, warmup_id: int, *, quiet: bool) -> dict[str, Any]:
    def poll() -> dict[str, Any]:
        result: dict[str, Any] = _call(client, "GET", "warmup", query={"id": warmup_id})
        return result

    if quiet or not sys.stderr.isatty():
        while not (report := poll())["done"]:
            time.sleep(POLL_SECONDS)
        return report
    columns = (TextColumn("[bold]warmup"), BarColumn(), TextColumn("{task.fields[files]} files"),
               DownloadColumn(binary_units=True), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("warmup", total=None, files="0/?")
        while True:
            report = poll()
            progress.update(task, total=report["bytes_total"] or None, completed=report["bytes_done"],
                            files=f"{report['files_done']}/{report['files_total']}")
            if report["done"]:
                return report
            time.sleep(POLL_SECONDS)


# -- drop-cache -----------------------------------------------------------------------


def cmd_drop(args: argparse.Namespace) -> int:
    if args.samples is not None:
        return _drop_samples(args.mount_point or _samples_mount(), args.samples)
    if not args.mount_point:
        raise UsageError("give the MOUNTPOINT whose cache to drop (or --samples NAME)")
    _, client = _client(args.mount_point)
    result = _call(client, "POST", "cache/drop", body=b"{}")
    print(f"dropped {_size(result['dropped_bytes'])} from the cache of {os.path.abspath(args.mount_point)}")
    return 0


def _samples_mount() -> str:
    """The mount whose daemon keeps the sample caches: $VOL_NAME's, else the only live one."""
    live = [m for m in mounts.survey() if m.state == "live" and m.info]
    volume = os.environ.get("VOL_NAME")
    if volume:
        for m in live:
            if (m.info or {}).get("volName") == volume:
                return m.mount_point
        raise UsageError(f"no live cubefs-fuse mount of volume {volume!r} (VOL_NAME) on this node: give its MOUNTPOINT")
    if len(live) == 1:
        return live[0].mount_point
    raise UsageError(f"{len(live)} live cubefs-fuse mounts on this node: give the MOUNTPOINT (or set VOL_NAME)")


def _drop_samples(mount_point: str, name: str) -> int:
    try:
        sample_cache_reference(name)  # NAME (the caller's) or ~UID/NAME
    except ValueError as exc:
        raise UsageError(f"--samples {name!r}: {exc}") from None
    _, client = _client(mount_point)
    result = _call(client, "POST", "samples/drop", query={"name": name}, body=b"{}")
    print(f"dropped sample cache {name}: {result['dropped_entries']} entries, {_size(result['dropped_bytes'])} "
          f"(daemon of {os.path.abspath(mount_point)})")
    return 0


# -- stats ----------------------------------------------------------------------------


def cmd_stats(args: argparse.Namespace) -> int:
    if not 0 < args.interval < math.inf:
        raise UsageError(f"--interval {args.interval}: give a positive number of seconds")
    if args.count < 0:
        raise UsageError(f"--count {args.count}: give a number of intervals, or 0 for no end")
    _, client = _client(args.mount_point)
    previous = _call(client, "GET", "status")
    before = time.monotonic()
    count = 0
    try:
        while args.count <= 0 or count < args.count:
            time.sleep(args.interval)
            current = _call(client, "GET", "status")
            now = time.monotonic()
            if count % STATS_HEADER_EVERY == 0:
                print(_STATS_HEADER, flush=True)
            print(_STATS_FORMAT.format(*_stats_row(previous, current, now - before)), flush=True)
            previous, before = current, now
            count += 1
    except KeyboardInterrupt:
        pass
    return 0


# One line per interval, like vmstat/juicefs stats: readable in a terminal and in a log.
# Columns: time | what applications read, every path (requests/s, hit %, MiB/s) | requests/s
# by path (mount, fast path, sample cache) | the mount's lookups/s and READs/s | MiB/s the
# mount served from RAM, disk, remote | remote ops/s, prefetched blocks/s | RAM and disk in
# use.  A header every 20 lines keeps one on a terminal's screen.
STATS_HEADER_EVERY = 20
_STATS_FORMAT = ("{:>8} {:>7} {:>6} {:>7} | {:>7} {:>7} {:>7} | {:>7} {:>7} | {:>7} {:>7} {:>7} | {:>7} {:>7} | "
                 "{:>6} {:>6}")
_STATS_HEADER = _STATS_FORMAT.format("time", "req/s", "hit%", "MiB/s", "mount", "fast", "sample", "look/s", "read/s",
                                     "RAM", "disk", "remote", "rops/s", "pref/s", "RAM", "disk")


def _short(n: float) -> str:
    """A size in at most 5 characters (1023B, 15.8M, 2.1G)."""
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or n >= 100 else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def _stats_row(a: dict[str, Any], b: dict[str, Any], seconds: float) -> list[str]:
    ca, cb = a["counters"], b["counters"]

    def rate(key: str) -> float:
        return float(cb[key] - ca[key]) / seconds

    ra, rb = _reads(a), _reads(b)
    requests = rb["requests"] - ra["requests"]
    misses = rb["misses"] - ra["misses"]
    hit = f"{100.0 * (requests - misses) / requests:.1f}" if requests else "-"
    paths = [(rb["by_path"][p]["requests"] - ra["by_path"][p]["requests"]) / seconds
             for p in ("mount", "fastpath", "sample_cache")]
    by = {k: (cb["bytes_by_source"][k] - ca["bytes_by_source"][k]) / seconds / 2**20 for k in cb["bytes_by_source"]}
    mib = (rb["bytes"] - ra["bytes"]) / seconds / 2**20
    return [time.strftime("%H:%M:%S"), f"{requests / seconds:.0f}", hit, f"{mib:.1f}",
            *(f"{n:.0f}" for n in paths), f"{rate('lookups'):.0f}", f"{rate('reads'):.0f}",
            f"{by.get('ram', 0):.1f}", f"{by.get('disk', 0):.1f}",
            f"{by.get('backend', 0):.1f}", f"{rate('backend_operations'):.0f}", f"{rate('prefetch_issued'):.0f}",
            _short(b["cache"]["ram"]["used_bytes"]), _short(b["cache"].get("disk", {}).get("used_bytes", 0))]
