"""The command line as users run it: real `python -m cubefs_fuse` subprocesses.

Every user mistake must be exactly one line on stderr naming the problem, exit code 2,
no traceback, and nothing left mounted or running.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse import __version__, mounts
from tests.helpers import REPO, Mount, cli, free_port

ERROR = "cubefs-fuse: error: "


def daemons_using(config_path: Path) -> list[int]:
    """Pids of processes whose command line names ``config_path``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(config_path).encode() in cmdline.split(b"\0") and mounts.pid_alive(int(entry)):
                pids.append(int(entry))
    return pids


class Env:
    """A valid config on disk (source, empty mount point, cache and log dirs in tmp_path)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.source = base / "source"
        self.mount_point = base / "mnt"
        self.config_path = base / "client.json"
        self.source.mkdir(parents=True)
        self.mount_point.mkdir()
        (self.source / "f.txt").write_text("data")
        self.config: dict[str, Any] = {
            "mountPoint": str(self.mount_point),
            "volName": "clitest",
            "source": str(self.source),
            "diskCacheDir": str(base / "cache"),
            "logDir": str(base / "log"),
            "exporterPort": free_port(),
        }

    def write(self, **changes: Any) -> Path:
        """Write the config with ``changes`` applied (a value of None removes the key)."""
        config = {**self.config, **changes}
        self.config_path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        return self.config_path

    def fails(self, *, foreground: bool = False, mount_point: Path | None = None) -> str:
        """Run `mount`; assert the one-line failure contract; return the message."""
        result = cli("mount", "-c", str(self.config_path), *(["--foreground"] if foreground else []))
        return assert_one_line_error(result, mount_point or self.mount_point, self.config_path)


def assert_one_line_error(result: subprocess.CompletedProcess[str], mount_point: Path, config_path: Path) -> str:
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {result.stderr!r}"
    assert lines[0].startswith(ERROR), lines[0]
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert mounts.find_mount(str(mount_point)) is None, "a failed mount left a mount behind"
    assert daemons_using(config_path) == [], "a failed mount left a daemon running"
    return lines[0].removeprefix(ERROR)


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


@contextmanager
def readonly_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir()
    # 1 MiB is plenty: nothing can be written to it anyway.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


FOREGROUND = pytest.mark.parametrize("foreground", [False, True], ids=["detached", "foreground"])


# -- bad configs ------------------------------------------------------------------------


@FOREGROUND
def test_unknown_key_suggests_the_closest(env: Env, foreground: bool) -> None:
    env.write(memCachSize="1GiB")
    assert env.fails(foreground=foreground) == (
        f"config file {str(env.config_path)!r}: unknown key 'memCachSize' (did you mean 'memCacheSize'?)")


@FOREGROUND
def test_wrong_type(env: Env, foreground: bool) -> None:
    env.write(exporterPort=[9500])
    message = env.fails(foreground=foreground)
    assert message.endswith("key 'exporterPort': expected an integer, got list [9500]")


@FOREGROUND
def test_missing_source_key(env: Env, foreground: bool) -> None:
    env.write(source=None)
    assert env.fails(foreground=foreground).endswith("missing required key 'source'")


@FOREGROUND
def test_source_does_not_exist(env: Env, foreground: bool) -> None:
    env.write(source=str(env.base / "nowhere"))
    assert env.fails(foreground=foreground) == f"key 'source': {str(env.base / 'nowhere')!r} does not exist"


@FOREGROUND
def test_source_is_a_file(env: Env, foreground: bool) -> None:
    env.write(source=str(env.source / "f.txt"))
    assert env.fails(foreground=foreground) == f"key 'source': {str(env.source / 'f.txt')!r} is not a directory"


@FOREGROUND
def test_mount_point_missing(env: Env, foreground: bool) -> None:
    missing = env.base / "nomnt"
    env.write(mountPoint=str(missing))
    message = env.fails(foreground=foreground, mount_point=missing)
    assert message == f"key 'mountPoint': {str(missing)!r} does not exist or is not a directory"


@FOREGROUND
def test_mount_point_not_empty(env: Env, foreground: bool) -> None:
    (env.mount_point / "leftover").write_text("x")
    env.write()
    assert env.fails(foreground=foreground) == f"key 'mountPoint': {str(env.mount_point)!r} is not empty"


@FOREGROUND
def test_cache_dir_under_a_regular_file(env: Env, foreground: bool) -> None:
    blocker = env.base / "file"
    blocker.write_text("x")
    env.write(diskCacheDir=str(blocker / "cache"))
    assert env.fails(foreground=foreground) == (
        f"key 'diskCacheDir': cannot create {str(blocker / 'cache')!r}: Not a directory")


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


@FOREGROUND
@pytest.mark.parametrize(("key", "value"), [("memCacheSize", "lots"), ("diskCacheSize", "8XiB"),
                                            ("blockSize", "-4KiB")])
def test_size_that_does_not_parse(env: Env, foreground: bool, key: str, value: str) -> None:
    env.write(**{key: value})
    assert env.fails(foreground=foreground).endswith(
        f"key {key!r}: cannot parse {value!r} as a size (examples: 1073741824, \"512MiB\", \"8GiB\")")


@FOREGROUND
def test_invalid_json(env: Env, foreground: bool) -> None:
    env.config_path.write_text('{"mountPoint": "/mnt",\n "volName": ,}')
    message = env.fails(foreground=foreground)
    assert message.startswith(f"config file {str(env.config_path)!r} is not valid JSON: ")
    assert "line 2 column" in message


@FOREGROUND
def test_missing_config_file(env: Env, foreground: bool) -> None:
    assert env.fails(foreground=foreground) == (
        f"cannot read config file {str(env.config_path)!r}: No such file or directory")


def test_exporter_port_in_use(env: Env) -> None:
    # Fails inside the daemon after the kernel mount was made: it must be taken down again.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env.write(exporterPort=port)
        message = env.fails()
    assert message.startswith(f"key 'exporterPort': cannot listen on 127.0.0.1:{port}: Address already in use")


# -- help, version, umount ------------------------------------------------------------


def test_version() -> None:
    result = cli("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"cubefs-fuse {__version__}")


@pytest.mark.parametrize("args", [[], ["mount"], ["umount"]], ids=["top", "mount", "umount"])
def test_help(args: list[str]) -> None:
    result = cli(*args, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: cubefs-fuse {' '.join(args)}".rstrip())
    assert result.stderr == ""
    if args == ["mount"]:
        assert "--foreground" in result.stdout and "--config" in result.stdout
    if args == ["umount"]:
        assert "MOUNTPOINT" in result.stdout and "--lazy" in result.stdout


def test_no_command_prints_help_and_fails() -> None:
    result = cli()
    assert result.returncode == 2
    assert "usage: cubefs-fuse" in result.stdout


def test_umount_of_a_path_that_is_not_mounted(tmp_path: Path) -> None:
    result = cli("umount", str(tmp_path))
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"{ERROR}{tmp_path} is not mounted"]
    assert result.returncode == 2


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
    assert daemons_using(m.config_path) == [pid]  # the helper the failure checks rely on sees daemons
    assert m.path("f.txt").read_text() == "live"
    assert [e.mount_point for e in mounts.mount_table()].count(str(m.mount_point)) == 1
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
