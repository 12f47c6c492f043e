"""Deadlines for a backend: a hung remote costs a reader EIO, never a stuck process
(docs/concurrency.md, "Never stuck"). ``DeadlineBackend(inner, timeout)`` gives every
operation ``timeout`` seconds (``backendTimeout``, waiting for a thread included) and
answers ``EIO`` on expiry; the first expiry, or ENOTCONN/ECONNABORTED, marks the backend
down so that every operation fails at once instead of waiting the deadline, while cached
data is still served; :meth:`supervise` probes the inner backend every ``probe_interval``
seconds while down (reopening the source root when the remote came back at the same path)
and marks it up at the first answer; an ESTALE/EIO asks for one probe; and :meth:`abort`
fails everything in flight at shutdown so the FUSE loop can end while the remote hangs."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import trio

from cubefs_fuse.attrs import Attr, FileVersion, FsStats
from cubefs_fuse.backends.base import BackendStatistics, ProbedBackend

log = logging.getLogger(__name__)
T = TypeVar("T")

# How often a down backend is probed.  1 s: recovery is noticed within about a second of
# the remote answering again, and a probe (one stat + statvfs of the root) costs nothing.
PROBE_INTERVAL = 1.0
# A probe's own deadline, at most this (and at most the operation deadline): the probe
# asks the cheapest question there is, so 5 s without an answer means "still hung", and a
# short deadline keeps the probe loop turning.
MAX_PROBE_TIMEOUT = 5.0
OPS = ("stat", "listdir", "read", "readlink", "statfs")
# Errors that say the remote's mount itself is gone (a FUSE remote that died or was
# unmounted under an open root): down at once, without waiting for a deadline.
REMOTE_GONE = frozenset({errno.ENOTCONN, errno.ECONNABORTED})
# Errors that may come from a dead root descriptor, or from one file: one probe checks.
CHECK_ROOT = frozenset({errno.ESTALE, errno.EIO})


def _eio(message: str) -> OSError:
    return OSError(errno.EIO, f"{os.strerror(errno.EIO)}: {message}")


class DeadlineBackend:
    """A backend whose every operation ends within ``timeout`` seconds (see module doc)."""

    def __init__(self, inner: ProbedBackend, timeout: float, *, probe_interval: float = PROBE_INTERVAL) -> None:
        self.inner = inner
        self.timeout = timeout
        self.probe_interval = probe_interval
        self.probe_timeout = min(timeout, MAX_PROBE_TIMEOUT)
        self._down_since: float | None = None
        self._down_reason = ""
        self._wake = trio.Event()
        self._scopes: set[trio.CancelScope] = set()
        self._aborted = False
        # Every operation has its sample from the start (a bounded label set), so an alert
        # on rate() sees 0, not "no data", before the first timeout.
        self._timeouts: dict[str, int] = dict.fromkeys(OPS, 0)
        self._failed_fast: dict[str, int] = dict.fromkeys(OPS, 0)
        self._probe_error = ""

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @property
    def down_since(self) -> float | None:
        """When the backend went down (trio's clock), None while up (fs/outage.py's Outage)."""
        return self._down_since

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        """Fail every operation in flight, and every later one, with EIO at once (shutdown)."""
        self._aborted = True
        for scope in self._scopes:
            scope.cancel()

    def _mark_down(self, reason: str) -> None:
        if self._down_since is None:
            self._down_since = trio.current_time()
            self._down_reason = reason
            log.error("backend down: %s; operations fail with EIO at once until the source answers again "
                      "(probing every %g s)", reason, self.probe_interval)
        self._wake.set()

    async def _call(self, op: str, path: str, fn: Callable[[], Awaitable[T]]) -> T:
        if self._aborted:
            raise _eio("the daemon is shutting down")
        if self._down_since is not None:
            self._failed_fast[op] = self._failed_fast.get(op, 0) + 1
            raise _eio(f"the source is not answering ({self._down_reason})")
        with trio.CancelScope(deadline=trio.current_time() + self.timeout) as scope:
            self._scopes.add(scope)
            try:
                return await fn()
            except OSError as exc:
                if exc.errno in REMOTE_GONE:
                    self._mark_down(f"{op} of {path!r}: {os.strerror(exc.errno)}")
                elif exc.errno in CHECK_ROOT:
                    self._wake.set()
                raise
            finally:
                self._scopes.discard(scope)
        if self._aborted:
            raise _eio("the daemon is shutting down")
        self._timeouts[op] = self._timeouts.get(op, 0) + 1
        self._mark_down(f"{op} of {path!r} got no answer within {self.timeout:g} s")
        raise _eio(f"{op} of {path!r}: no answer from the source within {self.timeout:g} s")

    # -- the probe -------------------------------------------------------------------------

    async def supervise(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe while down (or when asked), mark up when the source answers; runs forever."""
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while not await self._probe():
                self._mark_down(f"probe: {self._probe_error}")
                await trio.sleep(self.probe_interval)
            if self._down_since is not None:
                log.warning("backend up again after %.1f s down: the source answers", trio.current_time() - self._down_since)
                self._down_since = None
            # At most one check per interval, however many ESTALE/EIO errors ask for one.
            await trio.sleep(self.probe_interval)

    async def _probe(self) -> bool:
        with trio.move_on_after(self.probe_timeout):
            try:
                await self.inner.probe()
            except OSError as exc:
                self._probe_error = os.strerror(exc.errno or errno.EIO)
                log.debug("backend probe failed: %s", exc)
                return False
            return True
        self._probe_error = f"no answer within {self.probe_timeout:g} s"
        return False

    # -- the Backend protocol --------------------------------------------------------------

    async def stat(self, path: str) -> Attr:
        return await self._call("stat", path, lambda: self.inner.stat(path))

    async def listdir(self, path: str, limit: int | None = None) -> list[tuple[str, Attr]]:
        return await self._call("listdir", path, lambda: self.inner.listdir(path, limit))

    async def read_block(self, path: str, version: FileVersion, offset: int, size: int) -> bytes:
        return await self._call("read", path, lambda: self.inner.read_block(path, version, offset, size))

    async def stat_read(self, path: str, max_size: int, want: Callable[[Attr], bool]) -> tuple[Attr, bytes | None]:
        # Under the stat deadline: one worker-thread call, counted as a stat (and a read).
        return await self._call("stat", path, lambda: self.inner.stat_read(path, max_size, want))

    async def readlink(self, path: str) -> str:
        return await self._call("readlink", path, lambda: self.inner.readlink(path))

    async def statfs(self) -> FsStats:
        return await self._call("statfs", "", self.inner.statfs)

    def statistics(self) -> BackendStatistics:
        return replace(self.inner.statistics(), timeouts=dict(self._timeouts),
                       failed_fast=dict(self._failed_fast), up=self._down_since is None)
