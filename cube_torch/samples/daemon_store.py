"""The default sample store: the node's cubefs-fuse daemon, over its data socket.
``DaemonStore(volume)`` finds the daemon of ``volume`` (default ``$VOL_NAME``, which must
run with ``"profile": "ai_prefetch"``) through the per-volume config file, and moves entries
through the connection's shared-memory ring (cube_torch/fastpath.py's
:class:`~cube_torch.fastpath.Channel`; the ops are control/sampleplane.py's), one message
per batch of keys. Names are the caller's own; ``~UID/NAME`` reads a cache another user
shares, read-only. :meth:`DaemonStore.write_entry` encodes a computed sample straight into
the writer connection's ring and computes its checksum while the bytes are in this CPU's
cache, so the daemon never reads the payload; plans go through a connection of their own, as
the daemon answers at the ring's start. Connecting waits at most
:data:`~cube_torch.fastpath.CONNECT_TIMEOUT`, each answer
:data:`~cube_torch.fastpath.REPLY_TIMEOUT`, and any failure raises
:class:`~cube_torch.samples.store.StoreError` at once."""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from cube_torch.client import warn_if_daemon_down, warn_no_volume, warn_once_in_tree
from cube_torch.fastpath import CONNECT_TIMEOUT, REPLY_TIMEOUT, Channel
from cube_torch.samples.codec import Part, write_parts
from cube_torch.samples.store import StoreError
from cubefs_fuse.control.protocol import (MAX_SAMPLE_KEYS, MAX_SAMPLE_PLAN_KEYS, ProtocolError, entry_digest,
                                          read_volume_config)

# The daemon closes a data connection idle for 60 s (control/dataplane.py's IDLE_DEADLINE);
# one idle for half of that is replaced before use (a hello: well under a millisecond), so
# a validation pass or a checkpoint between two batches never turns into a StoreError.
REFRESH_AFTER = 30.0
# Slots start at page boundaries: the daemon writes a page-aligned entry from the ring to
# its NVMe tier without the page cache (O_DIRECT, cubefs_fuse/samples/files.py), ~10x less
# of its CPU than a copy into fresh page-cache memory.  A slot's rounding wastes < 4 KiB of
# the ring (3% of a 150 KB image).
SLOT_ALIGN = 4096


class RingSlot:
    """An entry written into a DaemonStore's ring (:meth:`DaemonStore.write_entry`), to be
    handed to its ``put_many`` in place of the entry's bytes."""

    __slots__ = ("channel", "offset", "size", "live", "name", "key", "digest")

    def __init__(self, channel: Channel, offset: int, size: int) -> None:
        self.channel = channel
        self.offset = offset
        self.size = size
        self.live = True  # until put (answered), dropped, or its ring is replaced
        # The entry's checksum (cubefs_fuse/samples/checksum.py) for a put of ``key`` in
        # cache ``name``; sent only with a put of that very key and name.
        self.name: str | None = None
        self.key: int | None = None
        self.digest: int | None = None

    def __len__(self) -> int:
        return self.size


