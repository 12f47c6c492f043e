"""Packaging, as a user meets it: a wheel built with the oldest setuptools pyproject.toml
declares (its metadata, py.typed, the example configs), ``pip install .`` into a fresh venv
without torch, the installed ``cubefs-fuse`` mounting a volume from its own example
config, and the cube-torch distribution (distributions/cube-torch) installed alone where
nothing can be compiled.  pip's download cache is kept (~/.cache/pip), so a repeated run is quick.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import uuid
import zipfile
from collections.abc import Callable
from email.parser import HeaderParser
from pathlib import Path

from cubefs_fuse import __version__, mounts
from tests import daemon_logs
from tests.helpers import REPO, Mount, wait_until

# What goes into a distribution (the same list as .dockerignore).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "cubefs_fuse", "cube_torch")
# pip installs of a few MB and a build of the C session: minutes on a loaded 2-core machine.
PIP_TIMEOUT = 600


# The fresh venvs must see only what is installed in them: no PYTHONPATH (the test run's
# points at the worktree), and a working directory outside the repository.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(*args: str | Path, timeout: float = PIP_TIMEOUT) -> str:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                            env=CLEAN_ENV, cwd="/")
    assert result.returncode == 0, f"{' '.join(map(str, args))}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _source_copy(dest: Path) -> Path:
    """The files a distribution is built from, outside the worktree (builds write into it)."""
    dest.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            shutil.copy2(REPO / name, dest / name)
    return dest


def _minimum_setuptools() -> str:
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    [setuptools] = [r for r in requires if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=([\d.]+)", setuptools)
    assert match, f"build-system requires {setuptools!r}: expected setuptools>=VERSION"
    return match.group(1)


def _venv(path: Path) -> Path:
    _run(sys.executable, "-m", "venv", path)
    return path / "bin"


def test_wheel_built_with_the_declared_minimum_setuptools(tmp_path: Path) -> None:
    minimum = _minimum_setuptools()
    src = _source_copy(tmp_path / "src")
    build = _venv(tmp_path / "build")
    _run(build / "pip", "install", "-q", f"setuptools=={minimum}", "wheel")
    _run(build / "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src)
    [wheel] = (tmp_path / "dist").glob("cubefs_fuse-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = f"cubefs_fuse-{__version__}.dist-info"
        metadata = HeaderParser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
    assert {"cubefs_fuse/py.typed", "cube_torch/py.typed", f"{dist_info}/licenses/LICENSE"} <= names, sorted(names)
    assert {f"cubefs_fuse/examples/{n}.json" for n in ("minimal", "nfs-dataset", "cubefs-compatible")} <= names
    assert not any(n.startswith(("tests/", "configs/", "deploy/")) for n in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and not any(c.startswith("License ::") for c in classifiers)
    requires = metadata.get_all("Requires-Dist") or []
    # torch only in the extras: installing the daemon never pulls it.
    assert [r for r in requires if r.startswith("torch")] and all("extra ==" in r for r in requires
                                                                  if r.startswith("torch"))
    assert metadata.get_all("Project-URL") is None  # none invented (the project has no public URL)

    # The declaration is the minimum: the release before it rejects the license field.
    older = _venv(tmp_path / "older")
    _run(older / "pip", "install", "-q", "setuptools<77", "wheel")
    result = subprocess.run([older / "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                             tmp_path / "dist-older", src], capture_output=True, text=True, timeout=PIP_TIMEOUT,
                            env=CLEAN_ENV, cwd="/")
    assert result.returncode != 0 and "license" in (result.stdout + result.stderr).lower(), result.stderr[-2000:]


def test_pip_install_into_a_fresh_venv_and_mount(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    bin_dir = _venv(tmp_path / "venv")
    _run(bin_dir / "pip", "install", "-q", src)  # runtime dependencies only: no extras
    python, cli = bin_dir / "python", bin_dir / "cubefs-fuse"
    assert subprocess.run([python, "-c", "import torch"], capture_output=True, env=CLEAN_ENV, cwd="/").returncode != 0
    assert "example-config" in _run(cli, "--help")
    assert "example-config" in _run(cli, "mount", "--help")  # where the examples are
    # cube_torch is installed (it needs torch only when imported: one ImportError saying so).
    site = Path(_run(python, "-c", "import importlib.util, os; "
                     "print(os.path.dirname(importlib.util.find_spec('cube_torch').origin) + '/..')").strip()).resolve()
    assert (site / "cubefs_fuse" / "py.typed").is_file() and (site / "cube_torch" / "py.typed").is_file()
    assert not str(site).startswith(str(REPO))  # the installed copy, not the worktree
    for name in ("minimal", "nfs-dataset", "cubefs-compatible"):
        printed = json.loads(_run(cli, "example-config", name))
        assert printed == json.loads((REPO / "configs" / f"{name}.json").read_text())
    bad = subprocess.run([cli, "example-config", "nope"], capture_output=True, text=True, env=CLEAN_ENV)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "minimal" in bad.stderr

    # The installed daemon mounts a volume described by its own example config.
    config = json.loads(_run(cli, "example-config"))
    (source := tmp_path / "source").mkdir()
    (source / "hello.txt").write_text("installed\n")
    (mount_point := tmp_path / "mnt").mkdir()
    config.update(mountPoint=str(mount_point), source=str(source), volName=f"pkg-{uuid.uuid4().hex[:8]}",
                  diskCacheDir=str(tmp_path / "cache"), logDir=str(tmp_path / "log"))
    (config_path := tmp_path / "client.json").write_text(json.dumps(config))
    daemon_logs.watch(tmp_path / "log")
    try:
        _run(cli, "mount", "-c", config_path, timeout=120)
        assert (mount_point / "hello.txt").read_text() == "installed\n"
        info = mounts.registered(str(mount_point))
        assert info is not None and Path(str(info["config"])) == config_path
        _run(cli, "umount", mount_point, timeout=120)
        wait_until(lambda: mounts.find_mount(str(mount_point)) is None, timeout=30, what="the unmount")
    finally:
        if mounts.find_mount(str(mount_point)) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(mount_point)], capture_output=True)


# The files of the cube-torch distribution (distributions/cube-torch): cube_torch and the
# wire protocol with what it imports, and nothing else of the daemon (no native code).
CUBE_TORCH_DAEMON_FILES = ["__init__.py", "control/__init__.py", "control/protocol.py", "limits.py", "py.typed",
                           "samples/__init__.py", "samples/checksum.py"]

# Without torch: the ImportError cube_torch raises, and the wire protocol against a live daemon.
WITHOUT_TORCH = """
import importlib.util, json, sys
try:
    import cube_torch
