"""The control server's resource bounds over a real Unix socket (no mount, no prefetch
service): refused peers take nothing, per-uid and total caps, the request-head deadline,
and the descriptors kept in reserve for the data path."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from cubefs_fuse.control import server as server_module
from cubefs_fuse.control.server import AccessPolicy, ControlServer, Peer, Request, Response
from cubefs_fuse.errors import ConfigError
from tests.helpers import wait_until


class DenyAll(AccessPolicy):
    def allows(self, peer: Peer) -> bool:
        return False


@contextmanager
def running(server: ControlServer, path: Path) -> Iterator[threading.Event]:
    """Serve ``server`` on ``path`` in a trio loop of its own thread; yields the event that
    releases the blocking test handler."""
    release = threading.Event()
    stop = threading.Event()
    started = threading.Event()
    errors: list[BaseException] = []

    async def block(request: Request) -> Response:
        await trio.to_thread.run_sync(release.wait)
        return Response.json({"released": True})

    async def ok(request: Request) -> Response:
        return Response.json({"ok": True})

    server.route("GET", "/v1/ok", ok)
    server.route("GET", "/v1/block", block)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve_unix, str(path))
            started.set()
            await trio.to_thread.run_sync(stop.wait)
            nursery.cancel_scope.cancel()

    def thread() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            errors.append(exc)
            started.set()

    t = threading.Thread(target=thread)
    t.start()
    started.wait(30)
    try:
        assert not errors, errors
        yield release
    finally:
        release.set()
        stop.set()
        t.join(30)
    assert not errors, errors


def connect(path: Path) -> socket.socket:
    """A connected client socket; a full listen backlog is waited out (bounded)."""
    deadline = time.monotonic() + 20
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(20)  # a Unix connect() with a timeout answers EAGAIN while the backlog is full
        try:
            s.connect(str(path))
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def get(s: socket.socket, route: str = "ok") -> tuple[int, dict[str, Any]]:
    try:
        s.sendall(f"GET /v1/{route} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at accept: the answer is queued
    response = http.client.HTTPResponse(s)
    response.begin()
    return response.status, json.loads(response.read())


def test_a_peer_that_is_not_allowed_is_answered_and_closed_at_accept(tmp_path: Path) -> None:
    server = ControlServer(DenyAll())
    path = tmp_path / "s.sock"
    with running(server, path):
        held = []
        for _ in range(500):  # held open by the client: the server must hold none of them
            s = connect(path)
            held.append(s)
        for s in held[:5]:
            status, body = get(s)
            assert status == 403 and "is not allowed" in body["error"]
        wait_until(lambda: server.refused_peers == 500, what="500 refusals")
        assert server.connections == 0 and server.requests == 0
        for s in held:
            s.close()


def test_idle_connections_give_their_slots_to_new_ones(tmp_path: Path) -> None:
    server = ControlServer(AccessPolicy())
    path = tmp_path / "s.sock"
    with running(server, path):
        idle = [connect(path) for _ in range(server_module.MAX_CONNECTIONS)]
        # Every new connection beyond the per-uid cap takes the slot of the longest idle one
        # (the server accepts them in the background: wait until it has seen them all).
        extra = server_module.MAX_CONNECTIONS - server_module.MAX_PER_UID
        wait_until(lambda: server.evicted == extra and server.connections == server_module.MAX_PER_UID,
                   what=f"{extra} evictions with the per-uid cap reached")
        assert server.evicted == extra
        with connect(path) as s:
            assert get(s) == (200, {"ok": True})
        for s in idle[:-server_module.MAX_PER_UID]:
            assert s.recv(1) == b""  # closed by the server, not left hanging
        for s in idle:
            s.close()


def test_busy_connections_keep_their_slots_and_the_next_one_gets_503(tmp_path: Path) -> None:
    server = ControlServer(AccessPolicy())
    path = tmp_path / "s.sock"
    with running(server, path) as release:
        busy = [connect(path) for _ in range(server_module.MAX_PER_UID)]
        for s in busy:
            s.sendall(b"GET /v1/block HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: server.requests == server_module.MAX_PER_UID, what="every request in its handler")
        with connect(path) as s:
            status, body = get(s)
        assert status == 503 and "too many" in body["error"]
        assert server.connections == server_module.MAX_PER_UID and server.evicted == 0
        release.set()
        for s in busy:
            response = http.client.HTTPResponse(s)
            response.begin()
            assert response.status == 200
            s.close()


def test_a_connection_without_a_request_head_is_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "HEAD_DEADLINE", 0.3)
    server = ControlServer(AccessPolicy())
    path = tmp_path / "s.sock"
    with running(server, path):
        with connect(path) as silent, connect(path) as partial, connect(path) as keep_alive:
            partial.sendall(b"GET /v1/ok HTTP/1.1\r\nHo")  # a head that never completes
            assert get(keep_alive) == (200, {"ok": True})  # then idle on a kept-alive connection
            for s in (silent, partial, keep_alive):
                assert s.recv(1) == b""  # closed by the server once the head deadline passed
        wait_until(lambda: server.connections == 0, what="slots released")


def test_descriptors_in_reserve_are_not_given_to_connections(tmp_path: Path) -> None:
    server = ControlServer(AccessPolicy())
    server._fd_ceiling = 0  # as if every descriptor below the reserve were in use
    path = tmp_path / "s.sock"
    with running(server, path):
        with connect(path) as s:
            status, body = get(s)
        assert status == 503 and "file descriptors" in body["error"]
        assert server.connections == 0 and server.refused_full == 1
    assert server_module.fd_reserve(65536) == 2048 and server_module.fd_reserve(1024) == 512


def test_a_control_socket_path_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    victim = tmp_path / "data.txt"
    victim.write_text("precious")
    link = tmp_path / "link.sock"
    link.symlink_to(victim)
    for path in (victim, link, tmp_path):
        with pytest.raises(ConfigError, match="exists and is not a socket"):
            trio.run(ControlServer(AccessPolicy()).serve_unix, str(path))
    assert victim.read_text() == "precious" and link.is_symlink()
