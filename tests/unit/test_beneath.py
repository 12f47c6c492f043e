"""Confinement beneath the source root (docs/contracts.md, "Never outside the source"):
backends/beneath.py's openat2 wrapper and its fallback walk, and LocalDirBackend's and
DirFds' use of them, on real directories with real symlinks.  Through a real mount, with
an unprivileged user doing the swaps: tests/mounted/test_confinement.py."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cubefs_fuse.attrs import Attr
from cubefs_fuse.backends import beneath
from cubefs_fuse.backends.localdir import DirFds, LocalDirBackend, SourceRoot

Opener = Callable[[int, str, int], int]
SECRET = b"outside the source"


def _openat2_confined(dirfd: int, path: str, flags: int) -> int:
    return beneath.openat2(dirfd, path, flags, beneath.CONFINED)


# Both ways of opening beneath a descriptor must behave the same on every case below.
OPENERS: dict[str, Opener] = {"openat2": _openat2_confined, "walk": beneath.walk_beneath}


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """root/{a/b/file, top, a/rel -> b/file, a/up -> ../../outside, a/abs -> /abs/outside,
    a/b/linkdir -> ../b (inside), a/b/out -> outside dir}, outside/secret; yields (root, fd)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    (root / "a" / "b" / "file").write_bytes(b"inside")
    (root / "top").write_bytes(b"top")
    (root / "a" / "rel").symlink_to("b/file")
    (root / "a" / "up").symlink_to("../../outside")
    (root / "a" / "abs").symlink_to(str(outside))
    (root / "a" / "b" / "linkdir").symlink_to("../b")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield root, fd
    os.close(fd)


def read_fd(fd: int) -> bytes:
    try:
        return os.pread(fd, 1 << 16, 0)
    finally:
        os.close(fd)


def test_constants_match_linux_openat2_h() -> None:
    # <linux/openat2.h>; struct open_how is three u64 (OPEN_HOW_SIZE_VER0 = 24).
    assert (beneath.RESOLVE_NO_XDEV, beneath.RESOLVE_NO_MAGICLINKS, beneath.RESOLVE_NO_SYMLINKS,
            beneath.RESOLVE_BENEATH, beneath.RESOLVE_IN_ROOT, beneath.RESOLVE_CACHED) == (1, 2, 4, 8, 16, 32)
    assert ctypes.sizeof(beneath.OpenHow) == 24
    assert beneath.CONFINED == beneath.RESOLVE_BENEATH | beneath.RESOLVE_NO_SYMLINKS | beneath.RESOLVE_NO_MAGICLINKS


def test_this_kernel_has_openat2() -> None:
    # The machines this runs on have Linux >= 5.6; the fallback is tested on its own below.
    assert beneath.have_openat2()


