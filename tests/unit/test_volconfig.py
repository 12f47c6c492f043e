"""The per-volume config file (DESIGN.md 2.2): written by a mounted ai_prefetch daemon,
one daemon per volume name, and checked by clients before they trust it."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from cubefs_fuse.control.protocol import PROTOCOL_VERSION, ControlClient, ProtocolError, VolumeConfig, read_volume_config
from tests.helpers import Mount, cli, dead_pid

FIELDS = {"prof", "mount_point", "vol_name", "local_ip", "control_socket", "pid", "protocol_version", "token_file"}


def config_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    return d


@pytest.mark.mounted
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


def write_config(directory: Path, vol: str, mode: int = 0o644) -> Path:
    config = VolumeConfig(prof=0, mount_point="/mnt/x", vol_name=vol, local_ip="127.0.0.1",
                          control_socket="/run/x.sock", pid=1)
    path = directory / f"cube_torch.config.{vol}"
    path.write_text(config.to_json())
    os.chmod(path, mode)
    return path


def test_read_volume_config_accepts_a_private_file(tmp_path: Path) -> None:
    write_config(tmp_path, "ok")
    assert read_volume_config("ok", str(tmp_path)).control_socket == "/run/x.sock"


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664])
def test_read_volume_config_refuses_a_file_others_can_write(tmp_path: Path, mode: int) -> None:
    write_config(tmp_path, "w", mode)
    with pytest.raises(ProtocolError, match="writable by group or others"):
        read_volume_config("w", str(tmp_path))


def test_read_volume_config_refuses_a_file_of_another_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to chown the file to another user")
    path = write_config(tmp_path, "other")
    os.chown(path, 65534, 65534)  # nobody: not root, not us
    with pytest.raises(ProtocolError, match="owned by uid 65534"):
        read_volume_config("other", str(tmp_path))


def test_read_volume_config_refuses_links_and_missing_and_bad_files(tmp_path: Path) -> None:
    target = write_config(tmp_path, "real")
    os.symlink(target, tmp_path / "cube_torch.config.link")
    with pytest.raises(ProtocolError, match="cannot open"):
        read_volume_config("link", str(tmp_path))  # a link could point anywhere
    with pytest.raises(ProtocolError, match="no daemon for volume 'absent'"):
        read_volume_config("absent", str(tmp_path))
    (tmp_path / "cube_torch.config.junk").write_text("{not json")
    with pytest.raises(ProtocolError, match="not a valid volume config"):
        read_volume_config("junk", str(tmp_path))
    data = json.loads(target.read_text())
    data["protocol_version"] = PROTOCOL_VERSION + 1
    (tmp_path / "cube_torch.config.future").write_text(json.dumps(data))
    with pytest.raises(ProtocolError, match="protocol"):
        read_volume_config("future", str(tmp_path))
