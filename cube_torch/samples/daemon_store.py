"""The default sample store: the node's cubefs-fuse daemon, over its data socket.

``DaemonStore(volume)`` talks to the daemon of the mount whose ``volName`` is ``volume``
(default: ``$VOL_NAME``), found through the per-volume config file like the fast path
(``read_volume_config``; the daemon must run with ``"profile": "ai_prefetch"``).  Entries
travel through the connection's shared-memory ring (cube_torch/fastpath.py's
:class:`~cube_torch.fastpath.Channel`; the ops are documented in the daemon's
control/sampleplane.py): one message per batch of keys, no per-sample round trip.

Names are the caller's own (the daemon scopes them by the process's uid); ``~UID/NAME``
reads another user's cache that its owner's daemon config shares (``sampleCacheShared``):
such a store is read-only, its ``put_many`` and ``plan`` do nothing.  ``plan_held`` is
``plan`` plus the daemon's answer of which keys it holds (cube_torch leaves their files out
of the epoch's prefetch plan).

Timeouts: connecting and the hello within :data:`~cube_torch.fastpath.CONNECT_TIMEOUT`
(2 s), each answer within :data:`~cube_torch.fastpath.REPLY_TIMEOUT` (10 s).  Any failure
raises :class:`~cube_torch.samples.store.StoreError` at once (the connection is dropped
and the next call connects again); nothing here waits unboundedly or retries.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from cube_torch.fastpath import CONNECT_TIMEOUT, REPLY_TIMEOUT, Channel
from cube_torch.samples.store import StoreError
from cubefs_fuse.control.protocol import (MAX_SAMPLE_KEYS, MAX_SAMPLE_PLAN_KEYS, ProtocolError,
                                          read_volume_config)

# The daemon closes a data connection idle for 60 s (control/dataplane.py's IDLE_DEADLINE);
# one idle for half of that is replaced before use (a hello: well under a millisecond), so
# a validation pass or a checkpoint between two batches never turns into a StoreError.
REFRESH_AFTER = 30.0


class DaemonStore:
    """A :class:`~cube_torch.samples.store.SampleStore` in the node's daemon (one connection)."""

    def __init__(self, volume: str | None = None, *, config_dir: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT, reply_timeout: float = REPLY_TIMEOUT) -> None:
        self.volume = volume or os.environ.get("VOL_NAME", "")
        self.config_dir = config_dir
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self._channel: Channel | None = None
        self._pid = os.getpid()
        self._used_at = 0.0

    def __repr__(self) -> str:
        return f"DaemonStore(volume={self.volume!r})"

    def __getstate__(self) -> dict[str, Any]:  # pickled into workers: never with a connection
        state = self.__dict__.copy()
        state["_channel"] = None
        return state

    # -- the SampleStore contract -------------------------------------------------------

    def get_many(self, name: str, keys: Sequence[int]) -> list[bytes | memoryview | None]:
        wanted = [int(k) for k in keys]
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

    def put_many(self, name: str, items: Sequence[tuple[int, bytes]]) -> None:
        if name.startswith("~"):
            return  # another user's cache: read-only
        channel: Channel | None = None
        batch: list[list[int]] = []
        offset = 0
        for key, entry in items:
            if channel is None:
                channel = self._connect()
            size = len(entry)
            if size > channel.size:
                continue  # larger than any entry the daemon keeps: dropped (the store is a cache)
            if offset + size > channel.size or len(batch) == MAX_SAMPLE_KEYS:
                self._put(name, batch)
                batch, offset = [], 0
            channel.ring[offset:offset + size] = entry
            batch.append([int(key), offset, size])
            offset += size
        if batch:
            self._put(name, batch)

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
        channel = self._connect()
        order = order[:channel.size // 8]
        channel.ring[:order.nbytes] = order.tobytes()
        request: dict[str, Any] = {"op": "sample_plan", "name": name, "count": int(len(order))}
        if held:
            request["held"] = True
        reply = self._call(request)
        if not held or type(reply.get("held")) is not int:
            return None
        out = np.zeros(len(wanted), dtype=bool)
        out[:len(order)] = np.frombuffer(channel.ring[:len(order)], dtype=np.uint8) != 0
        return out

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- the connection ---------------------------------------------------------------

    def _put(self, name: str, batch: list[list[int]]) -> None:
        reply = self._call({"op": "sample_put", "name": name, "items": batch})
        if type(reply.get("stored")) is not int:
            self._fail(f"bad sample_put answer ({str(reply)[:200]})")

    def _connect(self) -> Channel:
        now = time.monotonic()
        if self._channel is not None and self._pid == os.getpid():
            if now - self._used_at < REFRESH_AFTER:
                self._used_at = now
                return self._channel
            self._channel.close()  # the daemon may have closed it already: replaced before use
        self._channel = None  # a parent's connection (after a fork) is never used
        self._used_at = now
        self._pid = os.getpid()
        if not self.volume:
            raise StoreError("the daemon store needs a volume: set VOL_NAME or pass DaemonStore(volume=...)")
        try:
            config = read_volume_config(self.volume, self.config_dir)
        except ProtocolError as exc:
            raise StoreError(f"daemon store: {exc.message}") from None
        if not config.data_socket:
            raise StoreError(f"daemon store: the daemon of volume {self.volume!r} has no data socket (an older version)")
        try:
            self._channel = Channel(config.data_socket, connect_timeout=self.connect_timeout,
                                    reply_timeout=self.reply_timeout, writable=True)
        except (OSError, ValueError, ProtocolError) as exc:
            raise StoreError(f"daemon store: cannot connect to {config.data_socket}: {exc}") from None
        return self._channel

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        channel = self._connect()
        try:
            return channel.call(request)
        except ProtocolError as exc:
            if exc.status:  # the daemon refused this request; the connection is fine
                raise StoreError(f"daemon store: {request['op']} {request.get('name')!r}: {exc.message}") from None
            self.close()
            raise StoreError(f"daemon store: {exc.message}") from None
        except (OSError, ValueError) as exc:  # a timeout, a dead daemon, a malformed answer
            self.close()
            raise StoreError(f"daemon store: {request['op']} failed: {exc!r}") from None

    def _fail(self, message: str) -> NoReturn:
        self.close()
        raise StoreError(f"daemon store: {message}")
