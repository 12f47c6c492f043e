"""The fast path's transport: batches in, file bytes out through a per-connection memfd
ring. The data socket (``<controlSocket>.data``, ``data_socket`` in the per-volume file) is
AF_UNIX SOCK_SEQPACKET, one JSON object per message, because the h11 control socket cannot
carry a descriptor; it is admitted under the control socket's own policy, caps and
descriptor reserve. Per DataLoader worker (client: cube_torch/fastpath.py): ``hello`` → the
ring's size, protocol version and the peer's uid, with a ``memfd_create`` ring sealed
against shrinking and growing sent by SCM_RIGHTS; ``batch`` with relative paths → per path
``[offset, length]`` in the ring or ``null`` (read it through the mount); ``release`` with
each served file's open count, which is when the opens are counted. A response's bytes
belong to the worker until its next message and a connection has one batch in flight, so the
daemon never rewrites bytes a worker may read; the sample store's ops share the connection
(control/sampleplane.py). A worker sends its release before its batch reaches the loader,
so a count shown after the loader has it must include it: :meth:`DataPlane.settle` (part of
the filesystem's settle) waits until every message already in a socket is taken in. A
hello is due within ``HEAD_DEADLINE``, an idle connection closes after
:data:`IDLE_DEADLINE`, and a malformed message closes the connection."""

from __future__ import annotations

import array
import fcntl
import json
import logging
import mmap
import os
import select
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from cubefs_fuse.control.routes import relative_path
from cubefs_fuse.control.server import HEAD_DEADLINE, Peer, Slot
from cubefs_fuse.errors import BadRequest
from cubefs_fuse.limits import FAST_RING_BYTES, MAX_BATCH_FILES, MAX_BATCH_MESSAGE
from cubefs_fuse.prefetch.batches import BatchResolver, Caller, Resolved

log = logging.getLogger(__name__)

DATA_PROTOCOL_VERSION = 1
# An idle data connection (no batch for this long) is closed; the worker reconnects on its
# next batch (a hello and a new ring: well under a millisecond).  Training steps take
# seconds at most between batches of one worker; a validation pass or a checkpoint may
# take longer and then costs one reconnect.
IDLE_DEADLINE = 60.0
# Bytes copied into a ring between two checkpoints of the trio thread: 8 MiB is ~1 ms of
# memcpy, so a large batch never holds the thread (FUSE requests) for longer.
COPY_STEP = 8 * 1024 * 1024
# The longest a settle waits for connections to take in the messages already in their
# sockets: each is taken at the connection task's next step (well under a millisecond);
# the bound keeps a status or metrics answer from waiting on a trio thread that is
# overloaded for seconds (its counts then miss those releases, as before they arrive).
SETTLE_WAIT = 1.0
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


# The sample ops' server (control/sampleplane.py's SamplePlane.serve): a parsed message, the
# connection's ring and its peer in, the answer out.
SampleOps = Callable[[dict[str, Any], "Ring", Peer], Awaitable[dict[str, Any]]]


@dataclass(slots=True)
class DataPlaneStatistics:
    connections: int
    rings: int
    batches: int
    protocol_errors: int


