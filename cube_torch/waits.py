"""How long training steps waited for their batch: each ``DevicePrefetcher`` step adds its
wait (the time ``next()`` blocked) and its whole step (from the previous batch's hand-out
to this one's) to a histogram of the process, read as p50, p99 and the waits' share of
step time.  Pure arithmetic; the reporter prints it next to the hit-rate line."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

# Bucket edges grow by 2**(1/8) (9 %) from 1 µs: a percentile read as its bucket's
# geometric middle is within 4.5 % of the true value, and 256 buckets reach 2**32 µs
# (71 minutes, longer than any wait worth telling apart).  A wait of at most 1 µs (the
# batch was ready) reads as 0.
FIRST_EDGE = 1e-6
STEPS_PER_DOUBLING = 8
BUCKETS = 1 + 32 * STEPS_PER_DOUBLING  # bucket 0: at most FIRST_EDGE


def bucket(seconds: float) -> int:
    """The bucket of a wait: 0 up to 1 µs, then i for (edge(i-1), edge(i)]."""
    if not seconds > FIRST_EDGE:  # also NaN
        return 0
    index = int(math.ceil(math.log2(seconds / FIRST_EDGE) * STEPS_PER_DOUBLING))
    return max(1, min(BUCKETS - 1, index))


def middle(index: int) -> float:
    """The value a wait in bucket ``index`` is read as (its edges' geometric middle)."""
    if index <= 0:
        return 0.0
    return float(FIRST_EDGE * 2.0 ** ((index - 0.5) / STEPS_PER_DOUBLING))


@dataclass(frozen=True)
class DataWait:
    """Steps counted so far (or between two snapshots): their number, the seconds they
    waited and lasted in all, and the waits' histogram (``BUCKETS`` counts)."""

    steps: int = 0
    wait_seconds: float = 0.0
    step_seconds: float = 0.0
    buckets: tuple[int, ...] = (0,) * BUCKETS

    def percentile(self, q: float) -> float:
        """The nearest-rank ``q`` percentile (0 < q <= 100) of the waits, in seconds; 0
        without steps."""
        if self.steps == 0:
            return 0.0
        rank = max(1, math.ceil(q / 100.0 * self.steps))
        seen = 0
        for index, count in enumerate(self.buckets):
            seen += count
            if seen >= rank:
                return middle(index)
        return middle(BUCKETS - 1)

    @property
    def share(self) -> float:
        """The waits' share of step time (0 to 1)."""
        return self.wait_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def minus(self, earlier: DataWait) -> DataWait:
        """What was counted since ``earlier`` (a snapshot of the same counts); everything
        when ``earlier`` is not one (it counted more)."""
        if earlier.steps > self.steps:
            return self
        return DataWait(self.steps - earlier.steps, self.wait_seconds - earlier.wait_seconds,
                        self.step_seconds - earlier.step_seconds,
                        tuple(a - b for a, b in zip(self.buckets, earlier.buckets)))

    def as_dict(self) -> dict[str, float | int]:
        """For ``cube_torch.stats()``: seconds, and the share as a fraction."""
        return {"steps": self.steps, "wait_seconds": self.wait_seconds, "step_seconds": self.step_seconds,
                "p50_seconds": self.percentile(50), "p99_seconds": self.percentile(99), "share": self.share}


class WaitCounter:
    """Steps' waits, added from any thread; ``snapshot()`` reads them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps = 0
        self._wait = 0.0
        self._step = 0.0
        self._buckets = [0] * BUCKETS

    def add(self, wait: float, step: float) -> None:
        """One step that waited ``wait`` of its ``step`` seconds for its batch."""
        index = bucket(wait)
        with self._lock:
            self._steps += 1
            self._wait += wait
            self._step += step
            self._buckets[index] += 1

    def snapshot(self) -> DataWait:
        with self._lock:
            return DataWait(self._steps, self._wait, self._step, tuple(self._buckets))


def format_counts(waits: Mapping[str, float]) -> str:
    """One side of the line, from :meth:`DataWait.as_dict`'s numbers."""
    return (f"steps:{int(waits['steps'])} wait_p50_ms:{1000 * waits['p50_seconds']:.3f} "
            f"wait_p99_ms:{1000 * waits['p99_seconds']:.3f} wait_share:{100 * waits['share']:.2f}%")


def format_line(since_last: Mapping[str, float], cumulative: Mapping[str, float], rank: int | None = None) -> str:
    """The line printed after the hit-rate line (``[rank R] `` in front as there), from
    two :meth:`DataWait.as_dict`; its own words, so that parsers of the hit-rate line
    never take it for one."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    return f"{prefix}data_wait last_cycle:([{format_counts(since_last)}])  sum:([{format_counts(cumulative)}])"


# Every DevicePrefetcher of the process adds its steps here (the reporter's numbers).
process = WaitCounter()
