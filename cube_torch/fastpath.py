"""The fast path, worker side: a batch's files from the daemon's cache, without FUSE. Inside
a DataLoader worker of a map-style dataset, each batch is first sent to the daemon in one
message over the data socket (daemon side: cubefs_fuse/control/dataplane.py), which answers
per file where its bytes lie in this worker's sealed memfd ring, or "read it through the
mount"; the bytes are copied out at once, and while the fetcher loads exactly that batch a
``builtins.open`` hook answers read-only binary opens of the served paths with a
:class:`FastFile`, every other open going to the real ``open`` and the mount. Every wait is
bounded (:data:`CONNECT_TIMEOUT`, :data:`REPLY_TIMEOUT`), any failure sends that batch and
those of the next :data:`RETRY_AFTER` seconds through the mount, and
``CUBE_TORCH_FAST_PATH=0`` turns it off (docs/contracts.md, "The fast path")."""

from __future__ import annotations

import bisect
import builtins
import io
import json
import logging
import mmap
import os
import socket
import time
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from cube_torch.client import once, warn_if_daemon_down, warn_no_volume
from cube_torch.files import Unsupported, relative_to_mount, sample_files
from cubefs_fuse.control.protocol import (MAX_BATCH_FILES, MAX_BATCH_MESSAGE, ProtocolError, VolumeConfig,
                                          read_volume_config)

log = logging.getLogger("cube_torch")

ENV_SWITCH = "CUBE_TORCH_FAST_PATH"
# A reply must arrive within this time: the daemon answers a batch within its own bound
# (prefetch/batches.py's BATCH_WAIT, 2 s) plus the copy into the ring; 10 s leaves room
# for a loaded machine, and a hung daemon costs a worker one such wait, then the mount.
REPLY_TIMEOUT = 10.0
# Connecting and the hello: a live daemon answers in well under a millisecond.
CONNECT_TIMEOUT = 2.0
# After a failure the worker reads through the mount for this long before trying again
# (a restarted daemon is found again; a broken one costs one try per half minute).
RETRY_AFTER = 30.0
# Reading the volume file is a few syscalls; re-read at most this often per worker.
VOLUME_TTL = 30.0
# Batches in a row whose served files the dataset's code never opened (it reads from C)
# before a worker stops asking the daemon for that dataset: two tell it is no accident.
USELESS_BATCHES = 2

# The main process's settings as of its loaders' latest epoch start, for its forked
# workers (see :func:`publish`): one anonymous shared page, mapped before any worker forks.
# Layout: byte 0 is 1 once published; byte 1 the name's length; then the volume name
# (UTF-8, at most MAX_PUBLISHED_NAME bytes: an empty name means "off").
MAX_PUBLISHED_NAME = 254
_published: mmap.mmap | None = None
_main_pid = 0  # the process that mapped it (its workers only read it)


def publish(vol_name: str | None) -> None:
    """In the main process, at each epoch start of a patched loader: the fast path's
    volume for this process's DataLoader workers (None or empty: off).

    Persistent workers are forked once, often before ``VOL_NAME`` is set (it may be set
    after ``import cube_torch``, and a warm-up pass may run unplanned); their environment
    is a copy taken at the fork.  So the main process also writes its current ``VOL_NAME``
    (empty when ``CUBE_TORCH_FAST_PATH=0``) into a shared page its forked workers read at
    every batch.  A worker that reads the page while it is being rewritten (an epoch
    starting while batches of the previous one still load) may see a garbled name: the
    volume file is then not found and that worker reads through the mount (logged once).
    """
    if _published is None or os.getpid() != _main_pid:
        return
    name = (vol_name or "").encode("utf-8", "surrogateescape")
    if os.environ.get(ENV_SWITCH, "1") == "0" or len(name) > MAX_PUBLISHED_NAME:
        name = b""
    _published[1:2 + len(name)] = bytes([len(name)]) + name
    _published[0] = 1


def unpublish() -> None:
    """Forget what was published: workers go by their own ``VOL_NAME`` again."""
    if _published is not None and os.getpid() == _main_pid:
        _published[0] = 0


