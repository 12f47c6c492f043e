"""Mounted: the operator commands (status, warmup, drop-cache, stats) against real daemons.

Each test mounts a real daemon with ``"profile": "ai_prefetch"`` through the real CLI and
runs ``cubefs-fuse status|warmup|drop-cache|stats`` as subprocesses, the way an operator
would.  Expected numbers come from the files the test creates and from /metrics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cubefs_fuse import mounts
from cubefs_fuse.cache.disk import DIR_SLACK
from cubefs_fuse.control.protocol import ControlClient, config_file_path
from tests.helpers import REPO, Mount, cli, kill_for_good, metric, wait_until, write_tree

# Small RAM tier: the tests' files are a few hundred KiB in all.
AI_PREFETCH = {"profile": "ai_prefetch", "memCacheSize": "64MiB"}
# The unprivileged user the permission test runs the CLI as ("nobody" on Debian).
NOBODY = 65534


# Runs the CLI as NOBODY.  The interpreter here may live in a directory only root can read
# (a pyenv build under /root), so a preexec_fn setuid before exec cannot start it: this
# script imports the CLI as root, then drops every privilege before doing anything.
AS_NOBODY = f"""
import os, sys
from cubefs_fuse import cli
os.setgroups([])
os.setgid({NOBODY})
os.setuid({NOBODY})
assert os.getuid() == os.geteuid() == {NOBODY}
sys.exit(cli.main(sys.argv[1:]))
"""


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _tree(source: Path) -> dict[str, bytes]:
    """a/ holds 6 small files, a/deep/ 2 multi-block files, b/ 2 files; returns relative path -> data."""
    rng = np.random.default_rng(7)
    files = {f"a/f{i}": rng.bytes(3000 + 1000 * i) for i in range(6)}
    files |= {"a/deep/big0": rng.bytes(1_300_000), "a/deep/big1": rng.bytes(2_100_000)}
    files |= {"b/g0": rng.bytes(5000), "b/g1": rng.bytes(7000)}
    return write_tree(source, files)


def _mount(make_mount: Callable[..., Mount], **overrides: Any) -> tuple[Mount, dict[str, bytes]]:
    m = make_mount(volName=_unique("ops"), **overrides)
    files = _tree(m.source)
    m.mount()
    return m, files


def _json(*args: str) -> Any:
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _check(m: Mount, *paths: str) -> dict[str, Any]:
    report: dict[str, Any] = _json("warmup", str(m.mount_point), *paths, "--check", "--json")
    assert report["done"] and report["check"] and report["errors"] == 0
    return report


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str, code: int = 1) -> str:
    """One line on stderr, no traceback, exit ``code``: 2 for a mistake in the command line,
    1 for a failure (a daemon that is not running, a refused control socket)."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_status_one_mount_and_all_mounts(make_mount: Callable[..., Mount]) -> None:
    m, files = _mount(make_mount, **AI_PREFETCH)
    plain = make_mount(volName=_unique("plain"))  # a cubefs-fuse mount without ai_prefetch
    (plain.source / "a").mkdir()
    (plain.source / "a" / "f").write_bytes(b"plain" * 100)
    plain.mount()
    socket_path = mounts.registered(str(m.mount_point))["controlSocket"]  # type: ignore[index]
    client = ControlClient(socket_path)
    planned = [f"a/f{i}" for i in range(6)]
    assert cli("warmup", str(m.mount_point), "a").returncode == 0
    # This test process is the job: its opens are attributed to (job, rank 1).
    job = _unique("job")
    client.register_job(job, 1, os.getpid())
    dataset = client.register_dataset(planned)
    client.submit_plan(job, 1, 3, dataset, np.arange(6, dtype="<u4").tobytes(), "<u4")
    for rel in planned + ["b/g0", "b/g1"]:  # planned files (warm, hits), then two cold ones (misses)
        assert m.path(rel).read_bytes() == files[rel]

    [report] = _json("status", str(m.mount_point), "--json")
    assert report["control_api"] is True
    assert (report["volume"], report["source"], report["mount_point"]) == (
        m.config()["volName"], str(m.source), str(m.mount_point))
    assert report["pid"] == m.pid() and report["uptime"] > 0
    assert report["keeper"] == mounts.registered(str(m.mount_point))["keeper"] != m.pid()  # type: ignore[index]
    ram, disk = report["cache"]["ram"], report["cache"]["disk"]
    assert ram["limit_bytes"] == 64 * 2**20 and disk["limit_bytes"] > 0
    warmed = sum(len(files[p]) for p in files if p.startswith("a/")) + len(files["b/g0"]) + len(files["b/g1"])
    assert ram["used_bytes"] >= warmed  # everything read or warmed is in RAM (64 MiB holds it all)
    samples = m.scrape()
    assert ram["used_bytes"] == metric(samples, "cubefs_fuse_cache_used_bytes", tier="ram")
    assert disk["used_bytes"] == metric(samples, "cubefs_fuse_cache_used_bytes", tier="disk")
    assert report["hits"]["requests"] == 8 and report["hits"]["misses"] == 2
    assert report["hits"]["hit_rate"] == 0.75
    # What applications read, every path: here the mount's file requests alone, as /metrics says.
    reads = report["reads"]
    assert (reads["requests"], reads["hits"], reads["misses"], reads["hit_rate"]) == (8, 6, 2, 0.75)
    assert [reads["by_path"][p]["requests"] for p in ("mount", "fastpath", "sample_cache")] == [8, 0, 0]
    assert reads["bytes"] == metric(samples, "cubefs_fuse_read_bytes_total") \
        == metric(samples, "cubefs_fuse_app_bytes_total", path="mount")
    assert metric(samples, "cubefs_fuse_app_requests_total", path="mount", result="miss") == 2
    assert report["counters"]["file_requests"] == metric(samples, "cubefs_fuse_file_requests_total") == 8
    [job_row] = report["jobs"]
    assert (job_row["job"], job_row["rank"], job_row["pid"]) == (job, 1, os.getpid())
    assert (job_row["requests"], job_row["hits"], job_row["hit_rate"]) == (8, 6, 0.75)
    [plan] = report["plans"]
    assert (plan["job"], plan["rank"], plan["epoch"], plan["samples"], plan["cursor"]) == (job, 1, 3, 6, 6)

    table = cli("status", str(m.mount_point))
    assert table.returncode == 0, table.stderr
    text = table.stdout
    assert str(m.mount_point) in text and f"volume {m.config()['volName']}" in text
    assert re.search(r"ram\s+\S+ \w*B\s+64\.0 MiB", text), text
    assert re.search(r"disk\s+", text) and "uptime " in text
    assert "requests 8 (mount 8, fast path 0, sample cache 0)  hits 6  misses 2  hit rate 75.00%" in text, text
    assert "hit rate 75.00%" in text
    assert re.search(rf"{job}\s+1\s+{os.getpid()}\s+8\s+75\.00%\s+3\s+6/6", text), text

    everything = _json("status", "--json")
    by_mount = {r["mount_point"]: r for r in everything}
    assert by_mount[str(m.mount_point)]["jobs"][0]["job"] == job
    plain_report = by_mount[str(plain.mount_point)]
    assert plain_report["control_api"] is True and plain_report["profile"] == "" and plain_report["state"] == "live"
    assert plain_report["volume"] == plain.config()["volName"] and plain_report["jobs"] == []
    table_all = cli("status").stdout
    assert str(m.mount_point) in table_all and str(plain.mount_point) in table_all
    assert 'jobs and plans: this mount runs without "profile": "ai_prefetch"' in table_all

    # A cubefs-fuse mount without ai_prefetch: the operator commands work there too.
    for args in (("status", str(plain.mount_point)), ("warmup", str(plain.mount_point), "a"),
                 ("drop-cache", str(plain.mount_point)), ("stats", str(plain.mount_point), "-n", "1")):
        result = cli(*args)
        assert result.returncode == 0 and not result.stderr, (args, result.stdout, result.stderr)
    m.umount()
    plain.umount()


