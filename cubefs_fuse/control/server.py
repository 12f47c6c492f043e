"""The control API's HTTP/1.1 server (h11 over trio): transport, auth, bounds, routing, and
nothing about prefetching (handlers are registered per method and path). For every handler
it enforces the peer's credentials (SO_PEERCRED right after ``accept()``, a refused peer
answered 403 and closed at once) or, on the optional loopback port, a bearer token; at most
:data:`MAX_CONNECTIONS` connections, :data:`MAX_PER_UID` per uid, :data:`HEAD_DEADLINE` for
a request head, and none accepted into the last :func:`fd_reserve` descriptors; a body limit
per route and a deadline per request; and errors as JSON with the status from
:data:`STATUS_OF`, anything unexpected logged and answered 500 (docs/concurrency.md,
"Control socket resources")."""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import os
import resource
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import trio

from cubefs_fuse.control.protocol import CONTENT_JSON
from cubefs_fuse.errors import BadRequest, ConfigError, Forbidden, NoRoom, NotFound, RequestError, TooLarge
from cubefs_fuse.limits import MAX_JSON_BODY

log = logging.getLogger(__name__)

# A request's body must arrive within this time; a 400 MB file list over a Unix socket
# takes well under a second, so 120 s only cuts off stalled clients.
REQUEST_DEADLINE = 120.0
# A new connection, and a kept-alive one after its last response, must deliver a complete
# request head within this time or it is closed.  Our clients write the head in one
# send() right after connect(), so 5 s is orders of magnitude of slack; an idle or
# dribbling connection holds its slot for at most this long.
HEAD_DEADLINE = 5.0
# Connections served at once.  Clients are a handful of training processes (one
# submitter and one reporter thread each, one short connection per request) and
# operators' tools: 8 ranks x 2 threads = 16 per node and user, doubled for the
# operator's tools and retries = 32 per uid; 64 in all lets two such users work at once.
# A connection beyond a cap first takes the slot of a connection that is waiting for its
# request head (the longest waiting first); if every connection is mid-request, the new
# one gets a 503 and is closed at once.
MAX_CONNECTIONS = 64
MAX_PER_UID = 32
# The listen backlog: connections the kernel queues until the accept loop takes them (the
# kernel caps it at net.core.somaxconn, 4096 by default).  Refused peers are taken and
# closed at once, so a deep queue only absorbs bursts (every rank of a job at once, or a
# flood) while clients retry a full one (control/protocol.py's connect).
LISTEN_BACKLOG = 1024
# Accepts per wake-up of the accept loop before it yields to other tasks (FUSE requests).
_ACCEPT_BATCH = 64
# accept() failed for lack of descriptors or memory: wait this long before retrying
# (the kernel keeps the pending connections in the backlog meanwhile).
_ACCEPT_RETRY = 0.1
_READ_CHUNK = 1024 * 1024
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
# The HTTP status of each kind of request error the core raises.
STATUS_OF: dict[type[RequestError], int] = {
    BadRequest: 400, Forbidden: 403, NotFound: 404, TooLarge: 413, NoRoom: 507,
}


