"""The test tiers (the one place that says what each needs) and the shared fixtures.

Every test file lives in one tier folder, and its folder is its tier: the hook below gives
each test its tier's marker (``pytest -m unit``), and ``scripts/test.sh TIER...`` runs some
tiers only.  No test file marks or guards itself.

  unit/       one module's logic, in process, on plain files: needs nothing
  component/  layers together over fakes (tests/fakes.py) on trio's virtual clock, the
              CLI as a subprocess that fails before mounting, or the S3 backend over a
              real S3 server on loopback (tests/s3_servers.py: SeaweedFS from the test
              extra): needs nothing else
  mounted/    real mounts: cubefs-fuse daemons, the emulated remotes (tools/slowfs*) and a
              few tmpfs mounts: needs root and /dev/fuse
  torch/      real DataLoaders (real worker processes) over a real mount: cube_torch, two
              nodes, the benchmark suite: needs root and /dev/fuse

Without root or /dev/fuse the mounted and torch tests FAIL, each with a one-line reason,
so that no run (CI's included) can pass without them.  Only when asked, with
``CUBEFS_FUSE_SKIP_MOUNTED=1`` in the environment, they are skipped instead, with the
same reason.  Where root and /dev/fuse are there the variable changes nothing.

A mounted or torch test also fails when a daemon it ran logged an ERROR record or a
traceback it did not declare with ``@pytest.mark.expected_daemon_errors(REGEX, ...)``
(the ``daemon_log_check`` fixtures below, tests/daemon_logs.py); and in every tier a
warning is an error (pyproject.toml's ``filterwarnings``).
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse import mounts
from tests import daemon_logs
from tests.cli_checks import Env
from tests.helpers import Mount, SlowMount, force_unmount, free_port

TIERS = ("unit", "component", "mounted", "torch")
NEEDS_ROOT_AND_FUSE = ("mounted", "torch")
SKIP_ENV = "CUBEFS_FUSE_SKIP_MOUNTED"
TESTS = Path(__file__).resolve().parent


def tier_of(path: Path) -> str | None:
    """The tier of a file under tests/: the tier folder it is in (None: none, or not under tests/)."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def missing_root_or_fuse() -> str:
    """What this machine lacks for the mounted and torch tiers, as words ('' if nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append(f"not root (euid {os.geteuid()})")
    if not os.path.exists("/dev/fuse"):
        missing.append("no /dev/fuse")
    return " and ".join(missing)


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.hookimpl(tryfirst=True)  # before any fixture (module-scoped mounts included) is set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    tier = tier_of(item.path)
    if item.path.resolve().is_relative_to(TESTS) and tier is None:
        pytest.fail(f"{item.path.relative_to(TESTS.parent)} is in no tier folder: move it to tests/{{"
                    f"{','.join(TIERS)}}}/ (see tests/conftest.py)", pytrace=False)
    missing = missing_root_or_fuse() if tier in NEEDS_ROOT_AND_FUSE else ""
    if missing and os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{tier} tier: needs root and /dev/fuse: {missing} ({SKIP_ENV}=1)")
    if missing:
        pytest.fail(f"{tier} tier: needs root and /dev/fuse: {missing} (set {SKIP_ENV}=1 to skip these "
                    "tests instead)", pytrace=False)


def _only_in_mounting_tiers(request: pytest.FixtureRequest, fixture: str) -> None:
    """Fixtures that mount refuse tests of tiers that promise to need no root and no FUSE."""
    tier = tier_of(request.node.path)
    if tier not in NEEDS_ROOT_AND_FUSE:
        pytest.fail(f"{fixture} mounts, but this test is in the {tier} tier: move it to "
                    f"tests/{' or tests/'.join(NEEDS_ROOT_AND_FUSE)}", pytrace=False)


# -- nothing left behind ------------------------------------------------------------------

# Set in this process's environment before any test runs, so every daemon a test starts
# carries it: a live daemon is this run's if its environment has this run's value.
RUN_MARK = "CUBEFS_FUSE_TEST_RUN"
VOLUME_FILES = "/tmp/cube_torch.config.*"
# Client configs are small; a larger .json under the run's directory is a dataset's file.
MAX_CONFIG_BYTES = 1 << 20


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(RUN_MARK, secrets.token_hex(8))


def _ours(pid: object) -> bool:
    """True if ``pid`` is a live process of this run."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{RUN_MARK}={os.environ[RUN_MARK]}".encode() in environ


