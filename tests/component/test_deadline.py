"""DeadlineBackend on trio's virtual clock: a hung remote costs EIO, never a stuck caller.

Over FakeBackend (its ``hang()`` holds every operation, ``gate()`` one file's reads):
deadline -> EIO and down, fail-fast while down (nothing reaches the remote), the probe's
recovery, ENOTCONN marking down at once, abort at shutdown, cached data still served.
Over a real LocalDirBackend with a blocking ``pread``: abandoned threads stay bounded by
``backendThreads`` however many operations time out.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from cubefs_fuse.backends.deadline import DeadlineBackend
from cubefs_fuse.backends.localdir import LocalDirBackend
from cubefs_fuse.fs.inodes import ROOT_INODE
from tests.fakes import FakeBackend
from tests.stack import BLOCK, open_stack

TIMEOUT = 30.0
PROBE = 1.0


@asynccontextmanager
async def supervised(inner: FakeBackend | LocalDirBackend, timeout: float = TIMEOUT) -> AsyncIterator[DeadlineBackend]:
    backend = DeadlineBackend(inner, timeout, probe_interval=PROBE)
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.supervise)
        yield backend
        nursery.cancel_scope.cancel()


def fake_with(files: dict[str, bytes]) -> FakeBackend:
    fake = FakeBackend()
    for path, data in files.items():
        fake.write(path, data)
    return fake


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {op: n for op, n in counts.items() if n}


async def expect_eio(call: object) -> None:
    with pytest.raises(OSError) as failure:
        await call  # type: ignore[misc]
    assert failure.value.errno == errno.EIO, failure.value


async def test_deadline_gives_eio_marks_down_and_counts(autojump_clock: trio.testing.MockClock) -> None:
    fake = fake_with({"a": b"x" * 10})
    version = fake.version("a")
    fake.gate("a")  # the read starts and never gets an answer
    async with supervised(fake) as backend:
        start = trio.current_time()
        await expect_eio(backend.read_block("a", version, 0, 10))
        assert trio.current_time() - start == pytest.approx(TIMEOUT)
        stats = backend.statistics()
        assert nonzero(stats.timeouts) == {"read": 1} and not stats.up and backend.down


async def test_fail_fast_while_down_then_probe_recovers(autojump_clock: trio.testing.MockClock) -> None:
    fake = fake_with({"a": b"x" * 10, "b": b"y" * 10})
    async with supervised(fake) as backend:
        fake.hang()
        await expect_eio(backend.stat("a"))
        sent = sum(fake.operations.values())
        start = trio.current_time()
        for _ in range(50):  # each fails at once, none reaches the remote
            await expect_eio(backend.stat("b"))
            await expect_eio(backend.read_block("b", fake.version("b"), 0, 10))
        assert trio.current_time() == start and sum(fake.operations.values()) == sent
        assert nonzero(backend.statistics().failed_fast) == {"stat": 50, "read": 50}
        # The probe keeps asking, one at a time, each under its own deadline.
        await trio.sleep(60)
        assert backend.down and fake.probes >= 5 and fake.held <= 1 + 1  # the hung stat + one probe
        fake.unhang()
        await trio.sleep(backend.probe_timeout + PROBE + 0.1)
        assert not backend.down and backend.statistics().up
        assert (await backend.stat("b")).size == 10
        assert await backend.read_block("b", fake.version("b"), 0, 10) == b"y" * 10


async def test_failing_probe_keeps_it_down(autojump_clock: trio.testing.MockClock) -> None:
    fake = fake_with({"a": b"x"})
    fake.fail("a", errno.ENOTCONN)  # the remote's mount went away under us
    fake.probe_error = errno.ENOTCONN
    async with supervised(fake) as backend:
        with pytest.raises(OSError) as gone:
            await backend.stat("a")
        assert gone.value.errno == errno.ENOTCONN and backend.down  # down at once, no deadline waited
        await trio.sleep(20 * PROBE)
        assert backend.down and fake.probes >= 10
        await expect_eio(backend.stat(""))
        fake.heal("a")
        fake.probe_error = 0
        await trio.sleep(PROBE + 0.1)
        assert not backend.down and (await backend.stat("a")).size == 1


async def test_estale_asks_for_one_probe_without_going_down(autojump_clock: trio.testing.MockClock) -> None:
    fake = fake_with({"a": b"x"})
    fake.fail("a", errno.ESTALE)
    async with supervised(fake) as backend:
        for _ in range(20):
            with pytest.raises(OSError):
                await backend.stat("a")
        await trio.sleep(0.1)
        assert fake.probes == 1 and not backend.down  # rate-limited: one per interval


async def test_abort_ends_operations_in_flight_at_once(autojump_clock: trio.testing.MockClock) -> None:
    fake = fake_with({"a": b"x"})
    fake.hang()
    async with supervised(fake) as backend:
        results: list[int] = []

        async def stat() -> None:
            try:
                await backend.stat("a")
            except OSError as exc:
                results.append(exc.errno or 0)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(stat)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            backend.abort()
        assert results == [errno.EIO] * 3 and trio.current_time() == start
        await expect_eio(backend.stat("a"))
        assert nonzero(backend.statistics().timeouts) == {}


async def test_cached_data_and_metadata_are_served_while_the_remote_hangs(
        autojump_clock: trio.testing.MockClock) -> None:
    fake = fake_with({"d/cached": b"c" * 3000, "d/other": b"o" * 3000})
    async with supervised(fake) as backend, open_stack(backend) as stack:
        fs = stack.fs
        d = await fs.lookup(ROOT_INODE, "d")
        await fs.opendir(d.inode)  # the listing caches both files' attributes
        cached = await fs.lookup(d.inode, "cached")
        other = await fs.lookup(d.inode, "other")
        assert await fs.read(cached.inode, 0, 0, 3000, pid=1) == b"c" * 3000
        fake.hang()
        sent = sum(fake.operations.values())
        start = trio.current_time()
        assert (await fs.lookup(d.inode, "cached")).inode == cached.inode  # attributes within their TTL
        assert await fs.read(cached.inode, 0, 0, 3000, pid=1) == b"c" * 3000  # RAM hit
        assert (await fs.getattr(cached.inode)).attr.size == 3000
        assert trio.current_time() == start and sum(fake.operations.values()) == sent
        await expect_eio(fs.read(other.inode, 0, 0, 100, pid=1))  # a miss waits the deadline once ...
        assert trio.current_time() - start == pytest.approx(TIMEOUT)
        await expect_eio(fs.read(other.inode, 0, 1000, 100, pid=1))  # ... then fails fast
        assert trio.current_time() - start == pytest.approx(TIMEOUT)
        assert await fs.read(cached.inode, 0, 0, 10, pid=1) == b"c" * 10  # and the cached file is still served
        fake.unhang()


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait (real time, virtual time standing still) for worker threads to report back."""
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await trio.sleep(0)


