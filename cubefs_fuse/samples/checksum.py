"""A sample entry's checksum: what the daemon stores in the entry's header on NVMe and
checks on every read (samples/files.py), and what a client may compute and send with a
put (control/sampleplane.py) so that the daemon need not read the payload to compute it.

The xxh3-64 of the owner's uid (u32), the key (i64) and the payload's length (u64), all
little-endian, then the cache's name (UTF-8), then the payload.  ``uid`` is the owner as
the daemon sees it (its SO_PEERCRED uid, which the data socket's hello answers: in a user
namespace it differs from the client's own ``os.geteuid()``).

Imported by cube_torch inside training processes (through control/protocol.py): xxhash and
the standard library only.
"""

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
