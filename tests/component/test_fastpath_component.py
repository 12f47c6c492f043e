"""The fast path's batch protocol without FUSE: ``BatchResolver`` over the real cache and
prefetch service on a FakeBackend (virtual time), and cube_torch's client against a fake
data socket that dies mid-batch.

Hits and misses are counted per file exactly like a file's read through the mount (its
READ from the start, the kernel opening files without the daemon); a file is
served only from the version the metadata says; late files go to the mount; a worker
whose daemon dies or hangs mid-batch reads through the mount after a bounded wait.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from cube_torch import fastpath
from cube_torch.fastpath import Channel
from cubefs_fuse.cache.disk import DiskTier
from cubefs_fuse.cache.keys import block_key
from cubefs_fuse.control.dataplane import DataPlane
from cubefs_fuse.control.protocol import ProtocolError
from cubefs_fuse.control.server import AccessPolicy, ControlServer
from cubefs_fuse.fs.inodes import ROOT_INODE
from cubefs_fuse.prefetch.batches import BatchResolver, Caller
from tests.fakes import FakeBackend
from tests.helpers import damage_block
from tests.stack import BLOCK, open_stack, stack_config

LATENCY = 0.002
PID = os.getpid()
ME = Caller(PID, os.geteuid(), os.getegid())
ATTR_TTL = 1.0


@asynccontextmanager
async def open_resolver(backend: FakeBackend, *, wait: float = 2.0, disk: DiskTier | None = None,
                        mem_cache_size: int = 1 << 24) -> AsyncIterator[BatchResolver]:
    """``mem_cache_size``: what the daemon is told (plans' windows get half of it); the
    RAM tier itself holds 16 MiB either way."""
    config = stack_config(mem_cache_size=mem_cache_size, backend_threads=8, prefetch_threads=4, attr_valid=ATTR_TTL,
                          lookup_valid=ATTR_TTL, meta_cache_entries=10_000)
    async with open_stack(backend, config, disk=disk, ram=1 << 24, service=True) as stack:
        stack.service.jobs.register("train", 0, PID)
        yield BatchResolver(stack.service, allow_other=True, wait=wait)


def served(results: list) -> list[bytes | None]:  # type: ignore[type-arg]
    return [b"".join(r.parts) if r.parts is not None else None for r in results]


def counters(resolver: BatchResolver) -> tuple[int, int, int]:
    c = resolver.service.jobs.jobs[("train", 0)].counters
    return c.requests, c.hits, c.misses


def five_files() -> tuple[FakeBackend, dict[str, bytes]]:
    """A 2 ms backend with five files of 1 to 4 blocks."""
    backend = FakeBackend(latency=LATENCY)
    files = {f"d/{i}.jpg": bytes([i]) * (1000 + 3000 * i) for i in range(5)}
    for path, data in files.items():
        backend.write(path, data)
    return backend, files


async def test_hits_and_misses_are_counted_once_per_file(autojump_clock: trio.testing.MockClock) -> None:
    backend, files = five_files()
    async with open_resolver(backend) as resolver:
        names = list(files)
        first = await resolver.resolve(ME, names, 1 << 20)
        assert served(first) == list(files.values())
        assert counters(resolver) == (0, 0, 0), "nothing counts before the worker has the bytes"
        resolver.commit(first)
        assert counters(resolver) == (5, 0, 5)
        second = await resolver.resolve(ME, names, 1 << 20)
        resolver.commit(second)
        assert counters(resolver) == (10, 5, 5)
        # Not a file, missing, more than the room left: to the mount, not counted.
        backend.mkdir("dir")
        third = await resolver.resolve(ME, ["dir", "missing", *names], len(files["d/0.jpg"]))
        assert served(third) == [None, None, files["d/0.jpg"], None, None, None, None]
        resolver.commit(third)
        assert counters(resolver) == (11, 6, 5)
        assert resolver.stats.by_reason == {"not a regular file": 1, "error": 1, "ring full": 4}


async def test_a_release_sent_before_a_status_is_counted_by_it(tmp_path: Path) -> None:
    """A worker sends its release before its batch reaches the loader, so counters shown
    after that (the filesystem's settle, as a status or a metrics scrape does) include the
    release even when the connection's task has not run since it arrived."""
    backend, files = five_files()
    async with open_resolver(backend) as resolver, trio.open_nursery() as nursery:
        plane = DataPlane(resolver)
        resolver.fs.settle_reports_of(plane.settle)
        path = str(tmp_path / "data.sock")
        await nursery.start(ControlServer(AccessPolicy()).serve_data, path, plane.serve)
        channel = await trio.to_thread.run_sync(Channel, path)
        try:
            for epoch in range(3):
                answers = await trio.to_thread.run_sync(channel.batch, list(files))
                assert answers == list(files.values())
                channel.release([1] * len(files))  # from the trio thread: its task cannot run before the settle
                await resolver.fs.settle()
                assert counters(resolver)[0] == 5 * (epoch + 1)
        finally:
            channel.close()
        nursery.cancel_scope.cancel()


async def test_a_batch_moves_the_plan_past_its_files_when_it_asks(autojump_clock: trio.testing.MockClock) -> None:
    """A batch's files are requested when the worker asks for them, as through the mount a
    file's first READ is seen before its bytes are fetched: the plan's cursor moves past
    them at once, so its window fetches the *next* batch's files while the worker loads
    this one (not the files this batch is fetching itself), and the next batch finds them
    in RAM.  Each file is still one request, counted when the worker has it; a file the
    worker then reads through the mount is counted by that read (from its start) alone
    and moves the cursor once."""
    backend = FakeBackend(latency=LATENCY)
    paths = [f"d/{i:03d}.jpg" for i in range(48)]
    data = {path: bytes([i]) * BLOCK for i, path in enumerate(paths)}  # one block each
    for path in paths:
        backend.write(path, data[path])
    window = 8  # the plan's window holds 8 files (its share is half of mem_cache_size)
    async with open_resolver(backend, mem_cache_size=2 * window * BLOCK) as resolver:
        service, fs = resolver.service, resolver.fs
        dataset, _ = await service.register_dataset(b"\0".join(p.encode() for p in paths), 1)
        await service.submit_plan(("train", 0), 0, dataset.id, np.arange(len(paths), dtype="<u4").tobytes(), "<u4")
        plan = service.scheduler.plans[("train", 0, "0")]

        def in_ram(path: str) -> bool:
            attr = fs.meta.peek(path)
            return attr is not None and block_key(path, attr.version, 0) in fs.cache.memory

        with trio.fail_after(60):
            while not all(in_ram(p) for p in paths[:window]):
                await trio.sleep(LATENCY / 4)
        assert not any(in_ram(p) for p in paths[window:]), "the window holds 8 files, no more"

        first = await resolver.resolve(ME, paths[:16], 1 << 20)
        assert served(first) == [data[p] for p in paths[:16]]
        assert plan.cursor == 16, "the batch's asks moved the cursor, before its release"
        await trio.sleep(20 * LATENCY)  # the worker loads the batch
        assert all(in_ram(p) for p in paths[16:16 + window]), "meanwhile the window fetched the next files"
        resolver.commit(first)
        assert counters(resolver) == (16, 8, 8)  # the window's 8 hits, the batch's own 8 misses
        assert (plan.cursor, plan.counters.used, plan.counters.requests, plan.counters.hits) == (16, 16, 16, 8)

        second = await resolver.resolve(ME, paths[16:32], 1 << 20)
        assert [r.waited for r in second] == [False] * window + [True] * (16 - window)
        await trio.sleep(20 * LATENCY)
        # The first file opened twice from the ring, the second never (a loader reading it
        # from C): it is read through the mount, where its READ from the start is the one request.
        resolver.commit(second, [2, 0] + [1] * 14)
        assert counters(resolver) == (32, 16, 16)
        # The second open (from the ring) of a file the plan reads once is the job's request,
        # not the plan's (as a second read through the mount: it matches no position left).
        assert (plan.cursor, plan.counters.used, plan.counters.requests) == (32, 32, 31)
        inode = ROOT_INODE
        for name in paths[17].split("/"):
            inode = (await fs.lookup(inode, name)).inode
        assert await fs.read(inode, 0, 0, BLOCK, PID) == data[paths[17]]
        assert counters(resolver) == (33, 17, 16)
        assert (plan.cursor, plan.counters.used, plan.counters.requests) == (32, 32, 32)


async def test_a_batch_waits_for_in_flight_prefetches_and_sends_late_files_to_the_mount(
        autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(latency=LATENCY)
    backend.write("slow.jpg", b"s" * 100)
    backend.write("fast.jpg", b"f" * 100)
    async with open_resolver(backend, wait=2.0) as resolver:
        fs = resolver.fs
        attr = await fs.meta.stat("fast.jpg")
        # A prefetch in flight: the batch joins it (one backend read in all) and serves it.
        fs.cache.prefetch(block_key("fast.jpg", attr.version, 0), fs.blocks.fetcher("fast.jpg", attr.version, 0))
        reads = backend.statistics().operations.get("read", 0)
        results = await resolver.resolve(ME, ["fast.jpg"], 1 << 20)
        assert served(results) == [b"f" * 100]
        assert backend.statistics().operations.get("read", 0) == reads + 1
        # A file the remote takes 10 s for: after the batch's 2 s it goes to the mount,
        # its fetch goes on, and the next batch serves it from RAM (a hit).  (Its
        # attributes are cached first: a cold small file would come with its stat.)
        await fs.meta.stat("slow.jpg")
        backend.op_latency["read"] = 10.0
        start = trio.current_time()
        results = await resolver.resolve(ME, ["slow.jpg"], 1 << 20)
        assert served(results) == [None] and results[0].reason is None
        assert trio.current_time() - start == pytest.approx(2.0)
        assert resolver.stats.by_reason["not ready in time"] == 1
        await trio.sleep(10)
        backend.op_latency["read"] = 0.0
        results = await resolver.resolve(ME, ["slow.jpg"], 1 << 20)
        assert served(results) == [b"s" * 100] and not results[0].waited


async def test_a_cold_small_file_of_a_batch_costs_one_backend_call(autojump_clock: trio.testing.MockClock) -> None:
    """A batch's file whose attributes are not cached comes with its stat when it fits in
    one block (``Backend.stat_read``: over S3 one ranged GET, not a HEAD and a GET), and
    still counts as the miss it is; a larger one is stat'ed, then read by blocks."""
    backend = FakeBackend(latency=LATENCY)
    small, large = b"s" * 1000, bytes(range(256)) * (3 * BLOCK // 256)
    backend.write("small.jpg", small)
    backend.write("large.bin", large)
    async with open_resolver(backend) as resolver:
        results = await resolver.resolve(ME, ["small.jpg"], 1 << 20)
        assert served(results) == [small] and results[0].waited
        assert (backend.operations["stat"], backend.operations["read"], backend.stat_reads) == (1, 0, 1)
        resolver.commit(results)
        assert counters(resolver) == (1, 0, 1)
        results = await resolver.resolve(ME, ["large.bin"], 1 << 20)
        assert served(results) == [large]
        assert (backend.operations["stat"], backend.operations["read"], backend.stat_reads) == (2, 3, 1)


async def test_a_batchs_nvme_blocks_are_read_in_one_thread_call(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """After a restart (RAM empty, NVMe kept), the blocks of a batch's files whose
    attributes are cached come from NVMe in one worker-thread call, not one per block;
    every file is an NVMe hit (not a miss), the source is not read, and a damaged block is
    still found by its checksum and refetched."""
    backend = FakeBackend()
    files = {f"d/{i}.jpg": bytes([65 + i]) * (1000 + 3000 * i) for i in range(6)}  # 1 to 4 blocks
    for path, data in files.items():
        backend.write(path, data)
    names = list(files)
    disk = await DiskTier.open(str(tmp_path), 1 << 22, 0.0)
    try:
        async with open_resolver(backend, disk=disk) as resolver:
            resolver.commit(await resolver.resolve(ME, names, 1 << 20))
            await resolver.fs.cache.drain()
        damage_block(tmp_path, block_key("d/5.jpg", backend.version("d/5.jpg"), 1), -1)
        backend.operations.clear()
        async with open_resolver(backend, disk=disk) as resolver:  # fresh RAM tier and metadata
            for name in names:
                await resolver.fs.meta.stat(name)  # as the plan's directory listings leave them
            hops = []
            to_thread = trio.to_thread.run_sync

            async def counted(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
                hops.append(getattr(fn, "__name__", repr(fn)))
                return await to_thread(fn, *args, **kwargs)

            monkeypatch.setattr(trio.to_thread, "run_sync", counted)
            results = await resolver.resolve(ME, names, 1 << 20)
            assert served(results) == list(files.values())
            # One call read every block on NVMe; the damaged one (its checksum) went to the
            # usual flight: one disk read that finds it damaged (and a thread to delete it),
            # then the source.
            assert hops.count("read_all") == 1
            assert hops.count("_read_entry") == 1
            assert backend.operations["read"] == 1
            resolver.commit(results)
            assert counters(resolver) == (6, 5, 1)
            c = resolver.fs.cache.statistics()
            assert c.hits_disk == sum(-(-len(d) // BLOCK) for d in files.values()) - 1
            assert c.disk is not None and c.disk.checksum_failures == 1
    finally:
        await disk.close()


async def test_a_changed_file_is_served_only_in_its_new_version(autojump_clock: trio.testing.MockClock) -> None:
    """Before the attributes expire the daemon's metadata still names the old version (as a
    lookup through the mount would); from then on only the new bytes, never the old or mixed."""
    backend = FakeBackend(latency=LATENCY)
    backend.write("a.bin", b"1" * 10_000)
    async with open_resolver(backend) as resolver:
        assert served(await resolver.resolve(ME, ["a.bin"], 1 << 20)) == [b"1" * 10_000]
        backend.write("a.bin", b"2" * 10_000)  # same size: a new mtime/ctime
        await trio.sleep(ATTR_TTL + 0.01)
        for _ in range(3):
            assert served(await resolver.resolve(ME, ["a.bin"], 1 << 20)) == [b"2" * 10_000]
        # Changed between the stat and the read (a writer at the source): never served.
        backend.write("a.bin", b"3" * 12_000)
        await trio.sleep(ATTR_TTL + 0.01)
        await resolver.fs.meta.stat("a.bin")
        backend.write("a.bin", b"4" * 12_000)
        results = await resolver.resolve(ME, ["a.bin"], 1 << 20)
        assert served(results) in ([None], [b"4" * 12_000])
        assert served(await resolver.resolve(ME, ["a.bin"], 1 << 20)) == [b"4" * 12_000]


async def test_a_batch_already_in_ram_is_resolved_without_a_task_per_file(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later epoch's batch (attributes cached, every block in RAM) is answered in one
    step, with the accounting of the task-per-file path: each file a hit, the plan's cursor
    moved, the room respected in order.  A file that is not all in RAM, or whose
    attributes expired, still goes through that path (and is re-checked at the source)."""
    backend, files = five_files()
    async with open_resolver(backend) as resolver:
        names = list(files)
        resolver.commit(await resolver.resolve(ME, names, 1 << 20))  # cold: 5 misses
        slow: list[str] = []
        one = resolver._one

        async def counted_one(caller: Caller, key: object, entry: object, budget: list[int]) -> None:
            slow.append(entry.path)  # type: ignore[attr-defined]
            await one(caller, key, entry, budget)  # type: ignore[arg-type]

        monkeypatch.setattr(resolver, "_one", counted_one)
        hits_before = resolver.fs.cache.statistics().hits_ram
        warm = await resolver.resolve(ME, names, 1 << 20)
        assert served(warm) == list(files.values()) and slow == []
        resolver.commit(warm)
        assert counters(resolver) == (10, 5, 5)
        assert resolver.fs.cache.statistics().hits_ram - hits_before == sum(-(-len(d) // BLOCK) for d in files.values())
        # The room, in the batch's order: the first two fit, the rest go to the mount.
        room = len(files["d/0.jpg"]) + len(files["d/1.jpg"])
        tight = await resolver.resolve(ME, names, room)
        assert served(tight) == [files["d/0.jpg"], files["d/1.jpg"], None, None, None] and slow == []
        assert resolver.stats.by_reason.get("ring full") == 3
        # One file's block evicted, and a file changed at the source once its attributes
        # expire: those two take the other path; the changed one is served in its new bytes.
        attr = resolver.fs.meta.peek("d/2.jpg")
        assert attr is not None
        resolver.fs.cache.memory.discard(block_key("d/2.jpg", attr.version, 0))
        mixed = await resolver.resolve(ME, names, 1 << 20)
        assert served(mixed) == list(files.values()) and slow == ["d/2.jpg"]
        backend.write("d/4.jpg", b"new" * 5000)
        await trio.sleep(ATTR_TTL + 0.01)
        slow.clear()
        changed = await resolver.resolve(ME, names, 1 << 20)
        assert served(changed)[4] == b"new" * 5000 and sorted(slow) == names


async def test_permissions_follow_the_mounts_rules(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend()
    backend.write("open.bin", b"o")
    backend.write("private.bin", b"p")
    async with open_resolver(backend) as resolver:
        attr = await resolver.fs.meta.stat("private.bin")
        other = Caller(PID, attr.uid + 1, attr.gid + 1)
        os_mode = attr.mode
        expected_open = [b"o"] if os_mode & 0o004 else [None]
        assert served(await resolver.resolve(other, ["open.bin"], 1 << 20)) == expected_open
        no_allow_other = BatchResolver(resolver.service, allow_other=False)
        assert served(await no_allow_other.resolve(other, ["open.bin"], 1 << 20)) == [None]


# -- the client against a daemon that dies mid-batch ------------------------------------------


def _fake_daemon(path: str, behaviour: str, ready: threading.Event) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    ready.set()
    conn, _ = listener.accept()
    conn.recv(4096)  # hello
    fd = os.memfd_create("ring", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    conn.sendmsg([json.dumps({"ring": 4096, "version": 1}).encode()],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    conn.recv(4096)  # the batch
    if behaviour == "dies":
        conn.close()
    elif behaviour == "lies":
        conn.send(json.dumps({"files": [[4000, 500]]}).encode())  # beyond the ring
    elif behaviour == "hangs":
        conn.recv(4096)  # until the client gives up and closes
    conn.close()
    os.close(fd)
    listener.close()


@pytest.mark.parametrize("behaviour", ["dies", "lies", "hangs"])
def test_a_daemon_that_fails_mid_batch_costs_a_bounded_wait(behaviour: str, tmp_path: Path) -> None:
    path = str(tmp_path / "data.sock")
    ready = threading.Event()
    server = threading.Thread(target=_fake_daemon, args=(path, behaviour, ready), daemon=True)
    server.start()
    assert ready.wait(10)
    channel = Channel(path, reply_timeout=0.5)
    with pytest.raises((ProtocolError, OSError)):
        channel.batch(["a.jpg"])
    channel.close()
    server.join(10)
    assert not server.is_alive()


def test_the_open_hook_serves_exactly_the_batchs_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a batch's scope: the served path in "rb" gets the daemon's bytes; the same path
    in text mode, another path, and os.open read the file itself; after the scope, nothing."""
    served_path, other = tmp_path / "served.bin", tmp_path / "other.bin"
    served_path.write_bytes(b"on disk")
    other.write_bytes(b"other")
    worker = fastpath._worker()
    monkeypatch.setattr(worker, "resolve", lambda dataset, indices: ([str(served_path)], {str(served_path): b"daemon"}))
    monkeypatch.setattr(worker, "release", lambda *args: None)
    with fastpath.batch_scope(object(), [0]) as count:
        assert count == 1
        with open(served_path, "rb") as f:
            assert isinstance(f, fastpath.FastFile) and f.read() == b"daemon"
        with open(str(served_path), mode="rb", buffering=0) as f:
            assert f.read() == b"daemon"
        assert served_path.read_bytes() == b"daemon"  # pathlib goes through io.open
        with open(served_path) as text:
            assert text.read() == "on disk"
        with open(other, "rb") as f:
            assert f.read() == b"other"
        fd = os.open(served_path, os.O_RDONLY)
        assert os.read(fd, 100) == b"on disk"
        os.close(fd)
        with pytest.raises(OSError):
            open(served_path, "rb").write(b"x")  # noqa: SIM115
    with open(served_path, "rb") as f:
        assert f.read() == b"on disk"
