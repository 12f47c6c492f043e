"""Mounted: READs of cached files are served by the C FUSE session, never wrong bytes.

The daemon publishes a file's inode to the session (fs/_session.c) with its held blocks
lent: the session answers READs on the lent blocks without Python, and reports each
(``cubefs_fuse_native_reads_total``); files are opened by the kernel alone (no_open), and
a name is looked up again once the daemon stops trusting its attributes, which is where a
change at the source is found.  The stress test runs many readers, with the kernel's page
cache dropped under them so that READs keep reaching the daemon, while the source files
are rewritten and a small RAM tier evicts: every read sees one whole version.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cubefs_fuse.fs.session import READER_THREADS
from tests.helpers import Mount, metric, nvme_written, wait_until

BS = 64 * 1024


def _drop_page_cache(what: str = "1") -> None:
    """Drop the kernel's page cache (1), or its dentries and inodes too (3)."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(what)


def test_a_file_held_in_ram_is_looked_up_and_read_through_the_session_without_python(make_mount: Callable[..., Mount]) -> None:
    m = make_mount(blockSize="64KiB", memCacheSize="8MiB")
    small, large = os.urandom(3 * BS + 123), os.urandom(70 * BS)  # 4 blocks; 70, read in several READs
    (m.source / "small").write_bytes(small)
    (m.source / "large").write_bytes(large)
    m.mount()
    assert m.path("small").read_bytes() == small and m.path("large").read_bytes() == large  # cold: Python
    before = m.scrape()
    _drop_page_cache("3")  # the kernel's entries too: its LOOKUPs are the session's (published entries)
    assert m.path("small").read_bytes() == small
    assert m.path("large").read_bytes() == large
    after = m.scrape()
    for name in ("cubefs_fuse_lookups_total", "cubefs_fuse_native_lookups_total"):
        assert metric(after, name) - metric(before, name) == 2, name  # one per file, both in C
    native = metric(after, "cubefs_fuse_native_reads_total") - metric(before, "cubefs_fuse_native_reads_total")
    reads = metric(after, "cubefs_fuse_reads_total") - metric(before, "cubefs_fuse_reads_total")
    assert reads > 2, "the large file is read in several READs"
    assert native == reads, "a READ of a cached file was left to Python"
    served = metric(after, "cubefs_fuse_served_bytes_total", source="ram") \
        - metric(before, "cubefs_fuse_served_bytes_total", source="ram")
    assert served >= len(small) + len(large)
    m.umount()


def test_the_sessions_threads_are_named_so_a_profile_tells_c_from_python(make_mount: Callable[..., Mount]) -> None:
    """The C session's readers, flusher and (with a deadline) watchdog carry names of their
    own (``cfs-*``), which is how the benchmarks split the daemon's CPU by part
    (tools/harness.py ``cpu_split``)."""
    m = make_mount(backendTimeout=5)
    m.mount()
    task = Path(f"/proc/{m.pid()}/task")
    names = sorted((t / "comm").read_text().strip() for t in task.iterdir())
    assert names.count("cfs-reader") == READER_THREADS, names
    assert names.count("cfs-flusher") == 1 and names.count("cfs-watchdog") == 1, names
    m.umount()


def test_a_listed_name_is_looked_up_through_the_session_without_python(make_mount: Callable[..., Mount]) -> None:
    """A listing (READDIRPLUS) publishes its entries as a lookup does: once the kernel drops
    its own (a drop of caches, memory pressure), its LOOKUPs of the listed names, never
    looked up before, are the session's; the bytes are the source's."""
    m = make_mount(blockSize="64KiB", memCacheSize="8MiB")
    files = {f"f{i}": os.urandom(1000 + i) for i in range(20)}
    (m.source / "d").mkdir()
    for name, data in files.items():
        (m.source / "d" / name).write_bytes(data)
    m.mount()
    assert sorted(os.listdir(m.path("d"))) == sorted(files)
    before = m.scrape()
    _drop_page_cache("3")
    for name, data in files.items():
        assert m.path(f"d/{name}").read_bytes() == data
    after = m.scrape()
    looked_up = metric(after, "cubefs_fuse_lookups_total") - metric(before, "cubefs_fuse_lookups_total")
    in_c = metric(after, "cubefs_fuse_native_lookups_total") - metric(before, "cubefs_fuse_native_lookups_total")
    assert looked_up >= len(files), "the kernel kept its entries: nothing was tested"
    assert in_c == looked_up, f"{looked_up - in_c} of {looked_up} lookups were left to Python"
    m.umount()


