"""Helpers the tests import (fixtures live in tests/conftest.py): running the CLI, waiting,
real daemons on real mounts (:class:`Mount`) and their metrics."""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse import mounts
from cubefs_fuse.control.protocol import VolumeConfig, config_file_path
from tests import daemon_logs
from tools import harness
from tools.harness import free_port as free_port  # re-exported for the tests

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cubefs-fuse ARGS`` as a real subprocess."""
    return subprocess.run([sys.executable, "-m", "cubefs_fuse", *args], capture_output=True, text=True,
                          timeout=timeout, check=check, cwd=REPO)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


# -- real daemons on real FUSE mounts (the make_mount and make_slow_mount fixtures) -----------


@dataclass
class Mount:
    """A daemon started with ``cubefs-fuse mount`` on a real FUSE mount point."""

    base: Path
    source: Path
    mount_point: Path
    cache_dir: Path
    config_path: Path
    port: int
    overrides: dict[str, Any] = field(default_factory=dict)
    mounted: bool = False

    def config(self) -> dict[str, Any]:
        """The client config; whatever starts a daemon from it (mount(), a test's own
        ``cubefs-fuse mount --foreground``, a systemd unit) has its log checked after the
        test (tests/daemon_logs.py)."""
        config = {
            "mountPoint": str(self.mount_point),
            "volName": f"test{self.port}",
            "source": str(self.source),
            "diskCacheDir": str(self.cache_dir),
            "exporterPort": self.port,
            "logDir": str(self.base / "log"),
            "logLevel": "debug",
            # No free-space floor unless a test sets one: the NVMe tier's tests must not depend
            # on how full the host's disk is (the default 10 % floor empties the tier on a disk
            # with less than 10 % free; tests/mounted/test_disk_tier_full_fs.py tests the floor).
            "diskFreeRatio": 0,
            **self.overrides,
        }
        daemon_logs.watch(Path(config["logDir"]))
        return config

    def mount(self) -> None:
        self.config_path.write_text(json.dumps(self.config()))
        result = cli("mount", "-c", str(self.config_path))
        assert result.returncode == 0, f"mount failed: {result.stderr}\n{self.log()}"
        self.mounted = True

    def umount(self) -> None:
        if self.mounted:
            result = cli("umount", str(self.mount_point))
            assert result.returncode == 0, f"umount failed: {result.stderr}\n{self.log()}"
            self.mounted = False

    def pid(self) -> int:
        info = mounts.registered(str(self.mount_point))
        assert info is not None, "daemon not registered"
        return int(info["pid"])

    def log(self) -> str:
        logs = list((self.base / "log").glob("*.log"))
        return "\n".join(p.read_text(errors="replace")[-20000:] for p in logs)

    def scrape(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v",...}': value}."""
        return harness.scrape(self.port)

    def path(self, relative: str) -> Path:
        return self.mount_point / relative


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """One sample of ``Mount.scrape()`` by name and labels; 0 if the daemon has not emitted it."""
    if labels:
        name += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return samples.get(name, 0.0)


def nvme_written(m: Mount) -> None:
    """Wait until ``m``'s daemon has no NVMe write-behind pending: every block it fetched is
    on NVMe (what a daemon killed after this leaves for the next one)."""
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_disk_pending_write_bytes") == 0, 30, "the NVMe writes to drain")


def force_unmount(m: Mount) -> None:
    """Kill ``m``'s daemon and detach its mount if it is still there (teardown after a
    failure); `cubefs-fuse umount --lazy` then removes the files the killed daemon left
    (sockets, token, registry entry, volume file: tests/conftest.py fails a run that leaves any)."""
    info = mounts.registered(str(m.mount_point))
    if mounts.find_mount(str(m.mount_point)) is None and info is None:
        return
    if info:
        kill_for_good(info)
    result = cli("umount", "--lazy", str(m.mount_point))
    if result.returncode != 0 and mounts.find_mount(str(m.mount_point)) is not None:
        subprocess.run(["fusermount3", "-u", "-z", str(m.mount_point)], capture_output=True)
    m.mounted = False


