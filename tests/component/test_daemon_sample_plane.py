"""The sample store's ops over a real data socket: a real ControlServer admitting
connections, the DataPlane with its memfd rings, the SamplePlane over a real SampleStore
on disk, and cube_torch's DaemonStore (in a worker thread, as a DataLoader worker uses it).

Answers larger than a ring come in several rounds and are counted once; refusals are JSON
errors that leave the connection usable; a daemon that stops answering costs one bounded
wait; every failure is a StoreError, never a hang or another exception.
"""

from __future__ import annotations

import array
import json
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from cube_torch.samples.daemon_store import DaemonStore
from cube_torch.samples.store import StoreError
from cubefs_fuse.control import volfile
from cubefs_fuse.control.dataplane import DataPlane, Ring
from cubefs_fuse.control.protocol import VolumeConfig
from cubefs_fuse.control.sampleplane import SamplePlane
from cubefs_fuse.control.server import AccessPolicy, ControlServer
from cubefs_fuse.samples import checksum, files
from cubefs_fuse.samples.store import SampleStore

REPO = Path(__file__).resolve().parents[2]
RING = 1024 * 1024  # small rings, so that answers need several rounds


def volume(tmp_path: Path, data_socket: str, name: str = "vol") -> str:
    config = VolumeConfig(prof=0, mount_point=str(tmp_path / "mnt"), vol_name=name, local_ip="127.0.0.1",
                          control_socket=str(tmp_path / "ctl.sock"), pid=os.getpid(), data_socket=data_socket)
    volfile.write(config, str(tmp_path))
    return name


@asynccontextmanager
async def serving(tmp_path: Path, *, mem: int = 64 << 20, disk: int = 64 << 20,
                  shared: frozenset[tuple[int, str]] = frozenset()) -> AsyncIterator[tuple[SampleStore, DataPlane, str]]:
    async with trio.open_nursery() as nursery:
        store = await SampleStore.open(nursery, str(tmp_path / "samples"), mem, disk, 0.0, shared=shared)
        while not store.loaded:
            await trio.sleep(0.01)
        server = ControlServer(AccessPolicy())
        plane = DataPlane(None, ring_bytes=RING, samples=SamplePlane(store).serve)  # type: ignore[arg-type]  # no batches here
        path = str(tmp_path / "data.sock")
        await nursery.start(server.serve_data, path, plane.serve)
        yield store, plane, volume(tmp_path, path)
        nursery.cancel_scope.cancel()


def entry(key: int, size: int) -> bytes:
    return np.random.default_rng(key).bytes(size)


async def test_round_trip_plan_and_misses(tmp_path: Path) -> None:
    async with serving(tmp_path) as (store, plane, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))

        def work() -> list[Any]:
            client.put_many("sweep", [(k, entry(k, 10_000 + k)) for k in range(50)])
            client.plan("sweep", list(range(49, -1, -1)))
            return client.get_many("sweep", [3, 1000, 49, -5])

        got = await trio.to_thread.run_sync(work)
        assert got == [entry(3, 10_003), None, entry(49, 10_049), None]
        (stats,) = store.statistics().caches
        assert (stats.name, stats.owner, stats.entries, stats.hits, stats.misses, stats.planned) == \
            ("sweep", os.geteuid(), 50, 2, 2, 50)
        assert plane.connections == 1  # one connection for every call
        client.close()


