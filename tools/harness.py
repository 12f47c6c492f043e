"""What the demo and the benchmarks share: datasets, real mounts, reader processes, metrics.

Everything goes through the product's real interfaces: the ``cubefs-fuse`` CLI mounts
(daemonized) and unmounts, statistics come from the daemon's Prometheus ``/metrics``,
daemon CPU time from ``/proc/<pid>/stat``.  Nothing here reaches into the daemon.
"""

from __future__ import annotations

import colorsys
import io
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import xxhash
from humanfriendly import format_size
from prometheus_client.parser import text_string_to_metric_families

from cubefs_fuse import mounts
from cubefs_fuse.control.protocol import config_file_path

# Mean file size of an ImageNet-like dataset (ILSVRC-2012 train: ~110 KB per JPEG).
MEAN_FILE_BYTES = 110_000
# Sizes are drawn uniformly from mean * [1 - SPREAD, 1 + SPREAD] (here ~60-160 KB), so
# files are not all alike without drifting far from the ImageNet mean.
SIZE_SPREAD = 0.45
# JPEG of RGB noise at quality 90 without chroma subsampling: ~1.88 bytes per pixel
# (measured with Pillow), used to pick image dimensions for a target file size.
JPEG_NOISE_BYTES_PER_PIXEL = 1.88
JPEG_QUALITY = 90
# make_class_images: each class's colour in HSV (saturation, value: distinct, mid-bright
# colours) plus uniform noise of +-CLASS_NOISE per channel, strong enough to make the
# files ImageNet-sized (~1.5 bytes per pixel) yet leaving the colour clearly learnable.
CLASS_SATURATION = 0.6
CLASS_VALUE = 0.75
CLASS_NOISE = 72
# The parts of the daemon's CPU time (DaemonMount.cpu_snapshot), as its threads are named.
CPU_PARTS = ("session", "trio", "workers", "other")
# Files per task handed to a reader process: large enough that the IPC per task
# (~100 µs) is small against 16 file reads, small enough to keep all readers busy.
READ_CHUNK_FILES = 16
# How long one whole pass over a dataset may take before the harness gives up (a hung
# mount must end the demo with an error, not hang it).
PASS_TIMEOUT_S = 600.0
# Block size the demo/benchmark configs use (the config default, 1 MiB): every
# ~110 KB file is exactly one cache block.
BLOCK_SIZE = 1024 * 1024


class HarnessError(Exception):
    """A failure the demo or benchmark reports as one line before exiting non-zero."""


# Seconds a C tool's build may take: a cold gcc -O2 of one of them takes ~1-2 s on 2 cores.
BUILD_TIMEOUT_S = 120.0


