"""Start-up time of the NVMe tier with many cached blocks: from the index, and after a crash.

Fills a DiskTier with ``--blocks`` small blocks, closes it (the index is written), times
``DiskTier.open()`` from the index, then releases it without an index (a crash) and times
``open()`` again (the scan of the segment files' headers).  The target: under 2 s for 100k
blocks.  With ``--drop-caches`` (root) the kernel's page and dentry caches are dropped
before each timed open, which is what a start-up after a reboot sees.

    python -m benchmarks.disk_startup --blocks 100000 [--dir DIR] [--drop-caches]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import trio

from cubefs_fuse.cache.disk import DiskTier, allocated_bytes
from cubefs_fuse.attrs import FileVersion
from cubefs_fuse.cache.keys import block_key

# Concurrent puts while filling; the tier itself runs at most DISK_THREADS at once, more
# tasks only keep its queue full.
FILL_TASKS = 64
# Payload of each block: ~1 KB, a small file's single block.  Start-up cost is per block
# (an index entry, or a directory entry and a stat), not per byte.
DEFAULT_BLOCK_BYTES = 1000


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


async def fill(directory: str, blocks: int, block_bytes: int, limit: int) -> float:
    start = time.perf_counter()
    tier = await DiskTier.open(directory, limit, 0.0)
    payload = os.urandom(block_bytes)
    version = FileVersion(block_bytes, 1_700_000_000 * 10**9, 1, 1_700_000_000 * 10**9)

    async def worker(first: int) -> None:
        for i in range(first, blocks, FILL_TASKS):
            # Keys as the daemon makes them: one block of each file of an image-like tree.
            key = block_key(f"train/class{i % 1000:04d}/img{i:08d}.jpg", version, 0)
            if not await tier.put(key, payload):
                raise SystemExit(f"block {i} was not stored: is there enough free space in {directory}?")

    async with trio.open_nursery() as nursery:
        for first in range(FILL_TASKS):
            nursery.start_soon(worker, first)
    await tier.close()
    return time.perf_counter() - start


async def timed_open(directory: str, limit: int, cold: bool) -> tuple[DiskTier, float]:
    if cold:
        drop_caches()
    start = time.perf_counter()
    tier = await DiskTier.open(directory, limit, 0.0)
    return tier, time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> int:
    directory = args.dir or tempfile.mkdtemp(prefix="disk-startup-")
    owned = args.dir is None
    if not owned and os.path.exists(os.path.join(directory, "blocks")):
        print(f"{directory} already holds a cache; use an empty or new directory", file=sys.stderr)
        return 2
    # Room for every block with 10 % to spare, so nothing is evicted while filling.
    limit = int(args.blocks * allocated_bytes(args.block_bytes) * 1.1)
    try:
        fill_s = await fill(directory, args.blocks, args.block_bytes, limit)
        print(f"filled {args.blocks} blocks of {args.block_bytes} B in {fill_s:.1f} s ({directory})")

        tier, index_s = await timed_open(directory, limit, args.drop_caches)
        index_stats = tier.statistics()
        tier.release()  # a crash: no index is written, the next start must scan
        tier, scan_s = await timed_open(directory, limit, args.drop_caches)
        scan_stats = tier.statistics()
        await tier.close()

        for stats in (index_stats, scan_stats):
            if stats.blocks != args.blocks:
                print(f"expected {args.blocks} blocks, {stats.startup_source} start found {stats.blocks}",
                      file=sys.stderr)
                return 1
        caches = "cold (dropped)" if args.drop_caches else "warm"
        print(f"{'start-up':<22}{'blocks':>10}{'seconds':>10}{'in open()':>11}   kernel caches: {caches}")
        for name, stats, wall in (("from index", index_stats, index_s), ("after crash (scan)", scan_stats, scan_s)):
            print(f"{name:<22}{stats.blocks:>10}{wall:>10.3f}{stats.startup_seconds:>11.3f}")
        return 0
    finally:
        if owned and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks to cache (default 100000)")
    parser.add_argument("--dir", help="cache directory (default: a new temporary one, removed afterwards)")
    parser.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES,
                        help=f"payload bytes per block (default {DEFAULT_BLOCK_BYTES})")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the kernel page/dentry caches before each timed open (root)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    return trio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
