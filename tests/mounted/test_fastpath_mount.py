"""cube_torch's fast path against a real daemon: the data socket, the memfd ring, versions,
accounting, access control and a daemon that stops answering.

The client is cube_torch's own :class:`~cube_torch.fastpath.Channel` (the one a
DataLoader worker uses), in this process; the daemon is a real ``ai_prefetch`` mount.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from cube_torch.fastpath import Channel
from cubefs_fuse.control.protocol import ControlClient, ProtocolError, read_volume_config
from tests.helpers import REPO, Mount, metric, wait_until, write_tree


def _volume(m: Mount) -> tuple[ControlClient, str]:
    volume = read_volume_config(m.config()["volName"], m.config().get("configDir", "/tmp"))
    assert volume.data_socket, "the daemon must advertise its data socket"
    return ControlClient(volume.control_socket, timeout=10), volume.data_socket


def _job_counters(control: ControlClient, job: str) -> dict[str, int]:
    (entry,) = [j for j in control.stats(job)["jobs"] if j["job"] == job]
    return {k: int(entry["cumulative"][k]) for k in ("requests", "hits", "misses")}


def test_a_batch_is_served_from_the_ring_and_counted_once_per_file(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(profile="ai_prefetch")
    files = write_tree(m.source, {f"d/f{i}.bin": os.urandom(1000 + 70_000 * i) for i in range(6)})
    files.update(write_tree(m.source, {"big/two-blocks.bin": os.urandom(3 * 1024 * 1024 // 2)}))
    os.symlink("f0.bin", m.source / "d" / "link.bin")
    m.mount()
    try:
        control, data_socket = _volume(m)
        job = f"fast-{os.getpid()}"
        control.register_job(job, 0)  # this process: the daemon attributes our batches to it
        channel = Channel(data_socket)
        names = sorted(files)
        first = channel.batch(names)
        assert first == [files[n] for n in names]  # cold: fetched at foreground priority, then served
        # Counted once the worker released the batch (the daemon reads the release in order,
        # before the stats request on the control socket may be answered: hence the wait).
        channel.release([1] * len(names))
        expected = {"requests": len(names), "hits": 0, "misses": len(names)}
        wait_until(lambda: _job_counters(control, job) == expected, what=f"counters {expected}")
        second = channel.batch(names)
        assert second == first
        # The loader never opened the first two, opened the third twice: one request per open.
        channel.release([0, 0, 2] + [1] * (len(names) - 3))
        expected = {"requests": 2 * len(names) - 1, "hits": len(names) - 1, "misses": len(names)}
        wait_until(lambda: _job_counters(control, job) == expected, what=f"counters {expected}")
        # Not regular files, missing files: "read it through the mount", not counted here.
        assert channel.batch(["d/link.bin", "d", "d/missing.bin"]) == [None, None, None]
        channel.release([0, 0, 0])
        assert _job_counters(control, job) == expected
        # A bad path closes the connection: the client sees an error, never bytes.
        with pytest.raises(ProtocolError):
            channel.batch(["../etc/passwd"])
        channel.close()
        samples = m.scrape()
        assert metric(samples, "cubefs_fuse_fastpath_files_total", result="hit") == len(names) - 1
        assert metric(samples, "cubefs_fuse_fastpath_files_total", result="miss") == len(names)
        assert metric(samples, "cubefs_fuse_fastpath_files_total", result="mount") == 3
        # The mount's file requests count them like opens through the mount (none happened here).
        assert metric(samples, "cubefs_fuse_file_requests_total") == 2 * len(names) - 1
        assert metric(samples, "cubefs_fuse_file_hits_total") == len(names) - 1
        assert metric(samples, "cubefs_fuse_file_misses_total") == len(names)
        # What applications read: the fast path's share, bytes included; nothing opened through the mount.
        assert metric(samples, "cubefs_fuse_app_requests_total", path="fastpath", result="hit") == len(names) - 1
        assert metric(samples, "cubefs_fuse_app_requests_total", path="fastpath", result="miss") == len(names)
        assert metric(samples, "cubefs_fuse_app_bytes_total", path="fastpath") \
            == metric(samples, "cubefs_fuse_fastpath_bytes_total") > 0
        assert metric(samples, "cubefs_fuse_app_requests_total", path="mount", result="hit") == 0
        status = control.status()
        assert status["counters"]["file_requests"] == status["hits"]["requests"] == status["reads"]["requests"] \
            == 2 * len(names) - 1
    finally:
        m.umount()


def test_a_changed_file_is_never_served_from_its_old_version(make_mount: Callable[..., Mount]) -> None:
    """Once the daemon's metadata sees a change (attrValid), a batch serves the new bytes:
    changes of content with the same size and mtime restored, of size, and a replacement."""
    m = make_mount(profile="ai_prefetch", attrValid=0.5, lookupValid=0.5)
    write_tree(m.source, {"a.bin": b"A" * 50_000})
    m.mount()
    try:
        _, data_socket = _volume(m)
        channel = Channel(data_socket)
        assert channel.batch(["a.bin"]) == [b"A" * 50_000]
        path = m.source / "a.bin"
        changes: list[tuple[str, Callable[[], bytes]]] = []

        def same_size() -> bytes:
            st = path.stat()
            path.write_bytes(b"B" * 50_000)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # rsync -a style: only ctime tells
            return b"B" * 50_000

        def grown() -> bytes:
            path.write_bytes(b"C" * 70_000)
            return b"C" * 70_000

        def replaced() -> bytes:
            tmp = m.source / "a.tmp"
            tmp.write_bytes(b"D" * 70_000)
            os.rename(tmp, path)
            return b"D" * 70_000

        changes = [("same size and mtime", same_size), ("grown", grown), ("replaced", replaced)]
        for what, change in changes:
            old = channel.batch(["a.bin"])[0]
            new = change()
            served: list[bytes | None] = []

            def sees_new() -> bool:
                served.append(channel.batch(["a.bin"])[0])
                return served[-1] == new

            wait_until(sees_new, timeout=10, what=f"the new version ({what})")
            # Before the daemon noticed, only the old version; after, only the new one.
            first_new = served.index(new)
            assert all(s == old for s in served[:first_new]), what
            for _ in range(20):
                assert channel.batch(["a.bin"]) == [new], what
        channel.close()
    finally:
        m.umount()


NOBODY_CLIENT = """
import json, os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(10)
s.connect(sys.argv[1])
# No hello yet: the daemon decides right after accept(), so the answer is already on its
# way (a hello it never reads would turn its close into a connection reset).
message, fds, _, _ = socket.recv_fds(s, 4096, 4)
print(json.dumps({"message": message.decode(), "fds": len(fds)}))
"""


def test_a_user_without_control_access_gets_no_shared_memory(make_mount: Callable[..., Mount],
                                                              tmp_path: Path) -> None:
    """uid 65534 may connect to the data socket (mode 0666, like the control socket) but is
    refused by its credentials at once: an error message, no descriptor."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    # Not under pytest's tmp_path (its parents are 0700): nobody must reach the socket file,
    # so that only the daemon's credential check stands between it and the ring.
    run = Path(tempfile.mkdtemp(prefix="fastpath-", dir="/tmp"))
    os.chmod(run, 0o755)
    m = make_mount(profile="ai_prefetch", configDir=str(cfg), controlSocket=str(run / "ctl.sock"))
    write_tree(m.source, {"a.bin": b"x" * 1000})
    m.mount()
    try:
        _, data_socket = _volume(m)
        result = subprocess.run([sys.executable, "-c", NOBODY_CLIENT, data_socket], capture_output=True,
                                text=True, timeout=60, cwd=REPO)
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["fds"] == 0
        assert "not allowed" in json.loads(answer["message"])["error"]
        # The daemon's own uid (root here) is served.
        channel = Channel(data_socket)
        assert channel.batch(["a.bin"]) == [b"x" * 1000]
        channel.close()
    finally:
        m.umount()
        shutil.rmtree(run, ignore_errors=True)


