"""A reader that reads a mount's files in a loop while its daemon is replaced under it
(an upgrade, a crash and its recovery): every failure and every read of other bytes is
recorded, and the longest wait between two reads measured."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers import Mount, wait_until

FILES = 60
SIZE = 100_000

def fill(m: Mount) -> dict[str, bytes]:
    rng = random.Random(5)
    contents = {f"d/f{i}": rng.randbytes(SIZE + i) for i in range(FILES)}
    (m.source / "d").mkdir()
    for rel, data in contents.items():
        (m.source / rel).write_bytes(data)
    return contents


class Reader:
    """Reads every file in turn (open, read, close) until stopped; counts reads and
    records every failure and every read that returned other bytes."""

    def __init__(self, m: Mount, contents: dict[str, bytes]) -> None:
        self.m, self.contents = m, contents
        self.reads = 0
        self.errors: list[str] = []
        self.longest_wait = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        names = sorted(self.contents)
        last = time.monotonic()
        while not self._stop.is_set():
            rel = names[self.reads % len(names)]
            try:
                if self.m.path(rel).read_bytes() != self.contents[rel]:
                    self.errors.append(f"{rel}: other bytes")
            except OSError as exc:
                self.errors.append(f"{rel}: {exc!r}")
            self.reads += 1
            now = time.monotonic()
            self.longest_wait, last = max(self.longest_wait, now - last), now

    @contextmanager
    def running(self) -> Iterator[Reader]:
        self._thread.start()
        try:
            wait_until(lambda: self.reads >= 2 * FILES, 30, "the reader to read every file twice")
            yield self
            before = self.reads
            wait_until(lambda: self.reads >= before + FILES, 30, "the reader to go on reading")
        finally:
            self._stop.set()
            self._thread.join(timeout=30)

