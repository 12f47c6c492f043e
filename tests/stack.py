"""The daemon's stack for the component tests, built in one place as cubefs_fuse/daemon.py
builds it: a RAM tier (and an NVMe tier if given) under a BlockCache, a MetadataCache and
the Filesystem over a backend (a FakeBackend, or one wrapping it), and, for the tests of
plans and jobs, the PrefetchService observing the Filesystem.

Sizes, slots and TTLs come from a :class:`ClientConfig` (:func:`stack_config`: small test
defaults, each test changes what it needs), so a test says what it sets in the config's own
terms and the wiring follows the daemon's when it changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio

from cubefs_fuse.backends.base import Backend
from cubefs_fuse.backends.deadline import DeadlineBackend
from cubefs_fuse.cache.blockcache import BlockCache
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.cache.memory import MemoryTier
from cubefs_fuse.config import ClientConfig
from cubefs_fuse.fs.filesystem import Filesystem
from cubefs_fuse.fs.metadata import MetadataCache
from cubefs_fuse.prefetch.service import PrefetchService

BLOCK = 4096  # small blocks keep the tests light; the layers do not care about the size

B = TypeVar("B", bound=Backend)  # the test's backend, with its own hooks (a FakeBackend)


def stack_config(**changes: Any) -> ClientConfig:
    """The config of a component stack: 64 blocks of RAM, 4 fetch and 2 prefetch slots,
    metadata TTLs far longer than any test (fetched once), 1,000 metadata entries, jobs
    that never idle out (registered without a watched process, and an autojump clock leaps
    while a worker thread runs), then ``changes`` (ClientConfig's field names)."""
    defaults: dict[str, Any] = {
        "mount_point": "/mnt/test", "vol_name": "test", "source": "/src", "profile": "ai_prefetch",
        "block_size": BLOCK, "mem_cache_size": 64 * BLOCK, "backend_threads": 4, "prefetch_threads": 2,
        "attr_valid": 3600.0, "lookup_valid": 3600.0, "meta_cache_entries": 1000, "job_idle_timeout": 1e9,
    }
    return ClientConfig(**{**defaults, **changes})


@dataclass
class Stack(Generic[B]):
    backend: B
    cache: BlockCache
    meta: MetadataCache
    fs: Filesystem
    prefetch: PrefetchService | None

    @property
    def service(self) -> PrefetchService:
        assert self.prefetch is not None, "this stack was opened without the prefetch service (service=True)"
        return self.prefetch


@asynccontextmanager
async def open_stack(backend: B, config: ClientConfig | None = None, *, disk: DiskTier | None = None,
                     ram: int | None = None, service: bool = False) -> AsyncIterator[Stack[B]]:
    """The stack over ``backend`` in a nursery of its own, cancelled when the block exits.

    ``config``: :func:`stack_config` unless given; ``ram``: the RAM tier's size when it is
    not the config's ``mem_cache_size`` (what plans are told); ``service``: start the
    PrefetchService and make it the Filesystem's observer (the ai_prefetch profile).
    """
    config = config or stack_config()
    async with trio.open_nursery() as nursery:
        cache = BlockCache(nursery, MemoryTier(config.mem_cache_size if ram is None else ram), disk,
                           fetch_slots=config.backend_threads, prefetch_slots=config.prefetch_threads)
        meta = MetadataCache(backend, attr_ttl=config.attr_valid, lookup_ttl=config.lookup_valid,
                             max_entries=config.meta_cache_entries)
        # Stale-if-error as the daemon has it: over a DeadlineBackend, unless the config turns it off.
        outage = backend if isinstance(backend, DeadlineBackend) and config.stale_if_error else None
        fs = Filesystem(nursery, meta, cache, backend, block_size=config.block_size, outage=outage)
        prefetch = None
        if service:
            prefetch = PrefetchService(nursery, fs, config)
            fs.observer = prefetch
        yield Stack(backend, cache, meta, fs, prefetch)
        nursery.cancel_scope.cancel()
