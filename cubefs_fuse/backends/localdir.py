"""The directory backend: a local or NFS-mounted directory as the remote volume. Every
blocking syscall runs in a worker thread under one ``trio.CapacityLimiter`` and can be
abandoned on cancellation (``backends/operations.py``), its token kept until the thread
returns, so at most ``threads`` operation threads plus one probe thread exist however long
the remote hangs. The source root is a replaceable ``SourceRoot`` (``probe`` reopens it
after a remount or a dead descriptor; the old one closes when its last user returns), and
every path is resolved beneath it without following a symlink in any component
(``backends/beneath.py``; docs/contracts.md, "Never outside the source"), so symlinks are
served as symlinks and one met on the way fails with ``ELOOP``."""

from __future__ import annotations

import errno
import logging
import os
import resource
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import trio

from cubefs_fuse.attrs import Attr, FileVersion, FsStats
from cubefs_fuse.backends.base import BackendStatistics, too_many_entries
from cubefs_fuse.backends.beneath import open_beneath, split_beneath
from cubefs_fuse.backends.operations import Operations
from cubefs_fuse.errors import StaleVersion

log = logging.getLogger(__name__)
T = TypeVar("T")

# Source directories kept open (O_PATH) so that a file is opened relative to its own
# directory: on a remote without attribute caching (NFS "noac", our emulator) every path
# component of an open from the volume root costs a round trip.  1024 covers ImageNet's
# 1000 class directories; the daemon raises its open-file limit at start (raise_fd_limit).
DIR_FD_CACHE = 1024
# Open-file limit the daemon asks for (bounded by the hard limit): directory descriptors,
# NVMe segment files in flight, FUSE, sockets.
WANTED_FD_LIMIT = 65536

# A listing reads its entries' attributes in chunks of this many (one worker-thread call
# each, in series within it), LISTDIR_CONCURRENCY chunks at once: an eighth of the
# default backendThreads (64), so a large listing never takes every thread from reads.
LISTDIR_CHUNK = 16
LISTDIR_CONCURRENCY = 8
# Errors of the root descriptor that mean "this descriptor is dead, the path may be fine":
# a FUSE remote that was unmounted (ENOTCONN, or ECONNABORTED for a request aborted under
# it), an NFS handle that went stale with a server-side remount (ESTALE), a failed mount (EIO).
REOPEN_ERRNOS = frozenset({errno.ENOTCONN, errno.ECONNABORTED, errno.ESTALE, errno.EIO})


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, WANTED_FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass


class _ProcFds:
    """This process's ``/proc/self/fd`` directory, kept open (``O_PATH``): a ``readlinkat``
    of one entry beneath it skips resolving ``/proc``, ``self`` and ``fd`` at every
    :func:`fd_path` (2.2 against 3.2 µs per call on the development VM, one call per source
    access).  ``/proc/self`` resolves to the process that opened it, so a forked child
    drops the parent's descriptor and opens its own at its first use."""

    fd: int | None = None
    lock = threading.Lock()

    @classmethod
    def get(cls) -> int | None:
        fd = cls.fd
        if fd is None:
            with cls.lock:
                if cls.fd is None:
                    try:
                        cls.fd = os.open("/proc/self/fd", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    except OSError:
                        return None  # no /proc: fd_path answers None, nothing is trusted
                fd = cls.fd
        return fd

    @classmethod
    def after_fork(cls) -> None:
        if cls.fd is not None:
            os.close(cls.fd)  # the parent's /proc/<pid>/fd: never read from the child
        cls.fd = None
        cls.lock = threading.Lock()


os.register_at_fork(after_in_child=_ProcFds.after_fork)


def fd_path(fd: int) -> str | None:
    """Where the kernel's dentry cache says ``fd`` is now (``/proc/self/fd``), or None.

    A rename or removal made on this machine moves the dentry at once, so a directory
    renamed out of the source, or removed (``" (deleted)"``), no longer has the path it
    was opened at.  In-memory: no request reaches the remote.
    """
    proc = _ProcFds.get()
    if proc is None:
        return None
    try:
        return os.readlink(str(fd), dir_fd=proc)
    except OSError:
        return None  # a path longer than PATH_MAX: never trusted


def is_mount_point(path: str, st: os.stat_result) -> bool:
    """Whether ``path`` (whose ``stat`` is ``st``) is the root of a mounted filesystem."""
    parent = os.stat(os.path.join(path, ".."))
    return parent.st_dev != st.st_dev or parent.st_ino == st.st_ino


class SourceRoot:
    """The source root's directory descriptor, replaceable under threads that use it.

    ``use()`` lends the current descriptor; ``replace()`` opens the path afresh and
    retires the old descriptor, which is closed when its last borrower returns (never
    while a thread may still pass it as ``dir_fd``: a reused number would point the
    thread at another directory).  A thread that never returns keeps one descriptor.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd, self.identity = self._open()
        self._users: dict[int, int] = {self._fd: 0}
        # A source that was a mount point at start (NFS, a FUSE remote) and no longer is
        # has gone away: its empty mount-point directory must never be served instead.
        self.was_mount_point = is_mount_point(path, os.fstat(self._fd))

    def _open(self) -> tuple[int, tuple[int, int]]:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(fd)
        return fd, (st.st_dev, st.st_ino)

    @contextmanager
    def use(self) -> Iterator[int]:
        with self._lock:
            fd = self._fd
            self._users[fd] += 1
        try:
            yield fd
        finally:
            with self._lock:
                self._users[fd] -= 1
                retired = fd != self._fd and self._users[fd] == 0
                if retired:
                    del self._users[fd]
            if retired:
                os.close(fd)

    def replace(self) -> None:
        fd, identity = self._open()
        with self._lock:
            old, self._fd, self.identity = self._fd, fd, identity
            self._users[fd] = 0
            retired = self._users[old] == 0
            if retired:
                del self._users[old]
        if retired:
            os.close(old)

    def close(self) -> None:
        """Close the descriptors nobody uses (at shutdown; abandoned threads keep theirs)."""
        with self._lock:
            idle = [fd for fd, n in self._users.items() if n == 0]
            for fd in idle:
                del self._users[fd]
        for fd in idle:
            os.close(fd)


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
    ``clear()`` (after the root was reopened) drops them all; a directory opened through
    the old root while it ran is not cached.
    """

    def __init__(self, root: SourceRoot, capacity: int) -> None:
        self._root = root
        with root.use() as root_fd:
            self._root_path = fd_path(root_fd)
        self._capacity = capacity
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._generation = 0
        self.moved = 0  # cached descriptors found moved and dropped (tests, debugging)

    def open(self, path: str, flags: int) -> int:
        """Open ``path`` (relative to the root) through its parent directory's descriptor."""
        parent, _, name = path.rpartition("/")
        if not parent:
            with self._root.use() as root_fd:
                return open_beneath(root_fd, path or ".", flags)
        directory = self._acquire(parent)
        try:
            return open_beneath(directory, name, flags)
        finally:
            os.close(directory)

    def at(self, path: str, fn: Callable[[int, str], T]) -> T:
        """``fn(parent_fd, name)`` for the last component of ``path`` (a plain component,
        ``split_beneath``), the parent being its cached descriptor (checked in place, as
        for :meth:`open`) or the root's."""
        parent, name = split_beneath(path)
        if parent == ".":
            with self._root.use() as root_fd:
                return fn(root_fd, name)
        directory = self._acquire(parent)
        try:
            return fn(directory, name)
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
        with self._root.use() as root_fd:
            root_now = fd_path(root_fd)
        if root_now is None or root_now == self._root_path:
            return False
        self._root_path = root_now
        return where == os.path.join(root_now, directory)

    def _acquire(self, directory: str) -> int:
        with self._lock:
            generation = self._generation
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
        with self._root.use() as root_fd:
            opened = open_beneath(root_fd, directory, os.O_PATH | os.O_DIRECTORY)
        evicted = []
        with self._lock:
            if generation != self._generation:  # the root was reopened meanwhile: use once, keep nothing
                return opened
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

    def clear(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
            self._generation += 1
        with self._root.use() as root_fd:
            self._root_path = fd_path(root_fd)
        for fd in fds:
            os.close(fd)

    close = clear


class LocalDirBackend:
    """A directory path as the remote volume (an NFS/CubeFS/Lustre mount point)."""

    def __init__(self, root: str, threads: int) -> None:
        self.root = root
        self._source = SourceRoot(root)
        self._dirs = DirFds(self._source, DIR_FD_CACHE)
        self._ops = Operations(threads)
        # Shorthands for the operations' thread pool (used by every method below).
        self._limiter = self._ops.limiter
        self._thread = self._ops.thread
        self._run = self._ops.run
        self._reconnects = 0

    def close(self) -> None:
        self._dirs.close()
        self._source.close()

    @staticmethod
    def _rel(path: str) -> str:
        return path or "."

    def _at_parent(self, path: str, fn: Callable[[int, str], T]) -> T:
        """``fn(parent_fd, name)`` for the last component of ``path``, its parent opened
        beneath the root without following symlinks (the root fd itself at the top)."""
        parent, name = split_beneath(path)
        with self._source.use() as root_fd:
            if parent == ".":
                return fn(root_fd, name)
            fd = open_beneath(root_fd, parent, os.O_PATH | os.O_DIRECTORY)
        try:
            return fn(fd, name)
        finally:
            os.close(fd)

    async def stat(self, path: str) -> Attr:
        def lstat() -> os.stat_result:
            if not path:
                return self._at_root(os.fstat)
            # Beneath the parent's cached descriptor, as stat_read and read_block: one
            # round trip to the remote, where resolving the parent afresh costs one per
            # component (four for a VOC image, at every stat of a cold dataset).
            try:
                return self._dirs.at(path, lambda fd, name: os.stat(name, dir_fd=fd, follow_symlinks=False))
            except FileNotFoundError:
                self._dirs.forget(path)  # the directory may have been replaced: resolve afresh next time
                raise

        st = await self._run(
            "stat", path, lstat,
            expected=(errno.ENOENT, errno.ENOTDIR),  # a lookup of a missing name is no error
        )
        return Attr.from_stat(st)

    async def listdir(self, path: str, limit: int | None = None) -> list[tuple[str, Attr]]:
        """The directory's entries with their ``lstat`` attributes (Backend.listdir: past
        ``limit`` names, E2BIG before any is stat'ed).  The names come from one
        ``scandir``; a directory of more than ``LISTDIR_CHUNK`` entries has their
        attributes read in chunks, ``LISTDIR_CONCURRENCY`` chunks at once: a remote's
        round trips then overlap, where one thread pays one per entry in series (1,024
        entries at 1 ms took 3.4 s through the mount).  Counted as one ``listdir``."""
        rel = self._rel(path)

        def lstat_all(fd: int, names: list[str]) -> list[tuple[str, Attr]]:
            entries = []
            for name in names:
                try:
                    entries.append((name, Attr.from_stat(os.stat(name, dir_fd=fd, follow_symlinks=False))))
                except FileNotFoundError:
                    continue  # removed between readdir and stat
            return entries

        def scan() -> tuple[list[tuple[str, Attr]], list[str]]:
            fd = self._at_root(lambda root: open_beneath(root, rel, os.O_RDONLY | os.O_DIRECTORY))
            try:
                with os.scandir(fd) as it:
                    names = []
                    for entry in it:
                        names.append(entry.name)
                        if limit is not None and len(names) > limit:
                            raise too_many_entries(path, limit)
                if len(names) <= LISTDIR_CHUNK:
                    return lstat_all(fd, names), []
                return [], names
            finally:
                os.close(fd)

        entries, names = await self._run("listdir", path, scan, expected=(errno.E2BIG,))
        if not names:
            return entries
        chunks = [names[i : i + LISTDIR_CHUNK] for i in range(0, len(names), LISTDIR_CHUNK)]
        results: list[list[tuple[str, Attr]]] = [[] for _ in chunks]
        pending = iter(range(len(chunks)))

        def chunk_job(chunk: list[str]) -> list[tuple[str, Attr]]:
            # Beneath the directory's cached descriptor (checked in place, as for stat).
            return self._dirs.at(f"{rel}/{chunk[0]}" if rel != "." else chunk[0],
                                 lambda fd, _: lstat_all(fd, chunk))

        async def worker() -> None:
            for i in pending:  # the workers share one iterator: each chunk is read once
                results[i] = await self._thread(lambda: chunk_job(chunks[i]), self._limiter)

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(min(LISTDIR_CONCURRENCY, len(chunks))):
                    nursery.start_soon(worker)
        except OSError as exc:
            self._ops.count_error("listdir", path, exc)
            raise
        return [entry for chunk in results for entry in chunk]

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
        self._ops.counters.bytes_read += len(data)
        return data

    async def stat_read(self, path: str, max_size: int, want: Callable[[Attr], bool]) -> tuple[Attr, bytes | None]:
        """Backend.stat_read: ``fstatat(AT_SYMLINK_NOFOLLOW)`` and, for a regular file of
        1 to ``max_size`` bytes that ``want``, open (``O_NOFOLLOW`` beneath the same parent
        descriptor), ``pread`` and ``fstat`` in one worker-thread call.  The bytes are
        returned only if the descriptor's version after the read is the stat's version and
        the read was complete: never bytes of another version than ``attr``."""
        if not path:
            return await self.stat(path), None

        # (attributes, bytes, seconds the read part took or None if not attempted, its error)
        Result = tuple[Attr, bytes | None, float | None, OSError | None]

        def job() -> Result:
            def both(parent: int, name: str) -> Result:
                attr = Attr.from_stat(os.stat(name, dir_fd=parent, follow_symlinks=False))
                if not (attr.is_file and 0 < attr.size <= max_size) or not want(attr):
                    return attr, None, None, None
                start = time.perf_counter()
                try:
                    fd = open_beneath(parent, name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError as exc:  # the read path meets it again and reports it to the reader
                    return attr, None, time.perf_counter() - start, exc
                try:
                    data = os.pread(fd, attr.size, 0)
                    if len(data) != attr.size or Attr.from_stat(os.fstat(fd)).version != attr.version:
                        return attr, None, time.perf_counter() - start, None  # changed: the read path checks again
                except OSError as exc:
                    return attr, None, time.perf_counter() - start, exc
                finally:
                    os.close(fd)
                return attr, data, time.perf_counter() - start, None

            try:
                return self._dirs.at(path, both)
            except FileNotFoundError:
                self._dirs.forget(path)  # the directory may have been replaced: resolve afresh next time
                raise

        attr, data, elapsed, error = await self._run("stat", path, job, expected=(errno.ENOENT, errno.ENOTDIR))
        if elapsed is not None:
            self._ops.count_read_part(path, elapsed, error, data)
        return attr, data

    async def readlink(self, path: str) -> str:
        def read() -> str:
            if not path:
                return self._at_root(lambda root: os.readlink(".", dir_fd=root))  # EINVAL: the root is no symlink
            return self._at_parent(path, lambda fd, name: os.readlink(name, dir_fd=fd))

        return await self._run("readlink", path, read)

    async def statfs(self) -> FsStats:
        st = await self._run("statfs", "", lambda: self._at_root(os.statvfs))
        return FsStats(st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail,
                       st.f_files, st.f_ffree, st.f_namemax)
    def _at_root(self, fn: Callable[[int], T]) -> T:
        with self._source.use() as root:
            return fn(root)

    async def probe(self) -> bool:
        """Check the source (ProbedBackend.probe): ``stat`` of its path, then either
        ``statvfs`` of the open root (same directory) or a reopen (the path now names
        another directory, or the open root answers one of REOPEN_ERRNOS).  A source that
        was a mount point and no longer is counts as not answering (ENOTCONN)."""
        source = self._source

        def check() -> bool:
            st = os.stat(self.root)
            if source.was_mount_point and not is_mount_point(self.root, st):
                raise OSError(errno.ENOTCONN, "the source is no longer a mount point", self.root)
            if (st.st_dev, st.st_ino) == source.identity:
                try:
                    self._at_root(os.statvfs)
                    return False
                except OSError as exc:
                    if exc.errno not in REOPEN_ERRNOS:
                        raise
            source.replace()
            self._dirs.clear()
            self._at_root(os.statvfs)
            return True

        reopened = await self._thread(check, self._ops.probe_limiter)
        if reopened:
            self._reconnects += 1
            log.warning("source %s reopened (it was replaced at the same path, or its descriptor died)", self.root)
        return reopened


    def statistics(self) -> BackendStatistics:
        return self._ops.statistics(reconnects=self._reconnects)
