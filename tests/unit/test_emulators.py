"""The emulated remotes' parts that need no mount: tools/slowfs's --fail rules and the
benchmark suite's fallback to the Python emulator when the C one cannot be built."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from benchmarks.suite import remote
from tests.emulator_checks import emulator_options
from tools.slowfs import FailRule, SlowFSProcess, first_match


def test_fail_rule_parsing() -> None:
    assert FailRule.parse("a/*.jpg=EIO") == FailRule("a/*.jpg", errno.EIO)
    assert FailRule.parse("x=y=eacces") == FailRule("x=y", errno.EACCES)
    assert FailRule.parse("*=2") == FailRule("*", errno.ENOENT)
    for bad in ("noequals", "=EIO", "a=ENOTANERRNO", "a=0"):
        with pytest.raises(ValueError):
            FailRule.parse(bad)
    rules = [FailRule("a/*", errno.EIO), FailRule("*", errno.EACCES)]
    assert first_match(rules, "a/b/c") == errno.EIO  # '*' crosses '/'; the first rule wins
    assert first_match(rules, "b") == errno.EACCES
    assert first_match([], "b") == 0


def test_suite_falls_back_to_python_when_the_build_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "build.sh"
    broken.write_text("#!/bin/sh\necho 'slowfs-c: gcc is missing' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(remote, "SLOWFS_C_BUILD", broken)
    remote.slowfs_c_binary.cache_clear()
    try:
        name, fs = remote.emulator_process("c", tmp_path, tmp_path / "mnt", **emulator_options())
    finally:
        remote.slowfs_c_binary.cache_clear()  # the next caller builds the real one again
    assert name == "python" and type(fs) is SlowFSProcess and "tools.slowfs" in fs.argv
    assert "warning: cannot build the C emulated remote (slowfs-c: gcc is missing)" in capsys.readouterr().err
    with pytest.raises(ValueError):
        remote.emulator_process("rust", tmp_path, tmp_path / "mnt", **emulator_options())
