"""SampleCache and CachedDataset over an in-memory store: miss counts, validity, failures, the write bound."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cube_torch import client
from cube_torch.samples import cache as cache_module
from cube_torch.samples import codec
from cube_torch.samples.cache import HEADER, SampleCache
from cube_torch.samples.dataset import CachedDataset
from cube_torch.samples.store import StoreError
from cube_torch.samples.stores import open_store
from tests.fakes import MemoryStore


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    client._warned.clear()  # each test sees its own "logged once" lines


class Counting:
    def __init__(self) -> None:
        self.computed = Counter[int]()

    def __call__(self, key: int) -> Any:
        self.computed[key] += 1
        return {"key": key, "tensor": torch.full((2, 3), float(key)), "label": key % 3}


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "cube_torch"]


def test_each_key_is_computed_once_across_caches_sharing_a_store() -> None:
    store, compute = MemoryStore(), Counting()
    first = SampleCache("c", store)
    assert [v["key"] for v in first.get_many([3, 1, 4, 1, 5], compute)] == [3, 1, 4, 1, 5]
    assert first.flush(5)
    second = SampleCache("c", store)  # another worker, rank or run
    values = second.get_many([1, 3, 4, 5, 9], compute)
    assert second.flush(5)
    assert compute.computed == Counter({3: 1, 1: 1, 4: 1, 5: 1, 9: 1})
    assert torch.equal(values[0]["tensor"], torch.full((2, 3), 1.0))
    assert second.statistics().hits == 4 and second.statistics().misses == 1
    assert first.statistics().misses == 4 and first.statistics().writes == 4
    assert store.calls["get_many"] == 2
    other = SampleCache("other-name", store)
    other.get(1, lambda: compute(1))
    assert compute.computed[1] == 2  # a different name is a different cache


def test_get_returns_what_compute_returns_then_the_stored_copy() -> None:
    store = MemoryStore()
    c = SampleCache("one", store)
    value = (torch.arange(4), "x")
    assert c.get(7, lambda: value) is value
    c.flush(5)
    again: Any = c.get(7, lambda: pytest.fail("computed twice"))
    assert again is not value and torch.equal(again[0], value[0]) and again[1] == "x"


def test_a_changed_source_file_recomputes_its_sample(tmp_path: Path) -> None:
    store, compute = MemoryStore(), Counting()
    paths = [tmp_path / f"{i}.bin" for i in range(3)]
    for p in paths:
        p.write_bytes(b"v1")
    c = SampleCache("files", store)
    files = lambda k: [str(paths[k])]  # noqa: E731
    c.get_many([0, 1, 2], compute, files)
    c.flush(5)
    c.get_many([0, 1, 2], compute, files)
    assert sum(compute.computed.values()) == 3
    paths[1].write_bytes(b"version 2")  # another size (and mtime)
    c.get_many([0, 1, 2], compute, files)
    c.flush(5)
    assert compute.computed == Counter({0: 1, 1: 2, 2: 1})
    assert c.statistics().stale == 1
    c.get_many([0, 1, 2], compute, files)  # the new entry is valid
    assert compute.computed[1] == 2
    paths[2].unlink()  # gone: computed (the dataset's own error decides), never stored
    c.get_many([2], compute, files)
    assert compute.computed[2] == 2


def test_a_failing_store_warns_once_and_is_bypassed(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store, compute = MemoryStore(), Counting()
    store.fail_get = True
    c = SampleCache("down", store)
    for _ in range(5):
        assert [v["key"] for v in c.get_many([1, 2], compute)] == [1, 2]
    assert store.calls["get_many"] == 1  # bypassed after the first failure
    assert len(warnings_of(caplog)) == 1 and "down" in warnings_of(caplog)[0]
    assert c.statistics().bypassed and c.statistics().failures == 1
    assert compute.computed == Counter({1: 5, 2: 5})
    store.fail_get = False
    monkeypatch.setattr(cache_module, "RETRY_AFTER", 0.0)
    c._here().read_retry_at = c._here().write_retry_at = 0.0  # the retry time has come
    c.get_many([1, 2], compute)
    c.flush(5)
    c.get_many([1, 2], compute)
    assert compute.computed == Counter({1: 6, 2: 6}) and store.calls["get_many"] == 3


def test_a_store_refusing_writes_is_still_read(caplog: pytest.LogCaptureFixture) -> None:
    store, compute = MemoryStore(), Counting()
    c = SampleCache("full", store)
    c.get_many([1], compute)
    c.flush(5)
    store.fail_put = True
    for _ in range(3):
        c.get_many([1, 2, 3], compute)
        c.flush(5)
    assert compute.computed == Counter({1: 1, 2: 3, 3: 3})  # 1 still a hit
    assert store.calls["put_many"] == 2  # then writes stop for RETRY_AFTER
    assert len(warnings_of(caplog)) == 1 and "OOM full" in warnings_of(caplog)[0]


def test_writes_never_block_beyond_the_buffer() -> None:
    store, compute = MemoryStore(), Counting()
    store.stall.clear()  # the store hangs on writes
    c = SampleCache("slow", store, max_pending_entries=4)
    started = time.monotonic()
    for key in range(20):
        c.get(key, functools.partial(compute, key))
    # A store object shared by reader and writer: each read waits SHARED_STORE_WAIT at most
    # for the stalled write, then computes; never the write's own stall (10 s here).
    assert time.monotonic() - started < 20 * cache_module.SHARED_STORE_WAIT + 2.0
    assert not c.flush(0.2)  # bounded: gives up
    stats = c.statistics()
    # 4 buffered, and in the stalled put_many what was buffered when the writer woke: 1 if
    # it woke at the first entry, up to the 4 of a full buffer on a busy machine.
    assert stats.dropped >= 20 - 4 - 4
    store.stall.set()
    assert c.flush(5)
    assert 1 <= len(store.entries) == 20 - stats.dropped <= 8


def test_a_corrupt_entry_is_recomputed_and_overwritten(caplog: pytest.LogCaptureFixture) -> None:
    store, compute = MemoryStore(), Counting()
    c = SampleCache("corrupt", store)
    store.entries[("corrupt", 1)] = b"garbage that is not an entry"
    store.entries[("corrupt", 2)] = HEADER.pack(b"CTSC", 1, 0) + b"\xff\xff"
    store.entries[("corrupt", 3)] = HEADER.pack(b"CTSC", 99, 0) + b"N"  # another format version: a miss
    assert [v["key"] for v in c.get_many([1, 2, 3], compute)] == [1, 2, 3]
    c.flush(5)
    assert [v["key"] for v in c.get_many([1, 2, 3], compute)] == [1, 2, 3]
    assert compute.computed == Counter({1: 1, 2: 1, 3: 1})
    assert len(warnings_of(caplog)) == 1 and "corrupt" in warnings_of(caplog)[0]


def test_entries_of_the_first_format_version_are_still_read() -> None:
    """Version 1 stored every tensor in C order (tag p); version 2 keeps a permuted dense one
    as its memory lies (tag q).  Both are read as hits; new entries are version 2."""
    store, compute = MemoryStore(), Counting()
    c = SampleCache("versions", store)
    chw = torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4).permute(2, 0, 1)
    store.entries[("versions", 1)] = bytes(HEADER.pack(b"CTSC", 1, 0) + codec.encode(chw.contiguous()))
    assert torch.equal(c.get(1, lambda: compute(1)), chw) and not compute.computed
    c.get(2, lambda: chw)
    assert c.flush(5)
    magic, version, _ = HEADER.unpack(store.entries[("versions", 2)][:HEADER.size])
    assert (magic, version) == (b"CTSC", cache_module.FORMAT_VERSION) and cache_module.FORMAT_VERSION == 2
    again = c.get(2, lambda: compute(2))
    assert torch.equal(again, chw) and again.stride() == chw.stride() and not compute.computed


def test_values_the_codec_refuses_are_returned_uncached(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    c = SampleCache("odd", store)
    marker = object()
    for _ in range(3):
        assert c.get(1, lambda: marker) is marker
    assert store.entries == {} and len(warnings_of(caplog)) == 1 and "object" in warnings_of(caplog)[0]


def test_a_key_twice_in_one_batch_is_computed_once_and_not_shared() -> None:
    store, compute = MemoryStore(), Counting()
    values = SampleCache("dup", store).get_many([4, 4, 4], compute)
    assert compute.computed == Counter({4: 1})
    assert values[0] is not values[1] and torch.equal(values[1]["tensor"], values[2]["tensor"])


def test_store_specifications() -> None:
    for bad in ("http://x", "redis:/x", "", 5, object()):
        with pytest.raises(ValueError, match="redis://"):
            SampleCache("n", bad)  # type: ignore[arg-type]
    for bad_name in ("", "a b", "x" * 300, None, "tab\there"):
        with pytest.raises(ValueError, match="name"):
            SampleCache(bad_name, MemoryStore())  # type: ignore[arg-type]
    assert open_store("redis://127.0.0.1:1/0").__class__.__name__ == "RedisStore"  # nothing connects yet
    assert open_store("redis+cluster://127.0.0.1:1,127.0.0.1:2").__class__.__name__ == "RedisClusterStore"


def test_no_daemon_store_means_computing(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default store (the daemon's) failing to open, whatever the reason: one warning, values computed."""
    import cube_torch.samples.stores as stores

    def broken(spec: Any) -> Any:
        raise StoreError("no daemon store here")

    monkeypatch.setattr(cache_module, "open_store", broken)
    compute = Counting()
    c = SampleCache("nodaemon")
    for _ in range(3):
        assert c.get(1, lambda: compute(1))["key"] == 1
    assert compute.computed[1] == 3 and len(warnings_of(caplog)) == 1
    assert stores.open_store is not broken


