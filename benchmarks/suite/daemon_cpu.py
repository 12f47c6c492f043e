"""The daemon's own CPU per file : cold, kernel page-cache hit, NVMe-tier hit.

One reader process reads every file of the suite's dataset whole, in a shuffled order,
through our mount of the dataset's backing directory itself: a local source with no
latency, because the emulated remote would add CPU of its own on the same cores.  The
passes, all through one cache directory:

1. **cold**: a fresh daemon, page cache dropped; every block comes from the source and is
   written to NVMe (the write-behind is waited for and charged to the pass);
2. **page_cache**: the same daemon, page cache warm: the kernel serves the data and opens
   files itself, so only what the kernel asks again (a name whose entry's timeout ran
   out) reaches the daemon; repeated :data:`PAGE_CACHE_PASSES` times, because the
   per-file cost is a few clock ticks per pass;
3. **nvme**: unmounted and mounted again on the same cache directory (RAM tier empty),
   page cache dropped: the NVMe tier serves every block;
4. **ram**: a second daemon whose RAM tier holds the whole dataset, read once to fill it
   (not counted), then again with the page cache dropped: the RAM tier serves every block.

The RAM tier is ``ram_fraction`` of the dataset (smaller than the data, as the fast path's
NVMe-tier figure asks); the NVMe tier holds it all.  The daemon runs with
``"profile": "ai_prefetch"``, as in every other run of the suite.  Each figure is the
daemon's utime + stime (all threads, ``/proc/<pid>/stat``) over the pass divided by the
files read, so it is only as fine as one clock tick over those files (``resolution``),
and the same by part (``cpu_us_per_file_by_part``: the C session's threads, the trio
thread, trio's worker threads and the rest, ``tools.harness.cpu_split``), each part as
fine as a tick per thread.
The passes themselves are ``benchmarks.read_throughput.mount_pass``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.read_throughput import Row, mount_pass
from benchmarks.suite.cleanup import Registry
from benchmarks.suite.systems import cache_budget
from tools.harness import CPU_PARTS, DaemonMount, Dataset, HarnessError, Readers

# Repetitions of the page-cache pass: its ~100 µs per file is ~10 clock ticks (10 ms
# each) over 1,000 files; five passes make one tick ~2 µs per file.
PAGE_CACHE_PASSES = 5
READERS = 1  # the fast path's figures are per file with one reader: the daemon's cost, not its parallelism
PASS_KINDS = ("cold", "page_cache", "nvme", "ram")
PASS_TITLES = {
    "cold": "cold (local source, no latency)",
    "page_cache": "kernel page-cache hit",
    "nvme": "NVMe-tier hit (RAM tier smaller than the data, page cache dropped)",
    "ram": "RAM-tier hit (page cache dropped)",
}


def clock_tick_us() -> float:
    """One clock tick, the unit of utime/stime in /proc, in µs."""
    return 1e6 / os.sysconf("SC_CLK_TCK")


def pass_json(kind: str, rows: list[Row]) -> dict[str, Any]:
    """One figure of results.json's ``daemon_cpu.passes`` from one or more passes of a kind."""
    files = sum(r.result.files for r in rows)
    seconds = sum(r.result.seconds for r in rows)
    cpu = sum(r.cpu_s or 0.0 for r in rows)
    deltas = [r.delta for r in rows if r.delta is not None]
    by_part = {part: sum((r.cpu_by_part or {}).get(part, 0.0) for r in rows) / files * 1e6 for part in CPU_PARTS}
    return {
        "kind": kind, "passes": len(rows), "files": files, "bytes": sum(r.result.bytes for r in rows),
        "seconds": seconds, "files_per_s": files / seconds, "daemon_cpu_s": cpu,
        "cpu_us_per_file": cpu / files * 1e6, "cpu_us_per_file_by_part": by_part,
        "resolution_us_per_file": clock_tick_us() / files,
        "page_cache_dropped": all(r.dropped for r in rows),
        "fuse_reads": sum(d.reads for d in deltas), "ram_hits": sum(d.ram_hits for d in deltas),
        "disk_hits": sum(d.disk_hits for d in deltas), "misses": sum(d.misses for d in deltas),
    }


def measure(dataset: Dataset, workdir: Path, registry: Registry, *, ram_fraction: float, seed: int,
            on_pass: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run the three kinds of passes; results.json's ``daemon_cpu`` object.

    A failure ends the passes and is recorded as ``error`` (one line) beside those done.
    """
    memory, disk = cache_budget(dataset, None, ram_fraction)
    out: dict[str, Any] = {"readers": READERS, "files": len(dataset.files),
                           "mean_file_bytes": dataset.total_bytes / len(dataset.files),
                           "ram_fraction": ram_fraction, "ram_tier_bytes": memory, "disk_tier_bytes": disk,
                           "profile": "ai_prefetch", "clock_tick_us": clock_tick_us(), "passes": [],
                           "error": None}
    mount = DaemonMount(workdir, dataset.root, workdir / "cache", vol_name=f"benchcpu{os.getpid()}",
                        mem_cache_size=memory, disk_cache_size=disk, profile="ai_prefetch")
    release = registry.push(f"cubefs-fuse {mount.mount_point}", mount.cleanup)
    readers = Readers(READERS)

    def record(kind: str, rows: list[Row]) -> None:
        out["passes"].append(pass_json(kind, rows))
        on_pass(out["passes"][-1])

    try:
        mount.mount()
        record("cold", [mount_pass(readers, mount, dataset, "cold", seed=seed, drop=True, cold=True)])
        record("page_cache", [mount_pass(readers, mount, dataset, "page cache", seed=seed + 1 + i, drop=False)
                              for i in range(PAGE_CACHE_PASSES)])
        mount.umount()
        mount.mount()  # same cache directory: the NVMe tier survives, the RAM tier starts empty
        record("nvme", [mount_pass(readers, mount, dataset, "nvme", seed=seed + 1 + PAGE_CACHE_PASSES,
                                   drop=True)])
        mount.umount()
        whole, _ = cache_budget(dataset, None)
        (workdir / "ram").mkdir(exist_ok=True)
        ram = DaemonMount(workdir / "ram", dataset.root, workdir / "ram" / "cache", vol_name=f"benchram{os.getpid()}",
                          mem_cache_size=whole, disk_cache_size=disk, profile="ai_prefetch")
        release_ram = registry.push(f"cubefs-fuse {ram.mount_point}", ram.cleanup)
        try:
            ram.mount()
            mount_pass(readers, ram, dataset, "ram fill", seed=seed + 2 + PAGE_CACHE_PASSES, drop=True, cold=True)
            record("ram", [mount_pass(readers, ram, dataset, "ram", seed=seed + 3 + PAGE_CACHE_PASSES, drop=True)])
            ram.umount()
        finally:
            release_ram()
    except (HarnessError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        readers.close()
        release()  # mount.cleanup(): a no-op once unmounted
    return out