async def test_abandoned_threads_stay_bounded_by_backend_threads(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real worker threads: virtual time moves only when the test jumps it, so a deadline
    never passes before a thread has started or a probe's thread has answered."""
    clock = autojump_clock
    clock.autojump_threshold = float("inf")
    (tmp_path / "f").write_bytes(b"z" * 100)
    threads = 4
    inner = LocalDirBackend(str(tmp_path), threads)
    version = (await inner.stat("f")).version
    release = threading.Event()
    entered: list[int] = []
    real_pread = os.pread

    def hung_pread(fd: int, size: int, offset: int) -> bytes:
        entered.append(threading.get_ident())
        release.wait()
        return real_pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", hung_pread)
    try:
        async with supervised(inner) as backend:
            async with trio.open_nursery() as nursery:
                for _ in range(3 * threads):
                    nursery.start_soon(expect_eio, backend.read_block("f", version, 0, 100))
                await until(lambda: len(entered) == threads, "the threads to enter pread")
                clock.jump(TIMEOUT)
            stats = backend.statistics()
            # 12 timed out; 4 had a thread in pread, 8 were still waiting for one.
            assert nonzero(stats.timeouts) == {"read": 3 * threads} and not stats.up
            assert len(entered) == threads and stats.threads_abandoned == threads == stats.threads_busy
            # The probe (stat + statvfs of the root, its own thread) answers: up again.
            await until(lambda: not backend.down, "the probe")
            # The abandoned threads keep their tokens: a new read waits for one, times
            # out, and starts no thread.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(expect_eio, backend.read_block("f", version, 0, 100))
                await trio.testing.wait_all_tasks_blocked()
                clock.jump(TIMEOUT)
            assert len(entered) == threads and backend.statistics().threads_abandoned == threads
            release.set()  # the remote answers: the abandoned threads return their tokens
            await until(lambda: backend.statistics().threads_busy == 0, "the abandoned threads")
            assert backend.statistics().threads_abandoned == 0
            clock.jump(PROBE)  # the supervisor's pause after a probe
            await until(lambda: not backend.down, "the probe")
            assert await backend.read_block("f", version, 0, 100) == b"z" * 100
    finally:
        release.set()
        inner.close()


async def test_a_lookup_that_reads_is_under_the_stat_deadline(autojump_clock: trio.testing.MockClock) -> None:
    fake = fake_with({"a": b"x" * 10})
    fake.gate("a")  # the read part of stat_read starts and never gets an answer
    async with supervised(fake) as backend:
        start = trio.current_time()
        await expect_eio(backend.stat_read("a", BLOCK, lambda attr: True))
        assert trio.current_time() - start == pytest.approx(TIMEOUT)
        assert nonzero(backend.statistics().timeouts) == {"stat": 1} and backend.down
        await expect_eio(backend.stat_read("a", BLOCK, lambda attr: True))  # fails fast while down
        assert nonzero(backend.statistics().failed_fast) == {"stat": 1}
