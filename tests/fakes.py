"""Test doubles for the layers below the FUSE session, and a sample store in a dict.

:class:`FakeBackend` implements the :class:`cubefs_fuse.backend.Backend` protocol over
an in-memory tree, so the cache, metadata and core layers can be driven without a
kernel or a real remote.  It gives tests what a real volume cannot:

* **latency**: every operation awaits ``trio.sleep(latency)`` (per-operation override
  in ``op_latency``), so under ``autojump_clock`` a "slow remote" costs no wall time;
* **counters**: ``operations[op]``, ``read_calls[(path, offset)]`` and ``read_log``
  (the order in which reads *started*);
* **gates**: ``gate(path)`` returns a ``trio.Event``; reads of that path start (they
  are counted and logged) and then wait until the event is set, so a test can hold a
  fetch in flight for exactly as long as it wants, with no sleeps;
* **faults**: ``fail(path, errno, ops=...)`` makes operations on a path raise that
  ``OSError`` until ``heal(path)``;
* **a hung remote**: ``hang()`` holds every operation started from then on, ``probe()``
  included, until ``unhang()`` (a remote that stopped answering); ``probe_error`` makes
  probes fail with that errno, ``reopen_on_probe`` makes the next answered probe report
  a reopened source.

Files change like real files: ``write()`` on an existing path bumps its mtime and
ctime, so its :class:`FileVersion` changes and a read for the old version raises
:class:`StaleVersion`, as :class:`LocalDirBackend` does.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from cubefs_fuse.attrs import Attr, FileVersion, FsStats
from cubefs_fuse.backends.base import BackendStatistics, too_many_entries
from cubefs_fuse.errors import StaleVersion
from cubefs_fuse.stats import LatencyHistogram
from cube_torch.samples.store import StoreError

OPS = ("stat", "listdir", "read", "readlink", "statfs")
# A fixed "now" for fresh files (2024-01-01T00:00:00Z in ns), so attributes are
# reproducible; every change adds one second.
BASE_TIME_NS = 1_704_067_200 * 1_000_000_000
SECOND_NS = 1_000_000_000
# Reported preferred I/O size, as ext4/xfs report it.
BLKSIZE = 4096


@dataclass
class _Node:
    mode: int
    ino: int
    mtime_ns: int
    ctime_ns: int
    data: bytes = b""
    target: str = ""  # symlinks only


class FakeBackend:
    """An in-memory volume with injectable latency, gates and errors (see module doc)."""

    def __init__(self, latency: float = 0.0, op_latency: dict[str, float] | None = None) -> None:
        self.latency = latency
        self.op_latency: dict[str, float] = dict(op_latency or {})
        self._nodes: dict[str, _Node] = {}
        self._next_ino = 2  # 1 is the root, as on most filesystems' FUSE view
        self._nodes[""] = _Node(stat.S_IFDIR | 0o755, 1, BASE_TIME_NS, BASE_TIME_NS)
        self.operations: Counter[str] = Counter()
        self.read_calls: Counter[tuple[str, int]] = Counter()
        self.read_log: list[tuple[str, int]] = []
        self.bytes_read = 0
        self.errors: Counter[tuple[str, int]] = Counter()
        self._failures: dict[str, tuple[int, frozenset[str]]] = {}
        self._gates: dict[str, trio.Event] = {}
        self._latency_hist: dict[str, LatencyHistogram] = {}
        self.reads_in_flight = 0
        self._hung: trio.Event | None = None
        self.held = 0  # operations waiting in hang()
        self.probes = 0
        self.probe_error = 0
        self.reopen_on_probe = False
        self.reopens = 0
        self.stat_reads = 0  # stat_read calls that returned the file's bytes

    # -- building the tree -------------------------------------------------------------

    def mkdir(self, path: str) -> None:
        """Create ``path`` and any missing parents as directories."""
        parts = path.split("/") if path else []
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in self._nodes:
                self._nodes[sub] = self._new(stat.S_IFDIR | 0o755)

    def write(self, path: str, data: bytes) -> FileVersion:
        """Create or replace a regular file (a replace changes its version)."""
        self.mkdir(path.rpartition("/")[0])
        node = self._nodes.get(path)
        if node is None:
            node = self._nodes[path] = self._new(stat.S_IFREG | 0o644)
        else:
            node.mtime_ns += SECOND_NS
            node.ctime_ns += SECOND_NS
        node.data = bytes(data)
        return self._attr(node).version

    def symlink(self, path: str, target: str) -> None:
        self.mkdir(path.rpartition("/")[0])
        self._nodes[path] = self._new(stat.S_IFLNK | 0o777, target=target)

    def remove(self, path: str) -> None:
        del self._nodes[path]

    def version(self, path: str) -> FileVersion:
        return self._attr(self._nodes[path]).version

    def _new(self, mode: int, target: str = "") -> _Node:
        ino = self._next_ino
        self._next_ino += 1
        return _Node(mode, ino, BASE_TIME_NS, BASE_TIME_NS, target=target)

    # -- fault and timing hooks ----------------------------------------------------------

    def fail(self, path: str, err: int, ops: tuple[str, ...] = OPS) -> None:
        """Make ``ops`` on ``path`` raise ``OSError(err)`` until :meth:`heal`."""
        self._failures[path] = (err, frozenset(ops))

    def heal(self, path: str) -> None:
        self._failures.pop(path, None)

    def gate(self, path: str) -> trio.Event:
        """Hold every read of ``path`` (after it starts) until the returned event is set."""
        event = self._gates[path] = trio.Event()
        return event

    def hang(self) -> None:
        """Hold every operation started from now on until :meth:`unhang`."""
        if self._hung is None:
            self._hung = trio.Event()

    def unhang(self) -> None:
        if self._hung is not None:
            self._hung.set()
            self._hung = None

    async def _held(self) -> None:
        hung = self._hung
        if hung is not None:
            self.held += 1
            try:
                await hung.wait()
            finally:
                self.held -= 1

    async def _enter(self, op: str, path: str) -> None:
        self.operations[op] += 1
        await self._held()
        delay = self.op_latency.get(op, self.latency)
        if delay:
            start = trio.current_time()
            await trio.sleep(delay)
            self._latency_hist.setdefault(op, LatencyHistogram()).observe(trio.current_time() - start)
        failure = self._failures.get(path)
        if failure is not None and op in failure[1]:
            self.errors[(op, failure[0])] += 1
            raise OSError(failure[0], os.strerror(failure[0]), path)

    def _lookup(self, path: str) -> _Node:
        node = self._nodes.get(path)
        if node is None:
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return node

    @staticmethod
    def _attr(node: _Node) -> Attr:
        size = len(node.target) if stat.S_ISLNK(node.mode) else len(node.data)
        nlink = 2 if stat.S_ISDIR(node.mode) else 1
        return Attr(node.mode, nlink, 0, 0, 0, size, -(-size // 512), BLKSIZE,
                    node.mtime_ns, node.mtime_ns, node.ctime_ns, node.ino)

    # -- the Backend protocol ------------------------------------------------------------

    async def stat(self, path: str) -> Attr:
        await self._enter("stat", path)
        return self._attr(self._lookup(path))

    async def listdir(self, path: str, limit: int | None = None) -> list[tuple[str, Attr]]:
        await self._enter("listdir", path)
        node = self._lookup(path)
        if not stat.S_ISDIR(node.mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        prefix = f"{path}/" if path else ""
        entries = [
            (name[len(prefix):], self._attr(child))
            for name, child in self._nodes.items()
            if name and name.startswith(prefix) and "/" not in name[len(prefix):]
        ]
        if limit is not None and len(entries) > limit:
            raise too_many_entries(path, limit)
        return entries

    async def read_block(self, path: str, version: FileVersion, offset: int, size: int) -> bytes:
        self.read_calls[(path, offset)] += 1
        self.read_log.append((path, offset))
        self.reads_in_flight += 1
        try:
            await self._enter("read", path)
            gate = self._gates.get(path)
            if gate is not None:
                await gate.wait()
            node = self._lookup(path)
            if self._attr(node).version != version:
                raise StaleVersion(path)
            data = node.data[offset:offset + size]
        finally:
            self.reads_in_flight -= 1
        self.bytes_read += len(data)
        return data

    async def stat_read(self, path: str, max_size: int, want: Callable[[Attr], bool]) -> tuple[Attr, bytes | None]:
        """One call: counted as one ``stat`` (``stat_reads`` counts those that read too);
        the read part honours ``fail(..., ops=("read",))`` (no bytes), gates and versions."""
        await self._enter("stat", path)
        attr = self._attr(self._lookup(path))
        if not (attr.is_file and 0 < attr.size <= max_size) or not want(attr):
            return attr, None
        failure = self._failures.get(path)
        if failure is not None and "read" in failure[1]:
            return attr, None
        # The read part counts as read_block's does: when it starts (a gated one hangs after).
        self.read_calls[(path, 0)] += 1
        self.read_log.append((path, 0))
        gate = self._gates.get(path)
        if gate is not None:
            await gate.wait()
        node = self._nodes.get(path)
        if node is None or self._attr(node).version != attr.version:
            return attr, None
        self.stat_reads += 1
        self.bytes_read += len(node.data)
        return attr, node.data

    async def readlink(self, path: str) -> str:
        await self._enter("readlink", path)
        node = self._lookup(path)
        if not stat.S_ISLNK(node.mode):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return node.target

    async def statfs(self) -> FsStats:
        await self._enter("statfs", "")
        used = sum(-(-len(n.data) // BLKSIZE) for n in self._nodes.values())
        # A volume of 1 Mi blocks (4 GiB): large enough for any test tree.
        total = 1 << 20
        return FsStats(BLKSIZE, BLKSIZE, total, total - used, total - used,
                       total, total - len(self._nodes), 255)

    async def probe(self) -> bool:
        """The ProbedBackend check: held by hang(), fails with ``probe_error`` if set."""
        self.probes += 1
        await self._held()
        if self.probe_error:
            raise OSError(self.probe_error, os.strerror(self.probe_error))
        if self.reopen_on_probe:
            self.reopen_on_probe = False
            self.reopens += 1
            return True
        return False

    def close(self) -> None:
        pass

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            operations=dict(self.operations),
            errors=dict(self.errors),
            bytes_read=self.bytes_read,
            latency={op: h.snapshot() for op, h in self._latency_hist.items()},
            threads_busy=self.reads_in_flight,
            threads_total=0,
        )


class MemoryStore:
    """A SampleStore in a dict, with switches to fail and to stall."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], bytes] = {}
        self.calls = Counter[str]()
        self.fail_get = self.fail_put = False
        self.stall = threading.Event()
        self.stall.set()
        self.plans: list[tuple[str, list[int]]] = []

    def get_many(self, name: str, keys: Sequence[int]) -> list[bytes | memoryview | None]:
        self.calls["get_many"] += 1
        if self.fail_get:
            raise StoreError("down")
        return [memoryview(self.entries[(name, k)]) if (name, k) in self.entries else None for k in keys]

    def put_many(self, name: str, items: Sequence[tuple[int, bytes]]) -> None:
        self.calls["put_many"] += 1
        self.stall.wait(10)
        if self.fail_put:
            raise StoreError("OOM full")
        for key, entry in items:
            self.entries[(name, key)] = bytes(entry)

    def plan(self, name: str, keys: Sequence[int]) -> None:
        self.plans.append((name, [int(k) for k in keys]))

    def close(self) -> None:
        self.calls["close"] += 1
