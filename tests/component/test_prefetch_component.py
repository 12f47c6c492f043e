"""Plan-driven prefetch without FUSE: MetadataCache + MemoryTier + BlockCache +
Filesystem + PrefetchService over a FakeBackend with per-operation latency.

The "application" is this test task: it registers its own pid as a job, then looks
files up and reads them through ``Filesystem`` exactly as the FUSE adapter would (with
the pid a FUSE request carries; the kernel opens and closes files without the daemon, so a
READ from a file's start is what counts as a request).  Time is virtual
(``autojump_clock``): a 2 ms remote costs no wall time and outcomes do not depend on
the machine's speed.  Plans are registered through the service's real handlers.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from cubefs_fuse.cache.keys import block_key
from cubefs_fuse.cache.disk import DiskTier, allocated_bytes
from cubefs_fuse.fs.filesystem import Filesystem
from cubefs_fuse.fs.inodes import ROOT_INODE
from cubefs_fuse.limits import MAX_LOADERS
from cubefs_fuse.prefetch.datasets import Dataset
from cubefs_fuse.prefetch.scheduler import PLAN_IDLE
from cubefs_fuse.prefetch.service import FIRST_WAIT
from tests.fakes import FakeBackend
from tests.stack import BLOCK, Stack, open_stack, stack_config

LATENCY = 0.002  # 2 ms per remote operation: object-storage-like (docs/benchmarks.md)
JOB = "train"
PID = os.getpid()  # the registered "trainer": this process


System = Stack[FakeBackend]  # what open_system yields: the stack, the FakeBackend's hooks included


@asynccontextmanager
async def open_system(backend: FakeBackend, *, ram: int, fetch_slots: int = 16,
                      prefetch_slots: int = 12, disk: DiskTier | None = None) -> AsyncIterator[System]:
    config = stack_config(mem_cache_size=ram, backend_threads=fetch_slots, prefetch_threads=prefetch_slots,
                          meta_cache_entries=1_000_000)
    async with open_stack(backend, config, disk=disk, service=True) as s:
        yield s


def make_dataset(backend: FakeBackend, files: int, *, per_dir: int = 50, size: int = BLOCK) -> list[str]:
    """ImageNet-like: ``per_dir`` files per class directory, one block each by default (a
    file is either resident or not)."""
    paths = [f"class{i // per_dir:03d}/img{i:05d}.jpg" for i in range(files)]
    for i, path in enumerate(paths):
        backend.write(path, bytes([i % 251]) * size)
    return paths


async def register(s: System, paths: list[str]) -> str:
    s.service.jobs.register(JOB, 0, PID)
    body = b"\0".join(p.encode() for p in paths)
    dataset, _ = await s.service.register_dataset(body, 1)
    return dataset.id


async def submit(s: System, dataset: str, order: list[int], epoch: int, rank: int = 0) -> None:
    await s.service.submit_plan((JOB, rank), epoch, dataset, np.asarray(order, dtype="<u4").tobytes(), "<u4")


async def read_file(fs: Filesystem, path: str, pid: int = PID) -> bool:
    """Look up and read ``path`` whole as an application; True if a hit."""
    inode = ROOT_INODE
    for name in path.split("/"):
        entry = await fs.lookup(inode, name)
        inode = entry.inode
    misses = fs.statistics().file_misses
    offset = 0
    while offset < entry.attr.size:
        offset += len(await fs.read(inode, 0, offset, 128 * 1024, pid))  # the kernel's largest read
    return fs.statistics().file_misses == misses


async def eventually(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until ``predicate`` holds, polling every 0.05 s of virtual time; TooSlowError
    after ``timeout`` seconds of *real* time.  Polling, not one long sleep: under
    autojump_clock a sleep also ends while a worker thread (a plan's re-ranking) is still
    running, so only the condition itself says the work is done.  And the bound is real
    time for the same reason: while a thread runs, each poll leaps the clock, so a slow
    thread spent a 60 s virtual bound in milliseconds (CI on a slow VM, 2026-11-28)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise trio.TooSlowError(f"not within {timeout} s")
        await trio.sleep(0.05)


async def taken_in(s: System, rank: int = 0) -> None:
    """Wait until the daemon has re-ranked the cache for the newest plan and issued the
    first position of its window (the virtual clock advances by that stat's round trip at most).

    With a real clock that takes a worker thread ~1 ms after the plan arrives, before the
    epoch's first batch is read.  Under autojump_clock the reader's 2 ms misses cost no
    real time, so without this wait it would read dozens of files in "LRU mode" first."""
    await window_started(s.service.scheduler.plans[(JOB, rank, "0")])


_threads_out = 0  # worker threads (trio.to_thread) running now, counted by the fixture below


@pytest.fixture(autouse=True)
def _count_worker_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count the daemon's worker threads in flight, so that ``window_started`` can keep
    virtual time still while one computes (the re-ranking's numpy pass).  The autojump
    clock jumps whenever every task waits, a wait for a thread included, so without this
    a re-ranking that takes a loaded machine a second of real time costs a second of
    virtual time too."""
    real = trio.to_thread.run_sync

    async def counted(*args: Any, **kwargs: Any) -> Any:
        global _threads_out
        _threads_out += 1
        try:
            return await real(*args, **kwargs)
        finally:
            _threads_out -= 1

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)


