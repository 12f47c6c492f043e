"""Mounted: the daemon never reads outside its source (docs/contracts.md, "Never outside the
source"), whatever an unprivileged user who can write in the source does.

The layout (``base`` is traversable by everyone; ``src`` belongs to nobody)::

    base/src/                 the source, owned by uid 65534 (nobody), who swaps things in it
    base/private/dir/secret   0600 root, in a 0700 root directory: what must never be read
    base/mnt/m/               the mount point
    base/mnt/private/dir/secret   a world-readable DECOY
    base/elsewhere/           nobody's, outside the source (a directory moved out lands here)

Symlinks are made *relative* (``../private/dir``): resolved by the daemon from
``base/src`` they reach the secret; resolved by the kernel from the mount point they reach
the decoy.  So reading the decoy through the mount proves the daemon served the link as a
link and the kernel followed it, while the secret's bytes could only come from the daemon
following it.  An inotify watch on the secret's directory sees any open or read of it
(or of the directory itself); the detector is shown to work at the end of each test.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import REPO, Mount, cli, force_unmount, free_port, metric, wait_until

NOBODY = 65534
SECRET = b"root-only secret bytes " * 100
DECOY = b"world-readable decoy"
FILE = b"a file inside the source " * 50
OTHER = b"another file inside the source " * 40

# inotify(7): the events that mean a file (or directory) was opened or read.
IN_ACCESS, IN_OPEN = 0x1, 0x20
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)


class Watch:
    """An inotify watch for IN_OPEN | IN_ACCESS on one directory (its files included)."""

    def __init__(self, directory: Path) -> None:
        self.fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_OPEN | IN_ACCESS)
        assert wd >= 0, os.strerror(ctypes.get_errno())

    def events(self) -> list[tuple[int, str]]:
        """(mask, name) of every event since the last call ('' names the directory itself)."""
        out: list[tuple[int, str]] = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            offset = 0
            while offset < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16:offset + 16 + length].rstrip(b"\0").decode()
                out.append((mask, name))
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)


# nobody's actions run in a child that drops every privilege first (the interpreter may live
# where only root can read, so it starts as root; the script uses the standard library only).
AS_NOBODY = f"""
import os, sys, json
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
assert os.getuid() == os.geteuid() == {NOBODY}
action, args = sys.argv[1], sys.argv[2:]
if action == "swap":            # rename DIR away (to ASIDE), put a symlink to TARGET in its place
    directory, aside, target = args
    os.rename(directory, aside)
    os.symlink(target, directory)
elif action == "rename":
    os.rename(*args)
elif action == "read":          # print what reading PATH gives: bytes (hex) or the errno
    try:
        with open(args[0], "rb") as f:
            print(json.dumps({{"data": f.read().hex()}}))
    except OSError as exc:
        print(json.dumps({{"errno": exc.errno}}))
