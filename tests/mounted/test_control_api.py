"""The control API of a mounted ai_prefetch daemon: hostile and malformed requests,
authentication (peer uid on the Unix socket, bearer token on profPort), warmup and
cache drop.

Every refused request must come back as a 4xx with a JSON ``error`` and leave the
daemon's state (status and cumulative stats) exactly as it was.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cubefs_fuse.control.protocol import (
    CONTENT_BINARY,
    MAX_DATASET_BODY,
    MAX_JSON_BODY,
    MAX_PATH_BYTES,
    ControlClient,
    ProtocolError,
    read_volume_config,
)
from tests.helpers import REPO, Mount, dead_pid, free_port, metric, wait_until, write_tree

FILES = [f"a/{i}.bin" for i in range(10)] + [f"w/sub/{i}.bin" for i in range(6)]
SIZE = 20_000
JOB = "apitest"


def start(make_mount: Callable[..., Mount], tmp_path: Path, **overrides: Any) -> tuple[Mount, ControlClient, Any]:
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    m = make_mount(profile="ai_prefetch", configDir=str(cfg), **overrides)
    write_tree(m.source, {rel: bytes([i]) * SIZE for i, rel in enumerate(FILES)})
    m.mount()
    config = read_volume_config(m.config()["volName"], str(cfg))
    return m, ControlClient(config.control_socket), config


def state(client: ControlClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """Everything a request could change; uptime and since-last-call counters excluded
    (those change by design with every call)."""
    status = client.status()
    del status["uptime"]
    stats = client.stats()
    del stats["global"]["since_last"]
    for job in stats["jobs"]:
        del job["since_last"]
    return status, stats


def raw(socket_path: str, data: bytes, *, chunks: Sequence[bytes] = ()) -> tuple[int, dict[str, Any]]:
    """Send raw bytes (a hand-made request) and parse the daemon's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(socket_path)
        try:
            s.sendall(data)
            for chunk in chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered and closed before reading it all: the answer is queued
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.status, json.loads(response.read())


def expect_error(status: int, call: Callable[[], Any]) -> str:
    with pytest.raises(ProtocolError) as info:
        call()
    assert info.value.status == status, info.value
    assert info.value.message and "internal error" not in info.value.message
    return info.value.message