def _json(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_CONFIG_BYTES))
    except (OSError, ValueError, RecursionError):  # the config tests' broken files among them
        return {}
    return data if isinstance(data, dict) else {}


def _shared_state() -> dict[str, dict[str, Any]]:
    """What daemons leave in shared places, by name, with what it says of its daemon: the
    runtime directories' entries (control and data sockets, token files, registry entries),
    the per-volume files in /tmp, and the mounts `cubefs-fuse status` lists (mounts.survey
    is what it prints)."""
    found: dict[str, dict[str, Any]] = {}
    for directory in dict.fromkeys([mounts.SYSTEM_RUNTIME_DIR, mounts.runtime_dir()]):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if not name.endswith(".tmp"):  # a write in progress (renamed into place at once)
                path = os.path.join(directory, name)
                found[path] = _json(path) if name.startswith("mount-") else {}
    for path in glob.glob(VOLUME_FILES):
        data = _json(path)
        found[path] = {"mountPoint": data.get("mount_point"), "pid": data.get("pid")}
    for state in mounts.survey():
        found[f"status: {state.mount_point} ({state.state})"] = {**(state.info or {}),
                                                                "mountPoint": state.mount_point}
    return found


def _this_runs_volumes(base: Path) -> tuple[set[str], set[str]]:
    """The volume names and control sockets of the client configs under this run's
    temporary directory (every test writes its configs there), mounts skipped."""
    mounted = {e.mount_point for e in mounts.mount_table()}
    volumes: set[str] = set()
    sockets: set[str] = set()
    for directory, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if os.path.join(directory, d) not in mounted]
        for name in files:
            path = os.path.join(directory, name)
            try:
                if not name.endswith(".json") or not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block
                    continue
            except OSError:
                continue
            config = _json(path)
            if isinstance(config.get("volName"), str) and "mountPoint" in config:
                volumes.add(config["volName"])
                if isinstance(config.get("controlSocket"), str):
                    sockets.add(config["controlSocket"])
    return volumes, sockets


def _made_by_this_run(name: str, what: dict[str, Any], base: Path, volumes: set[str], sockets: set[str]) -> bool:
    """True if ``name`` names a mount point under ``base`` or a volume of this run's configs."""
    mount_point = what.get("mountPoint")
    if isinstance(mount_point, str) and Path(mount_point).is_relative_to(base):
        return True
    if what.get("volName") in volumes:  # a registry entry, a line of status
        return True
    directory, file = os.path.split(name)
    if directory == "/tmp" and file.removeprefix("cube_torch.config.") in volumes:
        return True
    if any(file.endswith(suffix) and file.removesuffix(suffix) in volumes
           for suffix in (".sock.data", ".sock.handover", ".sock.keeper", ".sock", ".token")):
        return True
    return any(name.removesuffix(suffix) in sockets for suffix in ("", ".data", ".handover", ".keeper"))


