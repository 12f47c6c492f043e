"""slowfs: a read-only passthrough FUSE mount that behaves like a slow, failing remote volume.

Tests and benchmarks mount a local directory through slowfs and point cubefs-fuse's
``source`` at the slowfs mount point: the emulated remote of docs/benchmarks.md::

    python -m tools.slowfs SOURCE MOUNTPOINT [--latency-us N] [--fail GLOB=ERRNO ...]
        [--fail-read GLOB=ERRNO ...] [--threads N] [--cache-timeout SECONDS]
        [--bandwidth-mb-s MB] [--foreground] [--log-file PATH]

Without ``--foreground`` the command detaches, returns once the mount is live and prints
the daemon's pid.  Stop it with SIGTERM/SIGINT or ``fusermount3 -u MOUNTPOINT``.  From
Python, :class:`SlowFSProcess` runs one as a child process (a context manager).

**Latency.**  Every remote operation -- lookup, getattr, readdir (the listing, fetched
when the directory is opened), open, read, readlink and statfs -- waits ``--latency-us``
before it touches SOURCE.  The wait happens in a worker thread (``time.sleep``), never on
the trio thread, and up to ``--threads`` operations wait at once, so the latency does
not cap throughput: like a real remote, 64 concurrent readers see 64 overlapping round
trips.  ``trio.sleep`` is not used because it oversleeps badly below ~1 ms.

**Accuracy.**  ``time.sleep`` overshoots by the kernel's timer slack (50 us by default)
plus the thread wake-up (~5-50 us on a loaded VM).  Each worker thread sets its timer
slack to 1 ns (``prctl(PR_SET_TIMERSLACK)``), and the sleep request is shortened by a
running mean of the measured overshoot, so the *mean* delay converges to the setting.
Measured on a quiet 2-core VM (tests/mounted/test_slowfs.py): 300 us slept 301-303 us on
average and an application saw +290-298 us per read against a zero-latency twin mount;
2 ms slept ~2.005 ms, +1.98-2.04 ms seen.  On other VMs of the same kind (2026-11-25)
300 us slept 299.1-301.4 us but showed as +265-281 us: the twin's read right after a
slow one pays for waking the CPUs that idled through the wait (193 against 145 us back
to back), which the alternation charges to the twin.  Single delays jitter by tens of
microseconds, and a machine loaded far past its cores (load 7 on 2) stretches them
much further.  The delays actually slept are in the statistics.

**Bandwidth.**  ``--bandwidth-mb-s MB`` caps the bytes all reads together return per
second (10^6 bytes; default 0: no cap), like one shared network link: each read, after its
latency, reserves ``size / rate`` seconds on a first-come first-served virtual clock and
returns when its transfer would have finished.  Latency still overlaps; only bytes queue.

**Errors.**  ``--fail GLOB=ERRNO`` makes ``open`` of every file whose path relative to
SOURCE matches GLOB (``fnmatch``: ``*`` also matches ``/``) fail with ERRNO (a name such
as ``EIO``/``EACCES``/``ENOENT`` or a number), after the latency.  ``--fail-read`` lets
the open succeed and fails each ``read`` instead.  The first matching rule wins.

**Hanging.**  ``kill -STOP PID`` (``SlowFSProcess.hang()``) makes the remote hang: every
operation from then on waits, unanswered, like an NFS server or a CubeFS client that
stopped answering; ``kill -CONT PID`` (``resume()``) answers them all.  The kernel keeps
the waiting requests queued (not yet read by slowfs), so a client that gives up on them
stays killable, as on an NFS hard mount.  Stop slowfs only when no operation is in
progress, or a request it already took waits for ``resume()``.  ``stop()`` resumes a
hung slowfs first.

**Kernel caching.**  Entries and attributes are cached by the kernel for
``--cache-timeout`` seconds (default 0: every lookup and stat reaches slowfs and pays the
latency, like an NFS mount with ``noac``).  Files are opened with ``direct_io``: no page
cache on this mount, every application read is one FUSE read (the kernel splits reads
above its maximum request size, 128 KiB by default, into several, each paying the
latency).  The mount is read-only (writes fail with EROFS); SOURCE itself may be changed
by tests at any time and slowfs sees the change on the next operation.

**Statistics.**  The root holds a virtual file ``.slowfs_stats`` (not listed by readdir;
it shadows a real file of that name).  Reading it returns a JSON object: operation
counts by name (``ops``), errors by operation and errno name (``errors``), injected
errors by operation (``injected``), ``bytes_read``, the most operations in progress at
once (``max_concurrent``), the most latency waits overlapping (``max_sleeping``) and the
delays slept (``delay``: count, mean_us, max_us).  Reading it costs no latency and is not
counted (the kernel's permission check may still getattr the root, which is).  ``SlowFSProcess.stats()`` reads it.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fnmatch
import itertools
import math
import json
import logging
import os
import re
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import trio

from cubefs_fuse.attrs import Attr, FsStats
from cubefs_fuse.errors import FsError
from cubefs_fuse.fs import session as kernel
from cubefs_fuse.fs.filesystem import Borrower

log = logging.getLogger("slowfs")
T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
STATS_NAME = ".slowfs_stats"
ROOT_INODE = 1  # FUSE's root inode number
STATS_INODE = ROOT_INODE + 1
# A file's inode number is its source st_ino shifted past the root and the stats file, so
# it keeps its number (and st_ino) for the life of the mount even after the kernel forgets
# it: clients that key caches on st_ino (cubefs-fuse does) see one stable file.  Files on
# another filesystem below SOURCE (or with huge st_ino) are numbered from FOREIGN_INODES.
INODE_SHIFT = STATS_INODE
FOREIGN_INODES = 1 << 62
# Worker threads, i.e. remote operations in progress at once.  64 covers a DataLoader with
# dozens of workers, or cubefs-fuse's backend threads (64 by default), without queueing;
# a sleeping thread costs only its stack.
DEFAULT_THREADS = 64
# Weight of a new sample in the running mean of time.sleep's overshoot: 1/32 averages
# over the last ~32 delays, fast enough to follow load changes, slow enough that one
# late wake-up does not swing the next requests.
OVERSLEEP_WEIGHT = 1 / 32
# How long start-up may take before the launcher gives up (mounting takes ~0.1 s).
READY_TIMEOUT = 30.0
PR_SET_TIMERSLACK = 29  # from <linux/prctl.h>
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT


# -- error rules ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FailRule:
    """Paths matching ``pattern`` (relative to SOURCE) fail with ``errno``."""

    pattern: str
    errno: int

    def __str__(self) -> str:
        return f"{self.pattern}={errno.errorcode.get(self.errno, self.errno)}"

    @classmethod
    def parse(cls, text: str) -> FailRule:
        """``"GLOB=ERRNO"`` with ERRNO a name (``EIO``) or a number; ValueError if malformed."""
        pattern, sep, code = text.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"expected GLOB=ERRNO, got {text!r}")
        code = code.strip()
        number = int(code) if code.isdigit() else getattr(errno, code.upper(), None)
        if not isinstance(number, int) or number <= 0:
            raise ValueError(f"unknown errno {code!r} in {text!r}")
        return cls(pattern, number)


def first_match(rules: Sequence[FailRule], path: str) -> int:
    """The errno of the first rule matching ``path``, 0 if none does."""
    for rule in rules:
        if fnmatch.fnmatchcase(path, rule.pattern):
            return rule.errno
    return 0


# -- the latency ---------------------------------------------------------------------

_thread_state = threading.local()


def _reduce_timer_slack() -> None:
    """Set this thread's timer slack to 1 ns once (Linux; best effort elsewhere)."""
    if getattr(_thread_state, "slack_set", False):
        return
    _thread_state.slack_set = True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True, slots=True)
