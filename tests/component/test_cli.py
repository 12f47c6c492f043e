"""The command line as users run it: real `python -m cubefs_fuse` subprocesses, for the
mistakes caught before anything is mounted (tests/mounted/test_cli_mounts.py has the rest).

Every user mistake must be exactly one line on stderr naming the problem, exit code 2,
no traceback, and nothing left mounted or running (tests/cli_checks.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cubefs_fuse import __version__
from tests.cli_checks import ERROR, FOREGROUND, Env, leftovers
from tests.helpers import cli


# -- bad configs ------------------------------------------------------------------------


@FOREGROUND
def test_unknown_key_suggests_the_closest(env: Env, foreground: bool) -> None:
    env.write(memCachSize="1GiB")
    assert env.fails(foreground=foreground) == (
        f"config file {str(env.config_path)!r}: unknown key 'memCachSize' (did you mean 'memCacheSize'?)")


@FOREGROUND
def test_wrong_type(env: Env, foreground: bool) -> None:
    env.write(exporterPort=[9500])
    message = env.fails(foreground=foreground)
    assert message.endswith("key 'exporterPort': expected an integer, got list [9500]")


@FOREGROUND
def test_missing_source_key(env: Env, foreground: bool) -> None:
    env.write(source=None)
    assert env.fails(foreground=foreground).endswith("missing required key 'source'")


@FOREGROUND
def test_source_does_not_exist(env: Env, foreground: bool) -> None:
    env.write(source=str(env.base / "nowhere"))
    assert env.fails(foreground=foreground) == f"key 'source': {str(env.base / 'nowhere')!r} does not exist"


@FOREGROUND
def test_source_is_a_file(env: Env, foreground: bool) -> None:
    env.write(source=str(env.source / "f.txt"))
    assert env.fails(foreground=foreground) == f"key 'source': {str(env.source / 'f.txt')!r} is not a directory"


@FOREGROUND
def test_mount_point_missing(env: Env, foreground: bool) -> None:
    missing = env.base / "nomnt"
    env.write(mountPoint=str(missing))
    message = env.fails(foreground=foreground, mount_point=missing)
    assert message == f"key 'mountPoint': {str(missing)!r} does not exist or is not a directory"


@FOREGROUND
def test_mount_point_not_empty(env: Env, foreground: bool) -> None:
    (env.mount_point / "leftover").write_text("x")
    env.write()
    assert env.fails(foreground=foreground) == f"key 'mountPoint': {str(env.mount_point)!r} is not empty"


@FOREGROUND
def test_cache_dir_under_a_regular_file(env: Env, foreground: bool) -> None:
    blocker = env.base / "file"
    blocker.write_text("x")
    env.write(diskCacheDir=str(blocker / "cache"))
    assert env.fails(foreground=foreground) == (
        f"key 'diskCacheDir': cannot create {str(blocker / 'cache')!r}: Not a directory")


@FOREGROUND
@pytest.mark.parametrize(("key", "value", "says"), [
    ("memCacheSize", "lots", "cannot parse 'lots' as a size (examples: 1073741824, \"512MiB\", \"8GiB\", \"8Gi\")"),
    ("memCacheSize", "64bananas", "'64bananas' has an unknown unit 'bananas'; sizes are bytes or a number with "
                                  "KiB, MiB, GiB, TiB (or Ki, Mi, Gi, Ti), all powers of 1024"),
    ("diskCacheSize", "10Gibberish", "'10Gibberish' has an unknown unit 'Gibberish'; sizes are bytes or a "
                                     "number with KiB, MiB, GiB, TiB (or Ki, Mi, Gi, Ti), all powers of 1024"),
    ("diskCacheSize", "10G", "'10G': the unit 'G' means 1000 or 1024 depending on the tool; write 10GiB "
                             "(powers of 1024) or a byte count"),
    ("memCacheSize", "0.5", "'0.5' is not a whole number of bytes (0.5)"),
    ("blockSize", "-4KiB", "size must not be negative, got '-4KiB'"),
])
def test_size_that_does_not_parse(env: Env, foreground: bool, key: str, value: str, says: str) -> None:
    env.write(**{key: value})
    assert env.fails(foreground=foreground) == f"config file {str(env.config_path)!r}: key {key!r}: {says}"


@FOREGROUND
@pytest.mark.parametrize("value", [0, -1, "soon"])
def test_backend_timeout_that_is_not_a_positive_number(env: Env, foreground: bool, value: object) -> None:
    env.write(backendTimeout=value)
    message = env.fails(foreground=foreground)
    assert message.startswith(f"config file {str(env.config_path)!r}: key 'backendTimeout': "), message


@FOREGROUND
def test_invalid_json(env: Env, foreground: bool) -> None:
    env.config_path.write_text('{"mountPoint": "/mnt",\n "volName": ,}')
    message = env.fails(foreground=foreground)
    assert message.startswith(f"config file {str(env.config_path)!r} is not valid JSON: ")
    assert "line 2 column" in message


@FOREGROUND
def test_missing_config_file(env: Env, foreground: bool) -> None:
    assert env.fails(foreground=foreground) == (
        f"cannot read config file {str(env.config_path)!r}: No such file or directory")


# -- help, version, umount ------------------------------------------------------------


def test_version() -> None:
    result = cli("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"cubefs-fuse {__version__}")


@pytest.mark.parametrize("args", [[], ["mount"], ["umount"]], ids=["top", "mount", "umount"])
def test_help(args: list[str]) -> None:
    result = cli(*args, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: cubefs-fuse {' '.join(args)}".rstrip())
    assert result.stderr == ""
    if args == ["mount"]:
        assert "--foreground" in result.stdout and "--config" in result.stdout
    if args == ["umount"]:
        assert "MOUNTPOINT" in result.stdout and "--lazy" in result.stdout


def test_no_command_prints_help_and_fails() -> None:
    result = cli()
    assert result.returncode == 2
    assert "usage: cubefs-fuse" in result.stdout


# Every mistake in the operator commands' command line: (arguments, what the line says).
# "{dir}" is a plain directory, no cubefs-fuse mount.
OPS_MISTAKES = [
    (["warmup", "{dir}"], "give at least one PATH or -f LIST"),
    (["warmup", "{dir}", "/etc/passwd"], "'/etc/passwd' is not under the mount point {dir}"),
    (["warmup", "{dir}", "../escape"], "'../escape' leaves the mount point"),
    (["warmup", "{dir}", "-f", "{dir}/no-such-list"], "cannot read {dir}/no-such-list: No such file or directory"),
    (["warmup", "{dir}", "a"], "{dir} is not a cubefs-fuse mount (see 'cubefs-fuse status')"),
    (["drop-cache"], "give the MOUNTPOINT whose cache to drop (or --samples NAME)"),
    (["drop-cache", "{dir}"], "{dir} is not a cubefs-fuse mount (see 'cubefs-fuse status')"),
    (["drop-cache", "--samples", "a/b", "{dir}"], "--samples 'a/b': a sample cache name is 1-128 of"),
    (["drop-cache", "--samples", "~1000/..", "{dir}"], "--samples '~1000/..': a sample cache name is"),
    (["stats", "{dir}"], "{dir} is not a cubefs-fuse mount (see 'cubefs-fuse status')"),
    (["stats", "{dir}", "-i", "0"], "--interval 0.0: give a positive number of seconds"),
    (["stats", "{dir}", "-i", "nan"], "--interval nan: give a positive number of seconds"),
    (["stats", "{dir}", "-n", "-1"], "--count -1: give a number of intervals, or 0 for no end"),
    (["status", "{dir}"], "{dir} is not a cubefs-fuse mount (see 'cubefs-fuse status')"),
]


@pytest.mark.parametrize(("args", "says"), OPS_MISTAKES, ids=[" ".join(a) for a, _ in OPS_MISTAKES])
def test_operator_command_mistakes_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    result = cli(*[a.format(dir=tmp_path) for a in args])
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{ERROR}{says.format(dir=tmp_path)}"), line
    assert result.returncode == 2, (result.returncode, result.stderr)


@pytest.mark.parametrize("args", [["warmup"], ["stats", "x", "-i", "soon"], ["stats", "x", "-n", "1.5"],
                                  ["drop-cache", "--nope"]])
def test_operator_command_argument_errors_exit_2(args: list[str]) -> None:
    result = cli(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(("cubefs-fuse: error: ", f"cubefs-fuse {args[0]}: error: "))


def test_warmup_summary_of_nothing_found() -> None:
    """A warmup that found no file says so: no "0/0 files ... (100.0%)", no "1 errors"."""
    from cubefs_fuse.opscli import warmup_summary

    report = {"files_total": 0, "files_cached": 0, "bytes_total": 0, "bytes_cached": 0, "cached_percent": 100.0,
              "errors": 1, "elapsed": 0.01, "check": False}
    assert warmup_summary(report, 1) == "no files found under the 1 path given, 1 error, 0.0 s"
    assert warmup_summary({**report, "errors": 0}, 2) == "no files found under the 2 paths given, 0 errors, 0.0 s"
    found = {**report, "files_total": 3, "files_cached": 2, "bytes_total": 300, "bytes_cached": 200,
             "cached_percent": 200 / 3, "check": True}
    assert warmup_summary(found, 1) == "2/3 files, 200 B of 300 B cached (66.7%), 1 error, 0.0 s"
    assert warmup_summary({**found, "files_total": 1, "files_cached": 1, "errors": 0, "check": False}, 1) == (
        "1/1 file, 200 B of 300 B now cached (66.7%), 0 errors, 0.0 s")


def test_umount_of_a_path_that_is_not_mounted(tmp_path: Path) -> None:
    result = cli("umount", str(tmp_path))
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"{ERROR}{tmp_path} is not mounted"]
    assert result.returncode == 2




# -- foot-guns: overlapping paths, a controlSocket that is not a socket, numbers, configDir ----


@FOREGROUND
def test_cache_dir_equal_to_source_writes_nothing_into_the_dataset(env: Env, foreground: bool) -> None:
    before = sorted(p.name for p in env.source.rglob("*"))
    env.write(diskCacheDir=str(env.source))
    message = env.fails(foreground=foreground)
    assert message.startswith(f"key 'diskCacheDir': {str(env.source)!r} is 'source'")
    assert sorted(p.name for p in env.source.rglob("*")) == before


@FOREGROUND
def test_mount_point_inside_source_is_refused(env: Env, foreground: bool) -> None:
    inner = env.source / "mnt"
    inner.mkdir()
    env.write(mountPoint=str(inner))
    message = env.fails(foreground=foreground, mount_point=inner)
    assert message.startswith(f"key 'mountPoint': {str(inner)!r} is inside 'source'")


@FOREGROUND
def test_control_socket_naming_a_file_deletes_nothing(env: Env, foreground: bool) -> None:
    precious = env.base / "precious.txt"
    precious.write_text("keep me")
    env.write(profile="ai_prefetch", configDir=str(env.base), controlSocket=str(precious), volName=f"hc{os.getpid()}")
    assert env.fails(foreground=foreground) == (
        f"key 'controlSocket': {str(precious)!r} exists and is not a socket: refusing to replace it")
    assert precious.read_text() == "keep me"
    assert leftovers({**env.config, "controlSocket": "", "configDir": str(env.base),
                      "volName": f"hc{os.getpid()}"}) == []


@FOREGROUND
def test_missing_config_dir_fails_before_mounting(env: Env, foreground: bool) -> None:
    missing = env.base / "nocfg"
    env.write(profile="ai_prefetch", configDir=str(missing), volName=f"hc{os.getpid()}")
    assert env.fails(foreground=foreground) == f"key 'configDir': {str(missing)!r} does not exist or is not a directory"
    assert not missing.exists()
    assert leftovers({**env.config, "configDir": str(missing), "volName": f"hc{os.getpid()}"}) == []


@FOREGROUND
@pytest.mark.parametrize("text", [
    '{"mountPoint": "/m", "volName": "v", "source": "/s", "memCacheSize": ' + "9" * 5000 + "}",
    "[" * 100_000 + "]" * 100_000,
], ids=["5000-digit number", "deeply nested"])
def test_json_python_cannot_hold_is_one_line(env: Env, foreground: bool, text: str) -> None:
    env.config_path.write_text(text)
    assert env.fails(foreground=foreground).startswith(f"config file {str(env.config_path)!r} is not valid JSON: ")


@FOREGROUND
@pytest.mark.parametrize(("key", "value"), [("exporterPort", "٩٥٠٠"), ("backendThreads", "²"),
                                            ("prefetchThreads", "9" * 5000), ("memCacheSize", "١٢٣"),
                                            ("attrValid", "1e400"), ("backendThreads", 1.5),
                                            ("metaCacheEntries", int("9" * 4000))])
def test_numbers_that_do_not_parse_are_one_line(env: Env, foreground: bool, key: str, value: object) -> None:
    env.write(**{key: value})
    message = env.fails(foreground=foreground)
    assert f"key {key!r}: " in message and len(message) < 300


def test_waiting_for_a_slow_daemon_says_so_and_never_kills_it(capsys: pytest.CaptureFixture[str]) -> None:
    """`mount` shows progress while the detached daemon starts, and on its deadline leaves
    the daemon running (it may be loading a very large NVMe cache)."""
    import subprocess
    import sys

    from cubefs_fuse import cli as cli_module

    read_fd, write_fd = os.pipe()
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cli_module._read_ready(read_fd, slow, 1.5) is None  # no report within the deadline
        progress = capsys.readouterr().err.splitlines()
        assert len(progress) >= 2 and all(f"waiting for the daemon (pid {slow.pid}) to mount" in line
                                          for line in progress), progress
        assert slow.poll() is None  # still running: the caller decides
    finally:
        os.close(write_fd)
        slow.kill()
        slow.wait()


def test_ready_timeout_must_be_a_positive_number() -> None:
    from cubefs_fuse import cli as cli_module

    parser = cli_module.build_parser()
    assert parser.parse_args(["mount", "-c", "x.json", "--ready-timeout", "600"]).ready_timeout == 600.0
    for bad in ("0", "-1", "soon", "1e9"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["mount", "-c", "x.json", "--ready-timeout", bad])
        assert exc.value.code == 2
