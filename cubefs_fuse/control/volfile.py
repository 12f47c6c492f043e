"""The per-volume config file (DESIGN.md 2.2): written atomically, owned, removed at exit.

One daemon per volume name: a file naming a live daemon makes a second one refuse to
start; a file left by a dead daemon is taken over.
"""

from __future__ import annotations

import json
import logging
import os
import socket

from cubefs_fuse import mounts
from cubefs_fuse.errors import ConfigError
from cubefs_fuse.control.protocol import VolumeConfig, config_file_path

log = logging.getLogger(__name__)


def local_ip() -> str:
    """The address other nodes would reach us on (CubeFS's ``local_ip``), loopback if none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            # connect() on UDP sends nothing; it only selects the outgoing interface.
            s.connect(("192.0.2.1", 9))  # TEST-NET-1, never routed anywhere
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def claim(vol_name: str, config_dir: str) -> None:
    """Refuse to start if a live daemon serves this volume; clear a dead one's file."""
    path = config_file_path(vol_name, config_dir)
    try:
        with open(path) as f:
            pid = int(json.load(f).get("pid", 0))
    except FileNotFoundError:
        return
    except (OSError, ValueError, AttributeError):
        pid = 0
    if pid and pid != os.getpid() and mounts.pid_alive(pid):
        raise ConfigError(f"key 'volName': volume {vol_name!r} is already served by daemon pid {pid} ({path})")
    log.warning("taking over %s left by a daemon that is gone (pid %s)", path, pid or "unknown")
    os.unlink(path)


def write(config: VolumeConfig, config_dir: str) -> str:
    path = config_file_path(config.vol_name, config_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, config.to_json().encode())
        os.fchmod(fd, 0o644)  # not subject to the umask
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return path


def remove(vol_name: str, config_dir: str) -> None:
    path = config_file_path(vol_name, config_dir)
    try:
        with open(path) as f:
            if int(json.load(f).get("pid", 0)) != os.getpid():
                return  # not ours any more
        os.unlink(path)
    except (OSError, ValueError):
        pass