def _published_name() -> str | None:
    """The volume the main process published (None: it never did; "": off)."""
    page = _published
    if page is None or page[0] != 1:
        return None
    size = page[1]
    return page[2:2 + size].decode("utf-8", "surrogateescape")


def volume_name() -> str:
    """The fast path's volume in this worker: the main process's ``VOL_NAME`` as of the
    latest epoch start (:func:`publish`), else this process's own ``VOL_NAME``."""
    published = _published_name()
    return published if published is not None else os.environ.get("VOL_NAME", "")


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and bool(volume_name())


def _warn_once(kind: str, message: str, *args: Any) -> None:
    if not once(f"fastpath:{kind}"):
        return
    log.warning("cube_torch: fast path: " + message + " (reading through the mount; logged once per process)", *args)


class FastFile(io.BytesIO):
    """A read-only binary file of bytes the daemon served (what ``open(path, "rb")`` gives)."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)  # shares ``data`` (a bytes object): no copy
        self.name = name

    @property
    def mode(self) -> str:
        return "rb"

    def writable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        raise io.UnsupportedOperation("not writable")

    def writelines(self, lines: Any) -> None:
        raise io.UnsupportedOperation("not writable")

    def truncate(self, size: int | None = None) -> int:
        raise io.UnsupportedOperation("not writable")


class Channel:
    """One connection to the daemon's data socket, with its ring (one per worker process).

    ``writable`` maps the ring writable too (the sample store's puts and plans are written
    into it by the client; cube_torch/samples/daemon_store.py); the fast path only reads.
    """

    def __init__(self, path: str, *, connect_timeout: float = CONNECT_TIMEOUT,
                 reply_timeout: float = REPLY_TIMEOUT, writable: bool = False) -> None:
        self.reply_timeout = reply_timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(connect_timeout)
            sock.connect(path)
            sock.send(b'{"op":"hello"}')
            message, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            try:
                reply = _decode(message)
                if len(fds) != 1 or not isinstance(reply.get("ring"), int):
                    raise ProtocolError(0, f"bad hello reply {reply!r}")
                size = reply["ring"]
                protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                self.ring = mmap.mmap(fds[0], size, mmap.MAP_SHARED, protection)
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(reply_timeout)
        self.sock = sock
        self.size = size
        # This process's uid as the daemon sees it (an older daemon does not say): the owner
        # a sample entry's checksum names (cube_torch/samples/daemon_store.py).
        uid = reply.get("uid")
        self.uid: int | None = uid if type(uid) is int and 0 <= uid < 1 << 32 else None

    def batch(self, paths: list[str]) -> list[bytes | None]:
        """Each path's bytes, or None: read it through the mount.  Raises on any failure."""
        request = json.dumps({"op": "batch", "paths": paths}, separators=(",", ":")).encode()
        if len(request) > MAX_BATCH_MESSAGE:
            raise ValueError("batch too large for one message")
        self.sock.send(request)
        reply = _decode(self.sock.recv(MAX_BATCH_MESSAGE))
        files = reply.get("files")
        if not isinstance(files, list) or len(files) != len(paths):
            raise ProtocolError(0, f"bad batch reply ({str(reply)[:200]})")
        out: list[bytes | None] = []
        for entry in files:
            if entry is None:
                out.append(None)
                continue
            offset, length = entry
            if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset <= offset + length <= self.size):
                raise ProtocolError(0, f"bad ring slot {entry!r}")
            out.append(self.ring[offset:offset + length])  # a copy: the ring is the daemon's again
        return out

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one JSON message and return the daemon's answer; an error answer raises
        ProtocolError (with its status), anything else broken OSError or ValueError."""
        message = json.dumps(request, separators=(",", ":")).encode()
        if len(message) > MAX_BATCH_MESSAGE:
            raise ValueError("request too large for one message")
        self.sock.send(message)
        return _decode(self.sock.recv(MAX_BATCH_MESSAGE))

    def release(self, opens: list[int]) -> None:
        """The batch is loaded: its ring bytes are the daemon's again; ``opens``: how often
        the loading code opened each file of the batch from the ring (0: never, e.g. it
        reads from C; each open is one request for the daemon, as through the mount)."""
        self.sock.send(json.dumps({"op": "release", "opens": opens}, separators=(",", ":")).encode())

    def close(self) -> None:
        self.sock.close()
        self.ring.close()


def _decode(message: bytes) -> dict[str, Any]:
    if not message:
        raise ProtocolError(0, "the daemon closed the data connection")
    data = json.loads(message)
    if not isinstance(data, dict):
        raise ProtocolError(0, "reply is not a JSON object")
    if "error" in data:
        raise ProtocolError(int(data.get("status", 400)), str(data["error"]))
    return data


class _Worker:
    """The fast path's state in one process (a forked worker starts afresh: keyed by pid)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.channel: Channel | None = None
        self.retry_at = 0.0
        self.volume: tuple[float, str, str, str] | None = None  # (read at, vol_name, mount point, data socket)
        self.volume_config: VolumeConfig | None = None  # the file read then
        self.mappings: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.mappings_by_id: dict[int, Any] = {}
        self.useless: dict[int, int] = {}  # id(dataset) -> batches in a row none of whose served files were opened

    def _volume(self, vol_name: str) -> tuple[str, str] | None:
        now = time.monotonic()
        if self.volume is None or self.volume[1] != vol_name or now - self.volume[0] > VOLUME_TTL:
            try:
                config = read_volume_config(vol_name)
            except ProtocolError as exc:
                warn_no_volume(vol_name, exc)  # once per process tree: the main process's plan says the same
                self.retry_at = now + RETRY_AFTER
                return None
            self.volume = (now, vol_name, config.mount_point, config.data_socket)
            self.volume_config = config
        if not self.volume[3]:
            _warn_once("no-data-socket", "the daemon of volume %r has no data socket (an older version)", vol_name)
            self.retry_at = now + RETRY_AFTER
            return None
        return self.volume[2], self.volume[3]

    def _mapping(self, dataset: Any) -> Any:
        try:
            mapping = self.mappings.get(dataset)
        except TypeError:
            mapping = self.mappings_by_id.get(id(dataset))
        if mapping is None:
            try:
                mapping = sample_files(dataset)
            except Unsupported:
                mapping = False
            try:
                self.mappings[dataset] = mapping
            except TypeError:
                self.mappings_by_id[id(dataset)] = mapping
        return mapping

    def resolve(self, dataset: Any, indices: list[int]) -> tuple[list[str], dict[str, bytes]]:
        """The batch's files (absolute paths, as sent) and the served ones: absolute path ->
        bytes (nothing on any failure)."""
        if time.monotonic() < self.retry_at:
            return [], {}
        if self.useless.get(id(dataset), 0) >= USELESS_BATCHES:
            return [], {}
        mapping = self._mapping(dataset)
        if not mapping:
            return [], {}
        vol_name = volume_name()
        if not vol_name:
            return [], {}
        found = self._volume(vol_name)
        if found is None:
            return [], {}
        mount_point, data_socket = found
        relative: dict[str, str] = {}  # relative path -> absolute path, in batch order
        try:
            for index in indices:
                for path in mapping(int(index)):
                    rel = relative_to_mount(path, mount_point)
                    if rel and rel not in relative:
                        relative[rel] = os.path.join(mount_point, rel)
        except Exception as exc:  # an index the mapping does not know: the dataset's own code decides
            _warn_once("mapping", "could not map this batch's samples to files: %r", exc)
            return [], {}
        if not relative:
            return [], {}
        paths = list(relative)[:MAX_BATCH_FILES]
        try:
            if self.channel is None:
                try:
                    self.channel = Channel(data_socket)
                except (FileNotFoundError, ConnectionRefusedError):
                    config = self.volume_config
                    if config is not None and warn_if_daemon_down(vol_name, config):
                        self.retry_at = time.monotonic() + RETRY_AFTER  # said once per process tree
                        return [], {}
                    raise
            answers = self.channel.batch(paths)
        except (OSError, ValueError, ProtocolError) as exc:
            self.fail(exc)
            return [], {}
        absolute = [relative[p] for p in paths]
        return absolute, {a: data for a, data in zip(absolute, answers) if data is not None}

    def fail(self, exc: Exception) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.retry_at = time.monotonic() + RETRY_AFTER
        _warn_once(f"failed:{type(exc).__name__}", "the daemon's data socket failed: %r", exc)

    def release(self, dataset: Any, paths: list[str], served: dict[str, bytes], used: dict[str, int]) -> None:
        opens = [used.get(p, 0) for p in paths]
        unused = [p for p in served if not used.get(p)]
        # A loader that never opens its files from Python (cv2, os.open) gains nothing here:
        # after USELESS_BATCHES such batches in a row its batches go straight to the mount.
        if served:
            key = id(dataset)
            self.useless[key] = self.useless.get(key, 0) + 1 if len(unused) == len(served) else 0
        if self.channel is None:
            return
        try:
            self.channel.release(opens)
        except OSError as exc:
            self.fail(exc)


