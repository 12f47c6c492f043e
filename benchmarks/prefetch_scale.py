"""ai_prefetch at scale: register a 10-million-file dataset and submit 10-million-sample
plans to a real mounted daemon; wall time of each request and the daemon's memory.

    sudo .venv/bin/python -m benchmarks.prefetch_scale [--files 10000000] [--dtype <u4]

The daemon is mounted with the real CLI (``"profile": "ai_prefetch"``) over an empty
scratch source directory: registering a file list and accepting a plan never touch the
files, and the plan's lookahead window (at most 4096 files) only finds them missing.
The file list is synthetic and ImageNet-shaped (``train/n0000123/n0000123_00159922.JPEG``,
38 bytes with its separator, 1,300 files per class), built with numpy in this process.

For each step it prints the request's wall time (client send + daemon validation +
answer) and the daemon's VmRSS before and after (``/proc/<pid>/status``) plus VmHWM,
the peak.  The target: "within seconds" and less than 1.5 GB of growth.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from humanfriendly import format_size, format_timespan
from humanfriendly.tables import format_pretty_table

from cubefs_fuse.control.protocol import CONTENT_BINARY, ControlClient, read_volume_config
from tools.harness import DaemonMount, remove_workdir, sigterm_as_interrupt

# Files per class directory, as in ImageNet-1k's training set.
PER_CLASS = 1300
TEMPLATE = b"train/n0000000/n0000000_00000000.JPEG\0"
# A 400 MB upload and its validation take seconds; the client waits far longer than that
# so a slow machine shows its real time instead of a timeout.
REQUEST_TIMEOUT = 600.0


def synthetic_list(files: int) -> bytes:
    """``files`` NUL-separated relative paths, built column by column (no Python strings)."""
    template = np.frombuffer(TEMPLATE, dtype=np.uint8)
    rows = np.empty((files, len(template)), dtype=np.uint8)
    rows[:] = template
    index = np.arange(files, dtype=np.int64)
    classes = index // PER_CLASS

    def put(values: np.ndarray, start: int, digits: int) -> None:
        for d in range(digits):
            rows[:, start + digits - 1 - d] = 48 + (values // 10**d) % 10  # ASCII '0' + digit

    first = TEMPLATE.index(b"n0") + 1
    second = TEMPLATE.index(b"/n0") + 2
    put(classes, first, 7)
    put(classes, second, 7)
    put(index, TEMPLATE.index(b"_") + 1, 8)
    return rows.reshape(-1)[:-1].tobytes()  # no separator after the last path


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process in bytes."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024  # reported in kB
    return values


def run(args: argparse.Namespace, workdir: Path) -> list[list[str]]:
    source = workdir / "source"
    source.mkdir()
    daemon = DaemonMount(workdir, source, workdir / "cache", vol_name=f"scale{os.getpid()}",
                         mem_cache_size="256MiB", disk_cache_size="1GiB", profile="ai_prefetch")
    rows: list[list[str]] = []
    try:
        daemon.mount()
        assert daemon.pid is not None
        client = ControlClient(read_volume_config(str(daemon.config["volName"])).control_socket,
                               timeout=REQUEST_TIMEOUT)
        client.status()
        start_rss = memory(daemon.pid)["VmRSS"]

        started = time.perf_counter()
        body = synthetic_list(args.files)
        print(f"built a {args.files:,}-path list of {format_size(len(body))} in "
              f"{format_timespan(time.perf_counter() - started)} (client side, not counted)", flush=True)
        order = np.random.default_rng(0).permutation(args.files).astype(args.dtype)

        def step(name: str, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
            assert daemon.pid is not None
            before = memory(daemon.pid)["VmRSS"]
            t = time.perf_counter()
            answer = call()
            seconds = time.perf_counter() - t
            after = memory(daemon.pid)
            rows.append([name, f"{seconds:.2f}", format_size(before, binary=True),
                         format_size(after["VmRSS"], binary=True),
                         format_size(after["VmRSS"] - start_rss, binary=True),
                         format_size(after["VmHWM"], binary=True)])
            print(f"{name}: {seconds:.2f} s, daemon RSS {format_size(after['VmRSS'], binary=True)}", flush=True)
            return answer

        def register() -> dict[str, Any]:
            result: dict[str, Any] = client.request("POST", "datasets", query={"columns": 1}, body=body,
                                                    content_type=CONTENT_BINARY)
            return result

        first = step("register dataset", register)
        assert first["files"] == args.files and not first["known"]
        dataset = str(first["dataset"])
        client.register_job("scale", 0, os.getpid())
        accepted = step("submit plan (epoch 0)",
                        lambda: client.submit_plan("scale", 0, 0, dataset, order.tobytes(), args.dtype))
        assert accepted["samples"] == args.files
        np.random.default_rng(1).shuffle(order)
        step("submit plan (epoch 1, replaces 0)",
             lambda: client.submit_plan("scale", 0, 1, dataset, order.tobytes(), args.dtype))
        again = step("register the same list again", register)
        assert again["known"] and again["dataset"] == dataset
        status = client.status()
        plan = status["plans"][0]
        print(f"plan: epoch {plan['epoch']}, {plan['samples']:,} samples, window {plan['lookahead_files']} files",
              flush=True)
        daemon.umount()
    finally:
        daemon.cleanup()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000_000, help="files in the list and samples per plan")
    parser.add_argument("--dtype", default="<u4", choices=["<u4", "<u8", "<i4", "<i8"],
                        help="the plan's integer type on the wire (default: <u4, as cube_torch sends)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a new one under /tmp)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("prefetch_scale: mounting needs root (or FUSE rights); run it as root", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="prefetch-scale-", dir=args.workdir))
    try:
        with sigterm_as_interrupt():
            rows = run(args, workdir)
    finally:
        remove_workdir(workdir, workdir / "mnt")
    print()
    print(format_pretty_table(rows, ["step", "seconds", "RSS before", "RSS after", "growth since start",
                                     "peak RSS (VmHWM)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
