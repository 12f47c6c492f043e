"""The per-volume config file (DESIGN.md 2.2): checked by clients before they trust it.
The daemon's side (writing it, one daemon per volume name) is in
tests/mounted/test_volconfig_daemon.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cubefs_fuse.control.protocol import PROTOCOL_VERSION, ProtocolError, VolumeConfig, read_volume_config


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


def test_read_volume_config_refuses_a_file_of_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, "other")
    owner = os.geteuid()
    if owner == 0:  # root gives the file away: to nobody, neither root nor us
        owner = 65534
        os.chown(path, owner, owner)
    else:  # a user cannot give a file away, so the reader becomes another (non-root) user
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(ProtocolError, match=f"owned by uid {owner}"):
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
