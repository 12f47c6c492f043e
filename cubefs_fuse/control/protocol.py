"""The ai_prefetch wire protocol, shared by the daemon and cube_torch, which imports it
inside training processes, so it uses only the standard library and xxhash (never trio,
the FUSE session or numpy): the per-volume config file ``<configDir>/cube_torch.config.<volName>``
(CubeFS's fields ``prof``, ``mount_point``, ``vol_name``, ``local_ip``, then ours), the
control API client (HTTP/1.1 over a Unix socket, ``/v1`` paths, JSON errors; file lists
NUL-separated, epoch orders little-endian integer arrays, never JSON lists), the request
bounds, the rule of a sample cache's name and the sample entries' checksum
(``entry_digest``)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlencode

# Request bounds and the rule of a sample cache's name, enforced by the daemon and known to
# clients (standard library only too; defined in limits.py, below the daemon's floors).
from cubefs_fuse.limits import FAST_RING_BYTES as FAST_RING_BYTES
from cubefs_fuse.limits import MAX_BATCH_FILES as MAX_BATCH_FILES
from cubefs_fuse.limits import MAX_BATCH_MESSAGE as MAX_BATCH_MESSAGE
from cubefs_fuse.limits import MAX_DATASET_BODY as MAX_DATASET_BODY
from cubefs_fuse.limits import MAX_DATASET_FILES as MAX_DATASET_FILES
from cubefs_fuse.limits import MAX_JSON_BODY as MAX_JSON_BODY
from cubefs_fuse.limits import MAX_NAME as MAX_NAME
from cubefs_fuse.limits import MAX_PATH_BYTES as MAX_PATH_BYTES
from cubefs_fuse.limits import MAX_PLAN_BODY as MAX_PLAN_BODY
from cubefs_fuse.limits import PLAN_DTYPES as PLAN_DTYPES
from cubefs_fuse.limits import SAMPLE_NAME_RULE as SAMPLE_NAME_RULE
from cubefs_fuse.limits import MAX_SAMPLE_ENTRY_BYTES as MAX_SAMPLE_ENTRY_BYTES
from cubefs_fuse.limits import MAX_SAMPLE_KEYS as MAX_SAMPLE_KEYS
from cubefs_fuse.limits import MAX_SAMPLE_PLAN_KEYS as MAX_SAMPLE_PLAN_KEYS
from cubefs_fuse.limits import is_sample_cache_name as is_sample_cache_name
from cubefs_fuse.limits import sample_cache_reference as sample_cache_reference
from cubefs_fuse.samples.checksum import entry_digest as entry_digest

PROTOCOL_VERSION = 1
CONFIG_FILE_PREFIX = "cube_torch.config."
DEFAULT_CONFIG_DIR = "/tmp"
# Where training processes look instead of DEFAULT_CONFIG_DIR (a pod that runs as a
# non-root user and keeps its own /tmp); the daemon's configDir defaults to it too.
CONFIG_DIR_ENV = "CUBE_TORCH_CONFIG_DIR"

CONTENT_JSON = "application/json"
CONTENT_BINARY = "application/octet-stream"


class ProtocolError(Exception):
    """The daemon answered with an error (``status`` is the HTTP status, 0 if unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class VolumeConfig:
    """The per-volume config file's content."""

    prof: int  # CubeFS: the profiling/control port (0 when only the socket is open)
    mount_point: str
    vol_name: str
    local_ip: str
    control_socket: str
    pid: int
    protocol_version: int = PROTOCOL_VERSION
    token_file: str = ""
    data_socket: str = ""  # the fast path's socket (control/dataplane.py); "" if none

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def default_config_dir() -> str:
    """``$CUBE_TORCH_CONFIG_DIR`` if set, else ``/tmp`` (CubeFS's place)."""
    return os.environ.get(CONFIG_DIR_ENV) or DEFAULT_CONFIG_DIR


def config_file_path(vol_name: str, config_dir: str | None = None) -> str:
    return os.path.join(config_dir or default_config_dir(), CONFIG_FILE_PREFIX + vol_name)


def read_volume_config(vol_name: str, config_dir: str | None = None) -> VolumeConfig:
    """Read and verify the per-volume config file; raises ProtocolError.

    The file must not be writable by others and must belong to root or to the current
    user: a local user must not be able to point training at a fake daemon.
    """
    path = config_file_path(vol_name, config_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ProtocolError(0, f"no daemon for volume {vol_name!r}: cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(0, f"{path} is not a regular file")
        if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
            raise ProtocolError(0, f"{path} is writable by group or others: refusing it")
        if st.st_nlink != 1:  # a hard link someone else made to a file of ours or root's
            raise ProtocolError(0, f"{path} has {st.st_nlink} links: refusing it")
        if st.st_uid not in (0, os.geteuid()):
            raise ProtocolError(0, f"{path} is owned by uid {st.st_uid}, not root or us: refusing it")
        raw = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
        config = VolumeConfig(**{k: data[k] for k in VolumeConfig.__dataclass_fields__ if k in data})
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise ProtocolError(0, f"{path} is not a valid volume config: {exc!r}") from None
    if config.vol_name != vol_name:  # e.g. a link to another volume's file: not ours to trust
        raise ProtocolError(0, f"{path} names volume {config.vol_name!r}, not {vol_name!r}: refusing it")
    if config.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(0, f"daemon speaks protocol {config.protocol_version}, we speak {PROTOCOL_VERSION}")
    return config


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        # A Unix connect() with a timeout fails at once with EAGAIN while the daemon's listen
        # backlog is full (a burst, or another user flooding it) instead of waiting: retry
        # until the timeout, backing off from 1 ms to 50 ms.
        deadline = time.monotonic() + (self.timeout if self.timeout is not None else 5.0)
        pause = 0.001
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.socket_path)
            except BlockingIOError:
                sock.close()
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            return


class ControlClient:
    """A blocking client of the control API (one short connection per request)."""

    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def request(self, method: str, path: str, *, query: dict[str, Any] | None = None,
                body: bytes | None = None, content_type: str = CONTENT_JSON) -> Any:
        url = f"/v1/{path}" + (f"?{urlencode(query)}" if query else "")
        conn = _UnixConnection(self.socket_path, self.timeout)
        try:
            headers = {"Content-Type": content_type} if body is not None else {}
            try:
                conn.request(method, url, body=body, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused (e.g. 403) after the headers, before the body: its answer is readable
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:  # unreachable, or not speaking HTTP
            raise ProtocolError(0, f"control socket {self.socket_path}: {exc}") from None
        finally:
            conn.close()
        try:
            data = json.loads(payload) if payload else {}
        except ValueError:
            raise ProtocolError(response.status, f"non-JSON answer: {payload[:200]!r}") from None
        if response.status >= 400:
            raise ProtocolError(response.status, str(data.get("error", data)))
        return data

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "status")
        return result

    def register_dataset(self, paths: list[str], columns: int = 1) -> str:
        """Register a file list (relative paths; ``columns`` files per sample); returns its id."""
        body = b"\0".join(p.encode("utf-8", "surrogateescape") for p in paths)
        result = self.request("POST", "datasets", query={"columns": columns}, body=body,
                              content_type=CONTENT_BINARY)
        return str(result["dataset"])

    def register_job(self, job: str, rank: int, pid: int | None = None) -> dict[str, Any]:
        """Register (job, rank); without ``pid`` the daemon takes the caller's (SO_PEERCRED)."""
        fields: dict[str, Any] = {"job": job, "rank": rank}
        if pid is not None:
            fields["pid"] = pid
        result: dict[str, Any] = self.request("POST", "jobs", body=json.dumps(fields).encode())
        return result

    def report_reads(self, job: str, rank: int, files: int,
                     data_wait: dict[str, float | int] | None = None) -> dict[str, Any]:
        """Tell the daemon that (job, rank)'s loaders have read ``files`` files so far, and
        (``data_wait``: steps, wait_seconds, step_seconds, p50_seconds, p99_seconds, all
        cumulative) how long its steps waited for their batches; the answer is the job's
        counters.  Only the job's own processes may."""
        fields: dict[str, Any] = {"job": job, "rank": rank, "files": files}
        if data_wait is not None:
            fields["data_wait"] = data_wait
        body = json.dumps(fields).encode()
        result: dict[str, Any] = self.request("POST", "jobs/reads", body=body)
        return result

    def submit_plan(self, job: str, rank: int, epoch: int, dataset: str, order: bytes, dtype: str,
                    loader: str | None = None, first: int = 0) -> dict[str, Any]:
        """Submit an epoch's sample order: ``order`` is a little-endian array of ``dtype``.
        ``loader`` names the DataLoader of (job, rank) it is for (each keeps its own plan;
        None: the daemon's default loader "0").  ``first``: the answer waits (bounded)
        until that many first positions are cached."""
        query: dict[str, Any] = {"job": job, "rank": rank, "epoch": epoch, "dataset": dataset, "dtype": dtype}
        if loader is not None:
            query["loader"] = loader
        if first:
            query["first"] = first
        result: dict[str, Any] = self.request("POST", "plans", query=query, body=order, content_type=CONTENT_BINARY)
        return result

    def stats(self, job: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "stats", query={"job": job} if job else None)
        return result