def build_tool(script: Path) -> Path:
    """Run a C tool's ``build.sh`` (tools/build_c.sh: idempotent) and return the binary it
    prints; HarnessError with the reason (the script's stderr) if it cannot be built."""
    try:
        done = subprocess.run([str(script)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HarnessError(str(exc)) from None
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines and os.access(lines[-1], os.X_OK):
        return Path(lines[-1])
    raise HarnessError(done.stderr.strip() or f"exit status {done.returncode}")


# -- datasets --------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    root: Path
    files: list[str]  # paths relative to root
    sizes: list[int]
    digests: dict[str, int]  # relative path -> xxh3_64 of the content
    jpeg: bool  # real JPEGs (Pillow available) or random bytes between JPEG markers

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def blocks(self) -> int:
        return sum(max(1, math.ceil(s / BLOCK_SIZE)) for s in self.sizes)


def _jpeg_noise(rng: np.random.Generator, target_bytes: int) -> bytes | None:
    try:
        from PIL import Image
    except ImportError:
        return None
    pixels = target_bytes / JPEG_NOISE_BYTES_PER_PIXEL
    aspect = float(rng.choice([4 / 3, 3 / 4, 1.0]))  # landscape, portrait, square
    width = max(8, int(math.sqrt(pixels * aspect)))
    height = max(8, int(pixels / width))
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=JPEG_QUALITY, subsampling=0)
    return out.getvalue()


def make_class_images(root: Path, files: int, *, classes: int = 10, mean_bytes: int = MEAN_FILE_BYTES,
                      seed: int = 0) -> Dataset:
    """An ImageNet-like tree ``root/class_XX/img_NNNNNN.jpg`` of JPEGs a CNN can learn.

    Each class has its own colour (evenly spaced hues) under strong pixel noise: the noise
    gives the files ImageNet-like sizes, the colour makes the labels learnable, so the
    demo's loss falls.  Needs Pillow.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    colours = [np.array(colorsys.hsv_to_rgb(c / classes, CLASS_SATURATION, CLASS_VALUE)) * 255
               for c in range(classes)]

    def encode(colour: np.ndarray, height: int, width: int) -> bytes:
        noise = rng.integers(-CLASS_NOISE, CLASS_NOISE + 1, (height, width, 3), dtype=np.int16)
        pixels = np.clip(noise + colour.astype(np.int16), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=JPEG_QUALITY, subsampling=0)
        return out.getvalue()

    # Bytes per pixel of this kind of image, measured once, to size images for a target.
    side = 128  # big enough that the JPEG header (~600 bytes) is noise in the estimate
    bytes_per_pixel = len(encode(colours[0], side, side)) / side**2
    names: list[str] = []
    sizes: list[int] = []
    digests: dict[str, int] = {}
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        target = mean_bytes * rng.uniform(1 - SIZE_SPREAD, 1 + SIZE_SPREAD)
        aspect = float(rng.choice([4 / 3, 3 / 4, 1.0]))  # landscape, portrait, square
        width = max(8, int(math.sqrt(target / bytes_per_pixel * aspect)))
        height = max(8, int(target / bytes_per_pixel / width))
        data = encode(colours[i % classes], height, width)
        name = f"class_{i % classes:02d}/img_{i:06d}.jpg"
        (root / name).write_bytes(data)
        names.append(name)
        sizes.append(len(data))
        digests[name] = xxhash.xxh3_64_intdigest(data)
    return Dataset(root, names, sizes, digests, jpeg=True)


def make_dataset(root: Path, files: int, *, classes: int = 10, mean_bytes: int = MEAN_FILE_BYTES,
                 seed: int = 0) -> Dataset:
    """An ImageNet-like tree ``root/class_XX/img_NNNNNN.jpg`` of noise images."""
    rng = np.random.default_rng(seed)
    names: list[str] = []
    sizes: list[int] = []
    digests: dict[str, int] = {}
    jpeg = True
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        target = int(mean_bytes * rng.uniform(1 - SIZE_SPREAD, 1 + SIZE_SPREAD))
        data = _jpeg_noise(rng, target) if jpeg else None
        if data is None:  # no Pillow: random bytes framed as a JPEG (SOI/APP0 ... EOI)
            jpeg = False
            data = b"\xff\xd8\xff\xe0" + rng.bytes(target - 6) + b"\xff\xd9"
        name = f"class_{i % classes:02d}/img_{i:06d}.jpg"
        (root / name).write_bytes(data)
        names.append(name)
        sizes.append(len(data))
        digests[name] = xxhash.xxh3_64_intdigest(data)
    return Dataset(root, names, sizes, digests, jpeg)


# -- reading with worker processes -----------------------------------------------------


@dataclass(frozen=True)
class PassResult:
    files: int
    bytes: int
    seconds: float
    mismatched: list[str] = field(default_factory=list)  # files whose content differed

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6  # decimal MB, as disks are rated


def _reader_init() -> None:
    # Ctrl-C goes to the whole process group: the parent alone handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Pool.terminate() stops us with SIGTERM; undo the parent's SIGTERM-as-Ctrl-C handler.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _read_chunk(task: tuple[str, list[str], dict[str, int] | None]) -> tuple[int, int, list[str]]:
    """Read each file whole, as a data loader does; (files, bytes, mismatched paths)."""
    root, names, digests = task
    total = 0
    bad: list[str] = []
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        total += len(data)
        if digests is not None and xxhash.xxh3_64_intdigest(data) != digests[name]:
            bad.append(name)
    return len(names), total, bad


class Readers:
    """A pool of reader processes, started once so passes do not time process start-up."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: Pool = multiprocessing.get_context("fork").Pool(workers, initializer=_reader_init)

    def read(self, root: Path, files: Sequence[str], *, seed: int,
             digests: dict[str, int] | None = None) -> PassResult:
        """Read every file once in a shuffled order; verify content if ``digests`` given."""
        order = list(files)
        random.Random(seed).shuffle(order)
        tasks = [(str(root), order[i : i + READ_CHUNK_FILES],
                  {n: digests[n] for n in order[i : i + READ_CHUNK_FILES]} if digests else None)
                 for i in range(0, len(order), READ_CHUNK_FILES)]
        done = total = 0
        bad: list[str] = []
        start = time.perf_counter()
        results = self._pool.imap_unordered(_read_chunk, tasks)
        for _ in tasks:
            remaining = PASS_TIMEOUT_S - (time.perf_counter() - start)
            try:
                n, nbytes, mismatched = results.next(timeout=max(remaining, 0.001))
            except multiprocessing.TimeoutError:
                raise HarnessError(f"reading {root} took longer than {PASS_TIMEOUT_S:.0f} s") from None
            except OSError as exc:
                raise HarnessError(f"reading through {root} failed: {exc}") from None
            done += n
            total += nbytes
            bad += mismatched
        return PassResult(done, total, time.perf_counter() - start, bad)

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()


# -- the page cache --------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Write back and drop the kernel's page, dentry and inode caches; False if not allowed."""
    os.sync()  # drop_caches only drops clean pages
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        return False
    return True


# -- a real mount ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> dict[str, str]:
    """What numbers were measured on: CPUs, RAM, kernel, Python, host."""
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])  # first line: MemTotal in kB (KiB)
    return {"cpus": f"{os.cpu_count()} × {model}", "ram": format_size(mem_kib * 1024, binary=True),
            "kernel": platform.release(), "python": platform.python_version(), "host": platform.node()}


