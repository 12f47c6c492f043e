"""The keeper: the small parent process of a mount's daemon, which keeps the mount alive
when the daemon dies.

The kernel keeps a FUSE connection as long as some process holds a descriptor of its
/dev/fuse; readers then wait in the kernel's queue.  The keeper holds one (and the daemon's
inode journal, fs/journal.py), so a daemon SIGKILLed, OOM-killed or crashed does not take
the mount with it: the keeper starts a new daemon (``mount --serve --recover``) that adopts
the connection, rebuilds the inode table from the journal, has the kernel send again the
requests the dead one had read (FUSE_NOTIFY_RESEND) and serves on.  Readers see a pause:
most of a new daemon's start is Python importing its modules (~0.85 s here), so the keeper
keeps one started in advance, its imports done, waiting for a mount to recover (a standby,
~50 MB); the pause is then the recovery itself.

``cubefs-fuse mount`` runs the keeper (in the foreground under systemd and Kubernetes: it is
the unit's main process, the container's first); the keeper runs the daemon as its child,
with a SOCK_SEQPACKET channel between them.  The daemon says on it (``Link``): ``connection``
(a /dev/fuse duplicate, its journal, the kernel's INIT request), ``journal`` (a compacted
one), ``ready`` or ``error`` (relayed to whoever started it), ``bye`` (it unmounted, or
handed the mount over: the keeper must not recover).  A daemon that ends without ``bye``
while the mount is there was lost: the keeper recovers it.

Upgrades go through the keeper too (``cubefs-fuse upgrade`` asks on ``<controlSocket>.keeper``,
mode 0600, peer uid checked): it starts the new daemon (``--take-over``), which takes the mount
from the running one (control/handover.py), and answers with its report.  The keeper's pid
never changes: systemd's main process and a container's first process stay."""

from __future__ import annotations

import array
import base64
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cubefs_fuse import mounts

log = logging.getLogger(__name__)

# One message on the channel: JSON, and at most two descriptors.
MAX_MESSAGE = 4096
# A recovery that fails is tried again after these pauses; past the last the keeper gives up
# (closes the connection: readers get ENOTCONN instead of waiting for ever).
RECOVERY_BACKOFF = (0.5, 2.0, 5.0)
# How long an upgrade's requester may take to say what it wants.
REQUEST_TIMEOUT = 10.0


def keeper_socket_path(control_socket: str) -> str:
    return control_socket + ".keeper"


def _send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the descriptors that came with it; None at the end of the channel
    (a peer that closed with a message of ours unread resets it: an end too)."""
    try:
        data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(2 * struct.calcsize("i")))
    except ConnectionResetError:
        return None
    fds = [fd for level, kind, payload in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
           for fd in array.array("i", payload[: len(payload) - len(payload) % 4])]
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    try:
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("not an object")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


# -- the daemon's side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Recovery:
    """What a recovering daemon gets from its keeper: the dead daemon's connection (a
    /dev/fuse descriptor and the INIT request), its journal, when and whose death it was."""

    connection: tuple[int, bytes]
    journal_fd: int
    died_at: float  # time.monotonic(): one clock for every process of the machine
    previous_pid: int


class Link:
    """The daemon's end of the channel to its keeper.  Every send is one small datagram the
    keeper reads at once: it never blocks for long, and a keeper that is gone costs a
    warning, never the daemon's serving."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        os.set_inheritable(fd, False)  # the channel ends when this process does, not a child's
        self._warned = False

    def _say(self, message: dict[str, Any], fds: tuple[int, ...] = (), quiet: bool = False) -> None:
        try:
            _send(self.sock, message, fds)
        except OSError as exc:
            if not self._warned and not quiet:
                self._warned = True
                log.warning("cannot reach the keeper (%s): a crash of this daemon would end the mount", exc)

    def standing_by(self) -> None:
        """A standby has imported what a daemon needs: from now on it takes over at once."""
        self._say({"kind": "standby", "pid": os.getpid()}, quiet=True)  # a keeper gone: recovery() says it

    def recovery(self) -> Recovery | None:
        """The keeper's first message to a daemon started to recover a mount (it may wait
        long: a standby waits for a daemon's death); None if the keeper ended the channel
        instead (the standby is not needed)."""
        received = _receive(self.sock)
        if received is None:
            return None
        message, fds = received
        if message.get("kind") != "recover" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise OSError(f"not a recovery: {message.get('kind')!r} with {len(fds)} descriptors")
        return Recovery((fds[0], base64.b64decode(message["init"])), fds[1], float(message["died_at"]),
                        int(message["previous"]))

    def journal_to_continue(self) -> int | None:
        """The keeper's first message to a daemon started to take the mount over: the
        running daemon's journal (None: none, or the keeper ended the channel)."""
        received = _receive(self.sock)
        if received is None:
            return None
        message, fds = received
        if message.get("kind") != "journal" or len(fds) > 1:
            for fd in fds:
                os.close(fd)
            raise OSError(f"not a journal: {message.get('kind')!r} with {len(fds)} descriptors")
        return fds[0] if fds else None

    def deposit(self, connection: tuple[int, bytes], journal_fd: int) -> None:
        """Give the keeper the connection (the descriptor is closed here once sent) and the journal."""
        fd, init = connection
        try:
            self._say({"kind": "connection", "init": base64.b64encode(init).decode()}, (fd, journal_fd))
        finally:
            os.close(fd)

    def journal(self, fd: int) -> None:
        self._say({"kind": "journal"}, (fd,))

    def ready(self, detail: str) -> None:
        self._say({"kind": "ready", "detail": detail, "pid": os.getpid()})

    def failed(self, message: str) -> None:
        self._say({"kind": "error", "message": message})

    def bye(self, handed_over: bool) -> None:
        self._say({"kind": "bye", "handed_over": handed_over})


# -- the keeper -----------------------------------------------------------------------------


@dataclass
class _Child:
    """A daemon the keeper started, and what it said."""

    role: str  # "start", "take-over" or "recover"
    proc: subprocess.Popen[bytes]
    channel: socket.socket
    answer: Callable[[dict[str, Any]], None]  # where its ready/error report goes
    ready: bool = False
    bye: bool = False
    handed_over: bool = False
    error: str = ""
    journal: int | None = None
    init: bytes = b""
    reported: bool = False

    def report(self, answer: dict[str, Any]) -> None:
        if not self.reported:
            self.reported = True
            self.answer(answer)


@dataclass
class Keeper:
    """Runs a mount's daemons, holds its connection, recovers a lost daemon (``run``)."""

    config_path: str
    mount_point: str
    control_socket: str
    report: Callable[[str], None]  # the first daemon's ready line ("ok ..." or "error: ...")
    child_args: list[str]  # given to every daemon (--detached: it logs to the log file)
    connection: int | None = None  # the /dev/fuse descriptor held
    init: bytes = b""
    journal: int | None = None  # the serving daemon's journal
    current: _Child | None = None
    successor: _Child | None = None
    standby: _Child | None = None  # a recovering daemon started in advance, waiting for a death
    lost: tuple[_Child, int] | None = None  # the serving daemon, dead during an upgrade, and its status
    children: list[_Child] = field(default_factory=list)
    retired: list[subprocess.Popen[bytes]] = field(default_factory=list)  # standbys told to end
    failed_recoveries: int = 0
    socket_inode: int = 0  # of the upgrade socket this keeper bound (removed at exit if still its own)
    stopping: bool = False  # SIGTERM or SIGINT came: the mount is being unmounted, not recovered
    exit_code: int | None = None

    def run(self) -> int:
        selector = selectors.DefaultSelector()
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        signals: list[int] = []

        def on_signal(signum: int, _frame: object) -> None:
            signals.append(signum)

        previous_wakeup = signal.set_wakeup_fd(wake_w.fileno())
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        selector.register(wake_r, selectors.EVENT_READ, "signal")
        listener = self._listen()
        if listener is not None:
            selector.register(listener, selectors.EVENT_READ, "upgrade")
        try:
            self.current = self._spawn(selector, "start", lambda a: self.report(
                f"ok {a['detail']}".strip() if a.get("ok") else f"error: {a['error']}"))
            while self.exit_code is None:
                for key, _ in selector.select():
                    if key.data == "signal":
                        with contextlib.suppress(BlockingIOError):
                            wake_r.recv(64)
                        while signals:
                            self._forward(selector, signals.pop(0))
                    elif key.data == "upgrade":
                        self._upgrade(selector, listener)  # type: ignore[arg-type]
                    elif key.data in self.children:  # (not a standby retired by an earlier key)
                        self._on_channel(selector, key.data)
                self._reap()
            return self.exit_code
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            if listener is not None:
                mounts.unlink_if_same(keeper_socket_path(self.control_socket), self.socket_inode)
                listener.close()
            for fd in (self.connection, self.journal):
                if fd is not None:
                    os.close(fd)
            for child in self.children:  # a standby hears the end of its channel, and exits
                child.channel.close()
            selector.close()
            wake_r.close()
            wake_w.close()

    # -- children ----------------------------------------------------------------------------

    def _spawn(self, selector: selectors.BaseSelector, role: str,
               answer: Callable[[dict[str, Any]], None]) -> _Child:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-m", "cubefs_fuse", "mount", "-c", self.config_path, "--serve",
                   f"--channel-fd={theirs.fileno()}", *self.child_args]
        if role != "start":
            command.append(f"--{role}")
        try:
            # Its own process group: a terminal's Ctrl-C reaches the keeper only, which passes
            # it on once (a second signal would kill the daemon in the middle of its unmount).
            proc = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                    process_group=0)
        finally:
            theirs.close()
        child = _Child(role, proc, ours, answer)
        self.children.append(child)
        selector.register(ours, selectors.EVENT_READ, child)
        return child

    def _on_channel(self, selector: selectors.BaseSelector, child: _Child) -> None:
        try:
            received = _receive(child.channel)
        except (OSError, ValueError) as exc:  # garbage from our own child: a bug, treated as its end
            log.error("the daemon (pid %d) sent what is not a message (%s)", child.proc.pid, exc)
            received = None
        if received is None:
            selector.unregister(child.channel)
            child.channel.close()
            self._ended(selector, child, child.proc.wait())
            return
        message, fds = received
        kind = message.get("kind")
        if kind == "connection" and len(fds) == 2:
            if self.connection is None:
                self.connection = fds[0]
            else:
                os.close(fds[0])  # the same connection: one descriptor is enough
            _replace(child, "journal", fds[1])
            child.init = base64.b64decode(message.get("init", ""))
            self._promote(selector, child)
        elif kind == "journal" and len(fds) == 1:
            _replace(child, "journal", fds[0])
            self._promote(selector, child)
        elif kind == "ready":
            child.ready = True
            if child is self.successor:
                self._succeeded(selector)
            self.failed_recoveries = 0
            self._promote(selector, child)
            child.report({"ok": True, "detail": str(message.get("detail", "")), "pid": child.proc.pid})
        elif kind == "error":
            child.error = str(message.get("message", ""))
        elif kind == "standby" and child is self.standby:
            log.info("standby daemon pid %d ready to take the mount over if the daemon dies", child.proc.pid)
        elif kind == "bye":
            child.bye, child.handed_over = True, bool(message.get("handed_over"))
            if child.handed_over and self.successor is not None:
                # The successor said "ok" to it: it serves, whether or not its report is here yet.
                self._succeeded(selector)
        elif kind != "standby":  # (a recovering daemon started after a death says it too)
            for fd in fds:
                os.close(fd)
            log.error("the daemon (pid %d) sent an unknown message %r", child.proc.pid, kind)

    def _promote(self, selector: selectors.BaseSelector, child: _Child) -> None:
        """The serving daemon's journal (and INIT) is the one a recovery starts from; once it
        is here and the daemon has said it serves, a standby waits for the daemon's death."""
        if child is self.current and child.journal is not None:
            if self.journal is not None:
                os.close(self.journal)
            self.journal, self.init = os.dup(child.journal), child.init or self.init
            if child.ready:
                self._start_standby(selector)

    def _ended(self, selector: selectors.BaseSelector, child: _Child, code: int) -> None:
        self.children.remove(child)
        if child.journal is not None:
            os.close(child.journal)
        how = f"exit status {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        if child is self.successor:
            self.successor = None
            child.report({"ok": False, "error": child.error or f"the new daemon ended ({how})"})
            lost, self.lost = self.lost, None
            if lost is not None:  # the daemon it was to take the mount from died meanwhile
                self.current = lost[0]
                self._recover(selector, *lost)
            return
        if child is self.standby:
            self.standby = None  # started again once a daemon serves
            if code not in (0, -signal.SIGTERM):
                log.warning("the standby daemon (pid %d) ended (%s)", child.proc.pid, how)
            return
        if child is not self.current:
            return  # a daemon that handed the mount over, or a retired standby
        child.report({"ok": False, "error": child.error or f"the daemon ended ({how})"})
        if child.bye and not child.handed_over:
            self.exit_code = code  # unmounted
            return
        if self.successor is not None:
            # Died in the middle of an upgrade: the new daemon may have the mount already (the
            # state sent, the "ok" not heard).  Two daemons must never read one connection:
            # the new one's outcome decides (it serves, or it ends and this one is recovered).
            self.current, self.lost = None, (child, code)
            return
        self._recover(selector, child, code)

    def _recover(self, selector: selectors.BaseSelector, child: _Child, code: int) -> None:
        """``child`` served the mount and ended without ``bye``: a daemon takes the mount over."""
        how = f"exit status {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        if self.connection is None or self.stopping or mounts.find_mount(self.mount_point) is None:
            self.exit_code = code if code > 0 else 1
            return
        if child.role == "recover" and not child.ready:
            self.failed_recoveries += 1
        if self.failed_recoveries >= len(RECOVERY_BACKOFF) or self.journal is None:
            log.error("cannot recover the mount of %s (%s, %d tries): giving it up; readers get ENOTCONN",
                      self.mount_point, child.error or how, self.failed_recoveries)
            self.exit_code = 1
            return
        if self.failed_recoveries:
            # The keeper's loop waits too (signals and upgrade requests are taken after it):
            # at most the last pause, and only while no daemon serves the mount anyway.
            time.sleep(RECOVERY_BACKOFF[self.failed_recoveries - 1])
        log.warning("the daemon of %s (pid %d) ended without unmounting (%s): starting a daemon that "
                    "recovers the mount", self.mount_point, child.proc.pid, how)
        died_at = time.monotonic()
        standby, self.standby = self.standby, None
        self.current = standby if standby is not None else self._spawn(selector, "recover", _nobody)
        _send(self.current.channel, {"kind": "recover", "init": base64.b64encode(self.init).decode(),
                                     "died_at": died_at, "previous": child.proc.pid},
              (self.connection, self.journal))

    def _succeeded(self, selector: selectors.BaseSelector) -> None:
        """The upgrade's new daemon serves the mount; the standby, of the version before the
        upgrade, ends (a new one starts once the new daemon's journal is here)."""
        self.current, self.successor, self.lost = self.successor, None, None
        self._retire_standby(selector)
        if self.current is not None:
            self._promote(selector, self.current)

    def _start_standby(self, selector: selectors.BaseSelector) -> None:
        if self.standby is None and self.connection is not None and self.exit_code is None:
            self.standby = self._spawn(selector, "recover", _nobody)

    def _retire_standby(self, selector: selectors.BaseSelector) -> None:
        """The standby ends (it reads the end of its channel; reaped later, see ``_reap``)."""
        standby, self.standby = self.standby, None
        if standby is not None:
            selector.unregister(standby.channel)
            standby.channel.close()
            self.children.remove(standby)
            self.retired.append(standby.proc)

    def _reap(self) -> None:
        self.retired = [proc for proc in self.retired if proc.poll() is None]

    def _forward(self, selector: selectors.BaseSelector, signum: int) -> None:
        """SIGTERM and SIGINT go to each daemon, which unmounts; SIGHUP is not an upgrade."""
        if signum == signal.SIGHUP:
            log.info("SIGHUP ignored: `cubefs-fuse upgrade %s` starts a new daemon on the mount", self.mount_point)
            return
        self.stopping = True
        self._retire_standby(selector)
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signum)

    # -- upgrades ------------------------------------------------------------------------

    def _listen(self) -> socket.socket | None:
        path = keeper_socket_path(self.control_socket)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead keeper's (the control socket's owner checked it is dead)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            sock.bind(path)
            self.socket_inode = os.stat(path).st_ino
            os.chmod(path, 0o600)
            sock.listen(4)
        except OSError as exc:
            sock.close()
            log.warning("no upgrades of %s (cannot listen on %s: %s)", self.mount_point, path, exc)
            return None
        return sock

    def _upgrade(self, selector: selectors.BaseSelector, listener: socket.socket) -> None:
        peer, _ = listener.accept()
        peer.settimeout(REQUEST_TIMEOUT)

        def answer(reply: dict[str, Any]) -> None:
            with contextlib.suppress(OSError):
                peer.sendall(json.dumps(reply).encode() + b"\n")
            peer.close()

        try:
            _, uid, _ = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            if uid not in (0, os.geteuid()):
                return answer({"ok": False, "error": f"uid {uid} may not upgrade this mount"})
            if peer.recv(MAX_MESSAGE).strip() != b"upgrade":
                return answer({"ok": False, "error": "not an upgrade request"})
        except OSError:
            peer.close()
            return None
        if self.successor is not None or self.current is None or not self.current.ready:
            return answer({"ok": False, "error": "an upgrade is under way already" if self.successor
                           else "the daemon is not serving yet"})
        previous = self.current.proc.pid
        log.info("upgrade: starting a new daemon to take the mount over from pid %d", previous)
        self.successor = self._spawn(selector, "take-over", lambda reply: answer({**reply, "previous": previous}))
        # The new daemon continues the running one's journal, which describes the inode table
        # it will be handed (rewriting it would cost the pause ~5 µs per inode).
        _send(self.successor.channel, {"kind": "journal"}, (self.journal,) if self.journal is not None else ())
        return None


def _replace(child: _Child, name: str, fd: int) -> None:
    old = getattr(child, name)
    if old is not None:
        os.close(old)
    setattr(child, name, fd)


def _nobody(_: dict[str, Any]) -> None:
    pass


def request_upgrade(control_socket: str, timeout: float,
                    progress: Callable[[float], None]) -> dict[str, Any]:
    """Ask the keeper of the mount whose control socket is given for an upgrade; its answer
    ({"ok": True, "pid", "previous", "detail"} or {"ok": False, "error"}).  OSError if no
    keeper answers; ``progress`` is told the seconds waited every so often."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with sock:
        sock.connect(keeper_socket_path(control_socket))
        sock.sendall(b"upgrade\n")
        started = time.monotonic()
        data = b""
        while not data.endswith(b"\n"):
            waited = time.monotonic() - started
            if waited >= timeout:
                raise TimeoutError(f"no answer within {timeout:.0f} s")
            sock.settimeout(min(10.0, timeout - waited))
            try:
                chunk = sock.recv(MAX_MESSAGE)
            except TimeoutError:
                progress(time.monotonic() - started)
                continue
            if not chunk:
                raise ConnectionError("the keeper closed the connection without an answer")
            data += chunk
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError("not an answer")
        return reply