async def window_started(plan: Any) -> None:
    """Wait until the cache is re-ranked for ``plan`` (its window fills from then on) and
    a first position is issued (its files stat'ed, a small one's bytes with its stat)."""
    real_deadline = time.monotonic() + 60  # a hung worker thread fails the test, not CI's clock
    with trio.fail_after(1):  # virtual time: passes only while the window stats its first chunk
        while not (plan.reranked.is_set() and plan.counters.issued):
            if time.monotonic() > real_deadline:
                raise trio.TooSlowError("a worker thread ran for a minute")
            # While a worker thread computes, a bare checkpoint (this task stays runnable,
            # so the clock stands still); otherwise a step of virtual time (the clock only
            # jumps when every task waits): at most one stat's round trip passes.
            await trio.sleep(0 if _threads_out else LATENCY / 20)


@asynccontextmanager
async def resident_after_one_epoch(files: int) -> AsyncIterator[tuple[System, list[str], str]]:
    """A system whose RAM tier holds a ``files``-file dataset, read once in order under an
    epoch-0 plan: (the system, the paths, the dataset's id)."""
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, files)
    async with open_system(backend, ram=4 * len(paths) * BLOCK) as s:
        dataset = await register(s, paths)
        await submit(s, dataset, list(range(len(paths))), epoch=0)
        for path in paths:
            await read_file(s.fs, path)
        yield s, paths, dataset


async def test_plan_read_in_order_hits_after_the_first_files(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, 600)
    order = list(range(len(paths)))
    random.Random(1).shuffle(order)
    async with open_system(backend, ram=4 * len(paths) * BLOCK) as s:
        dataset = await register(s, paths)
        await submit(s, dataset, order, epoch=0)
        outcomes = []
        for sample in order:
            outcomes.append(await read_file(s.fs, paths[sample]))
            await trio.sleep(LATENCY / 2)  # the training step between samples
        warm = outcomes[10:]  # "after the first few files": the plan has just arrived
        assert sum(warm) / len(warm) >= 0.99, f"{warm.count(False)} misses after the first 10"
        # Every file was read from the remote exactly once, prefetch and application together.
        assert sorted(backend.read_calls) == sorted((p, 0) for p in paths)
        assert set(backend.read_calls.values()) == {1}
        # Per-job accounting agrees with what the application saw.
        report = s.service.jobs.report(JOB)["jobs"][0]
        assert report["cumulative"]["requests"] == len(paths)
        assert report["cumulative"]["hits"] == sum(outcomes)
        stats = s.cache.statistics()
        assert stats.prefetch_wasted == 0  # the cache holds the dataset: nothing evicted unread
        assert stats.prefetch_used >= len(warm) * 0.99
        plan = s.service.scheduler.plans[(JOB, 0, "0")]
        assert plan.cursor == len(paths) and plan.counters.used == len(paths)
        # Metadata came per file, stat'ed in parallel by the window, never by listing a
        # directory (a listing pays one round trip per entry in series): each file once,
        # plus the lookups of the class directories and of the first few files, which
        # the reader may ask for while the window's stat of them is in flight.
        directories = len(paths) // 50
        assert backend.operations["listdir"] == 0
        assert backend.operations["stat"] <= len(paths) + directories + 10
        # Each file came with its stat: one backend call per file, no separate read.
        assert backend.operations["read"] == 0 and backend.stat_reads == len(paths)


async def test_a_lookup_while_the_prefetch_brings_the_file_waits_for_it(
        autojump_clock: trio.testing.MockClock) -> None:
    """A reader that looks a file up while the plan's prefetch is stat'ing it with its bytes
    waits for that call, as a read joins a flight: one backend call for the file, and the
    reader's read counts as the miss it waited for (the prefetch used, not wasted)."""
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, 100)
    gate = backend.gate(paths[40])  # the prefetch's read of it starts, then hangs
    async with open_system(backend, ram=64 << 20) as s:
        dataset = await register(s, paths)
        await submit(s, dataset, list(range(len(paths))), epoch=0)
        await taken_in(s)
        await eventually(lambda: backend.read_calls[(paths[40], 0)] == 1)
        used = s.cache.statistics().prefetch_used
        async with trio.open_nursery() as nursery:
            outcome: list[bool] = []

            async def reader() -> None:
                outcome.append(await read_file(s.fs, paths[40]))

            nursery.start_soon(reader)
            await trio.sleep(10 * LATENCY)
            assert not outcome  # the reader waits on the prefetch's call ...
            gate.set()
        assert outcome == [False]  # ... and counts the miss it waited for
        assert backend.read_calls[(paths[40], 0)] == 1 and backend.operations["read"] == 0
        stats = s.cache.statistics()
        assert stats.prefetch_used == used + 1 and stats.prefetch_wasted == 0


