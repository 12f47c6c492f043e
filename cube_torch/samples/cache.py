"""``SampleCache``: a value computed once per (name, key), kept in a sample store.
``get(key, compute)`` returns the stored value when the store has a valid entry, else
``compute()``, stored in the background; ``get_many`` does a batch in one store round trip.
An entry is a 16-byte header (magic ``CTSC``, format version, the validity tag of the
sample's source files) and the codec's encoding (docs/on-disk.md, "What a sample entry
holds"); another tag or version is a miss. It is never in training's way: a failing store is
logged once and bypassed for :data:`RETRY_AFTER` seconds, a corrupt entry is a miss, a value
is encoded and copied once (into the store's own buffer when it offers ``write_entry``)
after the batch's last compute, writes go through a bounded buffer
(:data:`MAX_PENDING_ENTRIES`, :data:`MAX_PENDING_BYTES`) drained by one thread per process
and flushed at exit within :data:`FLUSH_TIMEOUT`, and stores are opened lazily in each
process, never pickled."""

from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing.util
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence, Sized
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import xxhash

from cube_torch import shared
from cube_torch.client import once
from cube_torch.samples import codec
from cube_torch.samples.store import SampleStore, StoreError
from cube_torch.samples.stores import check_spec, open_store, preload
from cubefs_fuse.control.protocol import sample_cache_reference

log = logging.getLogger("cube_torch")

T = TypeVar("T")

MAGIC = b"CTSC"
# The entry format written: 2 since the codec stores a permuted dense array or tensor as its
# memory lies (its tags A and q).  Version-1 entries decode the same and are still read; a
# reader that knows version 1 only sees a version-2 entry as stale (computed again), never
# as corrupt.
FORMAT_VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})
HEADER = struct.Struct("<4sB3xQ")
NO_FILES_TAG = 0  # the tag of a value whose source files are not known
# After a store failure the cache computes without it for this long, then tries again (a
# restarted store is found again; a broken one costs one try per half minute).
RETRY_AFTER = 30.0
# The write buffer, per process: enough for a few batches of decoded images (a 224x224
# RGB image is 150 KB, as float32 600 KB) so the writer thread rides out a slow store
# for a moment, small enough to be no memory concern in each of N DataLoader workers.
MAX_PENDING_ENTRIES = 256
MAX_PENDING_BYTES = 64 << 20
# Entries handed to one put_many: a batch's worth, one pipelined round trip.
PUT_BATCH = 64
# At exit, what is pending is written for at most this long: torch gives a finishing
# worker 5 s (MP_STATUS_CHECK_INTERVAL) before terminating it.
FLUSH_TIMEOUT = 3.0
# A read waits this long for a store object it shares with the writer thread (a caller's
# SampleStore object) before computing the batch instead: a write in flight may take up to
# the store's own timeout, which the training step must not wait for.
SHARED_STORE_WAIT = 0.05
# The writer reads the answers to its last put (a store that reads them later, see
# redis_store.SetWriter) once it has had nothing more to put for this long: a server
# answers a batch of 32 150 KB SETs in ~3-4 ms (redis-server's CPU on the 2-core VM), so
# they are all there to read at once.  A flush (a DataLoader worker's exit) has them read
# at once: the exit flushes of a fill's workers measured 0.1-8.8 ms waiting this out,
# 0.1-0.6 ms without.
SETTLE_AFTER = 0.010
# The writer thread exits after this many idle seconds and starts again on demand.
WRITER_IDLE_EXIT = 30.0
def check_name(name: Any) -> str:
    """``name`` if the daemon takes it as a sample cache's name (control/protocol.py's rule,
    kept by every store, so a name works wherever the cache is moved); else one ValueError
    line that states the rule, raised where the cache is made, not at its first use."""
    try:
        sample_cache_reference(name)
    except ValueError as exc:
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:40] + "..."
        raise ValueError(f"{exc}, e.g. 'imagenet-train-decoded-224' (got {shown})") from None
    assert isinstance(name, str)
    return name


