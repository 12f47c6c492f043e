"""Hit-rate lines every ``CUBE_TORCH_METRICS_INTERVAL`` seconds, at the end of every epoch
and once at exit, in the format of CubeFS's cube_torch so that existing log parsers work
(``user memory last_cycle_metrics:([request_count:... hit_rate:...% ...])
sum_metrics:([...])``, prefixed ``[rank R] `` in a distributed job), printed to stdout and
logged (logger ``cube_torch``, INFO); ``cube_torch.stats()`` returns the same counters.
``last_cycle_metrics`` is computed here from the job's cumulative counters at this process's
previous report, because the daemon's own since-last counters restart whenever any rank of
the job asks.  When a ``DevicePrefetcher`` has counted steps, a ``data_wait`` line follows
(how long steps waited for their batch: ``cube_torch.waits``), and ``stats()`` carries the
same numbers; they are this process's, measured here, and never reach the daemon."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from cube_torch import progress, shared, waits
from cube_torch.client import rank, submitter, warn_once, world_size
from cubefs_fuse.control.protocol import ControlClient, ProtocolError, read_volume_config

log = logging.getLogger("cube_torch")

# Default seconds between hit-rate lines: often enough to watch an epoch of a small job,
# rare enough to be noise-free in a long one.  Override with CUBE_TORCH_METRICS_INTERVAL.
DEFAULT_INTERVAL = 30.0
# The exit line waits at most this long for the daemon: a process on its way out must
# not hang on a daemon that does not answer.
EXIT_TIMEOUT = 2.0
_thread: threading.Thread | None = None
_stop = threading.Event()
_wake = threading.Event()  # set by stop() and epoch_ended(): the thread stops waiting
_lock = threading.Lock()
_exit_hook_pid = 0  # the process whose exit prints the last line (0: none registered)
_exit_reported_pid = 0  # the process that printed its exit line (two hooks may ask for it)


def interval() -> float:
    try:
        value = float(os.environ.get("CUBE_TORCH_METRICS_INTERVAL", DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL
    return value if value > 0 else DEFAULT_INTERVAL


def _counts(c: dict[str, Any]) -> str:
    requests, hits, misses = int(c["requests"]), int(c["hits"]), int(c["misses"])
    hit_rate = 100.0 * hits / requests if requests else 0.0
    miss_rate = 100.0 * misses / requests if requests else 0.0
    return (f"request_count:{requests} hit_count:{hits} miss_count:{misses} "
            f"hit_rate:{hit_rate:.2f}% miss_rate:{miss_rate:.2f}%")


def format_line(since_last: dict[str, Any], cumulative: dict[str, Any], rank: int | None = None) -> str:
    """The CubeFS line; ``rank`` (a distributed job's) goes in front as ``[rank R] ``."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    return (f"{prefix}user memory last_cycle_metrics:([{_counts(since_last)} ])  "
            f"sum_metrics:([{_counts(cumulative)}])")


_COUNTERS = ("requests", "hits", "misses", "stall_seconds", "sample_hits")
# Each (volume, job, rank)'s cumulative counters at this process's previous report.
_previous: dict[tuple[str, str, int], dict[str, Any]] = {}
_previous_lock = threading.Lock()


def _since(previous: dict[str, Any] | None, cumulative: dict[str, Any]) -> dict[str, Any]:
    if previous is None or int(previous["requests"]) > int(cumulative["requests"]):
        return dict(cumulative)  # the first report, or the daemon restarted and counts anew
    since: dict[str, Any] = {key: cumulative[key] - previous.get(key, 0) for key in _COUNTERS if key in cumulative}
    since["hit_rate"] = since["hits"] / since["requests"] if since["requests"] else 0.0
    return since


def with_sample_hits(daemon: dict[str, Any], sample_hits: int) -> dict[str, Any]:
    """The daemon's cumulative counters of the job with its sample-cache hits added: each is
    a request and a hit (``sample_hits`` says how many of them there are)."""
    counts = dict(daemon)
    counts["sample_hits"] = sample_hits
    counts["requests"] = int(daemon["requests"]) + sample_hits
    counts["hits"] = int(daemon["hits"]) + sample_hits
    counts["hit_rate"] = counts["hits"] / counts["requests"] if counts["requests"] else 0.0
    return counts


