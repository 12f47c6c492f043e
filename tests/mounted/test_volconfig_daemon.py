"""The per-volume config file (docs/ai_prefetch.md) on the daemon's side: written by a mounted
ai_prefetch daemon, one daemon per volume name.  Clients' checks of the file are in
tests/unit/test_volconfig.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cubefs_fuse.control.protocol import PROTOCOL_VERSION, ControlClient, read_volume_config
from tests.helpers import Mount, cli, dead_pid

FIELDS = {"prof", "mount_point", "vol_name", "local_ip", "control_socket", "pid", "protocol_version", "token_file",
          "data_socket"}


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


# -- entries another user planted before the daemon started (docs/contracts.md) ----------------------

# Run as uid 65534 in a sticky, world-writable directory like /tmp: plant ARGV[1] at ARGV[2].
PLANT = """
import json, os, sys
kind, path, victim, missing, first_pid = sys.argv[1:6]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
if kind == "file naming pid 1":
    with open(path, "w") as f:
        json.dump({"pid": 1, "vol_name": os.path.basename(path).split(".", 2)[2], "control_socket": "/tmp/evil.sock",
                   "mount_point": "/", "prof": 0, "local_ip": "127.0.0.1", "protocol_version": 1}, f)
    os.chmod(path, 0o644)
elif kind == "symlink to a root file":
    os.symlink(victim, path)
elif kind == "symlink to nothing":
    os.symlink(missing, path)
elif kind == "directory":
    os.mkdir(path)
    with open(os.path.join(path, "inside"), "w") as f:
        f.write("theirs")
elif kind == "symlinks at the old temp names":
    # The old temp name was <path>.<daemon pid>.tmp: cover the pids the next processes get.
    for pid in range(int(first_pid), int(first_pid) + 3000):
        os.symlink(victim, f"{path}.{pid}.tmp")
"""
PLANTINGS = ["file naming pid 1", "symlink to a root file", "symlink to nothing", "directory",
             "symlinks at the old temp names"]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A root-owned, sticky, world-writable directory like /tmp, for the daemon's configDir."""
    d = Path(tempfile.mkdtemp(prefix="cubefs-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("kind", PLANTINGS)
def test_nothing_another_user_planted_blocks_or_redirects_the_volume_file(
        make_mount: Callable[..., Mount], tmp_path: Path, shared_dir: Path, kind: str) -> None:
    vol = f"plant{os.getpid()}"
    path = shared_dir / f"cube_torch.config.{vol}"
    victim = tmp_path / "victim"  # a root file a symlink could make the daemon overwrite
    victim.write_text("root's own data\n")
    missing = shared_dir / "created-by-the-daemon"  # a file a dangling symlink could make it create
    victim_before = (victim.read_bytes(), os.stat(victim))
    next_pid = int(Path("/proc/sys/kernel/ns_last_pid").read_text()) + 1
    subprocess.run([sys.executable, "-c", PLANT, kind, str(path), str(victim), str(missing), str(next_pid)],
                   check=True, timeout=60)
    assert os.lstat(path if kind != "symlinks at the old temp names" else f"{path}.{next_pid}.tmp").st_uid == 65534
    m = make_mount(profile="ai_prefetch", volName=vol, configDir=str(shared_dir))
    m.mount()
    try:
        # A correct file, written by the daemon, that a client trusts and that leads to it.
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644
        config = read_volume_config(vol, str(shared_dir))
        assert config.pid == m.pid() and config.vol_name == vol and config.mount_point == str(m.mount_point)
        assert ControlClient(config.control_socket).status()["pid"] == m.pid()
        if kind == "symlinks at the old temp names":
            assert next_pid <= m.pid() < next_pid + 3000, "the daemon's pid missed the planted names"
        else:
            assert "replacing" in m.log()
    finally:
        m.umount()
    assert not os.path.lexists(path), "the config file outlived the mount"
    # Nothing outside was modified or created.
    after = os.stat(victim)
    assert victim.read_bytes() == victim_before[0]
    assert (after.st_mtime_ns, after.st_ino, after.st_mode) == (victim_before[1].st_mtime_ns,
                                                               victim_before[1].st_ino, victim_before[1].st_mode)
    assert not os.path.lexists(missing)
    if kind == "directory":  # moved aside, its content kept
        [aside] = shared_dir.glob(f"cube_torch.config.{vol}.planted-*")
        assert (aside / "inside").read_text() == "theirs"
    leftovers = [p.name for p in shared_dir.iterdir()
                 if p.name.endswith(".tmp") and os.lstat(p).st_uid != 65534 or p.name == missing.name]
    assert leftovers == [], leftovers


def test_cube_torch_config_dir_is_honoured_by_the_daemon_and_by_clients(
        make_mount: Callable[..., Mount], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod that keeps its own /tmp: with CUBE_TORCH_CONFIG_DIR set and no configDir key, the
    daemon writes the per-volume file there and a client with the same variable finds it."""
    shared = tmp_path / "run"
    shared.mkdir()
    monkeypatch.setenv("CUBE_TORCH_CONFIG_DIR", str(shared))  # the CLI and the daemon inherit it
    m = make_mount(profile="ai_prefetch")
    m.mount()
    try:
        name = m.config()["volName"]
        assert (shared / f"cube_torch.config.{name}").is_file()
        assert not os.path.exists(f"/tmp/cube_torch.config.{name}")
        volume = read_volume_config(name)  # the client side: no directory given, the variable decides
        assert volume.mount_point == str(m.mount_point)
        assert ControlClient(volume.control_socket).status()["volume"] == name
        monkeypatch.delenv("CUBE_TORCH_CONFIG_DIR")
        with pytest.raises(Exception, match="no daemon"):
            read_volume_config(name)  # without it the client looks in /tmp, where nothing is
    finally:
        m.umount()
    assert not (shared / f"cube_torch.config.{m.config()['volName']}").exists()