class DelayStatistics:
    count: int
    mean_us: float
    max_us: float
    max_sleeping: int  # the most delays in progress at once


class Delay:
    """A fixed per-operation latency, slept in the calling (worker) thread."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._oversleep = 0.0  # running mean of how much time.sleep overshoots a request
        self._count = 0
        self._total = 0.0
        self._max = 0.0
        self._sleeping = 0
        self._max_sleeping = 0

    def wait(self) -> None:
        """Block the calling thread for the latency (mean accurate, see module doc)."""
        if self.seconds <= 0:
            return
        _reduce_timer_slack()
        with self._lock:
            self._sleeping += 1
            self._max_sleeping = max(self._max_sleeping, self._sleeping)
            request = max(0.0, self.seconds - self._oversleep)
        start = time.perf_counter()
        if request:
            time.sleep(request)
        elapsed = time.perf_counter() - start
        with self._lock:
            self._sleeping -= 1
            self._oversleep += OVERSLEEP_WEIGHT * (elapsed - request - self._oversleep)
            self._count += 1
            self._total += elapsed
            self._max = max(self._max, elapsed)

    def statistics(self) -> DelayStatistics:
        with self._lock:
            mean = self._total / self._count if self._count else 0.0
            return DelayStatistics(self._count, mean * 1e6, self._max * 1e6, self._max_sleeping)


class Bandwidth:
    """A shared link of ``bytes_per_s``: transfers queue first come, first served."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # perf_counter time at which the link finishes its queued bytes

    def transfer(self, nbytes: int) -> None:
        """Block the calling (worker) thread until ``nbytes`` would have crossed the link."""
        if self.bytes_per_s <= 0 or nbytes <= 0:
            return
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = done = start + nbytes / self.bytes_per_s
        remaining = done - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