def _restarted_on_nvme(m: Mount, files: dict[str, bytes]) -> None:
    """Write ``files`` to the source, read each through a first daemon (to NVMe), then
    mount a second on the same cache directory (RAM tier empty), the page cache dropped."""
    for name, data in files.items():
        (m.source / name).parent.mkdir(parents=True, exist_ok=True)
        (m.source / name).write_bytes(data)
    m.mount()
    for name, data in files.items():
        assert m.path(name).read_bytes() == data
    nvme_written(m)
    m.umount()
    m.mount()
    _drop_page_cache()


def test_after_a_restart_a_small_file_is_read_from_nvme_by_the_session(make_mount: Callable[..., Mount]) -> None:
    """A restarted daemon's first lookup of a file held on NVMe stats it and leaves the
    block there: the session serves the READ from the NVMe entry (its checksum checked in
    C), with no copy into the RAM tier and nothing from the source."""
    m = make_mount(blockSize="64KiB", memCacheSize="8MiB")
    files = {f"f{i}": os.urandom(5000 + i) for i in range(10)}
    _restarted_on_nvme(m, files)
    for name, data in files.items():
        assert m.path(name).read_bytes() == data
    after = m.scrape()
    assert metric(after, "cubefs_fuse_native_reads_total") == metric(after, "cubefs_fuse_reads_total") >= len(files)
    assert metric(after, "cubefs_fuse_served_bytes_total", source="disk") == sum(map(len, files.values()))
    assert metric(after, "cubefs_fuse_served_bytes_total", source="backend") == 0
    assert metric(after, "cubefs_fuse_served_bytes_total", source="ram") == 0
    assert metric(after, "cubefs_fuse_cache_blocks", tier="ram") == 0, "the lookups copied NVMe blocks into RAM"
    m.umount()


def test_after_a_restart_the_first_lookup_in_a_directory_publishes_its_names(make_mount: Callable[..., Mount]) -> None:
    """A restarted daemon's first lookup of a held file, in a directory nobody lists, lists
    that directory in the background and publishes its names with their NVMe places: the
    session answers the lookups and READs of the others, and the bytes are the source's."""
    m = make_mount(blockSize="64KiB", memCacheSize="8MiB")
    files = {f"d/f{i:02d}": os.urandom(3000 + i) for i in range(30)}
    _restarted_on_nvme(m, files)
    names = sorted(files)
    random.Random(7).shuffle(names)
    assert m.path(names[0]).read_bytes() == files[names[0]]  # the first: Python's, and the listing
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_inodes") >= 2 + len(files), what="the names published")
    before = m.scrape()
    for name in names[1:]:
        assert m.path(name).read_bytes() == files[name]
    after = m.scrape()

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("cubefs_fuse_lookups_total") == grew("cubefs_fuse_native_lookups_total") == len(files) - 1
    assert grew("cubefs_fuse_reads_total") == grew("cubefs_fuse_native_reads_total") >= len(files) - 1
    assert grew("cubefs_fuse_served_bytes_total", source="disk") == sum(len(files[n]) for n in names[1:])
    assert metric(after, "cubefs_fuse_backend_operations_total", op="listdir") == 1
    m.umount()


def _content(name: str, generation: int, size: int) -> bytes:
    """A version of a file: its generation in the first 8 bytes, the rest derived from it."""
    head = generation.to_bytes(8, "little")
    return head + random.Random(f"{name}/{generation}").randbytes(size - 8)


