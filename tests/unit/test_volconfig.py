"""The per-volume config file (docs/ai_prefetch.md): checked by clients before they trust it.
The daemon's side (writing it, one daemon per volume name) is in
tests/mounted/test_volconfig_daemon.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cubefs_fuse.control import volfile
from cubefs_fuse.control.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    VolumeConfig,
    config_file_path,
    read_volume_config,
)
from cubefs_fuse.errors import ConfigError
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
    data["vol_name"] = "future"
    (tmp_path / "cube_torch.config.future").write_text(json.dumps(data))
    with pytest.raises(ProtocolError, match="protocol"):
        read_volume_config("future", str(tmp_path))
    (tmp_path / "cube_torch.config.deep").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ProtocolError, match="not a valid volume config"):
        read_volume_config("deep", str(tmp_path))


def test_read_volume_config_refuses_another_volumes_file_and_hard_links(tmp_path: Path) -> None:
    target = write_volume_config(tmp_path, "mine")
    os.rename(target, tmp_path / "cube_torch.config.yours")  # a file naming volume 'mine'
    with pytest.raises(ProtocolError, match="names volume 'mine', not 'yours'"):
        read_volume_config("yours", str(tmp_path))
    target = write_volume_config(tmp_path, "linked")
    os.link(target, tmp_path / "elsewhere")
    with pytest.raises(ProtocolError, match="has 2 links"):
        read_volume_config("linked", str(tmp_path))


# -- the daemon's side: claim() and write() never trust or follow another user's entry --------


def volume(vol: str) -> VolumeConfig:
    return VolumeConfig(prof=0, mount_point="/mnt/x", vol_name=vol, local_ip="127.0.0.1",
                        control_socket="/run/x.sock", pid=os.getpid())


def planted(tmp_path: Path, vol: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put an entry of ``kind`` at vol's config path, as another user would."""
    path = Path(config_file_path(vol, str(tmp_path)))
    victim = tmp_path / "victim"
    if kind == "file naming pid 1":
        owned_by_another_user(write_volume_config(tmp_path, vol, pid=1), monkeypatch)
    elif kind == "group-writable file naming pid 1":
        write_volume_config(tmp_path, vol, 0o664, pid=1)
    elif kind == "symlink to a file":
        victim.write_text("precious")
        path.symlink_to(victim)
    elif kind == "dangling symlink":
        path.symlink_to(victim)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("theirs")
    elif kind == "fifo":
        os.mkfifo(path)
    return path


KINDS = ["file naming pid 1", "group-writable file naming pid 1", "symlink to a file", "dangling symlink",
         "directory", "fifo"]


@pytest.mark.parametrize("kind", KINDS)
def test_claim_and_write_replace_an_untrusted_entry(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = planted(tmp_path, "v", kind, monkeypatch)
    monkeypatch.undo()  # the daemon is itself again
    volfile.claim("v", str(tmp_path))  # pid 1 is alive, but an untrusted file is no claim
    assert not os.path.lexists(path)
    path = planted(tmp_path, "v", kind, monkeypatch) if kind != "symlink to a file" else path
    monkeypatch.undo()
    assert volfile.write(volume("v"), str(tmp_path)) == str(path)  # planted again after the claim
    assert read_volume_config("v", str(tmp_path)).pid == os.getpid()
    victim = tmp_path / "victim"
    assert not victim.exists() or victim.read_text() == "precious"
    if kind == "directory":  # moved aside with its content, not deleted
        asides = list(tmp_path.glob("cube_torch.config.v.planted-*"))  # planted twice, moved twice
        assert len(asides) == 2 and all((a / "inside").read_text() == "theirs" for a in asides)
    assert not list(tmp_path.glob("*.tmp"))
    volfile.remove("v", str(tmp_path))
    assert not os.path.lexists(path)


def test_claim_refuses_when_a_live_daemon_owns_the_file(tmp_path: Path) -> None:
    path = write_volume_config(tmp_path, "live", pid=1)  # ours (trusted), naming a live pid
    with pytest.raises(ConfigError, match="already served by daemon pid 1"):
        volfile.claim("live", str(tmp_path))
    assert path.exists()
    volfile.remove("live", str(tmp_path))  # not ours: left alone
    assert path.exists()