_state: _Worker | None = None


def _worker() -> _Worker:
    global _state
    if _state is None or _state.pid != os.getpid():
        _state = _Worker()  # never a parent's connection or ring
    return _state


# -- the scoped open hook -----------------------------------------------------------------

_served: dict[str, bytes] = {}  # the current batch's files (absolute path -> bytes)
_used: dict[str, int] = {}  # how often each of them was opened so far
_outer_open: Any = None  # the open in place when the batch's scope began


def _hooked_open(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                 errors: str | None = None, newline: str | None = None, closefd: bool = True,
                 opener: Any = None) -> Any:
    if (_served and mode in ("rb", "br") and encoding is None and errors is None and newline is None
            and closefd and opener is None and isinstance(file, (str, os.PathLike))):
        try:
            path = os.path.abspath(os.fspath(file))
        except (TypeError, ValueError):
            path = ""
        data = _served.get(path)
        if data is not None:
            _used[path] = _used.get(path, 0) + 1
            return FastFile(data, os.fspath(file))
    return _outer_open(file, mode, buffering, encoding, errors, newline, closefd, opener)


@contextmanager
def batch_scope(dataset: Any, indices: list[int]) -> Iterator[int]:
    """While the worker loads these samples, opens of their served files get the daemon's
    bytes; yields how many files were served (0: everything goes through the mount)."""
    global _served, _outer_open, _used
    if _served:  # a nested scope: leave the open alone
        yield 0
        return
    worker = _worker()
    paths, served = worker.resolve(dataset, indices)
    if not served:
        if paths:
            worker.release(dataset, paths, served, {})
        yield 0
        return
    _outer_open = builtins.open
    _served, _used = served, {}
    builtins.open = io.open = _hooked_open
    try:
        yield len(served)
    finally:
        if builtins.open is _hooked_open:
            builtins.open = io.open = _outer_open
        used = _used
        _served, _used, _outer_open = {}, {}, None
        worker.release(dataset, paths, served, used)