except ImportError as exc:
    error = str(exc)
from cubefs_fuse.control.protocol import ControlClient, read_volume_config
volume = read_volume_config(sys.argv[1])
status = ControlClient(volume.control_socket, timeout=30).status()
print(json.dumps({"error": error, "mount_point": volume.mount_point, "uptime": status["uptime"],
                  "fs": importlib.util.find_spec("cubefs_fuse.fs") is not None}))
"""

# With torch: one epoch of a DataLoader (2 workers) over the mount, and the job's counters.
ONE_EPOCH = """
import json, os, sys
import cubefs_fuse, cube_torch, numpy as np, torch
from torch.utils.data import DataLoader, Dataset

class Files(Dataset):
    def __init__(self, root):
        self.paths = sorted(os.path.join(root, name) for name in os.listdir(root))
    def train_data_list(self):
        return np.array(self.paths)
    def __len__(self):
        return len(self.paths)
    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return f.read()

loader = DataLoader(Files(sys.argv[1]), batch_size=4, num_workers=2, collate_fn=list)
read = sum(len(batch) for batch in loader)
stats = cube_torch.stats()
print("RESULT " + json.dumps({"read": read, "requests": stats["cumulative"]["requests"] if stats else None,
                              "cube_torch": cube_torch.__file__, "cubefs_fuse": cubefs_fuse.__file__}))
"""


def test_cube_torch_installs_alone_without_a_compiler(tmp_path: Path, make_mount: Callable[..., Mount]) -> None:
    src = _source_copy(tmp_path / "src")
    shutil.copytree(REPO / "distributions", src / "distributions", symlinks=True)
    bin_dir = _venv(tmp_path / "venv")
    # A training image: Python and pip, no compiler, no pkg-config (so no FUSE headers found).
    env = {**CLEAN_ENV, "PATH": str(bin_dir), "CC": "/bin/false", "CXX": "/bin/false"}
    assert not any(shutil.which(tool, path=env["PATH"]) for tool in ("gcc", "cc", "pkg-config"))

    def run(*args: str | Path, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=PIP_TIMEOUT,
                              env={**env, **(extra or {})}, cwd="/")

    # The daemon's distribution cannot be installed here: it compiles the FUSE session.
    daemon = run(bin_dir / "pip", "install", "-q", "--no-deps", src)
    assert daemon.returncode != 0 and "needs libfuse 3's headers and pkg-config" in daemon.stdout + daemon.stderr
    # cube-torch can.  Its dependencies are binary wheels; torch, the training image's own,
    # is not installed into this venv (minutes for its 190 MB wheel on a small machine):
    # the run with torch below borrows the test environment's.
    installed = run(bin_dir / "pip", "install", "-q", "--no-deps", src / "distributions" / "cube-torch",
                    "numpy", "xxhash")
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = Path(run(bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())
    shipped = sorted(str(p.relative_to(site / "cubefs_fuse")) for p in (site / "cubefs_fuse").rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)
    assert shipped == CUBE_TORCH_DAEMON_FILES
    assert (site / "cube_torch" / "py.typed").is_file() and not list(site.glob("cubefs_fuse*/**/*.so"))

    m = make_mount(profile="ai_prefetch")
    for i in range(12):
        (m.source / f"{i:02d}.bin").write_bytes(os.urandom(1000 + i))
    m.mount()
    vol = m.config()["volName"]
    bare = run(bin_dir / "python", "-c", WITHOUT_TORCH, vol)
    assert bare.returncode == 0, bare.stderr[-3000:]
    report = json.loads(bare.stdout)
    assert report["error"].startswith("cube_torch needs PyTorch, which is not installed")
    assert report["mount_point"] == str(m.mount_point) and report["uptime"] >= 0 and report["fs"] is False

    # torch from the test environment on PYTHONPATH, which loads no .pth file: the editable
    # cubefs_fuse there stays out, cube_torch and cubefs_fuse are the venv's.
    torch_site = sysconfig.get_paths()["purelib"]
    epoch = run(bin_dir / "python", "-c", ONE_EPOCH, m.mount_point, extra={"PYTHONPATH": torch_site, "VOL_NAME": vol})
    assert epoch.returncode == 0, epoch.stderr[-3000:]
    [line] = [line for line in epoch.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert Path(result["cube_torch"]).is_relative_to(site) and Path(result["cubefs_fuse"]).is_relative_to(site)
    assert result["read"] == 12 and result["requests"] == 12, (result, epoch.stderr[-3000:])
    m.umount()
