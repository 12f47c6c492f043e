"""DaemonStore inside real DataLoader worker processes over a real daemon: each worker
opens its own connection lazily after the fork (a store made in the parent is never
shared), the first epoch fills the store and the next one is served from it, and a
daemon that is gone is a prompt StoreError in the workers, never a hang.

The store is driven directly, with raw bytes (CachedDataset, which wraps exactly these
calls, is tested on the training side).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from cube_torch.samples.daemon_store import DaemonStore
from cube_torch.samples.store import StoreError
from tests.helpers import Mount, write_tree

SAMPLES = 96


class Squares(Dataset[Any]):
    """Sample i is i*i, cached under ("squares", i); returns (value, from the store, worker pid)."""

    def __init__(self, store: DaemonStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return SAMPLES

    def __getitems__(self, indices: list[int]) -> list[tuple[int, int, int]]:
        try:
            found = self.store.get_many("squares", indices)
        except StoreError:
            return [(i * i, -1, os.getpid()) for i in indices]
        missing = [(i, (i * i).to_bytes(8, "little")) for i, got in zip(indices, found) if got is None]
        if missing:
            self.store.put_many("squares", missing)
        return [(int.from_bytes(got, "little") if got is not None else i * i, int(got is not None), os.getpid())
                for i, got in zip(indices, found)]


def _epoch(loader: DataLoader[Any]) -> tuple[list[int], list[int], set[int]]:
    values: list[int] = []
    hits: list[int] = []
    pids: set[int] = set()
    for value, hit, pid in loader:
        values += value.tolist()
        hits += hit.tolist()
        pids |= set(pid.tolist())
    return values, hits, pids


def test_workers_fill_the_store_then_read_it_and_survive_a_dead_daemon(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(profile="ai_prefetch", sampleCacheMemSize="16MiB", sampleCacheDiskSize="64MiB")
    write_tree(m.source, {"a.bin": b"x"})
    m.mount()
    try:
        store = DaemonStore(m.config()["volName"], config_dir=m.config().get("configDir", "/tmp"))
        store.get_many("squares", [0])  # the parent's own connection: the workers must not use it
        loader = DataLoader(Squares(store), batch_size=8, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(0), collate_fn=_collate)
        values, hits, pids = _epoch(loader)
        assert sorted(values) == [i * i for i in range(SAMPLES)]
        assert sum(hits) == 0 and len(pids) == 2 and os.getpid() not in pids
        values, hits, _ = _epoch(loader)
        assert sorted(values) == [i * i for i in range(SAMPLES)] and hits == [1] * SAMPLES
        assert store.get_many("squares", [5]) == [(25).to_bytes(8, "little")]  # the parent's still works
        store.close()
    finally:
        m.umount()
    # The daemon is gone: every worker's store fails at once, the epoch still completes.
    started = time.monotonic()
    values, hits, _ = _epoch(loader)
    assert sorted(values) == [i * i for i in range(SAMPLES)] and hits == [-1] * SAMPLES
    assert time.monotonic() - started < 30  # worker start-up included; no wait on a dead daemon


def _collate(batch: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, hits, pids = zip(*batch)
    return torch.tensor(values), torch.tensor(hits), torch.tensor(pids)