def test_many_readers_see_whole_versions_while_the_source_changes_and_the_cache_evicts(
        make_mount: Callable[..., Mount]) -> None:
    ttl = 0.2
    m = make_mount(blockSize="16KiB", memCacheSize="1MiB", attrValid=ttl, lookupValid=ttl)
    names = [f"f{i}" for i in range(40)]
    sizes = {n: random.Random(n).randint(9, 120_000) for n in names}
    generation = dict.fromkeys(names, 0)
    for n in names:
        (m.source / n).write_bytes(_content(n, 0, sizes[n]))
    m.mount()
    stop = time.monotonic() + 8.0
    problems: list[str] = []
    whole: list[str] = []
    stale: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop and not problems:
            n = rng.choice(names)
            try:
                data = m.path(n).read_bytes()
            except OSError as exc:
                # The contract (docs/contracts.md): an old version's handle reads that
                # version or gets ESTALE, once its bytes are gone from the source and the cache.
                if exc.errno != errno.ESTALE:
                    problems.append(f"{n}: {exc!r}")
                stale.append(n)
                continue
            whole.append(n)
            gen = int.from_bytes(data[:8], "little")
            if data != _content(n, gen, sizes[n]):
                problems.append(f"{n}: {len(data)} bytes are not generation {gen} whole")

    def writer() -> None:
        rng = random.Random(1)
        while time.monotonic() < stop and not problems:
            n = rng.choice(names)
            generation[n] += 1
            tmp = m.source / f".{n}.tmp"
            tmp.write_bytes(_content(n, generation[n], sizes[n]))
            os.rename(tmp, m.source / n)  # a new version, whole, at once
            time.sleep(0.01)

    def dropper() -> None:
        drops = 0
        while time.monotonic() < stop and not problems:
            # READs keep reaching the daemon (and the session); every other time the kernel's
            # entries and inodes go too, so LOOKUPs reach it, answered from published entries.
            _drop_page_cache("3" if drops % 2 else "1")
            drops += 1
            time.sleep(0.05)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=writer), threading.Thread(target=dropper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not problems, problems[:10]
    assert len(whole) > 20 * len(stale), f"{len(whole)} whole reads, {len(stale)} ESTALE"
    samples = m.scrape()
    assert metric(samples, "cubefs_fuse_native_reads_total") > 0, "no READ went through the session"
    assert metric(samples, "cubefs_fuse_native_lookups_total") > 0, "no LOOKUP was answered by the session"
    assert metric(samples, "cubefs_fuse_cache_evictions_total", tier="ram") > 0, "the RAM tier never evicted"
    m.umount()


def test_a_cached_file_costs_no_request_until_its_attributes_expire_then_a_change_is_seen(
        make_mount: Callable[..., Mount]) -> None:
    # lookupValid long, attrValid short: the kernel keeps the entry only as long as the
    # daemon trusts the attributes (each entry's own timeout), so past attrValid the next
    # open looks the name up, which finds the change: a new inode, the new bytes.
    m = make_mount(attrValid=1, lookupValid=3600)
    (m.source / "f").write_bytes(b"one" * 1000)
    m.mount()
    assert m.path("f").read_bytes() == b"one" * 1000
    before = m.scrape()
    for _ in range(3):
        assert m.path("f").read_bytes() == b"one" * 1000
    after = m.scrape()
    for name in ("cubefs_fuse_lookups_total", "cubefs_fuse_reads_total"):
        assert metric(after, name) == metric(before, name), name  # the kernel answered all three
    (m.source / "f").write_bytes(b"two" * 2000)
    time.sleep(1.5)
    assert m.path("f").read_bytes() == b"two" * 2000  # never the old version's pages
    samples = m.scrape()
    assert metric(samples, "cubefs_fuse_lookups_total") > metric(after, "cubefs_fuse_lookups_total")
    assert metric(samples, "cubefs_fuse_file_version_changes_total") == 1  # the new version got a new inode
    m.umount()


def _segment_files(m: Mount) -> list[Path]:
    return sorted((m.cache_dir / "segments").glob("*.seg"))


def _damage_every_entry(m: Mount) -> None:
    """Flip a byte of every NVMe entry's payload (past its 40-byte header)."""
    for segment in _segment_files(m):
        raw = bytearray(segment.read_bytes())
        for offset in range(0, len(raw), 4096):
            if raw[offset:offset + 4] == b"CFSG":
                raw[offset + 100] ^= 0xFF
        segment.write_bytes(bytes(raw))


def _drop_pages_only() -> None:
    """Drop the page cache but not dentries and inodes: the kernel reads without a LOOKUP."""
    os.sync()
    _drop_page_cache()


def test_a_one_block_file_on_nvme_is_read_through_the_session_and_a_damaged_entry_never_served(
        make_mount: Callable[..., Mount]) -> None:
    # A RAM tier smaller than one file: blocks live on NVMe only, and the kernel's entries
    # (long lookupValid) stay, so reads need no LOOKUP that would bring the bytes.
    m = make_mount(blockSize="128KiB", memCacheSize="64KiB", diskCacheSize="64MiB")
    files = {f"f{i}": os.urandom(100_000 + i) for i in range(6)}
    for name, data in files.items():
        (m.source / name).write_bytes(data)
    m.mount()
    assert all(m.path(n).read_bytes() == d for n, d in files.items())  # cold: from the source, to NVMe
    wait_until(lambda: metric(m.scrape(), "cubefs_fuse_cache_blocks", tier="disk") >= len(files), 30,
               "every file written to NVMe")
    # The first read after the NVMe write reaches Python (the file was published when it
    # was looked up, cold), which serves it from NVMe and lends the entry's place; the
    # next is the session's.
    _drop_pages_only()
    assert m.path("f0").read_bytes() == files["f0"]
    _drop_pages_only()
    before = m.scrape()
    assert m.path("f0").read_bytes() == files["f0"]
    after = m.scrape()
    assert metric(after, "cubefs_fuse_native_reads_total") > metric(before, "cubefs_fuse_native_reads_total")
    assert metric(after, "cubefs_fuse_served_bytes_total", source="disk") \
        - metric(before, "cubefs_fuse_served_bytes_total", source="disk") == len(files["f0"])
    assert metric(after, "cubefs_fuse_reads_total") - metric(before, "cubefs_fuse_reads_total") \
        == metric(after, "cubefs_fuse_native_reads_total") - metric(before, "cubefs_fuse_native_reads_total")
    # Damage every payload on NVMe: the session's check fails, Python's read finds the
    # damage, frees the entry and fetches the source.
    _damage_every_entry(m)
    _drop_pages_only()
    assert all(m.path(n).read_bytes() == d for n, d in files.items())
    assert metric(m.scrape(), "cubefs_fuse_checksum_failures_total") >= len(files)
    m.umount()


def test_a_large_file_on_nvme_is_read_by_the_session_whole_blocks_only_and_never_damaged(
        make_mount: Callable[..., Mount]) -> None:
    """After a restart the blocks of a file of many blocks are on NVMe only: the session
    serves every READ of whole blocks from the entries' places (checked in C), nothing
    copied into RAM and nothing from the source; a READ of part of a block (O_DIRECT,
    4 KiB) is Python's, whose read brings that block into RAM; a damaged entry is never
    served."""
    m = make_mount(blockSize="64KiB", memCacheSize="8MiB")
    data = os.urandom(16 * BS + 1000)  # 17 blocks, the last one short
    _restarted_on_nvme(m, {"shard.tar": data})
    assert m.path("shard.tar").read_bytes() == data
    after = m.scrape()
    assert metric(after, "cubefs_fuse_native_reads_total") == metric(after, "cubefs_fuse_reads_total") >= 1
    assert metric(after, "cubefs_fuse_served_bytes_total", source="disk") == len(data)
    assert metric(after, "cubefs_fuse_served_bytes_total", source="backend") == 0
    assert metric(after, "cubefs_fuse_cache_blocks", tier="ram") == 0
    fd = os.open(m.path("shard.tar"), os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, 4096, 3 * BS + 4096) == data[3 * BS + 4096:3 * BS + 8192]
    finally:
        os.close(fd)
    part = m.scrape()
    assert metric(part, "cubefs_fuse_reads_total") == metric(after, "cubefs_fuse_reads_total") + 1
    assert metric(part, "cubefs_fuse_native_reads_total") == metric(after, "cubefs_fuse_native_reads_total")
    assert metric(part, "cubefs_fuse_cache_blocks", tier="ram") == 1  # the block it read part of
    _damage_every_entry(m)
    _drop_pages_only()
    assert m.path("shard.tar").read_bytes() == data
    assert metric(m.scrape(), "cubefs_fuse_checksum_failures_total") >= 1
    m.umount()
