"""Presets (``quick``, ``full``) and the command line that overrides them."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# raw_io, training, cache: the foundation's (a)-(c); nvme and daemon_cpu: the fast path's NVMe regime
# and the daemon's CPU per file (benchmarks/suite/daemon_cpu.py); samples: the processed-sample
# cache on and off (benchmarks/sample_cache.py, a local redis-server, then the daemon store);
# large_file: one 768 MiB file read whole through our mount against a direct read
# (benchmarks/large_file.py, ~1 minute); s3: an S3 bucket as the source
# (benchmarks/suite/s3.py), only when asked for (~5 minutes).
WORKLOADS = ("raw_io", "training", "cache", "nvme", "daemon_cpu", "large_file", "samples", "s3")
DEFAULT_WORKLOADS = tuple(w for w in WORKLOADS if w != "s3")
ALL_SYSTEMS = ("local", "remote", "cubefs", "cubefs+ct", "cubefs+ct-nofp", "rclone", "juicefs")
# cube_torch without its fast path runs only when asked for: it answers one question (does
# the fast path still win over the native data plane?) at the cost of another system's runs.
DEFAULT_SYSTEMS = tuple(s for s in ALL_SYSTEMS if s != "cubefs+ct-nofp")


@dataclass(frozen=True)
class Preset:
    name: str
    files: int  # dataset size; ~110 KB each
    classes: int  # class folders (ImageFolder labels)
    mean_kb: int  # mean file size in KB (10^3 bytes): ImageNet's ~110
    epochs: int
    raw_workers: tuple[int, ...]  # (a) DataLoader workers
    raw_latencies_us: tuple[int, ...]  # (a) remote latency presets
    train_workers: int  # (b)
    train_latencies_us: tuple[int, ...]  # (b)
    cache_fractions: tuple[float, ...]  # (c) cache size / dataset size
    cache_workers: int  # (c)
    cache_latency_us: int  # (c)
    bandwidth_mb_s: float  # remote bandwidth cap, 0: none
    # (d) the NVMe regime: the training loop (train_workers), page cache dropped before
    # every epoch, our RAM tier this fraction of the dataset (the dataset is 4x
    # the RAM tier), NVMe tiers and the peers' caches hold the whole dataset.  2 ms, the
    # raw-I/O preset (object storage): the regime of datasets many times larger than RAM
    # is that of a far remote, and every block or metadata entry the daemon failed to keep
    # on NVMe costs 12+ round trips of 2 ms, so a miss shows; it also shares the raw-I/O
    # runs' emulator instead of starting another.
    nvme_latency_us: int = 2000
    nvme_ram_fraction: float = 0.25
    # Seconds the kernel may cache the remote's entries and attributes (slowfs
    # --cache-timeout).  0, the default: every lookup and stat is a remote round trip,
    # like NFS mounted with noac (~12 operations per file of a class-folder tree).
    remote_cache_timeout_s: float = 0.0
    # The emulated remote's implementation: "c" (tools/slowfs_c, built on demand; falls
    # back to "python" with a warning if it cannot be built) or "python" (tools/slowfs.py,
    # whose own ceiling of ~350-400 files/s on 2 cores caps every first epoch).
    emulator: str = "c"
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    systems: tuple[str, ...] = DEFAULT_SYSTEMS

    def latencies(self) -> list[int]:
        """Every latency preset a workload of this run uses (one emulator each)."""
        used: set[int] = set()
        if "raw_io" in self.workloads:
            used.update(self.raw_latencies_us)
        if "training" in self.workloads:
            used.update(self.train_latencies_us)
        if "cache" in self.workloads:
            used.add(self.cache_latency_us)
        if "nvme" in self.workloads:
            used.add(self.nvme_latency_us)
        return sorted(used)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


PRESETS = {
    # Each workload at the latency its bar names (raw I/O 8 workers,
    # cache smaller than the dataset and the NVMe regime at 2 ms, training at 300 us and
    # 2 ms), plus the daemon's CPU per file.  The whole matrix on 1,000 files took ~17
    # minutes on 2 cores (a single reader at 2 ms and rclone's first epochs dominate), so
    # quick leaves out the 1- and 4-worker raw I/O runs (no bar names them; the 4-worker
    # ones make room for training at 2 ms, which one does) and the 0.25 and 0.9 caches.
    "quick": Preset(name="quick", files=1000, classes=10, mean_kb=110, epochs=3, raw_workers=(8,),
                    raw_latencies_us=(2000,), train_workers=2, train_latencies_us=(300, 2000),
                    cache_fractions=(0.5,), cache_workers=4, cache_latency_us=2000, bandwidth_mb_s=0),
    # The whole matrix: 1/4/8 workers and both latency presets for raw I/O and training,
    # caches of 0.25/0.5/0.9, the NVMe regime and the daemon's CPU per file, on 2,000
    # files (~220 MB): about an hour on 2 cores.
    "full": Preset(name="full", files=2000, classes=100, mean_kb=110, epochs=3, raw_workers=(1, 4, 8),
                   raw_latencies_us=(300, 2000), train_workers=2, train_latencies_us=(300, 2000),
                   cache_fractions=(0.25, 0.5, 0.9), cache_workers=4, cache_latency_us=2000, bandwidth_mb_s=0),
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not values or not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must lie strictly between 0 and 1, got {text!r}")
    return values


def _names(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(allowed)}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suite",
        description="The benchmark of docs/benchmarks.md: local copy, raw emulated remote, "
        "cubefs-fuse with and without cube_torch, rclone and JuiceFS on the same data in one run, and "
        "the daemon's CPU per file. "
        "Writes results.json, results.md and PNG plots into --out.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="default: quick (~4 min on 2 cores, ~11 with rclone and JuiceFS installed)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="parent of the scratch directory (default: $TMPDIR); needs room for ~3x the dataset")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (dataset, caches, logs)")
    g = p.add_argument_group("overrides of the preset")
    g.add_argument("--files", type=int, help="files in the dataset")
    g.add_argument("--classes", type=int, help="class folders")
    g.add_argument("--mean-kb", type=int, help="mean file size in KB (default 110, as ImageNet)")
    g.add_argument("--epochs", type=int, help="epochs per run")
    g.add_argument("--workloads", type=_names(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    g.add_argument("--systems", type=_names(ALL_SYSTEMS), help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    g.add_argument("--raw-workers", type=_ints, help="raw I/O DataLoader workers, e.g. 1,4,8")
    g.add_argument("--raw-latencies-us", type=_ints, help="raw I/O remote latencies in µs, e.g. 300,2000")
    g.add_argument("--train-workers", type=int, help="training DataLoader workers")
    g.add_argument("--train-latencies-us", type=_ints, help="training remote latencies in µs")
    g.add_argument("--cache-fractions", type=_fractions, help="cache sizes as fractions of the dataset, e.g. 0.25,0.5")
    g.add_argument("--cache-workers", type=int, help="DataLoader workers of the cache workload")
    g.add_argument("--cache-latency-us", type=int, help="remote latency of the cache workload in µs")
    g.add_argument("--nvme-latency-us", type=int, help="remote latency of the NVMe-regime workload in µs")
    g.add_argument("--nvme-ram-fraction", type=float,
                   help="our RAM tier as a fraction of the dataset in the NVMe regime and the daemon-CPU passes "
                   "(default 0.25: the dataset is 4 × the RAM tier)")
    g.add_argument("--bandwidth-mb-s", type=float, help="cap the remote's bandwidth (MB/s, shared by all reads)")
    g.add_argument("--remote-cache-timeout-s", type=float,
                   help="let the kernel cache the remote's entries/attributes this long (default 0: like NFS noac)")
    g.add_argument("--emulator", choices=("c", "python"),
                   help="the emulated remote: c (tools/slowfs_c, default) or python (tools/slowfs.py, slower)")
    return p


def resolve(args: argparse.Namespace) -> Preset:
    """The preset with the command line's overrides; ValueError if out of range."""
    preset = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in ("files", "classes", "mean_kb", "epochs", "workloads", "systems",
                                               "raw_workers", "raw_latencies_us", "train_workers",
                                               "train_latencies_us", "cache_fractions", "cache_workers",
                                               "cache_latency_us", "nvme_latency_us", "nvme_ram_fraction",
                                               "bandwidth_mb_s",
                                               "remote_cache_timeout_s", "emulator")
                 if getattr(args, k) is not None}
    preset = replace(preset, **overrides)
    if min(preset.files, preset.classes, preset.mean_kb, preset.epochs, preset.train_workers,
           preset.cache_workers, *preset.raw_workers) < 1:
        raise ValueError("files, classes, mean size, epochs and worker counts must be at least 1")
    if preset.files < preset.classes:
        raise ValueError("need at least one file per class")
    if preset.bandwidth_mb_s < 0 or preset.remote_cache_timeout_s < 0 or preset.nvme_latency_us < 0:
        raise ValueError("--bandwidth-mb-s, --remote-cache-timeout-s and --nvme-latency-us must be >= 0")
    if not 0 < preset.nvme_ram_fraction < 1:
        raise ValueError("--nvme-ram-fraction must lie strictly between 0 and 1")
    return preset
