"""benchmarks/sample_cache.py's run with a local Redis: each fill (a fresh cache's first
epoch) gets a new, empty redis-server, the previous one stopped first, and the later
epochs read the last fill's server (all fills in one server would hold that many copies of
the dataset; see the module's docstring).  The server is reached over a unix socket, with
no TCP port open."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from benchmarks import sample_cache

FILES = 12  # one batch: a few seconds in all


def test_each_fill_of_a_local_redis_gets_a_new_empty_server(tmp_path: Path) -> None:
    sample_cache.make_photos(tmp_path / "photos", FILES, classes=2)
    servers: list[dict[str, int]] = []  # each server's pid, keys when it started and stopped, hits

    @contextmanager
    def fresh() -> Iterator[str]:
        assert all("stopped" in s for s in servers)  # the previous fill's server is gone first
        with sample_cache.local_redis(tmp_path) as url:
            assert url.startswith("unix://")
            client = redis.Redis.from_url(url)
            assert client.config_get("port") == {"port": "0"}  # no TCP
            servers.append({"pid": int(client.info("server")["process_id"]), "started": int(client.dbsize())})
            yield url
            servers[-1]["stopped"] = int(client.dbsize())
            servers[-1]["hits"] = int(client.info("stats")["keyspace_hits"])
            client.close()

    results, fills = sample_cache.run(tmp_path / "photos", None, epochs=2, workers=1, seed=0, fills=3,
                                      fresh_store=fresh)
    assert len(fills) == 3 and [r.epoch for r in results] == [1, 2]
    assert len({s["pid"] for s in servers}) == 3  # three servers
    assert [s["started"] for s in servers] == [0, 0, 0]  # each empty at its fill
    assert [s["stopped"] for s in servers] == [FILES] * 3  # each filled by its own fill
    assert [s["hits"] for s in servers] == [0, 0, FILES]  # epoch 2 read the last fill's server
    # Each fill and its baselines carry the whole machine's CPU per sample by kind, from /proc/stat.
    for result in fills + results:
        for figures in (result.cached_cpu, result.baseline_cpu):
            assert figures is not None and set(figures) == set(sample_cache.CPU_KINDS)
            assert all(v >= 0 for v in figures.values()) and sum(figures.values()) > 0
    cpu = sample_cache.fill_cpu(fills)
    assert cpu is not None and cpu["fills"]["user"] > 0 and cpu["baselines"]["user"] > 0


def test_fill_cpu_is_the_mean_over_the_fills_and_their_baselines() -> None:
    def kinds(user: float, steal: float) -> dict[str, float]:
        return {"user": user, "system": 10.0, "steal": steal, "idle": 5.0}

    fills = [sample_cache.Result(1, 100.0, 90.0, kinds(1000.0, 200.0), kinds(900.0, 20.0)),
             sample_cache.Result(1, 100.0, 95.0, kinds(1100.0, 100.0), kinds(950.0, 40.0))]
    assert sample_cache.fill_cpu(fills) == {"fills": kinds(1050.0, 150.0), "baselines": kinds(925.0, 30.0)}
    line = sample_cache.cpu_line(sample_cache.fill_cpu(fills))
    assert line is not None and "steal 150 (30)" in line and "user 1,050 (925)" in line
    # One fill without figures (/proc/stat unreadable then): no mean is made up.
    assert sample_cache.fill_cpu(fills + [sample_cache.Result(1, 100.0, 90.0)]) is None
    assert sample_cache.cpu_line(None) is None
