"""The per-volume config file on the daemon's side: claimed at start (a file naming a live
daemon refuses a second one, a dead one's is taken over), written atomically, removed at
exit. The directory is shared (``/tmp``), so only a regular file owned by root or us and
writable by nobody else is read as a claim; any other entry is never followed and is
replaced, and the temp file has an unpredictable name created with O_EXCL|O_NOFOLLOW
(docs/contracts.md, "The per-volume file in a shared directory")."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import stat

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


# Attempts at replacing the file when another user keeps planting entries in the way; each
# attempt removes what was planted, so only a user racing us in a loop exhausts them.
_WRITE_ATTEMPTS = 5


def _trusted(st: os.stat_result) -> bool:
    """A file that can only come from us or root: regular, theirs, not writable by others."""
    return (stat.S_ISREG(st.st_mode) and st.st_uid in (0, os.geteuid())
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _read_claim(path: str) -> tuple[os.stat_result, int] | None:
    """(lstat, pid named) of the entry at ``path``; pid 0 if it is not a trusted claim.
    None if there is nothing there.  Never follows a symlink, never blocks on a FIFO."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not _trusted(st):
        return st, 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return st, 0
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or not _trusted(opened):
            return opened, 0  # replaced between lstat and open
        data = json.loads(os.read(fd, 65536))
        pid = data.get("pid", 0) if isinstance(data, dict) else 0
        return opened, pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 22 else 0
    except (OSError, ValueError, RecursionError):
        return opened, 0
    finally:
        os.close(fd)


def _clear(path: str, st: os.stat_result) -> None:
    """Remove the entry at ``path`` (not followed).  A directory is renamed aside to an
    unpredictable name next to it (its content is someone else's; nothing is deleted).  In a
    sticky directory (/tmp) only root, the entry's owner or the directory's owner may do
    this: anyone else gets a ConfigError naming the entry."""
    try:
        if stat.S_ISDIR(st.st_mode):
            aside = f"{path}.planted-{secrets.token_hex(8)}"
            os.rename(path, aside)
            log.warning("moved the directory %s (owner uid %d) planted at the volume config's path to %s",
                        path, st.st_uid, aside)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"key 'configDir': cannot replace {path} (owner uid {st.st_uid}): {exc.strerror}; "
                          "remove it or choose another configDir") from None


def claim(vol_name: str, config_dir: str) -> None:
    """Refuse to start if a live daemon serves this volume; clear anything else at the path.

    Only a trusted file (:func:`_trusted`) is read as a claim.  A file, symlink, directory
    or anything else another user put there is not followed, not believed, and removed.
    """
    path = config_file_path(vol_name, config_dir)
    found = _read_claim(path)
    if found is None:
        return
    st, pid = found
    if pid and pid != os.getpid() and mounts.pid_alive(pid):
        raise ConfigError(f"key 'volName': volume {vol_name!r} is already served by daemon pid {pid} ({path})")
    if _trusted(st):
        log.warning("taking over %s left by a daemon that is gone (pid %s)", path, pid or "unknown")
    else:
        log.warning("replacing %s: a %s owned by uid %d, mode %o, that no daemon of ours wrote",
                    path, _kind(st), st.st_uid, stat.S_IMODE(st.st_mode))
    _clear(path, st)


def _kind(st: os.stat_result) -> str:
    for test, name in ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISREG, "file")):
        if test(st.st_mode):
            return name
    return "special file"


def write(config: VolumeConfig, config_dir: str) -> str:
    """Write the file atomically: a temp file with an unpredictable name, created with
    O_EXCL|O_NOFOLLOW in the same directory, renamed over whatever is at the path (a
    symlink is replaced, not followed; a directory is moved aside first)."""
    path = config_file_path(config.vol_name, config_dir)
    data = config.to_json().encode()
    for _ in range(_WRITE_ATTEMPTS):
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            try:
                os.write(fd, data)
                os.fchmod(fd, 0o644)  # not subject to the umask
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            return path
        except (IsADirectoryError, NotADirectoryError, PermissionError) as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if isinstance(exc, PermissionError) and _trusted(st):
                raise
            _clear(path, st)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    raise ConfigError(f"key 'configDir': {path} keeps being replaced by another user; choose another configDir")


def remove(vol_name: str, config_dir: str, pid: int | None = None) -> bool:
    """Remove the file if it is still the one daemon ``pid`` (default: this process) wrote
    (a trusted file naming it); True if removed."""
    path = config_file_path(vol_name, config_dir)
    found = _read_claim(path)
    if found is not None and _trusted(found[0]) and found[1] == (os.getpid() if pid is None else pid):
        with contextlib.suppress(OSError):
            os.unlink(path)
            return True
    return False
