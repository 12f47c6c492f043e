"""Read throughput of a ~110 KB-file dataset: direct vs through the mount, in one run.

    .venv/bin/python -m benchmarks.read_throughput --files 2000 [--workers 4] [--markdown]

Generates an ImageNet-like dataset in a scratch directory (the "remote"), then reads
every file once per pass, in a shuffled order, with N reader processes:

1. directly from the source directory, page cache dropped (the reference: ratio 1.0);
2. directly again, page cache warm;
3. through the mount, cold (fresh NVMe cache dir, page cache dropped);
4. through the mount again, same daemon: the kernel page cache may serve it;
5. page cache dropped, same daemon: the daemon's RAM tier serves it;
6. unmounted and remounted on the same cache dir (RAM tier empty), page cache
   dropped: the NVMe tier serves it.

For the mount passes it reports the daemon's CPU time per file (utime + stime of
/proc/<pid>/stat over the pass, all threads) and what its /metrics counted.  This is
a quick foundation benchmark: the "remote" is a local directory, not the latency-
emulating remote of the benchmark suite (scripts/bench.sh, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from humanfriendly import format_size
from humanfriendly.tables import format_pretty_table

from cubefs_fuse import mounts
from tools.harness import (
    CacheDelta,
    DaemonMount,
    Dataset,
    HarnessError,
    PassResult,
    Readers,
    cache_delta,
    cpu_split,
    drop_page_cache,
    machine,
    make_dataset,
    remove_workdir,
    sigterm_as_interrupt,
)

# Cache tier limits, as a multiple of the dataset: both tiers hold it all, so the warm
# passes measure serving from a tier, not eviction.  The +64 MiB covers per-block
# allocation rounding on NVMe (4 KiB units) for small datasets.
CACHE_HEADROOM = 2
CACHE_EXTRA_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Row:
    name: str
    dropped: bool  # page cache dropped right before the pass
    result: PassResult
    cpu_s: float | None = None  # daemon CPU seconds over the pass
    delta: CacheDelta | None = None
    cpu_by_part: dict[str, float] | None = None  # those seconds by part (tools.harness.cpu_split)


def filesystem_of(path: Path) -> str:
    best = None
    for entry in mounts.mount_table():
        mp = entry.mount_point.rstrip("/") + "/"
        if (str(path) + "/").startswith(mp) and (best is None or len(mp) > len(best.mount_point)):
            best = entry
    return f"{best.fstype} on {best.source}" if best else "unknown"


def run(args: argparse.Namespace, workdir: Path) -> list[Row]:
    source = workdir / "remote"
    print(f"generating {args.files} files in {source} ...", file=sys.stderr, flush=True)
    dataset = make_dataset(source, args.files, classes=args.classes)
    print(f"dataset: {len(dataset.files)} {'JPEG' if dataset.jpeg else 'JPEG-like'} files, "
          f"{format_size(dataset.total_bytes)} (mean {format_size(dataset.total_bytes // len(dataset.files))})",
          file=sys.stderr)
    cache_bytes = CACHE_HEADROOM * dataset.total_bytes + CACHE_EXTRA_BYTES
    readers = Readers(args.workers)
    mount: DaemonMount | None = None
    rows: list[Row] = []
    seed = 0

    def direct(name: str, drop: bool) -> None:
        nonlocal seed
        seed += 1
        dropped = drop_page_cache() if drop else False
        rows.append(Row(name, dropped, _checked(readers.read(source, dataset.files, seed=seed), dataset)))
        _progress(rows[-1])

    def through(m: DaemonMount, name: str, drop: bool, *, cold: bool = False) -> None:
        nonlocal seed
        seed += 1
        rows.append(mount_pass(readers, m, dataset, name, seed=seed, drop=drop, cold=cold))
        _progress(rows[-1])

    try:
        direct("direct, cold", drop=True)
        direct("direct, page cache warm", drop=False)
        cache_dir = workdir / "nvme-cache"
        mount = DaemonMount(workdir, source, cache_dir, vol_name="bench",
                            mem_cache_size=cache_bytes, disk_cache_size=cache_bytes)
        mount.mount()
        through(mount, "mount, cold", drop=True, cold=True)
        through(mount, "mount, warm: kernel page cache", drop=False)
        through(mount, "mount, warm: daemon RAM", drop=True)
        mount.umount()
        mount.mount()  # same cache dir: the NVMe tier survives, the RAM tier starts empty
        through(mount, "mount, warm: daemon NVMe (remounted)", drop=True)
        mount.umount()
    finally:
        readers.close()
        if mount is not None:
            mount.cleanup()
    return rows


def mount_pass(readers: Readers, mount: DaemonMount, dataset: Dataset, name: str, *, seed: int, drop: bool,
               cold: bool = False) -> Row:
    """One pass over every file through ``mount`` (page cache dropped first if ``drop``),
    with the daemon's CPU seconds over it and what its /metrics counted.

    ``cold``: the pass fills the NVMe tier; its write-behind is waited for (by counting
    the entries of its segment files, which costs the daemon nothing) and charged to the
    pass.
    The benchmark suite's daemon-CPU figures (benchmarks/suite/daemon_cpu.py) use it too.
    """
    dropped = drop_page_cache() if drop else False
    before = mount.scrape()
    cpu_before = mount.cpu_snapshot()
    result = _checked(readers.read(mount.mount_point, dataset.files, seed=seed), dataset)
    if cold and not mount.wait_for_disk_blocks(dataset.blocks):
        print("warning: the NVMe write-behind did not finish within 60 s", file=sys.stderr)
    cpu_after = mount.cpu_snapshot()
    return Row(name, dropped, result, cpu_after.total - cpu_before.total, cache_delta(before, mount.scrape()),
               cpu_split(cpu_before, cpu_after))


def _checked(result: PassResult, dataset: Dataset) -> PassResult:
    if result.files != len(dataset.files) or result.bytes != dataset.total_bytes:
        raise HarnessError(f"a pass read {result.files} files / {result.bytes} bytes, "
                           f"expected {len(dataset.files)} / {dataset.total_bytes}")
    return result


def _progress(row: Row) -> None:
    print(f"  {row.name}: {row.result.files_per_s:,.0f} files/s", file=sys.stderr, flush=True)


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    reference = rows[0].result
    header = ["pass", "page cache dropped", "files/s", "MB/s", "× direct cold", "daemon CPU µs/file",
              "FUSE reads/file", "RAM hits", "NVMe hits", "misses", "from remote"]
    body = []
    for row in rows:
        r, d = row.result, row.delta
        body.append([
            row.name, "yes" if row.dropped else "no", f"{r.files_per_s:,.0f}", f"{r.mb_per_s:,.1f}",
            f"{r.files_per_s / reference.files_per_s:.2f}",
            f"{row.cpu_s / r.files * 1e6:,.0f}" if row.cpu_s is not None else "",
            f"{d.reads / r.files:.2f}" if d else "", str(d.ram_hits) if d else "", str(d.disk_hits) if d else "",
            str(d.misses) if d else "", format_size(d.backend_bytes) if d else "",
        ])
    return header, body


def markdown(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.read_throughput",
                                description="Files/s and MB/s reading a ~110 KB-file dataset directly "
                                "and through a cubefs-fuse mount (cold, warm RAM, warm NVMe).")
    p.add_argument("--files", type=int, default=2000, help="files in the dataset (default: 2000)")
    p.add_argument("--classes", type=int, default=100, help="class folders (default: 100)")
    p.add_argument("--workers", type=int, default=4, help="reader processes (default: 4)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory parent (default: $TMPDIR)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)
    if args.files < 1 or args.classes < 1 or args.workers < 1:
        p.error("--files, --classes and --workers must be at least 1")
    workdir = Path(tempfile.mkdtemp(prefix="cubefs-bench-", dir=args.workdir))
    try:
        with sigterm_as_interrupt():
            rows = run(args, workdir)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (HarnessError, OSError) as exc:  # OSError: e.g. the scratch disk is full
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        remove_workdir(workdir, workdir / "mnt")
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **machine()}
    info["scratch dir"] = f"{workdir.parent} ({filesystem_of(workdir.parent)})"
    info["readers"] = f"{args.workers} processes, {args.files} files, shuffled order"
    info["CPU clock tick"] = f"{1e6 / os.sysconf('SC_CLK_TCK'):,.0f} µs (resolution of daemon CPU time)"
    if not rows[0].dropped:
        info["note"] = "could not drop the page cache (needs root): 'cold' passes may be served from RAM"
    header, body = table(rows)
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    print(markdown(header, body) if args.markdown else format_pretty_table(body, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