def test_warmup_check_list_and_drop_cache(make_mount: Callable[..., Mount]) -> None:
    m, files = _mount(make_mount, **AI_PREFETCH)
    sub = [p for p in files if p.startswith("a/")]
    sub_bytes = sum(len(files[p]) for p in sub)

    before = _check(m, "a")
    assert (before["files_total"], before["files_cached"], before["bytes_total"]) == (len(sub), 0, sub_bytes)
    assert before["cached_percent"] == 0.0

    warm = cli("warmup", str(m.mount_point), str(m.mount_point / "a"))  # absolute path under the mount
    assert warm.returncode == 0, warm.stderr
    assert f"{len(sub)}/{len(sub)} files" in warm.stdout and "(100.0%)" in warm.stdout
    backend_bytes = metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total")
    assert backend_bytes == sub_bytes  # each file fetched once, nothing else
    after = _check(m, "a")
    assert (after["files_cached"], after["bytes_cached"], after["cached_percent"]) == (len(sub), sub_bytes, 100.0)
    assert _check(m, "b")["cached_percent"] == 0.0  # only the subtree was warmed
    for rel in sub:  # reads are served from the cache: the backend sees nothing new
        assert m.path(rel).read_bytes() == files[rel]
    assert metric(m.scrape(), "cubefs_fuse_backend_read_bytes_total") == backend_bytes

    # -f LIST: relative and absolute paths, blank lines ignored.
    listing = m.base / "list.txt"
    listing.write_text(f"b/g0\n\n{m.mount_point}/b/g1\n")
    from_list = _json("warmup", str(m.mount_point), "-f", str(listing), "--json")
    assert (from_list["files_total"], from_list["files_cached"], from_list["errors"]) == (2, 2, 0)
    assert _check(m, "b")["cached_percent"] == 100.0
    assert _check(m, str(m.mount_point))["cached_percent"] == 100.0  # the whole volume

    # Paths outside the mount are refused, in one line, before anything is sent.
    _one_line_error(cli("warmup", str(m.mount_point), "/etc/passwd"), "'/etc/passwd' is not under the mount point",
                    code=2)
    _one_line_error(cli("warmup", str(m.mount_point), "../escape"), "leaves the mount point", code=2)
    listing.write_text("b/g0\n/etc/shadow\n")
    _one_line_error(cli("warmup", str(m.mount_point), "-f", str(listing)), "/etc/shadow", code=2)
    _one_line_error(cli("warmup", str(m.mount_point)), "give at least one PATH or -f LIST", code=2)
    _one_line_error(cli("drop-cache", "--samples", "../x", str(m.mount_point)), "a sample cache name is", code=2)
    _one_line_error(cli("stats", str(m.mount_point), "-i", "0"), "--interval 0.0: give a positive number", code=2)

    drop = cli("drop-cache", str(m.mount_point))
    assert drop.returncode == 0, drop.stderr
    assert drop.stdout.startswith("dropped ") and str(m.mount_point) in drop.stdout
    dropped = _check(m, str(m.mount_point))
    assert (dropped["files_cached"], dropped["bytes_cached"], dropped["cached_percent"]) == (0, 0, 0.0)
    assert dropped["files_total"] == len(files)
    samples = m.scrape()
    assert metric(samples, "cubefs_fuse_cache_used_bytes", tier="ram") == 0
    # What stays counted: the tier's directory segments/ (and room for its growth); every
    # segment emptied by the drop is deleted.
    directory = os.lstat(m.cache_dir / "segments").st_blocks * 512
    assert list((m.cache_dir / "segments").iterdir()) == []
    assert metric(samples, "cubefs_fuse_cache_used_bytes", tier="disk") == directory + DIR_SLACK
    m.umount()


