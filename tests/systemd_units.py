"""systemd units in tests, without systemd: a unit file parsed into its keys, an Exec*=
line as argv, and a stand-in for systemd's $NOTIFY_SOCKET (tests/mounted/test_deploy.py,
tests/mounted/test_walkthrough.py)."""

from __future__ import annotations

import select
import shlex
import socket
import subprocess
import time
import uuid
from pathlib import Path


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as {section: {key: [values]}} (keys may repeat; '\\' continues lines)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit_command(value: str, substitutions: dict[str, str]) -> list[str]:
    """An Exec*= value as argv, with systemd's prefixes ('-', '@', ...) removed."""
    for old, new in substitutions.items():
        value = value.replace(old, new)
    return shlex.split(value.lstrip("-@:+!"))


def notify_socket(kind: str, tmp_path: Path) -> tuple[socket.socket, str]:
    """A datagram socket as systemd's $NOTIFY_SOCKET: a path, or an abstract '@' name."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if kind == "abstract":
        name = f"cubefs-fuse-test-{uuid.uuid4().hex}"
        sock.bind(b"\0" + name.encode())
        return sock, "@" + name
    path = str(tmp_path / "notify")
    sock.bind(path)
    return sock, path


def next_notification(sock: socket.socket, daemon: subprocess.Popen[str], timeout: float) -> dict[str, str]:
    """The next sd_notify datagram as {KEY: value}, waiting while the daemon runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([sock], [], [], 0.2)[0]:
            lines = sock.recv(4096).decode().splitlines()
            return dict(line.partition("=")[::2] for line in lines)
        assert daemon.poll() is None, f"daemon exited {daemon.returncode}: {daemon.stderr.read() if daemon.stderr else ''}"
    raise AssertionError(f"no notification within {timeout} s")
