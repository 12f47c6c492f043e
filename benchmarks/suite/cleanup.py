"""Never leave a mount or a process behind: a registry of what the suite started.

Every mount and child process is registered the moment it starts (before it is known to
be up, so an interrupt during start-up is covered too).  :meth:`Registry.cleanup` runs in
the suite's ``finally``, from ``atexit`` and after SIGINT/SIGTERM (both turned into
``KeyboardInterrupt`` by :func:`signals_interrupt`); it undoes everything in reverse order,
each step bounded in time, and then sweeps the work directory: any mount still below it
is detached (``fusermount3 -u -z``) and any process whose command line names it is
killed by its pid.  Only processes the suite started name its (fresh, unique) work
directory, so the sweep never touches anything else.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from cubefs_fuse import mounts

# Seconds a child gets to exit after SIGTERM before SIGKILL (slowfs, rclone and JuiceFS
# unmount on SIGTERM; a clean unmount takes well under a second).
TERM_TIMEOUT_S = 10.0


def mounts_below(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first."""
    prefix = str(root.resolve()).rstrip("/") + "/"
    found = [e.mount_point for e in mounts.mount_table() if (e.mount_point + "/").startswith(prefix)]
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def processes_naming(root: Path) -> list[int]:
    """Pids of live processes (not this one) whose command line mentions ``root``."""
    needle = str(root.resolve()).encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue  # exited meanwhile
        if needle in cmdline and state != b"Z":  # a zombie is already dead (its parent reaps it)
            pids.append(int(entry))
    return pids


def stop_process(proc: subprocess.Popen[bytes], timeout: float = TERM_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL past ``timeout``; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def detach(mount_point: Path | str) -> None:
    """Lazily unmount ``mount_point`` if anything is mounted there."""
    if mounts.find_mount(str(mount_point)) is not None:
        subprocess.run(["fusermount3", "-u", "-z", str(mount_point)], capture_output=True, timeout=30)


class Registry:
    """A stack of clean-up actions plus a sweep of the work directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._done = False
        atexit.register(self.cleanup)

    def push(self, what: str, action: Callable[[], None]) -> Callable[[], None]:
        """Register ``action``; returns a function that runs it now and unregisters it."""
        entry = (what, action)
        with self._lock:
            self._actions.append(entry)

        def run_now() -> None:
            with self._lock:
                if entry not in self._actions:
                    return
                self._actions.remove(entry)
            action()

        return run_now

    def process(self, what: str, proc: subprocess.Popen[bytes]) -> Callable[[], None]:
        return self.push(what, lambda: stop_process(proc))

    def cleanup(self) -> list[str]:
        """Undo everything (idempotent); returns what had to be swept by force."""
        with self._lock:
            actions, self._actions = self._actions[::-1], []
        for what, action in actions:
            try:
                action()
            except Exception as exc:  # keep going: the sweep below is the safety net
                print(f"cleanup: {what}: {exc!r}", file=sys.stderr)
        swept = []
        if self.workdir.exists():
            for mount_point in mounts_below(self.workdir):
                detach(mount_point)
                swept.append(f"mount {mount_point}")
            for pid in processes_naming(self.workdir):
                try:
                    os.kill(pid, signal.SIGKILL)
                    swept.append(f"process {pid}")
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + TERM_TIMEOUT_S
            while processes_naming(self.workdir) and time.monotonic() < deadline:
                time.sleep(0.05)
        if swept:
            print(f"cleanup: swept {', '.join(swept)}", file=sys.stderr)
        return swept


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread (once each)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        # A second signal during clean-up must not cut it short: ignore from now on.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """While cleaning up: no signal may interrupt it."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
