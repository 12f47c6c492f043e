"""The daemon-log check of the mounted and torch tests (tests/daemon_logs.py): what it
reports, what it lets pass, and that it reads each line once."""

from __future__ import annotations

import os
from pathlib import Path

from tests.daemon_logs import Logs

INFO = "2026-11-28 14:03:07,123 INFO cubefs_fuse.daemon: serving /src on /mnt"
WARNING = "2026-11-28 14:03:08,000 WARNING cubefs_fuse.fs.core: backend read of 'a' failed: EIO"
ERROR = "2026-11-28 14:03:09,000 ERROR cubefs_fuse.backends.deadline: backend down: read of 'a' got no answer"
EXCEPTION = ("2026-11-28 14:03:10,000 ERROR cubefs_fuse.control.server: control API handler failed\n"
             "Traceback (most recent call last):\n"
             '  File "routes.py", line 1, in handler\n'
             "KeyError: 'x'")


def logs_in(tmp_path: Path, text: str) -> tuple[Logs, Path]:
    logs = Logs()
    logs.watch(tmp_path)
    path = tmp_path / "vol.log"
    path.write_text(text)
    return logs, path


def test_errors_and_tracebacks_are_reported_whole_and_other_levels_are_not(tmp_path: Path) -> None:
    logs, path = logs_in(tmp_path, "\n".join([INFO, WARNING, ERROR, EXCEPTION, INFO]) + "\n")
    assert logs.unexpected([]) == [f"{path}:\n{ERROR}", f"{path}:\n{EXCEPTION}"]


def test_what_the_process_wrote_outside_the_log_format_is_reported_if_it_went_wrong(tmp_path: Path) -> None:
    uncaught = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom"
    warning = "/x/y.py:12: RuntimeWarning: coroutine 'f' was never awaited\n  f()"
    logs, path = logs_in(tmp_path, f"{uncaught}\n{INFO}\n{warning}\ncubefs-fuse: error: key 'x': bad\n")
    # The warning stays with the record before it (all continuation lines do).
    assert logs.unexpected([]) == [f"{path}:\n{uncaught}",
                                   f"{path}:\n{INFO}\n{warning}\ncubefs-fuse: error: key 'x': bad"]


def test_expected_records_pass_by_a_regex_searched_in_the_whole_record(tmp_path: Path) -> None:
    logs, _ = logs_in(tmp_path, f"{ERROR}\n{EXCEPTION}\n")
    assert logs.unexpected([r"backend down: read of 'a'", "KeyError"]) == []
    (tmp_path / "other").mkdir()
    logs, path = logs_in(tmp_path / "other", f"{ERROR}\n{EXCEPTION}\n")
    assert logs.unexpected([r"backend down: read of 'b'"]) == [f"{path}:\n{ERROR}", f"{path}:\n{EXCEPTION}"]


def test_each_line_is_read_once_a_partial_line_later_and_a_rotated_file_from_its_start(tmp_path: Path) -> None:
    logs, path = logs_in(tmp_path, f"{ERROR}\n")
    assert len(logs.unexpected([])) == 1
    assert logs.unexpected([]) == []  # already checked
    with open(path, "a") as f:
        f.write(ERROR[:30])  # the daemon is still writing this line
    assert logs.unexpected([]) == []
    with open(path, "a") as f:
        f.write(ERROR[30:] + "\n")
    assert logs.unexpected([]) == [f"{path}:\n{ERROR}"]
    os.rename(path, tmp_path / "vol.log.1")  # logrotate: a new file at the same path
    path.write_text(f"{EXCEPTION}\n")
    assert logs.unexpected([]) == [f"{path}:\n{EXCEPTION}"]


def test_a_directory_that_does_not_exist_yet_is_checked_once_it_does(tmp_path: Path) -> None:
    logs = Logs()
    logs.watch(tmp_path / "log")
    assert logs.unexpected([]) == []
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "vol.log").write_text(f"{ERROR}\n")
    assert logs.unexpected([]) == [f"{tmp_path / 'log' / 'vol.log'}:\n{ERROR}"]
