"""The sample store's ops on the data socket: entries through the connection's memfd ring.

The same connection, hello and ring as the fast path's batches (control/dataplane.py);
client: cube_torch/samples/daemon_store.py.  The caller is the connection's peer uid
(SO_PEERCRED, checked at accept against the control socket's policy): a name is the
caller's own, ``~UID/NAME`` another user's (samples/store.py says who may do what).

* ``{"op": "sample_get", "name": N, "keys": [k, ...]}`` → ``{"entries": [[offset, length] |
  null, ...]}``: the entries are laid out in the ring from offset 0 (those read from NVMe
  each at a 4 KiB boundary, read there directly); ``null`` is a miss.
  The answer may cover only a prefix of the keys (what fits the ring); the client asks
  again for the rest.  The bytes belong to the client until its next message.
* ``{"op": "sample_put", "name": N, "items": [[key, offset, length] | [key, offset, length,
  digest], ...]}`` → ``{"stored": n}``: the client wrote the entries into the ring first
  (the ring is sealed against resizing only, so the client's mapping may write); the daemon
  writes them to NVMe (or copies them to RAM) before it answers, so the ring is the
  client's again once the answer arrives.  ``n`` entries were kept (a store may drop any:
  full, still loading).  ``digest``, optional: the entry's checksum
  (samples/checksum.py's ``entry_digest``, with the uid the hello answered), computed by
  the client right after it wrote the entry (in its CPU's cache: ~4 us for 150 KB, where
  the daemon's own read of the payload cost ~17 us, measured); the daemon stores it as
  given.  It is the client's word about its own entry only: a wrong one makes the entry
  fail the check of every read (a miss, never served; then freed).
* ``{"op": "sample_plan", "name": N, "count": c}`` → ``{"planned": c}``: the next order of
  the cache's keys, ``c`` little-endian int64s at the start of the ring (at most
  MAX_SAMPLE_PLAN_KEYS: one ring).  With ``"held": true`` the answer also has ``"held": h``
  and the ring's first ``c`` bytes say, key by key, whether the cache holds an entry (1)
  or not (0): what the client need not have prefetched.

A request the store refuses (a bad name, a foreign cache, too large, no room) is
answered ``{"error": ..., "status": <HTTP-like status>}`` and the connection stays open;
only a malformed message (not JSON, an unknown op) closes it, as for batches.
Every op is bounded: at most MAX_SAMPLE_KEYS keys per message, at most a ring of bytes,
copied COPY_STEP at a time between checkpoints of the trio thread (a put's entries: in
worker threads, see samples/store.py's put_many).
"""

from __future__ import annotations

from typing import Any

import trio

from cubefs_fuse.control.dataplane import COPY_STEP, Ring
from cubefs_fuse.control.server import STATUS_OF, Peer
from cubefs_fuse.errors import BadRequest, RequestError, TooLarge
from cubefs_fuse.limits import MAX_SAMPLE_ENTRY_BYTES, MAX_SAMPLE_KEYS, MAX_SAMPLE_PLAN_KEYS
from cubefs_fuse.samples.store import SampleStore

_INT64 = (-(1 << 63), (1 << 63) - 1)


def _key(value: Any) -> int:
    if type(value) is not int or not _INT64[0] <= value <= _INT64[1]:
        raise BadRequest("sample keys must be 64-bit signed integers")
    return value


def _keys(value: Any) -> list[int]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_SAMPLE_KEYS:
        raise BadRequest(f"'keys' must be a list of 1-{MAX_SAMPLE_KEYS} integer keys")
    return [_key(k) for k in value]


