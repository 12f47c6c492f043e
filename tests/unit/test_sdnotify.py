"""sd_notify(3) in stdlib (cubefs_fuse/sdnotify.py): what systemd's socket receives."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from cubefs_fuse import sdnotify


def _receiver(kind: str, tmp_path: Path) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if kind == "abstract":
        name = f"cubefs-fuse-unit-{uuid.uuid4().hex}"
        sock.bind(b"\0" + name.encode())
        return sock, "@" + name
    sock.bind(str(tmp_path / "notify"))
    return sock, str(tmp_path / "notify")


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_ready_and_stopping_reach_the_socket(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock, address = _receiver(kind, tmp_path)
    with sock:
        sock.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        assert sdnotify.ready("serving /src on /mnt")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving /src on /mnt"
        assert sdnotify.stopping("unmounting /mnt\nnow")  # a newline cannot start a new key
        assert sock.recv(4096) == b"STOPPING=1\nSTATUS=unmounting /mnt now"


def test_without_systemd_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sdnotify.ready("x")
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert not sdnotify.ready("x")


@pytest.mark.parametrize("value", ["vsock:2:1234", "relative/path"])
def test_other_addresses_are_ignored(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.address(value) is None and not sdnotify.ready("x")


def test_a_dead_socket_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not sdnotify.stopping("x")
    assert "cannot notify systemd" in caplog.text


def test_a_full_socket_does_not_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that never reads: sends fail fast (EAGAIN) instead of blocking the trio thread."""
    sock, address = _receiver("path", tmp_path)
    with sock:
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        results = [sdnotify.notify("STATUS=" + "x" * 1000) for _ in range(2000)]
    assert results[0] and not results[-1]
