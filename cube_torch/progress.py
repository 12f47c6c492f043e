"""How many files this process's loaders have read, per (volume, job, rank), for the daemon.
A read the kernel's page cache answers never reaches the daemon, so it cannot count the
files a job reads from there; cube_torch reports them with each hit-rate line
(``reporter.stats``), and the job's requests are the larger of what the daemon saw and
what was reported (docs/metrics.md).

A sample's files count once the training loop has its batch: the batches the loader has
handed out but those it keeps in flight (each worker's ``prefetch_factor``, asked for
before the loop gets one), and all of an epoch's once the loader has asked past its last
batch.  A loop left early counts what it was handed.  Samples a CachedDataset
serves from its store read no file and count nothing here (they are sample-cache hits)."""

from __future__ import annotations

import collections
import threading

import numpy as np

Key = tuple[str, str, int]  # (volume, job, rank)

_lock = threading.Lock()
_finished: dict[Key, int] = {}  # files of the epochs that ended, per key
_running: dict[Key, list[EpochReads]] = {}  # epochs being read (one per loader iterating)


class EpochReads:
    """One loader's epoch: the samples handed out (the sampler counts them) and, once the
    plan's files are known (the background thread), the files read up to each position."""

    def __init__(self, key: Key, ahead: int) -> None:
        self.key = key
        self.ahead = ahead  # batches the loader keeps requested ahead of the loop
        # Samples handed out after each of the last ``ahead + 1`` batches (the sampler's
        # thread appends): the first is what the loop has received.
        self._handed: collections.deque[int] = collections.deque([0], maxlen=ahead + 1)
        self.complete = False  # the loader asked past the epoch's last sample
        self.done = False  # the epoch ended (finish())
        # files_upto[n]: files of the first n positions (0 for a held sample); None until
        # the plan's files are known (none are counted before, and none without a daemon).
        self.files_upto: np.ndarray | None = None

    def set_files(self, per_position: np.ndarray) -> None:
        """Each position's file count, from the thread that maps samples to files."""
        upto = np.zeros(len(per_position) + 1, dtype=np.int64)
        np.cumsum(per_position, out=upto[1:])
        self.files_upto = upto

    def hand(self, samples: int) -> None:
        """The sampler gave the loader a batch of ``samples``."""
        self._handed.append(self._handed[-1] + samples)

    def received(self) -> int:
        """Samples the training loop has received so far (those handed out, less the
        batches the loader keeps in flight)."""
        handed = self._handed  # the sampler appends meanwhile: each deque operation is atomic
        return handed[0] if len(handed) > self.ahead else 0

    def files(self) -> int:
        upto = self.files_upto
        if upto is None:
            return 0
        last = len(upto) - 1
        return int(upto[last if self.complete else min(self.received(), last)])


def start(key: Key, ahead: int) -> EpochReads:
    epoch = EpochReads(key, ahead)
    with _lock:
        _running.setdefault(key, []).append(epoch)
    return epoch


def finish(epoch: EpochReads, complete: bool) -> None:
    """The loader's epoch ended: ``complete`` if it asked past the last sample (all of its
    samples will reach the loop), else the loop left early."""
    epoch.complete = complete
    epoch.done = True
    with _lock:
        running = _running.get(epoch.key, [])
        if epoch in running:
            running.remove(epoch)
            _finished[epoch.key] = _finished.get(epoch.key, 0) + epoch.files()
            if not running:
                del _running[epoch.key]


def files_read(key: Key) -> int:
    """The files this process's loaders have read for ``key`` (cumulative)."""
    with _lock:
        return _finished.get(key, 0) + sum(e.files() for e in _running.get(key, ()))


def forget() -> None:
    """For tests: nothing counted."""
    with _lock:
        _finished.clear()
        _running.clear()
