"""The per-volume config file (docs/ai_prefetch.md): checked by clients before they trust it.
The daemon's side (writing it, one daemon per volume name) is in
tests/mounted/test_volconfig_daemon.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cubefs_fuse.control.protocol import PROTOCOL_VERSION, ProtocolError, read_volume_config
from tests.helpers import owned_by_another_user, write_volume_config


def test_read_volume_config_accepts_a_private_file(tmp_path: Path) -> None:
    write_volume_config(tmp_path, "ok")
    assert read_volume_config("ok", str(tmp_path)).control_socket == "/run/x.sock"


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664])
def test_read_volume_config_refuses_a_file_others_can_write(tmp_path: Path, mode: int) -> None:
    write_volume_config(tmp_path, "w", mode)
    with pytest.raises(ProtocolError, match="writable by group or others"):
        read_volume_config("w", str(tmp_path))


def test_read_volume_config_refuses_a_file_of_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = owned_by_another_user(write_volume_config(tmp_path, "other"), monkeypatch)
    with pytest.raises(ProtocolError, match=f"owned by uid {owner}"):
        read_volume_config("other", str(tmp_path))


def test_read_volume_config_refuses_links_and_missing_and_bad_files(tmp_path: Path) -> None:
    target = write_volume_config(tmp_path, "real")
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