async def test_a_later_epoch_of_a_resident_dataset_is_issued_without_a_task_per_file(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the RAM tier holds the dataset, a new epoch's window issues each position in
    the scheduler's own step (nothing to fetch: no task, no prefetch call), counts it into
    the window at its real size and ranks its blocks at their new positions; the epoch
    still reads as hits.  A position with a block gone from RAM takes the task path."""
    async with resident_after_one_epoch(200) as (s, paths, dataset):
        tasks: list[str] = []
        real = s.fs.blocks.prefetch_file

        async def counted(path: str, next_use: int | None = None, urgent: bool = False) -> int:
            tasks.append(path)
            return await real(path, next_use, urgent)

        monkeypatch.setattr(s.fs.blocks, "prefetch_file", counted)
        gone = paths[7]
        attr = s.fs.meta.peek(gone)
        assert attr is not None
        s.cache.memory.discard(block_key(gone, attr.version, 0))
        order = list(reversed(range(len(paths))))
        await submit(s, dataset, order, epoch=1)
        plan = s.service.scheduler.plans[(JOB, 0, "0")]
        await eventually(lambda: plan.counters.issued >= len(paths) - 1)
        assert tasks == [gone]
        ram = s.cache.memory.index
        for position in (0, 1, len(paths) - 1):
            path = paths[order[position]]
            key = block_key(path, s.fs.meta.peek(path).version, 0)  # type: ignore[union-attr]
            assert ram.next_use(key) == plan.origin + position
        assert plan.window_bytes == sum(plan.bytes_at.values()) == len(plan.bytes_at) * BLOCK
        before = s.service.jobs.report(JOB)["jobs"][0]["cumulative"]["misses"]
        for sample in order:
            await read_file(s.fs, paths[sample])
        assert s.service.jobs.report(JOB)["jobs"][0]["cumulative"]["misses"] - before <= 1


async def run_epochs(plans: bool, prefetch_slots: int, epochs: int = 4, files: int = 400) -> list[float]:
    """Hit rate per epoch of a reader with no think time, cache = 0.5 x dataset."""
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, files)
    rng = random.Random(7)
    rates = []
    async with open_system(backend, ram=files * BLOCK // 2, fetch_slots=prefetch_slots + 1,
                           prefetch_slots=prefetch_slots) as s:
        dataset = await register(s, paths)
        for epoch in range(epochs):
            order = list(range(files))
            rng.shuffle(order)  # the sampler reshuffles every epoch
            if plans:
                await submit(s, dataset, order, epoch)
                await taken_in(s)
            for sample in order:
                await read_file(s.fs, paths[sample])
            since = s.service.jobs.report(JOB)["jobs"][0]["since_last"]
            assert since["requests"] == files
            rates.append(since["hit_rate"])
            used = s.cache.statistics().ram
            assert used.used_bytes <= used.limit_bytes
    return rates


async def test_half_size_cache_keeps_a_stable_subset_over_reshuffled_epochs(
        autojump_clock: trio.testing.MockClock) -> None:
    # One prefetch slot: prefetch fetches no faster than the reader's own misses, so the
    # hit rate rests on the resident subset that plan-aware eviction keeps.  Twelve slots:
    # prefetch also runs ahead of the reader.
    results = {}
    for slots in (1, 12):
        results[f"plans, {slots} prefetch slot(s)"] = await run_epochs(plans=True, prefetch_slots=slots)
        results[f"LRU, {slots} prefetch slot(s)"] = await run_epochs(plans=False, prefetch_slots=slots)
    print("\nhit rate per epoch, cache = 0.5 x dataset, reshuffled epochs, reader with no think time:")
    for name, rates in results.items():
        print(f"  {name:28} {' '.join(f'{r:.3f}' for r in rates)}")
    for slots in (1, 12):
        with_plans, lru = results[f"plans, {slots} prefetch slot(s)"], results[f"LRU, {slots} prefetch slot(s)"]
        # Epoch 0 starts cold; from then on the plans keep half the dataset resident.
        assert min(with_plans[1:]) >= 0.45, (slots, with_plans)
        assert min(with_plans[1:]) > max(lru[1:]), (slots, with_plans, lru)


async def run_epochs_on_disk(directory: str, plans: bool, epochs: int = 4, files: int = 200) -> list[float]:
    """As run_epochs, but the NVMe tier holds 0.5 x the dataset and RAM almost nothing."""
    # Real time (the tier's file I/O runs in worker threads), with a shorter remote latency.
    backend = FakeBackend(latency=LATENCY / 4)
    paths = make_dataset(backend, files)
    rng = random.Random(11)
    rates = []
    disk = await DiskTier.open(directory, files // 2 * allocated_bytes(BLOCK), 0.0)
    try:
        # RAM: two blocks, so hits must come from the disk tier; one prefetch slot, so the
        # hit rate rests on what eviction keeps, not on prefetch outrunning the reader.
        async with open_system(backend, ram=2 * BLOCK, fetch_slots=2, prefetch_slots=1, disk=disk) as s:
            s.cache.disk_batch_linger = 0  # each write is waited for below: no batch to gather
            dataset = await register(s, paths)
            for epoch in range(epochs):
                order = list(range(files))
                rng.shuffle(order)
                if plans:
                    await submit(s, dataset, order, epoch)
                    await taken_in(s)
                for sample in order:
                    await read_file(s.fs, paths[sample])
                    # Let the write-behind land, as the time a training step takes would.
                    with trio.fail_after(10):
                        while s.cache.statistics().pending_disk_bytes:
                            await trio.sleep(0.001)
                since = s.service.jobs.report(JOB)["jobs"][0]["since_last"]
                assert since["requests"] == files
                rates.append(since["hit_rate"])
                stats = s.cache.statistics().disk
                assert stats is not None and stats.used_bytes <= stats.limit_bytes
    finally:
        disk.release()
    return rates


async def test_half_size_nvme_tier_keeps_a_stable_subset(tmp_path: Any) -> None:
    with_plans = await run_epochs_on_disk(str(tmp_path / "plans"), plans=True)
    lru = await run_epochs_on_disk(str(tmp_path / "lru"), plans=False)
    print(f"\nNVMe tier = 0.5 x dataset, hit rate per epoch: plans {with_plans}, LRU {lru}")
    assert min(with_plans[1:]) >= 0.45, with_plans
    assert min(with_plans[1:]) > max(lru[1:]), (with_plans, lru)


async def test_new_plan_for_the_same_rank_cancels_the_old_ones_issuing(
        autojump_clock: trio.testing.MockClock) -> None:
    # A stat takes 1 s, so the old plan takes as many positions at once as the cache has
    # fetch slots and finishes fewer per second (the prefetch's share of the slots): it
    # has taken some and not all of them after `per_chunk` seconds.
    per_chunk = 4.0
    backend = FakeBackend(latency=LATENCY, op_latency={"stat": 1.0})
    old_paths = make_dataset(backend, 8 * 32, per_dir=10)
    new_paths = [f"other/img{i}.jpg" for i in range(20)]
    for path in new_paths:
        backend.write(path, b"n" * BLOCK)
    async with open_system(backend, ram=64 * 1024 * 1024) as s:
        old = await register(s, old_paths)
        new = await register(s, new_paths)
        await submit(s, old, list(range(len(old_paths))), epoch=0)
        await trio.sleep(1.5 * per_chunk)  # the first chunk is issued, the second is being stat'ed
        old_plan = s.service.scheduler.plans[(JOB, 0, "0")]
        assert 0 < old_plan.issued_upto < len(old_paths)
        await submit(s, new, list(range(len(new_paths))), epoch=1)
        new_plan = s.service.scheduler.plans[(JOB, 0, "0")]
        assert new_plan is not old_plan
        await eventually(lambda: new_plan.counters.issued == len(new_paths)
                         and all((p, 0) in backend.read_calls for p in new_paths))
        issued_before = old_plan.issued_upto  # replaced: its task was cancelled
        await trio.sleep(10 * per_chunk)  # longer than the old plan needed to issue everything
        # Nothing past the old plan's issued positions was issued or read (a position taken
        # but still in its stat when the plan was replaced was not read either).
        assert old_plan.issued_upto == issued_before
        read_old = {p for p, _ in backend.read_calls if p in set(old_paths)}
        assert read_old <= set(old_paths[:issued_before]) and read_old
        assert old_plan.scope.cancelled_caught  # its task ended by cancellation
    # Control: without a new plan, the old one goes on to issue everything in that time.
    async with open_system(FakeBackend(latency=LATENCY, op_latency={"stat": 1.0}), ram=64 << 20) as s2:
        make_dataset(s2.backend, 8 * 32, per_dir=10)
        old2 = await register(s2, old_paths)
        await submit(s2, old2, list(range(len(old_paths))), epoch=0)
        await trio.sleep(1.5 * per_chunk + 10 * per_chunk)
        assert s2.service.scheduler.plans[(JOB, 0, "0")].issued_upto == len(old_paths)


async def test_foreground_reads_go_before_saturating_prefetch(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, 200)
    for name in ("unplanned.bin", "unplanned2.bin"):
        backend.write(name, b"u" * BLOCK)
    gates = {p: backend.gate(p) for p in paths}  # every planned read starts, then hangs
    async with open_system(backend, ram=64 << 20, fetch_slots=4, prefetch_slots=3) as s:
        dataset = await register(s, paths)
        await submit(s, dataset, list(range(len(paths))), epoch=0)
        await trio.sleep(1)  # long enough for prefetch to take every slot it may
        slots = s.cache.statistics().slots
        # The window issues as many positions at once as there are fetch slots (4): three
        # hold the prefetch slots, the fourth waits behind them.
        assert slots.busy_background == 3 and slots.waiting_background == 1
        # Nearest first: the first three positions (their issue tasks start in plan order
        # and take the slots as trio runs them, so in any order among themselves).
        assert sorted(backend.read_log) == [(p, 0) for p in paths[:3]], backend.read_log

        # 1. Prefetch never holds the last slot: a foreground miss goes straight through.
        start = trio.current_time()
        assert not await read_file(s.fs, "unplanned.bin")  # a miss (cold), but not queued
        assert trio.current_time() - start <= 2 * LATENCY + 1e-9  # virtual time: lookup + read

        async with trio.open_nursery() as nursery:
            # 2. A read of a file whose prefetch is queued promotes it: it takes the free
            #    slot as a foreground fetch (and hangs on its gate): all 4 slots are busy.
            nursery.start_soon(read_file, s.fs, paths[150])
            await trio.sleep(1)
            slots = s.cache.statistics().slots
            assert (slots.busy_foreground, slots.busy_background) == (1, 3)
            assert backend.read_log[-1] == (paths[150], 0)
            # 3. Another foreground miss must wait for a slot, behind nothing.
            nursery.start_soon(read_file, s.fs, "unplanned2.bin")
            await trio.sleep(1)
            assert s.cache.statistics().slots.waiting_foreground == 1
            reads = len(backend.read_log)
            gates[paths[0]].set()  # a prefetch ends and frees its slot ...
            await trio.sleep(LATENCY / 2)
            # ... which goes to the waiting application read, not to one of the queued
            # prefetches.
            assert backend.read_log[reads:] == [("unplanned2.bin", 0)]
            for gate in gates.values():
                gate.set()


async def submit_first(s: System, dataset: str, order: list[int], first: int) -> float:
    """Submit a plan whose answer waits for its first ``first`` positions; the virtual seconds it took."""
    start = trio.current_time()
    await s.service.submit_plan((JOB, 0), 0, dataset, np.asarray(order, dtype="<u4").tobytes(), "<u4", first=first)
    return trio.current_time() - start


def cached(s: System, path: str) -> bool:
    attr = s.fs.meta.peek(path)
    return attr is not None and s.fs.blocks.cached_fraction(path, attr) == 1.0


async def test_plan_answer_waits_until_the_first_batches_are_local(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, 300)
    order = list(range(len(paths)))
    random.Random(3).shuffle(order)
    first = [paths[i] for i in order[:64]]  # e.g. 4 workers x prefetch_factor 2 x batch 8
    async with open_system(backend, ram=64 << 20) as s:
        dataset = await register(s, paths)
        took = await submit_first(s, dataset, order, 64)
        # Stat'ed 16 at a time and fetched on the prefetch slots: a few round trips.
        assert took < 20 * LATENCY
        assert all(cached(s, p) for p in first)
        assert backend.operations["listdir"] == 0
        # A loader starting now hits on all of them.
        assert all([await read_file(s.fs, p) for p in first])
    # Control: without ``first`` the answer does not wait, and the files are not there yet.
    backend2 = FakeBackend(latency=LATENCY)
    make_dataset(backend2, 300)
    async with open_system(backend2, ram=64 << 20) as s2:
        dataset = await register(s2, paths)
        assert await submit_first(s2, dataset, order, 0) == 0
        assert not any(cached(s2, p) for p in first)


async def test_plan_answer_waits_for_the_first_batches_at_most_first_wait(
        autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, 100)
    gate = backend.gate(paths[5])  # this read starts, then hangs
    async with open_system(backend, ram=64 << 20) as s:
        dataset = await register(s, paths)
        took = await submit_first(s, dataset, list(range(len(paths))), 32)
        assert took == pytest.approx(FIRST_WAIT)
        plan = s.service.scheduler.plans[(JOB, 0, "0")]
        assert not plan.first_ready.is_set()
        # The plan goes on: the rest of the window is issued meanwhile.
        await eventually(lambda: plan.issued_upto == len(paths))
        gate.set()
        await eventually(plan.first_ready.is_set)


async def test_the_loaders_next_files_are_fetched_as_foreground_reads(autojump_clock: trio.testing.MockClock) -> None:
    """The plan's ``first`` positions past the cursor (the loader's batches in progress)
    are fetched as foreground reads, issued so or promoted as the cursor reaches them: a
    loader reading twice as fast as the one prefetch slot can fetch finds them in RAM,
    instead of queued behind that slot while the other fetch slots sit idle.  They are
    still prefetches (used, not misses), and each was read from the remote once."""

    async def epoch(first: int) -> tuple[float, System]:
        backend = FakeBackend(latency=LATENCY)
        paths = make_dataset(backend, 200)
        async with open_system(backend, ram=64 << 20, fetch_slots=8, prefetch_slots=1) as s:
            dataset = await register(s, paths)
            order = list(range(len(paths)))
            await submit_first(s, dataset, order, first)
            await taken_in(s)
            outcomes = []
            for sample in order:
                outcomes.append(await read_file(s.fs, paths[sample]))
                await trio.sleep(LATENCY / 2)  # the loader: two files per remote round trip
            assert set(backend.read_calls.values()) == {1}
            return sum(outcomes[10:]) / len(outcomes[10:]), s

    rate, s = await epoch(first=4)
    assert rate >= 0.95, rate
    stats = s.cache.statistics()
    assert stats.prefetch_used >= 0.95 * 190 and stats.misses <= 0.05 * 200
    # Control: the same loader without a depth (first=0) outruns the one prefetch slot.
    control, _ = await epoch(first=0)
    assert control <= 0.7, control


# -- several DataLoaders of one (job, rank), each with its own plan -----------------------
#
# Plans arrive through the service's real handler with a loader id, as
# ``POST /v1/plans?...&loader=`` delivers them; the "application" reads as the loaders'
# workers would through the mount.

LOADER_FILES = 300  # per loader
LOADER_RAM = 200 * BLOCK  # the LOADER_RAM tier holds a third of one epoch of both loaders (600 files)


async def submit_for(s: System, dataset: str, order: list[int], *, loader: str | None,
                     epoch: int = 0) -> None:
    """A plan as the control API hands it over (``loader=None``: a client that names none),
    then, as ``taken_in`` does, a wait until the daemon has re-ranked the cache for it (a
    worker thread) and started its window."""
    body = np.asarray(order, dtype="<u4").tobytes()
    if loader is None:
        await s.service.submit_plan((JOB, 0), epoch, dataset, body, "<u4")
    else:
        await s.service.submit_plan((JOB, 0), epoch, dataset, body, "<u4", loader)
    await window_started(s.service.scheduler.plans[(JOB, 0, loader or "0")])


def two_domains(backend: FakeBackend) -> tuple[list[str], list[str]]:
    first = make_dataset(backend, LOADER_FILES)  # class000/..., 50 per directory
    second = [f"domain_b/img{i:05d}.jpg" for i in range(LOADER_FILES)]
    for i, path in enumerate(second):
        backend.write(path, bytes([i % 13]) * BLOCK)
    return first, second


async def read_zipped(s: System, a: list[str], b: list[str], order_a: list[int],
                      order_b: list[int]) -> tuple[list[bool], list[bool]]:
    """Read both loaders' epochs in step (``zip``), a training step between samples."""
    hits_a, hits_b = [], []
    for i, j in zip(order_a, order_b):
        hits_a.append(await read_file(s.fs, a[i]))
        hits_b.append(await read_file(s.fs, b[j]))
        await trio.sleep(LATENCY)
    return hits_a, hits_b


