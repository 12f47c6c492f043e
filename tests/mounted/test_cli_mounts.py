"""The command line where a mount is involved: mistakes found on a read-only filesystem
(a tmpfs) or after the kernel mount was made, umount of a foreign mount, and commands
against a live daemon.  The mistakes caught before mounting are in tests/component/test_cli.py;
the failure contract itself is in tests/cli_checks.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from cubefs_fuse import mounts
from cubefs_fuse.config import user_allow_other
from tests.cli_checks import ERROR, FOREGROUND, Env, assert_one_line_error, daemons_using, leftovers, readonly_tmpfs
from tests.helpers import REPO, Mount, cli, free_port, kill_for_good


# -- mistakes that need a real mount to find ---------------------------------------------


@FOREGROUND
def test_cache_dir_on_a_readonly_filesystem(env: Env, foreground: bool) -> None:
    with readonly_tmpfs(env.base / "ro") as ro:
        # The directory exists but cannot be written (root's os.access() would say yes).
        env.write(diskCacheDir=str(ro))
        assert env.fails(foreground=foreground) == (
            f"key 'diskCacheDir': {str(ro)!r} is not writable: Read-only file system")
        # The directory would have to be created on the read-only filesystem.
        env.write(diskCacheDir=str(ro / "cache"))
        assert env.fails(foreground=foreground) == (
            f"key 'diskCacheDir': cannot create {str(ro / 'cache')!r}: Read-only file system")


def test_exporter_port_in_use(env: Env) -> None:
    # Fails inside the daemon after the kernel mount was made: it must be taken down again.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env.write(exporterPort=port)
        message = env.fails()
    assert message.startswith(f"key 'exporterPort': cannot listen on 127.0.0.1:{port}: Address already in use")


def test_umount_of_a_foreign_mount(tmp_path: Path) -> None:
    with readonly_tmpfs(tmp_path / "ro") as ro:
        result = cli("umount", str(ro))
        assert result.stderr.splitlines() == [f"{ERROR}{ro} is not a cubefs-fuse mount (tmpfs)"]
        assert result.returncode == 2
        assert mounts.find_mount(str(ro)) is not None, "umount must not touch a foreign mount"


# -- against a live daemon ----------------------------------------------------------------


def test_second_mount_on_a_mounted_mount_point(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    (m.source / "f.txt").write_text("live")
    m.mount()
    pid = m.pid()
    result = cli("mount", "-c", str(m.config_path))
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"{ERROR}key 'mountPoint': {str(m.mount_point)!r} is already mounted "
        f"(fuse.cubefs-fuse from cubefs-fuse:{m.config()['volName']})"]
    assert result.returncode == 2
    # The live mount is untouched: same daemon, still serving, mounted once.
    assert m.pid() == pid and mounts.pid_alive(pid)
    keeper = mounts.registered(str(m.mount_point))["keeper"]  # type: ignore[index]
    # The helper the failure checks rely on sees daemons, their keepers and standbys.
    assert {keeper, pid} <= set(daemons_using(m.config_path)) and len(daemons_using(m.config_path)) <= 3
    assert m.path("f.txt").read_text() == "live"
    assert [e.mount_point for e in mounts.mount_table()].count(str(m.mount_point)) == 1
    m.umount()


def test_second_daemon_of_a_live_volume_is_refused_before_it_writes(make_mount: Callable[..., Mount],
                                                                     tmp_path: Path) -> None:
    m = make_mount()
    (m.source / "f.txt").write_text("live")
    m.mount()
    pid, vol = m.pid(), m.config()["volName"]
    log_file = m.base / "log" / f"{vol}.log"
    log_before = log_file.read_bytes()
    # The same volume on another mount point, cache dir and port, logging into the same
    # directory: its log file would be the live daemon's.
    other = Env(tmp_path / "other")
    other.config.update(volName=vol, logDir=str(m.base / "log"))
    other.write()
    message = other.fails()
    assert message == (f"key 'volName': volume {vol!r} is already served by daemon pid {pid} on {m.mount_point} "
                       f"(unmount it first: cubefs-fuse umount {m.mount_point})")
    # Refused before writing anything: no line in the live daemon's log, no cache dir made.
    assert log_file.read_bytes() == log_before
    assert not (other.base / "cache").exists()
    # The live daemon keeps its control socket (a second daemon would have replaced it).
    status = cli("status", str(m.mount_point), "--json")
    assert status.returncode == 0 and json.loads(status.stdout)[0]["control_api"], status.stderr
    assert m.path("f.txt").read_text() == "live"
    m.umount()


def test_second_daemon_on_the_same_cache_dir(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    m = make_mount()
    (m.source / "f.txt").write_text("live")
    m.mount()
    other = Env(tmp_path / "other")
    other.config["diskCacheDir"] = str(m.cache_dir)
    other.write()
    message = other.fails()
    assert message.startswith(
        f"key 'diskCacheDir': {str(m.cache_dir)!r} is in use by another cubefs-fuse daemon (pid {m.pid()})")
    assert m.path("f.txt").read_text() == "live"
    m.umount()


def test_block_size_change_on_a_filled_cache_is_refused(make_mount: Callable[..., Mount]) -> None:
    # Block i of a file means other bytes under another block size: serving the cached
    # blocks would return wrong data, so the mount is refused until the config is fixed.
    m = make_mount(blockSize=8192)
    data = os.urandom(3 * 8192 + 100)  # four blocks of 8 KiB, two of 16 KiB
    (m.source / "f.bin").write_bytes(data)
    m.mount()
    assert m.path("f.bin").read_bytes() == data
    m.umount()
    m.overrides["blockSize"] = 16384
    m.config_path.write_text(json.dumps(m.config()))
    message = assert_one_line_error(cli("mount", "-c", str(m.config_path)), m.mount_point, m.config_path)
    assert message.startswith(f"key 'blockSize': 16384 differs from the 8192 bytes the cache in {str(m.cache_dir)!r}")
    m.overrides["blockSize"] = 8192
    m.mount()
    assert m.path("f.bin").read_bytes() == data
    m.umount()


def test_cubefs_client_config_mounts_and_reports_unused_keys_once(make_mount: Callable[..., Mount]) -> None:
    example = json.loads((REPO / "configs" / "cubefs-compatible.json").read_text())
    # Keep the CubeFS settings, point the paths and ports at this test's directories.
    cubefs_keys = {k: v for k, v in example.items()
                   if k not in {"mountPoint", "source", "logDir", "exporterPort", "profPort", "logLevel"}}
    m = make_mount(**cubefs_keys)
    (m.source / "f.txt").write_text("cubefs")
    m.mount()
    assert m.path("f.txt").read_text() == "cubefs"
    m.umount()
    log = m.log()
    for key in ("masterAddr", "consulAddr", "rdonly", "enablePosixACL", "icacheTimeout"):
        assert log.count(f"config key {key!r} is a CubeFS setting with no effect here") == 1, key


# -- a failed start leaves nothing behind; the log file is private --------------------------


def test_a_start_that_fails_after_the_control_api_opened_leaves_nothing(env: Env) -> None:
    # ai_prefetch with profPort: the socket, the token file, the registry entry and the kernel
    # mount exist before the exporter fails to listen; all of them must go again.
    cfg = env.base / "cfg"
    cfg.mkdir()
    vol = f"leftover{os.getpid()}"
    overrides = {"profile": "ai_prefetch", "volName": vol, "configDir": str(cfg), "profPort": free_port(),
                 "controlSocket": str(env.base / "ctl.sock")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env.write(exporterPort=taken.getsockname()[1], **overrides)
        message = env.fails()
    assert message.startswith("key 'exporterPort': cannot listen on")
    config = {**env.config, **overrides}
    assert leftovers(config) == []
    assert not list(cfg.iterdir()) and not list(Path(mounts.runtime_dir()).glob(f"{vol}.*"))

    # The same config with a free port mounts; the daemon's log file is private (it names
    # the files applications read), and at exit the token file goes with the daemon.
    env.write(**overrides)
    result = cli("mount", "-c", str(env.config_path))
    assert result.returncode == 0, result.stderr
    try:
        token_file = Path(mounts.runtime_dir()) / f"{vol}.token"
        # The control, data and handover sockets, the keeper's, the token, the volume file and the registry entry.
        assert token_file.exists() and len(leftovers(config)) == 7, leftovers(config)
        log_file = env.base / "log" / f"{vol}.log"
        assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    finally:
        assert cli("umount", str(env.mount_point)).returncode == 0
    assert leftovers(config) == []


def test_an_old_world_readable_log_file_is_made_private(env: Env) -> None:
    log_file = env.base / "log" / "clitest.log"
    log_file.parent.mkdir()
    log_file.write_text("old lines\n")
    os.chmod(log_file, 0o644)
    env.write()
    result = cli("mount", "-c", str(env.config_path))
    assert result.returncode == 0, result.stderr
    try:
        assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
        assert log_file.read_text().startswith("old lines\n")  # appended to, not replaced
    finally:
        assert cli("umount", str(env.mount_point)).returncode == 0


def test_umount_lazy_after_kill_9_leaves_nothing(env: Env) -> None:
    # Every file a daemon has in shared places (ai_prefetch with profPort has them all).
    cfg = env.base / "cfg"
    cfg.mkdir()
    vol = f"killed{os.getpid()}"
    env.write(profile="ai_prefetch", volName=vol, configDir=str(cfg), profPort=free_port())
    config = json.loads(env.config_path.read_text())
    assert cli("mount", "-c", str(env.config_path)).returncode == 0
    info = mounts.registered(str(env.mount_point))
    assert info is not None and len(leftovers(config)) == 7, leftovers(config)
    kill_for_good(info)
    result = cli("umount", "--lazy", str(env.mount_point))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"cubefs-fuse: unmounted {env.mount_point}\n"
    assert leftovers(config) == []
    assert mounts.find_mount(str(env.mount_point)) is None
    assert str(env.mount_point) not in cli("status").stdout


# -- as a user who is not root -------------------------------------------------------------

NOBODY = 65534  # the unprivileged uid and gid every Debian system has (nobody, nogroup)


def _as_nobody(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run as uid and gid NOBODY without supplementary groups, with ``env`` added."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "env",
                           *(f"{k}={v}" for k, v in env.items()), *argv],
                          capture_output=True, text=True, timeout=120, cwd="/")


def _python_for_nobody() -> str:
    """An interpreter of this Python version that uid NOBODY may run: this one, unless it
    lives in a directory closed to others (a pyenv under /root), then the system's."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/python{version}"):
        probe = _as_nobody(python, "-c", "import sys; print(f'{sys.version_info.major}.{sys.version_info.minor}')")
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return python
    raise AssertionError(f"no Python {version} that uid {NOBODY} can run (tried {sys.executable})")


