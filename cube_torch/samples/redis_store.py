"""Sample stores on Redis: one server (``RedisStore``) or a Redis Cluster
(``RedisClusterStore``). Entries live under ``cube_torch:sample:<name>:<key>`` as plain
strings without a hash tag (a cluster spreads a dataset over all its slots); a batch is one
``MGET`` on a server, a ``ClusterPipeline`` of ``GET``s on a cluster; on a server a batch's
``SET``s go out in one ``sendmsg`` from reused buffers and their answers are read later
(:class:`SetWriter`), because redis-py's pipeline cost two system calls per entry. No TTL is
set: capacity is Redis's ``maxmemory`` and policy (docs/cube_torch.md advises
``allkeys-lru``); every failure, a full ``noeviction`` server included, is a
:class:`StoreError`, no call waits longer than the timeouts below plus one retry, and
nothing connects before the first call, so forked DataLoader workers open their own
connections."""

from __future__ import annotations

import os
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from cube_torch.samples.codec import Part, write_parts
from cube_torch.samples.store import StoreError

KEY_PREFIX = "cube_torch:sample:"
# Connecting to a server on the same LAN takes well under a millisecond; 2 s also covers a
# lost SYN (retransmitted after 1 s) and a loaded server, and bounds a dead address.
CONNECT_TIMEOUT = 2.0
# One batch (tens of entries of up to a few MB) takes milliseconds on a healthy server;
# 5 s bounds a hung or overloaded one (after which the cache bypasses it for a while).
SOCKET_TIMEOUT = 5.0
# One retry, at once: a connection the server closed while idle is reopened transparently;
# a server that is down costs two connect attempts, not redis-py's default backoff series.
RETRIES = 1
# Bytes asked of the socket per read: entries are hundreds of KB (a 224x224 image is 150 KB),
# and redis-py's default (64 KiB) costs several system calls per entry.
READ_SIZE = 1 << 20
# Buffers handed to one sendmsg call: Linux's IOV_MAX.
IOV_MAX = 1024
# Entry buffers kept for reuse by a store object (the cache's writer's), in bytes: a put's
# worth of 150 KB images (PUT_BATCH 64 x 150 KB ~ 10 MB) and change.  A fresh buffer's
# first touch costs a page fault per 4 KiB (~37 for 150 KB, ~85 us on the 2-core VM
# measured, 2.3 us each); a reused one none.  Per DataLoader worker, at most this much.
POOL_BYTES = 16 << 20
OOM_HINT = ("Redis is full (maxmemory reached with maxmemory-policy noeviction): new samples are not stored; "
            "set maxmemory-policy allkeys-lru (or raise maxmemory) on the server")


def key_of(name: str, key: int) -> str:
    return f"{KEY_PREFIX}{name}:{key}"


def _store_error(url: str, exc: BaseException) -> StoreError:
    message = str(exc)
    if message.startswith("OOM") or type(exc).__name__ == "OutOfMemoryError":
        return StoreError(f"{_redacted(url)}: {OOM_HINT}")
    return StoreError(f"{_redacted(url)}: {type(exc).__name__}: {message}")


def _redacted(url: str) -> str:
    """The URL without its password (for log lines)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.split("@", 1)[1]
    return parts._replace(netloc=f"{parts.username or ''}:***@{netloc}").geturl()


def _errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisClusterException, RedisError

    return (RedisError, RedisClusterException, OSError)


def _retry() -> Any:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), RETRIES)


class _Buffer(bytearray):
    """An entry buffer made by a store's write_entry (only those are reused)."""


