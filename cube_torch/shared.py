"""What a training process shares with its forked DataLoader workers: one small page.

The main process maps it when cube_torch is imported, before any worker forks; a forked
worker inherits the mapping.  It holds:

* **sample-cache hits**: the samples CachedDatasets served from their store, counted by
  whichever process served them.  No file is read for them, so the daemon never sees
  them; the hit-rate line adds them to the daemon's counts of the job (a sample served
  from the cache is a hit of the job).  The page holds one count for the tree; the main
  process notes where each job's hits start (the count when it sends the job's first
  plan, before any of its samples is asked for), so a training run after another one in
  the same process counts only its own.  Jobs that read at the same time in one process
  (two loaders with different job names) share the hits since the earlier one started.
* **what was said**: the kinds of trouble some process of the tree has warned about, so
  one cause (a wrong ``VOL_NAME``, a daemon that is not running, a dataset outside the
  mount) is one warning per process tree, not one per worker and epoch.

Every update holds a POSIX record lock on the page's memfd (such locks belong to a
process, so forked processes exclude each other) and a thread lock within the process:
a few microseconds, once per batch.  A worker started by ``spawn`` or ``forkserver``
imports cube_torch afresh and maps a page of its own: its hits are not in the main
process's line, and it warns for itself.  Without memfd (not Linux) nothing is shared:
hits count in the main process only, warnings are once per process.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading

# Layout: the sample-cache hit count (u64), the bytes of what was said (u32), then the
# kinds said, each UTF-8 and NUL-terminated.  One page holds ~40 kinds of ~100 bytes; a
# kind that no longer fits is warned about once per process instead.
_HEADER = struct.Struct("<QI")
_page: mmap.mmap | None = None
_fd = -1
_thread_lock = threading.Lock()


def _map() -> None:
    global _page, _fd
    try:
        fd = os.memfd_create("cube_torch-shared", os.MFD_CLOEXEC)
        os.ftruncate(fd, mmap.PAGESIZE)
        page = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED)
    except (AttributeError, OSError):  # no memfd here: nothing shared
        return
    _page, _fd = page, fd


def _after_fork_in_child() -> None:
    global _thread_lock
    _thread_lock = threading.Lock()  # another thread of the parent may have held it at the fork


class _Locked:
    """The page under both locks (the thread's and the process's)."""

    def __enter__(self) -> mmap.mmap:
        assert _page is not None
        _thread_lock.acquire()
        try:
            fcntl.lockf(_fd, fcntl.LOCK_EX)
        except BaseException:
            _thread_lock.release()
            raise
        return _page

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.lockf(_fd, fcntl.LOCK_UN)
        finally:
            _thread_lock.release()


_local_hits = 0  # without a page


def add_sample_hits(count: int) -> None:
    """``count`` samples were served from a sample cache (in this process)."""
    global _local_hits
    if count <= 0:
        return
    if _page is None:
        _local_hits += count
        return
    with _Locked() as page:
        hits, said = _HEADER.unpack_from(page, 0)
        _HEADER.pack_into(page, 0, hits + count, said)


def sample_hits() -> int:
    """Samples served from sample caches by this process tree so far."""
    if _page is None:
        return _local_hits
    with _Locked() as page:
        hits: int = _HEADER.unpack_from(page, 0)[0]
        return hits


# (volume, job, rank) -> the tree's sample-cache hits when this process sent that job's
# first plan (main process only: that is where plans are sent and lines printed).
_job_starts: dict[tuple[str, str, int], int] = {}


def job_started(job: tuple[str, str, int]) -> None:
    """A plan of ``job`` (volume, job, rank) is about to be sent; the job's first marks
    where its sample-cache hits start (later epochs keep counting from there)."""
    if job not in _job_starts:
        _job_starts[job] = sample_hits()


def job_sample_hits(job: tuple[str, str, int]) -> int:
    """Samples served from sample caches by this process tree since ``job``'s first plan
    (all of them for a job that sent none from this process)."""
    return sample_hits() - _job_starts.get(job, 0)


def first_in_tree(kind: str) -> bool:
    """True if no process of this tree has said ``kind`` yet; it now has."""
    if _page is None:
        return True
    entry = kind.encode("utf-8", "surrogateescape") + b"\0"
    with _Locked() as page:
        hits, said = _HEADER.unpack_from(page, 0)
        start = _HEADER.size
        if (b"\0" + page[start:start + said]).find(b"\0" + entry) >= 0:  # a whole kind, not a suffix of one
            return False
        if start + said + len(entry) <= len(page):
            page[start + said:start + said + len(entry)] = entry
            _HEADER.pack_into(page, 0, hits, said + len(entry))
        return True


def forget() -> None:
    """For tests: nothing said, no hits, no job started."""
    global _local_hits
    _local_hits = 0
    _job_starts.clear()
    if _page is not None:
        with _Locked() as page:
            _HEADER.pack_into(page, 0, 0, 0)


_map()
os.register_at_fork(after_in_child=_after_fork_in_child)
