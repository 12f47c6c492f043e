"""What a sample store is: opaque entries under (cache name, integer key).

A store knows nothing of samples: the entry bytes are made and checked by
cube_torch.samples.cache (a header with the validity tag of the sample's source files,
then the codec's encoding).  Implementations: the node's daemon (daemon_store.py),
Redis and Redis Cluster (redis_store.py); tests may use an in-memory one.

Contract, shared by every implementation:

* ``get_many(name, keys)`` returns one item per key, in order: the entry's bytes, or
  ``None`` when the store has no entry.  An item may be a ``memoryview`` into the store's
  own buffer, valid only until the next call on the same store object (the caller decodes
  or copies it at once).
* ``put_many(name, items)`` stores ``(key, entry)`` pairs; it may drop any of them (a full
  store, an entry over the store's size bound): a store is a cache, never the only copy.
* ``plan(name, keys)``: the order in which the keys will be asked for next (an epoch's
  order); a store that evicts may use it, others ignore it.  Optional:
  ``plan_held(name, keys)``, the same plus which keys the store holds (a numpy bool array,
  one per key, or None): cube_torch then leaves those samples' files out of the epoch's
  prefetch plan (the daemon store has it).
* Any failure (down, refused, full beyond recovery, a malformed answer) raises
  :class:`StoreError`; the caller then logs once and bypasses the store for a while.
  No call waits unboundedly: each implementation documents its timeouts.
* A store object is used from one thread at a time; each DataLoader worker opens its own
  (stores are created lazily, after the fork, never pickled with an open connection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class StoreError(Exception):
    """The store cannot serve this call: the caller bypasses it (and logs once).  ``said``:
    the cause was already told to the user (a wrong VOL_NAME, a daemon that is not
    running: one warning per process tree, cube_torch/client.py), so the caller does not
    log it again."""

    def __init__(self, message: str, *, said: bool = False) -> None:
        super().__init__(message)
        self.said = said


class SampleStore(Protocol):
    def get_many(self, name: str, keys: Sequence[int]) -> list[bytes | memoryview | None]: ...

    def put_many(self, name: str, items: Sequence[tuple[int, bytes]]) -> None: ...

    def plan(self, name: str, keys: Sequence[int]) -> None: ...

    def close(self) -> None: ...
