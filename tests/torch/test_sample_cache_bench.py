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
