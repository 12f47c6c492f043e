"""backends/workers.py: the backend's abandonable worker-thread call, on real threads."""

from __future__ import annotations

import threading
import time

import pytest
import trio
import trio.testing

from cubefs_fuse.backends.workers import run_abandonable

# How long a test waits for a thread it released (generous: the machine may be loaded).
SLACK = 10.0


async def _until(predicate: object, what: str) -> None:
    assert callable(predicate)
    with trio.fail_after(SLACK):
        while not predicate():
            await trio.sleep(0.005)


async def test_returns_the_value_from_another_thread() -> None:
    limiter = trio.CapacityLimiter(2)
    caller = threading.get_ident()
    ident = await run_abandonable(threading.get_ident, limiter)
    assert ident != caller
    assert await run_abandonable(lambda: 41 + 1, limiter) == 42
    assert limiter.borrowed_tokens == 0


async def test_raises_the_threads_error() -> None:
    limiter = trio.CapacityLimiter(1)

    def fail() -> None:
        raise FileNotFoundError(2, "gone")

    with pytest.raises(FileNotFoundError):
        await run_abandonable(fail, limiter)
    assert limiter.borrowed_tokens == 0


async def test_cancel_abandons_the_thread_which_keeps_its_token_until_it_returns() -> None:
    limiter = trio.CapacityLimiter(1)
    release = threading.Event()
    returned = threading.Event()

    def hang() -> str:
        release.wait(SLACK)
        returned.set()
        return "late"

    with trio.move_on_after(0.05) as scope:
        await run_abandonable(hang, limiter)
    assert scope.cancelled_caught  # the caller did not wait for the thread
    assert not returned.is_set() and limiter.borrowed_tokens == 1
    # The only token is held by the abandoned thread: a new call waits for it.
    with trio.move_on_after(0.05) as scope:
        await run_abandonable(lambda: None, limiter)
    assert scope.cancelled_caught
    release.set()
    await _until(lambda: limiter.borrowed_tokens == 0, "the abandoned thread's token")
    assert returned.is_set()
    assert await run_abandonable(lambda: "next", limiter) == "next"


async def test_a_cancelled_caller_never_starts_a_thread() -> None:
    limiter = trio.CapacityLimiter(1)
    ran = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await run_abandonable(lambda: ran.append(1), limiter)
    assert ran == [] and limiter.borrowed_tokens == 0


async def test_at_most_the_limiters_tokens_run_at_once() -> None:
    limiter = trio.CapacityLimiter(3)
    lock = threading.Lock()
    running = [0]
    peak = [0]
    release = threading.Event()

    def job() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(SLACK)
        with lock:
            running[0] -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(run_abandonable, job, limiter)
        await _until(lambda: running[0] == 3, "three jobs running")
        await trio.sleep(0.05)
        assert running[0] == 3 and limiter.borrowed_tokens == 3
        release.set()
    assert peak[0] == 3 and limiter.borrowed_tokens == 0


def test_a_thread_returning_after_the_run_ended_is_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    release = threading.Event()
    returned = threading.Event()

    def hang() -> None:
        release.wait(SLACK)
        returned.set()

    async def main() -> None:
        with trio.move_on_after(0.05):
            await run_abandonable(hang, trio.CapacityLimiter(1))

    trio.run(main)  # ends with the thread still running
    release.set()
    assert returned.wait(SLACK)
    time.sleep(0.2)  # its delivery into the finished run, just after
    # trio's thread cache prints an error its delivery raised (it cannot raise it anywhere).
    assert "Exception while delivering" not in capsys.readouterr().err