# -- the filesystem ------------------------------------------------------------------


@dataclass(slots=True)
class _OpenFile:
    fd: int
    path: str
    read_errno: int  # injected on every read; 0 for none


@dataclass(slots=True)
class _Counters:
    ops: Counter[str] = field(default_factory=Counter)
    errors: dict[str, Counter[str]] = field(default_factory=dict)
    injected: Counter[str] = field(default_factory=Counter)
    bytes_read: int = 0
    concurrent: int = 0
    max_concurrent: int = 0


def _rel(path: str) -> str:
    return path or "."


@dataclass(frozen=True, slots=True)
class _Entry:
    inode: int
    attr: Attr
    valid_for: float = math.inf  # the mount's timeouts (cache_timeout) bound it


class SlowFS:
    """The FUSE session's operations (fs/session.py): a read-only passthrough of ``source``
    with latency and errors."""

    # Files are opened with direct_io and no page cache: every application read is one
    # FUSE read that pays the latency, as on a remote without a client cache.
    keep_cache = False
    direct_io = True

    def __init__(
        self,
        source: str,
        *,
        latency: float = 0.0,
        fail_open: Sequence[FailRule] = (),
        fail_read: Sequence[FailRule] = (),
        threads: int = DEFAULT_THREADS,
        cache_timeout: float = 0.0,
        bandwidth: float = 0.0,
    ) -> None:
        self.source = os.path.abspath(source)
        self.latency = latency
        self.fail_open = tuple(fail_open)
        self.fail_read = tuple(fail_read)
        self.cache_timeout = cache_timeout
        self._root_fd = os.open(self.source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._delay = Delay(latency)
        self._bandwidth = Bandwidth(bandwidth)  # bytes per second; 0: no cap
        self._limiter = trio.CapacityLimiter(threads)
        root = os.fstat(self._root_fd)
        self._root_key = (root.st_dev, root.st_ino)
        self._path: dict[int, str] = {ROOT_INODE: ""}  # inodes the kernel knows -> a path
        self._lookups: dict[int, int] = {}
        self._foreign: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> inode, never reused
        self._foreign_numbers = itertools.count(FOREIGN_INODES)
        self._handles = itertools.count(1)
        self._files: dict[int, _OpenFile] = {}
        self._dirs: dict[int, tuple[str, list[tuple[str, os.stat_result]]]] = {}
        self._listed: dict[str, os.stat_result] = {}  # children of the open directories, by path
        self._stats_reads: dict[int, bytes] = {}
        self._c = _Counters()

    def close(self) -> None:
        for f in self._files.values():
            os.close(f.fd)
        self._files.clear()
        os.close(self._root_fd)

    # -- helpers -----------------------------------------------------------------------

    async def _remote(self, op: str, path: str, fn: Callable[[], T], *, fail: int = 0) -> T:
        """One remote operation in a worker thread: the latency, then ``fn`` or ``fail``."""
        c = self._c
        c.ops[op] += 1
        c.concurrent += 1
        c.max_concurrent = max(c.max_concurrent, c.concurrent)
        if fail:
            c.injected[op] += 1

        def work() -> T:
            self._delay.wait()
            if fail:
                raise OSError(fail, os.strerror(fail), path)
            return fn()

        try:
            return await trio.to_thread.run_sync(work, limiter=self._limiter)
        except OSError as exc:
            code = exc.errno or errno.EIO
            c.errors.setdefault(op, Counter())[errno.errorcode.get(code, str(code))] += 1
            raise FsError(code) from None
        finally:
            c.concurrent -= 1

    def _node_path(self, inode: int) -> str:
        try:
            return self._path[inode]
        except KeyError:
            raise FsError(errno.ESTALE) from None

    def _inode_of(self, st: os.stat_result) -> int:
        key = (st.st_dev, st.st_ino)
        if key == self._root_key:
            return ROOT_INODE
        if st.st_dev == self._root_key[0] and st.st_ino + INODE_SHIFT < FOREIGN_INODES:
            return st.st_ino + INODE_SHIFT
        inode = self._foreign.get(key)
        if inode is None:
            inode = self._foreign[key] = next(self._foreign_numbers)
        return inode

    def _remember(self, path: str, st: os.stat_result) -> _Entry:
        """The entry for ``path`` handed to the kernel (its lookup count goes up by one)."""
        inode = self._inode_of(st)
        self._path[inode] = path  # the latest name of a hard-linked file will do
        if inode != ROOT_INODE:
            self._lookups[inode] = self._lookups.get(inode, 0) + 1
        return _Entry(inode, Attr.from_stat(st))

    def _forget_one(self, inode: int, n: int) -> None:
        if inode not in self._lookups:
            return  # the root and the stats file live as long as the mount
        self._lookups[inode] -= n
        if self._lookups[inode] <= 0:
            del self._lookups[inode], self._path[inode]

    def _stats_entry(self) -> _Entry:
        # Its size is the statistics' size now; read with direct_io, the file is read to
        # its end whatever size the kernel has cached (--cache-timeout).
        now = time.time_ns()
        return _Entry(STATS_INODE, Attr(stat.S_IFREG | 0o444, 1, os.getuid(), os.getgid(), 0,
                                        len(self.statistics_json()), 0, 4096, now, now, now, STATS_INODE))

    def statistics(self) -> dict[str, Any]:
        """Everything counted so far, as the JSON-ready object of ``.slowfs_stats``."""
        c = self._c
        d = self._delay.statistics()
        return {
            "pid": os.getpid(),
            "source": self.source,
            "latency_us": self.latency * 1e6,
            "bandwidth_mb_s": self._bandwidth.bytes_per_s / 1e6,
            "ops": dict(c.ops),
            "errors": {op: dict(codes) for op, codes in c.errors.items()},
            "injected": dict(c.injected),
            "bytes_read": c.bytes_read,
            "max_concurrent": c.max_concurrent,
            "max_sleeping": d.max_sleeping,
            "delay": {"count": d.count, "mean_us": d.mean_us, "max_us": d.max_us},
            "open_files": len(self._files),
        }

    def statistics_json(self) -> bytes:
        return json.dumps(self.statistics(), sort_keys=True).encode() + b"\n"

    # -- names and attributes ----------------------------------------------------------

    async def lookup(self, parent_inode: int, text: str) -> _Entry:
        parent = self._node_path(parent_inode)
        if parent_inode == ROOT_INODE and text == STATS_NAME:
            return self._stats_entry()
        if text == ".":
            path = parent
        elif text == "..":
            path = parent.rpartition("/")[0]
        else:
            path = f"{parent}/{text}" if parent else text
        rel = _rel(path)
        st = await self._remote("lookup", path, lambda: os.stat(rel, dir_fd=self._root_fd, follow_symlinks=False))
        return self._remember(path, st)

    def entry(self, parent_inode: int, name: str, path: str, attr: Attr) -> _Entry:
        """A listed child handed to the kernel by READDIRPLUS (its lookup count goes up)."""
        return self._remember(path, self._listed[path])

    def forget(self, inode: int, n: int) -> None:
        self._forget_one(inode, n)

    def lookup_now(self, parent_inode: int, text: str) -> _Entry | None:
        return None  # every lookup is a remote call

    def getattr_now(self, inode: int) -> _Entry | None:
        return None  # every getattr is a remote call

    async def getattr(self, inode: int) -> _Entry:
        if inode == STATS_INODE:
            return self._stats_entry()
        path = self._node_path(inode)
        rel = _rel(path)
        st = await self._remote("getattr", path, lambda: os.stat(rel, dir_fd=self._root_fd, follow_symlinks=False))
        return _Entry(inode, Attr.from_stat(st))

    async def readlink(self, inode: int) -> str:
        path = self._node_path(inode)
        rel = _rel(path)
        return await self._remote("readlink", path, lambda: os.readlink(rel, dir_fd=self._root_fd))

    async def statfs(self) -> FsStats:
        st = await self._remote("statfs", "", lambda: os.statvfs(self._root_fd))
        return FsStats(st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree,
                       st.f_namemax)

    # -- directories -------------------------------------------------------------------

    async def opendir(self, inode: int) -> int:
        path = self._node_path(inode)
        rel = _rel(path)

        def scan() -> list[tuple[str, os.stat_result]]:
            fd = os.open(rel, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._root_fd)
            try:
                entries = []
                with os.scandir(fd) as it:
                    for entry in it:
                        if not path and entry.name == STATS_NAME:
                            continue  # shadowed by the virtual stats file
                        try:
                            entries.append((entry.name, entry.stat(follow_symlinks=False)))
                        except FileNotFoundError:
                            continue  # removed between readdir and stat
            finally:
                os.close(fd)
            entries.sort(key=lambda e: e[0])  # stable offsets for readdir
            return entries

        entries = await self._remote("readdir", path, scan)
        fh = next(self._handles)
        self._dirs[fh] = (path, entries)
        for name, st in entries:
            self._listed[f"{path}/{name}" if path else name] = st
        return fh

    def readdir(self, fh: int, start: int) -> Iterator[tuple[int, str, str, Attr]]:
        try:
            path, entries = self._dirs[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None
        for i in range(start, len(entries)):
            name, st = entries[i]
            yield i + 1, name, f"{path}/{name}" if path else name, Attr.from_stat(st)

    def releasedir(self, fh: int) -> None:
        path, entries = self._dirs.pop(fh, ("", []))
        if not any(p == path for p, _ in self._dirs.values()):  # another handle may list it too
            for name, _ in entries:
                self._listed.pop(f"{path}/{name}" if path else name, None)

    # -- files -------------------------------------------------------------------------

    async def open(self, inode: int, flags: int, pid: int = 0) -> int:
        if flags & _WRITE_FLAGS:
            raise FsError(errno.EROFS)
        if inode == STATS_INODE:
            fh = next(self._handles)
            self._stats_reads[fh] = self.statistics_json()
            return fh
        path = self._node_path(inode)
        rel = _rel(path)
        fd = await self._remote(
            "open", path,
            lambda: os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._root_fd),
            fail=first_match(self.fail_open, path),
        )
        fh = next(self._handles)
        self._files[fh] = _OpenFile(fd, path, first_match(self.fail_read, path))
        return fh

    async def read(self, inode: int, fh: int, off: int, size: int, pid: int = 0) -> bytes:
        snapshot = self._stats_reads.get(fh)
        if snapshot is not None:
            return snapshot[off : off + size]
        try:
            f = self._files[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

        def read() -> bytes:
            chunk = os.pread(f.fd, size, off)
            self._bandwidth.transfer(len(chunk))
            return chunk

        data = await self._remote("read", f.path, read, fail=f.read_errno)
        self._c.bytes_read += len(data)
        return data

    # Nothing is cached here, so nothing is published: every open and read is a remote one.
    def lend_to(self, borrower: Borrower) -> None:
        pass

    def publish(self, inode: int) -> bool:
        return False

    def looked_up(self, inode: int) -> None:
        raise AssertionError("slowfs publishes no entries")

    def expire_entries(self) -> None:
        pass  # nothing published

    def served(self, inode: int, pid: int, offset: int, first: int, ram_bytes: int, ram_mask: int,
               disk_bytes: int, disk_mask: int) -> Coroutine[Any, Any, None] | None:
        raise AssertionError("slowfs lends no blocks")

    def release(self, fh: int) -> None:
        if self._stats_reads.pop(fh, None) is not None:
            return
        f = self._files.pop(fh, None)
        if f is not None:
            self._c.ops["release"] += 1
            os.close(f.fd)  # a descriptor of SOURCE, a local directory: close() does not block


# -- serving -------------------------------------------------------------------------


def mount_options() -> set[str]:
    options = {"default_permissions", "ro", "fsname=slowfs", "subtype=slowfs"}  # the kernel checks modes
    if os.geteuid() == 0:
        options.add("allow_other")  # the daemon under test may run as another user
    return options


async def serve(fs: SlowFS, mount_point: str, *, on_ready: Callable[[], None]) -> None:
    """Mount ``fs`` on ``mount_point`` and serve until unmounted or SIGINT/SIGTERM."""
    session = kernel.mount(fs, mount_point, mount_options(), entry_timeout=fs.cache_timeout,
                           attr_timeout=fs.cache_timeout, opener=fs)
    try:
        async with trio.open_nursery() as nursery:
            # The signal handler is in place before readiness is reported, so a SIGTERM
            # sent right after start-up unmounts cleanly instead of killing the process.
            await nursery.start(_terminate_on_signal, session)
            log.info("slowfs: %s on %s, latency %.0f us, pid %d", fs.source, mount_point, fs.latency * 1e6,
                     os.getpid())
            on_ready()
            await session.serve()
            nursery.cancel_scope.cancel()
    finally:
        session.close()
        log.info("slowfs: unmounted %s", mount_point)


async def _terminate_on_signal(session: kernel.KernelSession, *,
                               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            session.terminate()  # serve() returns; a terminate() before serve() makes it return at once
            return


# -- command line --------------------------------------------------------------------


def command_line(
    source: str,
    mount_point: str,
    *,
    latency_us: float = 0.0,
    fail: Iterable[str | FailRule] = (),
    fail_read: Iterable[str | FailRule] = (),
    threads: int = DEFAULT_THREADS,
    cache_timeout: float = 0.0,
    bandwidth_mb_s: float = 0.0,
) -> list[str]:
    """The argv that runs slowfs in the foreground with these settings."""
    argv = [sys.executable, "-m", "tools.slowfs", os.path.abspath(source), os.path.abspath(mount_point),
            f"--latency-us={latency_us:g}", f"--threads={threads}", f"--cache-timeout={cache_timeout:g}",
            "--foreground"]
    if bandwidth_mb_s:
        argv.append(f"--bandwidth-mb-s={bandwidth_mb_s:g}")
    argv += [f"--fail={rule}" for rule in fail]
    argv += [f"--fail-read={rule}" for rule in fail_read]
    return argv


def _rule(text: str) -> FailRule:
    try:
        return FailRule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.slowfs",
        description="Mount SOURCE read-only on MOUNTPOINT with a per-operation latency and injected errors "
        "(an emulated remote volume). Statistics: read MOUNTPOINT/.slowfs_stats.",
    )
    parser.add_argument("source", metavar="SOURCE")
    parser.add_argument("mount_point", metavar="MOUNTPOINT")
    parser.add_argument("--latency-us", type=float, default=0.0, metavar="N",
                        help="delay of every remote operation in microseconds (default: 0)")
    parser.add_argument("--fail", type=_rule, action="append", default=[], metavar="GLOB=ERRNO",
                        help="open of files matching GLOB (relative path) fails with ERRNO, e.g. '*.bad=EIO'")
    parser.add_argument("--fail-read", type=_rule, action="append", default=[], metavar="GLOB=ERRNO",
                        help="like --fail, but open succeeds and every read fails")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                        help=f"remote operations in progress at once (default: {DEFAULT_THREADS})")
    parser.add_argument("--cache-timeout", type=float, default=0.0, metavar="SECONDS",
                        help="kernel entry/attribute cache timeout (default: 0, every stat is remote)")
    parser.add_argument("--bandwidth-mb-s", type=float, default=0.0, metavar="MB",
                        help="cap on bytes all reads return per second, in MB/s (10^6 bytes; default: 0, none)")
    parser.add_argument("--foreground", action="store_true", help="do not detach; log to stderr")
    parser.add_argument("--log-file", default=None, metavar="PATH", help="where a detached daemon logs")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isdir(args.source):
        parser.error(f"SOURCE {args.source!r} is not a directory")
    if not os.path.isdir(args.mount_point):
        parser.error(f"MOUNTPOINT {args.mount_point!r} is not a directory")
    if args.threads < 1 or args.latency_us < 0 or args.cache_timeout < 0 or args.bandwidth_mb_s < 0:
        parser.error("--threads must be >= 1, --latency-us, --cache-timeout and --bandwidth-mb-s >= 0")
    if not args.foreground:
        return _detach(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    ready_fd: int | None = args.ready_fd

    def report(message: str) -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            os.write(ready_fd, f"{message}\n".encode())
            os.close(ready_fd)
            ready_fd = None

    try:
        fs = SlowFS(args.source, latency=args.latency_us / 1e6, fail_open=args.fail, fail_read=args.fail_read,
                    threads=args.threads, cache_timeout=args.cache_timeout, bandwidth=args.bandwidth_mb_s * 1e6)
    except OSError as exc:
        report(f"error: cannot open {args.source}: {exc.strerror}")
        return 1
    try:
        trio.run(lambda: serve(fs, args.mount_point, on_ready=lambda: report("ok")))
    except Exception as exc:
        report(f"error: {exc}")
        log.exception("slowfs failed")
        return 1
    finally:
        fs.close()
    return 0


def _detach(args: argparse.Namespace) -> int:
    argv = command_line(args.source, args.mount_point, latency_us=args.latency_us, fail=args.fail,
                        fail_read=args.fail_read, threads=args.threads, cache_timeout=args.cache_timeout,
                        bandwidth_mb_s=args.bandwidth_mb_s)
    log_target = open(args.log_file, "ab") if args.log_file else open(os.devnull, "wb")
    read_fd, write_fd = os.pipe()
    with log_target:
        proc = subprocess.Popen([*argv, f"--ready-fd={write_fd}"], pass_fds=(write_fd,), cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=log_target, stderr=log_target,
                                start_new_session=True)
    os.close(write_fd)
    message = _wait_ready(read_fd, proc, READY_TIMEOUT)
    if message != "ok":
        if proc.poll() is None:
            proc.kill()
        print(f"slowfs: {message or 'the daemon exited during start-up'}", file=sys.stderr)
        return 1
    print(proc.pid)
    return 0


def _wait_ready(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The daemon's one-line start-up report ("ok" or "error: ..."); "" if it died silently."""
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return f"error: no mount after {timeout:.0f} s"
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.2))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
            elif proc.poll() is not None:
                break
        return data.decode(errors="replace").strip()
    finally:
        os.close(fd)


# -- running it from Python ----------------------------------------------------------


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """True if something is mounted on ``path`` (also a dead FUSE mount, unlike os.path.ismount)."""
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            field = line.split()[4]
            # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
            if re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field) == target:
                return True
    return False


