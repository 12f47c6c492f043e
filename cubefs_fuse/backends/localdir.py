"""The directory backend: a local or NFS-mounted directory as the remote volume.

Paths are relative to the volume root, ``/``-separated, ``""`` for the root.  Every
blocking syscall runs in a worker thread under one ``trio.CapacityLimiter``: a slow or
hung remote ties up worker threads, never the trio thread.

Every path is resolved beneath the root's descriptor without following a symlink in any
component (``backends/beneath.py``; DESIGN.md 3.4 "Never outside the source"): the last
component's attributes come from ``fstatat(AT_SYMLINK_NOFOLLOW)`` and its target from
``readlinkat`` relative to the confined parent, so symlinks are served as symlinks and
never followed by the daemon.  A symlink met on the way fails with ``ELOOP``.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from cubefs_fuse.attrs import Attr, FileVersion, FsStats
from cubefs_fuse.backends.base import BackendStatistics
from cubefs_fuse.backends.beneath import open_beneath, split_beneath
from cubefs_fuse.errors import StaleVersion
from cubefs_fuse.stats import LatencyHistogram

log = logging.getLogger(__name__)
T = TypeVar("T")

# Source directories kept open (O_PATH) so that a file is opened relative to its own
# directory: on a remote without attribute caching (NFS "noac", our emulator) every path
# component of an open from the volume root costs a round trip.  1024 covers ImageNet's
# 1000 class directories; the daemon raises its open-file limit at start (raise_fd_limit).
DIR_FD_CACHE = 1024
# Open-file limit the daemon asks for (bounded by the hard limit): directory descriptors,
# NVMe block files in flight, FUSE, sockets.
WANTED_FD_LIMIT = 65536

# Distinct files whose errors are logged individually; past this many the log says so
# once and stays quiet (the counters keep counting).  Bounds memory under an error storm.
MAX_LOGGED_ERROR_FILES = 10_000


@dataclass
class _Counters:
    operations: dict[str, int] = field(default_factory=dict)
    errors: dict[tuple[str, int], int] = field(default_factory=dict)
    bytes_read: int = 0
    latency: dict[str, LatencyHistogram] = field(default_factory=dict)


class ErrorLog:
    """Logs a backend error once per file, counts every one."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._saturated = False

    def report(self, op: str, path: str, exc: OSError) -> None:
        if path in self._seen or self._saturated:
            return
        if len(self._seen) >= MAX_LOGGED_ERROR_FILES:
            self._saturated = True
            log.warning("backend errors on more than %d files; further files are not logged "
                        "individually (see cubefs_fuse_backend_errors_total)", MAX_LOGGED_ERROR_FILES)
            return
        self._seen.add(path)
        log.warning("backend %s of %r failed: %s (logged once per file)", op, path, os.strerror(exc.errno or errno.EIO))


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, WANTED_FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass


def fd_path(fd: int) -> str | None:
    """Where the kernel's dentry cache says ``fd`` is now (``/proc/self/fd``), or None.

    A rename or removal made on this machine moves the dentry at once, so a directory
    renamed out of the source, or removed (``" (deleted)"``), no longer has the path it
    was opened at.  In-memory: no request reaches the remote.
    """
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # no /proc, or a path longer than PATH_MAX: never trusted


