"""Which store a ``store=`` argument names: ``open_store(spec)`` maps ``None`` to the node's
daemon (``DaemonStore``), ``"redis://[[user]:password@]host[:port][/db]"`` (or
``rediss://``) to one Redis server,
``"redis+cluster://[[user]:password@]host:port[,host:port...]"`` to a Redis Cluster, and an
object with the :class:`~cube_torch.samples.store.SampleStore` methods to itself. Store
modules are imported lazily, so a process that never asks for Redis never imports redis-py,
and at once by :func:`preload` when a cache is made, so DataLoader workers forked anew each
epoch find them imported."""

from __future__ import annotations

from typing import Any

from cube_torch.samples.store import SampleStore, StoreError

ACCEPTED = ("None (the node's cubefs-fuse daemon), 'redis://host:port/db', 'rediss://host:port/db', "
            "'redis+cluster://host:port[,host:port...]', 'unix:///path/redis.sock' or a SampleStore object")
METHODS = ("get_many", "put_many", "plan", "close")


def check_spec(spec: Any) -> None:
    """Raise ValueError (one line) unless ``spec`` is a store specification :func:`open_store` takes."""
    if spec is None:
        return
    if isinstance(spec, str):
        if spec.startswith(("redis://", "rediss://", "redis+cluster://", "unix://")):
            return
        raise ValueError(f"unknown sample store {spec!r}: expected {ACCEPTED}")
    if all(callable(getattr(spec, m, None)) for m in METHODS):
        return
    raise ValueError(f"a sample store of type {type(spec).__name__}: expected {ACCEPTED}")


def open_store(spec: Any) -> SampleStore:
    """The store ``spec`` names (see the module docstring); StoreError when it cannot be had.

    Nothing here connects: stores connect on their first call.
    """
    check_spec(spec)
    if spec is None:
        try:
            from cube_torch.samples.daemon_store import DaemonStore  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise StoreError(f"the daemon store is not available in this cube_torch ({exc})") from None
        store: SampleStore = DaemonStore()
        return store
    if isinstance(spec, str):
        from cube_torch.samples.redis_store import RedisClusterStore, RedisStore

        if spec.startswith("redis+cluster://"):
            return RedisClusterStore(spec)
        return RedisStore(spec)
    store = spec
    return store


def preload(spec: Any) -> None:
    """Import what :func:`open_store` will need for ``spec``, now: the process that makes a
    cache (the training script's) forks the DataLoader workers, which would otherwise each
    import it afresh every epoch (redis-py: ~0.1 s of CPU per worker and epoch, ~0.5 ms per
    sample of a 200-sample share).  Failures are left for open_store to report."""
    try:
        if spec is None:
            import cube_torch.samples.daemon_store  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
        elif isinstance(spec, str):
            from cube_torch.samples.redis_store import preload_client

            preload_client()
    except ImportError:
        pass
