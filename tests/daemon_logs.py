"""What the daemons the tests start write to their logs, checked after every mounted and
torch test (the ``daemon_log_check`` fixture in tests/conftest.py).

Whatever starts a daemon (:class:`tests.helpers.Mount`, :class:`tests.cli_checks.Env`)
registers its ``logDir`` with :func:`watch`; after each test :func:`unexpected` reads what
every watched log gained since the last check and returns the records that say something
went wrong: an ERROR or CRITICAL record (with its traceback, for ``log.exception``), and
anything the process wrote outside the log format that holds a traceback or a Python
warning (a detached daemon's stderr is its log file).  A test that provokes such a record on
purpose declares it: ``@pytest.mark.expected_daemon_errors(REGEX, ...)``, each a regex
searched in the record's text.  A daemon shared by a module's tests (a module-scoped
fixture) is checked after each of them, and once more after the module's teardown.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

# A record of cubefs_fuse.cli.LOG_FORMAT: "2026-11-28 14:03:07,123 ERROR cubefs_fuse.x: ...".
RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) ")
BAD_LEVELS = frozenset({"ERROR", "CRITICAL"})
# What a process's stderr carries when something went wrong outside logging: a traceback
# (an uncaught exception, a thread's, an unraisable one) or a warning (warnings.showwarning).
BAD_RAW = re.compile(r"^Traceback \(most recent call last\):|^Exception ignored in|^\S+:\d+: \w*Warning: ", re.M)


class Logs:
    """Log directories to check, and how far each of their files has been checked."""

    def __init__(self) -> None:
        self.directories: list[Path] = []  # in the order they were registered
        self.checked: dict[Path, tuple[int, int]] = {}  # log file -> (inode, bytes checked)

    def watch(self, log_dir: Path) -> None:
        """Check the ``*.log`` files of ``log_dir`` (a daemon's ``logDir``) from now on."""
        if log_dir not in self.directories:
            self.directories.append(log_dir)

    def new_text(self) -> list[tuple[Path, str]]:
        """What each watched log gained since the last call (whole lines only; a file
        replaced by another, as logrotate does, is read from its start)."""
        gained = []
        for directory in self.directories:
            for path in sorted(directory.glob("*.log")) if directory.is_dir() else []:
                try:
                    with open(path, "rb") as f:
                        st = os.fstat(f.fileno())
                        inode, size = st.st_ino, st.st_size
                        known, start = self.checked.get(path, (inode, 0))
                        start = start if known == inode and start <= size else 0
                        f.seek(start)
                        data = f.read()
                except FileNotFoundError:  # rotated away between the glob and the open
                    continue
                end = data.rfind(b"\n") + 1  # a line still being written is read next time
                self.checked[path] = (inode, start + end)
                if end:
                    gained.append((path, data[:end].decode(errors="replace")))
        return gained

    def unexpected(self, expected: Iterable[str]) -> list[str]:
        """The records the watched logs gained since the last call that say something went
        wrong and match none of the ``expected`` regexes, each prefixed with its file."""
        patterns = [re.compile(p) for p in expected]
        found = []
        for path, text in self.new_text():
            for record in records(text):
                if is_bad(record) and not any(p.search(record) for p in patterns):
                    found.append(f"{path}:\n{record}")
        return found


def records(text: str) -> list[str]:
    """``text`` cut into log records: a record's continuation lines (a traceback, or what the
    process wrote to stderr after it) stay with it; lines before the first record are one."""
    out: list[str] = []
    for line in text.splitlines():
        if RECORD.match(line) or not out:
            out.append(line)
        else:
            out[-1] += "\n" + line
    return out


def is_bad(record: str) -> bool:
    """An ERROR or CRITICAL record, or one with a traceback or a warning in its lines."""
    head = RECORD.match(record)
    return (head is not None and head.group(1) in BAD_LEVELS) or BAD_RAW.search(record) is not None


# The tests' one set (tests/conftest.py checks it; Mount, Env and a few tests register).
LOGS = Logs()
watch = LOGS.watch
unexpected = LOGS.unexpected