@pytest.mark.parametrize("how", OPENERS)
def test_plain_paths_open(tree: tuple[Path, int], how: str) -> None:
    root, fd = tree
    opener = OPENERS[how]
    assert read_fd(opener(fd, "a/b/file", os.O_RDONLY)) == b"inside"
    assert read_fd(opener(fd, "top", os.O_RDONLY)) == b"top"
    here = opener(fd, ".", os.O_PATH | os.O_DIRECTORY)
    try:
        assert os.fstat(here).st_ino == os.fstat(fd).st_ino
    finally:
        os.close(here)
    directory = opener(fd, "a/b", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(os.listdir(directory)) == ["file", "linkdir"]
    finally:
        os.close(directory)
    opened = opener(fd, "top", os.O_RDONLY)
    try:
        assert not os.get_inheritable(opened)  # O_CLOEXEC always
    finally:
        os.close(opened)


@pytest.mark.parametrize("how", OPENERS)
@pytest.mark.parametrize("path, flags", [
    ("a/up/secret", os.O_RDONLY),                 # relative symlink out, as a middle component
    ("a/abs/secret", os.O_RDONLY),                # absolute symlink out
    ("a/b/linkdir/file", os.O_RDONLY),            # a symlink that stays inside is refused as well
    ("a/rel", os.O_RDONLY),                       # the last component a symlink (to a file inside)
    ("a/up", os.O_RDONLY | os.O_DIRECTORY),       # the last component a symlink to a directory
    ("a/up", os.O_PATH),                          # O_PATH without O_NOFOLLOW follows nothing either
])
def test_any_symlink_component_is_eloop(tree: tuple[Path, int], how: str, path: str, flags: int) -> None:
    _, fd = tree
    with pytest.raises(OSError) as raised:
        os.close(OPENERS[how](fd, path, flags))
    assert raised.value.errno == errno.ELOOP


@pytest.mark.parametrize("how", OPENERS)
def test_trailing_symlink_opens_as_itself_with_o_path_o_nofollow(tree: tuple[Path, int], how: str) -> None:
    _, fd = tree
    link = OPENERS[how](fd, "a/up", os.O_PATH | os.O_NOFOLLOW)
    try:
        assert stat.S_ISLNK(os.fstat(link).st_mode)
        assert os.readlink("", dir_fd=link) == "../../outside"
    finally:
        os.close(link)


@pytest.mark.parametrize("how", OPENERS)
@pytest.mark.parametrize("path, code", [
    ("../outside/secret", errno.EXDEV), ("a/../../outside/secret", errno.EXDEV),
    ("/etc/hostname", errno.EXDEV), ("a/missing", errno.ENOENT), ("top/x", errno.ENOTDIR),
])
def test_escapes_and_plain_errors(tree: tuple[Path, int], how: str, path: str, code: int) -> None:
    _, fd = tree
    with pytest.raises(OSError) as raised:
        os.close(OPENERS[how](fd, path, os.O_RDONLY))
    assert raised.value.errno == code


def test_openat2_raises_the_kernels_errno(tree: tuple[Path, int]) -> None:
    _, fd = tree
    with pytest.raises(OSError) as raised:
        beneath.openat2(fd, "top", os.O_RDONLY, 1 << 40)  # an unknown RESOLVE bit
    assert raised.value.errno == errno.EINVAL
    closed = os.dup(fd)
    os.close(closed)
    with pytest.raises(OSError) as raised:
        beneath.openat2(closed, "top", os.O_RDONLY, beneath.CONFINED)
    assert raised.value.errno == errno.EBADF


class FakeSyscall:
    """Stands in for libc's syscall(): fails with ``errors`` in turn, then calls the real one."""

    def __init__(self, real: Any, errors: list[int]) -> None:
        self.real, self.errors, self.calls = real, errors, 0

    def __call__(self, *args: Any) -> int:
        self.calls += 1
        if self.errors:
            ctypes.set_errno(self.errors.pop(0))
            return -1
        return int(self.real(*args))


def test_openat2_retries_eagain_and_eintr(tree: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    _, fd = tree
    fake = FakeSyscall(beneath._syscall, [errno.EAGAIN, errno.EINTR, errno.EAGAIN])
    monkeypatch.setattr(beneath, "_syscall", fake)
    assert read_fd(beneath.openat2(fd, "top", os.O_RDONLY, beneath.CONFINED)) == b"top"
    assert fake.calls == 4
    fake = FakeSyscall(beneath._syscall, [errno.EAGAIN] * beneath.EAGAIN_RETRIES)
    monkeypatch.setattr(beneath, "_syscall", fake)
    with pytest.raises(OSError) as raised:
        beneath.openat2(fd, "top", os.O_RDONLY, beneath.CONFINED)
    assert raised.value.errno == errno.EAGAIN and fake.calls == beneath.EAGAIN_RETRIES


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EPERM])
def test_without_openat2_the_walk_is_used(tree: tuple[Path, int], monkeypatch: pytest.MonkeyPatch,
                                          code: int) -> None:
    _, fd = tree
    monkeypatch.setattr(beneath, "_syscall", FakeSyscall(None, [code]))
    monkeypatch.setattr(beneath, "_have_openat2", None)
    assert not beneath.have_openat2()
    walked = []
    real_walk = beneath.walk_beneath

    def walk(dirfd: int, path: str, flags: int) -> int:
        walked.append(path)
        return real_walk(dirfd, path, flags)

    monkeypatch.setattr(beneath, "walk_beneath", walk)
    assert read_fd(beneath.open_beneath(fd, "a/b/file", os.O_RDONLY)) == b"inside"
    with pytest.raises(OSError) as raised:
        beneath.open_beneath(fd, "a/up/secret", os.O_RDONLY)
    assert raised.value.errno == errno.ELOOP
    assert walked == ["a/b/file", "a/up/secret"]


def test_walk_closes_what_it_opened(tree: tuple[Path, int]) -> None:
    _, fd = tree
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with pytest.raises(OSError):
            beneath.walk_beneath(fd, "a/b/linkdir/file", os.O_RDONLY)
        os.close(beneath.walk_beneath(fd, "a/b/file", os.O_RDONLY))
    assert len(os.listdir("/proc/self/fd")) == before


def test_split_beneath() -> None:
    assert beneath.split_beneath("a/b/c") == ("a/b", "c")
    assert beneath.split_beneath("c") == (".", "c")
    for bad in ("", "..", "a/..", "/a", "a//b", "./a"):
        with pytest.raises(OSError) as raised:
            beneath.split_beneath(bad)
        assert raised.value.errno == errno.EXDEV


# -- DirFds: cached directory descriptors cannot be redirected ------------------------------