def test_each_loader_of_a_rank_keeps_its_own_plan(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    """``loader=`` on POST /v1/plans: plans of different loaders of one (job, rank) live
    side by side, a loader's new plan replaces only its own, and a plan without the
    field is loader "0" (what clients before it sent)."""
    m, client, _ = start(make_mount, tmp_path)
    try:
        first, second = client.register_dataset(FILES[:10]), client.register_dataset(FILES[10:])
        client.register_job(JOB, 0, os.getpid())
        order = np.arange(6, dtype="<u4").tobytes()
        answer = client.submit_plan(JOB, 0, 0, first, np.arange(10, dtype="<u4").tobytes(), "<u4")
        assert answer["loader"] == "0"
        answer = client.submit_plan(JOB, 0, 0, second, order, "<u4", loader="val")
        assert answer == {"job": JOB, "rank": 0, "loader": "val", "epoch": 0, "samples": 6}
        client.submit_plan(JOB, 0, 1, second, order, "<u4", loader="val")  # val's next epoch

        def loaders() -> dict[str, tuple[int, str]]:
            return {p["loader"]: (p["epoch"], p["dataset"]) for p in client.status()["plans"] if p["job"] == JOB}

        assert loaders() == {"0": (0, first), "val": (1, second)}
        (job,) = client.status()["jobs"]
        assert job["loaders"] == 2
        (entry,) = client.stats(JOB)["jobs"]
        assert [p["loader"] for p in entry["plans"]] == ["0", "val"] and entry["plan"]["loader"] == "val"
        # Reads through the mount advance each loader's own plan and count as its requests.
        for rel in FILES[:10] + FILES[10:]:
            (m.mount_point / rel).read_bytes()
        wait_until(lambda: all(p["requests"] == p["samples"] for p in client.status()["plans"]),
                   what="every open counted for its loader")
        assert {p["loader"]: p["cursor"] for p in client.status()["plans"]} == {"0": 10, "val": 6}
        scrape = m.scrape()
        assert metric(scrape, "cubefs_fuse_plan_loaders", training_job=JOB, rank="0") == 2
        assert metric(scrape, "cubefs_fuse_plan_samples", training_job=JOB, rank="0") == 16
    finally:
        m.umount()


def test_hostile_requests_are_refused_and_change_nothing(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    m, client, config = start(make_mount, tmp_path)
    try:
        sock = config.control_socket
        dataset = client.register_dataset(FILES[:10])
        client.register_job(JOB, 0, os.getpid())
        # Another job, of a process that is not this one or its ancestor: its reads are not ours to report.
        other = subprocess.Popen(["sleep", "120"])
        client.register_job("other", 0, other.pid)
        client.submit_plan(JOB, 0, 1, dataset, np.arange(10, dtype="<u4").tobytes(), "<u4")
        # The plan's prefetch settles (10 files in RAM and written behind to disk), so the
        # state stops moving on its own.
        wait_until(lambda: client.stats()["prefetch"]["completed"] == 10
                   and client.status()["cache"]["disk"]["blocks"] == 10, what="plan prefetched")
        before = state(client)

        def dataset_body(body: bytes, columns: int | str = 1) -> Callable[[], Any]:
            return lambda: client.request("POST", "datasets", query={"columns": columns}, body=body,
                                          content_type=CONTENT_BINARY)

        def plan(body: bytes, dtype: str = "<u4", dataset_id: str = dataset, job: str = JOB,
                 rank: str = "0", loader: str | None = None, first: str | None = None) -> Callable[[], Any]:
            query = {"job": job, "rank": rank, "epoch": 2, "dataset": dataset_id, "dtype": dtype}
            if loader is not None:
                query["loader"] = loader
            if first is not None:
                query["first"] = first
            return lambda: client.request("POST", "plans", query=query, body=body, content_type=CONTENT_BINARY)

        def warmup(paths: Any) -> Callable[[], Any]:
            return lambda: client.request("POST", "warmup", body=json.dumps({"paths": paths}).encode())

        cases: list[tuple[str, int, Callable[[], Any]]] = [
            # File lists: traversal, absolute, unnormalised, empty, malformed.
            ("dataset traversal", 400, dataset_body(b"a/0.bin\0../../etc/passwd")),
            ("dataset inner traversal", 400, dataset_body(b"a/../../etc/passwd")),
            ("dataset absolute", 400, dataset_body(b"a/0.bin\0/etc/passwd")),
            ("dataset dot component", 400, dataset_body(b"a/./0.bin")),
            ("dataset empty component", 400, dataset_body(b"a//0.bin")),
            ("dataset trailing slash", 400, dataset_body(b"a/")),
            ("dataset empty path", 400, dataset_body(b"a/0.bin\0\0a/1.bin")),
            ("dataset empty", 400, dataset_body(b"")),
            ("dataset columns 0", 400, dataset_body(b"a/0.bin", columns=0)),
            ("dataset columns mismatch", 400, dataset_body(b"a/0.bin\0a/1.bin\0a/2.bin", columns=2)),
            ("dataset path too long", 400, dataset_body(b"a/" + b"x" * MAX_PATH_BYTES)),
            # Plans: dtype, length, indices, dataset, names.
            ("plan float dtype", 400, plan(np.zeros(4, dtype="<f8").tobytes(), dtype="<f8")),
            ("plan big-endian dtype", 400, plan(np.zeros(4, dtype=">i8").tobytes(), dtype=">i8")),
            ("plan ragged body", 400, plan(b"\0" * 7, dtype="<u4")),
            ("plan empty", 400, plan(b"")),
            ("plan index = samples", 400, plan(np.array([0, 10], dtype="<u4").tobytes())),
            ("plan negative index", 400, plan(np.array([3, -1], dtype="<i8").tobytes(), dtype="<i8")),
            ("plan unknown dataset", 404, plan(np.arange(3, dtype="<u4").tobytes(), dataset_id="0" * 32)),
            ("plan bad job name", 400, plan(np.arange(3, dtype="<u4").tobytes(), job="../x")),
            ("plan negative rank", 400, plan(np.arange(3, dtype="<u4").tobytes(), rank="-1")),
            ("plan empty loader", 400, plan(np.arange(3, dtype="<u4").tobytes(), loader="")),
            ("plan loader with a space", 400, plan(np.arange(3, dtype="<u4").tobytes(), loader="a b")),
            ("plan loader traversal", 400, plan(np.arange(3, dtype="<u4").tobytes(), loader="../x")),
            ("plan loader too long", 400, plan(np.arange(3, dtype="<u4").tobytes(), loader="l" * 129)),
            ("plan negative first", 400, plan(np.arange(3, dtype="<u4").tobytes(), first="-1")),
            ("plan first not a number", 400, plan(np.arange(3, dtype="<u4").tobytes(), first="all")),
            ("plan first 5000 digits", 400, plan(np.arange(3, dtype="<u4").tobytes(), first="9" * 5000)),
            # Warmup: traversal, absolute, unnormalised, NUL, wrong types.
            ("warmup traversal", 400, warmup(["../etc"])),
            ("warmup inner traversal", 400, warmup(["a/../../etc"])),
            ("warmup absolute", 400, warmup(["/etc/passwd"])),
            ("warmup dot", 400, warmup(["a/./0.bin"])),
            ("warmup double slash", 400, warmup(["a//0.bin"])),
            ("warmup NUL", 400, warmup(["a/0.bin\0x"])),
            ("warmup no paths", 400, warmup([])),
            ("warmup not a list", 400, warmup("a")),
            ("warmup not strings", 400, warmup([1])),
            ("warmup progress unknown id", 404, lambda: client.request("GET", "warmup", query={"id": 999})),
            ("warmup progress bad id", 400, lambda: client.request("GET", "warmup", query={"id": "x"})),
            # Jobs: JSON shape, names, pids.
            ("job invalid JSON", 400, lambda: client.request("POST", "jobs", body=b"{job")),
            ("job JSON not an object", 400, lambda: client.request("POST", "jobs", body=b"[1]")),
            ("job bad name", 400, lambda: client.request("POST", "jobs", body=b'{"job": "a b", "pid": 1}')),
            ("job pid out of range", 400, lambda: client.request("POST", "jobs", body=b'{"job": "j", "pid": 0}')),
            ("job no such process", 400,
             lambda: client.request("POST", "jobs", body=json.dumps({"job": "j", "pid": dead_pid()}).encode())),
            # Integers that are digits to str.isdigit() but not to int(), or past its 4300-digit
            # limit, and JSON nested past the recursion limit: 400, never 500.
            ("dataset columns superscript", 400, dataset_body(b"a/0.bin", columns="²")),
            ("plan rank arabic digits", 400, plan(np.arange(3, dtype="<u4").tobytes(), rank="١")),
            ("plan rank 5000 digits", 400, plan(np.arange(3, dtype="<u4").tobytes(), rank="9" * 5000)),
            ("warmup progress superscript id", 400, lambda: client.request("GET", "warmup", query={"id": "²"})),
            ("warmup progress 5000-digit id", 400,
             lambda: client.request("GET", "warmup", query={"id": "9" * 5000})),
            ("job deep JSON", 400, lambda: client.request("POST", "jobs", body=b"[" * 100_000 + b"]" * 100_000)),
            ("warmup deep JSON", 400,
             lambda: client.request("POST", "warmup", body=b'{"paths": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
            ("job pid 5000 digits", 400,
             lambda: client.request("POST", "jobs", body=b'{"job": "j", "pid": ' + b"9" * 5000 + b"}")),
            ("job rank superscript string", 400,
             lambda: client.request("POST", "jobs", body=json.dumps({"job": "j", "rank": "²"}).encode())),
            ("warmup trailing slash", 400, warmup(["w/"])),
            ("warmup file trailing slash", 400, warmup(["a/0.bin/"])),
            # Read counts: shape, bounds, a job that is not registered, another job's.
            ("reads negative", 400, lambda: client.request("POST", "jobs/reads",
                                                            body=b'{"job": "apitest", "files": -1}')),
            ("reads no count", 400, lambda: client.request("POST", "jobs/reads", body=b'{"job": "apitest"}')),
            ("reads count a float", 400, lambda: client.request("POST", "jobs/reads",
                                                                 body=b'{"job": "apitest", "files": 1.5}')),
            ("reads count past 2^53", 400, lambda: client.report_reads(JOB, 0, (1 << 53) + 1)),
            ("reads bad job name", 400, lambda: client.request("POST", "jobs/reads",
                                                                body=b'{"job": "../x", "files": 1}')),
            ("reads data_wait not an object", 400, lambda: client.request(
                "POST", "jobs/reads", body=b'{"job": "apitest", "files": 1, "data_wait": 3}')),
            ("reads data_wait negative", 400, lambda: client.report_reads(
                JOB, 0, 1, {"steps": 1, "wait_seconds": -1, "step_seconds": 1, "p50_seconds": 0, "p99_seconds": 0})),
            ("reads data_wait no steps", 400, lambda: client.report_reads(
                JOB, 0, 1, {"wait_seconds": 1, "step_seconds": 1, "p50_seconds": 0, "p99_seconds": 0})),
            ("reads unregistered rank", 403, lambda: client.report_reads(JOB, 7, 5)),
            ("reads of another process's job", 403, lambda: client.report_reads("other", 0, 5)),
            # Routing.
            ("unknown route", 404, lambda: client.request("GET", "nope")),
            ("wrong method", 405, lambda: client.request("DELETE", "status")),
            ("unversioned", 404, lambda: client.request("GET", "../v2/status")),
        ]
        failures = []
        for name, status, call in cases:
            try:
                expect_error(status, call)
            except AssertionError as exc:
                failures.append(f"{name}: {exc}")
            except BaseException as exc:  # pytest.raises' "DID NOT RAISE" is a Failed
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
        assert not failures, "\n".join(failures)

        # Bodies over the limit: declared (refused before reading) and streamed (chunked).
        code, body = raw(sock, b"POST /v1/datasets HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                               b"Content-Length: %d\r\n\r\n" % (MAX_DATASET_BODY + 1))
        assert code == 413 and "limit" in body["error"]
        code, body = raw(sock, b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_JSON_BODY + 1))
        assert code == 413 and "limit" in body["error"]
        piece = b"x" * 65536
        chunked = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (MAX_JSON_BODY // len(piece) + 1) + [b"0\r\n\r\n"]
        code, body = raw(sock, b"POST /v1/warmup HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                         chunks=chunked)
        assert code == 413 and "limit" in body["error"]
        code, body = raw(sock, b"GARBAGE\r\n\r\n")
        assert code == 400 and body["error"]
        for length in (b"9" * 5000, "²".encode(), "١٢".encode()):  # Content-Length h11 and we refuse
            code, body = raw(sock, b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n")
            assert code == 400 and body["error"], length

        after = state(client)
        assert after == before, f"a refused request changed the daemon's state:\n{before}\n{after}"
        # The daemon still works after all that; the job's own process reports its reads.
        assert client.register_dataset(FILES[:2]) != dataset
        answer = client.report_reads(JOB, 0, 25)
        assert (answer["requests"], answer["misses"]) == (25, 0)
        assert client.report_reads(JOB, 0, 3)["requests"] == 25  # cumulative: an older count changes nothing
    finally:
        other.kill()
        other.wait()
        m.umount()


# Run as uid 65534 (nobody): imports first, while the interpreter's files are still readable.
AS_NOBODY = """
import json, os, sys
from cubefs_fuse.control.protocol import ControlClient, ProtocolError
os.setgid(65534)
os.setuid(65534)
client = ControlClient(sys.argv[1])
out = []
for call in (client.status, lambda: client.register_job("evil", 0, 1)):
    try:
        call()
        out.append([200, ""])
    except ProtocolError as exc:
        out.append([exc.status, exc.message])
print(json.dumps(out))
"""


def test_authentication_uid_and_token(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    port = free_port()
    m, client, config = start(make_mount, tmp_path, profPort=port)
    try:
        sock = config.control_socket
        # The socket is open to every local user (mode 0666); who may use it is decided by
        # the peer's uid/gid (SO_PEERCRED): root and the daemon's uid by default.
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o666
        before = state(client)
        result = subprocess.run([sys.executable, "-c", AS_NOBODY, sock], capture_output=True, text=True,
                                cwd=REPO, timeout=60)
        assert result.returncode == 0, result.stderr
        for code, message in json.loads(result.stdout):
            assert code == 403 and "uid 65534" in message
        assert state(client) == before

        # profPort: loopback only, bearer token from a 0600 file named in the volume config.
        assert config.prof == port and config.token_file
        st = os.stat(config.token_file)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        token = Path(config.token_file).read_text().strip()
        assert len(token) >= 32

        def tcp(headers: dict[str, str], method: str = "GET", path: str = "/v1/status",
                body: bytes | None = None) -> tuple[int, dict[str, Any]]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                return response.status, json.loads(response.read())
            finally:
                conn.close()

        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token},
                        {"Authorization": f"Bearer {token}x"}, {"Authorization": f"Basic {token}"}):
            code, body = tcp(headers)
            assert code == 401 and "token" in body["error"], headers
        code, body = tcp({"Authorization": f"Bearer {token}"})
        assert code == 200 and body["pid"] == m.pid()
        # A TCP peer has no pid: it cannot show that a job's reads are its own.
        client.register_job(JOB, 0, os.getpid())
        before = state(client)
        code, body = tcp({"Authorization": f"Bearer {token}"}, "POST", "/v1/jobs/reads",
                         json.dumps({"job": JOB, "rank": 0, "files": 9}).encode())
        assert code == 403 and "Unix socket" in body["error"]
        if not config.local_ip.startswith("127."):  # a host with a network interface
            with pytest.raises(OSError):  # the port listens on loopback only
                socket.create_connection((config.local_ip, port), timeout=2).close()
        assert state(client) == before
    finally:
        m.umount()
    assert not os.path.exists(config.token_file), "the token outlived its daemon"
    assert not os.path.exists(sock)


def test_warmup_with_progress_check_mode_and_drop(make_mount: Callable[..., Mount], tmp_path: Path) -> None:
    m, client, _ = start(make_mount, tmp_path, memCacheSize="64MiB")
    try:
        def run_warmup(paths: list[str], check: bool) -> dict[str, Any]:
            started = client.request("POST", "warmup", body=json.dumps({"paths": paths, "check": check}).encode())
            assert started["check"] is check and started["id"] >= 1
            wait_until(lambda: client.request("GET", "warmup", query={"id": started["id"]})["done"],
                       what="warmup done")
            progress: dict[str, Any] = client.request("GET", "warmup", query={"id": started["id"]})
            return progress

        subtree = [f for f in FILES if f.startswith("w/")]
        check = run_warmup(["w"], check=True)
        assert (check["files_total"], check["files_done"], check["files_cached"]) == (len(subtree), len(subtree), 0)
        assert check["bytes_total"] == len(subtree) * SIZE and check["cached_percent"] == 0.0
        assert client.stats()["prefetch"]["issued"] == 0  # check mode fetches nothing

        warm = run_warmup(["w", "a/0.bin", "missing"], check=False)
        assert warm["files_total"] == len(subtree) + 1 and warm["files_cached"] == len(subtree) + 1
        assert warm["errors"] == 1  # "missing" does not exist; the rest is warmed anyway
        assert run_warmup(["w"], check=True)["cached_percent"] == 100.0

        # Warmed files are hits through the mount (no job registered: global counters).
        before = client.status()["hits"]
        for rel in subtree:
            assert m.path(rel).read_bytes() == (m.source / rel).read_bytes()
        after = client.status()["hits"]
        assert after["requests"] - before["requests"] == len(subtree)
        assert after["hits"] - before["hits"] == len(subtree)

        used = client.status()["cache"]["ram"]["used_bytes"]
        assert used >= (len(subtree) + 1) * SIZE
        dropped = client.request("POST", "cache/drop")
        assert dropped["dropped_bytes"] >= used
        cache = client.status()["cache"]
        assert cache["ram"]["used_bytes"] == 0 and cache["ram"]["blocks"] == 0
        assert cache["disk"]["blocks"] == 0
        assert run_warmup(["w"], check=True)["cached_percent"] == 0.0
    finally:
        m.umount()