async def test_entries_written_in_place_carry_the_clients_checksum(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot written for (name, key) carries the entry's checksum, computed by the client
    with the uid the hello answered; the put sends it and the daemon stores it without
    reading the payload.  Every read still checks it: a wrong one is a miss, never served,
    and the entry is freed.  Bytes put_many copies into the ring get theirs there; an item
    without one (a slot put under another key) has the daemon compute it."""
    computed: list[int] = []
    real = checksum.entry_digest  # what files calls (its own name for it, patched below)

    def counted(uid: int, name: bytes, key: int, payload: Any) -> int:
        computed.append(key)
        return real(uid, name, key, payload)

    monkeypatch.setattr(files, "entry_digest", counted)
    async with serving(tmp_path) as (store, _, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))

        def put() -> None:
            client.prepare()
            good = client.write_entry([entry(5, 9000)], 9000, name="sums", key=5)
            bad = client.write_entry([entry(6, 9000)], 9000, name="sums", key=6)
            other = client.write_entry([entry(7, 9000)], 9000, name="sums", key=7)  # put under another key below
            assert good is not None and bad is not None and other is not None
            assert good.digest == real(os.geteuid(), b"sums", 5, entry(5, 9000))
            assert bad.digest is not None
            bad.digest ^= 1  # what a buggy client might send
            client.put_many("sums", [(5, good), (6, bad), (8, other), (9, entry(9, 500))])

        await trio.to_thread.run_sync(put)
        assert client._channel is not None and client._channel.uid == os.geteuid()  # the hello's answer
        assert computed == [8]  # the daemon read only the payload that came without its checksum
        got = await trio.to_thread.run_sync(client.get_many, "sums", [5, 6, 8, 9])
        assert got == [entry(5, 9000), None, entry(7, 9000), entry(9, 500)]
        assert store.corrupt == 1 and store.statistics().caches[0].entries == 3  # the bad one freed
        with pytest.raises(StoreError, match="unsigned 64-bit"):
            await trio.to_thread.run_sync(client._call, {"op": "sample_put", "name": "sums", "items": [[1, 0, 8, -1]]})
        client.close()


async def test_answers_larger_than_the_ring_come_in_rounds_and_are_counted_once(tmp_path: Path) -> None:
    size = RING // 3 + 1  # two fit a ring, three do not
    async with serving(tmp_path) as (store, _, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))
        keys = list(range(7))
        await trio.to_thread.run_sync(client.put_many, "big", [(k, entry(k, size)) for k in keys])
        assert store.statistics().caches[0].entries == 7  # puts too were split to fit the ring
        got = await trio.to_thread.run_sync(client.get_many, "big", keys + [99])
        assert got == [entry(k, size) for k in keys] + [None]
        (stats,) = store.statistics().caches
        assert (stats.hits, stats.misses) == (7, 1)
        # An entry larger than the ring cannot travel: dropped by the client (a cache may drop).
        await trio.to_thread.run_sync(client.put_many, "big", [(100, b"x" * (RING + 1)), (101, b"small")])
        assert await trio.to_thread.run_sync(client.get_many, "big", [100, 101]) == [None, b"small"]
        client.close()


async def test_refusals_are_store_errors_and_the_connection_stays(tmp_path: Path) -> None:
    async with serving(tmp_path) as (store, plane, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))
        await trio.to_thread.run_sync(client.put_many, "mine", [(1, b"a")])
        for call in (lambda: client.get_many("../etc", [1]), lambda: client.put_many("a/b", [(1, b"x")]),
                     lambda: client.plan("..", [1])):
            with pytest.raises(StoreError):
                await trio.to_thread.run_sync(call)
        # Still the same connection, still served.
        assert await trio.to_thread.run_sync(client.get_many, "mine", [1]) == [b"a"]
        assert plane.connections == 1
        # A foreign reference is read-only on the client: nothing is sent.
        await trio.to_thread.run_sync(client.put_many, f"~{os.geteuid() + 1}/x", [(1, b"x")])
        await trio.to_thread.run_sync(client.plan, f"~{os.geteuid() + 1}/x", [1])
        assert len(store.statistics().caches) == 1
        client.close()


async def test_a_plan_beyond_the_ring_is_cut_to_what_the_ring_holds(tmp_path: Path) -> None:
    async with serving(tmp_path) as (store, _, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))
        await trio.to_thread.run_sync(client.plan, "long", np.arange(RING // 8 + 1000).tolist())
        assert store.statistics().caches[0].planned == RING // 8
        client.close()


async def test_a_plan_can_ask_which_keys_are_held(tmp_path: Path) -> None:
    async with serving(tmp_path) as (store, _, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))

        def work() -> Any:
            client.put_many("held", [(k, entry(k, 100)) for k in range(10)])
            return client.plan_held("held", [5, 50, 0, 9, -1])

        held = await trio.to_thread.run_sync(work)
        assert held.tolist() == [True, False, True, True, False]
        assert store.statistics().caches[0].planned == 5  # a plan all the same
        assert await trio.to_thread.run_sync(client.plan_held, f"~{os.geteuid()}/held", [5]) is None  # read-only
        client.close()


async def test_the_plans_of_two_processes_are_merged_until_one_exits(tmp_path: Path) -> None:
    """Another process (a second rank) plans its share of the same cache: the daemon holds
    both shares (sources told apart by the data socket's peer pid); once that process has
    exited, the next plan drops its share."""
    async with serving(tmp_path) as (store, _, vol):
        child = (f"from cube_torch.samples.daemon_store import DaemonStore\n"
                 f"s = DaemonStore({vol!r}, config_dir={str(tmp_path)!r})\n"
                 f"s.plan('ranks', list(range(100, 130)))\ns.close()\n")
        client = DaemonStore(vol, config_dir=str(tmp_path))
        await trio.to_thread.run_sync(client.plan, "ranks", list(range(20)))
        result = await trio.run_process([sys.executable, "-c", child], capture_stderr=True, check=False,
                                        env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 0, result.stderr
        assert store.statistics().caches[0].planned == 20 + 30
        await trio.to_thread.run_sync(client.plan, "ranks", list(range(10)))  # the child has exited
        assert store.statistics().caches[0].planned == 10
        client.close()


def test_no_daemon_is_a_prompt_store_error(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(StoreError, match="no daemon"):
        DaemonStore("nothing-here", config_dir=str(tmp_path)).get_many("x", [1])
    with pytest.raises(StoreError, match="volume"):
        DaemonStore("", config_dir=str(tmp_path)).get_many("x", [1])
    assert time.monotonic() - started < 1.0


def _silent_daemon(path: str, stop: threading.Event) -> None:
    """Accepts, answers the hello with a ring, then never answers again."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(10)
    conn, _ = listener.accept()
    conn.recv(4096)
    ring = Ring(RING)
    socket.send_fds(conn, [json.dumps({"ring": RING, "version": 1}).encode()], [ring.fd])
    stop.wait(30)
    conn.close()
    ring.close()
    listener.close()


def test_a_daemon_that_stops_answering_costs_one_bounded_wait(tmp_path: Path) -> None:
    path = str(tmp_path / "silent.sock")
    vol = volume(tmp_path, path, "silent")
    stop = threading.Event()
    thread = threading.Thread(target=_silent_daemon, args=(path, stop), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        client = DaemonStore(vol, config_dir=str(tmp_path), reply_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(StoreError):
            client.get_many("x", [1])
        assert time.monotonic() - started < 5.0
        assert client._channel is None  # dropped: a late answer can never be taken for the next one
    finally:
        stop.set()
        thread.join(timeout=10)


async def test_an_idle_connection_is_replaced_before_the_daemon_closes_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from cube_torch.samples import daemon_store
    from cubefs_fuse.control import dataplane

    monkeypatch.setattr(dataplane, "IDLE_DEADLINE", 0.3)
    async with serving(tmp_path) as (_, _, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))
        await trio.to_thread.run_sync(client.put_many, "c", [(1, b"one")])
        # Without the refresh, a call after the daemon's idle deadline meets a closed connection.
        monkeypatch.setattr(daemon_store, "REFRESH_AFTER", 60.0)
        await trio.sleep(0.6)
        with pytest.raises(StoreError):
            await trio.to_thread.run_sync(client.get_many, "c", [1])
        # With it (the real setting is half the daemon's deadline), the idle connection is replaced.
        monkeypatch.setattr(daemon_store, "REFRESH_AFTER", 0.15)
        assert await trio.to_thread.run_sync(client.get_many, "c", [1]) == [b"one"]
        await trio.sleep(0.6)
        assert await trio.to_thread.run_sync(client.get_many, "c", [1]) == [b"one"]
        client.close()


def test_the_refresh_comes_before_the_daemons_idle_deadline() -> None:
    from cube_torch.samples import daemon_store
    from cubefs_fuse.control import dataplane

    assert daemon_store.REFRESH_AFTER < dataplane.IDLE_DEADLINE


async def test_a_closed_connection_frees_its_ring_off_the_trio_thread(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    closed_on: list[threading.Thread] = []
    close = Ring.close

    def recording_close(ring: Ring) -> None:
        closed_on.append(threading.current_thread())
        close(ring)

    monkeypatch.setattr(Ring, "close", recording_close)
    async with serving(tmp_path) as (_, plane, vol):
        client = DaemonStore(vol, config_dir=str(tmp_path))
        await trio.to_thread.run_sync(client.put_many, "c", [(1, b"a" * 100_000)])  # the ring's pages in use
        assert plane.rings == 1
        client.close()
        with trio.fail_after(10):
            while plane.rings or not closed_on:
                await trio.sleep(0.01)
    assert len(closed_on) == 1
    assert closed_on[0] is not threading.main_thread()  # (the trio thread here)
