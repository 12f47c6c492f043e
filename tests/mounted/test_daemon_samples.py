"""The processed-sample cache's daemon store against a real daemon (``cubefs-fuse mount``):
cube_torch's DaemonStore over the data socket, a restart that keeps the entries, two
users (setuid'd subprocesses) who cannot read or overwrite each other's entries, the
operator's status and drop-cache --samples, and the per-cache metrics.

Entries are raw bytes: the store never looks inside them (the training side's codec and
CachedDataset are tested with it in their own files).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cube_torch.samples.daemon_store import DaemonStore
from cubefs_fuse.samples import files
from tests.helpers import REPO, Mount, cli, metric, resident_pages, wait_until, write_tree

ALICE, BOB = 4001, 4002  # uids without a passwd entry: only the numbers matter

# Runs DaemonStore calls as another uid: imports as root (the interpreter may live where
# only root reads), then drops every privilege; prints one JSON answer per action.
AS_USER = """
import json, os, sys
from cube_torch.samples.daemon_store import DaemonStore
from cube_torch.samples.store import StoreError
from cubefs_fuse.control.protocol import ControlClient, ProtocolError, read_volume_config
uid = int(sys.argv[1])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
assert os.getuid() == os.geteuid() == uid
vol, config_dir, actions = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
store = DaemonStore(vol, config_dir=config_dir)
out = []
for kind, name, arg in actions:
    try:
        if kind == "put":
            store.put_many(name, [(k, v.encode()) for k, v in arg])
            out.append("ok")
        elif kind == "get":
            out.append([None if d is None else bytes(d).decode() for d in store.get_many(name, arg)])
        elif kind == "raw_put":  # what a client that skips DaemonStore's own check would send
            channel = store._connect()
            channel.ring[0:5] = b"EVIL!"
            out.append(channel.call({"op": "sample_put", "name": name, "items": [[arg, 0, 5]]}))
        elif kind == "drop":
            control = read_volume_config(vol, config_dir).control_socket
            out.append(ControlClient(control, timeout=10).request("POST", "samples/drop", query={"name": name}, body=b"{}"))
        elif kind == "status":  # the sample caches this uid may see
            control = read_volume_config(vol, config_dir).control_socket
            samples = ControlClient(control, timeout=10).request("GET", "status")["samples"]
            out.append({"caches": sorted([c["name"], c["owner"]] for c in samples["caches"]),
                        "hidden": samples["hidden"]})
    except (StoreError, ProtocolError) as exc:
        out.append({"error": str(exc)})
