"""The command line's failure contract, checked by tests/component/test_cli.py (mistakes
caught before anything is mounted) and tests/mounted/test_cli_mounts.py (where a mount
or a live daemon is involved): every user mistake is exactly one line on stderr naming
the problem, exit code 2, no traceback, and nothing left mounted or running."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse import mounts
from cubefs_fuse.control.keeper import keeper_socket_path
from tests import daemon_logs
from tests.helpers import cli, free_port

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
        if isinstance(config.get("logDir"), str):
            daemon_logs.watch(Path(config["logDir"]))
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


def leftovers(config: dict[str, Any]) -> list[str]:
    """What a daemon for ``config`` leaves in shared places: its control, data and handover
    sockets, its keeper's socket, token file, per-volume config file and runtime registry entry (none may outlive a failed
    start, nor a daemon killed and unmounted with `umount --lazy`)."""
    vol = config["volName"]
    runtime = mounts.runtime_dir()
    control = config.get("controlSocket") or os.path.join(runtime, f"{vol}.sock")
    candidates = [control, mounts.data_socket_path(control), mounts.handover_socket_path(control),
                  keeper_socket_path(control), os.path.join(runtime, f"{vol}.token"),
                  os.path.join(config.get("configDir", "/tmp"), f"cube_torch.config.{vol}")]
    found = [p for p in candidates if os.path.lexists(p)]
    if mounts.registered(config["mountPoint"]) is not None:
        found.append(f"registry entry for {config['mountPoint']}")
    return found
