"""Metadata cache: attributes (trusted for ``attrValid``), negative lookups
(``lookupValid``) and directory listings, a listing filling its children's attributes so
that a dataset scan costs one backend call per directory; both maps are bounded by
``metaCacheEntries`` and drop their oldest entries first."""

from __future__ import annotations

import errno
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from cubefs_fuse.attrs import Attr
from cubefs_fuse.backends.base import Backend, too_many_entries
from cubefs_fuse.errors import FsError


@dataclass(frozen=True, slots=True)
class MetadataStatistics:
    attr_hits: int
    attr_misses: int
    negative_hits: int
    listing_hits: int
    listing_misses: int
    attr_entries: int
    listing_names: int


class MetadataCache:
    def __init__(self, backend: Backend, *, attr_ttl: float, lookup_ttl: float, max_entries: int) -> None:
        self.backend = backend
        self.attr_ttl = attr_ttl
        self.lookup_ttl = lookup_ttl
        self.max_entries = max_entries
        self._attrs: OrderedDict[str, tuple[float, Attr | None]] = OrderedDict()
        self._listings: OrderedDict[str, tuple[float, list[tuple[str, Attr]]]] = OrderedDict()
        self._listing_names = 0
        # Per path whose stat is in flight, set when it ends (stat's single flight).
        self._flights: dict[str, trio.Event] = {}
        self._attr_hits = self._attr_misses = self._negative_hits = 0
        self._listing_hits = self._listing_misses = 0

    async def stat(self, path: str) -> Attr:
        """Attributes of ``path``; FsError(ENOENT) if it does not exist.  A miss while a
        stat of ``path`` is in flight waits for that one (single flight: a window's stat
        and a reader's lookup of the same file make one backend call), then answers from
        what it cached (its own call if it cached nothing: it failed, or no TTL)."""
        while True:
            now = trio.current_time()
            cached = self._attrs.get(path)
            if cached is not None and cached[0] > now:
                attr = cached[1]
                if attr is None:
                    self._negative_hits += 1
                    raise FsError(errno.ENOENT)
                self._attr_hits += 1
                return attr
            flight = self._flights.get(path)
            if flight is None:
                break
            await flight.wait()
        attr, _ = await self._from_backend(path, self._backend_stat)
        return attr

    async def stat_read(self, path: str, max_size: int, want: Callable[[Attr], bool]) -> tuple[Attr, bytes | None]:
        """As :meth:`stat`; on a miss the backend's ``stat_read`` may also bring the whole
        file (see ``Backend.stat_read``): one backend call for a cold small file.  While a
        stat of ``path`` is in flight it waits for that one and brings no bytes."""
        cached = self._attrs.get(path)
        if (cached is not None and cached[0] > trio.current_time()) or path in self._flights:
            return await self.stat(path), None

        async def call(p: str) -> tuple[Attr, bytes | None]:
            return await self.backend.stat_read(p, max_size, want)

        return await self._from_backend(path, call)

    async def _backend_stat(self, path: str) -> tuple[Attr, bytes | None]:
        return await self.backend.stat(path), None

    async def _from_backend(self, path: str,
                            call: Callable[[str], Awaitable[tuple[Attr, bytes | None]]]) -> tuple[Attr, bytes | None]:
        """``call(path)`` as the one stat of ``path`` in flight, its answer cached (an
        absent file as absent, FsError(ENOENT)); waiters are woken however it ends."""
        self._attr_misses += 1
        now = trio.current_time()
        done = self._flights[path] = trio.Event()
        try:
            result = await call(path)
        except FileNotFoundError:
            self._remember(path, None, now + self.lookup_ttl if self.lookup_ttl else 0.0)
            raise FsError(errno.ENOENT) from None
        finally:
            if self._flights.get(path) is done:  # a fresh_stat may have started a newer one
                del self._flights[path]
            done.set()
        self._remember(path, result[0], now + self.attr_ttl if self.attr_ttl else 0.0)
        return result

    def hit(self, path: str) -> Attr | None:
        """As :meth:`stat` when it would answer from the cache (counted as a hit), else None
        (a miss, an expired entry or a cached absence: :meth:`stat` then does the rest).
        Synchronous: the warm path (every open of a cached file) creates no coroutine."""
        cached = self._attrs.get(path)
        if cached is None or cached[1] is None or cached[0] <= trio.current_time():
            return None
        self._attr_hits += 1
        return cached[1]

    def peek(self, path: str) -> Attr | None:
        """Cached, unexpired attributes of ``path`` without asking the backend."""
        cached = self._attrs.get(path)
        if cached is None or cached[0] <= trio.current_time():
            return None
        return cached[1]

    def trusted_until(self, path: str) -> float:
        """When ``path``'s cached attributes stop being trusted (trio's clock; 0 if none are)."""
        cached = self._attrs.get(path)
        return 0.0 if cached is None or cached[1] is None else cached[0]

    def last_validated(self, path: str) -> Attr | None:
        """The attributes the source last gave for ``path``, expired or not; None if it
        never did, said it does not exist, or they were forgotten since (invalidated,
        cleared, dropped by the bound).  Only for stale-if-error (fs/outage.py): past its
        TTL nothing else may answer from an entry."""
        cached = self._attrs.get(path)
        return None if cached is None else cached[1]

    def last_listing(self, path: str) -> list[tuple[str, Attr]] | None:
        """The listing the source last gave for ``path``, expired or not (None: none
        kept), each child with the attributes the source gave for it last: a child stat'ed
        after the listing has its newer attributes, one found absent since is left out (as
        :meth:`last_validated`, for stale-if-error only)."""
        cached = self._listings.get(path)
        if cached is None:
            return None
        listed = cached[0] - self.attr_ttl  # when the listing was validated (kept only with a TTL)
        prefix = f"{path}/" if path else ""
        entries = []
        for name, attr in cached[1]:
            later = self._attrs.get(prefix + name)
            if later is not None and self._validated(later) >= listed:
                if later[1] is None:
                    continue
                attr = later[1]
            entries.append((name, attr))
        return entries

    def _validated(self, cached: tuple[float, Attr | None]) -> float:
        """When an entry of ``_attrs`` was validated: its expiry less its TTL."""
        return cached[0] - (self.attr_ttl if cached[1] is not None else self.lookup_ttl)

    async def fresh_stat(self, path: str) -> Attr:
        """Attributes straight from the backend (and cached for the next caller): never
        the answer of a stat that was in flight before this call."""
        self.invalidate(path)
        attr, _ = await self._from_backend(path, self._backend_stat)
        return attr

    async def listdir(self, path: str, limit: int | None = None) -> list[tuple[str, Attr]]:
        """The directory's entries, cached for ``attrValid`` with their attributes;
        ``limit``: a directory of more names raises OSError(E2BIG) (``Backend.listdir``)."""
        now = trio.current_time()
        cached = self._listings.get(path)
        if cached is not None and cached[0] > now:
            self._listing_hits += 1
            if limit is not None and len(cached[1]) > limit:
                raise too_many_entries(path, limit)
            return cached[1]
        self._listing_misses += 1
        entries = await self.backend.listdir(path, limit)
        expires = now + self.attr_ttl if self.attr_ttl else 0.0
        prefix = f"{path}/" if path else ""
        for name, attr in entries:
            self._remember(prefix + name, attr, expires)
        if self.attr_ttl and len(entries) <= self.max_entries:
            old = self._listings.pop(path, None)
            if old is not None:
                self._listing_names -= len(old[1])
            self._listings[path] = (expires, entries)
            self._listing_names += len(entries)
            while self._listing_names > self.max_entries:
                _, (_, dropped) = self._listings.popitem(last=False)
                self._listing_names -= len(dropped)
        return entries

    def invalidate(self, path: str) -> None:
        self._attrs.pop(path, None)

    def clear(self) -> None:
        self._attrs.clear()
        self._listings.clear()
        self._listing_names = 0

    def _remember(self, path: str, attr: Attr | None, expires: float) -> None:
        if not expires:
            return
        self._attrs[path] = (expires, attr)
        self._attrs.move_to_end(path)
        while len(self._attrs) > self.max_entries:
            self._attrs.popitem(last=False)

    def statistics(self) -> MetadataStatistics:
        return MetadataStatistics(self._attr_hits, self._attr_misses, self._negative_hits,
                                  self._listing_hits, self._listing_misses, len(self._attrs),
                                  self._listing_names)