def fd_reserve(soft_limit: int) -> int:
    """Descriptors the control server must leave free for the data path.

    The data path holds up to 1024 cached directory descriptors (backends' DIR_FD_CACHE),
    one file per backend thread (at most a few hundred), 8 disk-tier threads, /dev/fuse,
    the metrics exporter's sockets and the disk tier's files: 2048 covers them with room
    to spare.  Under a small limit (a container's 1024) half of it is kept instead.
    """
    return min(2048, soft_limit // 2)


def _fd_ceiling() -> int:
    """The first descriptor number the control server must not accept into."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20  # the kernel's default nr_open
    return soft - fd_reserve(soft)


def _quick_answer(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP response, written without waiting to a connection about to be closed."""
    body = json.dumps({"error": message}, separators=(",", ":")).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {CONTENT_JSON}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _data_answer(status: int, reason: str, message: str) -> bytes:
    """The data socket's refusal: one JSON message (the client reads it as an error)."""
    return json.dumps({"error": message, "status": status}, separators=(",", ":")).encode()


def _refuse(sock: socket.socket, answer: bytes) -> None:
    """Write ``answer`` if the socket buffer takes it at once, then close: no await, no task."""
    try:
        sock.send(answer, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    except OSError:
        pass  # the peer is gone or its buffer is full: it gets the close alone
    sock.close()


def remove_stale_socket(path: str) -> None:
    """Remove a socket file left at ``path``; refuse (ConfigError) anything else there.

    ``controlSocket`` may name any path: a regular file, a directory or a symlink there is
    someone's data or a trap, never ours to delete.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"key 'controlSocket': {path!r} exists and is not a socket: refusing to replace it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _Conn:
    """One admitted connection: its uid bucket, whether it waits for a request head (or,
    on the data socket, for its next batch), and the cancel scope that closes it when its
    slot is taken."""

    __slots__ = ("uid", "scope", "waiting_since", "released")

    def __init__(self, uid: int, scope: trio.CancelScope) -> None:
        self.uid = uid
        self.scope = scope
        self.waiting_since: float | None = trio.current_time()
        self.released = False

    def waiting(self, idle: bool) -> None:
        """Idle connections give up their slot first when the caps are reached."""
        self.waiting_since = trio.current_time() if idle else None


Slot = _Conn


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
        except RecursionError:
            raise ApiError(400, "body is not valid JSON: nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, and integers beyond Python's int-str limit
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
# A data-socket connection (control/dataplane.py): the admitted socket, its peer, and its
# slot (``waiting(True/False)`` marks it idle, i.e. the first to give up its slot).
DataHandler = Callable[[trio.socket.SocketType, "Peer", "Slot"], Awaitable[None]]


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
        self.requests = 0
        self.rejected = 0
        self.refused_peers = 0  # connections closed at accept: peer not allowed
        self.refused_full = 0  # connections closed at accept: caps or descriptor reserve reached
        self.evicted = 0  # connections waiting for a request head, closed to make room
        self._conns: list[_Conn] = []  # admitted, oldest first (at most MAX_CONNECTIONS)
        self._per_uid: dict[int, int] = {}
        self._fd_ceiling = _fd_ceiling()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def route(self, method: str, path: str, handler: Handler, *, max_body: int = MAX_JSON_BODY) -> None:
        self.routes[(method, path)] = Route(handler, max_body)

    async def serve_unix(self, path: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on a Unix socket (mode 0666: access is decided by peer credentials).

        A socket file left at ``path`` is replaced; anything else there (a regular file, a
        directory, a symlink) is refused with a ConfigError and left alone.
        """
        await self._listen(path, socket.SOCK_STREAM, None, task_status)

    async def serve_data(self, path: str, handler: DataHandler, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on the fast path's data socket (SOCK_SEQPACKET, mode 0666).

        The same admission as the control socket, in the same counters: the peer
        credentials checked against the same :class:`AccessPolicy` right after accept()
        (a refused peer gets one error message and the close, never a descriptor), the
        same connection caps (an idle data connection is the first to give its slot up)
        and the descriptor reserve.  ``handler`` serves an admitted connection.
        """
        await self._listen(path, socket.SOCK_SEQPACKET, handler, task_status)

    async def serve_tcp(self, port: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on loopback only; every request needs the bearer token."""
        await self._listen(("127.0.0.1", port), socket.SOCK_STREAM, None, task_status)

    async def _listen(self, address: str | tuple[str, int], kind: int, handler: DataHandler | None,
                      task_status: trio.TaskStatus[None]) -> None:
        """Bind a socket of ``kind`` at ``address`` (a Unix socket's path, or a TCP host and
        port), accept on it until cancelled, and close it at the end.  A Unix socket
        replaces a stale one at its path and is removed at the end."""
        path = address if isinstance(address, str) else None
        if path is not None:
            remove_stale_socket(path)
        family = socket.AF_UNIX if path is not None else socket.AF_INET
        sock = socket.socket(family, kind | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            if path is None:  # a restarted daemon rebinds its port while the last one's connections linger
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            if path is not None:
                os.chmod(path, 0o666)  # access is decided by peer credentials
            sock.listen(LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        task_status.started()
        try:
            await self._accept_loop(sock, "unix" if path is not None else "tcp", handler)
        finally:
            sock.close()
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    async def _accept_loop(self, listener: socket.socket, transport: str, data: DataHandler | None = None) -> None:
        """Accept, check and admit or refuse each connection; a refusal costs no task."""
        async with trio.open_nursery() as nursery:
            while True:
                await trio.lowlevel.wait_readable(listener)
                for _ in range(_ACCEPT_BATCH):
                    try:
                        sock, _ = listener.accept()
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            self.refused_full += 1
                            await trio.sleep(_ACCEPT_RETRY)
                            break
                        if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                            continue  # that peer gave up; the next one may be fine
                        raise
                    self._admit(nursery, sock, transport, data)
                await trio.lowlevel.checkpoint()

    def _admit(self, nursery: trio.Nursery, sock: socket.socket, transport: str,
               data: DataHandler | None = None) -> None:
        """Decide at once: refuse (a short answer if the buffer takes it, then close) or serve."""
        answer = _quick_answer if data is None else _data_answer
        if transport == "unix":
            try:
                raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            except OSError:
                sock.close()
                return
            pid, uid, gid = _PEERCRED.unpack(raw)
            peer = Peer(pid, uid, gid, transport)
            if not self.policy.allows(peer):
                self.refused_peers += 1
                _refuse(sock, answer(403, "Forbidden", f"uid {uid} is not allowed to use the control socket"))
                return
        else:
            peer = Peer(0, -1, -1, transport)
        if sock.fileno() >= self._fd_ceiling:
            # Descriptors are handed out lowest first: every one below this number is in use,
            # so only the reserve is left.  It stays for FUSE and the caches.
            self.refused_full += 1
            _refuse(sock, answer(503, "Service Unavailable", "the daemon is short of file descriptors"))
            return
        if not self._make_room(peer.uid):
            self.refused_full += 1
            _refuse(sock, answer(503, "Service Unavailable", "too many control connections: retry later"))
            return
        sock.setblocking(False)
        slot = _Conn(peer.uid, trio.CancelScope())
        self._conns.append(slot)
        self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
        if data is not None:
            nursery.start_soon(self._serve_data, data, trio.socket.from_stdlib_socket(sock), peer, slot)
        else:
            nursery.start_soon(self._serve, trio.SocketStream(trio.socket.from_stdlib_socket(sock)), peer, slot)

    def _make_room(self, uid: int) -> bool:
        """True if a new connection of ``uid`` fits, after closing a waiting one if needed."""
        if self._per_uid.get(uid, 0) >= MAX_PER_UID:
            return self._evict(uid)
        if len(self._conns) >= MAX_CONNECTIONS:
            return self._evict(None)
        return True

    def _evict(self, uid: int | None) -> bool:
        """Close the connection (of ``uid``, else anyone's) waiting longest for a request head."""
        victim: _Conn | None = None
        for slot in self._conns:  # at most MAX_CONNECTIONS
            since = slot.waiting_since
            if since is not None and (uid is None or slot.uid == uid):
                if victim is None or since < (victim.waiting_since or 0.0):
                    victim = slot
        if victim is None:
            return False
        self._release(victim)
        victim.scope.cancel()
        self.evicted += 1
        return True

    def _release(self, slot: _Conn) -> None:
        if slot.released:
            return
        slot.released = True
        self._conns.remove(slot)
        left = self._per_uid[slot.uid] - 1
        if left:
            self._per_uid[slot.uid] = left
        else:
            del self._per_uid[slot.uid]

    async def _serve(self, stream: trio.SocketStream, peer: Peer, slot: _Conn) -> None:
        try:
            with slot.scope:
                conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
                while await self._one_request(conn, stream, peer, slot):
                    if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                        break
                    try:
                        conn.start_next_cycle()
                    except h11.LocalProtocolError:
                        break
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._release(slot)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _serve_data(self, handler: DataHandler, sock: trio.socket.SocketType, peer: Peer, slot: _Conn) -> None:
        try:
            with slot.scope:
                await handler(sock, peer, slot)
        finally:
            self._release(slot)
            sock.close()

    async def _next_event(self, conn: h11.Connection, stream: trio.SocketStream) -> Any:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(_READ_CHUNK))
                continue
            return event

    async def _one_request(self, conn: h11.Connection, stream: trio.SocketStream, peer: Peer, slot: _Conn) -> bool:
        """Serve one request; False when the connection is to be closed."""
        slot.waiting_since = trio.current_time()
        try:
            event: Any = None
            with trio.move_on_after(HEAD_DEADLINE):
                event = await self._next_event(conn, stream)
            if not isinstance(event, h11.Request):
                return False  # no complete head in time, closed by the peer, or not a request
            slot.waiting_since = None  # busy: this connection's slot is not taken from it now
            self.requests += 1
            response: Response | None = None
            with trio.move_on_after(REQUEST_DEADLINE):
                response = await self._dispatch(conn, stream, event, peer)
            if response is None:
                return False  # the body did not arrive in time
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
        # h11 has checked the header's syntax; ASCII digits, and a length beyond 19 digits is
        # over every limit without converting it.
        if length is not None and length.isascii() and length.isdigit() and (len(length) > 19 or int(length) > limit):
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