def cli_command() -> list[str]:
    """The installed ``cubefs-fuse`` console script next to this interpreter, else ``-m``."""
    script = Path(sys.executable).with_name("cubefs-fuse")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cubefs_fuse"]


def scrape(port: int) -> dict[str, float]:
    """Every sample of the daemon's /metrics as ``{'name{label="v"}': value}``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError as exc:
        raise HarnessError(f"cannot scrape http://127.0.0.1:{port}/metrics: {exc}") from None
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# tools/slowfs.py is run as ``python -m tools.slowfs`` from the repository root.
REPO = Path(__file__).resolve().parent.parent
# Seconds slowfs gets to unmount after SIGTERM before it is detached and killed.
STOP_TIMEOUT_S = 10.0


class SlowRemote:
    """The remote volume: ``data`` served on ``mount_point`` by tools/slowfs.py (daemonized),
    which delays every operation by ``latency_us`` like a network round trip."""

    def __init__(self, data: Path, mount_point: Path, *, latency_us: int, log_file: Path) -> None:
        self.data = data
        self.mount_point = mount_point
        self.latency_us = latency_us
        self.log_file = log_file
        self.pid: int | None = None
        self._interrupted = False

    def mount(self) -> None:
        self.mount_point.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tools.slowfs", str(self.data), str(self.mount_point),
                   f"--latency-us={self.latency_us}", f"--log-file={self.log_file}"]
        try:
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        except BaseException:
            self._interrupted = True  # the detached daemon may still come up: cleanup() checks
            raise
        if result.returncode != 0 or not result.stdout.strip().isdigit():
            raise HarnessError(f"tools/slowfs.py failed (exit {result.returncode}): "
                               f"{(result.stderr or result.stdout).strip()}")
        self.pid = int(result.stdout.strip())

    def stats(self) -> dict[str, Any]:
        """slowfs's own counters: operations by name, bytes read, delays slept."""
        try:
            result: dict[str, Any] = json.loads((self.mount_point / ".slowfs_stats").read_bytes())
        except (OSError, ValueError) as exc:
            raise HarnessError(f"cannot read the slowfs statistics: {exc}") from None
        return result

    def cleanup(self) -> None:
        """SIGTERM (slowfs unmounts itself); past STOP_TIMEOUT_S, detach the mount and kill."""
        if self._interrupted:
            deadline = time.monotonic() + 5  # interrupted mid-mount: let the daemon show up
            while mounts.find_mount(str(self.mount_point)) is None and time.monotonic() < deadline:
                time.sleep(0.1)
        pid, self.pid = self.pid, None
        if pid is not None and mounts.pid_alive(pid):
            try:
                os.kill(pid, signal.SIGTERM)
                if not mounts.wait_for_exit(pid, STOP_TIMEOUT_S):
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if mounts.find_mount(str(self.mount_point)) is not None:
            # A dead or unknown daemon's mount; a live one exits once its mount is gone.
            subprocess.run(["fusermount3", "-u", "-z", str(self.mount_point)], capture_output=True)


