"""The filesystem core without FUSE: names, handles, reads assembled from cached blocks,
testable without a kernel (``fs.session`` only translates). The volume is read-only, so
every write fails with EROFS, and failures are raised as exceptions for ``errors.errno_of``
to map. A borrower (the FUSE session in C) may answer opens and reads of inodes the core
publishes to it: the core vouches for an inode's version while its metadata is trusted and
lends the cached blocks of that version, and withdraws both when either stops being true."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Protocol

import trio

from cubefs_fuse.attrs import Attr, FileVersion, FsStats
from cubefs_fuse.backends.base import Backend
from cubefs_fuse.cache.blockcache import BlockCache, Source
from cubefs_fuse.cache.keys import block_key, path_tag
from cubefs_fuse.errors import FsError, StaleVersion
from cubefs_fuse.fs.blocks import FileBlocks
from cubefs_fuse.fs.inodes import InodeTable, child_path
from cubefs_fuse.fs.metadata import MetadataCache
from cubefs_fuse.fs.outage import Outage, StaleIfError

# Blocks fetched ahead of a sequential reader of a large file.  Two keep one block in
# flight while the reader consumes the next, which hides one remote round trip per
# block without spending the cache on blocks a random reader never asks for.
READAHEAD_BLOCKS = 2
# The largest file (in blocks) whose blocks are lent to the borrower: it reports which
# blocks it served as 64-bit masks.  Larger files are read in large requests, where the
# per-request cost the borrower saves matters least.
MAX_LENT_BLOCKS = 64
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


@dataclass(frozen=True, slots=True)
class Entry:
    inode: int
    attr: Attr


@dataclass(slots=True)
class OpenFile:
    inode: int
    path: str
    version: FileVersion
    next_block: int = 0  # the block a sequential reader asks for next
    tag: int = 0  # path_tag(path)
    owner: object = None  # the observer's context for the opening process
    waited: bool = False  # a read of this handle waited on the backend
    stall: float = 0.0  # seconds reads of this handle waited on the backend
    read_here: bool = False  # a READ of this handle was served here, not by the borrower
    observed: bool = True  # the observer has seen the open (False while its owner is looked up)
    released: bool = False  # released before the observer saw the open


# An NVMe entry lent by its place: (segment path, offset, allocated bytes, block key).
DiskBlock = tuple[bytes, int, int, bytes]
# A lent block: a RAM block's bytes, an NVMe entry's place, or None where it is not held.
LentBlock = bytes | DiskBlock | None


class Borrower(Protocol):
    """A reader that answers opens and reads of published inodes itself (the FUSE session
    in C, fs/_session.c) and reports them afterwards (``open_served``, ``release``).
    ``publish`` and ``withdraw`` return the id of an earlier publication freed by the call
    (no handle reads it any more), or 0; the others are reported freed later (``freed``).
    ``report`` hands over, now, what it answered and has not reported yet."""

    def publish(self, inode: int, id: int, valid_for: float, keep_cache: bool, direct_io: bool, size: int,
                block_size: int, blocks: Sequence[LentBlock], /) -> int: ...

    def withdraw(self, inode: int, /) -> int: ...

    def invalidate_all(self) -> None: ...

    def report(self) -> None: ...


# What AccessObserver.opened_now answers when the opener's owner cannot be known without
# waiting: then opened() is called.
OWNER_UNKNOWN = object()


class AccessObserver(Protocol):
    """Sees every application open and release (hit accounting, plan cursors)."""

    async def opened(self, pid: int, path: str) -> object: ...

    def opened_now(self, pid: int, path: str) -> object:
        """As :meth:`opened` when that needs no wait; else OWNER_UNKNOWN (nothing seen)."""
        ...

    def released(self, f: OpenFile) -> None: ...


@dataclass(frozen=True, slots=True)
class FilesystemStatistics:
    lookups: int
    opens: int
    native_opens: int  # of those, answered by the borrower from a publication (counted when reported)
    open_files: int
    open_dirs: int
    reads: int
    read_bytes: int
    native_reads: int  # of those, served by the FUSE session from lent blocks (counted at release)
    blocks_by_source: dict[str, int]  # block lookups by the tier that answered
    bytes_by_source: dict[str, int]  # bytes returned to applications by that tier
    stale_reads: int
    stale_opens: int  # opens of a retired inode (its file changed): ESTALE, the kernel looks up again
    inodes: int
    retired_inodes: int  # inodes of old versions the kernel still holds
    version_changes_with_handles: int  # files found changed with handles open on the old version
    version_changes_without_handles: int  # ... with the old version's inode held, no handle open
    file_requests: int  # opens of regular files, counted at release
    file_misses: int  # of those, the ones with a read that waited on the backend
    stall_seconds: float
    stale_if_error: dict[str, int] = field(default_factory=dict)  # op -> answered stale while the source was down


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    opens: int = 0
    native_opens: int = 0
    reads: int = 0
    read_bytes: int = 0
    native_reads: int = 0
    stale_reads: int = 0
    stale_opens: int = 0
    file_requests: int = 0
    file_misses: int = 0
    stall_seconds: float = 0.0
    blocks_by_source: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in Source})
    bytes_by_source: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in Source})


class Filesystem:
    # The kernel may keep a file's pages across opens: an inode serves one version of a
    # file (a changed file gets a new inode, fs/inodes.py), so the pages it holds for an
    # inode are always good, and no invalidation notice is ever needed.
    keep_cache = True
    direct_io = False

    def __init__(self, meta: MetadataCache, cache: BlockCache, backend: Backend, *, block_size: int,
                 outage: Outage | None = None) -> None:
        """``outage``: while it says the source is down, answer from the last validated
        metadata what the cache holds whole (fs/outage.py); None: never (EIO)."""
        self.meta = meta
        self.cache = cache
        self.backend = backend
        self.block_size = block_size
        self.inodes = InodeTable()
        self.blocks = FileBlocks(meta, cache, backend, block_size)
        self.stale_if_error = StaleIfError(meta, self.blocks, outage)
        self._files: dict[int, OpenFile] = {}
        self._dirs: dict[int, tuple[str, list[tuple[str, Attr]]]] = {}
        self._handles = count(1)
        self._c = _Counters()
        self.observer: AccessObserver | None = None
        self.borrower: Borrower | None = None
        # inode -> (the id of its publication, when its attributes stop being trusted)
        self._published: dict[int, tuple[int, float]] = {}
        self._incomplete: set[int] = set()  # published inodes with a block not lent (not held then)
        # Publications that lend RAM blocks: id -> (inode, the keys lent), and each lent
        # key's publications, so that a block leaving the RAM tier withdraws them.
        self._loans: dict[int, tuple[int, list[bytes]]] = {}
        self._lenders: dict[bytes, list[int]] = {}
        self._publication_ids = count(1)
        # Lookups and getattrs that miss the metadata cache bring small files whole
        # (see _stat_fetching); off: they only stat, as operator tools do.
        self.lookup_fetch = True

    # -- names and attributes --------------------------------------------------------

    async def lookup(self, parent_inode: int, name: str) -> Entry:
        parent = self.inodes.node(parent_inode).path
        self._c.lookups += 1
        if name == ".":
            path = parent
        elif name == "..":
            path = parent.rpartition("/")[0]
        else:
            path = child_path(parent, name)
        attr = await self._stat_fetching(path, "lookup")
        return self.entry(path, attr)

    async def _or_stale(self, path: str, op: str, answer: Awaitable[Attr]) -> Attr:
        """``answer``, or where the source failed to give it while down, the last validated
        attributes if stale-if-error allows them (fs/outage.py)."""
        try:
            return await answer
        except OSError as exc:
            stale = self.stale_if_error.attr(path, exc, op)
            if stale is None:
                raise
            return stale

    async def _stat_fetching(self, path: str, op: str) -> Attr:
        """``path``'s attributes for the kernel (``op``: lookup, getattr)."""
        attr = self.meta.hit(path)  # a warm lookup or getattr: no coroutine, no fetch slot
        if attr is not None:
            return attr
        return await self._or_stale(path, op, self._stat_from_source(path))

    async def _stat_from_source(self, path: str) -> Attr:
        """``path``'s attributes past the metadata cache's hit.  A metadata miss on a
        regular file of at most one block that no tier holds brings the file too, in the
        same backend call (``Backend.stat_read``): the open and read that usually follow
        are then served from RAM.  The process that waited counts the file as a miss
        (``BlockCache.admit``), exactly as if its read had fetched it."""
        if not self.lookup_fetch or self.meta.peek(path) is not None:
            return await self.meta.stat(path)
        cache = self.cache
        # A fetch slot, as any fetch has (never waited for: without one it only stats).
        slot = cache.try_fetch_slot()
        if slot is None:
            return await self.meta.stat(path)

        on_disk: list[bytes] = []

        def want(attr: Attr) -> bool:
            # Runs in the backend's worker thread, between the stat and the source read:
            # a block on NVMe is read right here (same thread call), not from the source.
            key = block_key(path, attr.version, 0)
            local = cache.disk_block_in_thread(key)
            if local is not None:
                on_disk.append(local)
                return False
            return cache.wanted(key)

        start = time.perf_counter()
        try:
            attr, data = await self.meta.stat_read(path, self.block_size, want)
        finally:
            cache.release_fetch_slot(slot)
        if data is not None:
            cache.admit(block_key(path, attr.version, 0), data, tag=path_tag(path),
                        stall=time.perf_counter() - start)
        elif on_disk and len(on_disk[0]) == attr.size:
            cache.admit(block_key(path, attr.version, 0), on_disk[0], tag=path_tag(path), from_disk=True)
        return attr

    def entry(self, path: str, attr: Attr) -> Entry:
        """An entry handed to the kernel (raises the lookup count of the inode serving ``attr``:
        a new one if the path's file changed, see fs/inodes.py)."""
        return Entry(self.inodes.remember(path, attr), attr)

    def forget(self, inode: int, n: int) -> None:
        if self.inodes.forget(inode, n):
            self._withdraw(inode)

    async def getattr(self, inode: int) -> Entry:
        """The inode's attributes: its path's current ones, or, for an inode whose file has
        changed since (retired), those of its own version.  The kernel must not see the new
        size or mtime on an old version's inode: it would cut or extend the old handles'
        reads, or drop their pages and refill them from another version."""
        node = self.inodes.node(inode)
        if not node.retired:
            attr = await self._stat_fetching(node.path, "getattr")
            if self.inodes.serves(inode, attr):
                return Entry(inode, attr)
        assert node.attr is not None  # a retired inode always has the attributes it served
        return Entry(inode, node.attr)

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

    async def open(self, inode: int, flags: int, pid: int = 0) -> int:
        """A handle pinned to the version the inode serves.

        The kernel may always keep the inode's page cache: every handle of an inode reads
        one version (fs/inodes.py).  An inode whose file has changed at the source (found
        now or before) is not opened: ESTALE, on which the kernel repeats the path walk
        with a forced lookup (``LOOKUP_REVAL``), which answers the new version's inode."""
        if flags & _WRITE_FLAGS:
            raise FsError(errno.EROFS)
        node = self.inodes.node(inode)
        attr = None if node.retired else self.meta.hit(node.path) or await self._or_stale(
            node.path, "open", self.meta.stat(node.path))
        if attr is None or not self.inodes.serves(inode, attr):
            self._c.stale_opens += 1
            raise FsError(errno.ESTALE, f"{node.path} changed at the source")
        if attr.is_dir:
            raise FsError(errno.EISDIR)
        if not attr.is_file:
            raise FsError(errno.EINVAL, "only regular files can be opened")
        fh = next(self._handles)
        owner = await self.observer.opened(pid, node.path) if self.observer is not None else None
        self._files[fh] = OpenFile(inode, node.path, attr.version, tag=path_tag(node.path), owner=owner)
        self.inodes.opened(inode)
        self._c.opens += 1
        return fh

    def open_served(self, inode: int, fh: int, pid: int) -> Coroutine[Any, Any, None] | None:
        """An open the borrower answered itself from the inode's publication, with its own
        handle ``fh``: counted as :meth:`open` counts one.  Returns what is left to do (the
        observer's part, which may wait), to run in a task; None if nothing is."""
        node = self.inodes.node(inode)
        assert node.attr is not None  # published inodes are regular files with attributes
        f = OpenFile(inode, node.path, node.attr.version, tag=path_tag(node.path))
        self._files[fh] = f
        self.inodes.opened(inode)
        self._c.opens += 1
        self._c.native_opens += 1
        if self.observer is None:
            return None
        owner = self.observer.opened_now(pid, node.path)
        if owner is not OWNER_UNKNOWN:
            f.owner = owner
            return None
        f.observed = False
        return self._observe(f, pid)

    async def _observe(self, f: OpenFile, pid: int) -> None:
        assert self.observer is not None
        f.owner = await self.observer.opened(pid, f.path)
        f.observed = True
        if f.released:
            self.observer.released(f)

    # -- publications ----------------------------------------------------------------

    def settle(self) -> None:
        """Take in the opens and releases the borrower answered and has not reported yet:
        before a decision that must see every open so far (a new plan replacing a loader's
        last, whose cursor and consumed files they move)."""
        if self.borrower is not None:
            self.borrower.report()

    def lend_to(self, borrower: Borrower) -> None:
        """From now on, publish inodes to ``borrower`` and withdraw them when their version,
        their metadata or a lent block stops being good."""
        self.borrower = borrower
        self.cache.memory.on_recall = self._recall
        self.meta.on_forget = self._meta_forgotten
        self.inodes.on_retire = self._withdraw

    def publish(self, inode: int, *, again: bool = False) -> bool:
        """Vouch for ``inode`` to the borrower for as long as its path's attributes are
        trusted (``attrValid``), and lend the blocks of its version that are held: RAM
        blocks as their bytes, and for a file of one block its NVMe entry's place.  The
        borrower answers opens only of an inode with every block lent (or too large for
        any to be): the open of one that is not comes here and publishes it again.  An
        inode published whole until the same expiry is left as it is (a listing or lookup
        of a published file costs no new publication) unless ``again``.  False if it is not
        published (no borrower, not a current regular file, nothing trusted)."""
        borrower = self.borrower
        if borrower is None:
            return False
        try:
            node = self.inodes.node(inode)
        except FsError:  # forgotten meanwhile
            return False
        attr = self.meta.peek(node.path)
        until = self.meta.trusted_until(node.path)
        valid_for = until - trio.current_time()
        if attr is None or valid_for <= 0 or not attr.is_file or not self.inodes.serves(inode, attr):
            return False
        current = self._published.get(inode)
        if not again and current is not None and current[1] == until and inode not in self._incomplete:
            return True
        size = attr.version.size
        n = self.blocks.count(size)
        blocks: list[LentBlock] = []
        keys: list[bytes] = []
        if 0 < n <= MAX_LENT_BLOCKS:
            for index in range(n):
                key = block_key(node.path, attr.version, index)
                data = self.cache.lend(key)
                if data is not None:
                    keys.append(key)
                    blocks.append(data)
                    continue
                # NVMe entries only for one-block files: the reader checks a whole entry per
                # READ, which a file of many blocks would pay once per READ of each block.
                place = self.cache.locate_on_disk(key) if n == 1 else None
                blocks.append((os.fsencode(place[0]), place[1], place[2], key) if place else None)
        publication = next(self._publication_ids)
        self._published[inode] = (publication, until)
        if None in blocks:
            self._incomplete.add(inode)
        else:
            self._incomplete.discard(inode)
        if keys:
            self._loans[publication] = (inode, keys)
            for key in keys:
                self._lenders.setdefault(key, []).append(publication)
        freed = borrower.publish(inode, publication, valid_for, self.keep_cache, self.direct_io, size,
                                 self.block_size, blocks)
        if freed:
            self.freed(freed)
        return True

    def freed(self, publication: int) -> None:
        """The borrower let go of a publication: its lent blocks are given back."""
        loans = self._loans.pop(publication, None)
        if loans is None:
            return
        for key in loans[1]:
            self.cache.give_back(key)
            lenders = self._lenders.get(key)
            if lenders is not None:
                lenders.remove(publication)
                if not lenders:
                    del self._lenders[key]

    def _withdraw(self, inode: int) -> None:
        self._incomplete.discard(inode)
        if self._published.pop(inode, None) is not None and self.borrower is not None:
            freed = self.borrower.withdraw(inode)
            if freed:
                self.freed(freed)

    def _recall(self, key: bytes) -> None:
        """A lent RAM block left the tier: the publications lending it are replaced by what
        is held now (a one-block file's NVMe entry, where the block was written), or
        withdrawn, so no new handle reads the block and its bytes are given back once the
        open ones are released."""
        for publication in list(self._lenders.get(key, ())):
            loans = self._loans.get(publication)
            if loans is not None and self._published.get(loans[0], (0, 0.0))[0] == publication:
                if not self.publish(loans[0], again=True):
                    self._withdraw(loans[0])

    def _meta_forgotten(self, path: str | None) -> None:
        """The metadata cache stopped trusting ``path``'s attributes (None: everyone's)."""
        if path is None:
            if self.borrower is not None:
                self.borrower.invalidate_all()
            return
        inode = self.inodes.current(path)
        if inode is not None:
            self._withdraw(inode)

    def served(self, fh: int, reads: int, ram_bytes: int, ram_lookups: int, ram_mask: int,
               disk_bytes: int, disk_lookups: int, disk_mask: int) -> None:
        """What the reader of lent blocks served for ``fh``: ``reads`` requests; bytes and
        block lookups from RAM and from NVMe; masks of the blocks read (bit i: block i)."""
        f = self.open_file(fh)
        c = self._c
        c.reads += reads
        c.native_reads += reads
        c.read_bytes += ram_bytes + disk_bytes
        for source, nbytes, lookups, mask in ((Source.RAM, ram_bytes, ram_lookups, ram_mask),
                                              (Source.DISK, disk_bytes, disk_lookups, disk_mask)):
            # What each block counts as (a RAM block brought by admit counts as the read
            # that brought it); the bytes and lookups are shared out over the blocks read.
            counted = [self.cache.served(block_key(f.path, f.version, i), source, f.tag)
                       for i in range(mask.bit_length()) if mask >> i & 1]
            n = len(counted)
            for i, (actual, stall) in enumerate(counted):
                c.blocks_by_source[actual.value] += lookups // n + (i < lookups % n)
                c.bytes_by_source[actual.value] += nbytes // n + (i < nbytes % n)
                if actual is Source.BACKEND:
                    f.waited = True
                    f.stall += stall

    def release(self, fh: int) -> None:
        f = self._files.pop(fh, None)
        if f is None:
            return
        self.inodes.released(f.inode)
        if f.inode in self._published and (f.inode in self._incomplete or (
                f.read_here and self.blocks.count(f.version.size) <= MAX_LENT_BLOCKS)):
            # Its reads may have brought blocks the publication lacked, or found a lent NVMe
            # entry gone (the borrower's check failed): lend what is held now.
            self.publish(f.inode, again=True)
        self._c.file_requests += 1
        if f.waited:
            self._c.file_misses += 1
            self._c.stall_seconds += f.stall
        if self.observer is not None:
            if f.observed:
                self.observer.released(f)
            else:
                f.released = True  # _observe reports it once the owner is known

    def open_file(self, fh: int) -> OpenFile:
        try:
            return self._files[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        f = self.open_file(fh)
        end = min(offset + size, f.version.size)
        self._c.reads += 1
        f.read_here = True
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
            self.meta.invalidate(f.path)  # the next open sees the new version
            raise
        self._readahead(f, first, last)
        self._c.read_bytes += len(result)
        return result

    async def _block(self, f: OpenFile, index: int, served: int) -> bytes:
        """Block ``index`` of the open file; ``served`` of its bytes go to the reader."""
        start = time.perf_counter()
        data, source, earlier = await self.cache.read(block_key(f.path, f.version, index),
                                                      self.blocks.fetcher(f.path, f.version, index), tag=f.tag)
        if source is Source.BACKEND:
            f.waited = True
            f.stall += time.perf_counter() - start + earlier
        self._c.blocks_by_source[source.value] += 1
        self._c.bytes_by_source[source.value] += served
        return data

    def _readahead(self, f: OpenFile, first: int, last: int) -> None:
        sequential = first == f.next_block or first == f.next_block - 1
        f.next_block = last + 1
        if not sequential:
            return
        self.blocks.prefetch_range(f.path, f.version, last + 1, last + 1 + READAHEAD_BLOCKS)

    def statistics(self) -> FilesystemStatistics:
        c, i = self._c, self.inodes.statistics()
        return FilesystemStatistics(c.lookups, c.opens, c.native_opens, len(self._files), len(self._dirs), c.reads,
                                    c.read_bytes, c.native_reads, dict(c.blocks_by_source), dict(c.bytes_by_source),
                                    c.stale_reads, c.stale_opens, i.inodes, i.retired,
                                    i.changes_with_handles, i.changes_without_handles,
                                    c.file_requests, c.file_misses, c.stall_seconds,
                                    self.stale_if_error.statistics().served)
