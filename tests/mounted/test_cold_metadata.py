"""Metadata from a slow remote without round trips in series, through a real mount.

Before: listing a directory through the mount cost one ``lstat`` after another on the
remote (1,024 entries at 1 ms: 3.4 s through the mount; the plan window listed each new
directory that way too, which left a COCO or VOC epoch 0 without hits).  Now a listing
reads its entries' attributes in parallel chunks, and a plan stats its files in parallel.
The overlap is shown by the remote's own count of operations in progress at once
(slowfs's ``max_concurrent``), not by a timing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from cubefs_fuse.control.protocol import ControlClient, read_volume_config
from tests.helpers import SlowMount, wait_until

ENTRIES = 200
LATENCY_US = 2000


def fill(slow: SlowMount, directory: str) -> None:
    (slow.real / directory).mkdir()
    for i in range(ENTRIES):
        (slow.real / directory / f"f{i:03d}.jpg").write_bytes(bytes([i % 251]) * (i + 1))


def job_counts(client: ControlClient) -> tuple[int, int]:
    """(requests, hits) of the job "cold"."""
    jobs = client.stats("cold")["jobs"]
    return (jobs[0]["cumulative"]["requests"], jobs[0]["cumulative"]["hits"]) if jobs else (0, 0)


def test_a_listing_overlaps_its_entries_stats_on_the_remote(make_slow_mount: Callable[..., SlowMount]) -> None:
    slow = make_slow_mount(latency_us=LATENCY_US)
    fill(slow, "d")
    slow.mount.mount()
    assert slow.slowfs.stats()["max_concurrent"] < 4  # mounting asks one thing at a time
    listed = {e.name: e.stat(follow_symlinks=False).st_size for e in os.scandir(slow.mount.path("d"))}
    assert listed == {f"f{i:03d}.jpg": i + 1 for i in range(ENTRIES)}
    stats = slow.slowfs.stats()
    assert stats["ops"]["lookup"] >= ENTRIES  # every entry was stat'ed on the remote ...
    assert stats["max_concurrent"] >= 4  # ... several at once (one after the other before)


def test_a_plan_stats_its_files_in_parallel_and_never_lists_them(make_slow_mount: Callable[..., SlowMount]) -> None:
    slow = make_slow_mount(latency_us=LATENCY_US, profile="ai_prefetch")
    fill(slow, "coco")
    slow.mount.mount()
    volume = read_volume_config(slow.mount.config()["volName"])
    client = ControlClient(volume.control_socket, timeout=10)
    paths = [f"coco/f{i:03d}.jpg" for i in range(ENTRIES)]
    dataset = client.register_dataset(paths)
    client.register_job("cold", 0)
    before = slow.slowfs.stats()["ops"]
    order = np.random.default_rng(1).permutation(ENTRIES).astype("<u4")
    client.submit_plan("cold", 0, 0, dataset, order.tobytes(), "<u4", first=32)
    # The answer came once the first 32 files were local: reading them now, each open is
    # a hit for the job (this process).
    for i in order[:32]:
        assert (slow.mount.path(paths[i])).read_bytes() == bytes([i % 251]) * (i + 1)
    wait_until(lambda: job_counts(client) == (32, 32), 10, "the 32 releases to be counted")
    wait_until(lambda: slow.slowfs.stats()["ops"].get("read", 0) - before.get("read", 0) >= ENTRIES, 30,
               "the plan's files to be fetched")
    ops = slow.slowfs.stats()
    assert ops["ops"].get("readdir", 0) == before.get("readdir", 0)  # no directory listed for the plan
    assert ops["max_concurrent"] >= 4
