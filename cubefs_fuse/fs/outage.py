"""Stale-if-error: while the source counts as down, a lookup, getattr or opendir
whose answer would need the source is answered from what it last said, if what that
answer leads to is held whole (docs/contracts.md, "Outages of the source").

The decision, for one path whose metadata the source failed to give:

* the failure is the outage's: ``EIO`` or the remote's mount gone (``ENOTCONN``,
  ``ECONNABORTED``), and the source counts as down (``Outage.down_since``, set by
  backends/deadline.py from the first deadline expiry or lost mount until a probe
  answers).  Any other failure (the source answered: ``EACCES``, ``ELOOP``, no such file)
  is passed on as it is;
* the metadata cache still remembers the attributes the source last gave for the path
  (its last validation, however long ago; not forgotten since: not invalidated by a read
  that found a newer version, by ``drop-cache``, nor evicted by ``metaCacheEntries``);
* a regular file is served only if every block of exactly that version is held by a
  cache tier (RAM or NVMe) now: its reads are then cache hits, never a guessed or partial
  byte.  A directory has no bytes: its attributes let the kernel reach the cached files
  beneath it.  Anything else (a symlink, whose target is not cached; a remembered
  absence) fails as before;
* a listing is served if the metadata cache still holds the directory's last listing.

Nothing here waits: each decision is dict lookups on the trio thread, one per block of
the file (a read of the whole file makes as many), never anything proportional to the
cache.  The first answer the source gives afterwards revalidates
as any expired entry does, and a file that changed meanwhile gets a new inode
(fs/inodes.py): stale answers never outlive the outage.  Each stale answer is counted
(per FUSE operation), and each outage logged once, at its first stale answer.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Protocol

from cubefs_fuse.attrs import Attr
from cubefs_fuse.fs.blocks import FileBlocks
from cubefs_fuse.fs.metadata import MetadataCache

log = logging.getLogger(__name__)

# The errors that say "no answer from the source" (a deadline, a fail-fast refusal while
# down, the remote's mount gone), as opposed to an answer the source gave.
NO_ANSWER = frozenset({errno.EIO, errno.ENOTCONN, errno.ECONNABORTED})
# The FUSE operations a stale answer can serve: one counter each, from the start (a
# bounded label set; an alert on rate() sees 0, not "no data", before the first outage).
OPS = ("lookup", "getattr", "opendir")


class Outage(Protocol):
    """Whether the source counts as down (backends/deadline.py's DeadlineBackend)."""

    @property
    def down_since(self) -> float | None:
        """When the current outage began (trio's clock), or None while the source answers."""
        ...


@dataclass(frozen=True, slots=True)
class StaleStatistics:
    served: dict[str, int]  # op -> answers given from the last validated metadata while down


class StaleIfError:
    """Decides whether a failed answer may be replaced by the last validated one (module
    doc).  ``outage`` None: never (``staleIfError`` off, or no deadline backend)."""

    def __init__(self, meta: MetadataCache, blocks: FileBlocks, outage: Outage | None) -> None:
        self.meta = meta
        self.blocks = blocks
        self.outage = outage
        self._served: dict[str, int] = dict.fromkeys(OPS, 0)
        self._logged: float | None = None  # the down_since of the outage already logged

    def _down(self, exc: OSError) -> bool:
        return self.outage is not None and exc.errno in NO_ANSWER and self.outage.down_since is not None

    def attr(self, path: str, exc: OSError, op: str) -> Attr | None:
        """The attributes to answer ``op`` on ``path`` with instead of raising ``exc``,
        or None (the caller raises it)."""
        if not self._down(exc):
            return None
        attr = self.meta.last_validated(path)
        if attr is None or not (attr.is_dir or (attr.is_file and self.blocks.cached_fraction(path, attr) == 1.0)):
            return None
        self._count(op)
        return attr

    def listing(self, path: str, exc: OSError) -> list[tuple[str, Attr]] | None:
        """The listing to answer an opendir of ``path`` with instead of raising ``exc``, or None."""
        if not self._down(exc):
            return None
        entries = self.meta.last_listing(path)
        if entries is None:
            return None
        self._count("opendir")
        return entries

    def _count(self, op: str) -> None:
        self._served[op] += 1
        assert self.outage is not None
        since = self.outage.down_since
        if since != self._logged:
            self._logged = since
            log.warning("the source is down: cached files are served at the version last validated "
                        "(staleIfError); files not held whole fail with EIO until the source answers again")

    def statistics(self) -> StaleStatistics:
        return StaleStatistics(dict(self._served))
