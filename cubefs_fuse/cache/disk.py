"""The NVMe tier: one checksummed file per block, a byte limit and a free-space floor.

Layout of the cache directory::

    lock                 flock()ed by the daemon that owns the directory (holds its pid)
    index.bin            the block list, written at clean shutdown, deleted at start-up
    blocks/ab/<hex key>  one file per block: 36-byte header + payload
    tmp/                 blocks being written (wiped at start-up)

Start-up reads ``index.bin`` (one sequential read, no per-block syscalls) and deletes
it, so a daemon that crashes later leaves no index and the next start falls back to a
directory scan.  Blocks are written to ``tmp/`` and renamed into place, so a block file
is complete or absent; a damaged one is caught by its checksum, counted, deleted and
reported as a miss, never served.

Accounting is in allocated bytes (header + payload rounded up to 4 KiB, what ``du``
shows), reserved on the trio thread before a write starts and released after an
unlink, so the bytes on disk never exceed the limit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import trio
import xxhash

from cubefs_fuse.cache.keys import KEY_BYTES
from cubefs_fuse.cache.policy import SCRATCH_FRACTION, PlannedLru
from cubefs_fuse.errors import ConfigError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHHI16sQ")  # magic, format, reserved, payload length, key, xxh3-64 of payload
_MAGIC = b"CFBK"
_FORMAT = 1
HEADER_BYTES = _HEADER.size
_INDEX_HEADER = struct.Struct("<8sQQ")  # magic, entry count, xxh3-64 of the body
# Body: the keys (16 bytes each), then the sizes and the path tags (<u8 each), eviction order.
_INDEX_MAGIC = b"CFIDX002"
# Filesystem allocation unit used for accounting; 4 KiB is the block size of ext4/xfs on NVMe.
ALLOCATION_UNIT = 4096
# Concurrent block file reads/writes.  NVMe queues are deep; 8 threads keep a drive busy
# without starving the backend's threads of the GIL on a 2-core machine.
DISK_THREADS = 8


def allocated_bytes(payload: int) -> int:
    """Bytes a block file of ``payload`` bytes occupies on disk."""
    return -(-(HEADER_BYTES + payload) // ALLOCATION_UNIT) * ALLOCATION_UNIT


@dataclass(frozen=True, slots=True)
class DiskStatistics:
    used_bytes: int
    limit_bytes: int
    effective_limit_bytes: int  # the limit after the free-space floor
    blocks: int
    hits: int
    misses: int
    evictions: int
    inserts: int
    rejected: int
    checksum_failures: int
    write_errors: int
    read_errors: int
    startup_seconds: float
    startup_source: str  # "index", "scan" or "empty"


class DiskTier:
    def __init__(self, directory: str, limit_bytes: int, free_ratio: float, lock_fd: int) -> None:
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.free_ratio = free_ratio
        self._lock_fd = lock_fd
        self._blocks_dir = os.path.join(directory, "blocks")
        self._tmp_dir = os.path.join(directory, "tmp")
        self._entries: dict[bytes, int] = {}  # key -> allocated bytes
        self._tags: dict[bytes, int] = {}  # key -> path tag (0: unknown, e.g. after a crash scan)
        # Eviction order, as in the RAM tier: unplanned LRU first, then furthest next use.
        self.policy = PlannedLru(limit_bytes // SCRATCH_FRACTION)
        self._writing: dict[bytes, int] = {}  # key -> bytes reserved for a write in progress
        # Allocated bytes of stored blocks plus reservations of writes in progress.  A put
        # reserves max(its block, the victims it evicts) until its worker has unlinked the
        # victims and written the block, so a concurrent put can never reuse the space of
        # a file that is still on disk; dropped blocks likewise stay counted until unlinked.
        self.used_bytes = 0
        self._reserved = 0  # the in-flight part of used_bytes (writes and unlinks in progress)
        self._inserted_bytes = 0  # cumulative bytes of blocks stored by put(), for _set_headroom
        self._headroom = limit_bytes  # used_bytes may grow to this before the free-space floor is hit
        self._limiter = trio.CapacityLimiter(DISK_THREADS)
        self._hits = self._misses = self._evictions = self._inserts = self._rejected = 0
        self._checksum_failures = self._write_errors = self._read_errors = 0
        self._tmp_serial = 0
        self.startup_seconds = 0.0
        self.startup_source = "empty"

    # -- start-up and shutdown -------------------------------------------------------

    @classmethod
    async def open(cls, directory: str, limit_bytes: int, free_ratio: float) -> DiskTier:
        """Lock the directory and load its block list (index file, else a scan)."""
        start = time.perf_counter()
        lock_fd = await trio.to_thread.run_sync(_lock_directory, directory)
        tier = cls(directory, limit_bytes, free_ratio, lock_fd)
        try:
            entries, source = await trio.to_thread.run_sync(tier._load)
        except BaseException:
            os.close(lock_fd)
            raise
        tier._entries = {key: size for key, (size, _) in entries.items()}
        tier._tags = {key: tag for key, (_, tag) in entries.items() if tag}
        for key, size in tier._entries.items():  # oldest first: the LRU order of the last run
            tier.policy.add(key, size)
        tier.used_bytes = sum(tier._entries.values())
        tier.startup_source = source
        await tier._refresh_headroom()
        await tier._shrink_to_fit()
        tier.startup_seconds = time.perf_counter() - start
        log.info("disk cache %s: %d blocks, %d bytes, loaded from %s in %.3f s", directory,
                 len(entries), tier.used_bytes, source, tier.startup_seconds)
        return tier

    def _load(self) -> tuple[OrderedDict[bytes, tuple[int, int]], str]:
        shutil.rmtree(self._tmp_dir, ignore_errors=True)
        os.makedirs(self._tmp_dir, exist_ok=True)
        os.makedirs(self._blocks_dir, exist_ok=True)
        index_path = os.path.join(self.directory, "index.bin")
        entries = _read_index(index_path)
        if entries is not None:
            # From here on the index is stale: only a clean shutdown writes a new one.
            os.unlink(index_path)
            return entries, "index"
        return self._scan(), "scan"

    def _scan(self) -> OrderedDict[bytes, tuple[int, int]]:
        """Rebuild the block list from the files (after a crash); oldest write first."""
        found: list[tuple[int, bytes, int]] = []
        for sub in os.scandir(self._blocks_dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    key = bytes.fromhex(entry.name)
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, FileNotFoundError):
                    _unlink_quietly(entry.path)
                    continue
                if len(key) != KEY_BYTES or st.st_size < HEADER_BYTES:
                    _unlink_quietly(entry.path)
                    continue
                found.append((st.st_mtime_ns, key, allocated_bytes(st.st_size - HEADER_BYTES)))
        found.sort()
        return OrderedDict((key, (size, 0)) for _, key, size in found)  # tags come back as blocks are read

    async def close(self) -> None:
        """Write the index for a fast restart and release the directory lock."""
        entries = [(key, size, self._tags.get(key, 0)) for key, size in self._lru_order()]
        try:
            await trio.to_thread.run_sync(_write_index, os.path.join(self.directory, "index.bin"), entries)
        except OSError as exc:
            log.warning("could not write the disk cache index (next start will scan): %s", exc)
        finally:
            os.close(self._lock_fd)

    def release(self) -> None:
        """Release the directory lock without an index (the next start rescans)."""
        os.close(self._lock_fd)

    # -- the cache interface ---------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    async def get(self, key: bytes, tag: int = 0) -> bytes | None:
        """The block, or None if absent or damaged (a damaged block is deleted).

        ``tag`` (the reader's path tag) restores a tag lost by a crash scan."""
        if key not in self._entries:
            self._misses += 1
            return None
        self.policy.touch(key)
        if tag and key not in self._tags:
            self._tags[key] = tag
        path = self._path(key)
        try:
            data = await trio.to_thread.run_sync(_read_block_file, path, key, limiter=self._limiter)
        except FileNotFoundError:
            data = None  # evicted while we were reading
        except _Corrupt as exc:
            self._checksum_failures += 1
            log.warning("disk cache block %s is damaged (%s): discarded, will refetch", path, exc)
            size = self._entries.pop(key, 0)  # its bytes stay counted until the file is gone
            self.policy.remove(key)
            self._tags.pop(key, None)
            self._reserved += size
            try:
                await trio.to_thread.run_sync(_unlink_quietly, path, limiter=self._limiter)
            finally:
                self._reserved -= size
                self.used_bytes -= size
            data = None
        except OSError as exc:
            self._read_errors += 1
            log.warning("disk cache read of %s failed: %s", path, exc)
            data = None
        if data is None:
            self._forget(key)
            self._misses += 1
            return None
        self._hits += 1
        return data

    async def put(self, key: bytes, data: bytes, *, next_use: int | None = None, tag: int = 0) -> bool:
        """Store a block (``next_use``: the plan position that reads it), evicting by the
        plan-aware policy; False if it was not stored."""
        if key in self._entries or key in self._writing:
            if next_use is not None:
                self.policy.plan(key, next_use)
            return True
        need = allocated_bytes(len(data))
        limit = self.effective_limit_bytes
        chosen = self.policy.victims(need, limit - self.used_bytes, next_use) if need <= limit else None
        victims = chosen or []
        freed = 0
        for victim in victims:
            freed += self._entries.pop(victim)
            self.policy.remove(victim)
            self._tags.pop(victim, None)
            self._evictions += 1
        fits = chosen is not None and self.used_bytes - freed + need <= limit
        # The victims' files and the new one are never on disk together (the worker
        # unlinks first), so max() of the two bounds what this put has on disk.
        reserved = max(need, freed) if fits else freed
        self.used_bytes += reserved - freed
        self._reserved += reserved
        if fits:
            self._writing[key] = need
        else:
            self._rejected += 1
        self._tmp_serial += 1
        tmp = os.path.join(self._tmp_dir, f"{self._tmp_serial}")
        victim_paths = [self._path(v) for v in victims]
        inserted_before = self._inserted_bytes
        try:
            avail = await trio.to_thread.run_sync(
                _write_block_file, victim_paths, tmp, self._path(key) if fits else None, key, data,
                limiter=self._limiter,
            )
        except OSError as exc:
            self._write_errors += 1
            log.warning("disk cache write failed: %s", exc)
            fits = False
            return False
        finally:
            self._writing.pop(key, None)
            self._reserved -= reserved
            self.used_bytes -= reserved - (need if fits else 0)
        self._set_headroom(avail, self._inserted_bytes - inserted_before)
        if fits:
            self._entries[key] = need
            self.policy.add(key, need, next_use)
            if tag:
                self._tags[key] = tag
            self._inserted_bytes += need
            self._inserts += 1
        return fits

    def plan(self, key: bytes, next_use: int) -> None:
        self.policy.plan(key, next_use)

    def unplan(self, key: bytes) -> None:
        self.policy.unplan(key)

    def tagged(self) -> list[tuple[bytes, int]]:
        """(key, tag) of every block whose tag is known."""
        return list(self._tags.items())

    def _lru_order(self) -> list[tuple[bytes, int]]:
        """Blocks in eviction order (for the index: the next run starts from it)."""
        return [(key, self._entries[key]) for key in self.policy.order() if key in self._entries]

    async def clear(self) -> None:
        """Drop every stored block and its file (writes in progress still land)."""
        paths = [self._path(k) for k in self._entries]
        freed = sum(self._entries.values())
        self._entries.clear()
        self._tags.clear()
        self.policy = PlannedLru(self.policy.scratch_bytes)
        self._reserved += freed  # counted until the files are gone
        try:
            await trio.to_thread.run_sync(_unlink_all, paths, limiter=self._limiter)
        finally:
            self._reserved -= freed
            self.used_bytes -= freed

    @property
    def effective_limit_bytes(self) -> int:
        return max(0, min(self.limit_bytes, self._headroom))

    def statistics(self) -> DiskStatistics:
        return DiskStatistics(
            self.used_bytes, self.limit_bytes, self.effective_limit_bytes, len(self._entries),
            self._hits, self._misses, self._evictions, self._inserts, self._rejected,
            self._checksum_failures, self._write_errors, self._read_errors,
            self.startup_seconds, self.startup_source,
        )

    # -- internals -------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self._blocks_dir, name[:2], name)

    def _forget(self, key: bytes) -> None:
        size = self._entries.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            self.policy.remove(key)
            self._tags.pop(key, None)

    def _set_headroom(self, avail_bytes: tuple[int, int], stored_since: int = 0) -> None:
        """``avail_bytes`` was measured by a worker; ``stored_since`` bytes of blocks were
        stored after that worker started (their files may postdate the measurement)."""
        available, total = avail_bytes
        floor = int(self.free_ratio * total)
        # What we surely held when ``available`` was measured, plus what the filesystem
        # could still give before the floor.  Only blocks whose files were on disk at that
        # moment count: in-flight writes and unlinks may or may not have reached the
        # filesystem (``available`` may or may not include them), and neither may blocks
        # stored while the worker ran.  Counting any of them lets concurrent writes
        # overshoot the floor.
        self._headroom = self.used_bytes - self._reserved - stored_since + available - floor

    async def _refresh_headroom(self) -> None:
        st = await trio.to_thread.run_sync(os.statvfs, self.directory)
        self._set_headroom((st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize))

    async def _shrink_to_fit(self) -> None:
        """Evict down to the limit (the limit may have shrunk since the last run)."""
        limit = self.effective_limit_bytes
        victims = []
        if self.used_bytes > limit:
            for victim in self.policy.victims(self.used_bytes - limit, 0, None) or list(self._entries):
                if self.used_bytes <= limit:
                    break
                self.used_bytes -= self._entries.pop(victim)
                self.policy.remove(victim)
                self._tags.pop(victim, None)
                self._evictions += 1
                victims.append(self._path(victim))
        if victims:
            await trio.to_thread.run_sync(_unlink_all, victims)


class _Corrupt(Exception):
    pass


def _lock_directory(directory: str) -> int:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"key 'diskCacheDir': {directory!r} is in use by another cubefs-fuse daemon (pid {owner})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _read_block_file(path: str, key: bytes) -> bytes:
    with open(path, "rb", buffering=0) as f:
        raw = f.read()
    if len(raw) < HEADER_BYTES:
        raise _Corrupt("truncated header")
    magic, fmt, _, length, stored_key, checksum = _HEADER.unpack_from(raw)
    if magic != _MAGIC or fmt != _FORMAT:
        raise _Corrupt("bad magic")
    if stored_key != key:
        raise _Corrupt("key mismatch")
    payload = raw[HEADER_BYTES:]
    if len(payload) != length:
        raise _Corrupt(f"length {len(payload)} != {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise _Corrupt("checksum mismatch")
    return payload


def _write_block_file(victims: list[str], tmp: str, final: str | None, key: bytes, data: bytes) -> tuple[int, int]:
    # Victims go first so the bytes on disk stay within the reservation at every instant.
    for victim in victims:
        _unlink_quietly(victim)
    if final is not None:
        header = _HEADER.pack(_MAGIC, _FORMAT, 0, len(data), key, xxhash.xxh3_64_intdigest(data))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.writev(fd, [header, data])
        finally:
            os.close(fd)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.rename(tmp, final)
    st = os.statvfs(tmp.rsplit("/", 1)[0])
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        _unlink_quietly(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_index(path: str) -> OrderedDict[bytes, tuple[int, int]] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    if len(raw) < _INDEX_HEADER.size:
        log.warning("disk cache index %s is truncated; scanning instead", path)
        return None
    magic, count, checksum = _INDEX_HEADER.unpack_from(raw)
    body = memoryview(raw)[_INDEX_HEADER.size:]
    if magic != _INDEX_MAGIC or len(body) != count * (KEY_BYTES + 16) or xxhash.xxh3_64_intdigest(body) != checksum:
        log.warning("disk cache index %s is damaged; scanning instead", path)
        return None
    keys = bytes(body[: count * KEY_BYTES])
    sizes = np.frombuffer(body, dtype="<u8", offset=count * KEY_BYTES, count=count).tolist()
    tags = np.frombuffer(body, dtype="<u8", offset=count * (KEY_BYTES + 8), count=count).tolist()
    return OrderedDict(zip((keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)), zip(sizes, tags)))


def _write_index(path: str, entries: list[tuple[bytes, int, int]]) -> None:
    """(key, allocated size, path tag) per block, in eviction order."""
    body = (b"".join(k for k, _, _ in entries)
            + np.fromiter((s for _, s, _ in entries), dtype="<u8", count=len(entries)).tobytes()
            + np.fromiter((t for _, _, t in entries), dtype="<u8", count=len(entries)).tobytes())
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_INDEX_HEADER.pack(_INDEX_MAGIC, len(entries), xxhash.xxh3_64_intdigest(body)))
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)

