"""The per-volume config file (docs/ai_prefetch.md) on the daemon's side: written by a mounted
ai_prefetch daemon, one daemon per volume name.  Clients' checks of the file are in
tests/unit/test_volconfig.py."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

from cubefs_fuse.control.protocol import PROTOCOL_VERSION, ControlClient, read_volume_config
from tests.helpers import Mount, cli, dead_pid

FIELDS = {"prof", "mount_point", "vol_name", "local_ip", "control_socket", "pid", "protocol_version", "token_file"}


def config_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    return d


def test_config_file_lifecycle_and_one_daemon_per_volume(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    cfg = config_dir(tmp_path)
    vol = f"volcfg{os.getpid()}"
    path = cfg / f"cube_torch.config.{vol}"
    # A file left behind by a daemon that died: the new daemon takes it over.
    path.write_text(json.dumps({"pid": dead_pid(), "vol_name": vol}))
    first = make_mount(profile="ai_prefetch", volName=vol, configDir=str(cfg))
    first.mount()
    try:
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o644 and st.st_uid == os.geteuid()
        data = json.loads(path.read_text())
        assert set(data) == FIELDS
        assert data["vol_name"] == vol and data["mount_point"] == str(first.mount_point)
        assert data["pid"] == first.pid() and data["protocol_version"] == PROTOCOL_VERSION
        assert data["prof"] == 0 and data["token_file"] == ""  # no profPort configured
        assert isinstance(data["local_ip"], str) and data["local_ip"].count(".") == 3
        assert stat.S_ISSOCK(os.stat(data["control_socket"]).st_mode)
        # What a client does: read the file, then talk to the daemon it names.
        config = read_volume_config(vol, str(cfg))
        assert ControlClient(config.control_socket).status()["pid"] == first.pid()
        assert not list(cfg.glob("*.tmp")), "the atomic write left its temp file"

        # A second daemon for the same volume name refuses while the first is alive.
        second = make_mount(profile="ai_prefetch", volName=vol, configDir=str(cfg))
        second.config_path.write_text(json.dumps(second.config()))
        result = cli("mount", "-c", str(second.config_path))
        assert result.returncode == 2, result.stderr
        assert f"already served by daemon pid {first.pid()}" in result.stderr
        assert result.stderr.count("\n") == 1  # one line, no traceback
        # ... and leaves the first one's file and socket alone.
        assert json.loads(path.read_text())["pid"] == first.pid()
        assert ControlClient(config.control_socket).status()["pid"] == first.pid()
    finally:
        first.umount()
    assert not path.exists(), "the config file outlived the mount"
