"""The filesystem core without FUSE: names, handles, reads assembled from cached blocks,
testable without a kernel (``fs.session`` only translates). The volume is read-only, so
every write fails with EROFS, and failures are raised as exceptions for ``errors.errno_of``
to map. Reads are by inode (an inode serves one version of its file, fs/inodes.py), so a
file is opened without the core (the kernel's no_open mode); a file's read by one process
counts from its first READ (offset 0), and a file changed at the source is found when its
name is looked up again, which the kernel does once an entry's ``valid_for`` (as long as
the metadata cache trusts the attributes) has passed. A borrower (the FUSE session in C)
serves reads of the cached blocks the core lends it per inode, and answers lookups of the
names whose entries the core publishes to it while the attributes are trusted; the core
takes blocks back when they leave the RAM tier, and all of them when the inode goes."""

from __future__ import annotations

import errno
import heapq
import math
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Protocol

import trio

from cubefs_fuse.attrs import Attr, FileVersion, FsStats, attr_fields
from cubefs_fuse.backends.base import Backend
from cubefs_fuse.cache.blockcache import BlockCache, Source
from cubefs_fuse.cache.keys import block_key, path_tag
from cubefs_fuse.errors import FsError, StaleVersion
from cubefs_fuse.fs.blocks import FileBlocks
from cubefs_fuse.fs.inodes import InodeTable, Replayed, child_path
from cubefs_fuse.fs.metadata import MetadataCache
from cubefs_fuse.fs.outage import Outage, StaleIfError

# Blocks fetched ahead of a sequential reader of a large file.  Two keep one block in
# flight while the reader consumes the next, which hides one remote round trip per
# block without spending the cache on blocks a random reader never asks for.
READAHEAD_BLOCKS = 2
# The largest file (in blocks) whose blocks are lent to the borrower: a publication holds
# 8-16 bytes per block, 64 KiB at most (a 4 GiB file of 1 MiB blocks); larger files are
# read in large requests, where the per-request cost the borrower saves matters least.
MAX_LENT_BLOCKS = 4096
# The most names a directory may have for a lookup's miss to publish all of them (see
# Filesystem._publish_listing): a dataset's class directory holds hundreds to a few
# thousand files (ImageNet's ~1,300); a flat one of 10^5-10^6 would cost a listing of all
# (over S3 30-40 us of CPU per key) and pin that many inodes and entries for one lookup's
# sake, so its listing stops past this many names, and its names are published one
# lookup at a time, as before.
MAX_LISTED_NAMES = 16_384
# Directories found larger than that, remembered so that they are not listed again (a
# set of paths, emptied when it reaches this many: each costs at most one listing of
# MAX_LISTED_NAMES names per emptying).
MAX_LARGE_DIRECTORIES = 4096
# Names of such a listing published per trio step: each costs ~10-20 us (an inode, an
# entry, its held blocks lent), so a step of 64 stays near a millisecond.
LISTED_NAMES_PER_STEP = 64


@dataclass(frozen=True, slots=True)
class Entry:
    inode: int
    attr: Attr
    valid_for: float  # seconds the kernel may keep it (fs/session.py, Entry)


@dataclass(slots=True)
class FileRequest:
    """One READ's file, and, for a READ at offset 0, a process's read of the file: what the
    hit accounting and the plans count as a request (the kernel opens and closes files
    without telling the core)."""
    inode: int
    path: str
    version: FileVersion
    tag: int = 0  # path_tag(path)
    owner: object = None  # the observer's context for the reading process
    waited: bool = False  # the READ waited on the backend
    stall: float = 0.0  # seconds it waited
    keys: tuple[bytes, ...] = ()  # its blocks' keys at ``version`` when known (() : compute them)


@dataclass(frozen=True, slots=True)
class _FileOf:
    """What every READ of an inode needs, computed at its first: an inode serves one
    version of one path (fs/inodes.py), so none of it changes until the inode is freed."""

    path: str
    version: FileVersion
    tag: int  # path_tag(path)
    keys: tuple[bytes, ...]  # the version's block keys; () for a file of more than MAX_LENT_BLOCKS


# An NVMe entry lent by its place: (segment path, offset, allocated bytes, block key).
DiskBlock = tuple[bytes, int, int, bytes]
# A lent block: a RAM block's bytes, an NVMe entry's place, or None where it is not held.
LentBlock = bytes | DiskBlock | None


# withdraw_entry's deadline for "whichever the name was published with".
ANY_DEADLINE = 0


