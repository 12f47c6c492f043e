"""The control socket cannot be used to stop readers (docs/concurrency.md, "Nobody else's
resources"): a local user who is not allowed floods it with connections, an allowed one
holds idle connections, and reads through the mount (uncached files too), /metrics and
the API of allowed users keep working while the daemon's descriptors stay bounded."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from cubefs_fuse.control.server import MAX_CONNECTIONS
from tests.helpers import REPO, Mount, write_tree

FLOOD_CONNECTIONS = 20_000
# Processes the flood is spread over: one process may hold at most its hard RLIMIT_NOFILE
# descriptors (20,000 in this test container, and raising it needs CAP_SYS_RESOURCE).
FLOOD_PROCESSES = 4
FLOOD_SECONDS = 240  # the flood's own bound; it reports how many it got by then
# Run as uid 65534: opens connections in a loop and holds every one open until stdin closes.
FLOOD = """
import json, os, resource, socket, sys, time
path, count, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
assert hard >= count + 64, f"hard RLIMIT_NOFILE {hard} < {count} connections"
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
held, answered = [], 0
deadline = time.monotonic() + limit
while len(held) < count and time.monotonic() < deadline:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)  # a Unix connect() with a timeout answers EAGAIN while the backlog is full
    try:
        s.connect(path)
    except BlockingIOError:
        s.close()
        time.sleep(0.0005)
        continue
    held.append(s)
for s in held[:100]:  # what a refused peer is told
    answered += s.recv(4096).startswith(b"HTTP/1.1 403 ")
print(json.dumps({"held": len(held), "answered_403": answered}), flush=True)
sys.stdin.read()
"""


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def readline(proc: subprocess.Popen[str], timeout: float) -> dict[str, int]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the flood said nothing within {timeout} s"
    line = proc.stdout.readline()
    assert line, f"the flood exited: {proc.wait()}"
    result: dict[str, int] = json.loads(line)
    return result


def test_a_connection_flood_and_idle_connections_stop_no_reader(make_mount: Callable[..., Mount],
                                                                tmp_path: Path) -> None:
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    m = make_mount(profile="ai_prefetch", configDir=str(cfg))
    files = write_tree(m.source, {f"d/{i}.bin": os.urandom(4096 + i) for i in range(400)})
    m.mount()
    try:
        config = read_volume_config(m.config()["volName"], str(cfg))
        sock = config.control_socket
        client = ControlClient(sock, timeout=10)
        pid = client.status()["pid"]
        assert pid == m.pid()
        baseline = open_fds(pid)
        names = iter(sorted(files))
        peak = [baseline]

        def still_serving() -> None:
            """An uncached file through the mount, /metrics and root's API, each answered."""
            peak[0] = max(peak[0], open_fds(pid))
            rel = next(names)
            assert m.path(rel).read_bytes() == files[rel]
            assert m.scrape()["cubefs_fuse_lookups_total"] >= 1
            assert client.status()["pid"] == pid

        # An allowed user (root) holds 64 idle connections ...
        idle = []
        for _ in range(MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock)
            idle.append(s)
        still_serving()
        # ... and uid 65534 opens 20,000 more, holding every one.
        floods = [subprocess.Popen([sys.executable, "-c", FLOOD, sock, str(FLOOD_CONNECTIONS // FLOOD_PROCESSES),
                                    str(FLOOD_SECONDS)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
                  for _ in range(FLOOD_PROCESSES)]
        try:
            checks = 0
            outputs = [f.stdout for f in floods if f.stdout is not None]  # all of them: stdout=PIPE
            while not all(select.select([out], [], [], 0)[0] for out in outputs):  # while under way
                still_serving()
                checks += 1
                assert all(f.poll() is None for f in floods), "a flood process exited early"
                assert checks < 300, "more reads than files: the flood takes too long"
                time.sleep(0.05)
            results = [readline(f, FLOOD_SECONDS) for f in floods]
            assert sum(r["held"] for r in results) == FLOOD_CONNECTIONS, results
            assert all(r["answered_403"] == 100 for r in results), results  # refused, with the reason
            # Every flood connection was refused at accept: none held a descriptor for long.
            peak[0] = max(peak[0], open_fds(pid))
            assert peak[0] <= baseline + MAX_CONNECTIONS + 8, (baseline, peak[0])
            for _ in range(20):
                still_serving()
            assert client.status()["pid"] == pid
        finally:
            for f in floods:
                assert f.stdin is not None
                f.stdin.close()
            for f in floods:
                f.wait(60)
                if f.stdout is not None:
                    f.stdout.close()
        for s in idle:
            s.close()
        print(f"{checks} read/metrics/API rounds during the flood, daemon fds {baseline} -> peak {peak[0]}")
    finally:
        m.umount()