# -- the worker's fetcher -----------------------------------------------------------------

_original_fetch: Any = None


def _fetch(self: Any, possibly_batched_index: Any) -> Any:
    from torch.utils.data import get_worker_info

    if get_worker_info() is None or not enabled():
        return _original_fetch(self, possibly_batched_index)
    owns = _owns_batches(self.dataset)
    if owns == _CONCAT and self.auto_collation:
        # ConcatDataset has no __getitems__: torch would load its samples one by one (a store
        # round trip and a scope each); its parts get their share of the batch at once.
        return self.collate_fn(_concat_items(self.dataset, list(possibly_batched_index)))
    if owns:
        return _original_fetch(self, possibly_batched_index)  # (a CachedDataset scopes its own misses)
    indices = list(possibly_batched_index) if self.auto_collation else [possibly_batched_index]
    with batch_scope(self.dataset, indices):
        return _original_fetch(self, possibly_batched_index)


_CONCAT = 2  # _owns_batches: a ConcatDataset whose parts all load their batches in two steps


def _owns_batches(dataset: Any) -> int:
    """Whether a dataset scopes its own batches (``cube_torch_own_batches``: a CachedDataset),
    itself or under ``Subset``s (whose ``__getitems__`` hands it the whole batch at once): 1;
    a ``ConcatDataset`` (nested, under Subsets too) whose parts all are CachedDatasets
    (``cube_torch_load_many``, under Subsets): ``_CONCAT``; else 0.  Other wrappers load
    sample by sample: the fetcher serves their batches (the files of every sample, which a
    CachedDataset's hits would not read)."""
    from torch.utils.data import ConcatDataset, Subset

    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if isinstance(dataset, ConcatDataset):
        return _CONCAT if dataset.datasets and all(_two_step(d) for d in dataset.datasets) else 0
    return int(bool(getattr(dataset, "cube_torch_own_batches", False)))