def test_mount_as_a_user_without_fuse_access_says_what_is_missing() -> None:
    device = os.stat("/dev/fuse")
    if device.st_mode & 0o006 == 0o006:
        pytest.skip("/dev/fuse is readable and writable by every user here: nothing is missing")
    # pytest's tmp_path is private to root: the user's files go in a directory of their own.
    base = Path(tempfile.mkdtemp(prefix="cubefs-nonroot-"))
    try:
        (base / "source").mkdir()
        (base / "mnt").mkdir()
        (base / "source" / "f.txt").write_text("data")
        config = {"mountPoint": str(base / "mnt"), "volName": f"nonroot{os.getpid()}", "source": str(base / "source"),
                  "diskCacheDir": str(base / "cache"), "logDir": str(base / "log")}
        (base / "client.json").write_text(json.dumps(config))
        for path in (base, *base.rglob("*")):
            os.chown(path, NOBODY, NOBODY)
        site = sysconfig.get_paths()["purelib"]  # the test environment's packages, readable by all
        result = _as_nobody(_python_for_nobody(), "-m", "cubefs_fuse", "mount", "-c", str(base / "client.json"),
                            HOME=str(base), PYTHONPATH=f"{REPO}:{site}")
        message = assert_one_line_error(result, base / "mnt", base / "client.json")
        missing_other = "" if user_allow_other() else (
            f"; and add user_allow_other to /etc/fuse.conf, or only uid {NOBODY} can read the mount")
        assert message == (
            f"cannot mount as uid {NOBODY} (not root): /dev/fuse is {stat.filemode(device.st_mode)} uid "
            f"{device.st_uid} gid {device.st_gid}, not readable and writable by this user: run the daemon as root, "
            f"or give its user access to /dev/fuse (mode 0666 is the usual default){missing_other}")
        # Found before the daemon started: no log file, so no traceback anywhere.
        assert list((base / "log").glob("*")) == []
    finally:
        shutil.rmtree(base)