class DirFds:
    """Open descriptors of recently used source directories (thread-safe, bounded).

    Each is opened beneath the root fd without following a symlink in any component
    (``beneath.open_beneath``), and checked on every use to be still where it was opened
    (:func:`fd_path` == root path + directory): a cached descriptor of ``a/b`` keeps
    pointing at the old directory when ``a`` is replaced (by a symlink or another
    directory) or ``a/b`` is renamed elsewhere, even out of the source tree.  A
    descriptor that moved is dropped and the directory is opened afresh from the root,
    so a swapped component is met (``ELOOP`` for a symlink) and a directory moved out
    of the source is never read through.  Files are opened beneath the directory's
    descriptor, again without following a symlink.

    Callers get a dup() of the cached descriptor, so an eviction that closes the cached
    one can never close (or let the kernel reuse) a descriptor another thread is using.
    """

    def __init__(self, root_fd: int, capacity: int) -> None:
        self._root_fd = root_fd
        self._root_path = fd_path(root_fd)
        self._capacity = capacity
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self.moved = 0  # cached descriptors found moved and dropped (tests, debugging)

    def open(self, path: str, flags: int) -> int:
        """Open ``path`` (relative to the root) through its parent directory's descriptor."""
        parent, _, name = path.rpartition("/")
        if not parent:
            return open_beneath(self._root_fd, path or ".", flags)
        directory = self._acquire(parent)
        try:
            return open_beneath(directory, name, flags)
        finally:
            os.close(directory)

    def forget(self, path: str) -> None:
        """Drop the parent directory of ``path`` (it may have been replaced at the source)."""
        parent = path.rpartition("/")[0]
        with self._lock:
            fd = self._fds.pop(parent, None)
        if fd is not None:
            os.close(fd)

    def _in_place(self, fd: int, directory: str) -> bool:
        """Whether ``fd`` is still the directory ``directory`` beneath the root."""
        where = fd_path(fd)
        if where is None or self._root_path is None:
            return False
        if where == os.path.join(self._root_path, directory):
            return True
        # The source root itself may have been renamed (the root fd still is the root):
        # read its path again before deciding.
        root_now = fd_path(self._root_fd)
        if root_now is None or root_now == self._root_path:
            return False
        self._root_path = root_now
        return where == os.path.join(root_now, directory)

    def _acquire(self, directory: str) -> int:
        with self._lock:
            cached = self._fds.get(directory)
            duplicate = None
            if cached is not None:
                self._fds.move_to_end(directory)
                duplicate = os.dup(cached)
        if duplicate is not None:
            if self._in_place(duplicate, directory):
                return duplicate
            os.close(duplicate)
            with self._lock:
                stale = self._fds.pop(directory) if self._fds.get(directory) == cached else None
                self.moved += 1
            if stale is not None:
                os.close(stale)
            log.info("source directory %r moved or was replaced since it was opened; opening it afresh", directory)
        opened = open_beneath(self._root_fd, directory, os.O_PATH | os.O_DIRECTORY)
        evicted = []
        with self._lock:
            if directory in self._fds:  # another thread opened it meanwhile
                evicted.append(opened)
                opened = self._fds[directory]
            else:
                self._fds[directory] = opened
                while len(self._fds) > self._capacity:
                    evicted.append(self._fds.popitem(last=False)[1])
            duplicate = os.dup(opened)
        for fd in evicted:
            os.close(fd)
        return duplicate

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
        for fd in fds:
            os.close(fd)