def _two_step(dataset: Any) -> bool:
    from torch.utils.data import ConcatDataset, Subset

    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if isinstance(dataset, ConcatDataset):
        return bool(dataset.datasets) and all(_two_step(d) for d in dataset.datasets)
    return callable(getattr(dataset, "cube_torch_load_many", None)) and callable(getattr(dataset, "cube_torch_finish", None))


def _concat_items(dataset: Any, indices: list[Any]) -> list[Any]:
    """``[dataset[i] for i in indices]`` for a ConcatDataset of CachedDatasets (see
    _owns_batches): each part's samples loaded in one call, then finished (its transform)
    in the batch's order, as torch's sample-by-sample loading would."""
    loaded: list[tuple[Any, Any]] = [(None, None)] * len(indices)
    _load_parts(dataset, list(range(len(indices))), indices, loaded)
    return [part.cube_torch_finish(sample) for part, sample in loaded]


def _load_parts(dataset: Any, positions: list[int], indices: list[Any], out: list[tuple[Any, Any]]) -> None:
    from torch.utils.data import ConcatDataset, Subset

    while isinstance(dataset, Subset):
        indices = [dataset.indices[int(i)] for i in indices]
        dataset = dataset.dataset
    if not isinstance(dataset, ConcatDataset):
        for position, sample in zip(positions, dataset.cube_torch_load_many(indices)):
            out[position] = (dataset, sample)
        return
    n = len(dataset)
    wanted: dict[int, tuple[list[int], list[int]]] = {}  # part -> (positions in the batch, its indices)
    for position, index in zip(positions, indices):
        i = int(index)
        if i < 0:
            if -i > n:
                raise ValueError("absolute value of index should not exceed dataset length")  # ConcatDataset's own
            i += n
        part = bisect.bisect_right(dataset.cumulative_sizes, i)
        slot = wanted.setdefault(part, ([], []))
        slot[0].append(position)
        slot[1].append(i - (dataset.cumulative_sizes[part - 1] if part else 0))
    for part, (where, local) in wanted.items():
        _load_parts(dataset.datasets[part], where, local, out)


def own_batch_scope(dataset: Any, indices: list[int]) -> AbstractContextManager[int]:
    """The batch scope of a dataset that loads only some of a batch's samples itself (a
    CachedDataset: its misses), for those samples; nothing outside a patched worker."""
    from torch.utils.data import get_worker_info

    if _original_fetch is None or get_worker_info() is None or not enabled():
        return nullcontext(0)
    return batch_scope(dataset, indices)


def install() -> None:
    """Wrap torch's map-style fetcher (what every worker calls once per batch), and map the
    page :func:`publish` writes (in the installing process, before any worker forks)."""
    global _original_fetch, _published, _main_pid
    from torch.utils.data._utils import fetch

    if _published is None:
        _published = mmap.mmap(-1, mmap.PAGESIZE)  # MAP_SHARED | MAP_ANONYMOUS: shared with forked children
        _main_pid = os.getpid()

    if _original_fetch is None:
        _original_fetch = fetch._MapDatasetFetcher.fetch
        fetch._MapDatasetFetcher.fetch = _fetch  # type: ignore[method-assign]


def uninstall() -> None:
    global _original_fetch
    from torch.utils.data._utils import fetch

    if _original_fetch is not None:
        fetch._MapDatasetFetcher.fetch = _original_fetch  # type: ignore[method-assign]
        _original_fetch = None