def shuffled(n: int, seed: int) -> list[int]:
    order = list(range(n))
    np.random.default_rng(seed).shuffle(order)
    return order


async def test_two_zipped_loaders_keep_their_plans_and_both_hit(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    a, b = two_domains(backend)
    order_a, order_b = shuffled(LOADER_FILES, 1), shuffled(LOADER_FILES, 2)
    async with open_system(backend, ram=LOADER_RAM) as s:
        da, db = await register(s, a), await register(s, b)
        await submit_for(s, da, order_a, loader="0")
        await submit_for(s, db, order_b, loader="1")
        scheduler = s.service.scheduler
        plan_a, plan_b = scheduler.plans[(JOB, 0, "0")], scheduler.plans[(JOB, 0, "1")]
        hits_a, hits_b = await read_zipped(s, a, b, order_a, order_b)
        assert scheduler.plans_of((JOB, 0)) == [plan_a, plan_b]  # neither replaced the other
        assert not plan_a.scope.cancel_called and not plan_b.scope.cancel_called
        for plan, hits in ((plan_a, hits_a), (plan_b, hits_b)):
            # each loader's reads advanced its own plan, and were counted as its requests
            assert plan.counters.used == plan.cursor == LOADER_FILES and plan.counters.skipped == 0
            assert plan.counters.requests == LOADER_FILES and plan.counters.hits == sum(hits)
            assert sum(hits[5:]) / len(hits[5:]) >= 0.99, f"{hits.count(False)} misses"
        summaries = [p["loader"] for p in (await s.service.status())["plans"]]
        assert summaries == ["0", "1"]
        job = (await s.service.stats(JOB))["jobs"][0]
        assert [p["loader"] for p in job["plans"]] == ["0", "1"] and job["plan"]["loader"] == "1"

    # Control: the same reads with both plans under one loader id (what every client sent
    # before loaders had plans of their own): the second plan replaces the first, whose
    # reads then miss.
    backend = FakeBackend(latency=LATENCY)
    a, b = two_domains(backend)
    async with open_system(backend, ram=LOADER_RAM) as s:
        da, db = await register(s, a), await register(s, b)
        await submit_for(s, da, order_a, loader=None)
        await submit_for(s, db, order_b, loader=None)
        hits_a, hits_b = await read_zipped(s, a, b, order_a, order_b)
        assert list(s.service.scheduler.plans) == [(JOB, 0, "0")]
        assert sum(hits_a) / LOADER_FILES < 0.2 and sum(hits_b[5:]) / len(hits_b[5:]) >= 0.99


async def test_the_window_budget_is_shared_by_the_loaders_being_read(
        autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    a, b = two_domains(backend)
    async with open_system(backend, ram=LOADER_RAM) as s:
        scheduler = s.service.scheduler
        budget = scheduler.window_budget
        da, db = await register(s, a), await register(s, b)
        await submit_for(s, da, list(range(LOADER_FILES)), loader="0")
        plan_a = scheduler.plans[(JOB, 0, "0")]
        await eventually(lambda: plan_a.window_bytes >= budget)
        assert plan_a.window_bytes < budget + BLOCK  # alone: the whole budget
        await submit_for(s, db, list(range(LOADER_FILES)), loader="1")
        plan_b = scheduler.plans[(JOB, 0, "1")]
        await eventually(lambda: plan_b.window_bytes >= budget // 2)
        # Reading A drains its window down to its half; B's never goes past its half.
        for i in range(100):
            assert await read_file(s.fs, a[i])
            await trio.sleep(LATENCY)
            assert plan_b.window_bytes < budget // 2 + BLOCK
        assert plan_a.window_bytes < budget // 2 + BLOCK
        assert scheduler.share() == budget // 2
        # B is read to its end: it takes no share any more, and A's window grows back.
        for path in b:
            await read_file(s.fs, path)
        assert plan_b.finished and plan_b.window_bytes == 0
        await eventually(lambda: plan_a.window_bytes >= budget)
        # A loader nobody reads for PLAN_IDLE gives its share back too.
        await submit_for(s, db, list(range(LOADER_FILES)), loader="1", epoch=1)
        plan_b = scheduler.plans[(JOB, 0, "1")]
        await eventually(lambda: scheduler.share() == budget // 2)
        for path in a[100:250]:  # A is being read all along; B not
            await read_file(s.fs, path)
            await trio.sleep((PLAN_IDLE + 1) / 150)
        assert not plan_a.finished and scheduler.share() == budget


async def test_a_later_loader_starts_at_the_clock_of_the_reads_so_far(
        autojump_clock: trio.testing.MockClock) -> None:
    """Positions of every plan are on one clock: a plan submitted after 100 reads of
    another starts at 100, so its blocks never outrank the older plan's current window."""
    backend = FakeBackend(latency=LATENCY)
    a, b = two_domains(backend)
    async with open_system(backend, ram=LOADER_RAM) as s:
        da, db = await register(s, a), await register(s, b)
        await submit_for(s, da, list(range(LOADER_FILES)), loader="0")
        for path in a[:100]:
            await read_file(s.fs, path)
        await submit_for(s, db, list(range(LOADER_FILES)), loader="1")
        scheduler = s.service.scheduler
        plan_a, plan_b = scheduler.plans[(JOB, 0, "0")], scheduler.plans[(JOB, 0, "1")]
        assert plan_a.origin == 0 and plan_a.cursor == 100 and plan_b.origin == 100
        await eventually(lambda: plan_b.counters.issued > 10 and cached(s, b[0]))  # its first blocks landed
        policy = s.cache.memory.index
        def next_use(path: str) -> int | None:
            attr = s.fs.meta.peek(path)
            assert attr is not None
            return policy.next_use(block_key(path, attr.version, 0))

        assert next_use(b[0]) == 100 and next_use(a[100]) == 100 and next_use(a[110]) == 110
        # A new epoch of loader 0 continues the clock from where its last one stood.
        for path in a[100:]:
            await read_file(s.fs, path)
        await submit_for(s, da, list(range(LOADER_FILES)), loader="0", epoch=1)
        assert scheduler.plans[(JOB, 0, "0")].origin == LOADER_FILES


async def test_a_long_re_ranking_runs_beside_the_window_and_protects_nothing_read_meanwhile(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache whose re-ranking outlasts ``RERANK_HEAD_START`` (here: its worker thread held
    until the test lets it go, as a large cache's numpy pass would take long) does not
    hold the new plan's window back: it issues while the re-ranking goes on.  And a file
    the loader reads meanwhile, after the re-ranking took its snapshot of the plan, is not
    ranked again at its passed position (it would then outrank every block still ahead
    until the next epoch)."""
    real_positions = Dataset.positions_of
    snapshot = threading.Event()  # the re-ranking has taken the plan's cursor (before its first pass)
    go_on = threading.Event()  # the test lets the re-ranking's worker thread return

    def held_positions(self: Dataset, tags: np.ndarray, inverse: np.ndarray) -> np.ndarray:
        found = real_positions(self, tags, inverse)
        snapshot.set()
        assert go_on.wait(60), "the test never let the re-ranking go on"
        return found

    async with resident_after_one_epoch(200) as (s, paths, dataset):
        keys = {}  # each file's block, as read (virtual time may pass the attributes' TTL below)
        for path in paths:
            attr = s.fs.meta.peek(path)
            assert attr is not None
            keys[path] = block_key(path, attr.version, 0)
        scheduler = s.service.scheduler
        await scheduler.plans[(JOB, 0, "0")].reranked.wait()
        monkeypatch.setattr(Dataset, "positions_of", held_positions)
        try:
            order = list(range(len(paths)))
            random.Random(2).shuffle(order)
            await submit(s, dataset, order, epoch=1)
            plan = scheduler.plans[(JOB, 0, "0")]
            await eventually(lambda: plan.counters.issued > 0)
            assert not plan.reranked.is_set(), "the window waited for the whole re-ranking"
            await eventually(snapshot.is_set)
            read = [paths[i] for i in order[:40]]
            for path in read:
                assert await read_file(s.fs, path)
            assert not plan.reranked.is_set(), "the re-ranking ended before the reads: nothing was tested"
            go_on.set()
            await plan.reranked.wait()
            policy = s.cache.memory.index
            assert [p for p in read if policy.next_use(keys[p]) is not None] == []
            assert all(policy.next_use(keys[paths[i]]) == plan.origin + at for at, i in enumerate(order) if at >= len(read))
        finally:
            go_on.set()  # a failed assertion above must not leave the thread held


async def test_a_files_read_advances_the_plan_that_reads_it_next(autojump_clock: trio.testing.MockClock) -> None:
    """Two loaders over one dataset (one registration), in different orders: a file's
    read (a READ from its start) goes to the plan that reads that file nearest its cursor."""
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, 100)
    async with open_system(backend, ram=64 << 20) as s:
        dataset = await register(s, paths)
        assert await register(s, paths) == dataset  # the same list: the same registration
        await submit_for(s, dataset, list(range(100)), loader="0")
        await submit_for(s, dataset, list(range(99, -1, -1)), loader="1")
        scheduler = s.service.scheduler
        forward, backward = scheduler.plans[(JOB, 0, "0")], scheduler.plans[(JOB, 0, "1")]
        for i in range(10):
            await read_file(s.fs, paths[i])
            await read_file(s.fs, paths[99 - i])
        assert forward.cursor == backward.cursor == 10
        assert forward.counters.requests == backward.counters.requests == 10


async def test_loaders_are_bounded_and_end_with_their_job(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    paths = make_dataset(backend, 2 * MAX_LOADERS + 3)
    async with open_system(backend, ram=64 << 20) as s:
        dataset = await register(s, paths)
        scheduler = s.service.scheduler
        for loader in range(MAX_LOADERS):  # loader k reads files 2k and 2k + 1
            await submit_for(s, dataset, [2 * loader, 2 * loader + 1], loader=str(loader))
            await trio.sleep(1)
        # Loader 3 is read to its end; loader 5 half (the others are only planned).
        for i in (6, 7, 10):
            await read_file(s.fs, paths[i])
        assert scheduler.plans[(JOB, 0, "3")].finished and not scheduler.plans[(JOB, 0, "5")].finished
        await submit_for(s, dataset, [2 * MAX_LOADERS], loader="new")
        loaders = {key[2] for key in scheduler.plans}
        assert len(loaders) == MAX_LOADERS and "3" not in loaders and "new" in loaders  # finished first
        await submit_for(s, dataset, [2 * MAX_LOADERS + 1], loader="newer")
        loaders = {key[2] for key in scheduler.plans}
        assert len(loaders) == MAX_LOADERS and "newer" in loaders
        assert "0" not in loaders and "5" in loaders  # then the one read least recently
        # Job end cancels every loader's plan.
        plans = scheduler.plans_of((JOB, 0))
        s.service.end_job((JOB, 0), "test")
        assert scheduler.plans == {} and all(p.scope.cancel_called for p in plans)


async def test_a_dropped_loaders_window_stops_being_protected(autojump_clock: trio.testing.MockClock) -> None:
    """A loader left mid-epoch (dropped, or its loop broke early) says nothing: once none
    of its files was read for PLAN_IDLE, the next re-ranking unplans its window."""
    backend = FakeBackend(latency=LATENCY)
    a, b = two_domains(backend)
    async with open_system(backend, ram=LOADER_RAM) as s:
        policy = s.cache.memory.index

        def next_use(path: str) -> int | None:
            attr = s.fs.meta.peek(path)
            assert attr is not None
            return policy.next_use(block_key(path, attr.version, 0))

        da, db = await register(s, a), await register(s, b)
        await submit_for(s, da, list(range(LOADER_FILES)), loader="0")
        for path in a[:50]:
            await read_file(s.fs, path)
        plan_a = s.service.scheduler.plans[(JOB, 0, "0")]
        await eventually(lambda: plan_a.issued_upto > 60 and s.fs.meta.peek(a[60]) is not None
                         and next_use(a[60]) is not None)
        # Another loader starts while the first is still read: its window stays protected.
        await submit_for(s, db, list(range(LOADER_FILES)), loader="1")
        await eventually(lambda: s.service.scheduler.plans[(JOB, 0, "1")].counters.issued > 0)
        assert next_use(a[60]) == 60
        # Loader 0 is never read again; loader 1 starts its next epoch after PLAN_IDLE.
        await trio.sleep(PLAN_IDLE + 1)
        await submit_for(s, db, list(range(LOADER_FILES)), loader="1", epoch=1)
        await eventually(lambda: next_use(a[60]) is None)
        assert (JOB, 0, "0") in s.service.scheduler.plans  # still listed (status), protecting nothing
