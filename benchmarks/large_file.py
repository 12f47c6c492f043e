"""One large file read whole with 1 MiB reads (a WebDataset or TFRecord shard), through our
mount against a direct read of the same file, in one run.

    .venv/bin/python -m benchmarks.large_file [--mib 768] [--rounds 2] [--markdown]

The file (random bytes) is written to a scratch directory, the source: local, no latency.
Each round reads it whole, by one reader with ``os.read`` calls of 1 MiB, the page cache
written back and dropped before every pass:

1. **direct**: the source file itself, the reference, once before and once after our
   passes: this VM's virtual disk reads the same file at up to twice the rate minutes
   apart, so each ratio is to the mean of the two;
2. **cold**: a fresh daemon, its cache directory empty: every block comes from the source
   and is written to NVMe behind the reader (the write-behind is waited for before the
   next pass, outside the timing);
3. **nvme**: unmounted and mounted again on the same cache directory, the RAM tier empty
   and a third of the file: the NVMe tier serves every block.

Bars of the native data plane: nvme >= 0.9 x direct, cold >= 0.6 x direct (the medians
over the rounds).  Each pass also reports the daemon's CPU seconds (utime + stime, all its
threads) and how many of its READs the C session served without Python.  The suite's
``large_file`` workload runs :func:`measure` (benchmarks/suite/runner.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cubefs_fuse.config import DEFAULT_BLOCK_SIZE
from tools.harness import DaemonMount, HarnessError, drop_page_cache, machine, remove_workdir, sigterm_as_interrupt

READ_BYTES = 1 << 20  # what WebDataset's tar reader and TFRecord readers ask for at a time, roughly
DEFAULT_MIB = 768  # a typical shard: large against the RAM tier, small against a disk
DEFAULT_ROUNDS = 3
NVME_BAR = 0.9
COLD_BAR = 0.6
# The RAM tier, as a fraction of the file: the NVMe pass must be served from NVMe.
RAM_FRACTION = 1 / 3
WRITE_BEHIND_TIMEOUT_S = 300.0  # for the file's blocks to reach NVMe after the cold pass


def write_file(path: Path, mib: int) -> None:
    """``mib`` MiB of random bytes (incompressible, as a shard of JPEGs is)."""
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())


def read_whole(path: Path) -> float:
    """Read ``path`` whole with READ_BYTES reads, the page cache written back and dropped
    first; MB/s (10^6 bytes)."""
    if not drop_page_cache():
        raise HarnessError("cannot drop the page cache (needs root): every pass would be warm")
    fd = os.open(path, os.O_RDONLY)
    total = 0
    start = time.perf_counter()
    try:
        while chunk := os.read(fd, READ_BYTES):
            total += len(chunk)
    finally:
        os.close(fd)
    return total / (time.perf_counter() - start) / 1e6


def measure(workdir: Path, *, mib: int = DEFAULT_MIB, rounds: int = DEFAULT_ROUNDS,
            on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Write the file, run ``rounds`` rounds; results.json's ``large_file`` object.  A
    failure ends the rounds and is recorded as ``error`` (one line) beside those done."""
    size = mib << 20
    ram = int(size * RAM_FRACTION)
    out: dict[str, Any] = {"mib": mib, "read_bytes": READ_BYTES, "ram_tier_bytes": ram, "rounds": [],
                           "nvme_ratio": None, "cold_ratio": None, "error": None}
    source = workdir / "source"
    source.mkdir(parents=True, exist_ok=True)
    shard = source / "shard-000000.tar"
    try:
        write_file(shard, mib)
        for number in range(rounds):
            cache = workdir / f"cache-{number}"
            mount = DaemonMount(workdir / f"round-{number}", source, cache, vol_name=f"benchlarge{os.getpid()}",
                                mem_cache_size=ram, disk_cache_size=2 * size)
            try:
                direct_before = read_whole(shard)
                mount.mount()
                cpu = mount.cpu_seconds()
                cold = read_whole(mount.mount_point / shard.name)
                cold_cpu = mount.cpu_seconds() - cpu
                blocks = -(-size // DEFAULT_BLOCK_SIZE)  # the mount's blockSize is the default
                if not mount.wait_for_disk_blocks(blocks, WRITE_BEHIND_TIMEOUT_S):
                    raise HarnessError(f"the file's {blocks} blocks did not reach NVMe in {WRITE_BEHIND_TIMEOUT_S:g} s")
                mount.umount()
                mount.mount()
                before = mount.scrape()
                cpu = mount.cpu_seconds()
                nvme = read_whole(mount.mount_point / shard.name)
                nvme_cpu = mount.cpu_seconds() - cpu
                after = mount.scrape()
                mount.umount()
                direct_after = read_whole(shard)
            finally:
                mount.cleanup()
                remove_workdir(cache)
            direct = (direct_before + direct_after) / 2

            def grew(name: str) -> int:
                return int(after.get(name, 0) - before.get(name, 0))

            figures = {"round": number, "direct_mb_s": [direct_before, direct_after],
                       "cold_mb_s": cold, "cold_ratio": cold / direct, "cold_daemon_cpu_s": cold_cpu,
                       "nvme_mb_s": nvme, "nvme_ratio": nvme / direct, "nvme_daemon_cpu_s": nvme_cpu,
                       "nvme_reads": grew("cubefs_fuse_reads_total"),
                       "nvme_native_reads": grew("cubefs_fuse_native_reads_total")}
            out["rounds"].append(figures)
            if on_round is not None:
                on_round(figures)
    except (HarnessError, OSError) as exc:
        out["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        shard.unlink(missing_ok=True)
    if out["rounds"]:
        out["nvme_ratio"] = statistics.median(r["nvme_ratio"] for r in out["rounds"])
        out["cold_ratio"] = statistics.median(r["cold_ratio"] for r in out["rounds"])
    return out


def table(figures: dict[str, Any]) -> str:
    """Markdown: one line per round and pass, then the medians against the bars."""
    lines = [f"One file of {figures['mib']} MiB read whole with {figures['read_bytes'] >> 20} MiB reads, one reader, "
             f"page cache dropped before each pass; RAM tier {figures['ram_tier_bytes'] >> 20} MiB (the NVMe pass "
             "reads the NVMe tier); ratios to the mean of the direct reads before and after.", "",
             "| round | direct MB/s (before / after) | cold MB/s | cold × direct | daemon CPU s | "
             "NVMe MB/s | NVMe × direct | daemon CPU s | READs in C |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in figures["rounds"]:
        lines.append(f"| {r['round'] + 1} | {r['direct_mb_s'][0]:,.0f} / {r['direct_mb_s'][1]:,.0f} | "
                     f"{r['cold_mb_s']:,.0f} | {r['cold_ratio']:.2f} | {r['cold_daemon_cpu_s']:.2f} | "
                     f"{r['nvme_mb_s']:,.0f} | {r['nvme_ratio']:.2f} | {r['nvme_daemon_cpu_s']:.2f} | "
                     f"{r['nvme_native_reads']} of {r['nvme_reads']} |")
    if figures["rounds"]:
        lines += ["", f"Medians: NVMe tier {figures['nvme_ratio']:.2f} × direct (bar ≥ {NVME_BAR}), "
                      f"cold {figures['cold_ratio']:.2f} × (bar ≥ {COLD_BAR})."]
    if figures["error"]:
        lines += ["", f"failed: {figures['error']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.large_file", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=DEFAULT_MIB, help=f"the file's size in MiB (default {DEFAULT_MIB})")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help=f"rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.rounds < 1:
        parser.error("--mib and --rounds must be at least 1")
    if os.geteuid() != 0:
        print("large_file: needs root (mount, and dropping the page cache)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="cubefs-large-file-"))
    host = machine()
    print(f"{host['cpus']}; writing {args.mib} MiB in {workdir} ...", file=sys.stderr, flush=True)

    def on_round(r: dict[str, Any]) -> None:
        print(f"round {r['round'] + 1}: direct {r['direct_mb_s'][0]:,.0f}/{r['direct_mb_s'][1]:,.0f} MB/s, "
              f"cold {r['cold_mb_s']:,.0f} ({r['cold_ratio']:.2f} ×), NVMe {r['nvme_mb_s']:,.0f} "
              f"({r['nvme_ratio']:.2f} ×, {r['nvme_native_reads']} of {r['nvme_reads']} READs in C)", flush=True)

    try:
        with sigterm_as_interrupt():
            figures = measure(workdir, mib=args.mib, rounds=args.rounds, on_round=on_round)
    finally:
        remove_workdir(workdir, *workdir.glob("round-*/mnt"))
    if args.markdown:
        print(table(figures))
    if figures["error"]:
        print(f"large_file: {figures['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
