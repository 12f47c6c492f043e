from __future__ import annotations

from collections.abc import Callable

from tests.conftest import Mount


def test_mount_read_umount(make_mount: Callable[..., Mount]) -> None:
    m = make_mount()
    (m.source / "hello.txt").write_bytes(b"hello world\n")
    m.mount()
    assert m.path("hello.txt").read_bytes() == b"hello world\n"
    assert m.scrape()["cubefs_fuse_opens_total"] >= 1
    m.umount()
    assert not m.path("hello.txt").exists()