def test_dirfds_cached_directory_replaced_by_symlink(tree: tuple[Path, int], tmp_path: Path) -> None:
    root, fd = tree
    dirs = DirFds(SourceRoot(str(root)), 8)
    assert read_fd(dirs.open("a/b/file", os.O_RDONLY)) == b"inside"  # caches "a/b"
    (tmp_path / "outside" / "file").write_bytes(SECRET)
    os.rename(root / "a" / "b", root / "b.old")
    (root / "a" / "b").symlink_to("../../outside")
    with pytest.raises(OSError) as raised:
        os.close(dirs.open("a/b/file", os.O_RDONLY))
    assert raised.value.errno == errno.ELOOP
    assert dirs.moved == 1
    dirs.close()


def test_dirfds_cached_directory_moved_out_of_the_source(tree: tuple[Path, int], tmp_path: Path) -> None:
    root, fd = tree
    dirs = DirFds(SourceRoot(str(root)), 8)
    assert read_fd(dirs.open("a/b/file", os.O_RDONLY)) == b"inside"
    os.rename(root / "a" / "b", tmp_path / "outside" / "b")  # the cached fd now points outside
    (tmp_path / "outside" / "b" / "file").write_bytes(SECRET)
    with pytest.raises(FileNotFoundError):
        os.close(dirs.open("a/b/file", os.O_RDONLY))
    assert dirs.moved == 1
    # A new directory at the old place is found and read, not the one that moved out.
    (root / "a" / "b").mkdir()
    (root / "a" / "b" / "file").write_bytes(b"new")
    assert read_fd(dirs.open("a/b/file", os.O_RDONLY)) == b"new"
    dirs.close()


def test_dirfds_survive_a_renamed_root_and_keep_their_cache(tree: tuple[Path, int], tmp_path: Path) -> None:
    root, fd = tree
    dirs = DirFds(SourceRoot(str(root)), 8)
    assert read_fd(dirs.open("a/b/file", os.O_RDONLY)) == b"inside"
    os.rename(root, tmp_path / "moved-root")  # the root fd is still the root
    assert read_fd(dirs.open("a/b/file", os.O_RDONLY)) == b"inside"
    assert dirs.moved == 0
    dirs.close()


# -- LocalDirBackend: every operation confined ----------------------------------------------


async def test_backend_serves_symlinks_as_symlinks_and_never_follows(tree: tuple[Path, int]) -> None:
    root, _ = tree
    backend = LocalDirBackend(str(root), threads=2)
    try:
        link: Attr = await backend.stat("a/up")
        assert link.is_symlink and await backend.readlink("a/up") == "../../outside"
        assert (await backend.stat("a/b/file")).is_file
        assert (await backend.stat("")).is_dir
        names = dict(await backend.listdir("a"))
        assert names["up"].is_symlink and names["abs"].is_symlink and names["b"].is_dir
        version = (await backend.stat("a/b/file")).version
        assert await backend.read_block("a/b/file", version, 0, 6) == b"inside"
        calls: list[Any] = [
            backend.stat("a/up/secret"), backend.stat("a/abs/secret"), backend.listdir("a/up"),
            backend.listdir("a/b/linkdir"), backend.readlink("a/b/linkdir/linkdir"),
            backend.read_block("a/up/secret", version, 0, 6), backend.read_block("a/rel", version, 0, 6),
        ]
        for call in calls:
            with pytest.raises(OSError) as raised:
                await call
            assert raised.value.errno == errno.ELOOP
        for escape in ("../outside/secret", "a/../../outside/secret"):
            with pytest.raises(OSError) as raised:
                await backend.stat(escape)
            assert raised.value.errno == errno.EXDEV
        errors = backend.statistics().errors
        assert errors[("stat", errno.ELOOP)] == 2 and errors[("read", errno.ELOOP)] == 2
    finally:
        backend.close()


def test_fd_path_reads_the_callers_own_descriptors_after_a_fork(tmp_path: Path) -> None:
    """fd_path keeps /proc/self/fd open: a forked child must read its own table, not the
    parent's (where the same number names another file, or nothing)."""
    from cubefs_fuse.backends.localdir import fd_path

    (tmp_path / "parent").write_bytes(b"")
    (tmp_path / "child").write_bytes(b"")
    fd = os.open(tmp_path / "parent", os.O_RDONLY)
    try:
        assert fd_path(fd) == str(tmp_path / "parent")  # the parent's /proc/self/fd is open now
        pid = os.fork()
        if pid == 0:  # the child: the same number, now its own file
            try:
                os.dup2(os.open(tmp_path / "child", os.O_RDONLY), fd)
                os._exit(0 if fd_path(fd) == str(tmp_path / "child") else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert fd_path(fd) == str(tmp_path / "parent")
    finally:
        os.close(fd)