def double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_cached_dataset(tmp_path: Path) -> None:
    store = MemoryStore()
    base = [torch.full((2,), float(i)) for i in range(10)]
    ds = CachedDataset(base, name="ds", transform=double, store=store)
    assert len(ds) == 10
    assert torch.equal(ds[3], torch.full((2,), 6.0)) and torch.equal(ds[-1], torch.full((2,), 18.0))
    assert [float(t[0]) for t in ds.__getitems__([0, 5, 9])] == [0.0, 10.0, 18.0]
    with pytest.raises(IndexError):
        ds[10]
    ds.cache.flush(5)
    assert {k for _, k in store.entries} == {0, 3, 5, 9}
    assert torch.equal(ds.cache.get(3, lambda: pytest.fail("computed")), base[3])  # stores base[i], untransformed
    by_url = CachedDataset(base, name="ds", transform=double, store="redis://127.0.0.1:1/0")
    by_url.cache._here()  # used in this process: a state with a lock and (later) a thread
    clone = pickle.loads(pickle.dumps(by_url))  # to a worker: no store state travels
    assert clone.cache._state is None and clone.cache.store_spec == "redis://127.0.0.1:1/0" and len(clone) == 10
    with pytest.raises(TypeError, match="map-style"):
        CachedDataset(iter([]), name="x", store=store)