class SamplePlane:
    """Serves the ``sample_*`` ops of one daemon's data socket over its :class:`SampleStore`."""

    def __init__(self, store: SampleStore) -> None:
        self.store = store
        self.requests = 0
        self.errors = 0

    async def serve(self, data: dict[str, Any], ring: Ring, peer: Peer) -> dict[str, Any]:
        self.requests += 1
        try:
            op = data.get("op")
            if op == "sample_get":
                return await self._get(data, ring, peer)
            if op == "sample_put":
                return await self._put(data, ring, peer)
            if op == "sample_plan":
                return await self._plan(data, ring, peer)
            raise BadRequest("op must be 'sample_get', 'sample_put' or 'sample_plan'")
        except RequestError as exc:
            self.errors += 1
            return {"error": str(exc), "status": STATUS_OF.get(type(exc), 400)}

    async def _get(self, data: dict[str, Any], ring: Ring, peer: Peer) -> dict[str, Any]:
        keys = _keys(data.get("keys"))
        # The store reads NVMe entries straight into the ring (worker threads) and hands back
        # the RAM entries to copy there; the view dies with this call (the ring is the
        # client's again once answered).
        with memoryview(ring.map) as whole:
            layout, copies = await self.store.get_into(peer.uid, data.get("name"), keys, whole)
        copied = 0
        for offset, entry in copies:
            ring.map[offset:offset + len(entry)] = entry
            copied += len(entry)
            if copied >= COPY_STEP:
                copied = 0
                await trio.lowlevel.checkpoint()
        return {"entries": [None if place is None else list(place) for place in layout]}

    async def _put(self, data: dict[str, Any], ring: Ring, peer: Peer) -> dict[str, Any]:
        raw = data.get("items")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_SAMPLE_KEYS:
            raise BadRequest(f"'items' must be a list of 1-{MAX_SAMPLE_KEYS} [key, offset, length] items")
        # Who may write is checked before any byte is copied.
        self.store.resolve(peer.uid, data.get("name"), write=True)
        spans: list[tuple[int, int, int]] = []
        digests: dict[int, int] = {}  # a key's last item decides (as for its payload)
        for item in raw:
            if not isinstance(item, list) or not 3 <= len(item) <= 4:
                raise BadRequest("each item must be [key, offset, length] or [key, offset, length, digest]")
            key, offset, length = _key(item[0]), item[1], item[2]
            if len(item) == 4:
                if type(item[3]) is not int or not 0 <= item[3] < 1 << 64:
                    raise BadRequest(f"item {key}: a digest is an unsigned 64-bit integer")
                digests[key] = item[3]
            else:
                digests.pop(key, None)
            if type(offset) is not int or type(length) is not int or not 0 <= offset <= offset + length <= ring.size:
                raise BadRequest(f"item {key}: [offset, length] must lie inside the ring of {ring.size} bytes")
            if length > MAX_SAMPLE_ENTRY_BYTES:
                raise TooLarge(f"item {key}: an entry is at most {MAX_SAMPLE_ENTRY_BYTES} bytes")
            spans.append((key, offset, length))
        # The store gets views of the ring: it writes NVMe straight from them and copies only
        # what goes to RAM, in worker threads (a copy lands in fresh memory, whose page faults
        # were most of a put's cost and held the trio thread for milliseconds per batch).
        # The views die with this call: the ring is the client's again once answered.
        with memoryview(ring.map) as whole:
            views = [(key, whole[offset:offset + length]) for key, offset, length in spans]
            try:
                stored = await self.store.put_many(peer.uid, data.get("name"), views, digests)
            finally:
                for _, view in views:
                    view.release()
        return {"stored": stored}

    async def _plan(self, data: dict[str, Any], ring: Ring, peer: Peer) -> dict[str, Any]:
        count = data.get("count")
        if type(count) is not int or not 0 <= count <= MAX_SAMPLE_PLAN_KEYS or count * 8 > ring.size:
            raise BadRequest(f"'count' must be an integer in [0, {MAX_SAMPLE_PLAN_KEYS}] (keys in the ring)")
        self.store.resolve(peer.uid, data.get("name"), write=True)
        # Up to a ring (32 MiB) of keys: copied in a worker thread, not on the trio thread.
        keys = await trio.to_thread.run_sync(lambda: ring.map[:count * 8])
        planned = await self.store.plan(peer.uid, data.get("name"), keys, source=peer.pid)
        if data.get("held") is not True:
            return {"planned": planned}
        # Asked for: which of the keys the cache holds, one byte each, over the keys' start.
        held = await self.store.held(peer.uid, data.get("name"), keys)
        await trio.to_thread.run_sync(lambda: ring.map.__setitem__(slice(0, len(held)), held.tobytes()))
        return {"planned": planned, "held": int(held.sum())}
