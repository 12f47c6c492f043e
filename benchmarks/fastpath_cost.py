"""What one file costs through the mount and through cube_torch's fast path, in one run.

    .venv/bin/python -m benchmarks.fastpath_cost --files 1000 [--batch 32] [--markdown]

One daemon (``"profile": "ai_prefetch"``) over a generated ImageNet-like dataset in a
scratch directory (a local source: no latency), read by this process, one file at a time
through the mount or one batch at a time over the data socket (cube_torch's own
:class:`~cube_torch.fastpath.Channel`, as a DataLoader worker uses it):

1. through the mount, kernel page cache warm (what a later epoch without cube_torch
   costs: open, ioctl and release requests, no read);
2. fast path, RAM tier (the same files served from the daemon's RAM through the ring);
3. through the mount, NVMe tier: daemon restarted with a RAM tier of a quarter of the
   dataset, page cache dropped (the NVMe regime without cube_torch);
4. fast path, NVMe tier: the same, the directories listed first (as a plan's listings
   leave the metadata), batches over the data socket.

Per pass: files/s, the daemon's CPU per file (utime + stime of all its threads from
/proc over the pass; one clock tick of uncertainty over the files read) and this
process's own CPU per file, and their sum as a ratio to the first pass's.  A quick
foundation benchmark for the fast path's cost; the performance bars are the suite's
(scripts/bench.sh, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from humanfriendly.tables import format_pretty_table

from cube_torch.fastpath import Channel
from cubefs_fuse.control.protocol import read_volume_config
from tools.harness import (DaemonMount, HarnessError, drop_page_cache, machine, make_dataset, remove_workdir,
                           sigterm_as_interrupt)

# Both tiers hold the dataset for the RAM passes (plus allocation slack for small
# datasets); the NVMe passes give the RAM tier a quarter of it, as the suite's NVMe regime.
CACHE_HEADROOM = 2
CACHE_EXTRA_BYTES = 64 * 1024 * 1024
NVME_RAM_FRACTION = 0.25
VOL_NAME = "fastpath-cost"


@dataclass(frozen=True)
class Row:
    name: str
    files: int
    seconds: float
    daemon_cpu_s: float
    client_cpu_s: float


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(name: str, mount: DaemonMount, files: list[str], read: Callable[[list[str]], None]) -> Row:
    daemon, own, start = mount.cpu_seconds(), _own_cpu(), time.perf_counter()
    read(files)
    return Row(name, len(files), time.perf_counter() - start, mount.cpu_seconds() - daemon, _own_cpu() - own)


def run(args: argparse.Namespace, workdir: Path) -> list[Row]:
    dataset = make_dataset(workdir / "remote", args.files, classes=args.classes)
    files = list(dataset.files)
    sizes: dict[str, int] = {}
    cache_bytes = CACHE_HEADROOM * dataset.total_bytes + CACHE_EXTRA_BYTES
    mount = DaemonMount(workdir, workdir / "remote", workdir / "cache", vol_name=VOL_NAME,
                        mem_cache_size=cache_bytes, disk_cache_size=cache_bytes, profile="ai_prefetch")
    rows: list[Row] = []
    rng = random.Random(0)

    def through_mount(order: list[str]) -> None:
        for name in order:
            with open(mount.mount_point / name, "rb") as f:
                sizes[name] = len(f.read())

    def fast(order: list[str]) -> None:
        channel = Channel(read_volume_config(VOL_NAME).data_socket)
        try:
            for i in range(0, len(order), args.batch):
                answers = channel.batch(order[i:i + args.batch])
                channel.release([1] * len(answers))
                if any(a is None or len(a) != sizes[n] for a, n in zip(answers, order[i:i + args.batch])):
                    raise HarnessError("the fast path sent a file to the mount or answered a wrong size")
        finally:
            channel.close()

    def shuffled() -> list[str]:
        order = list(files)
        rng.shuffle(order)
        return order

    try:
        mount.mount()
        through_mount(files)  # fetched into RAM and NVMe
        through_mount(files)  # and surely in the page cache
        if not mount.wait_for_disk_blocks(dataset.blocks):
            raise HarnessError("the NVMe write-behind did not finish within 60 s")
        rows.append(_measure("mount, page cache warm", mount, shuffled(), through_mount))
        rows.append(_measure("fast path, RAM tier", mount, shuffled(), fast))
        mount.umount()
        mount.config["memCacheSize"] = int(NVME_RAM_FRACTION * dataset.total_bytes)
        for name, reader in (("mount, NVMe tier (remounted)", through_mount), ("fast path, NVMe tier (remounted)", fast)):
            mount.mount()
            for directory in sorted({os.path.dirname(f) for f in files}):
                os.listdir(mount.mount_point / directory)  # metadata, as a plan's listings
            drop_page_cache()
            rows.append(_measure(name, mount, shuffled(), reader))
            mount.umount()
    finally:
        mount.cleanup()
    return rows


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    header = ["pass", "files/s", "daemon CPU µs/file", "client CPU µs/file", "CPU × mount page cache"]
    base = (rows[0].daemon_cpu_s + rows[0].client_cpu_s) / rows[0].files
    body = [[r.name, f"{r.files / r.seconds:,.0f}", f"{r.daemon_cpu_s / r.files * 1e6:,.0f}",
             f"{r.client_cpu_s / r.files * 1e6:,.0f}",
             f"{(r.daemon_cpu_s + r.client_cpu_s) / r.files / base:.2f}" if base else "-"] for r in rows]
    return header, body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fastpath_cost",
                                description="Daemon and client CPU per ~110 KB file through the mount and "
                                "through cube_torch's fast path (RAM and NVMe tiers), in one run.")
    p.add_argument("--files", type=int, default=1000, help="files in the dataset (default: 1000)")
    p.add_argument("--classes", type=int, default=10, help="class folders (default: 10)")
    p.add_argument("--batch", type=int, default=32, help="files per fast-path batch (default: 32)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory parent (default: $TMPDIR)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)
    if args.files < 1 or args.classes < 1 or not 1 <= args.batch <= 1024:
        p.error("--files and --classes must be at least 1, --batch 1 to 1024")
    workdir = Path(tempfile.mkdtemp(prefix="cubefs-fastpath-cost-", dir=args.workdir))
    try:
        with sigterm_as_interrupt():
            rows = run(args, workdir)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (HarnessError, OSError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        remove_workdir(workdir, workdir / "mnt")
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **machine(),
            "load average": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
            "files": f"{args.files}, batches of {args.batch}, one reader (this process)",
            "CPU clock tick": f"{1e6 / os.sysconf('SC_CLK_TCK'):,.0f} µs (resolution of the CPU times)"}
    header, body = table(rows)
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|")
        print("\n".join("| " + " | ".join(cells) + " |" for cells in body))
    else:
        print(format_pretty_table(body, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