def validity_tag(files: Sequence[str]) -> int:
    """The tag of a sample reading ``files``, as they are now (OSError when one is missing)."""
    h = xxhash.xxh64()
    for path in files:
        st = os.stat(path)
        # Not st_ino: a FUSE mount's inode numbers live only while the kernel remembers the
        # inode (cubefs-fuse gives a path a new number after a forget), so they would
        # invalidate entries of unchanged files.  ctime catches a change that kept mtime.
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode("utf-8", "surrogateescape"))
    return int(h.intdigest()) or 1  # never NO_FILES_TAG


@dataclass(frozen=True)
class CacheStatistics:
    """This process's counters of one SampleCache."""

    hits: int  # values decoded from the store
    misses: int  # values computed (no entry, a stale or corrupt one, or no store)
    stale: int  # of the misses: entries whose validity tag no longer matched
    writes: int  # entries handed to the store
    dropped: int  # entries not written: buffer full, writes bypassed, not encodable
    failures: int  # store calls that failed
    bypassed: bool  # the store is being bypassed right now
    plans: int = 0  # epoch key orders sent to the store (SampleCache.plan)


class _Miss:
    pass


_MISS = _Miss()


class _State:
    """One process's side of a SampleCache: its store, writer thread and counters."""

    def __init__(self, cache: SampleCache) -> None:
        self.pid = os.getpid()
        self.name = cache.name
        self.spec = cache.store_spec
        self.max_entries, self.max_bytes = cache.max_pending_entries, cache.max_pending_bytes
        self.store: SampleStore | None = None  # the training thread's
        self.write_store: SampleStore | None = None  # the writer thread's: its own connection
        # One call at a time on a store object (the contract).  Opened from a URL (or None),
        # the reader and the writer each have their own object; a SampleStore object given by
        # the caller is shared, and then a read finding the writer in a call does not wait
        # for it (see SHARED_STORE_WAIT).
        self.shared = not (self.spec is None or isinstance(self.spec, str))
        self.lock = threading.Lock()
        self.write_lock = self.lock if self.shared else threading.Lock()
        self.read_retry_at = 0.0
        self.write_retry_at = 0.0
        self.counts = collections.Counter[str]()
        # Entries: bytes, or a store's slot (written into its buffer by write_entry).
        self.pending: collections.deque[tuple[int, Sized]] = collections.deque()
        self.pending_bytes = 0
        self.in_flight = 0
        self.prepared = False  # the writer started ahead of the first misses (prepare)
        self.unsettled = False  # the writer store's answers to its last put are not read yet
        self.flushing = 0  # flush calls waiting: the writer reads the answers at once (no SETTLE_AFTER)
        self.cond = threading.Condition()
        self.writer: threading.Thread | None = None
        _live.add(self)
        _flush_at_process_exit()

    # -- the store ---------------------------------------------------------------------------

    def open(self) -> SampleStore | None:
        if self.store is None:
            try:
                self.store = open_store(self.spec)
            except StoreError as exc:
                self.fail("open", exc, reads=True)
                return None
        return self.store

    def open_writer(self) -> SampleStore | None:
        if self.write_store is None:
            if self.shared:
                self.write_store = self.open()  # the caller's object itself (a plan may come before any read)
            else:
                try:
                    self.write_store = open_store(self.spec)
                except StoreError as exc:
                    self.fail("open", exc, reads=False)
        return self.write_store

    def fail(self, what: str, exc: BaseException, *, reads: bool) -> None:
        self.counts["failures"] += 1
        now = time.monotonic()
        self.write_retry_at = now + RETRY_AFTER
        if reads:
            self.read_retry_at = now + RETRY_AFTER
        if isinstance(exc, StoreError) and exc.said:
            return  # its cause was said once for the process tree (a missing volume, a daemon not running)
        kind = f"samples:{self.name}:store"  # one line per process and cache, whatever fails next
        if once(kind):
            log.warning("cube_torch: sample cache %r: the store failed (%s): %s (%s for %.0f s; logged once)",
                        self.name, what, exc, "computing samples without it" if reads else "not storing new samples",
                        RETRY_AFTER)

    def readable(self) -> SampleStore | None:
        if time.monotonic() < self.read_retry_at:
            return None
        return self.open()

    def writable(self) -> bool:
        return time.monotonic() >= self.write_retry_at

    # -- the writer --------------------------------------------------------------------------

    def write_entry(self, key: int, parts: list[codec.Part]) -> Sized | None:
        """The entry's parts copied into the writer store's own buffer (the daemon store's
        ring, the Redis stores' reused buffers), when it has one and room: a slot to offer
        for ``key``; else None.  Only a store this cache opened itself (a caller's object
        may be read meanwhile: its buffer is not ours)."""
        store = self.write_store  # made by the writer thread (see prepare): until then, bytes
        write_entry = getattr(store, "write_entry", None)
        if self.shared or not callable(write_entry) or not self.writable():
            return None
        slot: Sized | None = write_entry(parts, codec.size_of(parts), name=self.name, key=key)
        return slot

    def discard(self, entries: Iterable[Sized]) -> None:
        """Entries that will not be put: the slots among them are freed."""
        release = getattr(self.write_store, "release", None)
        if callable(release):
            for entry in entries:
                if not isinstance(entry, bytes):
                    release(entry)

    def offer(self, key: int, entry: Sized) -> None:
        with self.cond:
            if len(self.pending) >= self.max_entries or self.pending_bytes + len(entry) > self.max_bytes:
                self.counts["dropped"] += 1
                self.discard([entry])
                return
            self.pending.append((key, entry))
            self.pending_bytes += len(entry)

    def wake(self) -> None:
        """Have the writer put what is pending (a batch's entries at once: one round trip
        for the batch, not one per entry, and no thread switch per computed sample)."""
        with self.cond:
            if not self.pending:
                return
            self._start_writer()
            self.cond.notify()

    def prepare(self) -> None:
        """Start the writer before a batch's misses are computed, once per process: it opens
        its store and connects (``prepare``, where the store has it) in the background, so
        that the first batch's entries already go into the store's own buffer instead of
        fresh bytes.  Measured in a fresh worker process, per worker: the first batch cost
        ~9 ms of CPU and ~1,850 page faults against ~2.5 ms for later ones, a second batch
        of fresh buffers ~1,200 more."""
        if self.prepared or self.shared or not self.writable():
            return
        self.prepared = True
        with self.cond:
            self._start_writer()

    def _start_writer(self) -> None:  # (under cond)
        if self.writer is None or not self.writer.is_alive():
            self.writer = threading.Thread(target=self.write_loop, name="cube_torch-samples", daemon=True)
            self.writer.start()

    def _prepare_store(self) -> None:
        """The writer thread's start: its store opened and, where it can, connected."""
        if self.shared or not self.writable():
            return
        store = self.open_writer()
        prepare = getattr(store, "prepare", None)
        if not callable(prepare):
            return
        try:
            with self.write_lock:
                prepare()
        except StoreError as exc:
            self.fail("open", exc, reads=False)

    def write_loop(self) -> None:
        self._prepare_store()
        while True:
            with self.cond:
                if not self.pending and self.unsettled:  # the last put's answers: read in a moment
                    self.cond.wait_for(lambda: bool(self.pending) or self.flushing > 0, SETTLE_AFTER)
                settle = not self.pending and self.unsettled
                if not settle:
                    if not self.pending and not self.cond.wait_for(lambda: bool(self.pending), WRITER_IDLE_EXIT):
                        self.writer = None
                        return
                    batch = [self.pending.popleft() for _ in range(min(PUT_BATCH, len(self.pending)))]
                    size = sum(len(entry) for _, entry in batch)
                    self.pending_bytes -= size
                    self.in_flight += 1
            if settle:
                self.settle()
                continue
            try:
                self.write(batch)
            except Exception as exc:  # never let the thread die on a surprise
                self.fail("write", exc, reads=False)
            finally:
                with self.cond:
                    self.in_flight -= 1
                    self.unsettled = callable(getattr(self.write_store, "settle", None))
                    self.cond.notify_all()

    def settle(self) -> None:
        """The writer store's answers to its last put read (a store that reads them later:
        the Redis store's SetWriter); an error answer is the store's failure."""
        try:
            settle = getattr(self.write_store, "settle", None)
            if callable(settle):
                with self.write_lock:
                    settle()
        except Exception as exc:  # a StoreError, or a surprise: never let the thread die on it
            self.fail("write", exc, reads=False)
        finally:
            with self.cond:
                self.unsettled = False
                self.cond.notify_all()

    def write(self, batch: list[tuple[int, Sized]]) -> None:
        if not self.writable():
            self.counts["dropped"] += len(batch)
            self.discard(entry for _, entry in batch)
            return
        store = self.open_writer()
        if store is None:
            self.counts["dropped"] += len(batch)
            return
        try:
            with self.write_lock:  # (slots are the store's own: its put_many takes them, and frees them)
                store.put_many(self.name, cast(list[tuple[int, bytes]], batch))
            self.counts["writes"] += len(batch)
        except StoreError as exc:
            self.counts["dropped"] += len(batch)
            self.fail("write", exc, reads=False)

    def flush(self, timeout: float) -> bool:
        """Wait until every pending entry is written (or dropped); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.flushing += 1
            self.cond.notify_all()  # a writer waiting out SETTLE_AFTER settles now
            try:
                while self.pending or self.in_flight or self.unsettled:
                    left = deadline - time.monotonic()
                    if left <= 0 or self.writer is None or not self.writer.is_alive():
                        return not self.pending and not self.in_flight and not self.unsettled
                    self.cond.wait(min(left, 0.1))
            finally:
                self.flushing -= 1
        return True

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self.write_lock:
            writer, self.write_store = self.write_store, None
        with self.lock:
            store, self.store = self.store, None
        for each in {id(s): s for s in (store, writer) if s is not None}.values():
            try:
                each.close()
            except Exception as exc:
                log.debug("cube_torch: sample cache %r: closing the store: %r", self.name, exc)


_live: weakref.WeakSet[_State] = weakref.WeakSet()


def _flush_all_at_exit() -> None:
    """Write what every cache of this process has pending, within FLUSH_TIMEOUT in all."""
    deadline = time.monotonic() + FLUSH_TIMEOUT
    for state in list(_live):
        if state.pid == os.getpid():
            state.flush(max(0.0, deadline - time.monotonic()))


atexit.register(_flush_all_at_exit)
_finalizer_pid = 0


def _flush_at_process_exit() -> None:
    """DataLoader workers leave through multiprocessing, which runs its finalizers, not
    atexit; a forked child starts with none (Process._bootstrap clears the registry), so
    each process registers its own, when its first cache state is made."""
    global _finalizer_pid
    if _finalizer_pid != os.getpid():
        _finalizer_pid = os.getpid()
        multiprocessing.util.Finalize(None, _flush_all_at_exit, exitpriority=100)


class SampleCache:
    """Values computed once per (name, key), kept in a sample store (see the module docstring).

    ``store``: None (the node's cubefs-fuse daemon), a ``redis://`` / ``rediss://`` /
    ``unix://`` URL, a ``redis+cluster://host:port[,host:port...]`` URL, or a
    :class:`~cube_torch.samples.store.SampleStore` object.
    """

    def __init__(self, name: str, store: str | SampleStore | None = None, *,
                 max_pending_entries: int = MAX_PENDING_ENTRIES, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.name = check_name(name)
        check_spec(store)
        preload(store)  # (here, before any DataLoader worker forks)
        self.store_spec = store
        self.max_pending_entries = max_pending_entries
        self.max_pending_bytes = max_pending_bytes
        self._state: _State | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = None  # no connection, thread or lock crosses a pickle
        return state

    def __repr__(self) -> str:
        return f"SampleCache({self.name!r}, store={self.store_spec!r})"

    def _here(self) -> _State:
        state = self._state
        if state is None or state.pid != os.getpid():  # a forked worker: its own store and writer
            state = self._state = _State(self)
        return state

    # -- reading -----------------------------------------------------------------------------

    def get(self, key: int, compute: Callable[[], T], files: Sequence[str] | None = None) -> T:
        """The value of ``key``: the store's when valid, else ``compute()`` (then stored)."""
        return self.get_many([key], lambda _key: compute(), None if files is None else lambda _key: files)[0]

    def get_many(self, keys: Sequence[int], compute_one: Callable[[int], T],
                 files: Callable[[int], Sequence[str]] | None = None,
                 scope: Callable[[list[int]], AbstractContextManager[Any]] | None = None) -> list[T]:
        """The values of ``keys``, in order: one store read for the batch, ``compute_one(key)``
        for each key without a valid entry (once per distinct key), run inside
        ``scope(those keys)`` when given.  ``files(key)``: the key's source files."""
        state = self._here()
        keys = [int(k) for k in keys]
        results: list[Any] = [_MISS] * len(keys)
        store = state.readable()
        tags: list[int | None] = self._tags(state, keys, files) if store is not None else [None] * len(keys)
        if store is not None:
            self._read(state, store, keys, tags, results)
        missing = [i for i, value in enumerate(results) if value is _MISS]
        if missing:
            state.prepare()
            self._compute(state, keys, tags, results, missing, compute_one, scope)
        return results

    def _tags(self, state: _State, keys: list[int], files: Callable[[int], Sequence[str]] | None) -> list[int | None]:
        if files is None:
            return [NO_FILES_TAG] * len(keys)
        tags: list[int | None] = []
        for key in keys:
            try:
                tags.append(validity_tag(files(key)))
            except OSError:
                tags.append(None)  # a source file is missing: compute (the dataset's error), store nothing
            except Exception as exc:  # the file mapping itself failed: the dataset's code decides
                if once(f"samples:{self.name}:files"):
                    log.warning("cube_torch: sample cache %r: could not tell the source files of sample %d: %r "
                                "(its entry is not checked against them; logged once)", self.name, key, exc)
                tags.append(NO_FILES_TAG)
        return tags

    def _read(self, state: _State, store: SampleStore, keys: list[int], tags: list[int | None],
              results: list[Any]) -> None:
        asked = [i for i, tag in enumerate(tags) if tag is not None]
        if not asked:
            return
        if not state.lock.acquire(timeout=SHARED_STORE_WAIT):  # a shared store busy writing: compute
            state.counts["busy"] += 1
            return
        try:
            try:  # entries may be views into the store's buffer: decoded before the next call
                entries = store.get_many(self.name, [keys[i] for i in asked])
                if len(entries) != len(asked):
                    raise StoreError(f"the store answered {len(entries)} entries for {len(asked)} keys")
                for i, entry in zip(asked, entries):
                    if entry is not None:
                        results[i] = self._decoded(state, entry, tags[i])
            finally:
                state.lock.release()
        except StoreError as exc:
            for i in asked:
                results[i] = _MISS
            state.fail("read", exc, reads=True)
            return
        hits = sum(1 for value in results if value is not _MISS)
        state.counts["hits"] += hits
        shared.add_sample_hits(hits)  # the job's hits the daemon never sees (the hit-rate line adds them)

    def _decoded(self, state: _State, entry: bytes | memoryview, tag: int | None) -> Any:
        view = memoryview(entry)
        if len(view) < HEADER.size:
            return self._corrupt(state, f"an entry of {len(view)} bytes")
        magic, version, stored_tag = HEADER.unpack(view[:HEADER.size])
        if magic != MAGIC:
            return self._corrupt(state, "an entry without the cache's magic")
        if version not in READABLE_VERSIONS or stored_tag != tag:
            state.counts["stale"] += 1
            return _MISS
        try:
            return codec.decode(view[HEADER.size:])
        except codec.CodecError as exc:
            return self._corrupt(state, str(exc))

    def _corrupt(self, state: _State, why: str) -> Any:
        if once(f"samples:{self.name}:corrupt"):
            log.warning("cube_torch: sample cache %r: a corrupt entry in the store (%s): computing it again and "
                        "overwriting it (logged once)", self.name, why)
        return _MISS

    # -- computing ---------------------------------------------------------------------------

    def _compute(self, state: _State, keys: list[int], tags: list[int | None], results: list[Any],
                 missing: list[int], compute_one: Callable[[int], Any],
                 scope: Callable[[list[int]], AbstractContextManager[Any]] | None) -> None:
        first: dict[int, int] = {}  # key -> its first position among the misses
        for i in missing:
            first.setdefault(keys[i], i)
        twice = {keys[i] for i in missing if first[keys[i]] != i}
        entries: dict[int, bytes | bytearray] = {}
        computed: list[tuple[int, int]] = []  # (key, its position), in computing order
        try:
            with scope(list(first)) if scope is not None else nullcontext():
                for key, i in first.items():
                    results[i] = compute_one(key)
                    state.counts["misses"] += 1
                    computed.append((key, i))
        finally:
            # The batch's values encoded after its computing, in one loop (those computed before
            # a failure too).  Encoding a sample between two decodes of the dataset cost 3-5x
            # the same code run back to back (measured: ~35 against ~8 us a sample; the decode
            # leaves the CPU's caches cold).  torch's fetcher holds a batch's samples until it
            # collates them as well, so each value is still the one its compute returned.
            for key, i in computed:
                entry = self._store(state, key, tags[i], results[i], keep=key in twice)
                if entry is not None:
                    entries[key] = entry
            state.wake()  # the batch's entries at once
        for i in missing:  # a key asked twice in one batch: a fresh copy, as a hit would give
            key = keys[i]
            if first[key] != i:
                entry = entries.get(key)
                results[i] = (codec.decode(memoryview(entry)[HEADER.size:]) if entry is not None
                              else compute_one(key))

    def _store(self, state: _State, key: int, tag: int | None, value: Any, *, keep: bool = False) -> bytes | bytearray | None:
        """Hand ``value``'s entry to the writer, copied once (see the module docstring); the
        entry's bytes when ``keep`` (a key asked twice in the batch decodes its copy from
        them), else None (also when the codec refuses the value)."""
        try:
            parts = codec.encode_parts(value, HEADER.pack(MAGIC, FORMAT_VERSION, NO_FILES_TAG if tag is None else tag))
        except codec.CodecError as exc:
            state.counts["dropped"] += 1
            if once(f"samples:{self.name}:encode:{type(value).__name__}"):
                log.warning("cube_torch: sample cache %r: %s: such samples are not cached (logged once)",
                            self.name, exc)
            return None
        if tag is None or state.store is None or not state.writable():
            if tag is not None:
                state.counts["dropped"] += 1
            return codec.join(parts) if keep else None
        slot = None if keep else state.write_entry(key, parts)
        if slot is not None:
            state.offer(key, slot)
            return None
        entry = codec.join(parts)
        state.offer(key, entry)
        return entry if keep else None

    # -- planning ----------------------------------------------------------------------------

    def plan(self, keys: Sequence[int] | np.ndarray) -> np.ndarray | None:
        """Tell the store the order in which ``keys`` will be read next (an epoch's), for its
        eviction; returns which of them the store holds an entry for (a bool per key) when
        the store says (the daemon's ``plan_held``), else None.  Called by cube_torch's
        background submitter thread at each epoch's start (never the training step); it goes
        through the writer's store object, under its lock, and is bounded by the store's own
        timeouts.  A failure is the store's failure: logged once, writes bypassed for a while."""
        state = self._here()
        if not state.writable():
            return None
        store = state.open_writer()
        if store is None:
            return None
        held: np.ndarray | None = None
        try:
            with state.write_lock:
                plan_held = getattr(store, "plan_held", None)
                if callable(plan_held):
                    held = plan_held(self.name, cast(Sequence[int], keys))
                else:
                    store.plan(self.name, cast(Sequence[int], keys))
            state.counts["plans"] += 1
        except StoreError as exc:
            state.fail("plan", exc, reads=False)
            return None
        if not isinstance(held, np.ndarray) or held.shape != (len(keys),):
            return None
        return held.astype(bool, copy=False)

    # -- the rest ----------------------------------------------------------------------------

    def statistics(self) -> CacheStatistics:
        state = self._here()
        c = state.counts
        return CacheStatistics(hits=c["hits"], misses=c["misses"], stale=c["stale"], writes=c["writes"],
                               dropped=c["dropped"], failures=c["failures"],
                               bypassed=time.monotonic() < state.read_retry_at, plans=c["plans"])

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> bool:
        """Wait until this process's pending writes are in the store (False after ``timeout`` s)."""
        return self._here().flush(timeout)

    def close(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Flush (bounded), then close this process's store; a later call opens it again."""
        state = self._state
        if state is not None and state.pid == os.getpid():
            state.close(timeout)