def test_each_epoch_sends_its_key_order_to_the_store(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """cube_torch's patch hands every planned epoch to its background thread, which sends a
    CachedDataset's store the epoch's keys: directly, and through a Subset (its indices)."""
    import cube_torch
    from torch.utils.data import DataLoader, Subset

    monkeypatch.setenv("VOL_NAME", f"no-daemon-{os.getpid()}")  # plans on; no daemon for the file plan
    cube_torch.install()
    store = MemoryStore()
    ds = CachedDataset([torch.tensor(i) for i in range(20)], name="planned", store=store)
    subset = Subset(ds, list(range(19, -1, -2)))  # keys 19, 17, ..., 1
    for dataset, name in ((ds, "ds"), (subset, "subset")):
        store.plans.clear()
        dl = DataLoader(dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
        for epoch in range(2):
            read = [int(v) for batch in dl for v in batch]
            assert client.submitter.wait_idle(10)
            assert store.plans[epoch] == ("planned", read), (name, epoch)  # the order read, as keys
        assert len(store.plans) == 2 and store.plans[0][1] != store.plans[1][1]
    assert ds.statistics().plans == 4
    # A store that fails the plan: logged once (as any store failure), the epoch unharmed.
    monkeypatch.setattr(store, "plan", lambda name, keys: (_ for _ in ()).throw(StoreError("refused")))
    with caplog.at_level(logging.WARNING, logger="cube_torch"):
        for _ in range(2):
            assert sorted(int(v) for batch in DataLoader(ds, batch_size=4, shuffle=True) for v in batch) == \
                list(range(20))
            assert client.submitter.wait_idle(10)
    assert sum("store failed (plan)" in r.getMessage() for r in caplog.records) == 1


class HoldingStore(MemoryStore):
    """A MemoryStore that answers plans with which keys it holds (as the daemon does)."""

    def plan_held(self, name: str, keys: Sequence[int]) -> Any:
        import numpy as np

        self.plan(name, keys)
        return np.array([(name, int(k)) in self.entries for k in keys], dtype=bool)


def test_a_concat_dataset_sends_each_cached_part_its_keys() -> None:
    """Through ConcatDataset (and Subsets under and over it) each CachedDataset gets its own
    keys, in the order they are read; a part met twice sends one plan; the held answers
    come back at the epoch's positions (a plain part's samples are never held)."""
    import numpy as np
    from torch.utils.data import ConcatDataset, Subset

    store_a, store_b = HoldingStore(), MemoryStore()
    a = CachedDataset([torch.tensor(i) for i in range(6)], name="a", store=store_a)
    b = CachedDataset([torch.tensor(100 + i) for i in range(5)], name="b", store=store_b)
    plain: Any = [torch.tensor(-1)] * 3  # a list is a dataset to torch (not to its annotations)
    concat: ConcatDataset[Any] = ConcatDataset([a, Subset(b, [4, 2, 0]), plain, ConcatDataset([Subset(a, [5, 4])])])
    # concat's index -> (cache, key): what each of its samples reads
    where = [("a", k) for k in range(6)] + [("b", 4), ("b", 2), ("b", 0)] + [None] * 3 + [("a", 5), ("a", 4)]
    outer = Subset(concat, list(range(len(concat)))[::-1])  # 14 samples, read back to front
    order = np.array([3, 0, 13, 12, 1, 9, 11, 5, 2, 10, 4, 8, 7, 6])  # an epoch's order of `outer`
    read = [where[len(concat) - 1 - int(i)] for i in order]
    store_a.entries[("a", 4)] = b"held"
    held = client._plan_samples(outer, order)
    assert store_a.plans == [("a", [k for c, k in filter(None, read) if c == "a"])]
    assert store_b.plans == [("b", [k for c, k in filter(None, read) if c == "b"])]
    assert held is not None and held.tolist() == [w == ("a", 4) for w in read]
    assert client._plan_samples(ConcatDataset([plain, Subset(b, [1])]), np.array([0, 3])) is None  # b does not say


def test_making_a_cache_imports_its_stores_client_for_the_workers_to_inherit() -> None:
    """The training process imports redis-py when it makes a Redis cache (not before):
    DataLoader workers forked from it, anew each epoch, do not each import it again."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from cube_torch.samples.cache import SampleCache\n"
            "SampleCache('daemon', None)\n"
            "assert 'redis' not in sys.modules, 'redis-py imported without a Redis store'\n"
            "SampleCache('redis', 'redis://127.0.0.1:1/0')\n"
            "assert {'redis', 'redis.cluster', 'redis.retry'} <= set(sys.modules)\n"
            "assert 'cube_torch.samples.daemon_store' in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_store_is_opened_per_process(tmp_path: Path) -> None:
    """After a fork the child opens its own store state (never the parent's writer or lock)."""
    store = MemoryStore()
    c = SampleCache("fork", store)
    c.get(1, lambda: 1)
    parent_state = c._here()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        ok = c._here() is not parent_state and c.get(2, lambda: 2) == 2 and c.flush(5)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    assert c._here() is parent_state


def test_a_stalled_write_never_delays_reads_of_a_store_opened_by_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened from a URL, the reader and the writer thread have their own store objects."""
    entries: dict[tuple[str, int], bytes] = {}
    opened: list[MemoryStore] = []

    def fake_open(spec: Any) -> MemoryStore:
        store = MemoryStore()
        store.entries = entries  # one server, two connections
        store.stall.clear()  # writes hang (the reader never writes)
        opened.append(store)
        return store

    monkeypatch.setattr(cache_module, "open_store", fake_open)
    c, compute = SampleCache("url", "redis://127.0.0.1:1/0"), Counting()
    started = time.monotonic()
    for key in range(20):
        c.get(key, functools.partial(compute, key))
    assert time.monotonic() - started < 2.0  # no read waited for the hung write
    deadline = time.monotonic() + 10
    while len(opened) < 2 and time.monotonic() < deadline:  # the writer thread opens its own
        time.sleep(0.01)
    assert len(opened) == 2 and opened[0].calls["get_many"] == 20 and opened[0].calls["put_many"] == 0
    assert c.statistics().misses == 20
    for store in opened:
        store.stall.set()
    assert c.flush(15)


class Slot:
    """An entry in a store's own buffer (what the daemon store's write_entry gives)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)


class SlotStore(MemoryStore):
    """A MemoryStore with a buffer of its own: write_entry copies an entry into it (with
    room for ``room`` entries at a time), put_many takes its slots, release frees them."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.live: set[int] = set()
        self.slots = self.released = 0
        self.written_for: list[tuple[str | None, int | None]] = []  # (name, key) of each write_entry

    def write_entry(self, parts: list[codec.Part], size: int, *, name: str | None = None,
                    key: int | None = None) -> Slot | None:
        self.written_for.append((name, key))
        if len(self.live) >= self.room:
            return None
        slot = Slot(bytes(codec.join(parts)))
        assert len(slot) == size
        self.live.add(id(slot))
        self.slots += 1
        return slot

    def release(self, slot: Slot) -> None:
        if id(slot) in self.live:
            self.live.discard(id(slot))
            self.released += 1

    def put_many(self, name: str, items: Sequence[tuple[int, Any]]) -> None:
        try:
            super().put_many(name, [(k, e.data if isinstance(e, Slot) else e) for k, e in items])
        finally:
            for _, e in items:
                if isinstance(e, Slot):
                    self.release(e)


def test_entries_go_into_the_stores_buffer_as_snapshots_taken_at_compute_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store opened by the cache with a buffer of its own gets each entry written into it
    at compute time (one copy): a transform that changes the value in place afterwards does
    not change what is stored.  Without room, bytes; a key twice in a batch, bytes too."""
    entries: dict[tuple[str, int], bytes] = {}
    opened: list[SlotStore] = []

    def fake_open(spec: Any) -> SlotStore:
        store = SlotStore(room=3)
        store.entries = entries
        store.stall.clear()  # the writer holds its first batch until released below
        opened.append(store)
        return store

    monkeypatch.setattr(cache_module, "open_store", fake_open)
    c = SampleCache("slots", "redis://127.0.0.1:1/0")
    c.get(0, lambda: torch.zeros(4))  # the writer thread opens its store (stalled on its first put)
    deadline = time.monotonic() + 10
    while len(opened) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    writer = opened[1]
    hwc = torch.arange(24, dtype=torch.uint8).reshape(2, 4, 3)
    values = {k: hwc.permute(2, 0, 1) + k for k in range(1, 6)}  # CHW views of HWC tensors
    got = c.get_many([1, 2, 3, 4, 4, 5], lambda k: values[k].clone())  # (clone keeps the strides)
    for value in got:
        value.mul_(0)  # a transform after the cache, in place
    assert writer.slots == 3  # keys 1-3 in the buffer; 4 (asked twice) and 5 (no room) as bytes
    assert writer.written_for[-4:] == [("slots", k) for k in (1, 2, 3, 5)]  # each under its key
    assert torch.equal(got[4], values[4] * 0) and got[3] is not got[4]
    writer.stall.set()
    assert c.flush(10)
    assert writer.released == 3 and not writer.live
    for k in range(1, 6):
        assert torch.equal(c.get(k, lambda: pytest.fail("computed")), values[k])
    assert c.statistics().writes == 6


def test_the_writer_connects_while_the_first_misses_are_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batch with misses starts the writer thread before computing them: it opens
    its store and calls its ``prepare`` (connect), so the batch's entries already go into
    the store's buffer.  A batch of hits starts nothing."""
    entries: dict[tuple[str, int], bytes] = {}
    opened: list[SlotStore] = []
    prepared = threading.Event()

    class Preparing(SlotStore):
        def prepare(self) -> None:
            prepared.set()

    def fake_open(spec: Any) -> SlotStore:
        store = Preparing(room=100)
        store.entries = entries
        opened.append(store)
        return store

    monkeypatch.setattr(cache_module, "open_store", fake_open)
    c = SampleCache("prepared", "redis://127.0.0.1:1/0")

    def compute(key: int) -> Any:  # a decode takes a while: long enough for a connect
        assert prepared.wait(10)
        return torch.full((8,), key)

    c.get_many(list(range(6)), compute)
    assert len(opened) == 2 and opened[1].slots == 6  # the writer's store: every entry in its buffer
    assert c.flush(10) and len(entries) == 6
    reader = SampleCache("prepared", "redis://127.0.0.1:1/0")
    got: list[Any] = reader.get_many(list(range(6)), lambda k: pytest.fail("computed"))
    assert [int(v[0]) for v in got] == list(range(6))
    state = reader._here()  # hits only: no writer started, no store opened for it
    assert len(opened) == 3 and not state.prepared and state.writer is None and state.write_store is None


def test_a_store_that_answers_later_is_settled_before_a_flush_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer store with ``settle`` (Redis: answers read later) is settled once the writer
    has had nothing to put for SETTLE_AFTER, and flush waits for it; an error it reports
    then is the store's failure (writes bypassed)."""
    settled = threading.Event()
    opened: list[MemoryStore] = []

    class Answering(MemoryStore):
        fail_settle = False

        def settle(self) -> None:
            time.sleep(0.05)
            settled.set()
            if self.fail_settle:
                raise StoreError("OOM full")

    def fake_open(spec: Any) -> MemoryStore:
        store = Answering()
        opened.append(store)
        return store

    monkeypatch.setattr(cache_module, "open_store", fake_open)
    c = SampleCache("settled", "redis://127.0.0.1:1/0")
    c.get(1, lambda: torch.zeros(2))
    assert c.flush(5) and settled.is_set()
    assert c.statistics().failures == 0
    settled.clear()
    failing = opened[-1]
    assert isinstance(failing, Answering)
    failing.fail_settle = True
    c.get(2, lambda: torch.zeros(2))
    assert c.flush(5) and settled.is_set()
    assert c.statistics().failures == 1 and not c._here().writable()


def test_a_flush_has_the_answers_read_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left alone, the writer reads a put's answers SETTLE_AFTER later (more puts may come
    first); a flush (a DataLoader worker's exit) has them read at once instead of waiting
    that out."""
    settled = threading.Event()

    class Answering(MemoryStore):
        def settle(self) -> None:
            settled.set()

    monkeypatch.setattr(cache_module, "SETTLE_AFTER", 60.0)
    monkeypatch.setattr(cache_module, "open_store", lambda spec: Answering())
    c = SampleCache("flushed", "redis://127.0.0.1:1/0")
    c.get(1, lambda: torch.zeros(2))
    state = c._here()
    with state.cond:
        assert state.cond.wait_for(lambda: state.unsettled and not state.pending and not state.in_flight, 10)
    assert not settled.wait(0.3)  # the writer waits SETTLE_AFTER for more puts
    assert c.flush(30) and settled.is_set()  # (waiting out SETTLE_AFTER, it would answer False at 30 s)


def test_a_full_buffer_frees_the_slots_it_drops() -> None:
    store = SlotStore(room=10)
    c = SampleCache("dropped", store, max_pending_entries=1)
    state = c._here()
    state.write_store = store  # as if opened by the writer thread (a caller's object is never given slots)
    assert state.write_entry(1, [b"x"]) is None  # a caller's object: shared with reads
    state.shared = False
    slot = state.write_entry(1, [b"ab", b"c"])
    assert isinstance(slot, Slot) and slot.data == b"abc"
    with state.cond:
        state.pending.append((9, b"busy"))  # the buffer is full
    state.offer(1, slot)
    assert store.released == 1 and c.statistics().dropped == 1


class FileStore:
    """A SampleStore in a directory (one file per entry), slow to write: shared across processes."""

    def __init__(self, root: str, write_delay: float = 0.0) -> None:
        self.root, self.write_delay = root, write_delay

    def get_many(self, name: str, keys: Sequence[int]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = []
        for k in keys:
            path = os.path.join(self.root, f"{name}.{k}")
            out.append(Path(path).read_bytes() if os.path.exists(path) else None)
        return out

    def put_many(self, name: str, items: Sequence[tuple[int, bytes]]) -> None:
        time.sleep(self.write_delay)
        for k, entry in items:
            Path(self.root, f"{name}.{k}").write_bytes(entry)

    def plan(self, name: str, keys: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


def _child_computes(cache: SampleCache) -> None:
    cache.get_many([1, 2, 3], lambda k: k * 10)  # returns at once: the writes are still pending


def test_a_forked_process_writes_what_is_pending_when_it_exits(tmp_path: Path) -> None:
    """DataLoader workers leave through multiprocessing (its finalizers, not atexit): pending
    writes land before the process is gone."""
    import multiprocessing

    c = SampleCache("exit", FileStore(str(tmp_path), write_delay=0.5))
    c.get(0, lambda: 0)  # the parent has a state (and its finalizer) before the fork
    assert c.flush(5)
    child = multiprocessing.get_context("fork").Process(target=_child_computes, args=(c,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit.0", "exit.1", "exit.2", "exit.3"]
    assert SampleCache("exit", FileStore(str(tmp_path))).get_many([1, 2, 3], lambda k: -1) == [10, 20, 30]
