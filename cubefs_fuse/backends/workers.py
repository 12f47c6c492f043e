"""One worker-thread call that the caller may abandon: the backend's thread hop.
:func:`run_abandonable` is ``trio.to_thread.run_sync(fn, limiter=limiter,
abandon_on_cancel=True)`` on trio's own thread cache without what the backend never uses
(the per-call thread naming, two ``prctl`` calls, the ``from_thread`` channel and the
context copy: 30-34 against 42-48 us of CPU per no-op call, 2-core VM, 2026-11-24 at
4e2350f), keeping the semantics the backend relies on: the limiter's token is held from
before the thread starts until it really returns, a cancelled caller gets ``trio.Cancelled``
at once while the thread finishes on its own with its result dropped, and a thread that
returns after the trio run ended is ignored."""

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
    try:
        # A free token is taken without the limiter's own checkpoint (a round of the
        # scheduler, ~40 us of trio-thread CPU per call on the 2-core VM): the wait for
        # the thread below is this call's checkpoint.
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
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