def _held_by_another_run(name: str, what: dict[str, Any], live: dict[str, object]) -> bool:
    """True if a live daemon that is not this run's holds ``name`` (another run on the
    machine may use the same volume name)."""
    pid = what.get("pid", live.get(name))
    return isinstance(pid, int) and mounts.pid_alive(pid) and not _ours(pid)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fail the run if it leaves a socket, token file, registry entry or volume file, or a
    mount in `status`, behind (docs/operations.md, "Leftovers").  Only what this run made
    counts: what was there when it started is ignored, and of what appeared meanwhile only
    what names a volume or a mount point of a client config under this run's temporary
    directory (other runs on the machine, with their own daemons, are not blamed)."""
    before = set(_shared_state())
    yield
    base = tmp_path_factory.getbasetemp().resolve()
    volumes, sockets = _this_runs_volumes(base)
    live: dict[str, object] = {}  # socket or token path -> pid of the live daemon that holds it
    for state in mounts.survey():
        info = state.info or {}
        if state.state == "live" and isinstance(info.get("controlSocket"), str):
            for path in (info["controlSocket"], mounts.data_socket_path(info["controlSocket"]), info.get("tokenFile")):
                if isinstance(path, str) and path:
                    live[path] = info.get("pid")
    left = sorted(name for name, what in _shared_state().items()
                  if name not in before and _made_by_this_run(name, what, base, volumes, sockets)
                  and not _held_by_another_run(name, what, live))
    if left:
        pytest.fail(f"the tests left {len(left)} thing(s) behind (a daemon killed without 'cubefs-fuse umount', "
                    f"or a cleanup path that misses a file): " + "; ".join(left), pytrace=False)


# -- fixtures -----------------------------------------------------------------------------


def _fail_on_daemon_errors(node: pytest.Item | pytest.Collector, when: str) -> None:
    """Fail if a daemon's log gained an ERROR record or a traceback that ``node`` (or its
    module) did not declare with ``@pytest.mark.expected_daemon_errors(REGEX, ...)``."""
    expected = [p for mark in node.iter_markers("expected_daemon_errors") for p in mark.args]
    found = daemon_logs.unexpected(expected)
    if found:
        pytest.fail(f"a daemon logged {len(found)} unexpected error(s) {when} (declare one a test provokes on "
                    f"purpose with @pytest.mark.expected_daemon_errors(REGEX)):\n\n" + "\n\n".join(found),
                    pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def daemon_log_check_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a module's teardown (its module-scoped daemons unmounted): their last records."""
    yield
    if tier_of(request.node.path) in NEEDS_ROOT_AND_FUSE:
        _fail_on_daemon_errors(request.node, "while the module's fixtures were torn down")


@pytest.fixture(autouse=True)
def daemon_log_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each mounted and torch test (its own daemons gone, a module's still running):
    what the daemons logged since the last check (tests/daemon_logs.py)."""
    yield
    if tier_of(request.node.path) in NEEDS_ROOT_AND_FUSE:
        _fail_on_daemon_errors(request.node, "during this test")


@pytest.fixture
def make_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Mount]]:
    """Factory: ``make_mount(**config_overrides)`` returns an unmounted Mount whose
    ``source`` directory the test fills before calling ``mount()``."""
    _only_in_mounting_tiers(request, "make_mount")
    created: list[Mount] = []

    def factory(**overrides: Any) -> Mount:
        base = tmp_path / f"m{len(created)}"
        m = Mount(base, base / "source", base / "mnt", base / "cache", base / "client.json", free_port(), overrides)
        for d in (m.source, m.mount_point):
            d.mkdir(parents=True)
        created.append(m)
        return m

    yield factory
    for m in created:
        force_unmount(m)


@pytest.fixture
def make_slow_mount(make_mount: Callable[..., Mount]) -> Iterator[Callable[..., SlowMount]]:
    """Factory: ``make_slow_mount(latency_us=0, fail=(), fail_read=(), **config_overrides)``
    starts slowfs over a fresh ``real`` directory on the Mount's source path and returns the
    (not yet mounted) daemon side.  Teardown removes the daemon before the slowfs under it."""
    from tools.slowfs import SlowFSProcess

    started: list[SlowMount] = []

    def factory(*, latency_us: float = 0.0, fail: tuple[str, ...] = (), fail_read: tuple[str, ...] = (),
                **overrides: Any) -> SlowMount:
        m = make_mount(**overrides)
        real = m.base / "real"
        real.mkdir()
        fs = SlowFSProcess(real, m.source, latency_us=latency_us, fail=fail, fail_read=fail_read)
        fs.start()
        started.append(SlowMount(m, real, fs))
        return started[-1]

    yield factory
    for s in started:
        force_unmount(s.mount)
        s.slowfs.stop()


@pytest.fixture
def env(tmp_path: Path) -> Env:
    """A valid config for ``cubefs-fuse mount`` in tmp_path, to break one thing at a time."""
    return Env(tmp_path)
