"""What confinement (docs/contracts.md, "Never outside the source") costs per file open.

Opens ``--files`` files ``class<i>/img<j>`` (depth 2, like an ImageFolder) three ways and
prints the mean microseconds per open (open + close, no read):

* ``cached-unchecked``: the old way, ``openat(cached dir fd, name, O_NOFOLLOW)``;
* ``cached-checked`` (what backends/localdir.DirFds does): the same cached descriptor,
  its place checked through ``/proc/self/fd`` (one readlink, in memory), the name opened
  with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``;
* ``root-openat2``: no cached descriptors, ``openat2`` of the whole path from the root
  every time (every component looked up again: a round trip each on a ``noac`` remote).

By default the files are on a local directory; with ``--latency-us N`` they are behind
tools/slowfs with N microseconds per remote operation (entry caching off, like NFS
``noac``), the emulated remote (root and /dev/fuse needed).  Only ratios are meaningful:

    python -m benchmarks.confine_open [--files 2000] [--latency-us 300]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cubefs_fuse.backends import beneath
from cubefs_fuse.backends.localdir import DIR_FD_CACHE, DirFds, SourceRoot

# Files per class directory: ImageNet has ~1300 images in each of 1000 classes; 100 keeps
# the run short while most opens still reuse a cached directory.
PER_DIRECTORY = 100


def build(root: Path, files: int) -> list[str]:
    paths = [f"class{i // PER_DIRECTORY}/img{i:06d}" for i in range(files)]
    for path in paths:
        (root / path).parent.mkdir(exist_ok=True)
        (root / path).write_bytes(b"x")
    return paths


def time_opens(label: str, paths: list[str], open_one: Callable[[str], int]) -> float:
    for path in paths[:PER_DIRECTORY]:  # warm the dentry cache and the descriptor cache
        os.close(open_one(path))
    start = time.perf_counter()
    for path in paths:
        os.close(open_one(path))
    per_open = (time.perf_counter() - start) / len(paths) * 1e6
    print(f"{label:18s} {per_open:9.1f} us/open")
    return per_open


def run(source: Path, paths: list[str]) -> None:
    root_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    cache: dict[str, int] = {}

    def unchecked(path: str) -> int:
        parent, _, name = path.rpartition("/")
        fd = cache.get(parent)
        if fd is None:
            fd = cache[parent] = os.open(parent, os.O_PATH | os.O_DIRECTORY, dir_fd=root_fd)
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)

    dirs = DirFds(SourceRoot(str(source)), DIR_FD_CACHE)
    base = time_opens("cached-unchecked", paths, unchecked)
    checked = time_opens("cached-checked", paths, lambda p: dirs.open(p, os.O_RDONLY | os.O_NOFOLLOW))
    walked = time_opens("root-openat2", paths, lambda p: beneath.open_beneath(root_fd, p, os.O_RDONLY))
    print(f"ratios to cached-unchecked: cached-checked {checked / base:.2f}, root-openat2 {walked / base:.2f}")
    dirs.close()
    for fd in cache.values():
        os.close(fd)
    os.close(root_fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--latency-us", type=float, default=None, help="behind tools/slowfs with this latency")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="confine-open-") as tmp:
        real = Path(tmp) / "real"
        real.mkdir()
        paths = build(real, args.files)
        if args.latency_us is None:
            run(real, paths)
            return
        from tools.slowfs import SlowFSProcess

        mount_point = Path(tmp) / "mnt"
        mount_point.mkdir()
        with SlowFSProcess(real, mount_point, latency_us=args.latency_us):
            run(mount_point, paths)


if __name__ == "__main__":
    main()