def count_disk_entries(cache_dir: Path) -> int:
    """Entries in a disk tier's segment files: a header (magic ``CFSG``, payload length
    at bytes 8-12, 40 bytes in all) at a 4 KiB-aligned offset, the next entry after the
    payload rounded up to 4 KiB; anything else (a punched hole) is skipped 4 KiB at a
    time.  One small read per entry."""
    count = 0
    try:
        segments = list((cache_dir / "segments").iterdir())
    except FileNotFoundError:
        return 0
    for path in segments:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:
                header = os.pread(fd, 12, offset)
                if header[:4] == b"CFSG":
                    count += 1
                    offset += -(-(40 + int.from_bytes(header[8:12], "little")) // 4096) * 4096
                else:
                    offset += 4096
        finally:
            os.close(fd)
    return count


def _stat_cpu_seconds(stat: str) -> float:
    """User + system seconds in a process's or thread's ``/proc/.../stat`` line."""
    fields = stat.rsplit(")", 1)[1].split()
    # Fields 14 and 15 of proc(5) (utime, stime) in clock ticks; fields[0] is field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSnapshot:
    """A daemon's CPU seconds at one moment (:meth:`DaemonMount.cpu_snapshot`)."""

    total: float  # all its threads, those that ended included
    threads: dict[str, tuple[str, float]]  # per live thread id: its part and its seconds


def cpu_split(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds of each part (CPU_PARTS) between two snapshots of one daemon.  A thread
    counts what it used in between (all of it if it started in between); what threads that
    ended in between used goes to ``other``: the parts add up to the total's difference (a
    few ticks more where each thread's own rounding to a clock tick exceeds the total's),
    never a part below zero."""
    parts = dict.fromkeys(CPU_PARTS, 0.0)
    for tid, (part, seconds) in after.threads.items():
        earlier = before.threads.get(tid)
        parts[part] += max(0.0, seconds - (earlier[1] if earlier is not None and earlier[0] == part else 0.0))
    parts["other"] += max(0.0, after.total - before.total - sum(parts.values()))
    return parts


class DaemonMount:
    """A cubefs-fuse daemon mounted with the real CLI; ``cleanup()`` never leaves it behind."""

    def __init__(self, workdir: Path, source: Path, cache_dir: Path, *, vol_name: str,
                 mem_cache_size: str | int, disk_cache_size: str | int, profile: str = "",
                 echo: bool = False) -> None:
        self.workdir = workdir
        self.source = source
        self.cache_dir = cache_dir
        self.mount_point = workdir / "mnt"
        self.config_path = workdir / "client.json"
        self.log_dir = workdir / "log"
        self.port = free_port()
        self.echo = echo
        self.config: dict[str, Any] = {
            "mountPoint": str(self.mount_point),
            "volName": vol_name,
            "source": str(source),
            "memCacheSize": mem_cache_size,
            "diskCacheDir": str(cache_dir),
            "diskCacheSize": disk_cache_size,
            # No free-space floor: every caller sizes diskCacheSize to its dataset, and what
            # it measures must not change with how full the host's disk is (the default 10 %
            # floor leaves the NVMe tier nothing on a disk with less than 10 % free).
            "diskFreeRatio": 0,
            "exporterPort": self.port,
            "logDir": str(self.log_dir),
        }
        if profile:
            self.config["profile"] = profile
        self.pid: int | None = None
        self._cli_interrupted = False

    def _cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = cli_command() + list(args)
        if self.echo:
            print(f"$ cubefs-fuse {' '.join(args)}", flush=True)
        result = subprocess.run(command, capture_output=True, text=True, timeout=180)
        if self.echo and result.stdout.strip():
            print(f"  {result.stdout.strip()}", flush=True)
        return result

    def mount(self) -> None:
        self.mount_point.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.config, indent=2) + "\n")
        try:
            result = self._cli("mount", "-c", str(self.config_path))
        except BaseException:
            self._cli_interrupted = True  # the daemon may still come up: cleanup() checks
            raise
        if result.returncode != 0:
            raise HarnessError(f"cubefs-fuse mount failed (exit {result.returncode}): "
                               f"{result.stderr.strip()}{self.log_tail()}")
        info = mounts.registered(str(self.mount_point))
        if info is None or not isinstance(info.get("pid"), int):
            raise HarnessError(f"mounted, but no daemon is registered for {self.mount_point}")
        self.pid = int(info["pid"])

    def umount(self) -> None:
        result = self._cli("umount", str(self.mount_point))
        if result.returncode != 0:
            raise HarnessError(f"cubefs-fuse umount failed (exit {result.returncode}): "
                               f"{result.stderr.strip()}{self.log_tail()}")
        self.pid = None

    def cleanup(self) -> None:
        """Unmount whatever is still mounted here (politely, then by force)."""
        if self._cli_interrupted:
            # Interrupted mid-mount: give the detached daemon a moment to show up.
            deadline = time.monotonic() + 5
            while mounts.find_mount(str(self.mount_point)) is None and time.monotonic() < deadline:
                time.sleep(0.1)
        if mounts.find_mount(str(self.mount_point)) is None:
            return
        info = mounts.registered(str(self.mount_point))
        pid = info.get("pid") if info else self.pid
        try:
            if self._cli("umount", str(self.mount_point)).returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            pass
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount_point)], capture_output=True)
        if isinstance(pid, int):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._remove_volume_config(pid)

    def _remove_volume_config(self, pid: int) -> None:
        """Delete the per-volume config file a killed ai_prefetch daemon left in /tmp."""
        path = config_file_path(str(self.config["volName"]))
        try:
            with open(path) as f:
                if json.load(f).get("pid") == pid:
                    os.unlink(path)
        except (OSError, ValueError, AttributeError):
            pass

    def scrape(self) -> dict[str, float]:
        return scrape(self.port)

    def cpu_seconds(self) -> float:
        """User + system CPU time the daemon process (all its threads) has used so far."""
        if self.pid is None:
            raise HarnessError("the daemon is not mounted")
        with open(f"/proc/{self.pid}/stat") as f:
            return _stat_cpu_seconds(f.read())

    def cpu_snapshot(self) -> CpuSnapshot:
        """The daemon's CPU seconds so far, in all and per thread with its part (CPU_PARTS):
        ``session``, the C FUSE session's threads (named ``cfs-*``); ``trio``, the main
        thread; ``workers``, trio's worker threads (``Trio thread N``: the backend's calls,
        the NVMe reads and writes); ``other``, any other thread.  :func:`cpu_split` turns
        two snapshots into the seconds of each part between them."""
        total = self.cpu_seconds()
        assert self.pid is not None  # cpu_seconds raised otherwise
        threads: dict[str, tuple[str, float]] = {}
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # ended meanwhile: its time is in the total
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            part = ("trio" if tid == str(self.pid) else "session" if comm.startswith("cfs-")
                    else "workers" if comm.startswith("Trio thread") else "other")
            threads[tid] = (part, _stat_cpu_seconds(stat))
        return CpuSnapshot(total, threads)

    def wait_for_disk_blocks(self, blocks: int, timeout: float = 60.0) -> bool:
        """Wait until ``blocks`` blocks are on NVMe (the write-behind has finished).

        Counts the entries of the documented cache layout (``segments/<hex>.seg``, see
        docs/on-disk.md) instead of polling /metrics, so that waiting costs the
        daemon no CPU time (benchmarks charge the daemon's CPU time to each pass).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if count_disk_entries(self.cache_dir) >= blocks:
                return True
            time.sleep(0.05)
        return False

    def log_tail(self, lines: int = 15) -> str:
        logs = sorted(self.log_dir.glob("*.log")) if self.log_dir.is_dir() else []
        text = "".join(p.read_text(errors="replace") for p in logs).splitlines()[-lines:]
        return ("\n--- daemon log (last lines) ---\n" + "\n".join(text)) if text else ""


# -- metrics arithmetic ----------------------------------------------------------------


@dataclass(frozen=True)
class CacheDelta:
    """What the daemon counted between two scrapes."""

    lookups: int
    reads: int
    ram_hits: int
    disk_hits: int
    misses: int
    served_ram: int
    served_disk: int
    served_backend: int
    backend_bytes: int


def cache_delta(before: dict[str, float], after: dict[str, float]) -> CacheDelta:
    def d(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    return CacheDelta(
        lookups=d("cubefs_fuse_lookups_total"),
        reads=d("cubefs_fuse_reads_total"),
        ram_hits=d('cubefs_fuse_cache_hits_total{tier="ram"}'),
        disk_hits=d('cubefs_fuse_cache_hits_total{tier="disk"}'),
        misses=d("cubefs_fuse_cache_misses_total"),
        served_ram=d('cubefs_fuse_served_bytes_total{source="ram"}'),
        served_disk=d('cubefs_fuse_served_bytes_total{source="disk"}'),
        served_backend=d('cubefs_fuse_served_bytes_total{source="backend"}'),
        backend_bytes=d("cubefs_fuse_backend_read_bytes_total"),
    )


# -- process hygiene -------------------------------------------------------------------


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks clean up on ``kill`` too."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_workdir(workdir: Path, *mount_points: Path) -> None:
    """Delete the scratch directory, never through a mount that is still live."""
    for mount_point in mount_points:
        if mounts.find_mount(str(mount_point)) is not None:
            print(f"warning: {mount_point} is still mounted; leaving {workdir} in place", file=sys.stderr)
            return
    shutil.rmtree(workdir, ignore_errors=True)
