"""The systemd walkthrough of docs/operations.md, run as written, line by line, inside a
throwaway root: every absolute path it names (/opt, /etc, /usr/local/src, /mnt, /nvme0)
is moved under tmp_path.  What needs the real machine is checked instead of run:
``apt-get install`` (the packages must be installed here), ``systemctl daemon-reload``
(``systemd-analyze verify`` of the installed unit), ``systemctl enable --now`` (the
installed unit's ExecStart, with its drop-in, run as systemd would: it must report
READY=1 with the mount live; then ExecStop) and ``systemctl status``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

from cubefs_fuse import mounts
from cubefs_fuse.config import load_config
from tests import daemon_logs
from tests.helpers import REPO, free_port
from tests.systemd_units import next_notification, notify_socket, parse_unit, unit_command

DOC = REPO / "docs" / "operations.md"
MARKER = "<!-- walkthrough:systemd"
CHECKOUT = "/usr/local/src/cubefs-fuse"  # where the walkthrough's checkout lies
ROOTS = ("/opt/", "/etc/", "/mnt/", "/nvme0/", "/var/log/", "/nfs/")
# The checkout is copied with what a distribution and the deploy step use.
CHECKOUT_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "cubefs_fuse", "cube_torch", "deploy")
# Without PYTHONPATH (the test run's points at the worktree): the venv must work alone.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
PIP_TIMEOUT = 600  # the venv's pip install compiles the C session


def walkthrough() -> list[str]:
    text = DOC.read_text()
    block = text[text.index(MARKER):]
    block = block[block.index("```sh\n") + 6:]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def test_walkthrough_block_is_found() -> None:
    lines = walkthrough()
    assert lines[0] == "apt-get update" and lines[-1].startswith("systemctl status")
    assert any(line.startswith("apt-get install") for line in lines)


def _installed(package: str) -> bool:
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return result.returncode == 0 and result.stdout.endswith("installed")


def test_the_debian12_walkthrough_runs_as_written(tmp_path: Path) -> None:
    root = tmp_path / "root"
    # The directories a Debian 12 system has before the walkthrough (logrotate.d: from
    # the logrotate package, which the walkthrough installs).
    for skeleton in ("etc/systemd/system", "etc/logrotate.d", "opt", "mnt", "usr/local/src"):
        (root / skeleton).mkdir(parents=True)
    checkout = root / CHECKOUT.lstrip("/")
    checkout.mkdir(parents=True)
    for name in CHECKOUT_FILES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(REPO / name, checkout / name)

    def rooted(line: str) -> str:
        return re.sub(r"(?<![\w./-])(" + "|".join(map(re.escape, ROOTS + (CHECKOUT,))) + ")",
                      lambda m: f"{root}{m.group(1)}", line)

    config_path = root / "etc/cubefs-fuse/imagenet.json"
    ran, checked = [], []
    for line in walkthrough():
        if line.startswith("#"):
            if "Edit /etc/cubefs-fuse/imagenet.json" in line:
                _edit_config(config_path, root)  # what the operator does at this step
            continue
        words = shlex.split(line)
        if words[:2] == ["apt-get", "update"]:
            continue
        if words[:2] == ["apt-get", "install"]:
            packages = [w for w in words[2:] if not w.startswith("-")]
            if shutil.which("dpkg-query"):
                missing = [p for p in packages if not _installed(p)]
                assert not missing, f"the walkthrough installs {missing}: not installed here, so not tested"
            checked.append(line)
            continue
        if words[0] == "systemctl":
            checked.append(line)
            if words[1] == "daemon-reload":
                _verify_unit(root)
            elif words[1:3] == ["enable", "--now"]:
                _start_and_stop(root, words[3], config_path)
            continue
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", rooted(line)], capture_output=True, text=True,
                                timeout=PIP_TIMEOUT, env=CLEAN_ENV, cwd=tmp_path)
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        ran.append(line)
    assert len(ran) >= 8 and len(checked) >= 4, (ran, checked)
    print(f"walkthrough: {len(ran)} commands run, {len(checked)} checked (apt-get install, systemctl)")


def _edit_config(config_path: Path, root: Path) -> None:
    """The editing step: the example's paths under the throwaway root, a free metrics port."""
    config = json.loads(config_path.read_text())
    for key in ("source", "mountPoint", "diskCacheDir", "logDir"):
        config[key] = f"{root}{config[key]}"
    Path(config["source"]).mkdir(parents=True)
    (Path(config["source"]) / "train.txt").write_text("walkthrough\n")
    config.update(exporterPort=free_port(), volName=f"walk-{uuid.uuid4().hex[:8]}")
    config_path.write_text(json.dumps(config))
    daemon_logs.watch(Path(config["logDir"]))


def _verify_unit(root: Path) -> None:
    unit = root / "etc/systemd/system/cubefs-fuse@.service"
    assert unit.is_file()
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return
    text = unit.read_text().replace("/opt/", f"{root}/opt/")
    (instance := root / "cubefs-fuse@imagenet.service").write_text(text)
    result = subprocess.run([analyze, "verify", "--man=no", str(instance)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def _start_and_stop(root: Path, instance_unit: str, config_path: Path) -> None:
    instance = instance_unit.removeprefix("cubefs-fuse@").removesuffix(".service")
    system = root / "etc/systemd/system"
    service = parse_unit((system / "cubefs-fuse@.service").read_text())["Service"]
    for dropin in sorted((system / f"cubefs-fuse@{instance}.service.d").glob("*.conf")):
        for key, values in parse_unit(dropin.read_text())["Service"].items():
            service[key] = values
    # The drop-in's memory limits follow the config's two RAM tiers, memCacheSize and
    # sampleCacheMemSize (+1.5 GiB / +2 GiB).
    config = load_config(str(config_path))
    mib = {k: int(service[k][-1].removesuffix("M")) if service[k][-1].endswith("M")
           else int(service[k][-1].removesuffix("G")) * 1024 for k in ("MemoryHigh", "MemoryMax")}
    tiers = (config.mem_cache_size + config.sample_cache_mem_size) // 2**20
    assert mib == {"MemoryHigh": tiers + 1536, "MemoryMax": tiers + 2048}, mib
    subs = {"%i": instance, "/opt/": f"{root}/opt/", "/etc/": f"{root}/etc/"}
    start, stop = unit_command(service["ExecStart"][-1], subs), unit_command(service["ExecStop"][-1], subs)
    sock, address = notify_socket("path", root)
    daemon = subprocess.Popen(start, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**CLEAN_ENV, "NOTIFY_SOCKET": address}, cwd="/")
    try:
        ready = next_notification(sock, daemon, timeout=120)
        assert ready["READY"] == "1" and ready["STATUS"] == f"serving {config.source} on {config.mount_point}"
        assert (Path(config.mount_point) / "train.txt").read_text() == "walkthrough\n"
        result = subprocess.run(stop, capture_output=True, text=True, timeout=120, env=CLEAN_ENV)
        assert result.returncode == 0, result.stderr
        assert daemon.wait(timeout=90) == 0
        assert Path(config.log_dir, f"{config.vol_name}.log").is_file()  # logDir: the rotated file
    finally:
        sock.close()
        if daemon.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", config.mount_point], capture_output=True)
            daemon.kill()
            daemon.wait()
        if daemon.stderr is not None:
            daemon.stderr.close()  # read by next_notification only if the daemon died
    assert mounts.find_mount(config.mount_point) is None
