"""The sample store's ops on the data socket, through the same connection, hello and ring as
the fast path's batches (control/dataplane.py; client: cube_torch/samples/daemon_store.py),
for the connection's peer uid: ``sample_get {name, keys}`` → ``[offset, length]`` or
``null`` per key for the prefix of the keys that fits the ring (NVMe entries read straight
to a 4 KiB boundary there); ``sample_put {name, items: [[key, offset, length(,
digest)]...]}`` → ``{"stored": n}`` once the entries the client wrote into the ring are on
NVMe or in RAM (``digest`` is the client's checksum of its own entry, stored as given);
``sample_plan {name, count(, held)}`` with ``count`` int64 keys at the ring's start, and
with ``held`` a byte per key saying whether the cache holds it. A refusal is ``{"error",
"status"}`` and keeps the connection; a malformed message closes it; every op is bounded
(MAX_SAMPLE_KEYS keys, one ring of bytes, COPY_STEP bytes between checkpoints)."""

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
