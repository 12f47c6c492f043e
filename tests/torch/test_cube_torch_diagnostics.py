"""One clear warning per cause and process tree, as a user sees it on the stderr of a real
training script with DataLoader workers (2 workers x 2 epochs, not persistent: 4 worker
processes besides the main one): a wrong VOL_NAME (listing the volumes served), a daemon
that is not running, a dataset outside the mount.  No daemon is involved: fake per-volume
files point at nothing or at dead sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cubefs_fuse.control.protocol import CONFIG_FILE_PREFIX, VolumeConfig
from tests.helpers import REPO

TRAIN = """
import os, sys
import cube_torch
from torch.utils.data import DataLoader
from tests.torch_datasets import ListDataset, keep
data = sys.argv[1]
dataset = ListDataset(sorted(os.path.join(data, n) for n in os.listdir(data)))
if sys.argv[2] == "cached":  # the daemon's sample store, the default
    dataset = cube_torch.CachedDataset(dataset, name="diagnostics")
loader = DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2, collate_fn=keep)
for epoch in range(2):
    assert sum(len(b) for b in loader) == len(dataset)
print("TRAINED", flush=True)
"""


def train(tmp_path: Path, vol_name: str, data: Path, *, cached: bool = False) -> list[str]:
    """Train 2 epochs with 2 workers over ``data`` (through a CachedDataset with the default
    store when ``cached``); the cube_torch warnings on stderr.  An empty ``vol_name``: unset."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBE_TORCH") and k != "VOL_NAME"}
    env |= {"CUBE_TORCH_CONFIG_DIR": str(tmp_path / "config"), "CUBE_TORCH_METRICS_INTERVAL": "3600",
            "CUBE_TORCH_JOB": f"messages-{os.getpid()}"} | ({"VOL_NAME": vol_name} if vol_name else {})
    result = subprocess.run([sys.executable, "-c", TRAIN, str(data), "cached" if cached else "plain"],
                            capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert result.returncode == 0 and "TRAINED" in result.stdout, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if "cube_torch" in line]


def files(directory: Path, count: int = 8) -> Path:
    directory.mkdir(parents=True)
    for i in range(count):
        (directory / f"{i:02d}.bin").write_bytes(bytes([i]) * 100)
    return directory


def volume_file(tmp_path: Path, vol_name: str, mount_point: Path, socket_path: str, data_socket: str = "") -> None:
    """A per-volume file as a daemon writes it (ours, 0644)."""
    config = VolumeConfig(prof=0, mount_point=str(mount_point), vol_name=vol_name, local_ip="127.0.0.1",
                          control_socket=socket_path, pid=4242, data_socket=data_socket or socket_path + ".data")
    path = tmp_path / "config" / f"{CONFIG_FILE_PREFIX}{vol_name}"
    path.write_text(config.to_json())
    path.chmod(0o644)


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    """Two volumes served on this "node": imagenet and coco."""
    (tmp_path / "config").mkdir()
    for name in ("imagenet", "coco"):
        volume_file(tmp_path, name, tmp_path / f"mnt-{name}", str(tmp_path / f"{name}.sock"))
    return tmp_path / "config"


@pytest.mark.parametrize("cached", [False, True], ids=["files", "sample-cache"])
def test_a_wrong_vol_name_is_one_warning_listing_the_volumes_served(tmp_path: Path, config_dir: Path,
                                                                    cached: bool) -> None:
    """Prefetch, the workers' fast path and the sample cache's daemon store all meet it: one line."""
    [warning] = train(tmp_path, "imagenett", files(tmp_path / "data"), cached=cached)
    assert "WARNING" in warning or warning.startswith("cube_torch:"), warning
    assert (f"VOL_NAME='imagenett': no cubefs-fuse daemon serves this volume on this node "
            f"(no {config_dir}/cube_torch.config.imagenett). Volumes served here: 'coco', 'imagenet'.") in warning
    assert '"profile": "ai_prefetch"' in warning and "configDir" in warning and "$CUBE_TORCH_CONFIG_DIR" in warning


def test_a_sample_cache_without_vol_name_is_one_warning(tmp_path: Path, config_dir: Path) -> None:
    [warning] = train(tmp_path, "", files(tmp_path / "data"), cached=True)
    assert "a sample cache's default store is the cubefs-fuse daemon of $VOL_NAME, which is not set" in warning


def test_no_volume_at_all_says_none_are_served(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    [warning] = train(tmp_path, "imagenet", files(tmp_path / "data"))
    assert "Volumes served here: none." in warning, warning


def test_a_daemon_that_is_not_running_is_its_own_warning(tmp_path: Path, config_dir: Path) -> None:
    data = files(tmp_path / "data")
    # What a killed daemon leaves: its sockets, bound and not listening (connections are refused).
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "dead.sock"))
    dead_data = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead_data.bind(str(tmp_path / "dead.data.sock"))
    try:
        volume_file(tmp_path, "imagenet", data, str(tmp_path / "dead.sock"), str(tmp_path / "dead.data.sock"))
        warnings = train(tmp_path, "imagenet", data)
    finally:
        dead.close()
        dead_data.close()
    [warning] = warnings
    assert (f"the cubefs-fuse daemon of volume 'imagenet' is not running: {config_dir}/cube_torch.config.imagenet "
            f"names pid 4242, whose socket {tmp_path}/dead.sock refuses connections") in warning, warning
    assert "cubefs-fuse status" in warning


def test_a_dataset_outside_the_mount_is_a_warning_naming_both(tmp_path: Path, config_dir: Path) -> None:
    data = files(tmp_path / "elsewhere" / "train")
    mount = tmp_path / "mnt-imagenet"
    [warning] = train(tmp_path, "imagenet", data)
    assert "WARNING" in warning or warning.startswith("cube_torch:"), warning
    assert (f"the files of ListDataset lie under {data}, outside the mount {mount} of volume 'imagenet'"
            in warning), warning