def test_a_daemon_that_stops_answering_costs_one_bounded_wait(make_mount: Callable[..., Mount]) -> None:
    """A stopped daemon (SIGSTOP) mid-conversation: the batch fails within the reply
    timeout instead of hanging; after SIGCONT a new connection is served again."""
    m = make_mount(profile="ai_prefetch")
    write_tree(m.source, {"a.bin": b"y" * 1000})
    m.mount()
    pid = m.pid()
    try:
        _, data_socket = _volume(m)
        channel = Channel(data_socket, reply_timeout=1.0)
        assert channel.batch(["a.bin"]) == [b"y" * 1000]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError):  # socket.timeout after reply_timeout: no hang
                channel.batch(["a.bin"])
        finally:
            os.kill(pid, signal.SIGCONT)
        channel.close()
        channel = Channel(data_socket)
        assert channel.batch(["a.bin"]) == [b"y" * 1000]
        channel.close()
    finally:
        m.umount()


def test_after_a_restart_a_batch_is_served_from_nvme_as_hits(make_mount: Callable[..., Mount]) -> None:
    """A restarted daemon (RAM tier empty, NVMe kept) serves a batch whose metadata its
    listings cached from NVMe (the batch's blocks read in one worker call, not one per
    block): the same bytes, every file a hit and every block an NVMe hit, nothing read
    from the source."""
    m = make_mount(profile="ai_prefetch")
    files = write_tree(m.source, {f"d/f{i}.bin": os.urandom(20_000 + 90_000 * i) for i in range(8)})
    m.mount()
    try:
        for name in files:
            assert m.path(name).read_bytes() == files[name]  # fetched, then written to NVMe
        blocks = sum(-(-len(data) // (1 << 20)) for data in files.values())
        wait_until(lambda: metric(m.scrape(), "cubefs_fuse_cache_blocks", tier="disk") >= blocks, what="the NVMe write-behind")
    finally:
        m.umount()
    m.mount()
    try:
        control, data_socket = _volume(m)
        job = f"nvme-{os.getpid()}"
        control.register_job(job, 0)
        os.listdir(m.path("d"))  # the directory's listing caches its files' attributes, as a plan's does
        before = m.scrape()
        channel = Channel(data_socket)
        names = sorted(files)
        assert channel.batch(names) == [files[n] for n in names]
        channel.release([1] * len(names))
        expected = {"requests": len(names), "hits": len(names), "misses": 0}
        wait_until(lambda: _job_counters(control, job) == expected, what=f"counters {expected}")
        channel.close()
        after = m.scrape()
        assert metric(after, "cubefs_fuse_cache_hits_total", tier="disk") - \
            metric(before, "cubefs_fuse_cache_hits_total", tier="disk") == blocks
        assert metric(after, "cubefs_fuse_backend_operations_total", op="read") == \
            metric(before, "cubefs_fuse_backend_operations_total", op="read")
    finally:
        m.umount()
