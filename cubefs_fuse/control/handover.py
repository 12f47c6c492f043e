"""Handing a live mount to the next daemon (``cubefs-fuse upgrade``): readers see a pause,
never an error.

The running daemon listens on its handover socket (the control socket's path +
``.handover``, mode 0600; a peer of another uid than the daemon's, root aside, is
refused).  The successor, started with ``--take-over``, connects and sends one line: the
state formats it reads.  The running daemon, if it writes one of them,

1. stops reading the kernel's requests (the kernel queues new ones) and answers those in
   flight (``KernelSession.hand_over``);
2. releases what the successor takes: the control and data sockets, the metrics port,
   the volume file, the NVMe tier (its index written, its lock released);
3. sends one message: a header line (the lengths of what follows) carrying the /dev/fuse
   descriptor (SCM_RIGHTS), then the state (JSON, ``FORMAT``): the kernel's INIT request
   and the filesystem's inode table and directory handles (``Filesystem.export``), whose
   bytes values (the inode table's columns) follow the JSON raw;
4. waits for the successor's one-line answer.  ``ok``: the successor serves the mount, and
   the old daemon exits.  Anything else, or the connection closing (the successor died):
   the old daemon adopts its own connection again, as the successor would have, and
   serves on.  There is no timeout on this wait: the old daemon must not take the
   connection back while the successor might still answer ``ok`` and start reading it.

The successor builds its components, adopts the connection, restores the state and
answers ``ok`` just before its readers start; if it fails before, it answers why (or
dies) and leaves the mount as it was.  Readers pause from step 1 to that answer.
"""

from __future__ import annotations

import array
import base64
import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from cubefs_fuse import __version__, mounts
from cubefs_fuse.errors import ConfigError
from cubefs_fuse.fs.session import Detached, KernelSession

log = logging.getLogger(__name__)

# The state's format: a successor that reads none of the running daemon's formats is
# refused before anything stops (then unmount and mount again).  1: init (base64), fs
# (Filesystem.export: inodes, dirs, next_handle).
FORMAT = 1
FORMATS_READ = (1,)
# A request line or an answer line is short JSON or a word: more than this is not ours.
MAX_LINE = 4096
# How long the running daemon waits for a connected peer's request line: a peer that
# connects and says nothing must not hold the listener.
REQUEST_TIMEOUT = 10.0


@dataclass(frozen=True)
class Adopted:
    """A connection to serve, the state that goes with it, and when its readers were paused
    (time.monotonic(): CLOCK_MONOTONIC, one clock for every process of the machine)."""

    connection: Detached
    fs: dict[str, Any]
    paused_at: float


async def _read_line(sock: trio.socket.SocketType, prefix: bytes = b"") -> tuple[bytes, bytes]:
    """One line (without its newline) and what came after it; b"" at end of stream."""
    data = prefix
    while b"\n" not in data:
        if len(data) > MAX_LINE:
            raise ValueError("line too long")
        chunk = await sock.recv(MAX_LINE)
        if not chunk:
            return b"", b""
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view):]


# The state is JSON but for its bytes values (the inode table's columns), which go raw after
# it, each named in the JSON by {BLOB: its index}.
BLOB = "$blob"


def without_blobs(value: Any, blobs: list[bytes]) -> Any:
    """``value`` for JSON: each bytes value appended to ``blobs`` and named by its index."""
    if isinstance(value, bytes):
        blobs.append(value)
        return {BLOB: len(blobs) - 1}
    if isinstance(value, dict):
        return {k: without_blobs(v, blobs) for k, v in value.items()}
    if isinstance(value, list):
        return [without_blobs(v, blobs) for v in value]
    return value


def with_blobs(value: Any, blobs: list[bytes]) -> Any:
    """What :func:`without_blobs` was given, from its result (read from JSON) and ``blobs``."""
    if isinstance(value, dict):
        if set(value) == {BLOB}:
            return blobs[int(value[BLOB])]
        return {k: with_blobs(v, blobs) for k, v in value.items()}
    if isinstance(value, list):
        return [with_blobs(v, blobs) for v in value]
    return value


# -- the running daemon ----------------------------------------------------------------


