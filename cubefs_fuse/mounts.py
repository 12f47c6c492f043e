"""Mount-point bookkeeping: the kernel's mount table, stale mounts, connection tuning and
the runtime registry, which holds one JSON file per live daemon (pid, mount point, volume,
config path) so that ``umount`` can wait for the daemon and tools can list every mount
without scanning processes."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cubefs_fuse.errors import ConfigError

log = logging.getLogger(__name__)

FUSE_SUBTYPE = "cubefs-fuse"
# Asynchronous FUSE requests (reads, readahead) the kernel lets reach the daemon at once.
# The kernel default of 12 serialises DataLoaders with many workers; 64 measured
# +40-75 % with >= 64 readers (2026-11-21, 350266a), and the kernel queues what the daemon has not read yet.
FUSE_MAX_BACKGROUND = 64
# Readahead window for files on the mount: 1 MiB matched the default block size and
# measured +34 % on files >= 1 MB (2026-11-21, 350266a); small files are unaffected.
FUSE_READ_AHEAD_KB = 1024


# Where daemons started by root (systemd, Kubernetes) register; other users' tools look here too.
SYSTEM_RUNTIME_DIR = "/run/cubefs-fuse"


def runtime_dir() -> str:
    if os.geteuid() == 0:
        return SYSTEM_RUNTIME_DIR
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/cubefs-fuse-{os.geteuid()}"
    return os.path.join(base, "cubefs-fuse") if "XDG_RUNTIME_DIR" in os.environ else base


def control_socket_path(vol_name: str, configured: str = "") -> str:
    """A daemon's control socket: ``controlSocket`` if configured, else <runtime dir>/<volName>.sock."""
    return configured or os.path.join(runtime_dir(), f"{vol_name}.sock")


def data_socket_path(control_socket: str) -> str:
    """The fast path's data socket (ai_prefetch), beside the control socket."""
    return control_socket + ".data"


def handover_socket_path(control_socket: str) -> str:
    """Where a running daemon takes a successor's request for its mount (control/handover.py)."""
    return control_socket + ".handover"


def unlink_if_same(path: str, inode: int) -> None:
    """Remove the socket a process bound at ``path`` (inode ``inode``) when it stops listening,
    unless another process has replaced it since (a new daemon or keeper of the volume)."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def token_file_path(vol_name: str) -> str:
    """The bearer token of the loopback control port (profPort)."""
    return os.path.join(runtime_dir(), f"{vol_name}.token")


# How long a check waits for a Unix socket's listener to take a connection: a live daemon's
# kernel queue accepts at once (no round trip through its event loop); a full queue, which
# makes connect() wait, is a live daemon too.
SOCKET_PROBE_SECONDS = 1.0


def socket_in_use(path: str) -> bool:
    """True if a process listens on the Unix socket at ``path``; a socket file left by a
    dead process refuses the connection (ECONNREFUSED), a missing one is ENOENT.  A
    listener of another type (the SOCK_SEQPACKET data socket) answers EPROTOTYPE."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(SOCKET_PROBE_SECONDS)
        try:
            probe.connect(path)
        except (TimeoutError, BlockingIOError):
            return True
        except OSError as exc:
            return exc.errno == errno.EPROTOTYPE
    return True


@dataclass(frozen=True, slots=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str
    minor: int  # the device minor, which names the FUSE connection in /sys


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def mount_table() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            minor = int(fields[2].split(":")[1])
            entries.append(MountEntry(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]), minor))
    return entries


def find_mount(mount_point: str) -> MountEntry | None:
    target = os.path.abspath(mount_point)
    for entry in reversed(mount_table()):
        if entry.mount_point == target:
            return entry
    return None


def is_stale(mount_point: str) -> bool:
    """True if a FUSE daemon that served ``mount_point`` is gone (ENOTCONN)."""
    try:
        # statfs always reaches the daemon; stat() is answered from the kernel's attribute
        # cache (attrValid, 30 s by default) and would call a dead mount alive.
        os.statvfs(mount_point)
    except OSError as exc:
        # ECONNABORTED: the request was queued while the dying daemon's last thread still
        # held /dev/fuse open, and the kernel aborted the connection under it.
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def lazy_unmount(mount_point: str) -> None:
    result = subprocess.run(["fusermount3", "-u", "-z", mount_point], capture_output=True, text=True)
    if result.returncode != 0 and find_mount(mount_point) is not None:
        result = subprocess.run(["umount", "-l", mount_point], capture_output=True, text=True)
    if find_mount(mount_point) is not None:
        raise ConfigError(f"cannot clear the stale mount on {mount_point!r}: {result.stderr.strip()}")


