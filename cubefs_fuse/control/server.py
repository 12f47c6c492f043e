"""The control API's HTTP/1.1 server (h11 over trio): transport, auth, bounds, routing.

It knows nothing about prefetching: handlers are registered per (method, path) and
receive a parsed :class:`Request`.  What it enforces for every handler:

* peer credentials (SO_PEERCRED) on the Unix socket: only allowed uids/gids get in;
  on the optional loopback TCP port, a bearer token instead;
* a body limit per route, checked against Content-Length before reading and again
  while reading, and a deadline per request so a stalled client cannot pin a task;
* errors as JSON ``{"error": ...}`` with a 4xx/5xx status: a handler's ApiError or the
  core's RequestError (mapped by :data:`STATUS_OF`, the one table) is the client's
  fault, anything else is logged and answered 500.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import trio

from cubefs_fuse.control.protocol import CONTENT_JSON
from cubefs_fuse.errors import BadRequest, Forbidden, NoRoom, NotFound, RequestError, TooLarge
from cubefs_fuse.limits import MAX_JSON_BODY

log = logging.getLogger(__name__)

# A request (headers and body) must arrive within this time; a 400 MB file list over a
# Unix socket takes well under a second, so 120 s only cuts off stalled clients.
REQUEST_DEADLINE = 120.0
# Connections served at once; more wait in the listen backlog.  Clients are a handful
# of training processes and operators' tools.
MAX_CONNECTIONS = 64
_READ_CHUNK = 1024 * 1024
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
# The HTTP status of each kind of request error the core raises.
STATUS_OF: dict[type[RequestError], int] = {
    BadRequest: 400, Forbidden: 403, NotFound: 404, TooLarge: 413, NoRoom: 507,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int  # 0 when unknown (TCP)
    uid: int
    gid: int
    transport: str  # "unix" or "tcp"


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    peer: Peer

    def json(self) -> dict[str, Any]:
        if not self.body:
            return {}
        try:
            data = json.loads(self.body)
        except ValueError as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body must be a JSON object")
        return data


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = CONTENT_JSON

    @classmethod
    def json(cls, data: Any, status: int = 200) -> Response:
        return cls(status, json.dumps(data, separators=(",", ":")).encode())


Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class Route:
    handler: Handler
    max_body: int = MAX_JSON_BODY


@dataclass
class AccessPolicy:
    """Who may use the Unix socket: root, the daemon's uid, and any listed uid/gid."""

    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    def allows(self, peer: Peer) -> bool:
        return peer.uid in (0, os.geteuid()) or peer.uid in self.uids or peer.gid in self.gids


class ControlServer:
    def __init__(self, policy: AccessPolicy, token: str | None = None) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.policy = policy
        self.token = token
        self._limiter = trio.CapacityLimiter(MAX_CONNECTIONS)
        self.requests = 0
        self.rejected = 0

    def route(self, method: str, path: str, handler: Handler, *, max_body: int = MAX_JSON_BODY) -> None:
        self.routes[(method, path)] = Route(handler, max_body)

    async def serve_unix(self, path: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on a Unix socket (mode 0666: access is decided by peer credentials)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        os.chmod(path, 0o666)
        sock.listen(MAX_CONNECTIONS)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._serve_unix_stream, [listener])
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    async def serve_tcp(self, port: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on loopback only; every request needs the bearer token."""
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        task_status.started()
        await trio.serve_listeners(self._serve_tcp_stream, listeners)

    async def _serve_unix_stream(self, stream: trio.SocketStream) -> None:
        raw = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, gid = _PEERCRED.unpack(raw)
        await self._serve(stream, Peer(pid, uid, gid, "unix"))

    async def _serve_tcp_stream(self, stream: trio.SocketStream) -> None:
        await self._serve(stream, Peer(0, -1, -1, "tcp"))

    async def _serve(self, stream: trio.SocketStream, peer: Peer) -> None:
        async with self._limiter:
            try:
                conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
                while True:
                    with trio.move_on_after(REQUEST_DEADLINE) as scope:
                        keep_going = await self._one_request(conn, stream, peer)
                    if scope.cancelled_caught or not keep_going:
                        break
                    if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                        break
                    try:
                        conn.start_next_cycle()
                    except h11.LocalProtocolError:
                        break
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                await stream.aclose()

    async def _next_event(self, conn: h11.Connection, stream: trio.SocketStream) -> Any:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(_READ_CHUNK))
                continue
            return event

    async def _one_request(self, conn: h11.Connection, stream: trio.SocketStream, peer: Peer) -> bool:
        try:
            event = await self._next_event(conn, stream)
            if isinstance(event, h11.ConnectionClosed):
                return False
            if not isinstance(event, h11.Request):
                return False
            self.requests += 1
            response = await self._dispatch(conn, stream, event, peer)
        except h11.RemoteProtocolError as exc:
            response = Response.json({"error": f"bad HTTP request: {exc}"}, exc.error_status_hint)
        if response.status >= 400:
            self.rejected += 1
        await self._send(conn, stream, response)
        return response.status < 400 or conn.their_state is h11.DONE

    async def _dispatch(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, peer: Peer) -> Response:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        try:
            self._authorize(peer, headers)
            url = urlsplit(request.target.decode("latin-1"))
            method = request.method.decode("latin-1")
            route = self.routes.get((method, url.path))
            if route is None:
                known = any(p == url.path for _, p in self.routes)
                raise ApiError(405 if known else 404, f"no route {method} {url.path}")
            body = await self._read_body(conn, stream, headers, route.max_body)
            query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            return await route.handler(Request(method, url.path, query, headers, body, peer))
        except ApiError as exc:
            return Response.json({"error": exc.message}, exc.status)
        except RequestError as exc:
            return Response.json({"error": str(exc)}, STATUS_OF.get(type(exc), 400))
        except Exception:
            log.exception("control API handler failed")
            return Response.json({"error": "internal error (see the daemon log)"}, 500)

    def _authorize(self, peer: Peer, headers: dict[str, str]) -> None:
        if peer.transport == "tcp":
            given = headers.get("authorization", "")
            if self.token is None or not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise ApiError(401, "missing or wrong bearer token")
        elif not self.policy.allows(peer):
            raise ApiError(403, f"uid {peer.uid} is not allowed to use the control socket")

    async def _read_body(self, conn: h11.Connection, stream: trio.SocketStream, headers: dict[str, str], limit: int) -> bytes:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"body of {length} bytes exceeds the limit of {limit} bytes")
        chunks = bytearray()
        while True:
            event = await self._next_event(conn, stream)
            if isinstance(event, h11.Data):
                chunks += event.data
                if len(chunks) > limit:
                    raise ApiError(413, f"body exceeds the limit of {limit} bytes")
            elif isinstance(event, h11.EndOfMessage):
                # No bytes() copy: a 400 MB file list would briefly be held twice.
                return chunks  # type: ignore[return-value]  # a bytearray serves every reader of the body
            else:
                raise ApiError(400, "incomplete request body")

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, response: Response) -> None:
        headers = [("Content-Type", response.content_type), ("Content-Length", str(len(response.body)))]
        if response.status >= 400 and conn.their_state is not h11.DONE:
            headers.append(("Connection", "close"))  # the unread rest of the body is not worth reading
        try:
            await stream.send_all(conn.send(h11.Response(status_code=response.status, headers=headers)))
            await stream.send_all(conn.send(h11.Data(data=response.body)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass
