"""systemd's readiness protocol (sd_notify(3)) in a few lines of stdlib: under a
``Type=notify`` unit, ``READY=1`` once the mount is live, ``STOPPING=1`` when it starts to
unmount, and ``STATUS=`` lines (sent by the daemon, the keeper's child: the unit needs
``NotifyAccess=all``), as one non-blocking datagram to ``$NOTIFY_SOCKET`` (a path,
or an abstract name written with a leading ``@``); without it every call is a no-op, and a
call never blocks or raises, so it is safe on the trio thread."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

ENV = "NOTIFY_SOCKET"


def address(value: str) -> str | bytes | None:
    """The socket address of a ``$NOTIFY_SOCKET`` value; None if it is not an AF_UNIX one."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # Linux abstract namespace
    if value.startswith("/"):
        return value
    return None  # vsock (vsock:CID:PORT) and relative paths: not used for a host daemon


def notify(*lines: str) -> bool:
    """Send ``lines`` (``KEY=value``) as one datagram; True if it was delivered."""
    value = os.environ.get(ENV, "")
    if not value:
        return False
    target = address(value)
    if target is None:
        log.debug("%s=%r is not an AF_UNIX socket: not notifying", ENV, value)
        return False
    message = "\n".join(line.replace("\n", " ") for line in lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(message, target)
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", value, exc.strerror or exc)
        return False
    return True


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


def stopping(status: str) -> bool:
    return notify("STOPPING=1", f"STATUS={status}")