# The process's step waits at its previous report (stats() or a line): since-last is the
# difference, as for the daemon's counters.
_previous_waits = waits.DataWait()


def _waits_since_last() -> tuple[waits.DataWait, waits.DataWait] | None:
    """(since the previous report, cumulative) of the process's prefetcher steps; None
    before any step."""
    global _previous_waits
    cumulative = waits.process.snapshot()
    if cumulative.steps == 0:
        return None
    with _previous_lock:
        since = cumulative.minus(_previous_waits)
        _previous_waits = cumulative
    return since, cumulative


def _daemon_stats(timeout: float) -> dict[str, Any] | None:
    last = submitter.last_job
    if last is None:
        return None
    key = (last.vol_name, last.job, last.rank)
    try:
        volume = read_volume_config(last.vol_name)
        client = ControlClient(volume.control_socket, timeout=timeout)
        files = progress.files_read(key)
        waited = waits.process.snapshot()
        if files or waited.steps:
            # First the files the loaders read, those the page cache served included
            # (they never reach the daemon): the job's requests count them; and how long
            # the steps waited for their batches, which the daemon exports per job.
            wait = {k: v for k, v in waited.as_dict().items() if k != "share"} if waited.steps else None
            try:
                client.report_reads(last.job, last.rank, files, wait)
            except ProtocolError as exc:
                if exc.status == 0:
                    raise  # no daemon: no line either
                # A daemon that refuses (an older release, a job it ended): the line
                # counts what the daemon saw, as it did before.
                warn_once(f"reads-refused:{exc.status}", "the cubefs-fuse daemon refused this job's read count: %s",
                          exc)
        report = client.stats(last.job)
    except ProtocolError:
        return None
    for entry in report.get("jobs", []):
        if entry.get("rank") == last.rank:
            cumulative = with_sample_hits(entry["cumulative"], shared.job_sample_hits(key))
            with _previous_lock:
                since = _since(_previous.get(key), cumulative)
                _previous[key] = cumulative
            return {"job": last.job, "rank": last.rank, "world_size": last.world_size, "cumulative": cumulative,
                    "since_last": since, "plan": entry.get("plan")}
    return None


def stats(timeout: float = 5.0) -> dict[str, Any] | None:
    """This process's (job, rank) counters from the daemon: cumulative and since this
    process's previous ``stats()`` (or line); with ``data_wait`` (the same two, of the
    process's DevicePrefetcher steps) once one counted steps."""
    result = _daemon_stats(timeout)
    if result is not None:
        waited = _waits_as_dicts(_waits_since_last())
        if waited is not None:
            result["data_wait"] = waited
    return result


def _waits_as_dicts(waited: tuple[waits.DataWait, waits.DataWait] | None) -> dict[str, Any] | None:
    return None if waited is None else {"since_last": waited[0].as_dict(), "cumulative": waited[1].as_dict()}


def _print(line: str) -> None:
    log.info("%s", line)
    if not _on_console(log):
        # One write of the whole line: ranks printing to one pipe at once must not interleave
        # (print() writes the line and its newline separately).
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def report_once(timeout: float = 5.0, *, unless_idle: bool = False) -> str | None:
    """Print and log the hit-rate line now and return it; None (and no hit-rate line) if no
    daemon has this job, or with ``unless_idle`` if nothing was read since this process's
    previous line.  The data_wait line follows whenever a DevicePrefetcher counted steps
    (with ``unless_idle``: steps since the previous line), also without a daemon."""
    current = stats(timeout)
    line = None
    if current is not None and not (unless_idle and current["since_last"]["requests"] == 0):
        line = format_line(current["since_last"], current["cumulative"],
                           current["rank"] if current["world_size"] > 1 else None)
        _print(line)
    waited = current.get("data_wait") if current is not None else _waits_as_dicts(_waits_since_last())
    if waited is not None and not (unless_idle and waited["since_last"]["steps"] == 0):
        ranks = current["world_size"] if current is not None else world_size()
        this_rank = current["rank"] if current is not None else rank()
        _print(waits.format_line(waited["since_last"], waited["cumulative"], this_rank if ranks > 1 else None))
    return line