class SlowFSProcess:
    """A slowfs daemon as a child process: ``with SlowFSProcess(src, mnt, latency_us=300) as fs: ...``."""

    def __init__(
        self,
        source: str | os.PathLike[str],
        mount_point: str | os.PathLike[str],
        *,
        latency_us: float = 0.0,
        fail: Iterable[str | FailRule] = (),
        fail_read: Iterable[str | FailRule] = (),
        threads: int = DEFAULT_THREADS,
        cache_timeout: float = 0.0,
        bandwidth_mb_s: float = 0.0,
    ) -> None:
        self.source = Path(source)
        self.mount_point = Path(mount_point)
        self.argv = command_line(str(source), str(mount_point), latency_us=latency_us, fail=list(fail),
                                 fail_read=list(fail_read), threads=threads, cache_timeout=cache_timeout,
                                 bandwidth_mb_s=bandwidth_mb_s)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout: float = READY_TIMEOUT) -> SlowFSProcess:
        """Start the daemon and return once the mount is live; RuntimeError if it fails."""
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen([*self.argv, f"--ready-fd={write_fd}"], pass_fds=(write_fd,), cwd=REPO,
                                         stdin=subprocess.DEVNULL)
        finally:
            os.close(write_fd)
        message = _wait_ready(read_fd, self.proc, timeout)
        if message != "ok":
            self.stop()
            raise RuntimeError(f"slowfs did not start: {message or f'exit status {self.proc.returncode}'}")
        return self

    def stats(self) -> dict[str, Any]:
        """The daemon's statistics (see the module doc)."""
        result: dict[str, Any] = json.loads((self.mount_point / STATS_NAME).read_bytes())
        return result

    def hang(self) -> None:
        """Make every operation from now on wait unanswered until :meth:`resume` (SIGSTOP)."""
        assert self.proc is not None and self.proc.poll() is None, "not running"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Answer the operations held by :meth:`hang` and serve normally again (SIGCONT)."""
        assert self.proc is not None, "not started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait for a clean unmount; past ``timeout`` detach the mount and kill."""
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a hung slowfs would never see the SIGTERM
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        code = proc.wait()
        if is_mounted(self.mount_point):  # a crashed daemon leaves a dead mount behind
            subprocess.run(["fusermount3", "-u", "-z", str(self.mount_point)], capture_output=True)
        return code

    def __enter__(self) -> SlowFSProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
