"""Job lifetime without FUSE: a job whose process exits ends at once (pidfd); a job that
cannot be watched (pid 0, another pid namespace) ends after ``jobIdleTimeout`` without
an open or a plan, unless it stays active; its plan goes, its dataset is no longer
pinned, and once no plan is left the cache's blocks are unplanned again.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import trio
import trio.testing

from cubefs_fuse.prefetch import service as service_module
from cubefs_fuse.prefetch.service import PrefetchService
from tests.fakes import FakeBackend
from tests.stack import BLOCK, open_stack, stack_config

IDLE = 600.0


@asynccontextmanager
async def open_service(backend: FakeBackend) -> AsyncIterator[PrefetchService]:
    async with open_stack(backend, stack_config(mem_cache_size=1 << 20, job_idle_timeout=IDLE), service=True) as stack:
        yield stack.service


async def plan_for(service: PrefetchService, job: str, paths: list[str]) -> str:
    dataset, _ = await service.register_dataset(b"\0".join(p.encode() for p in paths), 1)
    await service.submit_plan((job, 0), 0, dataset.id, np.arange(len(paths), dtype="<i8").tobytes(), "<i8")
    return dataset.id


async def advance(clock: trio.testing.MockClock, seconds: float) -> None:
    """Move virtual time by hand (an autojump clock also leaps while a worker thread runs,
    which would age the jobs during a dataset registration), then let every task react."""
    step = IDLE / 8  # below the idle check's interval (IDLE / 4): no check is skipped
    while seconds > 0:
        clock.jump(min(step, seconds))
        seconds -= step
        await trio.testing.wait_all_tasks_blocked()


async def test_pid0_job_ends_when_idle_and_releases_its_dataset(mock_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    paths = [f"f{i}" for i in range(10)]
    for p in paths:
        backend.write(p, b"x" * BLOCK)
    async with open_service(backend) as service:
        await service.register_job("container", 0, 0, caller_uid=None)
        await service.register_job("busy", 0, 0, caller_uid=None)  # the latest pid-0 job: gets the opens
        dataset = await plan_for(service, "container", paths)
        await advance(mock_clock, IDLE / 2)
        await service.submit_plan(("busy", 0), 0, dataset, np.arange(3, dtype="<i8").tobytes(), "<i8")
        await advance(mock_clock, IDLE / 2 + IDLE / 4 + 1)  # past the timeout and one idle check
        assert ("container", 0) not in service.jobs.jobs
        assert ("container", 0, "0") not in service.scheduler.plans
        assert ("busy", 0) in service.jobs.jobs  # active half a timeout ago: still there
        await advance(mock_clock, IDLE)
        assert service.jobs.jobs == {} and service.scheduler.plans == {}
        assert service.ended == 2
        # Nothing pins the dataset any more: the LRU budget may drop it.
        service._make_room(service_module.MAX_DATASET_BYTES)
        assert dataset not in service.datasets


async def test_watched_job_ends_when_its_process_exits() -> None:
    backend = FakeBackend()
    paths = [f"f{i}" for i in range(4)]
    for p in paths:
        backend.write(p, b"x" * BLOCK)
    async with open_service(backend) as service:
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            await service.register_job("trainer", 0, child.pid, caller_uid=None)
            await plan_for(service, "trainer", paths)
            service.reap_idle()  # a watched job is never idle-reaped, however long it waits
            assert ("trainer", 0) in service.jobs.jobs
            assert child.stdin is not None
            child.stdin.close()  # the trainer exits
            with trio.fail_after(30):
                while service.jobs.jobs or service.scheduler.plans:
                    await trio.sleep(0.01)
            assert service.ended == 1
        finally:
            child.kill()
            child.wait()
