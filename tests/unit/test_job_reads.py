"""A job's file requests from its two witnesses: the reads the daemon answered and the
count the job's cube_torch reports (page-cache hits included, which reach no daemon)."""

from __future__ import annotations

from cubefs_fuse.prefetch.jobs import DataWait, HitCounters, JobRegistry


def counts(c: HitCounters) -> tuple[int, int, int]:
    return c.requests, c.hits, c.misses


async def test_requests_are_the_larger_witness_and_the_total_follows_the_jobs() -> None:
    jobs = JobRegistry()
    jobs.register("train", 0, 100)
    key = ("train", 0)
    jobs.record(key, waited=True, stall=0.5)  # a cold read: seen, a miss
    jobs.record(key, waited=False, stall=0.0)  # a RAM-tier hit: seen
    assert counts(jobs.jobs[key].counters) == (2, 1, 1)
    # cube_torch: its loop has read 10 files, 8 of them from the page cache (unseen).
    after = jobs.report_reads(key, 10)
    assert after is not None and counts(after) == (10, 9, 1)
    # A read it already reported adds no request when the daemon sees it late; a miss stays a miss.
    jobs.record(key, waited=True, stall=0.25)
    assert counts(jobs.jobs[key].counters) == (10, 8, 2)
    # An older or repeated report changes nothing (cumulative counts, ranks report on their own).
    assert counts(jobs.report_reads(key, 7) or HitCounters()) == (10, 8, 2)
    # Reads nobody reports (a job without cube_torch) still count as the daemon saw them.
    for _ in range(15):
        jobs.record(key, waited=False, stall=0.0)
    assert counts(jobs.jobs[key].counters) == (18, 16, 2)
    # The total is the jobs' sum plus reads of no job, and never counts a read twice.
    jobs.record(None, waited=False, stall=0.0)
    assert counts(jobs.total) == (19, 17, 2)
    assert jobs.total.stall_seconds == 0.75
    # since_last restarts per call; a re-registered rank keeps its counts.
    first = jobs.report("train")
    assert first["jobs"][0]["since_last"]["requests"] == 18
    jobs.report_reads(key, 20)
    second = jobs.report("train")
    assert (second["jobs"][0]["since_last"]["requests"], second["jobs"][0]["since_last"]["hits"]) == (2, 2)
    jobs.register("train", 0, 101)
    assert counts(jobs.jobs[key].counters) == (20, 18, 2)


async def test_a_report_for_no_registered_job_is_refused() -> None:
    jobs = JobRegistry()
    assert jobs.report_reads(("nobody", 0), 5) is None
    assert counts(jobs.total) == (0, 0, 0)



async def test_the_newest_data_wait_is_kept_and_an_older_one_ignored() -> None:
    jobs = JobRegistry()
    jobs.register("train", 0, 100)
    key = ("train", 0)
    assert jobs.jobs[key].data_wait is None
    jobs.report_reads(key, 0, DataWait(10, 0.5, 4.0, 0.01, 0.2))
    jobs.report_reads(key, 0, DataWait(8, 0.4, 3.0, 0.01, 0.2))  # late, from before the first
    assert jobs.jobs[key].data_wait == DataWait(10, 0.5, 4.0, 0.01, 0.2)
    jobs.report_reads(key, 5)  # a report without waits keeps them
    assert jobs.jobs[key].data_wait == DataWait(10, 0.5, 4.0, 0.01, 0.2)
    jobs.register("train", 0, 101)  # a new pid for the rank keeps them too
    assert jobs.jobs[key].data_wait == DataWait(10, 0.5, 4.0, 0.01, 0.2)