class Borrower(Protocol):
    """A reader that serves reads of an inode's lent blocks itself (the FUSE session in C,
    fs/_session.c), reported afterwards (``Filesystem.served``), and answers lookups of a
    published entry until its deadline (``expires_ns``, ``time.monotonic_ns``), reported
    too (``Filesystem.looked_up``).  What ``publish``, ``lend``, ``withdraw`` and the
    entry calls replace is unused once they return.  ``report`` hands over, now, what it
    served and answered and has not reported yet."""

    def publish(self, inode: int, size: int, block_size: int, blocks: Sequence[LentBlock], /) -> None: ...

    def lend(self, inode: int, index: int, block: LentBlock, /) -> bool: ...

    def withdraw(self, inode: int, /) -> None: ...

    def publish_entry(self, parent: int, name: str, inode: int, attr: Attr, expires_ns: int, /) -> None: ...

    def withdraw_entry(self, parent: int, name: str, expires_ns: int, /) -> bool: ...

    def report(self) -> None: ...


# What AccessObserver.opened_now answers when the opener's owner cannot be known without
# waiting: then opened() is called.
OWNER_UNKNOWN = object()


class AccessObserver(Protocol):
    """Sees every file request (a process's READ at offset 0) that reaches the daemon:
    ``opened`` when it starts (its owner), ``released`` when it is answered (hit
    accounting, plan cursors)."""

    async def opened(self, pid: int, path: str) -> object: ...

    def opened_now(self, pid: int, path: str) -> object:
        """As :meth:`opened` when that needs no wait; else OWNER_UNKNOWN (nothing seen)."""
        ...

    def released(self, f: FileRequest) -> None: ...


@dataclass(frozen=True, slots=True)
class FilesystemStatistics:
    lookups: int
    native_lookups: int  # of those, answered by the borrower from published entries (counted when reported)
    open_dirs: int
    reads: int
    read_bytes: int
    native_reads: int  # of those, served by the FUSE session from lent blocks (counted when reported)
    blocks_by_source: dict[str, int]  # block lookups by the tier that answered
    bytes_by_source: dict[str, int]  # bytes returned to applications by that tier
    stale_reads: int
    inodes: int
    retired_inodes: int  # inodes of old versions the kernel still holds
    version_changes: int  # files found changed at the source while the kernel held the old version's inode
    file_requests: int  # READs at offset 0 of regular files: a process's read of a file
    file_misses: int  # of those, the ones whose READ waited on the backend
    stall_seconds: float
    stale_if_error: dict[str, int] = field(default_factory=dict)  # op -> answered stale while the source was down


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    native_lookups: int = 0
    reads: int = 0
    read_bytes: int = 0
    native_reads: int = 0
    stale_reads: int = 0
    file_requests: int = 0
    file_misses: int = 0
    stall_seconds: float = 0.0
    blocks_by_source: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in Source})
    bytes_by_source: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in Source})


