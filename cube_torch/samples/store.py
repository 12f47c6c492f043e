"""What a sample store is: opaque entries under (cache name, integer key), made and checked
by cube_torch.samples.cache; implemented by the node's daemon (daemon_store.py), Redis and
Redis Cluster (redis_store.py). The contract: ``get_many(name, keys)`` returns one item per
key in order, the entry's bytes or ``None`` (an item may be a ``memoryview`` valid only
until the next call on the store); ``put_many(name, items)`` may drop any entry (a store is
a cache, never the only copy); ``plan(name, keys)`` announces the next order (optional
``plan_held`` also says which keys the store holds); any failure raises :class:`StoreError`
and no call waits unboundedly; and a store object is used from one thread at a time, opened
lazily in each process, never pickled with an open connection."""

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