def waits_on_fuse(pid: int) -> bool:
    """Whether a thread of process ``pid`` waits for a FUSE daemon's answer (in the kernel's
    request_wait_answer)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text() == "request_wait_answer":
                return True
        except OSError:
            continue  # the thread ended meanwhile
    return False


def kill_daemon(m: Mount, after_death: Callable[[], object] | None = None) -> int:
    """SIGKILL ``m``'s daemon (not its keeper); the pid of the daemon that recovers the mount,
    once it is registered (it serves from then on).  ``after_death`` runs once the old
    daemon is gone, before the wait (e.g. to let a hung source answer the new one)."""
    old = m.pid()
    os.kill(old, 9)
    assert mounts.wait_for_exit(old, timeout=30)
    if after_death is not None:
        after_death()
    wait_until(lambda: (mounts.registered(str(m.mount_point)) or {}).get("pid") not in (None, old), 60,
               "a daemon recovering the mount")
    return m.pid()


def kill_for_good(info: dict[str, Any]) -> None:
    """SIGKILL a mount's keeper, then its daemon (registry entry ``info``): the mount is
    left stale (ENOTCONN), as after a crash of the whole node's service.  The daemon alone
    would be recovered by its keeper."""
    for key in ("keeper", "pid"):
        pid = int(info.get(key) or 0)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            mounts.wait_for_exit(pid, timeout=10)


@dataclass
class SlowMount:
    """A Mount whose source is a slowfs mount (the emulated remote) of the directory ``real``."""

    mount: Mount
    real: Path  # the files behind slowfs: tests create, change and delete them here
    slowfs: Any  # tools.slowfs.SlowFSProcess


# -- files and processes -------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, bytes]) -> dict[str, bytes]:
    """Write ``files`` ({relative path: content}) under ``root``, making directories; returns ``files``."""
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def stat_tree(root: Path) -> dict[str, os.stat_result]:
    """``os.lstat`` of every directory, file and link under ``root``, by relative path."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            found[str(path.relative_to(root))] = os.lstat(path)
    return found


def allocated_on_disk(cache_dir: Path) -> int:
    """Bytes the filesystem has allocated to a disk tier's segment files and their
    directory ``segments/``, summed file by file.

    Not atomic: a segment deleted after it was counted and another written before the
    walk ends are both counted, so under churn this may exceed what was on disk at any
    one instant.  For one consistent state, walk inside ``DiskTier.io_paused()``.
    """
    segments = cache_dir / "segments"
    try:
        total = os.lstat(segments).st_blocks * 512
        names = os.listdir(segments)
    except FileNotFoundError:
        return 0
    for name in names:
        try:
            total += os.lstat(segments / name).st_blocks * 512
        except FileNotFoundError:
            pass  # deleted while we looked
    return total


def resident_pages(path: Path) -> int:
    """How many of a file's pages are in the page cache (mincore on a private read mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))  # (the export ends with the statement)
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector)


def damage_block(cache_dir: Path, key: bytes, at: int) -> None:
    """Flip one byte of ``key``'s payload (at ``at``; from its end if negative) in a disk
    tier's segment files (the layout documented in cubefs_fuse/cache/disk.py: entries at
    4 KiB-aligned offsets, a header of magic, format, reserved, payload length, key...)."""
    for segment in sorted((cache_dir / "segments").iterdir()):
        with open(segment, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            for offset in range(0, size, 4096):
                f.seek(offset)
                header = f.read(28)
                if header[:4] == b"CFSG" and header[12:28] == key:
                    length = int.from_bytes(header[8:12], "little")
                    where = offset + 40 + (at if at >= 0 else length + at)
                    f.seek(where)
                    byte = f.read(1)
                    f.seek(where)
                    f.write(bytes([byte[0] ^ 0x40]))
                    return
    raise AssertionError(f"no entry of {key.hex()} in {cache_dir}")


def block_key(i: int) -> bytes:
    """Cache key number ``i`` (16 bytes, like the keys the block cache makes)."""
    return i.to_bytes(16, "big")


def block_payload(i: int, size: int) -> bytes:
    """``size`` bytes of content for block ``i``: the same bytes on every call."""
    return random.Random(i).randbytes(size)


def write_volume_config(directory: Path, vol: str, mode: int = 0o644, **changes: Any) -> Path:
    """A daemon's per-volume config file for ``vol`` in ``directory`` (``changes`` to its
    fields applied), with permissions ``mode``; returns its path."""
    config = VolumeConfig(prof=0, mount_point="/mnt/x", vol_name=vol, local_ip="127.0.0.1",
                          control_socket="/run/x.sock", pid=1)
    data = json.loads(config.to_json())
    data.update(changes)
    path = Path(config_file_path(vol, str(directory)))
    path.write_text(json.dumps(data))
    os.chmod(path, mode)
    return path


def owned_by_another_user(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Make ``path`` belong to another user, neither root nor us, as this process sees it;
    returns that user's uid.  Root gives the file to nobody (65534); anyone else cannot give
    a file away, so this process pretends to be another non-root user instead
    (``os.geteuid`` patched until the test ends)."""
    me = os.geteuid()
    if me == 0:
        os.chown(path, 65534, 65534)
        return 65534
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    return me


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(proc.stdout)