class LocalDirBackend:
    """A directory path as the remote volume (an NFS/CubeFS/Lustre mount point)."""

    def __init__(self, root: str, threads: int) -> None:
        self.root = root
        self._root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dirs = DirFds(self._root_fd, DIR_FD_CACHE)
        self._limiter = trio.CapacityLimiter(threads)
        self._counters = _Counters()
        self._errors = ErrorLog()

    def close(self) -> None:
        self._dirs.close()
        os.close(self._root_fd)

    @staticmethod
    def _rel(path: str) -> str:
        return path or "."

    async def _run(self, op: str, path: str, fn: Callable[[], T], *, expected: tuple[int, ...] = ()) -> T:
        """Run ``fn`` in a worker thread; time it, count it, log its error once per file."""
        counters = self._counters
        counters.operations[op] = counters.operations.get(op, 0) + 1

        def timed() -> tuple[T, float]:
            start = time.perf_counter()
            try:
                return fn(), time.perf_counter() - start
            except OSError as exc:
                exc.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]
                raise

        histogram = counters.latency.get(op)
        if histogram is None:
            histogram = counters.latency[op] = LatencyHistogram()
        try:
            result, elapsed = await trio.to_thread.run_sync(timed, limiter=self._limiter)
        except OSError as exc:
            histogram.observe(getattr(exc, "elapsed", 0.0))
            code = exc.errno or errno.EIO
            if code not in expected:
                key = (op, code)
                counters.errors[key] = counters.errors.get(key, 0) + 1
                self._errors.report(op, path, exc)
            raise
        histogram.observe(elapsed)
        return result

    def _at_parent(self, path: str, fn: Callable[[int, str], T]) -> T:
        """``fn(parent_fd, name)`` for the last component of ``path``, its parent opened
        beneath the root without following symlinks (the root fd itself at the top)."""
        parent, name = split_beneath(path)
        if parent == ".":
            return fn(self._root_fd, name)
        fd = open_beneath(self._root_fd, parent, os.O_PATH | os.O_DIRECTORY)
        try:
            return fn(fd, name)
        finally:
            os.close(fd)

    async def stat(self, path: str) -> Attr:
        def lstat() -> os.stat_result:
            if not path:
                return os.fstat(self._root_fd)
            return self._at_parent(path, lambda fd, name: os.stat(name, dir_fd=fd, follow_symlinks=False))

        st = await self._run(
            "stat", path, lstat,
            expected=(errno.ENOENT, errno.ENOTDIR),  # a lookup of a missing name is no error
        )
        return Attr.from_stat(st)

    async def listdir(self, path: str) -> list[tuple[str, Attr]]:
        rel = self._rel(path)

        def scan() -> list[tuple[str, Attr]]:
            fd = open_beneath(self._root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
            try:
                entries = []
                with os.scandir(fd) as it:
                    for entry in it:
                        try:
                            entries.append((entry.name, Attr.from_stat(entry.stat(follow_symlinks=False))))
                        except FileNotFoundError:
                            continue  # removed between readdir and stat
                return entries
            finally:
                os.close(fd)

        return await self._run("listdir", path, scan)

    async def read_block(self, path: str, version: FileVersion, offset: int, size: int) -> bytes:
        def read() -> bytes:
            try:
                fd = self._dirs.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                self._dirs.forget(path)  # the directory may have been replaced: resolve afresh next time
                raise
            try:
                chunks = []
                done = 0
                while done < size:
                    chunk = os.pread(fd, size - done, offset + done)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    done += len(chunk)
                # One check, after the read, covers both a file that changed before the
                # open (another inode, size or mtime) and an in-place rewrite during pread
                # that would otherwise hand out a block mixing two versions.
                if done != size or Attr.from_stat(os.fstat(fd)).version != version:
                    self._dirs.forget(path)
                    raise StaleVersion(path)
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            finally:
                os.close(fd)

        data = await self._run("read", path, read)
        self._counters.bytes_read += len(data)
        return data

    async def readlink(self, path: str) -> str:
        def read() -> str:
            if not path:
                return os.readlink(".", dir_fd=self._root_fd)  # EINVAL: the root is no symlink
            return self._at_parent(path, lambda fd, name: os.readlink(name, dir_fd=fd))

        return await self._run("readlink", path, read)

    async def statfs(self) -> FsStats:
        st = await self._run("statfs", "", lambda: os.statvfs(self._root_fd))
        return FsStats(st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail,
                       st.f_files, st.f_ffree, st.f_namemax)

    def statistics(self) -> BackendStatistics:
        c = self._counters
        return BackendStatistics(
            operations=dict(c.operations),
            errors=dict(c.errors),
            bytes_read=c.bytes_read,
            latency={op: h.snapshot() for op, h in c.latency.items()},
            threads_busy=self._limiter.borrowed_tokens,
            threads_total=int(self._limiter.total_tokens),
        )