def test_stats_prints_rate_lines(make_mount: Callable[..., Mount]) -> None:
    m, files = _mount(make_mount, **AI_PREFETCH)
    sizes = [len(data) for data in files.values()]
    mean_size, round_bytes = sum(sizes) / len(sizes), sum(sizes) + max(sizes)
    proc = subprocess.Popen([sys.executable, "-m", "cubefs_fuse", "stats", str(m.mount_point), "-n", "2",
                             "-i", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    stop = threading.Event()
    opened = 0

    def reader() -> None:  # keeps opening files so that every interval has activity
        nonlocal opened
        while not stop.is_set():
            for rel in files:
                with open(m.path(rel), "rb") as f:
                    # Drop the file's kernel page cache so the reads reach the daemon too.
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    f.read()
                opened += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        stop.set()
        thread.join()
    assert proc.returncode == 0, err
    header, *rows = out.strip().splitlines()
    assert header.replace("|", " ").split()[:9] == ["time", "req/s", "hit%", "MiB/s", "mount", "fast", "sample",
                                                   "look/s", "read/s"]
    assert len(rows) == 2, out
    lookups = 0.0
    for row in rows:
        fields = row.replace("|", " ").split()
        assert re.fullmatch(r"\d\d:\d\d:\d\d", fields[0]), row
        requests, mib, by_path = float(fields[1]), float(fields[3]), [float(f) for f in fields[4:7]]
        lookups += float(fields[7])
        reads = float(fields[8])
        assert requests > 0 and reads > 0, row
        # Everything went through the mount: every request is the mount's, and each is a
        # READ from a file's start that reached the daemon (the fadvise drops the pages), so
        # there are no more requests than READs, give or take a file at each edge of the
        # interval (of at least 0.5 s) and the rounding.
        assert by_path[1:] == [0.0, 0.0] and by_path[0] == requests, row
        assert requests <= reads + 2 / 0.5 + 1, row
        # The reader reads whole files, every file in turn, one at a time: the bytes read in
        # an interval are its requests times the mean file size, give or take less than one
        # round of files and one file across each end of the interval, and rounding.
        tolerance = round_bytes / 0.5 + mean_size / 2 + 0.05 * 2**20
        expected = requests * mean_size
        assert abs(mib * 2**20 - expected) <= tolerance, (row, f"expected {expected / 2**20:.1f} MiB/s")
        assert 0.0 <= float(fields[2]) <= 100.0, row  # hit% over the interval
        assert len(fields) == 16, row
    # The kernel opens the files itself and keeps their entries (lookupValid): a name is
    # looked up once at most while the reader opens it again and again.
    assert lookups * 0.5 <= len(files) + 4, out
    assert opened > 0
    m.umount()


def test_clear_errors_not_a_mount_stale_and_permission(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    plain_dir = tmp_path / "not-a-mount"
    plain_dir.mkdir()
    for args in (("status", str(plain_dir)), ("warmup", str(plain_dir), "x"), ("drop-cache", str(plain_dir))):
        _one_line_error(cli(*args), f"{plain_dir} is not a cubefs-fuse mount", code=2)

    m, _ = _mount(make_mount, **AI_PREFETCH)
    info = mounts.registered(str(m.mount_point))
    assert info is not None

    # Permission denied: the socket is world-connectable, the daemon refuses other uids.
    def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"} | {"HOME": "/"}
        return subprocess.run([sys.executable, "-c", AS_NOBODY, *args], capture_output=True, text=True,
                              timeout=60, cwd=REPO, env=env)

    line = _one_line_error(as_nobody("warmup", str(m.mount_point), "a", "--check"), "permission denied",
                           info["controlSocket"], "controlAllowUids")
    assert "Traceback" not in line
    denied = as_nobody("status", str(m.mount_point), "--json")
    assert denied.returncode == 1
    [report] = json.loads(denied.stdout)
    assert report["control_api"] is False and "permission denied" in report["error"]
    _one_line_error(as_nobody("drop-cache", str(m.mount_point)), "permission denied")
    assert _check(m, "a")["files_total"] == 8  # root still gets in

    # Stale mount: the daemon and its keeper die without unmounting.
    pid = m.pid()
    kill_for_good(mounts.registered(str(m.mount_point)) or {})
    assert mounts.find_mount(str(m.mount_point)) is not None  # the kernel mount is still there
    try:
        for args in (("status", str(m.mount_point)), ("warmup", str(m.mount_point), "a")):
            _one_line_error(cli(*args), f"{m.mount_point} is a cubefs-fuse mount but its daemon is not running",
                            "stale mount")
        # `status` lists the dead mount with what to do about it.
        [stale] = [r for r in _json("status", "--json") if r["mount_point"] == str(m.mount_point)]
        assert stale["state"] == "stale" and stale["pid"] == pid
        assert f"cubefs-fuse umount --lazy {m.mount_point}" in stale["hint"]
        assert "stale" in cli("status").stdout
        # The remedy it names works, and removes what the killed daemon left behind.
        remedy = cli("umount", "--lazy", str(m.mount_point))
        assert remedy.returncode == 0, remedy.stderr
        assert mounts.find_mount(str(m.mount_point)) is None
        assert mounts.registered(str(m.mount_point)) is None
        assert not os.path.exists(info["controlSocket"])
        assert not os.path.exists(config_file_path(m.config()["volName"]))
        assert str(m.mount_point) not in {r["mount_point"] for r in _json("status", "--json")}
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(m.mount_point)], capture_output=True)
        m.mounted = False
        # What the killed daemon could not remove: its registry entry, socket and volume file.
        for leftover in (mounts._registry_path(str(m.mount_point)), info["controlSocket"],
                         config_file_path(m.config()["volName"])):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass


def test_leftovers_of_a_crashed_daemon_are_listed_and_removed_by_umount(make_mount: Callable[..., Mount]) -> None:
    """A daemon killed, then unmounted by someone else (plain fusermount3): status lists
    what it left behind with the command that removes it, and that command works."""
    m, _ = _mount(make_mount, **AI_PREFETCH)
    info = mounts.registered(str(m.mount_point))
    assert info is not None
    kill_for_good(info)  # the daemon and its keeper
    subprocess.run(["fusermount3", "-u", "-z", str(m.mount_point)], capture_output=True, check=True)
    m.mounted = False
    volume_file = config_file_path(m.config()["volName"])
    assert os.path.exists(info["controlSocket"]) and os.path.exists(volume_file)
    [left] = [r for r in _json("status", "--json") if r["mount_point"] == str(m.mount_point)]
    assert left["state"] == "leftover" and f"cubefs-fuse umount {m.mount_point}" in left["hint"]
    result = cli("umount", str(m.mount_point))
    assert result.returncode == 0 and "left behind" in result.stdout, result.stderr
    assert mounts.registered(str(m.mount_point)) is None
    assert not os.path.exists(info["controlSocket"]) and not os.path.exists(volume_file)
    assert str(m.mount_point) not in {r["mount_point"] for r in _json("status", "--json")}
    again = cli("umount", str(m.mount_point))  # nothing left: the usual one-line error
    assert again.returncode != 0 and "is not mounted" in again.stderr


def test_warmup_names_the_paths_that_failed_and_why(make_mount: Callable[..., Mount]) -> None:
    m, _ = _mount(make_mount)
    try:
        result = cli("warmup", str(m.mount_point), "a", "no/such/dir", "missing.bin")
        assert result.returncode == 1
        assert ", 2 errors," in result.stdout, result.stdout
        # Only a missing file: nothing found, nothing said to be cached (not "0/0 files ... (100.0%)").
        missing = cli("warmup", str(m.mount_point), "missing.bin")
        assert missing.returncode == 1
        assert re.fullmatch(r"no files found under the 1 path given, 1 error, [0-9.]+ s\n", missing.stdout), missing.stdout
        assert missing.stderr == "  missing.bin: ENOENT: No such file or directory\n", missing.stderr
        assert result.stderr.splitlines() == ["  no/such/dir: ENOENT: No such file or directory",
                                              "  missing.bin: ENOENT: No such file or directory"], result.stderr
        as_json = cli("warmup", str(m.mount_point), "missing.bin", "--json")
        assert as_json.returncode == 1
        report = json.loads(as_json.stdout)
        assert report["error_details"] == [{"path": "missing.bin", "error": "ENOENT: No such file or directory"}]
    finally:
        m.umount()
