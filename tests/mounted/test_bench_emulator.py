"""The benchmark suite's emulated remote (benchmarks.suite.remote.Remote over tools/slowfs_c):
latency and bandwidth as set.  The suite's end-to-end runs are in tests/torch/test_bench_suite.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from benchmarks.suite.cleanup import Registry, mounts_below
from benchmarks.suite.remote import Remote
from tests.emulator_checks import trimmed_mean

ROUNDS = 5  # measurement rounds before an accuracy test fails (see test_emulator_latency)
FILES = 16  # files of the latency test's tree


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    root = tmp_path / "backing"
    (root / "dataset" / "c0").mkdir(parents=True)
    for i in range(FILES):
        (root / "dataset" / "c0" / f"{i}.bin").write_bytes(os.urandom(4096))
    (root / "big.bin").write_bytes(os.urandom(4_000_000))
    return root


@pytest.mark.parametrize(("latency_us", "files_per_round"), [(300, 64), (2000, 16)])
def test_emulator_latency(tmp_path: Path, backing: Path, latency_us: int, files_per_round: int) -> None:
    """Through the suite's Remote, whole-file reads (open, read, close: every operation the
    systems pay) take each delayed operation's latency more than on a zero-latency twin,
    within 10 %, and the delays slowfs slept average the setting within 10 %."""
    registry = Registry(tmp_path)
    try:
        slow = Remote(backing, tmp_path / "slow", latency_us=latency_us, bandwidth_mb_s=0, registry=registry).start()
        fast = Remote(backing, tmp_path / "fast", latency_us=0, bandwidth_mb_s=0, registry=registry).start()
        names = [f"dataset/c0/{i % FILES}.bin" for i in range(files_per_round)]
        for name in names[:FILES]:  # warm up threads and slowfs's oversleep estimate
            (slow.mount_point / name).read_bytes()
            (fast.mount_point / name).read_bytes()
        seen = []
        for _ in range(ROUNDS):
            before = slow.stats()
            differences = []
            for name in names:
                start = time.perf_counter()
                (slow.mount_point / name).read_bytes()
                middle = time.perf_counter()
                (fast.mount_point / name).read_bytes()
                differences.append((middle - start) - (time.perf_counter() - middle))
            delta = slow.stats().minus(before)
            per_file_delays = delta.delays / len(names)
            added_per_op_us = trimmed_mean(differences) * 1e6 / per_file_delays
            seen.append(f"slept {delta.mean_delay_us:.0f} us, +{added_per_op_us:.0f} us per operation seen "
                        f"({per_file_delays:.1f} delayed operations per file)")
            if max(abs(delta.mean_delay_us - latency_us), abs(added_per_op_us - latency_us)) <= 0.1 * latency_us:
                break
        else:
            pytest.fail(f"set {latency_us} us; {ROUNDS} rounds: {'; '.join(seen)}")
        assert delta.delays >= 3 * len(names)  # lookup, open and read at least: latency is per operation
    finally:
        registry.cleanup()
    assert not mounts_below(tmp_path)
    print(f"\nemulator {latency_us} us: {seen[-1]}")


def test_emulator_bandwidth_cap_is_shared(tmp_path: Path, backing: Path) -> None:
    """Four concurrent readers together get the cap (within 10 %), not four times it."""
    cap_mb_s = 10.0  # 4 x 4 MB take ~1.6 s at 10 MB/s: long against per-request overheads
    readers = 4
    registry = Registry(tmp_path)
    try:
        remote = Remote(backing, tmp_path / "capped", latency_us=0, bandwidth_mb_s=cap_mb_s,
                        registry=registry).start()
        path = remote.mount_point / "big.bin"
        path.read_bytes()  # warm-up: threads started
        seen = []
        for _ in range(ROUNDS):
            barrier = threading.Barrier(readers + 1)
            sizes: list[int] = []

            def read() -> None:
                barrier.wait()
                sizes.append(len(path.read_bytes()))

            threads = [threading.Thread(target=read) for _ in range(readers)]
            for t in threads:
                t.start()
            barrier.wait()
            start = time.perf_counter()
            for t in threads:
                t.join()
            rate = sum(sizes) / (time.perf_counter() - start) / 1e6
            seen.append(f"{rate:.2f} MB/s")
            assert sizes == [4_000_000] * readers
            if abs(rate - cap_mb_s) <= 0.1 * cap_mb_s:
                break
        else:
            pytest.fail(f"cap {cap_mb_s} MB/s; {ROUNDS} rounds: {', '.join(seen)}")
        assert remote.raw_stats()["bandwidth_mb_s"] == cap_mb_s
    finally:
        registry.cleanup()
