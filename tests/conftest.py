"""The test tiers (the one place that says what each needs) and the shared fixtures.

Every test file lives in one tier folder, and its folder is its tier: the hook below gives
each test its tier's marker (``pytest -m unit``), and ``scripts/test.sh TIER...`` runs some
tiers only.  No test file marks or guards itself.

  unit/       one module's logic, in process, on plain files: needs nothing
  component/  layers together over fakes (tests/fakes.py) on trio's virtual clock, or the
              CLI as a subprocess that fails before mounting: needs nothing
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

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

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