class Filesystem:
    """The kernel keeps a file's pages across opens (no_open implies FOPEN_KEEP_CACHE): an
    inode serves one version of a file (a changed file gets a new inode, fs/inodes.py), so
    the pages it holds for an inode are always good, and no invalidation notice is ever
    needed."""

    def __init__(self, nursery: trio.Nursery, meta: MetadataCache, cache: BlockCache, backend: Backend, *,
                 block_size: int, outage: Outage | None = None) -> None:
        """``nursery``: where listings published for the borrower run (:meth:`lookup`);
        ``outage``: while it says the source is down, answer from the last validated
        metadata what the cache holds whole (fs/outage.py); None: never (EIO)."""
        self._nursery = nursery
        self.meta = meta
        self.cache = cache
        self.backend = backend
        self.block_size = block_size
        self.inodes = InodeTable()
        self.blocks = FileBlocks(meta, cache, backend, block_size)
        self.stale_if_error = StaleIfError(meta, self.blocks, outage)
        self._dirs: dict[int, tuple[str, list[tuple[str, Attr]]]] = {}
        self._handles = count(1)
        self._c = _Counters()
        self.observer: AccessObserver | None = None
        self.borrower: Borrower | None = None
        # Per inode Python has read: the block a sequential reader asks for next.
        self._next_block: dict[int, int] = {}
        self._published: set[int] = set()  # inodes published to the borrower
        # Per inode read since it was created: its path, version, tag and block keys (one
        # entry per inode the kernel holds; gone with the inode, _withdraw).
        self._files: dict[int, _FileOf] = {}
        self._incomplete: set[int] = set()  # published inodes with a block not lent (not held then)
        # RAM blocks lent: per inode, block index -> key; per key, its (inode, index)
        # loans, so that a block leaving the RAM tier is taken back from each.
        self._loans: dict[int, dict[int, bytes]] = {}
        self._lenders: dict[bytes, list[tuple[int, int]]] = {}
        # Entries published to the borrower: a heap of (deadline, parent, name, inode), one
        # per publication (each pins its inode until withdrawn).
        self._entry_deadlines: list[tuple[int, int, str, int]] = []
        # Directories listed for the borrower (:meth:`_list_for_borrower`), in the order they
        # were, with when (trio's clock) that listing stops being trusted: one listing per
        # directory per ``attrValid``, in flight or done, whatever it found.
        self._listed: OrderedDict[str, float] = OrderedDict()
        self._too_large: set[str] = set()  # directories of more than MAX_LISTED_NAMES names
        # File requests the borrower served whose owner is still being resolved (a process
        # not seen before): each set once its request is counted (settle() waits on them).
        self._observing: set[trio.Event] = set()
        # Other servers of reads whose reports may still be on their way (the fast path's
        # releases, sent before the batch reached the loader): settle() awaits each.
        self._reporters: list[Callable[[], Awaitable[None]]] = []
        # The borrower's clock for entry deadlines (CLOCK_MONOTONIC, as C reads it; trio's
        # clock has an offset of its own).  Tests replace it.
        self.clock_ns: Callable[[], int] = time.monotonic_ns
        # Lookups and getattrs that miss the metadata cache bring small files whole
        # (see _stat_fetching); off: they only stat, as operator tools do.
        self.lookup_fetch = True

    # -- names and attributes --------------------------------------------------------

    async def lookup(self, parent_inode: int, name: str) -> Entry:
        """``name``'s entry, its attributes from the metadata cache or the source.  A miss
        on a file some tier holds (a restarted daemon, or entries whose time ran out in a
        later epoch) starts a listing of its directory for the borrower
        (:meth:`_list_for_borrower`)."""
        path = self._child(parent_inode, name)
        self._c.lookups += 1
        attr, missed = await self._stat_fetching(path, "lookup")
        entry = self._looked_up_here(parent_inode, name, path, attr)
        if (missed and self.borrower is not None and attr.is_file and attr.size > 0
                and self.cache.contains(block_key(path, attr.version, 0))):
            self._list_for_borrower(parent_inode, path.rpartition("/")[0])
        return entry

    def lookup_now(self, parent_inode: int, name: str) -> Entry | None:
        """:meth:`lookup` when the metadata cache answers, without waiting (the session
        then answers in the same step, with no task); None when it would wait."""
        path = self._child(parent_inode, name)
        attr = self.meta.hit(path)
        if attr is None:
            return None
        self._c.lookups += 1
        return self._looked_up_here(parent_inode, name, path, attr)

    def entry(self, parent_inode: int, name: str, path: str, attr: Attr) -> Entry:
        """The entry of a listed name handed to the kernel (READDIRPLUS), published to the
        borrower as a lookup's is (:meth:`_looked_up_here`), unless its inode is pinned
        already: an inode serves one path's version, so its name is published, and a
        listing read again and again (``ls`` in a loop: the kernel does not cache listings)
        adds no publication per pass; they stay bounded by the names."""
        entry = self._entry(path, attr)
        if not self.inodes.node(entry.inode).pins:
            self._publish_entry(parent_inode, name, entry)
        return entry

    def _list_for_borrower(self, parent_inode: int, parent: str) -> None:
        """List ``parent`` in the background and publish its names to the borrower with
        their held blocks, as a READDIRPLUS answer does, without handing the kernel any: a
        reader that goes on reading the directory's files (a dataset read again) is then
        answered in C, lookups and reads, where each name would otherwise cost a Python
        lookup (~430 us of trio-thread CPU, 2-core VM).  Only a lookup that missed on a
        held file asks for it, so a cold first pass lists nothing it would not read, and a
        directory is listed once per ``attrValid`` (what an ``ls -l`` of it costs the
        source), however many lookups miss in it meanwhile."""
        now = trio.current_time()
        listed = self._listed
        while listed:  # the oldest first: every listing is trusted for the same time
            oldest = next(iter(listed))
            if listed[oldest] > now:
                break
            del listed[oldest]
        if parent in listed or parent in self._too_large or not self.meta.attr_ttl:
            return
        listed[parent] = now + self.meta.attr_ttl
        self._nursery.start_soon(self._publish_listing, parent_inode, parent)

    async def _publish_listing(self, parent_inode: int, parent: str) -> None:
        try:
            entries = await self.meta.listdir(parent, MAX_LISTED_NAMES)
        except OSError as exc:
            if exc.errno == errno.E2BIG:
                if len(self._too_large) >= MAX_LARGE_DIRECTORIES:
                    self._too_large.clear()
                self._too_large.add(parent)
            return  # the lookups go on as before; not tried again before its time
        except FsError:
            return
        for start in range(0, len(entries), LISTED_NAMES_PER_STEP):
            if self.inodes.current(parent) != parent_inode:
                return  # the directory's inode was forgotten meanwhile: nobody looks up in it
            for name, attr in entries[start:start + LISTED_NAMES_PER_STEP]:
                path = child_path(parent, name)
                # As readdir: never an older version than the path's current inode serves.
                self._listed_here(parent_inode, name, path, self.meta.peek(path) or attr)
            await trio.lowlevel.checkpoint()

    def _listed_here(self, parent_inode: int, name: str, path: str, attr: Attr) -> None:
        """A listed name published to the borrower (:meth:`entry`), with its held block for
        a file of one block, the kernel holding no lookup of it: the publication's pin
        keeps the inode until its deadline, and the borrower's answers count the kernel's
        lookups.  A larger file's blocks are lent at its first READ (one key per block to
        compute: a step of 64 shards of 4,096 blocks would hold the trio thread for a
        quarter of a million)."""
        entry = self.entry(parent_inode, name, path, attr)
        self.forget(entry.inode, 1)
        if attr.is_file and attr.size <= self.block_size:
            self.publish(entry.inode)

    def _looked_up_here(self, parent_inode: int, name: str, path: str, attr: Attr) -> Entry:
        """The entry of a lookup answered here, published to the borrower for as long as
        it is valid, so that the kernel's next lookups of the name (after it dropped its
        own entry: memory pressure, a drop of caches) are answered without Python."""
        entry = self._entry(path, attr)
        self._publish_entry(parent_inode, name, entry)
        return entry

    def _publish_entry(self, parent_inode: int, name: str, entry: Entry) -> None:
        if self.borrower is not None and 0 < entry.valid_for < math.inf and name not in (".", ".."):
            expires = self.clock_ns() + int(entry.valid_for * 1e9)
            self.inodes.pin(entry.inode)
            heapq.heappush(self._entry_deadlines, (expires, parent_inode, name, entry.inode))
            self.borrower.publish_entry(parent_inode, name, entry.inode, entry.attr, expires)

    def looked_up(self, inode: int) -> None:
        """The borrower answered a lookup from a published entry of ``inode``."""
        self.inodes.looked_up(inode)
        self._c.lookups += 1
        self._c.native_lookups += 1

    def expire_entries(self) -> None:
        """Withdraw the published entries whose deadline has passed and let their inodes go:
        first the entries (no answer is made from them once that returns), then the reports
        of answers made before (each a lookup the inode must count), then the pins."""
        due = self._entry_deadlines
        now = self.clock_ns()
        if not due or due[0][0] > now:
            return
        expired = []
        while due and due[0][0] <= now:
            expires, parent, name, inode = heapq.heappop(due)
            if self.borrower is not None:
                self.borrower.withdraw_entry(parent, name, expires)
            expired.append(inode)
        if self.borrower is not None:
            self.borrower.report()
        for inode in expired:
            if self.inodes.unpin(inode):
                self._next_block.pop(inode, None)
                self._withdraw(inode)

    def _withdraw_entry(self, path: str) -> None:
        """The borrower stops answering lookups of ``path`` (its file changed), whichever
        deadline it was published with: the kernel's next lookup of it comes here.  The
        inode stays pinned until that publication's deadline passes."""
        parent, _, name = path.rpartition("/")
        parent_inode = self.inodes.current(parent)
        if parent_inode is not None and self.borrower is not None:
            self.borrower.withdraw_entry(parent_inode, name, ANY_DEADLINE)

    def _child(self, parent_inode: int, name: str) -> str:
        parent = self.inodes.node(parent_inode).path
        if name == ".":
            return parent
        if name == "..":
            return parent.rpartition("/")[0]
        return child_path(parent, name)

    async def _stat_fetching(self, path: str, op: str) -> tuple[Attr, bool]:
        """``path``'s attributes for the kernel (``op``: lookup, getattr), and whether they
        missed the metadata cache and brought no bytes.  Past the metadata cache's hit, a
        regular file of at most one block that no tier holds comes too
        (``FileBlocks.stat_bringing``): the open and read that usually follow are then
        served from RAM, and the process that waited counts the file as a miss, exactly as
        if its read had fetched it.  Where the source failed while down: the last validated
        attributes if stale-if-error allows them (fs/outage.py)."""
        attr = self.meta.hit(path)  # a warm lookup or getattr: no coroutine, no fetch slot
        if attr is not None:
            return attr, False
        try:
            if not self.lookup_fetch:
                return await self.meta.stat(path), True
            attr, brought = await self.blocks.stat_bringing(path)
            return attr, not brought
        except OSError as exc:
            stale = self.stale_if_error.attr(path, exc, op)
            if stale is None:
                raise
            return stale, True

    def _entry(self, path: str, attr: Attr) -> Entry:
        return Entry(self.inodes.remember(path, attr), attr, self._valid_for(path))

    def _valid_for(self, path: str) -> float:
        """How long the kernel may keep ``path``'s entry and attributes: as long as the
        metadata cache trusts them, no longer, so the name is looked up again (and a file
        changed since found, a new inode) at most ``attrValid`` after the source said what
        it did.  0 for answers the cache does not trust (stale-if-error's, or with
        ``attrValid`` 0)."""
        return max(0.0, self.meta.trusted_until(path) - trio.current_time())

    def forget(self, inode: int, n: int) -> None:
        if self.inodes.forget(inode, n):
            self._next_block.pop(inode, None)
            self._withdraw(inode)

    async def getattr(self, inode: int) -> Entry:
        """The inode's attributes: its path's current ones, or, for an inode whose file has
        changed since (retired), those of its own version.  The kernel must not see the new
        size or mtime on an old version's inode: it would cut or extend the old handles'
        reads, or drop their pages and refill them from another version."""
        node = self.inodes.node(inode)
        if not node.retired:
            attr, _ = await self._stat_fetching(node.path, "getattr")
            if self.inodes.serves(inode, attr):
                return Entry(inode, attr, self._valid_for(node.path))
        return self._own_version(inode)

    def getattr_now(self, inode: int) -> Entry | None:
        """:meth:`getattr` when it needs no wait (a retired inode, or the metadata cache
        answers); None when it would wait."""
        node = self.inodes.node(inode)
        if not node.retired:
            attr = self.meta.hit(node.path)
            if attr is None:
                return None
            if self.inodes.serves(inode, attr):
                return Entry(inode, attr, self._valid_for(node.path))
        return self._own_version(inode)

    def _own_version(self, inode: int) -> Entry:
        """A retired inode's entry: the attributes of its own version, which never change."""
        attr = self.inodes.node(inode).attr
        assert attr is not None  # a retired inode always has the attributes it served
        return Entry(inode, attr, math.inf)

    async def readlink(self, inode: int) -> str:
        path = self.inodes.node(inode).path
        attr = await self.meta.stat(path)
        if not attr.is_symlink:
            raise FsError(errno.EINVAL)
        return await self.backend.readlink(path)

    async def statfs(self) -> FsStats:
        return await self.backend.statfs()

    # -- directories -----------------------------------------------------------------

    async def opendir(self, inode: int) -> int:
        path = self.inodes.node(inode).path
        try:
            listing = await self.meta.listdir(path)
        except OSError as exc:
            stale = self.stale_if_error.listing(path, exc)
            if stale is None:
                raise
            listing = stale
        entries = sorted(listing)
        fh = next(self._handles)
        self._dirs[fh] = (path, entries)
        return fh

    def readdir(self, fh: int, start: int) -> Iterator[tuple[int, str, str, Attr]]:
        """(next offset, name, path, attributes) from offset ``start`` on, lazily."""
        try:
            path, entries = self._dirs[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None
        for i in range(start, len(entries)):
            name, attr = entries[i]
            child = child_path(path, name)
            # A listing may be older than the child's attributes (a stat since): never hand
            # the kernel an older version than the path's current inode serves.
            yield i + 1, name, child, self.meta.peek(child) or attr

    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files -----------------------------------------------------------------------

    def _request(self, inode: int) -> FileRequest:
        file = self._files.get(inode)
        if file is None:
            node = self.inodes.node(inode)
            attr = node.attr
            if attr is None or not attr.is_file:
                raise FsError(errno.EISDIR if attr is not None and attr.is_dir else errno.EINVAL)
            version = attr.version
            n = self.blocks.count(version.size)
            keys = tuple(block_key(node.path, version, i) for i in range(n)) if n <= MAX_LENT_BLOCKS else ()
            file = self._files[inode] = _FileOf(node.path, version, path_tag(node.path), keys)
        return FileRequest(inode, file.path, file.version, tag=file.tag, keys=file.keys)

    def _answered(self, f: FileRequest) -> None:
        """A file request (a READ at offset 0) was answered: counted, and shown to the observer."""
        c = self._c
        c.file_requests += 1
        if f.waited:
            c.file_misses += 1
            c.stall_seconds += f.stall
        if self.observer is not None:
            self.observer.released(f)

    async def _observed(self, f: FileRequest, pid: int, done: trio.Event) -> None:
        assert self.observer is not None
        try:
            f.owner = await self.observer.opened(pid, f.path)
            self._answered(f)
        finally:
            self._observing.discard(done)
            done.set()

    # -- a handover (control/handover.py) -------------------------------------------------------

    def export(self) -> dict[str, Any]:
        """What the next daemon needs to answer the kernel as this one would, as data the
        handover sends (JSON values, and bytes): the inode table and the open directory
        handles.  Called once the session is
        paused and idle (every request answered, every report taken).  Caches are not in
        it: the NVMe tier's index and the metadata cache's entries are found again."""
        dirs = [[fh, path, [[name, attr_fields(attr)] for name, attr in entries]]
                for fh, (path, entries) in self._dirs.items()]
        return {"inodes": self.inodes.export(), "dirs": dirs, "next_handle": next(self._handles)}

    def restore(self, state: dict[str, Any]) -> None:
        """Take over what :meth:`export` gave (ValueError if it is not that), before the
        session that adopted the connection serves its first request."""
        try:
            inodes = InodeTable.restore(state["inodes"])
            dirs = {int(fh): (str(path), [(str(name), Attr(*map(int, fields_))) for name, fields_ in entries])
                    for fh, path, entries in state["dirs"]}
            handles = count(int(state["next_handle"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a filesystem state: {exc!r}") from None
        self.inodes, self._dirs, self._handles = inodes, dirs, handles

    def recover(self, replayed: Replayed) -> None:
        """Take the inode table a dead daemon's journal describes (fs/journal.py), before the
        session that adopted its connection serves.  Its directory handles died with it: a
        READDIR of one is answered EBADF (the reader opens the directory again).  New handles
        start at the clock's nanoseconds, above every number the dead daemon gave (it gave
        fewer handles than nanoseconds passed since it started), so that an old handle never
        names a new listing."""
        self.inodes = InodeTable.recovered(replayed)
        self._handles = count(time.monotonic_ns())

    # -- publications ----------------------------------------------------------------

    async def settle(self) -> None:
        """Take in the reads the borrower served and has not reported yet, and wait until
        each is counted (a read by a process not seen before is counted once its owner is
        resolved): before a decision that must see every read so far (a new plan replacing
        a loader's last, whose cursor and consumed files they move) and before counters are
        shown (a status read after a read counts it).  Reads served after the call are not
        waited for, so a steady stream of new readers cannot hold it."""
        for reporter in self._reporters:
            await reporter()
        if self.borrower is not None:
            self.borrower.report()
        for done in list(self._observing):
            await done.wait()

    def settle_reports_of(self, reporter: Callable[[], Awaitable[None]]) -> None:
        """:meth:`settle` also awaits ``reporter()``: another server of reads taking in the
        reports already sent to it (the fast path's releases, control/dataplane.py)."""
        self._reporters.append(reporter)

    def lend_to(self, borrower: Borrower) -> None:
        """From now on, publish inodes to ``borrower`` and take back what stops being good:
        a block that leaves the RAM tier, everything when the kernel forgets the inode."""
        self.borrower = borrower
        self.cache.memory.on_recall = self._recall

    def publish(self, inode: int) -> bool:
        """Lend the borrower the held blocks of the version ``inode`` serves (RAM blocks as
        their bytes; for a file of one block, its NVMe entry's place).  An inode published
        with every block lent is left as it is (a listing or lookup of a published file
        costs no new publication); one with blocks missing is published again with what
        is held now.  False if nothing is published: no borrower, not a regular file, or
        no block held (a publication of nothing would serve no READ: a listing of a cold
        dataset publishes nothing, and the first READ of a file lends what it brings)."""
        borrower = self.borrower
        if borrower is None:
            return False
        try:
            node = self.inodes.node(inode)
        except FsError:  # forgotten meanwhile
            return False
        attr = node.attr  # the version this inode serves, current or retired
        if attr is None or not attr.is_file:
            return False
        if inode in self._published and inode not in self._incomplete:
            return True
        size = attr.version.size
        n = self.blocks.count(size)
        blocks: list[LentBlock] = []
        loans: dict[int, bytes] = {}
        if 0 < n <= MAX_LENT_BLOCKS:
            for index in range(n):
                key = block_key(node.path, attr.version, index)
                data = self.cache.lend(key)
                if data is not None:
                    loans[index] = key
                    blocks.append(data)
                    continue
                blocks.append(self._disk_place(key))
        if all(block is None for block in blocks):
            self._withdraw(inode)  # what an earlier publication lent has left the cache
            return False
        borrower.publish(inode, size, self.block_size, blocks)
        self._give_back_all(inode)  # what the earlier publication lent: unused now
        self._published.add(inode)
        if None in blocks:
            self._incomplete.add(inode)
        else:
            self._incomplete.discard(inode)
        if loans:
            self._loans[inode] = loans
            for index, key in loans.items():
                self._lenders.setdefault(key, []).append((inode, index))
        return True

    def _disk_place(self, key: bytes) -> LentBlock:
        """A block's NVMe entry, lent by its place (None if it has none).  The borrower
        reads and checks an entry whole, so it serves from one only a READ of the whole
        block, or of any part of a one-block file; a READ of part of a larger file's block
        comes here, and the read path brings that block into RAM (lent then)."""
        place = self.cache.locate_on_disk(key)
        return (os.fsencode(place[0]), place[1], place[2], key) if place else None

    def _lend_read(self, inode: int, first: int, last: int) -> None:
        """After a READ served here: lend the blocks it read that are held now, so the
        borrower serves the next READ of them (the inode is published if it is not)."""
        if inode not in self._published:
            self.publish(inode)
            return
        if inode not in self._incomplete or self.borrower is None:
            return
        f = self._request(inode)
        n = self.blocks.count(f.version.size)
        if n > MAX_LENT_BLOCKS:
            return
        loans = self._loans.setdefault(inode, {})
        for index in range(first, min(last, n - 1) + 1):
            if index in loans:
                continue
            key = block_key(f.path, f.version, index)
            data = self.cache.lend(key)
            block: LentBlock = data if data is not None else self._disk_place(key)
            if block is None:
                continue
            if not self.borrower.lend(inode, index, block):
                if data is not None:
                    self.cache.give_back(key)
                continue
            if data is not None:
                loans[index] = key
                self._lenders.setdefault(key, []).append((inode, index))
        if not loans:
            del self._loans[inode]
        if len(loans) == n:
            self._incomplete.discard(inode)

    def _give_back_all(self, inode: int) -> None:
        for index, key in self._loans.pop(inode, {}).items():
            self._forget_loan(key, inode, index)
            self.cache.give_back(key)

    def _forget_loan(self, key: bytes, inode: int, index: int) -> None:
        lenders = self._lenders.get(key)
        if lenders is not None:
            lenders.remove((inode, index))
            if not lenders:
                del self._lenders[key]

    def _withdraw(self, inode: int) -> None:
        """Nothing of ``inode`` is served by the borrower any more (it is freed)."""
        self._files.pop(inode, None)
        self._incomplete.discard(inode)
        if inode in self._published:
            self._published.discard(inode)
            if self.borrower is not None:
                self.borrower.withdraw(inode)
        self._give_back_all(inode)

    def _recall(self, key: bytes) -> None:
        """A lent RAM block left the tier: each inode lending it gets what is held now in
        its place (its NVMe entry, where the block was written) or nothing,
        and the block is given back (the borrower no longer uses it)."""
        for inode, index in self._lenders.pop(key, []):
            loans = self._loans.get(inode)
            if loans is None or loans.pop(index, None) is None:
                continue
            if not loans:
                del self._loans[inode]
            place = self._disk_place(key)
            if self.borrower is not None:
                self.borrower.lend(inode, index, place)
            if place is None:
                self._incomplete.add(inode)
            self.cache.give_back(key)

    def served(self, inode: int, pid: int, offset: int, first: int, ram_bytes: int, ram_mask: int,
               disk_bytes: int, disk_mask: int) -> Coroutine[Any, Any, None] | None:
        """A READ the borrower served from lent blocks: ``offset`` where it started, the
        bytes and a mask of the blocks read (bit i: block ``first`` + i) from RAM and from
        NVMe.  Counted as :meth:`read` counts one; returns what is left to do (the
        observer's part of a file request, which may wait), to run in a task; None if
        nothing is."""
        try:
            f = self._request(inode)
        except FsError:  # forgotten since (a report is taken after the FORGET that follows it)
            return None
        c = self._c
        c.reads += 1
        c.native_reads += 1
        c.read_bytes += ram_bytes + disk_bytes
        last = first
        for source, nbytes, mask in ((Source.RAM, ram_bytes, ram_mask), (Source.DISK, disk_bytes, disk_mask)):
            if not mask:
                continue
            last = max(last, first + mask.bit_length() - 1)
            # What each block counts as (a RAM block brought by admit counts as the read
            # that brought it); the bytes are shared out over the blocks read.
            # A lent file has at most MAX_LENT_BLOCKS blocks, so _request knows its keys.
            counted = [self.cache.served(f.keys[first + i], source, f.tag)
                       for i in range(mask.bit_length()) if mask >> i & 1]
            n = len(counted)
            for i, (actual, stall) in enumerate(counted):
                c.blocks_by_source[actual.value] += 1
                c.bytes_by_source[actual.value] += nbytes // n + (i < nbytes % n)
                if actual is Source.BACKEND:
                    f.waited = True
                    f.stall += stall
        self._readahead(f, first, last, from_nvme=False)
        if offset != 0:
            return None
        if self.observer is None:
            self._answered(f)
            return None
        owner = self.observer.opened_now(pid, f.path)
        if owner is OWNER_UNKNOWN:
            done = trio.Event()
            self._observing.add(done)
            return self._observed(f, pid, done)
        f.owner = owner
        self._answered(f)
        return None

    async def read(self, inode: int, fh: int, offset: int, size: int, pid: int = 0) -> bytes | memoryview:
        """``size`` bytes at ``offset`` of the version ``inode`` serves (``fh`` is unused:
        reads are by inode).  A READ at offset 0 is a file request (FileRequest)."""
        f = self._request(inode)
        end = min(offset + size, f.version.size)
        self._c.reads += 1
        request = offset == 0
        if request and self.observer is not None:
            f.owner = await self.observer.opened(pid, f.path)
        try:
            if offset >= end:
                return b""
            bs = self.block_size
            first, last = offset // bs, (end - 1) // bs
            try:
                if first == last:
                    block = await self._block(f, first, end - offset)
                    result: bytes | memoryview = block if (offset - first * bs, end - first * bs) == (0, len(block)) else memoryview(block)[offset - first * bs : end - first * bs]
                else:
                    # Start every block's fetch, then collect them in order: each get() joins
                    # (and promotes to foreground) the flight its prefetch started.
                    for index in range(first + 1, last + 1):
                        self.cache.prefetch(block_key(f.path, f.version, index), self.blocks.fetcher(f.path, f.version, index))
                    parts = []
                    for index in range(first, last + 1):
                        served = min(end, (index + 1) * bs) - max(offset, index * bs)
                        parts.append(await self._block(f, index, served))
                    joined = b"".join(parts)
                    result = memoryview(joined)[offset - first * bs : end - first * bs]
            except StaleVersion:
                self._c.stale_reads += 1
                self.meta.invalidate(f.path)  # the next lookup sees the new version
                self._withdraw_entry(f.path)
                raise
            self._readahead(f, first, last)
            self._lend_read(inode, first, last)
            self._c.read_bytes += len(result)
            return result
        finally:
            if request:
                self._answered(f)

    async def _block(self, f: FileRequest, index: int, served: int) -> bytes:
        """Block ``index`` of the file; ``served`` of its bytes go to the reader."""
        start = time.perf_counter()
        data, source, earlier = await self.cache.read(block_key(f.path, f.version, index),
                                                      self.blocks.fetcher(f.path, f.version, index), tag=f.tag)
        if source is Source.BACKEND:
            f.waited = True
            f.stall += time.perf_counter() - start + earlier
        self._c.blocks_by_source[source.value] += 1
        self._c.bytes_by_source[source.value] += served
        return data

    def _readahead(self, f: FileRequest, first: int, last: int, from_nvme: bool = True) -> None:
        """After a sequential READ, fetch the next READAHEAD_BLOCKS blocks.  ``from_nvme``
        False (a READ the borrower served): a block on NVMe is left there, where the
        borrower serves READs of whole blocks (the next READs are its too, most likely);
        a READ of part of it brings it here."""
        expected = self._next_block.get(f.inode, 0)
        sequential = first == expected or first == expected - 1
        self._next_block[f.inode] = last + 1
        if not sequential:
            return
        self.blocks.prefetch_range(f.path, f.version, last + 1, last + 1 + READAHEAD_BLOCKS, from_nvme=from_nvme)

    def statistics(self) -> FilesystemStatistics:
        c, i = self._c, self.inodes.statistics()
        return FilesystemStatistics(c.lookups, c.native_lookups, len(self._dirs), c.reads, c.read_bytes, c.native_reads,
                                    dict(c.blocks_by_source), dict(c.bytes_by_source), c.stale_reads,
                                    i.inodes, i.retired, i.changes,
                                    c.file_requests, c.file_misses, c.stall_seconds,
                                    self.stale_if_error.statistics().served)
