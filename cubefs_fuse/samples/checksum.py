"""A sample entry's checksum, stored in the entry's NVMe header and checked on every read
(samples/files.py), and computed by a client with its put (control/sampleplane.py) so that
the daemon need not read the payload: the xxh3-64 of the owner's uid (u32), the key (i64)
and the payload's length (u64), little-endian, then the cache's name (UTF-8), then the
payload, ``uid`` being the owner as the daemon sees it (the uid the data socket's hello
answers, which differs from the client's own in a user namespace). Imported by cube_torch
through control/protocol.py, so xxhash and the standard library only."""

from __future__ import annotations

import struct

import xxhash

_FIELDS = struct.Struct("<IqQ")


def entry_digest(uid: int, name: bytes, key: int, payload: bytes | bytearray | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(_FIELDS.pack(uid, key, len(payload)))
    h.update(name)
    h.update(payload)
    return int(h.intdigest())