class DaemonStore:
    """A :class:`~cube_torch.samples.store.SampleStore` in the node's daemon (one connection)."""

    slot_align = SLOT_ALIGN  # (a class attribute: the ring tests scale it down with their ring)

    def __init__(self, volume: str | None = None, *, config_dir: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT, reply_timeout: float = REPLY_TIMEOUT) -> None:
        self.volume = volume or os.environ.get("VOL_NAME", "")
        self.config_dir = config_dir
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self._channel: Channel | None = None
        self._pid = os.getpid()
        self._used_at = 0.0
        # The channel's replacement and the ring's slots: write_entry runs in the training
        # thread while put_many runs in the cache's writer thread.  Held for a slot's
        # allocation and copy (tens of microseconds), never across a call to the daemon.
        self._lock = threading.Lock()
        self._slots: collections.deque[RingSlot] = collections.deque()  # allocation order

    def __repr__(self) -> str:
        return f"DaemonStore(volume={self.volume!r})"

    def __getstate__(self) -> dict[str, Any]:  # pickled into workers: never with a connection
        state = self.__dict__.copy()
        state["_channel"] = None
        del state["_lock"], state["_slots"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._slots = collections.deque()

    # -- the SampleStore contract -------------------------------------------------------

    def get_many(self, name: str, keys: Sequence[int]) -> list[bytes | memoryview | None]:
        wanted = [int(k) for k in keys]
        if self._slots:  # the answer is laid out from the ring's start: slots there are lost
            with self._lock:
                self._drop_slots()
        out: list[bytes | memoryview | None] = []
        while len(out) < len(wanted):
            chunk = wanted[len(out):len(out) + MAX_SAMPLE_KEYS]
            channel = self._connect()
            reply = self._call({"op": "sample_get", "name": name, "keys": chunk})
            entries = reply.get("entries")
            if not isinstance(entries, list) or not 0 < len(entries) <= len(chunk):
                self._fail(f"bad sample_get answer ({str(reply)[:200]})")
            for entry in entries:
                if entry is None:
                    out.append(None)
                    continue
                if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int for v in entry)
                        and 0 <= entry[0] <= entry[0] + entry[1] <= channel.size):
                    self._fail(f"bad ring slot {entry!r}")
                out.append(channel.ring[entry[0]:entry[0] + entry[1]])  # a copy: the ring is reused
        return out

    def put_many(self, name: str, items: Sequence[tuple[int, bytes | bytearray | RingSlot]]) -> None:
        """Store the entries: bytes are copied into the ring first (and checksummed there,
        see write_entry); RingSlots of this store's current ring are sent as they lie (those
        of a replaced ring are dropped)."""
        if name.startswith("~"):
            self._release(entry for _, entry in items)
            return  # another user's cache: read-only
        batch: list[list[int]] = []
        sent: list[RingSlot] = []
        try:
            if items:
                self._connect()
            for key, entry in items:
                slot = (entry if isinstance(entry, RingSlot)
                        else self.write_entry([entry], len(entry), name=name, key=key))
                if slot is None and batch and not isinstance(entry, RingSlot):
                    self._put(name, batch, sent)  # the ring is full of this batch: send it, then go on
                    batch, sent = [], []
                    slot = self.write_entry([entry], len(entry), name=name, key=key)
                if slot is None or not (slot.live and slot.channel is self._channel):
                    continue  # larger than the ring, the ring full of unsent slots, or replaced: dropped
                item = [int(key), slot.offset, slot.size]
                if slot.digest is not None and slot.key == key and slot.name == name:
                    item.append(slot.digest)
                batch.append(item)
                sent.append(slot)
                if len(batch) == MAX_SAMPLE_KEYS:
                    self._put(name, batch, sent)
                    batch, sent = [], []
            if batch:
                self._put(name, batch, sent)
        finally:
            self._release(entry for _, entry in items)
            self._release(sent)

    def write_entry(self, parts: Sequence[Part], size: int, *, name: str | None = None,
                    key: int | None = None) -> RingSlot | None:
        """Copy an entry (``parts`` as the codec's ``encode_parts`` gives them, ``size``
        bytes in all: one copy, see ``codec.write_parts``) into a free part of the ring, for
        a later ``put_many``; None (nothing copied) when there is no connection yet, it is
        about to be replaced, or the ring has no room: the caller keeps the bytes instead.
        With the ``name`` and ``key`` it will be put under, its checksum too (see the module
        docstring).  Never connects or waits for the daemon (the training thread calls it)."""
        if self._pid != os.getpid():
            return None  # a parent's store (its lock may be held forever in this child)
        with self._lock:
            channel = self._channel
            if (channel is None or size > channel.size
                    or time.monotonic() - self._used_at >= REFRESH_AFTER / 2):
                return None  # (a slot must be sent before _connect would replace the ring)
            offset = self._allocate(channel.size, size)
            if offset is None:
                return None
            slot = RingSlot(channel, offset, size)
            uid = channel.uid
            with memoryview(channel.ring) as ring, ring[offset:offset + size] as view:
                write_parts(list(parts), view)  # (released before the lock is: close never meets an export)
                if uid is not None and name is not None and key is not None and not name.startswith("~"):
                    slot.name, slot.key = name, int(key)
                    slot.digest = entry_digest(uid, name.encode(), int(key), view)
            self._slots.append(slot)
            return slot

    def prepare(self) -> None:
        """Connect now (the cache's writer thread does, ahead of its first put), so that
        write_entry has a ring to write into."""
        self._connect()

    def release(self, slot: RingSlot) -> None:
        """A slot that will not be put (dropped by the caller): its bytes are free again."""
        self._release([slot])

    def _release(self, entries: Any) -> None:
        slots = [e for e in entries if isinstance(e, RingSlot) and e.live]
        if not slots:
            return
        with self._lock:
            for slot in slots:
                slot.live = False
            while self._slots and not self._slots[0].live:
                self._slots.popleft()

    def _allocate(self, ring: int, size: int) -> int | None:
        """Where ``size`` bytes fit: at the ring's start when they fit before the oldest live
        slot, else after the newest (slots are freed mostly in allocation order).  Starting
        over as early as possible keeps the slots within the pages already touched: a
        ring's first touch of a page is a page fault, here and in the daemon.  Offsets are
        multiples of ``slot_align``."""
        while self._slots and not self._slots[0].live:
            self._slots.popleft()
        if not self._slots:
            return 0
        first, last = self._slots[0], self._slots[-1]
        end = -(-(last.offset + last.size) // self.slot_align) * self.slot_align
        if last.offset >= first.offset:  # not wrapped: free before the oldest and after the newest
            if size <= first.offset:
                return 0
            return end if end + size <= ring else None
        return end if end + size <= first.offset else None

    def _drop_slots(self) -> None:
        """Every slot is lost (its ring replaced or overwritten); under the lock."""
        for slot in self._slots:
            slot.live = False
        self._slots.clear()

    def plan(self, name: str, keys: Sequence[int]) -> None:
        self._plan(name, keys, held=False)

    def plan_held(self, name: str, keys: Sequence[int]) -> np.ndarray | None:
        """``plan``, and which of the keys the daemon holds an entry for (a bool per key;
        keys past the plan's cut count as not held); None for another user's cache (no plan
        is sent) or a daemon that does not say."""
        return self._plan(name, keys, held=True)

    def _plan(self, name: str, keys: Sequence[int], *, held: bool) -> np.ndarray | None:
        if name.startswith("~"):
            return None
        wanted = np.asarray(keys, dtype="<i8")
        order = wanted[:MAX_SAMPLE_PLAN_KEYS]
        # A connection of its own (once per epoch: a hello, well under a millisecond): the
        # keys and the answer take the ring's start, where this store's slots may live.
        channel = self._open_channel()
        try:
            order = order[:channel.size // 8]
            channel.ring[:order.nbytes] = order.tobytes()
            request: dict[str, Any] = {"op": "sample_plan", "name": name, "count": int(len(order))}
            if held:
                request["held"] = True
            reply = self._call(request, channel)
            if not held or type(reply.get("held")) is not int:
                return None
            out = np.zeros(len(wanted), dtype=bool)
            out[:len(order)] = np.frombuffer(channel.ring[:len(order)], dtype=np.uint8) != 0
            return out
        finally:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
            self._drop_slots()
        if channel is not None and self._pid == os.getpid():
            channel.close()

    # -- the connection ---------------------------------------------------------------

    def _put(self, name: str, batch: list[list[int]], slots: list[RingSlot]) -> None:
        try:
            reply = self._call({"op": "sample_put", "name": name, "items": batch})
        finally:
            self._release(slots)  # answered (or failed): the ring's bytes are ours again
        if type(reply.get("stored")) is not int:
            self._fail(f"bad sample_put answer ({str(reply)[:200]})")

    def _connect(self) -> Channel:
        now = time.monotonic()
        if self._channel is not None and self._pid == os.getpid():
            if now - self._used_at < REFRESH_AFTER:
                self._used_at = now
                return self._channel
            self.close()  # the daemon may have closed it already: replaced before use
        elif self._pid != os.getpid():  # a parent's connection (after a fork) is never used, nor closed here
            self._lock = threading.Lock()  # (the parent's may have been held at the fork)
            self._channel = None
            self._drop_slots()
            self._pid = os.getpid()
        channel = self._open_channel()  # outside the lock: write_entry never waits for a connect
        with self._lock:
            self._channel = channel
            self._used_at = time.monotonic()
        return channel

    def _open_channel(self) -> Channel:
        if not self.volume:
            # Every worker of every epoch meets this: one warning for the process tree.
            warn_once_in_tree("samples:no-vol-name", "a sample cache's default store is the cubefs-fuse daemon of "
                              "$VOL_NAME, which is not set: set VOL_NAME to the mount's volName (or give the "
                              "CachedDataset a store=...); samples are computed without a cache")
            raise StoreError("the daemon store needs a volume: set VOL_NAME or pass DaemonStore(volume=...)", said=True)
        try:
            config = read_volume_config(self.volume, self.config_dir)
        except ProtocolError as exc:
            warn_no_volume(self.volume, exc, self.config_dir)  # said by this process, or by another of its tree
            raise StoreError(f"daemon store: {exc.message}", said=True) from None
        if not config.data_socket:
            raise StoreError(f"daemon store: the daemon of volume {self.volume!r} has no data socket (an older version)")
        try:
            return Channel(config.data_socket, connect_timeout=self.connect_timeout,
                           reply_timeout=self.reply_timeout, writable=True)
        except (OSError, ValueError, ProtocolError) as exc:
            down = isinstance(exc, (FileNotFoundError, ConnectionRefusedError)) and warn_if_daemon_down(
                self.volume, config, self.config_dir)
            raise StoreError(f"daemon store: cannot connect to {config.data_socket}: {exc}", said=down) from None

    def _call(self, request: dict[str, Any], channel: Channel | None = None) -> dict[str, Any]:
        own = channel is None
        channel = self._connect() if channel is None else channel
        try:
            return channel.call(request)
        except ProtocolError as exc:
            if exc.status:  # the daemon refused this request; the connection is fine
                raise StoreError(f"daemon store: {request['op']} {request.get('name')!r}: {exc.message}") from None
            if own:
                self.close()
            raise StoreError(f"daemon store: {exc.message}") from None
        except (OSError, ValueError) as exc:  # a timeout, a dead daemon, a malformed answer
            if own:
                self.close()
            raise StoreError(f"daemon store: {request['op']} failed: {exc!r}") from None

    def _fail(self, message: str) -> NoReturn:
        self.close()
        raise StoreError(f"daemon store: {message}")