class _RedisBase(ABC):
    """What both stores share: a client opened lazily per process, pipelined ``SET``s,
    no use for the plan, a best-effort close.  Subclasses open the client (``_open``)
    and read a batch (``get_many``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: Any = None
        self._pid = 0
        self._sets: SetWriter | None = None  # the single-server store's SET connection
        # Buffers of earlier entries, by size, free again (write_entry runs in the training
        # thread, put_many in the cache's writer thread: the lock is held for list operations).
        self._free: dict[int, list[_Buffer]] = {}
        self._free_bytes = 0
        self._free_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # pickled into workers: no client, buffers or lock
        state = self.__dict__.copy()
        state["_client"], state["_sets"], state["_free"], state["_free_bytes"] = None, None, {}, 0
        del state["_free_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._free_lock = threading.Lock()

    @abstractmethod
    def _open(self) -> Any:
        """A new client for this process (raises StoreError)."""

    def _connected(self) -> Any:
        if self._client is None or self._pid != os.getpid():  # never a parent's connection
            self._client = self._open()
            self._pid = os.getpid()
            self._sets = None
        return self._client

    def settle(self) -> None:
        """Read the answers of the last ``put_many`` (see :class:`SetWriter`); the cache's
        writer thread calls it once it has nothing more to put for a moment."""
        if self._sets is None or self._pid != os.getpid():
            return
        try:
            self._sets.settle()
        except _errors() as exc:
            raise _store_error(self.url, exc) from None

    def put_many(self, name: str, items: Sequence[tuple[int, bytes | bytearray]]) -> None:
        if not items:
            return
        try:
            self._put(self._connected(), name, items)
        except _errors() as exc:
            raise _store_error(self.url, exc) from None
        finally:
            for _, entry in items:
                self.release(entry)

    def prepare(self) -> None:
        """Connect now (the cache's writer thread does, ahead of its first put): the pool's
        connection, which a server store's SetWriter then takes for its SETs."""
        try:
            self._connected().ping()
        except _errors() as exc:
            raise _store_error(self.url, exc) from None

    def write_entry(self, parts: Sequence[Part], size: int, *, name: str | None = None,
                    key: int | None = None) -> bytearray:
        """The entry's parts copied into a buffer of this store's (the one copy,
        ``codec.write_parts``), to hand to ``put_many``, which frees it for a later entry of
        the same size: memory already touched (see POOL_BYTES).  (``name`` and ``key``, for
        the daemon store's checksum, are not needed here.)"""
        with self._free_lock:
            free = self._free.get(size)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._free_bytes -= size
        if buffer is None:
            buffer = _Buffer(size)
        with memoryview(buffer) as view:
            write_parts(list(parts), view)
        return buffer

    def release(self, entry: Any) -> None:
        """A buffer of write_entry's that will not be (or has been) put: free for reuse."""
        if type(entry) is not _Buffer:
            return
        with self._free_lock:
            if self._free_bytes + len(entry) <= POOL_BYTES:
                self._free.setdefault(len(entry), []).append(entry)
                self._free_bytes += len(entry)

    def _put(self, client: Any, name: str, items: Sequence[tuple[int, bytes | bytearray]]) -> None:
        pipe = client.pipeline(transaction=False)  # a cluster's pipelines never are
        for key, entry in items:
            pipe.set(key_of(name, key), entry)
        pipe.execute()

    def plan(self, name: str, keys: Sequence[int]) -> None:
        """Redis evicts by its own policy: the order is not used."""

    def close(self) -> None:
        client, self._client = self._client, None
        sets, self._sets = self._sets, None
        if client is not None and self._pid == os.getpid():
            try:
                if sets is not None:
                    sets.close()
                client.close()
            except _errors():
                pass


def _redis_py() -> Any:
    try:
        import redis
    except ImportError:
        raise StoreError("the redis store needs redis-py: pip install 'cubefs-fuse[redis]'") from None
    return redis


def preload_client() -> None:
    """Import redis-py and the parts of it the stores use (see stores.preload), and resolve
    the client identity every connection sends (:func:`_identity`); nothing if redis-py is
    not installed (open_store says so when the store is used)."""
    try:
        _redis_py()
    except StoreError:
        return
    import redis.backoff  # noqa: F401
    import redis.cluster  # noqa: F401
    import redis.exceptions  # noqa: F401
    import redis.retry  # noqa: F401

    # The codec a host name is encoded with when a socket connects (imported on first use,
    # stringprep with it): 1.6 ms of CPU in every fresh worker, measured.
    import encodings.idna  # noqa: F401

    # What redis-py's connection pool imports when it is made (redis-py 7/8: a random pool
    # id): a fresh worker's first client took 3.3 ms of CPU with them, 1.7 ms without.
    import hmac  # noqa: F401
    import secrets  # noqa: F401

    _identity()


_IDENTITY: dict[str, Any] | None = None


def _identity() -> dict[str, Any]:
    """The client options naming redis-py in CLIENT SETINFO, its version resolved once per
    process tree (here, or in the process that made the cache, before DataLoader workers
    fork): left to redis-py, every new connection reads the package's metadata through
    importlib.metadata, 1.7 ms of CPU per connection in a forked process and ~5 ms for the
    first (measured), two connections per worker and epoch."""
    global _IDENTITY
    if _IDENTITY is None:
        try:
            from redis.driver_info import DriverInfo  # redis-py 7+: lib_version is deprecated

            _IDENTITY = {"driver_info": DriverInfo()}  # (resolves the version now)
        except ImportError:
            from redis.utils import get_lib_version

            _IDENTITY = {"lib_version": get_lib_version()}  # type: ignore[no-untyped-call]
    return _IDENTITY


class RedisStore(_RedisBase):
    """One Redis server: ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL (redis-py's forms)."""

    def _open(self) -> Any:
        redis = _redis_py()
        try:
            return redis.Redis.from_url(self.url, socket_timeout=SOCKET_TIMEOUT,
                                        socket_connect_timeout=CONNECT_TIMEOUT, retry=_retry(),
                                        socket_read_size=READ_SIZE, **_identity())
        except (ValueError, *_errors()) as exc:  # type: ignore[misc]
            raise _store_error(self.url, exc) from None

    def _put(self, client: Any, name: str, items: Sequence[tuple[int, bytes | bytearray]]) -> None:
        if self._sets is None:
            self._sets = SetWriter(client.connection_pool)
        self._sets.send(name, items)

    def get_many(self, name: str, keys: Sequence[int]) -> list[bytes | memoryview | None]:
        if not keys:
            return []
        self.settle()  # what this object put before is there for it to read
        client = self._connected()
        try:
            values = client.mget([key_of(name, k) for k in keys])
        except _errors() as exc:
            raise _store_error(self.url, exc) from None
        return _checked(values, len(keys))


class SetWriter:
    """Pipelined ``SET``s on a connection of their own, whose answers are read later.

    ``send`` writes a batch's ``SET``s in one ``sendmsg`` (redis-py's connection: its
    connect, AUTH, SELECT and TLS; a TLS socket cannot sendmsg, so it sends buffer by
    buffer) and returns: the kernel has copied the entries, their buffers are free.
    ``settle`` reads the answers, and ``send`` settles the previous batch first.  Read right
    after the send, the answers came one per ``recv`` as the server got to each ``SET``
    (~35 system calls and GIL hand-overs a batch of 32); read later, in one or two (measured
    in a fresh process: 4.6 -> 3.4 ms of CPU a batch of 32 150 KB entries, the first batch
    13.5 -> 11 ms).

    A connection the server closed (while idle) is replaced before a send; one found broken
    when sending is replaced and the batch sent once more (a ``SET`` is safe to repeat); a
    timeout is not retried.
    An error answer (``OOM``: full) raises, from the ``settle`` or ``send`` that reads it;
    on any failure the connection is dropped (unread answers with it).  A connection that
    broke after a send loses that batch silently (the store is a cache; the next send
    connects again)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.connection: Any = None
        self.unread = 0

    def send(self, name: str, items: Sequence[tuple[int, bytes | bytearray]]) -> None:
        self.settle()
        buffers: list[bytes | bytearray | memoryview] = []
        crlf = b""
        for key, entry in items:
            k = key_of(name, key).encode()
            buffers += (b"%s*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (crlf, len(k), k, len(entry)), entry)
            crlf = b"\r\n"
        buffers.append(crlf)
        from redis.exceptions import ConnectionError as Broken

        if self.connection is not None:
            try:
                if self.connection.can_read():  # nothing is due: the server closed it (idle), or worse
                    self._drop()
            except (OSError, Broken):
                self._drop()
        for attempt in range(1 + RETRIES):
            if self.connection is None:
                self.connection = self.pool.get_connection()  # kept: never back in the pool with answers unread
            try:
                self.connection.connect()  # (nothing when connected)
                sock = getattr(self.connection, "_sock", None)
                if type(sock) is socket.socket:  # not TLS: the whole batch in one system call
                    _sendmsg_all(sock, buffers)
                else:
                    self.connection.send_packed_command(buffers)
                self.unread = len(items)
                return
            except TimeoutError:
                self._drop()
                raise
            except (OSError, Broken):
                self._drop()
                if attempt == RETRIES:
                    raise
            except BaseException:
                self._drop()
                raise

    def settle(self) -> None:
        """Read the answers of the batch sent last (raises on an error answer)."""
        if not self.unread:
            return
        unread, self.unread = self.unread, 0
        from redis.exceptions import ConnectionError as Broken
        from redis.exceptions import TimeoutError as Hung

        try:
            for _ in range(unread):
                self.connection.read_response()
        except (Hung, TimeoutError):
            self._drop()
            raise
        except (OSError, Broken):
            self._drop()  # broke after the send: that batch may be lost (see the class docstring)
        except BaseException:
            self._drop()
            raise

    def close(self) -> None:
        try:
            self.settle()
        finally:
            if self.connection is not None:
                self.pool.release(self.connection)
                self.connection = None

    def _drop(self) -> None:
        self.unread = 0
        if self.connection is not None:
            self.connection.disconnect()


def _sendmsg_all(sock: socket.socket, buffers: list[bytes | bytearray | memoryview]) -> None:
    """Send every byte of ``buffers``, at most IOV_MAX of them per ``sendmsg`` (which may
    send part of them: the rest goes in the next call)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    start = 0
    while start < len(views):
        sent = sock.sendmsg(views[start:start + IOV_MAX])
        while sent and start < len(views):
            n = views[start].nbytes
            if sent >= n:
                sent -= n
                start += 1
            else:
                views[start] = views[start][sent:]
                sent = 0


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """``redis+cluster://[[user]:password@]host:port[,host:port...]`` -> (nodes, username, password)."""
    rest = url[len("redis+cluster://"):].split("/", 1)[0]
    username = password = None
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        user, _, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    nodes = []
    for part in rest.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a Redis Cluster URL names its nodes as host:port[,host:port...], not {part!r}")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, username, password


class RedisClusterStore(_RedisBase):
    """A Redis Cluster: ``redis+cluster://host:port[,host:port...]``; any reachable node will do
    (the client learns the slot map from it)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.nodes, self._username, self._password = cluster_nodes(url)

    def _open(self) -> Any:
        _redis_py()
        from redis.cluster import ClusterNode, RedisCluster

        try:
            startup = [ClusterNode(h, p) for h, p in self.nodes]  # type: ignore[no-untyped-call]
            return RedisCluster(startup_nodes=startup, username=self._username, password=self._password,
                                socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=CONNECT_TIMEOUT,
                                retry=_retry(), socket_read_size=READ_SIZE, **_identity())
        except _errors() as exc:
            raise _store_error(self.url, exc) from None

    def get_many(self, name: str, keys: Sequence[int]) -> list[bytes | memoryview | None]:
        if not keys:
            return []
        client = self._connected()
        try:
            pipe = client.pipeline()
            for k in keys:
                pipe.get(key_of(name, k))
            values = pipe.execute()
        except _errors() as exc:
            self._client = None  # a changed slot map or a dead node: ask the cluster again next time
            raise _store_error(self.url, exc) from None
        return _checked(values, len(keys))


def _checked(values: Any, expected: int) -> list[bytes | memoryview | None]:
    if not isinstance(values, list) or len(values) != expected:
        raise StoreError(f"Redis answered {type(values).__name__} for {expected} keys")
    for value in values:
        if value is not None and not isinstance(value, bytes):
            raise StoreError(f"Redis answered a {type(value).__name__} (is decode_responses set in the URL?)")
    return values
