"""Shared fixtures: real daemons on real FUSE mounts (the helpers they use are in tests/helpers.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli_checks import Env
from tests.helpers import Mount, SlowMount, force_unmount, free_port


@pytest.fixture
def make_mount(tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """Factory: ``make_mount(**config_overrides)`` returns an unmounted Mount whose
    ``source`` directory the test fills before calling ``mount()``."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.fail("mounted tests need root and /dev/fuse (run scripts/test.sh as root)")
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