def prepare_mount_point(mount_point: str) -> bool:
    """Recover a mount point left by a crashed daemon; True if one was recovered.

    A live mount (of anything) on the mount point is an error: we never stack mounts.
    """
    entry = find_mount(mount_point)
    if entry is None:
        return False
    if is_stale(mount_point):
        log.warning("%s: mount left by a dead daemon; lazily unmounting it", mount_point)
        lazy_unmount(mount_point)
        return True
    raise ConfigError(f"key 'mountPoint': {mount_point!r} is already mounted ({entry.fstype} from {entry.source})")


def tune_connection(mount_point: str) -> None:
    """Raise the kernel's FUSE limits for this connection (root only; best effort).

    Reads the mount table rather than stat()ing the mount point: a stat would be a FUSE
    request to this very daemon and deadlock before its loop runs.
    """
    entry = find_mount(mount_point)
    if entry is None:
        return
    minor = entry.minor
    settings = {
        f"/sys/fs/fuse/connections/{minor}/max_background": FUSE_MAX_BACKGROUND,
        # Congestion starts at 3/4 of max_background, the kernel's own default ratio.
        f"/sys/fs/fuse/connections/{minor}/congestion_threshold": FUSE_MAX_BACKGROUND * 3 // 4,
        f"/sys/class/bdi/0:{minor}/read_ahead_kb": FUSE_READ_AHEAD_KB,
    }
    for path, value in settings.items():
        try:
            with open(path, "w") as f:
                f.write(str(value))
        except OSError as exc:
            log.debug("could not set %s: %s", path, exc)


# -- runtime registry -----------------------------------------------------------------


def _registry_path(mount_point: str) -> str:
    digest = hashlib.sha256(os.path.abspath(mount_point).encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(), f"mount-{digest}.json")


def register(mount_point: str, info: dict[str, Any]) -> None:
    os.makedirs(runtime_dir(), mode=0o755, exist_ok=True)
    path = _registry_path(mount_point)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"mountPoint": os.path.abspath(mount_point), "pid": os.getpid(), **info}, f)
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)


def unregister(mount_point: str, pid: int | None = None) -> None:
    """Remove the entry if daemon ``pid`` (default: this process) wrote it."""
    try:
        with open(_registry_path(mount_point)) as f:
            if json.load(f).get("pid") != (os.getpid() if pid is None else pid):
                return  # a newer daemon owns the entry
        os.unlink(_registry_path(mount_point))
    except (OSError, ValueError):
        pass


def _registry_dirs() -> list[str]:
    """Our own runtime directory, then root's (a user's tools must see system daemons)."""
    return list(dict.fromkeys([runtime_dir(), SYSTEM_RUNTIME_DIR]))


def _read_entry(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def registered(mount_point: str) -> dict[str, Any] | None:
    name = os.path.basename(_registry_path(mount_point))
    for directory in _registry_dirs():
        info = _read_entry(os.path.join(directory, name))
        if info is not None:
            return info
    return None


def _entries() -> Iterator[dict[str, Any]]:
    """Every registry entry (live and dead daemons), our own directory first."""
    for directory in _registry_dirs():
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.startswith("mount-") and name.endswith(".json"):
                info = _read_entry(os.path.join(directory, name))
                if info is not None and isinstance(info.get("mountPoint"), str):
                    yield info


def serving(vol_name: str) -> dict[str, Any] | None:
    """The registry entry of a live daemon (not this process) serving volume ``vol_name``."""
    for info in _entries():
        pid = info.get("pid")
        if info.get("volName") == vol_name and isinstance(pid, int) and pid != os.getpid() and pid_alive(pid):
            return info
    return None


@dataclass(frozen=True, slots=True)
class MountState:
    """One cubefs-fuse mount point as ``status`` sees it."""

    mount_point: str
    info: dict[str, Any] | None  # the daemon's registry entry, None if it left none
    state: str  # "live", "stale" (mounted, daemon gone) or "leftover" (not mounted, entry of a dead daemon)


def survey() -> list[MountState]:
    """Every cubefs-fuse mount on the node, live or left behind by a crashed daemon.

    The union of the registry (daemons' own entries, dead ones included) and the kernel's
    mount table (``fuse.cubefs-fuse`` entries, whose daemon may have left no entry)."""
    entries: dict[str, dict[str, Any]] = {}
    for entry in _entries():
        entries.setdefault(entry["mountPoint"], entry)
    mounted = {e.mount_point for e in mount_table() if e.fstype == f"fuse.{FUSE_SUBTYPE}"}
    found = []
    for mount_point in sorted(set(entries) | mounted):
        info = entries.get(mount_point)
        alive = info is not None and isinstance(info.get("pid"), int) and pid_alive(info["pid"])
        state = "live" if alive else "stale" if mount_point in mounted else "leftover"
        found.append(MountState(mount_point, info, state))
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)
