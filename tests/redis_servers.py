"""Real Redis servers for tests: one ``redis-server``, or a 3-master Redis Cluster.

Each server listens on a free loopback port with its files in a temporary directory and
no persistence, and is killed at teardown.  Fixtures (import them into a test module):

* ``redis_server``: one server, its ``redis://127.0.0.1:<port>/0`` URL in ``.url``;
* ``make_redis``: a factory ``make_redis(*extra_args)`` for servers with their own settings
  (e.g. ``"--maxmemory", "1mb", "--maxmemory-policy", "noeviction"``);
* ``redis_cluster``: 3 masters made with ``redis-cli --cluster create``, URL
  ``redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3>`` in ``.url``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# A server answers PING within milliseconds of starting; a cluster agrees on its slots within
# a second or two (cluster-node-timeout below): generous bounds for a loaded test machine.
START_TIMEOUT = 15.0
CLUSTER_TIMEOUT = 30.0
CLUSTER_NODE_TIMEOUT_MS = 2000


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port + 10000 free as well)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    result = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True,
                            text=True, timeout=timeout)
    return result.stdout.strip()


@dataclass
class RedisServer:
    port: int
    directory: Path
    args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server; scripts/setup.sh does it)",
                        pytrace=False)
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "wb")
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no", "--protected-mode", "no", *self.args],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while cli(self.port, "PING") != "PONG":
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server on port {self.port} did not start: "
                            f"{(self.directory / 'redis.log').read_text()[-2000:]}", pytrace=False)
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def keys(self) -> int:
        return int(cli(self.port, "DBSIZE") or 0)


@dataclass
class RedisCluster:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def make_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    started: list[RedisServer] = []

    def factory(*args: str) -> RedisServer:
        server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"), args)
        started.append(server)
        return server.start()

    yield factory
    for server in started:
        server.stop()


@pytest.fixture
def redis_server(make_redis: Callable[..., RedisServer]) -> RedisServer:
    return make_redis()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    nodes: list[RedisServer] = []
    try:
        for i in range(3):
            port = free_port(cluster_bus=True)
            directory = tmp_path_factory.mktemp(f"redis-cluster-{i}")
            nodes.append(RedisServer(port, directory, (
                "--cluster-enabled", "yes", "--cluster-config-file", str(directory / "nodes.conf"),
                "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS))).start())
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas", "0",
             "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert created.returncode == 0, created.stdout + created.stderr
        deadline = time.monotonic() + CLUSTER_TIMEOUT
        while not all("cluster_state:ok" in cli(n.port, "CLUSTER", "INFO") for n in nodes):
            assert time.monotonic() < deadline, "the Redis Cluster did not reach cluster_state:ok"
            time.sleep(0.1)
        yield RedisCluster(nodes)
    finally:
        for node in nodes:
            node.stop()
