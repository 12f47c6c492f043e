"""Cache keys: a block of one version of one file, the 128-bit xxh3 of (path, version, block
index), where the version is size, mtime, inode number and ctime, because ``rsync -a``/``cp
-p`` preserve mtime and often size but replace the file or touch ctime; a changed file gets
new keys and its old blocks age out, never served again."""

from __future__ import annotations

import struct

import xxhash

from cubefs_fuse.attrs import FileVersion

KEY_BYTES = 16
_VERSION = struct.Struct("<QqQqQ")  # size, mtime_ns, ino, ctime_ns, block index


def path_tag(path: str) -> int:
    """A 64-bit hash of a path: kept with cached blocks so a plan can rank them."""
    return xxhash.xxh3_64_intdigest(path.encode("utf-8", "surrogateescape"))


def block_key(path: str, version: FileVersion, index: int) -> bytes:
    """The cache key of block ``index`` of ``path`` at ``version`` (16 bytes)."""
    digest = xxhash.xxh3_128()
    digest.update(path.encode("utf-8", "surrogateescape"))
    # The fixed-width tail makes the encoding unambiguous whatever the path holds.
    digest.update(b"\0")
    digest.update(_VERSION.pack(version.size, version.mtime_ns, version.ino, version.ctime_ns, index))
    return digest.digest()
