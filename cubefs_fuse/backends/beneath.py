"""Opening paths beneath a directory descriptor without following any symlink
(docs/contracts.md, "Never outside the source"). :func:`open_beneath` uses ``openat2(2)``
with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``, where the kernel
refuses any symlink (``ELOOP``) or escape (``EXDEV``) atomically, or, without ``openat2``
(an older kernel, a seccomp filter answering ``ENOSYS``/``EPERM``), a component-wise walk of
``openat(fd, name, O_PATH | O_NOFOLLOW | O_DIRECTORY)`` from each step's descriptor, so no
step follows a symlink and no rename elsewhere redirects it; ``..``, ``.``, empty and
absolute components are refused with ``EXDEV``. Both give ``ELOOP`` for a symlink anywhere
on the path, except that, as with ``openat2`` and ``O_PATH | O_NOFOLLOW``, a symlink as the
last component is opened as itself (for ``fstat``/``readlinkat``)."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading

# <linux/openat2.h>: the RESOLVE_* bits of struct open_how.resolve.
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
RESOLVE_CACHED = 0x20
# What every source access asks for.  RESOLVE_NO_SYMLINKS implies RESOLVE_NO_MAGICLINKS;
# both are named so the intent survives a reading of the flags alone.
CONFINED = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS

# openat2's syscall number: 437 in the unified syscall table every architecture shares
# since Linux 5.6 (x86_64, arm64, riscv64, ppc64le, s390x alike).
SYS_OPENAT2 = 437
# openat2 may answer EAGAIN when a concurrent rename or mount could have let a ".."
# escape (we never pass "..", so this is near impossible); a few retries, then the error.
EAGAIN_RETRIES = 8


class OpenHow(ctypes.Structure):
    """``struct open_how`` (<linux/openat2.h>): three u64 fields, 24 bytes."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(OpenHow), ctypes.c_size_t]


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """The raw ``openat2(2)`` syscall; a failure raises ``OSError`` with the kernel's errno.

    ``O_CLOEXEC`` is always added (the daemon never hands descriptors to children).
    """
    how = OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    encoded = os.fsencode(path)
    for _ in range(EAGAIN_RETRIES):
        fd = _syscall(SYS_OPENAT2, dirfd, encoded, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            break
    raise OSError(err, os.strerror(err), path)


def _probe_openat2() -> bool:
    """Whether this kernel (and any seccomp filter around us) lets openat2 through."""
    try:
        os.close(openat2(-100, "/", os.O_PATH, CONFINED & ~RESOLVE_BENEATH))  # -100: AT_FDCWD
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG):
            return False
        raise
    return True


_have_openat2: bool | None = None
_probe_lock = threading.Lock()


def have_openat2() -> bool:
    """Probed once per process (the answer does not change while it runs)."""
    global _have_openat2
    if _have_openat2 is None:
        with _probe_lock:
            if _have_openat2 is None:
                _have_openat2 = _probe_openat2()
    return _have_openat2


def _components(path: str) -> list[str]:
    """The path's components; absolute paths and '.', '..', '' components refused (EXDEV)."""
    if path == ".":
        return []
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EXDEV, f"{path!r} is not a normalised path beneath the source", path)
    return parts


def split_beneath(path: str) -> tuple[str, str]:
    """``(parent, name)`` of a normalised relative path, ``parent`` ``"."`` at the top.

    For the ``*at`` calls that take the last component relative to the parent's
    descriptor (``fstatat(AT_SYMLINK_NOFOLLOW)``, ``readlinkat``): the parent is opened
    with :func:`open_beneath`, ``name`` is checked to be one plain component here.
    """
    parts = _components(path)
    if not parts:
        raise OSError(errno.EXDEV, "the source root has no parent beneath it", path)
    return "/".join(parts[:-1]) or ".", parts[-1]


def _is_symlink(dirfd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def walk_beneath(dirfd: int, path: str, flags: int) -> int:
    """The fallback of :func:`open_beneath`: one ``O_NOFOLLOW`` step per component."""
    parts = _components(path)
    if not parts:
        return os.open(".", flags | os.O_CLOEXEC, dir_fd=dirfd)
    current = dirfd
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            step = (flags | os.O_NOFOLLOW) if last else (os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                fd = os.open(name, step | os.O_CLOEXEC, dir_fd=current)
            except NotADirectoryError:
                # O_DIRECTORY | O_NOFOLLOW answers ENOTDIR for a symlink: say ELOOP, as
                # openat2 does, so both paths give one errno for "a symlink on the way".
                if _is_symlink(current, name):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path) from None
                raise
            if current != dirfd:
                os.close(current)
            current = fd
        if flags & os.O_PATH and not flags & os.O_NOFOLLOW and stat.S_ISLNK(os.fstat(current).st_mode):
            # openat2 opens a trailing symlink as itself only under O_PATH | O_NOFOLLOW.
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        return current
    except BaseException:
        if current != dirfd:
            os.close(current)
        raise


def open_beneath(dirfd: int, path: str, flags: int) -> int:
    """Open ``path`` (relative, normalised; ``"."`` for ``dirfd`` itself) beneath ``dirfd``
    without following a symlink in any component; the descriptor is ``O_CLOEXEC``."""
    if have_openat2():
        return openat2(dirfd, path, flags, CONFINED)
    return walk_beneath(dirfd, path, flags)