"""


def as_nobody(*args: str) -> str:
    result = subprocess.run([sys.executable, "-c", AS_NOBODY, *args], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return result.stdout


def read_as_nobody(path: Path) -> bytes | int:
    """The bytes nobody reads at ``path``, or the errno the read failed with."""
    answer = json.loads(as_nobody("read", str(path)))
    return bytes.fromhex(answer["data"]) if "data" in answer else int(answer["errno"])


def read_as_root(path: Path) -> bytes | int:
    try:
        return path.read_bytes()
    except OSError as exc:
        assert exc.errno is not None
        return exc.errno


class Layout:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.src, self.elsewhere = base / "src", base / "elsewhere"
        self.secret_dir, self.decoy_dir = base / "private" / "dir", base / "mnt" / "private" / "dir"
        self.mount_point = base / "mnt" / "m"
        for d in (self.src, self.elsewhere, self.secret_dir, self.decoy_dir, self.mount_point):
            d.mkdir(parents=True)
        (self.secret_dir / "secret").write_bytes(SECRET)
        (self.secret_dir / "secret").chmod(0o600)
        (base / "private").chmod(0o700)
        self.secret_dir.chmod(0o700)
        (self.decoy_dir / "secret").write_bytes(DECOY)
        (self.src / "d").mkdir()
        (self.src / "d" / "file").write_bytes(FILE)
        (self.src / "d" / "other").write_bytes(OTHER)
        for path in (self.src, self.src / "d", self.src / "d" / "file", self.src / "d" / "other", self.elsewhere):
            os.chown(path, NOBODY, NOBODY)
        self.watch = Watch(self.secret_dir)
        self.mounts: list[Mount] = []

    def mount(self, **overrides: Any) -> Mount:
        m = Mount(self.base, self.src, self.mount_point, self.base / "cache", self.base / "client.json",
                  free_port(), {"volName": f"confine-{uuid.uuid4().hex[:8]}", **overrides})
        self.mounts.append(m)
        m.mount()
        return m

    def assert_secret_never_opened(self) -> None:
        assert self.watch.events() == [], "something opened or read the secret's directory"
        # The detector works: reading the secret here is seen.
        assert (self.secret_dir / "secret").read_bytes() == SECRET
        assert (IN_OPEN, "secret") in self.watch.events()


@pytest.fixture
def layout() -> Iterator[Layout]:
    # Not under pytest's tmp_path: its parents are 0700 root, and nobody must reach the mount.
    base = Path(tempfile.mkdtemp(prefix="cubefs-confine-"))
    base.chmod(0o755)
    lay = Layout(base)
    yield lay
    for m in lay.mounts:
        force_unmount(m)
    lay.watch.close()
    shutil.rmtree(base, ignore_errors=True)


def test_directory_swapped_for_a_symlink_within_the_ttl(layout: Layout) -> None:
    # The kernel and the daemon keep "d" as a directory for 60 s: every request below
    # reaches the daemon with paths under "d", now a symlink to the secret's directory.
    m = layout.mount(attrValid=60, lookupValid=60)
    d = m.mount_point / "d"
    assert (d / "file").read_bytes() == FILE  # the daemon caches "d" (its fd included)
    assert sorted(os.listdir(d)) == ["file", "other"]  # and the attributes of d/other
    as_nobody("swap", str(layout.src / "d"), str(layout.src / "d.old"), "../private/dir")
    assert os.path.realpath(layout.src / "d") == str(layout.secret_dir)  # the trap is set
    for _ in range(3):  # an attacker retries: the first failure must not open the way
        assert read_as_nobody(d / "secret") == errno.ELOOP
        assert read_as_root(d / "secret") == errno.ELOOP
        # d/other's attributes are cached, its blocks are not: the read goes through the
        # cached descriptor of "d", which no longer is "d".
        assert read_as_root(d / "other") == errno.ELOOP
    samples = m.scrape()
    assert metric(samples, "cubefs_fuse_backend_errors_total", op="stat", errno="ELOOP") >= 6
    assert metric(samples, "cubefs_fuse_backend_errors_total", op="read", errno="ELOOP") >= 3
    assert metric(samples, "cubefs_fuse_backend_read_bytes_total") == len(FILE)
    layout.assert_secret_never_opened()


def test_directory_swapped_for_a_symlink_after_the_ttl(layout: Layout) -> None:
    m = layout.mount(attrValid=1, lookupValid=1)
    d = m.mount_point / "d"
    assert (d / "file").read_bytes() == FILE
    as_nobody("swap", str(layout.src / "d"), str(layout.src / "d.old"), "../private/dir")
    seen: list[bytes | int] = []

    def kernel_follows_the_link() -> bool:
        seen.append(read_as_root(d / "secret"))
        return seen[-1] == DECOY

    # Once the TTL has passed, "d" is a symlink at the mount too and the kernel resolves it
    # (relative to the mount point: the decoy) for the caller.
    wait_until(kernel_follows_the_link, timeout=30, what="d to be served as a symlink")
    assert SECRET not in seen and set(seen) <= {DECOY, errno.ELOOP}, seen
    assert os.readlink(d) == "../private/dir"
    assert read_as_nobody(d / "secret") == DECOY
    assert read_as_root(m.mount_point / "d.old" / "file") == FILE
    layout.assert_secret_never_opened()


def test_cached_directory_moved_out_of_the_source(layout: Layout) -> None:
    m = layout.mount(attrValid=60, lookupValid=60)
    d = m.mount_point / "d"
    assert (d / "file").read_bytes() == FILE
    assert sorted(os.listdir(d)) == ["file", "other"]
    # "d" (whose descriptor the daemon holds) leaves the source tree.
    as_nobody("rename", str(layout.src / "d"), str(layout.elsewhere / "d"))
    for _ in range(3):
        # d/other is now outside the source: its attributes are cached, the daemon must
        # not read it through the descriptor it holds.
        assert read_as_root(d / "other") == errno.ENOENT
        assert read_as_nobody(d / "other") == errno.ENOENT
    assert metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total") == len(FILE)
    layout.assert_secret_never_opened()


def test_warmup_and_plans_naming_paths_through_symlinks(layout: Layout, tmp_path: Path) -> None:
    os.symlink("../private/dir", layout.src / "link")
    os.symlink("../../private/dir/secret", layout.src / "d" / "filelink")
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    m = layout.mount(profile="ai_prefetch", configDir=str(config_dir), memCacheSize="64MiB")

    def warmup(*paths: str) -> dict[str, Any]:
        result = cli("warmup", str(m.mount_point), *paths, "--json")
        report: dict[str, Any] = json.loads(result.stdout)
        return report

    through = warmup("link/secret")
    assert through["errors"] == 1 and through["files_total"] == 0
    # A symlink named itself, or met in a subtree, is a symlink: not a file, not followed.
    links = warmup("link", "d/filelink", str(m.mount_point))  # the mount point: the whole volume
    assert links["errors"] == 0 and links["files_total"] == 2 and links["bytes_total"] == len(FILE) + len(OTHER)

    client = ControlClient(read_volume_config(m.config()["volName"], str(config_dir)).control_socket)
    dataset = client.register_dataset(["link/secret", "d/filelink", "d/file"])
    client.register_job("confine", 0, os.getpid())
    order = (0, 1, 2, 0, 1, 2)
    client.submit_plan("confine", 0, 1, dataset, b"".join(i.to_bytes(4, "little") for i in order), "<u4")

    def refused() -> float:
        return metric(m.scrape(), "cubefs_fuse_backend_errors_total", op="stat", errno="ELOOP")

    wait_until(lambda: refused() >= 2, timeout=30, what="the plan's stat of link/secret to be refused")
    samples = m.scrape()
    assert metric(samples, "cubefs_fuse_backend_read_bytes_total") == len(FILE) + len(OTHER)
    assert metric(samples, "cubefs_fuse_backend_errors_total", op="read", errno="ELOOP") == 0
    layout.assert_secret_never_opened()


def test_symlinks_inside_the_source_still_work(layout: Layout) -> None:
    os.symlink("file", layout.src / "d" / "rel")
    os.symlink("d", layout.src / "dirlink")
    os.symlink("../private/dir/secret", layout.src / "out")
    m = layout.mount()
    d = m.mount_point / "d"
    assert os.readlink(d / "rel") == "file" and os.path.islink(d / "rel")
    assert (d / "rel").read_bytes() == FILE  # the kernel follows it, the daemon serves d/file
    assert read_as_nobody(d / "rel") == FILE
    assert sorted(os.listdir(m.mount_point / "dirlink")) == ["file", "other", "rel"]
    assert (m.mount_point / "dirlink" / "other").read_bytes() == OTHER
    # A link out of the source resolves, for the caller, from the mount point: the decoy.
    assert os.readlink(m.mount_point / "out") == "../private/dir/secret"
    assert (m.mount_point / "out").read_bytes() == DECOY
    layout.assert_secret_never_opened()