class Listener:
    """The running daemon's side: takes one successor's request and pauses the session."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.session: KernelSession | None = None  # set once the session serves
        self.successor: trio.socket.SocketType | None = None  # the peer being handed the mount
        self.paused_at = 0.0  # when the readers were paused for it
        # What to release before the readers pause (while the mount is still served): the
        # metrics port, whose server takes a poll interval to stop.
        self.before_pause: Callable[[], Awaitable[None]] | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock, contextlib.ExitStack() as cleanup:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # a dead daemon's (the control socket's owner checked it is dead)
            await sock.bind(self.path)
            cleanup.callback(mounts.unlink_if_same, self.path, os.stat(self.path).st_ino)
            os.chmod(self.path, 0o600)
            sock.listen(4)
            task_status.started()
            async with trio.open_nursery() as nursery:
                while True:
                    peer, _ = await sock.accept()
                    nursery.start_soon(self._handle, peer)

    async def _handle(self, peer: trio.socket.SocketType) -> None:
        keep = False
        try:
            pid, uid, _ = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            if uid not in (0, os.geteuid()):
                await self._refuse(peer, f"uid {uid} may not take over this daemon's mount")
                return
            with trio.move_on_after(REQUEST_TIMEOUT):
                try:
                    line, _ = await _read_line(peer)
                    request = json.loads(line)
                    formats = [int(f) for f in request["formats"]]
                except (ValueError, KeyError, TypeError):
                    await self._refuse(peer, "not a handover request")
                    return
                if FORMAT not in formats:
                    await self._refuse(peer, f"this daemon ({__version__}) hands over state format {FORMAT}, "
                                             f"which the new one ({request.get('version', '?')}) does not read "
                                             f"(it reads {formats}): unmount and mount again instead")
                    return
                session = self.session
                if session is None or self.successor is not None:
                    await self._refuse(peer, "the daemon is not serving yet" if session is None
                                       else "a handover is under way already")
                    return
                log.info("handing the mount over to daemon pid %d (version %s): pausing the readers",
                         pid, request.get("version", "?"))
                self.successor = peer
                keep = True
                if self.before_pause is not None:
                    await self.before_pause()
                self.paused_at = time.monotonic()
                await session.hand_over()
        except OSError as exc:
            log.warning("handover request failed: %s", exc)
        except Exception:  # a bug must not end the daemon: the mount is served on
            log.exception("unexpected error taking a handover request")
        finally:
            if not keep:
                peer.close()

    @staticmethod
    async def _refuse(peer: trio.socket.SocketType, why: str) -> None:
        log.warning("handover refused: %s", why)
        with contextlib.suppress(OSError):
            await _send_all(peer, json.dumps({"error": why}).encode() + b"\n")


@dataclass
class Outgoing:
    """What the running daemon hands over, once it has released everything."""

    successor: trio.socket.SocketType
    adopted: Adopted

    async def complete(self) -> Adopted | None:
        """Send the connection and the state; None once the successor serves the mount,
        else (it refused or died) the connection for this daemon to serve again."""
        fd, init = self.adopted.connection
        sock = self.successor
        try:
            blobs: list[bytes] = []
            state = json.dumps({"format": FORMAT, "version": __version__, "init": base64.b64encode(init).decode(),
                                "paused_at": self.adopted.paused_at, "fs": without_blobs(self.adopted.fs, blobs)}).encode()
            header = json.dumps({"format": FORMAT, "state_bytes": len(state),
                                 "blob_bytes": [len(b) for b in blobs]}).encode() + b"\n"
            await sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            for part in (state, *blobs):
                await _send_all(sock, part)
            answer, _ = await _read_line(sock)
        except (OSError, ValueError) as exc:
            answer = f"no answer ({exc})".encode()
        finally:
            sock.close()
        if answer == b"ok":
            os.close(fd)
            log.info("the new daemon serves the mount: exiting")
            return None
        log.warning("the handover failed (%s): serving the mount again",
                    answer.decode(errors="replace") or "the new daemon exited")
        return self.adopted


# -- the successor ---------------------------------------------------------------------


@dataclass
class Predecessor:
    """The successor's side: the running daemon's connection and state, and its answer."""

    sock: trio.socket.SocketType
    adopted: Adopted
    answered: bool = False

    @property
    def paused_at(self) -> float:
        return self.adopted.paused_at

    async def answer(self, ok: bool, why: str = "") -> None:
        """Tell the old daemon to exit (``ok``) or to serve on (``why``); once."""
        assert not self.answered
        self.answered = True
        with contextlib.suppress(OSError):
            await _send_all(self.sock, b"ok\n" if ok else f"abort: {why}\n".encode()[:MAX_LINE])
        self.sock.close()


async def take_over(path: str) -> Predecessor:
    """Ask the daemon listening at ``path`` for its mount; returns once it has released
    everything (ConfigError, saying why, if there is no such daemon or it refuses)."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            await sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ConfigError(f"no running daemon to take the mount over from ({path} does not answer)") from None
        await _send_all(sock, json.dumps({"formats": list(FORMATS_READ), "version": __version__}).encode() + b"\n")
        data, ancdata, _, _ = await sock.recvmsg(MAX_LINE, socket.CMSG_SPACE(struct.calcsize("i")))
        fds = [fd for level, kind, payload in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
               for fd in array.array("i", payload[: len(payload) - len(payload) % 4])]
        try:
            line, rest = await _read_line(sock, data)
            if not line:
                raise ConfigError("the running daemon ended the handover without handing the mount over "
                                  "(its log says why); it serves on")
            header = json.loads(line)
            if "error" in header:
                raise ConfigError(f"the running daemon refused the handover: {header['error']}")
            if len(fds) != 1:
                raise ValueError(f"{len(fds)} descriptors came with the state")
            sizes = [int(header["state_bytes"]), *map(int, header["blob_bytes"])]
            received = bytearray(rest)
            while len(received) < sum(sizes):
                chunk = await sock.recv(min(1 << 20, sum(sizes) - len(received)))
                if not chunk:
                    raise ValueError("the state was cut short")
                received += chunk
            parts, start = [], 0
            for size in sizes:
                parts.append(bytes(received[start:start + size]))
                start += size
            del received
            state = json.loads(parts[0])
            if state["format"] not in FORMATS_READ:
                raise ValueError(f"state format {state['format']} is not one this release reads")
            adopted = Adopted((fds[0], base64.b64decode(state["init"])), with_blobs(state["fs"], parts[1:]),
                              float(state["paused_at"]))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Predecessor(sock, adopted)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        sock.close()
        raise ConfigError(f"the running daemon's handover could not be read: {exc}") from None
    except BaseException:
        sock.close()
        raise
