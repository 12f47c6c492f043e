"""One worker-thread call that the caller may abandon: the backend's thread hop.

:func:`run_abandonable` is ``trio.to_thread.run_sync(fn, limiter=limiter,
abandon_on_cancel=True)`` without what the backend never uses, built on trio's own thread
cache (``trio.lowlevel.start_thread_soon``, the cache ``to_thread`` itself runs on):

* no thread naming: ``to_thread`` formats a name from the task and sets it on the OS
  thread before each call and back after it (two ``prctl`` syscalls per call);
* no ``trio.from_thread`` channel back into trio (``fn`` never calls into trio) and no copy
  of the task's context variables (``fn`` reads none).

The semantics the backend relies on are ``to_thread``'s, and kept:

* the call holds one token of ``limiter`` from before the thread starts until the thread
  really returns, abandoned or not: a hung remote ties up at most ``limiter``'s total
  threads, and a new call waits for a token (under its caller's deadline);
* on cancellation the caller gets ``trio.Cancelled`` at once and the thread is left to
  finish on its own; its result, or error, is dropped;
* a thread that returns after the trio run ended is ignored.

Measured on the development VM (2 cores): ``to_thread.run_sync`` of a no-op costs 42-48 µs
of process CPU, this 30-34 µs (the rest is the two threads' wake-ups and the GIL handoff).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")


class _Borrower:
    """The limiter's borrower for one call: a unique object, not the task (a task may
    have several calls in flight through a nursery, each holding its own token)."""

    __slots__ = ()


async def run_abandonable(fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
    """``fn()`` in a worker thread under ``limiter``; abandoned (not waited for) on cancel."""
    await trio.lowlevel.checkpoint_if_cancelled()
    borrower = _Borrower()
    await limiter.acquire_on_behalf_of(borrower)
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    abandoned = False

    def report(result: outcome.Outcome[T]) -> None:
        # In the trio thread, once the worker thread has returned.
        limiter.release_on_behalf_of(borrower)
        if not abandoned:
            trio.lowlevel.reschedule(task, result)

    def deliver(result: outcome.Outcome[T]) -> None:
        # In the worker thread, after fn.
        try:
            token.run_sync_soon(report, result)
        except trio.RunFinishedError:
            pass  # the run is over: nobody is waiting, and the limiter is gone with it

    try:
        trio.lowlevel.start_thread_soon(fn, deliver)
    except BaseException:
        limiter.release_on_behalf_of(borrower)
        raise

    def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        nonlocal abandoned
        abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED

    result: T = await trio.lowlevel.wait_task_rescheduled(abort)
    return result