class Ring:
    """A sealed memfd of ``size`` bytes, mapped writable by the daemon."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("cubefs-fuse-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class _Connection:
    """One data connection as :meth:`DataPlane.settle` sees it: its socket, and an event
    set each time its task has taken in a message (then replaced)."""

    __slots__ = ("sock", "took")

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.took = trio.Event()

    def taken(self) -> None:
        self.took.set()
        self.took = trio.Event()

    def holds_a_message(self) -> bool:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))


class DataPlane:
    """Serves admitted data-socket connections (``ControlServer.serve_data``'s handler)."""

    def __init__(self, resolver: BatchResolver, ring_bytes: int = FAST_RING_BYTES,
                 samples: SampleOps | None = None) -> None:
        self.resolver = resolver
        self.samples = samples
        self.ring_bytes = ring_bytes
        self.connections = 0
        self.rings = 0
        self.batches = 0
        self.protocol_errors = 0
        self._open: set[_Connection] = set()

    async def settle(self) -> None:
        """Wait until every connection has taken in the messages already in its socket
        (at most :data:`SETTLE_WAIT`): a release sent before this call is counted after it."""
        sent = [c.took for c in self._open if c.holds_a_message()]
        with trio.move_on_after(SETTLE_WAIT):
            for took in sent:
                await took.wait()

    def statistics(self) -> DataPlaneStatistics:
        return DataPlaneStatistics(self.connections, self.rings, self.batches, self.protocol_errors)

    async def serve(self, sock: trio.socket.SocketType, peer: Peer, slot: Slot) -> None:
        self.connections += 1
        connection = _Connection(sock)
        self._open.add(connection)
        ring: Ring | None = None
        caller = Caller(peer.pid, peer.uid, peer.gid)
        pending: list[Resolved] | None = None  # served, not yet released (nor counted)
        try:
            deadline = HEAD_DEADLINE
            while True:
                slot.waiting(True)
                message = b""
                with trio.move_on_after(deadline):
                    message = await sock.recv(MAX_BATCH_MESSAGE + 1)
                if not message:
                    return  # closed by the worker, or idle past the deadline
                slot.waiting(False)
                deadline = IDLE_DEADLINE
                try:
                    data = _load(message)
                    op, paths, opens = ("sample", [], []) if _is_sample_op(data) else _parse(data)
                except BadRequest as exc:
                    self.protocol_errors += 1
                    await _send_quietly(sock, {"error": str(exc)})
                    return
                if pending is not None:
                    self.resolver.commit(pending, opens if op == "release" else None)
                    pending = None
                connection.taken()
                if op == "release":
                    continue
                if op == "sample":
                    if ring is None:
                        self.protocol_errors += 1
                        await _send_quietly(sock, {"error": "say hello first"})
                        return
                    answer = await self.samples(data, ring, peer) if self.samples is not None else \
                        {"error": "this daemon keeps no sample cache (sampleCacheMemSize and sampleCacheDiskSize are 0)",
                         "status": 404}
                    await sock.send(json.dumps(answer, separators=(",", ":")).encode())
                    continue
                if op == "hello":
                    if ring is None:
                        ring = await trio.to_thread.run_sync(Ring, self.ring_bytes)
                        self.rings += 1
                    reply = json.dumps({"ring": ring.size, "version": DATA_PROTOCOL_VERSION, "uid": peer.uid}).encode()
                    await sock.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ring.fd]))])
                    continue
                if ring is None:
                    self.protocol_errors += 1
                    await _send_quietly(sock, {"error": "say hello first"})
                    return
                self.batches += 1
                results = await self.resolver.resolve(caller, paths, ring.size)
                layout: list[list[int] | None] = []
                offset = copied = 0
                for entry in results:
                    if entry.parts is None:
                        layout.append(None)
                        continue
                    layout.append([offset, entry.size])
                    for part in entry.parts:
                        ring.map[offset:offset + len(part)] = part
                        offset += len(part)
                        copied += len(part)
                        if copied >= COPY_STEP:
                            copied = 0
                            await trio.lowlevel.checkpoint()
                await sock.send(json.dumps({"files": layout}, separators=(",", ":")).encode())
                pending = results
        except OSError:
            pass  # the worker went away mid-answer: it reads through the mount
        finally:
            if pending is not None:
                self.resolver.commit(pending)  # delivered; the worker left without saying which it used
            self._open.discard(connection)
            connection.taken()
            self.connections -= 1
            if ring is not None:
                self.rings -= 1
                # Freeing a used ring's pages takes ~1 ms (profiled: one ring of a DataLoader
                # worker's epoch): a worker thread's job, shielded so that a cancelled
                # connection frees its ring too.
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(ring.close)


def _load(message: bytes) -> dict[str, Any]:
    if len(message) > MAX_BATCH_MESSAGE:
        raise BadRequest(f"message over {MAX_BATCH_MESSAGE} bytes")
    try:
        data: Any = json.loads(message)
    except (ValueError, RecursionError):
        raise BadRequest("message is not JSON") from None
    if not isinstance(data, dict):
        raise BadRequest("message must be a JSON object")
    return data


def _is_sample_op(data: dict[str, Any]) -> bool:
    op = data.get("op")
    return isinstance(op, str) and op.startswith("sample_")


def _parse(data: dict[str, Any]) -> tuple[str, list[str], list[int]]:
    op = data.get("op")
    if op == "hello":
        return "hello", [], []
    if op == "release":
        opens = data.get("opens")
        # An open count per file of the batch; a loader opens a file a few times at most
        # (a sample repeated in its batch), MAX_BATCH_FILES bounds what one batch may claim.
        if (not isinstance(opens, list) or len(opens) > MAX_BATCH_FILES
                or not all(type(n) is int and 0 <= n <= MAX_BATCH_FILES for n in opens)):
            raise BadRequest(f"'opens' must be a list of at most {MAX_BATCH_FILES} open counts")
        return "release", [], opens
    if op != "batch":
        raise BadRequest("op must be 'hello', 'batch' or 'release'")
    paths = data.get("paths")
    if not isinstance(paths, list) or not 0 < len(paths) <= MAX_BATCH_FILES:
        raise BadRequest(f"'paths' must be a list of 1-{MAX_BATCH_FILES} relative paths")
    clean = [relative_path(p) for p in paths]
    if any(not p for p in clean):
        raise BadRequest("the volume root is not a file")
    return "batch", clean, []


async def _send_quietly(sock: trio.socket.SocketType, data: dict[str, Any]) -> None:
    try:
        await sock.send(json.dumps(data).encode())
    except OSError:
        pass