def _is_console(stream: Any) -> bool:
    """True for the process's stdout or stderr (also after a redirection of sys.stdout)."""
    if stream is None:
        return False
    if any(stream is s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)):
        return True
    try:
        return stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):
        return False


def _on_console(logger: logging.Logger) -> bool:
    """Whether an INFO record of ``logger`` reaches a handler that writes it to stdout or
    stderr (``logging.basicConfig(level=INFO)``, to either stream, or the user's own
    StreamHandler): then the log line is the printed line.  A file handler, a handler
    above INFO, or no handler at all (Python's last resort shows warnings only) leaves
    the printing to cube_torch."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if (handler.level <= logging.INFO and isinstance(handler, logging.StreamHandler)
                    and not isinstance(handler, logging.FileHandler) and _is_console(handler.stream)):
                return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def _run(still_needed: Callable[[], int]) -> None:
    global _thread
    while True:
        _wake.wait(interval())
        if _stop.is_set():
            return
        _wake.clear()
        try:
            report_once()
        except Exception as exc:  # a reporting problem must never reach training
            log.debug("cube_torch: metrics report failed: %r", exc)
        with _lock:  # decided under the lock: ensure_running() then starts a fresh thread
            if not still_needed():
                # Every loader that planned is gone: nothing left to report on.  The next
                # plan starts the thread again, so no thread outlives training.
                if _thread is threading.current_thread():
                    _thread = None
                return


def ensure_running(still_needed: Callable[[], int]) -> None:
    """Start the reporting thread if it is not running; it ends when ``still_needed()`` is 0.

    Also arranges one last line when this process exits (DataLoader workers never print:
    a forked worker skips atexit, a spawned one never plans).  A rank that multiprocessing
    started (``torch.multiprocessing.spawn``, Lightning's ``ddp_spawn``, Accelerate's
    ``notebook_launcher``) ends in ``os._exit`` without atexit; multiprocessing runs its
    exit finalizers there instead, so the hook is registered with both.
    """
    global _thread, _exit_hook_pid
    with _lock:
        if _exit_hook_pid != os.getpid():
            _exit_hook_pid = os.getpid()
            atexit.register(_report_at_exit, _exit_hook_pid)
            multiprocessing.util.Finalize(None, _report_at_exit, args=(_exit_hook_pid,), exitpriority=0)
        if _thread is None or not _thread.is_alive():
            _stop.clear()
            _wake.clear()
            _thread = threading.Thread(target=_run, args=(still_needed,), name="cube_torch-metrics", daemon=True)
            _thread.start()


def epoch_ended() -> None:
    """A planned epoch handed out its last index: the reporter prints a line now."""
    _wake.set()


def _report_at_exit(pid: int) -> None:
    global _exit_reported_pid
    with _lock:
        if pid != os.getpid() or _exit_reported_pid == pid:
            return  # a forked child that runs exit handlers (its parent reports), or reported already
        _exit_reported_pid = pid
    stop()
    try:
        # Nothing read since the previous line (an epoch's end, the interval): that line's
        # sum_metrics is the final count, and a last_cycle of 0 requests (or of 0 steps)
        # would say nothing.
        report_once(EXIT_TIMEOUT, unless_idle=_previous_reported())
    except Exception as exc:  # never turn a clean exit into an error
        log.debug("cube_torch: final metrics report failed: %r", exc)


def _previous_reported() -> bool:
    """Whether this process has printed a line (or answered stats()) for its current job,
    or (without a daemon's) a data_wait line."""
    last = submitter.last_job
    with _previous_lock:
        return (last is not None and (last.vol_name, last.job, last.rank) in _previous) or _previous_waits.steps > 0


def stop() -> None:
    global _thread
    _stop.set()
    _wake.set()
    with _lock:
        thread, _thread = _thread, None
    if thread is not None:
        thread.join(timeout=5)