print(json.dumps(out))
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other uids can reach (pytest's tmp_path has 0700 parents): the sockets
    and the per-volume file go there, so only the daemon's checks stand between users."""
    path = Path(tempfile.mkdtemp(prefix="samples-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _mount(make_mount: Callable[..., Mount], shared_dir: Path, **overrides: Any) -> Mount:
    settings: dict[str, Any] = {"profile": "ai_prefetch", "memCacheSize": "64MiB", "sampleCacheMemSize": "16MiB",
                                "sampleCacheDiskSize": "64MiB", "configDir": str(shared_dir),
                                "controlSocket": str(shared_dir / "ctl.sock")}
    m = make_mount(**{**settings, **overrides})
    write_tree(m.source, {"a.bin": b"x"})
    m.mount()
    return m


def _store(m: Mount) -> DaemonStore:
    return DaemonStore(m.config()["volName"], config_dir=m.config()["configDir"])


def _as(uid: int, m: Mount, actions: list[tuple[str, str, Any]]) -> list[Any]:
    result = subprocess.run([sys.executable, "-c", AS_USER, str(uid), m.config()["volName"], m.config()["configDir"],
                             json.dumps(actions)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    answers: list[Any] = json.loads(result.stdout)
    return answers


def _status(m: Mount) -> dict[str, Any]:
    result = cli("status", str(m.mount_point), "--json")
    assert result.returncode == 0, result.stderr
    samples: dict[str, Any] = json.loads(result.stdout)[0]["samples"]
    return samples


def test_entries_round_trip_survive_a_restart_and_are_dropped(make_mount: Callable[..., Mount],
                                                              shared_dir: Path) -> None:
    m = _mount(make_mount, shared_dir)
    entries = {k: os.urandom(1000 + 3000 * k) for k in range(40)}
    try:
        store = _store(m)
        wait_until(lambda: _status(m)["loaded"], what="the sample store's start-up scan")
        store.put_many("sweep", list(entries.items()))
        store.plan("sweep", list(range(39, -1, -1)))
        assert store.get_many("sweep", [5, 1000, 39]) == [entries[5], None, entries[39]]
        store.close()
        # The put came from the ring's page-aligned slots: written, and read, without the
        # page cache (O_DIRECT), so none of the segment's pages are cached.
        (written,) = (m.cache_dir / "samples" / str(os.geteuid()) / "sweep").iterdir()
        assert written.stat().st_size == sum(files.span(len(e)) for e in entries.values())
        assert resident_pages(written) == 0
        # The operator sees the cache: name, owner, entries, bytes, hits, misses.
        (cache,) = _status(m)["caches"]
        assert (cache["name"], cache["owner"], cache["entries"], cache["hits"], cache["misses"]) == \
            ("sweep", os.geteuid(), 40, 2, 1)
        assert cache["bytes"] == sum(len(e) for e in entries.values())
        human = cli("status", str(m.mount_point))
        assert human.returncode == 0 and "sweep" in human.stdout and "sample store" in human.stdout, human.stdout
        samples = m.scrape()
        labels = {"sample_cache": "sweep", "owner": str(os.geteuid())}
        assert metric(samples, "cubefs_fuse_sample_cache_entries", **labels) == 40
        assert metric(samples, "cubefs_fuse_sample_cache_hits_total", **labels) == 2
        assert metric(samples, "cubefs_fuse_sample_cache_misses_total", **labels) == 1
        assert metric(samples, "cubefs_fuse_sample_cache_puts_total", **labels) == 40
        assert metric(samples, "cubefs_fuse_sample_store_limit_bytes", tier="disk") == 64 * 2**20
        assert 0 < metric(samples, "cubefs_fuse_sample_store_used_bytes", tier="disk") <= 64 * 2**20
        # What applications read: the two entries served are the sample cache's requests.
        served = len(entries[5]) + len(entries[39])
        assert metric(samples, "cubefs_fuse_app_requests_total", path="sample_cache", result="hit") == 2
        assert metric(samples, "cubefs_fuse_app_bytes_total", path="sample_cache") == served

        # A second run of the daemon: the entries come back from NVMe (a sweep decodes once).
        m.umount()
        # Meanwhile one entry is damaged (a flipped payload byte): never served.  The put was
        # one batch, so one segment file, its entries in the put's order.
        (segment,) = (m.cache_dir / "samples" / str(os.geteuid()) / "sweep").iterdir()
        offset = files.layout([len(e) for e in entries.values()])[7]
        with open(segment, "r+b") as f:
            f.seek(files.payload_offset(offset) + len(entries[7]) - 1)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([last ^ 0x55]))
        blocks = segment.stat().st_blocks * 512
        m.mount()
        wait_until(lambda: _status(m)["loaded"], what="the sample store's start-up scan")
        store = _store(m)
        expected: list[bytes | None] = [None if k == 7 else e for k, e in entries.items()]
        assert store.get_many("sweep", list(entries)) == expected
        store.close()
        assert _status(m)["caches"][0]["hits"] == 39
        assert metric(m.scrape(), "cubefs_fuse_sample_store_corrupt_total") == 1
        # Its blocks were freed (punched out of the segment); the others stay.
        assert segment.stat().st_blocks * 512 == blocks - files.span(len(entries[7]))

        # drop-cache --samples destroys it (the mount found through VOL_NAME).
        dropped = subprocess.run([sys.executable, "-m", "cubefs_fuse", "drop-cache", "--samples", "sweep"],
                                 capture_output=True, text=True, timeout=60, cwd=REPO,
                                 env={**os.environ, "VOL_NAME": m.config()["volName"]})
        assert dropped.returncode == 0, dropped.stderr
        assert "39 entries" in dropped.stdout
        assert _status(m)["caches"] == []
        assert not list((m.cache_dir / "samples" / str(os.geteuid())).glob("sweep/*"))
        missing = cli("drop-cache", str(m.mount_point), "--samples", "sweep")
        assert missing.returncode == 1 and "no sample cache" in missing.stderr and "Traceback" not in missing.stderr
        store = _store(m)
        assert store.get_many("sweep", [5]) == [None]
        store.close()
        # The cache is gone, what it served stays counted (this run of the daemon: 39 hits).
        reads = cli("status", str(m.mount_point), "--json")
        by_path = json.loads(reads.stdout)[0]["reads"]["by_path"]["sample_cache"]
        assert (by_path["requests"], by_path["misses"]) == (39, 0)
        assert by_path["bytes"] == sum(len(e) for k, e in entries.items() if k != 7)
    finally:
        m.umount()


def test_eviction_frees_disk_space_as_it_goes(make_mount: Callable[..., Mount], shared_dir: Path) -> None:
    """NVMe only, a budget of 4 MiB, 12 MiB of entries in batches of 8: what is evicted is
    freed on disk (punched out of its segment, the segment removed with its last entry),
    so the directory never takes more than the budget, and the survivors read back."""
    m = _mount(make_mount, shared_dir, sampleCacheMemSize="0", sampleCacheDiskSize="4MiB")
    root = m.cache_dir / "samples" / str(os.geteuid()) / "epoch"
    entries = {k: os.urandom(150_000) for k in range(80)}
    try:
        wait_until(lambda: _status(m)["loaded"], what="the sample store's start-up scan")
        store = _store(m)
        for start in range(0, 80, 8):
            store.put_many("epoch", [(k, entries[k]) for k in range(start, start + 8)])
            allocated = sum(p.stat().st_blocks * 512 for p in root.iterdir())
            disk = _status(m)["disk"]
            assert allocated <= disk["used_bytes"] <= 4 * 2**20, (start, allocated, disk)
        assert len(list(root.iterdir())) <= 4  # older segments went with their last entry
        got = store.get_many("epoch", list(entries))
        store.close()
        kept = [k for k, data in zip(entries, got) if data is not None]
        assert kept and all(got[k] == entries[k] for k in kept)
        assert len(kept) == _status(m)["disk"]["entries"] == 4 * 2**20 // files.allocated_bytes(150_000)
        assert set(kept) == set(range(80 - len(kept), 80))  # least recently used first
    finally:
        m.umount()


def test_two_users_cannot_read_or_overwrite_each_others_entries(make_mount: Callable[..., Mount],
                                                               shared_dir: Path) -> None:
    m = _mount(make_mount, shared_dir, controlAllowUids=[ALICE, BOB], sampleCacheShared=[f"{ALICE}:public"])
    try:
        wait_until(lambda: _status(m)["loaded"], what="the sample store's start-up scan")
        assert _as(ALICE, m, [("put", "model", [[1, "alice-1"], [2, "alice-2"]]),
                              ("put", "public", [[1, "alice-public"]])]) == ["ok", "ok"]
        bob = _as(BOB, m, [
            ("get", "model", [1, 2]),  # his own namespace: the same name is another cache
            ("get", f"~{ALICE}/model", [1]),  # not shared: refused
            ("get", f"~{ALICE}/public", [1]),  # shared read-only by the daemon's config
            ("put", f"~{ALICE}/public", [[1, "bob-overwrites"]]),  # DaemonStore sends nothing
            ("raw_put", f"~{ALICE}/public", 1),  # the daemon refuses it anyway
            ("raw_put", f"~{ALICE}/model", 2),
            ("put", "model", [[1, "bob-1"]]),
            ("drop", f"~{ALICE}/model", None),
        ])
        assert bob[0] == [None, None]
        assert "not shared" in bob[1]["error"]
        assert bob[2] == ["alice-public"]
        assert bob[3] == "ok"
        assert "only its owner writes" in bob[4]["error"] and "only its owner writes" in bob[5]["error"]
        assert bob[6] == "ok"
        assert "403" in bob[7]["error"]
        # Alice's entries are hers, unchanged; Bob's "model" is his own.
        alice = _as(ALICE, m, [("get", "model", [1, 2]), ("get", "public", [1]), ("get", f"~{BOB}/model", [1])])
        assert alice[:2] == [["alice-1", "alice-2"], ["alice-public"]]
        assert "not shared" in alice[2]["error"]
        assert _as(BOB, m, [("get", "model", [1])]) == [["bob-1"]]
        owners = {(c["name"], c["owner"]) for c in _status(m)["caches"]}
        assert owners == {("model", ALICE), ("public", ALICE), ("model", BOB)}  # root sees every cache
        # A user's status shows the caches it may read, not the names of the others'.
        assert _as(BOB, m, [("status", "", None)]) == [
            {"caches": [["model", BOB], ["public", ALICE]], "hidden": 1}]
        assert _as(ALICE, m, [("status", "", None)]) == [
            {"caches": [["model", ALICE], ["public", ALICE]], "hidden": 1}]
        # Root reads anyone's entries (an administrator), and may drop them.
        store = _store(m)
        assert store.get_many(f"~{ALICE}/model", [1]) == [b"alice-1"]
        store.close()
        dropped = cli("drop-cache", str(m.mount_point), "--samples", f"~{ALICE}/model")
        assert dropped.returncode == 0, dropped.stderr
        assert _as(ALICE, m, [("get", "model", [1])]) == [[None]]
    finally:
        m.umount()
